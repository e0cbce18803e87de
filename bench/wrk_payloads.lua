-- wrk script for bench/wrk.py: POST the bodies listed in an index file (one line per body,
-- "<content type>\t<file>") in turn, like `python -m loadtest`, and print wrk's summary as
-- one JSON line. Usage: wrk -t1 -cN -dS -s bench/wrk_payloads.lua URL -- INDEX
local requests, count, last = {}, 0, 0

function init(args)
  for line in io.lines(args[1]) do
    local content_type, path = line:match("^([^\t]*)\t(.*)$")
    local file = assert(io.open(path, "rb"))
    count = count + 1
    requests[count] = wrk.format("POST", nil, { ["Content-Type"] = content_type }, file:read("*a"))
    file:close()
  end
end

function request()
  last = last % count + 1
  return requests[last]
end

function done(summary, latency)
  local errors = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "errors": {"connect": %d, "read": %d, "write": %d, '
      .. '"status": %d, "timeout": %d}, "p50_ms": %.3f, "p99_ms": %.3f}\n',
    summary.requests, summary.duration, errors.connect, errors.read, errors.write,
    errors.status, errors.timeout, latency:percentile(50) / 1000, latency:percentile(99) / 1000
  ))
end
