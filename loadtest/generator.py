"""Load generation: closed-loop workers (fixed concurrency) and open-loop Poisson arrivals.

Requests are whole pre-built byte strings (loadtest.inputs, loadtest.client), replayed over
keep-alive connections, so the client spends 25–110 µs of CPU per request on the two
cores it shares with the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import httptools

from loadtest.client import Pool, request_bytes
from loadtest.inputs import Payload
from loadtest.stats import Outcome, Recorder

REFUSALS = (429, 503)
# A closed-loop client whose connection failed waits this long before its next request, as
# clients do: against a server that is down it would otherwise spin through some 15 000 refused
# connections a second on the cores it shares.
CONNECT_RETRY_S = 0.1


@dataclass(frozen=True, slots=True)
class Request:
    data: bytes  # the request as sent: head and body
    rows: int


def post_requests(url: str, payloads: Sequence[Payload], headers: Mapping[str, str] | None = None) -> list[Request]:
    return [Request(request_bytes(url, "POST", p.body, p.content_type, headers), p.rows) for p in payloads]


async def send(
    pool: Pool, request: Request, recorder: Recorder, since: float, *, connect_retry_s: float = 0.0
) -> float | None:
    """One request; latency runs from `since` (the send time, or the scheduled arrival in open loop).
    Returns the seconds a refusal (429, 503) asked the client to wait, if it was one. After a
    failure to connect or to read an answer it waits `connect_retry_s`, once recorded."""
    wait, held, refusal, server_ms = None, False, None, None
    try:
        response = await pool.request(request.data)
        status, server_ms = str(response.status), response.server_ms
        if response.status in REFUSALS:
            wait, held = retry_after_s(response.retry_after), response.held
            refusal = response.error_type
    except TimeoutError:
        status = "timeout"
    except (OSError, httptools.HttpParserError) as exc:
        status = type(exc).__name__
    finished = time.perf_counter()
    latency = finished - since
    outcome = Outcome(finished, latency, status, request.rows, held=held, refusal=refusal, server_ms=server_ms)
    recorder.add(outcome)
    if not status.isdigit() and status != "timeout":
        await asyncio.sleep(connect_retry_s)
    return wait


def with_request_id(request: Request, request_id: str) -> Request:
    """`request` carrying `X-Request-ID: request_id`, a header inserted after its request line."""
    line_end = request.data.index(b"\r\n") + 2
    header = f"X-Request-ID: {request_id}\r\n".encode("latin-1")
    return Request(request.data[:line_end] + header + request.data[line_end:], request.rows)


def retry_after_s(value: str | None) -> float:
    """Retry-After in seconds (RFC 9110: whole seconds; a date or junk counts as 1 s)."""
    return float(value) if value is not None and value.isdigit() else 1.0


async def closed_loop(
    pool: Pool,
    requests: Sequence[Request],
    *,
    concurrency: int,
    stop: asyncio.Event,
    recorder: Recorder,
    honour_retry_after: bool = False,
    retry_jitter_s: float = 0.0,
) -> None:
    """`concurrency` workers, each sending its next request as soon as the last one answered, or,
    `honour_retry_after`, as SDKs retry: a refused request again, with the same `X-Request-ID`,
    once its Retry-After has passed (or the load stops), plus a random wait of up to
    `retry_jitter_s`, as SDKs' retry policies add jitter. Without it, clients refused together
    come back together, Retry-After being whole seconds, and queue behind one another."""
    order = itertools.cycle(requests)
    ids = (f"{secrets.token_hex(4)}-{n}" for n in itertools.count())

    async def worker() -> None:
        while not stop.is_set():
            request = with_request_id(next(order), next(ids)) if honour_retry_after else next(order)
            wait = await send(pool, request, recorder, time.perf_counter(), connect_retry_s=CONNECT_RETRY_S)
            while wait is not None and honour_retry_after and not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait + random.uniform(0.0, retry_jitter_s))
                if not stop.is_set():
                    wait = await send(pool, request, recorder, time.perf_counter(), connect_retry_s=CONNECT_RETRY_S)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def open_loop(
    pool: Pool,
    requests: Sequence[Request],
    *,
    rate: float,
    stop: asyncio.Event,
    recorder: Recorder,
    max_outstanding: int,
    seed: int = 0,
) -> None:
    """Poisson arrivals at `rate`/s regardless of answers; latency counts from the scheduled
    arrival, so a late client or a slow server cannot hide queueing (no coordinated omission).
    Arrivals beyond `max_outstanding` in flight are recorded as 'client_backlog' failures.
    The next arrival is one timer on the loop: no task per wait, nothing left to wake after `stop`.
    A late loop (a stall, a busy host) sends every arrival already due at once, and arrivals due by
    the time the generator sees `stop` are sent too, so a stall never shortens the load."""
    loop = asyncio.get_running_loop()
    draw = random.Random(seed).expovariate
    order = itertools.cycle(requests)
    in_flight: set[asyncio.Task[None]] = set()
    next_arrival = time.perf_counter() + draw(rate)

    def dispatch(arrival: float) -> None:
        if len(in_flight) >= max_outstanding:
            now = time.perf_counter()
            recorder.add(Outcome(finished=now, latency=now - arrival, status="client_backlog"))
            return
        task = loop.create_task(send(pool, next(order), recorder, arrival))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)

    def send_due() -> float:
        """Dispatch every arrival due by now; the seconds until the next one."""
        nonlocal next_arrival
        now = time.perf_counter()
        while next_arrival <= now:
            dispatch(next_arrival)
            next_arrival += draw(rate)
        return next_arrival - now

    def tick() -> None:
        nonlocal timer
        timer = loop.call_later(send_due(), tick)

    timer = loop.call_later(send_due(), tick)
    await stop.wait()
    timer.cancel()
    send_due()
    await asyncio.gather(*in_flight)  # cancelled, it cancels them too
