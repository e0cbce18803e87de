"""The load tester: its arithmetic as pure functions, its HTTP client and load loops against a
tiny real server (`tiny_server`), and short real sweeps against the running service (the
`server` fixture), including the service's queue, inference and batch-rows metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvloop
from tiny_http import directives

from bench.processes import free_port
from loadtest.__main__ import main as loadtest_main
from loadtest.capacity import Point, capacity_plan, find_knee
from loadtest.client import Pool, fetch, request_bytes
from loadtest.generator import CONNECT_RETRY_S, closed_loop, open_loop, post_requests, send
from loadtest.inputs import image_payloads, sample_photo_files, text_payloads
from loadtest.server_metrics import INFERENCE, QUEUE, RESIDENT, ROWS, breakdown, endpoint_label, parse
from loadtest.stats import Outcome, Recorder, is_stable, percentile, summarize
from loadtest.sweep import SweepSettings, run_sweep
from sample_inputs import sample_texts

REPO = Path(__file__).resolve().parent.parent


def test_capacity_plan_takes_headroom_off_each_replica() -> None:
    plan = capacity_plan(target_qps=100, knee_qps=30, headroom=0.25)
    assert plan.planned_per_replica_qps == pytest.approx(22.5)
    assert plan.replicas == 5  # 100 / 22.5 = 4.44 → 5
    assert plan.utilization == pytest.approx(100 / 150)
    exact = capacity_plan(target_qps=90, knee_qps=30, headroom=0.0)
    assert exact.replicas == 3 and exact.utilization == pytest.approx(1.0)
    assert capacity_plan(target_qps=1, knee_qps=1000, headroom=0.5).replicas == 1
    assert plan.fleet_mib is None  # the server did not say what a replica holds
    assert capacity_plan(target_qps=100, knee_qps=30, headroom=0.25, replica_mib=700).fleet_mib == 5 * 700
    for bad in ({"target_qps": 0, "knee_qps": 1, "headroom": 0}, {"target_qps": 1, "knee_qps": 1, "headroom": 1}):
        with pytest.raises(ValueError):
            capacity_plan(**bad)


def test_knee_is_the_best_throughput_within_the_slo_and_error_free() -> None:
    points = [
        Point(level=1, throughput=10, p99_ms=50, error_rate=0),
        Point(level=4, throughput=30, p99_ms=180, error_rate=0),
        Point(level=8, throughput=35, p99_ms=260, error_rate=0.02),  # errors disqualify
        Point(level=16, throughput=40, p99_ms=900, error_rate=0),  # past the SLO
    ]
    knee = find_knee(points, slo_ms=300)
    assert (knee.level, knee.throughput, knee.p99_ms) == (4, 30, 180)
    assert find_knee(points, slo_ms=300, max_error_rate=0.05).level == 8
    assert find_knee(points, slo_ms=10) is None


def test_the_knees_plateau_runs_from_the_lowest_to_the_highest_level_within_noise_of_its_throughput() -> None:
    """A flat curve's best level is noise; its plateau ends where the SLO does."""
    flat = [
        Point(level=c, throughput=t, p99_ms=c * 8, error_rate=0)
        for c, t in [(1, 142), (2, 174), (4, 172), (8, 180), (16, 185), (32, 186), (64, 197)]
    ]
    knee = find_knee(flat, slo_ms=1000)
    assert (knee.level, knee.throughput, knee.saturated_at, knee.plateau_end) == (64, 197, 64, 64)  # 186: 5.6 % short
    knee = find_knee([*flat[:-1], Point(level=64, throughput=190, p99_ms=512, error_rate=0)], slo_ms=1000)
    assert (knee.level, knee.saturated_at, knee.plateau_end) == (64, 16, 64)
    knee = find_knee([*flat, Point(level=128, throughput=199, p99_ms=1024, error_rate=0)], slo_ms=1000)
    assert (knee.level, knee.saturated_at, knee.plateau_end) == (64, 64, 64)  # 128 clients: past the SLO
    peaked = [*flat[:4], Point(level=16, throughput=200, p99_ms=80, error_rate=0), Point(64, 150, 400, 0)]
    assert find_knee(peaked, slo_ms=1000).plateau_end == 16  # beyond the peak, throughput fell
    steep = [Point(level=c, throughput=10 * c, p99_ms=50, error_rate=0) for c in (1, 2, 4)]
    assert (find_knee(steep, slo_ms=1000).saturated_at, find_knee(steep, slo_ms=1000).plateau_end) == (4, 4)


def test_percentiles_are_observed_values_and_summaries_add_up() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([1, 2, 3, 4], 99) == 4 and percentile([7], 90) == 7
    recorder = Recorder()
    for i in range(100):
        recorder.add(Outcome(finished=i / 100, latency=(i + 1) / 1000, status="200", rows=2))
    recorder.add(Outcome(finished=0.5, latency=0.001, status="503"))
    recorder.add(Outcome(finished=0.6, latency=0.0, status="timeout"))
    window = summarize(recorder.between(0, 1), 1.0)
    assert (window.completed, window.ok, window.errors) == (102, 100, {"503": 1, "timeout": 1})
    assert window.throughput == 100 and window.rows_per_s == 200
    latency = window.latency_ms
    assert latency.p50 == pytest.approx(50) and latency.p99 == pytest.approx(99) and latency.max == pytest.approx(100)
    assert len(recorder.between(0.25, 0.5)) == 25


def test_stability_needs_three_windows_within_tolerance() -> None:
    def window(throughput: float, mean_ms: float):
        return summarize([Outcome(0, mean_ms / 1000, "200")] * int(throughput), 1.0)

    steady = [window(100, 50), window(104, 52), window(97, 49)]
    assert is_stable(steady)
    assert not is_stable(steady[:2])
    assert not is_stable([*steady[:2], window(80, 50)])
    assert not is_stable([*steady[:2], window(100, 70)])


def test_breakdown_is_the_mean_between_two_scrapes() -> None:
    def page(queue: tuple[float, int], inference: tuple[float, int], rows: tuple[float, int]) -> str:
        lines = []
        for name, (total, count) in ((QUEUE, queue), (INFERENCE, inference), (ROWS, rows)):
            labels = '{endpoint="classify",model="m:1"}'
            lines += [f"# TYPE {name} histogram", f"{name}_sum{labels} {total}", f"{name}_count{labels} {count}"]
        return "\n".join(lines) + "\n"

    before = parse(page((1.0, 10), (2.0, 5), (10, 5)))
    after = parse(page((1.5, 20), (2.4, 9), (22, 9)))
    found = breakdown(before, after, path="/classify_batch")
    assert found.queue_ms == pytest.approx(50) and found.inference_ms == pytest.approx(100)
    assert found.batch_rows == pytest.approx(3) and found.batches == 4 and found.model_requests == 10
    assert found.workers_mib is None  # a server that does not say
    # The workers' memory is a gauge: as it stands at the span's end.
    memory = f"# TYPE {RESIDENT} gauge\n{RESIDENT} {700 * 2**20}\n"
    assert breakdown(before, parse(page((1.5, 20), (2.4, 9), (22, 9)) + memory), path="/classify").workers_mib == 700
    assert breakdown({}, {}, path="/classify") is None
    assert endpoint_label("/embed", before) == "embed" and endpoint_label("/v1/classify_batch/", before) == "classify"


def test_a_models_own_path_is_read_from_its_own_series_or_its_default_routes() -> None:
    """/models/<name>/… feeds the route <name> when the model has one of its own; a default
    endpoint's model shares that endpoint's route (and series) at its own path."""
    page = "".join(
        f"# TYPE {INFERENCE} histogram\n"
        f'{INFERENCE}_sum{{endpoint="{endpoint}",model="{endpoint}:1"}} {total}\n'
        f'{INFERENCE}_count{{endpoint="{endpoint}",model="{endpoint}:1"}} {count}\n'
        for endpoint, total, count in (("classify", 5.0, 100), ("digits", 0.1, 100))
    )
    exported = parse(page)
    assert endpoint_label("/models/digits/classify", exported) == "digits"
    assert endpoint_label("/models/image-classifier/classify_batch", exported) == "classify"
    assert breakdown({}, exported, path="/models/digits/classify").inference_ms == pytest.approx(1.0)


def test_sweep_counts_statuses_and_latencies_on_kept_alive_connections(tiny_server) -> None:
    payloads = [directives(sleep=0.02), directives(status=503), directives(status=404, chunked=True)]
    settings = SweepSettings(
        url=f"{tiny_server.url}/any",
        levels=(3,),
        warmup_s=0.2,
        window_s=0.5,
        stable_windows=2,
        max_windows=2,
        metrics_url="",
    )
    (level,) = run_sweep(settings, payloads, {"kind": "test"}).levels
    check_level(dataclasses.asdict(level), stable_windows=2)
    result = level.result
    assert set(result.errors) == {"404", "503"}
    # The bodies go out in turn, so each kind is a third of the answers, give or take those in flight.
    assert all(abs(count - result.ok) <= 3 for count in result.errors.values())
    assert result.ok > 10 and 20 <= result.latency_ms.p50 < 200, "successes are the ones that sleep 20 ms"
    assert len(tiny_server.connections) == 3, "three workers, each on one kept-alive connection"


async def _refuse_unread_or_read(scope, receive, send) -> None:
    """An ASGI app: /read reads the body (uvicorn then answers 100 Continue) and says its length;
    any other path is refused without reading it, as optiserve's door refuses."""
    body, more = b"", scope["path"] == "/read"
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    answer = str(len(body)).encode()
    head = [(b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200 if scope["path"] == "/read" else 503, "headers": head})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture()
def uvicorn_url() -> Iterator[str]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(_refuse_unread_or_read, port=free_port(), lifespan="off", log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join()


@pytest.mark.parametrize("expect", [{"Expect": "100-continue"}, {"expect": "100-Continue"}], ids=["curl", "lower"])
def test_a_request_expecting_100_continue_sends_its_body_only_when_the_server_asks(
    uvicorn_url: str, expect: dict[str, str]
) -> None:
    """As curl sends a body over 1 MB: refused unread, the request is answered at once and its
    body never sent (its connection is not reused); read, it is sent on the server's 100 Continue.
    The header's name and its token are case-insensitive, as HTTP has them."""
    body = b"x" * 2_000_000

    async def scenario() -> tuple[float, list, float, list, int]:
        pool = Pool(uvicorn_url, timeout=10)
        started = time.monotonic()
        refused = await pool.request(request_bytes(f"{uvicorn_url}/refuse", "POST", body, "image/jpeg", expect))
        refused_s, idle_after_refusal = time.monotonic() - started, list(pool.idle)
        started = time.monotonic()
        read = await pool.request(request_bytes(f"{uvicorn_url}/read", "POST", body, "image/jpeg", expect))
        read_s = time.monotonic() - started
        pool.close()
        return refused_s, [refused.status, refused.body], read_s, [read.status, read.body], len(idle_after_refusal)

    refused_s, refused, read_s, read, idle_after_refusal = uvloop.run(scenario())

    assert refused == [503, b"0"] and idle_after_refusal == 0
    assert read == [200, str(len(body)).encode()]
    assert refused_s < 0.5 and read_s < 0.5  # neither waited out the client's 1 s patience


def test_pool_reuses_connections_and_replaces_closed_or_timed_out_ones(tiny_server) -> None:
    url = f"{tiny_server.url}/pool"

    def post(**fields: object) -> bytes:
        return request_bytes(url, "POST", json.dumps(fields).encode(), "application/json")

    async def exchange() -> list:
        pool = Pool(url, timeout=0.3)
        answers = [await pool.request(post(n=n)) for n in range(4)]
        answers.append(await pool.request(post(chunked=True, pad="x" * 1000)))
        answers.append(await pool.request(post(close=True)))  # the server closes after answering
        answers.append(await pool.request(post(status=201)))  # so this one needs a new connection
        with pytest.raises(TimeoutError):
            await pool.request(post(sleep=1))
        answers.append(await pool.request(post(status=202)))  # its own answer, never the late one
        pool.close()
        return answers

    answers = uvloop.run(exchange())
    assert [a.status for a in answers] == [200] * 6 + [201, 202]
    assert answers[0].body == b'{"n": 0}'
    assert answers[4].body == json.dumps({"chunked": True, "pad": "x" * 1000}).encode(), "chunks joined"
    assert len(tiny_server.connections) == 3, "one until the server closed it, one until the timeout, one after"
    assert uvloop.run(fetch(f"{tiny_server.url}/metrics", timeout=5))[:2] == (200, b"# GET /metrics\n")


def test_pool_opens_a_new_connection_rather_than_reuse_one_idle_near_the_servers_keepalive(tiny_server) -> None:
    async def exchange() -> list[int]:
        pool = Pool(f"{tiny_server.url}/pool", timeout=5, keepalive_s=0.2)
        statuses = [(await pool.request(request_bytes(tiny_server.url))).status for _ in range(2)]
        await asyncio.sleep(0.3)
        statuses.append((await pool.request(request_bytes(tiny_server.url))).status)
        pool.close()
        return statuses

    assert uvloop.run(exchange()) == [200] * 3
    assert len(tiny_server.connections) == 2, "reused while fresh, replaced once idle past keepalive_s"


def test_requests_carry_the_headers_asked_for_on_every_replay() -> None:
    (request,) = post_requests("http://h:1/embed", [directives()], {"X-Deadline-Ms": "50"})
    head, _, body = request.data.partition(b"\r\n\r\n")

    assert head.split(b"\r\n")[0] == b"POST /embed HTTP/1.1"
    assert b"\r\nX-Deadline-Ms: 50" in head and int(head.split(b"Content-Length: ")[1]) == len(body)


def refused_for(url: str, seconds: float, **closed_loop_options) -> Recorder:
    """A closed loop of `closed_loop_options` for `seconds` against `url`, which answers every
    request 503 with Retry-After: 1."""
    requests = post_requests(url, [directives(status=503, retry_after="1")])
    recorder = Recorder()

    async def load() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds, stop.set)
        await closed_loop(Pool(url, timeout=5), requests, stop=stop, recorder=recorder, **closed_loop_options)

    uvloop.run(load())
    return recorder


@pytest.mark.parametrize(("honour", "at_most"), [(True, 4), (False, None)])
def test_a_client_honouring_retry_after_waits_before_its_next_request(tiny_server, honour, at_most) -> None:
    """Two clients for 1.5 s, every answer a 503 with Retry-After: 1; honouring it, a client
    retries the same request with the same X-Request-ID, as SDKs do."""
    recorder = refused_for(tiny_server.url + "/refuse", 1.5, concurrency=2, honour_retry_after=honour)

    statuses = {o.status for o in recorder.outcomes}
    assert statuses == {"503"}
    ids = tiny_server.request_ids
    if at_most is not None:
        assert len(recorder.outcomes) <= at_most
        assert len(set(ids)) == 2 and None not in ids, "each client retries its one request, keeping its id"
    else:
        assert len(recorder.outcomes) > 20
        assert set(ids) == {None}


def test_clients_refused_together_come_back_spread_over_their_retry_jitter(tiny_server) -> None:
    """Eight clients refused at once with Retry-After: 1 and a jitter of 0.5 s retry between 1 and
    1.5 s later, each at its own time, not all in the same instant."""
    recorder = refused_for(tiny_server.url + "/refuse", 1.8, concurrency=8, honour_retry_after=True, retry_jitter_s=0.5)

    sent = sorted(o.finished - o.latency for o in recorder.outcomes)
    first, retries = sent[:8], [t - sent[0] for t in sent[8:]]
    assert max(first) - min(first) < 0.1 and len(retries) == 8
    assert all(1.0 <= t <= 1.6 for t in retries), retries
    assert max(retries) - min(retries) > 0.05, "spread over the jitter"


def test_a_refusal_is_recorded_with_what_the_server_says_of_it(tiny_server) -> None:
    """Held or not (the door names a refusal it held `held` in Server-Timing), its error type, and
    the server's own time for it (`total`); an answer that is no refusal is read for its time alone."""
    url = tiny_server.url + "/refuse"
    answers = [
        directives(status=503, retry_after="1", server_timing="total;dur=0.2", type="overloaded"),
        directives(status=503, retry_after="1", server_timing="held;dur=880.00, total;dur=880.31"),
        directives(status=429, retry_after="1", server_timing="unheld;dur=2, total;dur=1.0", type="expired"),
        directives(status=200, server_timing="held;dur=1, total;dur=3", type="overloaded"),
    ]
    recorder = Recorder()

    async def load() -> None:
        pool = Pool(url, timeout=5)
        for request in post_requests(url, answers):
            await send(pool, request, recorder, time.perf_counter())
        pool.close()

    uvloop.run(load())

    assert [o.held for o in recorder.outcomes] == [False, True, False, False]
    assert [o.refusal for o in recorder.outcomes] == ["overloaded", None, "expired", None]
    assert [o.server_ms for o in recorder.outcomes] == [0.2, 880.31, 1.0, 3.0]


def test_failures_are_counted_by_name() -> None:
    url = f"http://127.0.0.1:{free_port()}/nothing-listens"
    recorder = Recorder()
    uvloop.run(send(Pool(url, timeout=5), post_requests(url, [directives()])[0], recorder, time.perf_counter()))
    (outcome,) = recorder.outcomes
    assert outcome.status == "ConnectionRefusedError" and not outcome.ok


def test_a_closed_loop_client_waits_after_a_failed_connection() -> None:
    """Against a server that is down, a client backs off instead of spinning on refused connects."""
    url = f"http://127.0.0.1:{free_port()}/nothing-listens"

    async def half_a_second() -> Recorder:
        pool, recorder, stop = Pool(url, timeout=5), Recorder(), asyncio.Event()
        load = asyncio.create_task(
            closed_loop(pool, post_requests(url, [directives()]), concurrency=2, stop=stop, recorder=recorder)
        )
        await asyncio.sleep(0.5)
        stop.set()
        await load
        return recorder

    statuses = [o.status for o in uvloop.run(half_a_second()).outcomes]
    assert set(statuses) == {"ConnectionRefusedError"} and 2 <= len(statuses) <= 2 * (0.5 / CONNECT_RETRY_S + 1)


def test_the_cli_fails_when_no_request_succeeded_and_checks_its_plan_before_any_load(tmp_path: Path, capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}/embed"
    quick = ["--concurrency", "1", "--warmup", "0", "--window", "0.5", "--stable-windows", "1", "--max-windows", "1"]
    assert loadtest_main([url, *quick, "--no-plots", "--out", str(tmp_path)]) == 1
    assert "no request succeeded: ConnectionRefusedError × " in capsys.readouterr().err
    assert loadtest_main([url, "--max-duration", "1", "--no-plots", "--out", str(tmp_path)]) == 1
    assert "nothing measured: time budget of 1 s spent before level 1" in capsys.readouterr().err
    for wrong, said in (
        (["--headroom", "1"], "headroom is a fraction in [0, 1), got 1"),
        (["--target-qps", "0"], "the target QPS must be positive, got 0"),
        (["--timeout", "-1"], "the request timeout must be positive, got -1 s"),
    ):
        started = time.perf_counter()
        assert loadtest_main([url, *quick, *wrong, "--out", str(tmp_path / "never")]) == 2
        assert said in capsys.readouterr().err and time.perf_counter() - started < 1
    assert not (tmp_path / "never").exists()


def open_loop_run(
    url: str,
    *,
    rate: float,
    seconds: float,
    max_outstanding: int = 100,
    sleep: float = 0,
    stall_at: float = 0,
    stall_s: float = 0.3,
) -> tuple[Recorder, float]:
    """`seconds` of Poisson arrivals, each answered after `sleep`; with `stall_at`, the client
    blocks its own loop for `stall_s` at that time. Returns the outcomes and how long the load ran
    (a busy host can stretch the stall and, with it, the run)."""
    requests = post_requests(url, [directives(sleep=sleep)])

    async def load() -> tuple[Recorder, float]:
        pool, recorder, stop = Pool(url, timeout=5), Recorder(), asyncio.Event()
        started = time.perf_counter()
        task = asyncio.create_task(
            open_loop(pool, requests, rate=rate, stop=stop, recorder=recorder, max_outstanding=max_outstanding)
        )
        if stall_at:
            await asyncio.sleep(stall_at)
            time.sleep(stall_s)  # a late client: every arrival due meanwhile goes out late
        await asyncio.sleep(max(0.0, started + seconds - time.perf_counter()))
        stop.set()
        ran = time.perf_counter() - started
        await task
        pool.close()
        return recorder, ran

    return uvloop.run(load())


def test_open_loop_latency_counts_from_the_scheduled_arrival(tiny_server) -> None:
    recorder, ran = open_loop_run(f"{tiny_server.url}/open", rate=200, seconds=1.5, stall_at=0.5)
    outcomes = recorder.outcomes
    assert all(o.ok for o in outcomes)
    expected = 200 * ran  # about 300; Poisson's spread is about ±17
    assert 0.8 * expected <= len(outcomes) <= 1.2 * expected, "the arrivals due in the stall are sent, not skipped"
    latencies = sorted(o.latency for o in outcomes)
    assert latencies[len(latencies) // 2] < 0.05
    assert latencies[-1] >= 0.25, "an arrival at the start of the stall waited for all of it"
    assert sum(latency > 0.1 for latency in latencies) >= 20  # about 200/s × 0.2 s


def test_open_loop_sends_the_arrivals_due_in_a_stall_that_outlasts_the_load(tiny_server) -> None:
    recorder, ran = open_loop_run(f"{tiny_server.url}/open", rate=200, seconds=0.6, stall_at=0.2, stall_s=0.6)
    assert ran >= 0.8
    assert len(recorder.outcomes) >= 0.8 * 200 * ran, "arrivals due before the stop are sent, however late"
    assert sum(o.latency >= 0.3 for o in recorder.outcomes) >= 40


def test_open_loop_counts_arrivals_beyond_the_outstanding_cap(tiny_server) -> None:
    outcomes = open_loop_run(f"{tiny_server.url}/slow", rate=100, seconds=0.4, max_outstanding=5, sleep=0.5)[0].outcomes
    statuses = [o.status for o in outcomes]
    assert statuses.count("200") == 5 and statuses.count("client_backlog") >= 20
    assert len(tiny_server.requests) == 5


def check_level(level: dict, stable_windows: int) -> None:
    """Counts add up, throughput is completions over time, percentiles are ordered."""
    result, windows = level["result"], level["windows"]
    assert result["completed"] == result["ok"] + sum(result["errors"].values())
    assert result["throughput"] == pytest.approx(result["ok"] / result["duration_s"])
    pooled = windows[-min(stable_windows, len(windows)) :]
    assert result["completed"] == sum(w["completed"] for w in pooled)
    assert result["duration_s"] == pytest.approx(sum(w["duration_s"] for w in pooled))
    latency = result["latency_ms"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p95"] <= latency["p99"] <= latency["max"]


@pytest.mark.slow
def test_cli_sweep_writes_consistent_json_and_plots(server, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "loadtest", f"{server.url}/classify", "--concurrency", "1,4"]
    command += ["--warmup", "0.5", "--window", "1", "--max-windows", "3", "--slo-ms", "5000"]
    command += ["--target-qps", "50", "--headroom", "0.3", "--out", str(tmp_path), "--name", "sweep"]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "knee:" in run.stdout and "capacity plan:" in run.stdout
    document = json.loads((tmp_path / "sweep.json").read_text())
    assert [level["level"] for level in document["levels"]] == [1, 4]
    for level in document["levels"]:
        check_level(level, document["settings"]["stable_windows"])
        assert level["result"]["errors"] == {}, "the service must not fail under a little concurrency"
        server_side = level["server"]
        assert server_side["inference_ms"] > 0 and server_side["queue_ms"] >= 0 and server_side["batch_rows"] >= 1
        assert server_side["model_service_ms"] is None, "the default deployment runs its models in the front"
        assert server_side["front_ms"] > server_side["inference_ms"] * 0.5
        assert server_side["workers_mib"] > 100, "a worker with both models loaded"
    knee, plan = document["knee"], document["capacity_plan"]
    at_knee = next(level for level in document["levels"] if level["level"] == knee["level"])
    assert plan["replica_mib"] == at_knee["server"]["workers_mib"]
    assert f"memory: each replica's workers held {plan['replica_mib']:.0f} MiB at the knee" in run.stdout
    assert knee["throughput"] == max(level["result"]["throughput"] for level in document["levels"])
    assert plan["replicas"] == math.ceil(50 / (knee["throughput"] * 0.7) - 1e-9)
    for plot in ("sweep-throughput.png", "sweep-p99.png"):
        assert (tmp_path / plot).read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_open_loop_multipart_batches_count_rows(server) -> None:
    payloads = image_payloads(sample_photo_files(), multipart_field="images", per_request=2)
    settings = SweepSettings(
        url=f"{server.url}/classify_batch", mode="rate", levels=(4,), warmup_s=0.5, window_s=1.0, max_windows=3
    )
    result = run_sweep(settings, payloads, {"kind": "image"})
    (level,) = result.levels
    assert level.result.errors == {} and level.result.ok > 0
    assert level.result.rows_per_s == pytest.approx(2 * level.result.throughput)
    assert level.server is not None and level.server.batch_rows >= 2


def metric_totals(client: httpx.Client, endpoint: str) -> dict[str, float]:
    snapshot = parse(client.get("/metrics").text)
    totals: dict[str, float] = {}
    for (name, labels), value in snapshot.items():
        found = dict(labels)
        if name.startswith("optiserve_") and found.get("endpoint") == endpoint:
            assert found["model"].split(":")[0] in ("image-classifier", "text-embedder")
            totals[name] = totals.get(name, 0.0) + value
    return totals


# Our batcher stamps each request's wait; BentoML's batcher (model services) exposes none publicly.
QUEUE_WAITS_MEASURED = {"server": True, "model_services_server": False}


@pytest.mark.slow
@pytest.mark.parametrize("deployment", sorted(QUEUE_WAITS_MEASURED))
@pytest.mark.parametrize("endpoint", ["classify", "embed"])
def test_queue_inference_and_row_metrics_move_under_load(request, deployment: str, endpoint: str) -> None:
    server = request.getfixturevalue(deployment)
    if endpoint == "classify":
        payloads = image_payloads(sample_photo_files(), multipart_field="images", per_request=3)
        path, rows = "/classify_batch", 3
    else:
        payloads, path, rows = text_payloads(sample_texts(16), per_request=4), "/embed", 4
    requests = 12
    with server.client() as client:
        before = metric_totals(client, endpoint)

        def send(i: int) -> int:
            payload = payloads[i % len(payloads)]
            return client.post(path, content=payload.body, headers={"content-type": payload.content_type}).status_code

        with ThreadPoolExecutor(6) as pool:
            assert set(pool.map(send, range(requests))) == {200}
        after = metric_totals(client, endpoint)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta[f"{ROWS}_sum"] == requests * rows  # rows, not requests: every row counted once
    # Requests may be split into chunks of max_batch_size rows, and chunks merged into batches.
    assert 1 <= delta[f"{ROWS}_count"] <= requests * rows
    assert delta[f"{INFERENCE}_count"] == delta[f"{ROWS}_count"] and delta[f"{INFERENCE}_sum"] > 0
    queued = delta.get(f"{QUEUE}_count", 0.0)
    assert queued >= requests if QUEUE_WAITS_MEASURED[deployment] else queued == 0
