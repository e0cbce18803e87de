"""A sweep: for each load level, warm up, then measure windows until three agree (or a bound
is hit), pooling the stable windows into the level's figures; then the knee and capacity plan.

Bounds keep every run finite: `max_windows` per level and `max_duration_s` for the sweep, and
the sweep stops one level past the SLO (nothing right of the knee changes the answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal
from urllib.parse import urlsplit

import httptools
import uvloop

from loadtest.capacity import CapacityPlan, Knee, Point, capacity_plan, find_knee
from loadtest.client import Pool, fetch, origin
from loadtest.generator import Request, closed_loop, open_loop, post_requests
from loadtest.inputs import Payload
from loadtest.server_metrics import Breakdown, Snapshot, breakdown, metrics_url, parse
from loadtest.stats import Recorder, Summary, is_stable, summarize

Mode = Literal["concurrency", "rate"]

# Up to 128 clients: a closed loop fills a server's batches only with about twice their rows in
# flight (while one batch runs, its callers' next requests are on their way), and a 64-row cap
# is common; the sweep stops one level past the SLO, so the levels a server cannot hold cost one
# level each. Stopping at 32 read a text knee of 650 req/s where 128 clients got 818 within it.
CONCURRENCY_LEVELS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class SweepSettings:
    url: str
    mode: Mode = "concurrency"
    levels: tuple[float, ...] = CONCURRENCY_LEVELS
    slo_ms: float = 500.0
    warmup_s: float = 2.0
    window_s: float = 3.0
    stable_windows: int = 3
    max_windows: int = 8
    tolerance: float = 0.10
    max_duration_s: float = 600.0
    request_timeout_s: float = 30.0
    metrics_url: str | None = None  # None: <origin>/metrics; "" turns scraping off
    stop_past_slo: bool = True
    max_error_rate: float = 0.0
    max_outstanding: int = 1024
    target_qps: float | None = None
    headroom: float = 0.3

    def __post_init__(self) -> None:
        origin(self.url)  # ValueError unless an http(s) URL with a host
        if self.mode not in ("concurrency", "rate"):
            raise ValueError(f"mode must be 'concurrency' or 'rate', got {self.mode!r}")
        if not self.levels or any(level <= 0 for level in self.levels):
            raise ValueError(f"levels must be positive, got {self.levels}")
        if self.mode == "concurrency" and any(level != int(level) for level in self.levels):
            raise ValueError(f"concurrency levels must be whole numbers, got {self.levels}")
        if self.stable_windows < 1 or self.max_windows < self.stable_windows:
            raise ValueError("need 1 ≤ stable_windows ≤ max_windows")
        if self.window_s <= 0 or self.warmup_s < 0 or self.max_duration_s <= 0:
            raise ValueError("window and duration must be positive, warm-up not negative")
        if self.request_timeout_s <= 0:
            raise ValueError(f"the request timeout must be positive, got {self.request_timeout_s:g} s")
        if self.tolerance < 0 or not 0 <= self.max_error_rate <= 1:
            raise ValueError("the tolerance must not be negative, the error rate a fraction in [0, 1]")
        if self.target_qps is not None and self.target_qps <= 0:
            raise ValueError(f"the target QPS must be positive, got {self.target_qps:g}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom is a fraction in [0, 1), got {self.headroom:g}")

    @property
    def scrape_url(self) -> str | None:
        if self.metrics_url is not None:
            return self.metrics_url or None
        return metrics_url(self.url)

    @property
    def path(self) -> str:
        return urlsplit(self.url).path or "/"


@dataclass
class LevelResult:
    """One load level: every window, and the figures pooled over the last `stable_windows`."""

    level: float
    windows: list[Summary]
    result: Summary
    stable: bool
    server: Breakdown | None


@dataclass
class SweepResult:
    settings: SweepSettings
    inputs: dict[str, object]
    started_at: str
    levels: list[LevelResult] = field(default_factory=list)
    knee: Knee | None = None
    capacity_plan: CapacityPlan | None = None
    stopped: str = "all levels measured"


WindowCallback = Callable[[float, int, Summary], None]


async def scrape(url: str | None) -> Snapshot | None:
    if url is None:
        return None
    try:
        response = await fetch(url, timeout=10)
        return parse(response.body.decode()) if response.status == 200 else None
    except (OSError, httptools.HttpParserError, ValueError):  # TimeoutError is an OSError
        return None


async def measure_level(
    settings: SweepSettings,
    requests: Sequence[Request],
    level: float,
    on_window: WindowCallback,
    deadline: float,
) -> LevelResult:
    """Each level on connections of its own, opened by its warm-up and closed after it."""
    recorder, stop, pool = Recorder(), asyncio.Event(), Pool(settings.url, settings.request_timeout_s)
    if settings.mode == "concurrency":
        load = closed_loop(pool, requests, concurrency=int(level), stop=stop, recorder=recorder)
    else:
        load = open_loop(
            pool,
            requests,
            rate=level,
            stop=stop,
            recorder=recorder,
            max_outstanding=settings.max_outstanding,
        )
    task = asyncio.create_task(load)
    marks: list[tuple[float, Snapshot | None]] = []
    windows: list[Summary] = []
    try:
        await asyncio.sleep(settings.warmup_s)
        marks.append((time.perf_counter(), await scrape(settings.scrape_url)))
        while True:
            await asyncio.sleep(settings.window_s)
            if task.done():
                task.result()  # a bug in the generator surfaces here rather than as an empty window
            marks.append((time.perf_counter(), await scrape(settings.scrape_url)))
            (start, _), (end, _) = marks[-2], marks[-1]
            windows.append(summarize(recorder.between(start, end), end - start))
            on_window(level, len(windows), windows[-1])
            stable = is_stable(windows, count=settings.stable_windows, tolerance=settings.tolerance)
            out_of_time = time.perf_counter() + settings.window_s > deadline
            if stable or len(windows) >= settings.max_windows or out_of_time:
                break
    finally:
        stop.set()
        # On timeout wait_for cancels the stragglers; they would finish after the last window anyway.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(task, timeout=settings.request_timeout_s + 5)
        pool.close()
    pooled = min(settings.stable_windows, len(windows))
    (start, before), (end, after) = marks[-pooled - 1], marks[-1]
    server = breakdown(before, after, path=settings.path) if before is not None and after is not None else None
    return LevelResult(
        level=level,
        windows=windows,
        result=summarize(recorder.between(start, end), end - start),
        stable=is_stable(windows, count=settings.stable_windows, tolerance=settings.tolerance),
        server=server,
    )


def error_rate(summary: Summary) -> float:
    return (summary.completed - summary.ok) / summary.completed if summary.completed else 1.0


def past_slo(level: LevelResult, settings: SweepSettings) -> bool:
    latency = level.result.latency_ms
    return latency is None or latency.p99 > settings.slo_ms or error_rate(level.result) > settings.max_error_rate


def conclude(result: SweepResult) -> SweepResult:
    """Knee over the measured levels and, given a target QPS, the capacity plan at the knee."""
    settings = result.settings
    points = [
        Point(
            level=lv.level,
            throughput=lv.result.throughput,
            p99_ms=lv.result.latency_ms.p99 if lv.result.latency_ms else None,
            error_rate=error_rate(lv.result),
        )
        for lv in result.levels
    ]
    result.knee = find_knee(points, slo_ms=settings.slo_ms, max_error_rate=settings.max_error_rate)
    if result.knee is not None and settings.target_qps is not None:
        knee_server = next(level.server for level in result.levels if level.level == result.knee.level)
        result.capacity_plan = capacity_plan(
            target_qps=settings.target_qps,
            knee_qps=result.knee.throughput,
            headroom=settings.headroom,
            replica_mib=knee_server.workers_mib if knee_server else None,
        )
    return result


def minimum_level_seconds(settings: SweepSettings) -> float:
    return settings.warmup_s + settings.stable_windows * settings.window_s


async def sweep(
    settings: SweepSettings,
    payloads: Sequence[Payload],
    inputs: dict[str, object],
    *,
    on_level: Callable[[float], None] = lambda _: None,
    on_window: WindowCallback = lambda *_: None,
) -> SweepResult:
    if not payloads:
        raise ValueError("no request bodies to send")
    result = SweepResult(settings=settings, inputs=inputs, started_at=datetime.now(UTC).isoformat(timespec="seconds"))
    deadline = time.perf_counter() + settings.max_duration_s
    requests = post_requests(settings.url, payloads)
    for level in settings.levels:
        if time.perf_counter() + minimum_level_seconds(settings) > deadline:
            result.stopped = f"time budget of {settings.max_duration_s:g} s spent before level {level:g}"
            break
        on_level(level)
        measured = await measure_level(settings, requests, level, on_window, deadline)
        result.levels.append(measured)
        if settings.stop_past_slo and past_slo(measured, settings) and level != settings.levels[-1]:
            result.stopped = f"p99 or errors past the SLO at level {level:g}: later levels skipped"
            break
    return conclude(result)


def run_sweep(settings: SweepSettings, payloads: Sequence[Payload], inputs: dict[str, object]) -> SweepResult:
    """Blocking entry point without progress display (the bench and tests use it), on uvloop."""
    return uvloop.run(sweep(settings, payloads, inputs))
