"""Latency and throughput against batch size on the machine at hand, and the batching they imply.

Candidates are timed interleaved, in short blocks taken in turn, so that a noisy neighbour on
a shared machine slows them all alike and their ratios stay meaningful. Each block starts with
an untimed call: thread pools of the previous runtime (ONNX Runtime spins after a run, PyTorch's
OpenMP pool likewise) must not be billed to the next one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from serving.engine import EngineSettings, OnnxEngine

Run = Callable[[int], object]


class ProfilePoint(BaseModel):
    batch_size: int
    p50_ms: float
    p99_ms: float
    throughput: float  # rows per second at p50


class Batching(BaseModel):
    max_batch_size: int
    max_latency_ms: int
    reason: str


def _point(batch_size: int, timings: list[float]) -> ProfilePoint:
    p50, p99 = np.percentile(timings, [50, 99]) * 1000
    return ProfilePoint(batch_size=batch_size, p50_ms=p50, p99_ms=p99, throughput=batch_size / (p50 / 1000))


def _timed_block(run: Run, batch: int, seconds: float, timings: list[float]) -> None:
    run(batch)  # untimed: settles caches and the other runtime's spinning threads
    block_end = time.monotonic() + seconds
    while True:
        started = time.perf_counter()
        run(batch)
        timings.append(time.perf_counter() - started)
        if time.monotonic() >= block_end:
            return


def profile(
    runners: dict[str, Run],
    max_batch_size: int,
    *,
    slo_ms: float,
    seconds_per_point: float = 2.0,
    blocks: int = 4,
) -> dict[str, list[ProfilePoint]]:
    """Powers of two up to `max_batch_size`; a runner stops growing once one call breaks the SLO."""
    points: dict[str, list[ProfilePoint]] = {name: [] for name in runners}
    active = dict(runners)
    batch = 1
    while batch <= max_batch_size and active:
        for name, point in time_interleaved(active, batch, seconds=seconds_per_point, blocks=blocks).items():
            points[name].append(point)
            if point.p99_ms > slo_ms:
                del active[name]
        batch *= 2
    return points


def time_interleaved(runners: dict[str, Run], batch: int, *, seconds: float, blocks: int) -> dict[str, ProfilePoint]:
    """One point per runner at `batch`: `blocks` rounds, each runner timed for its share in turn."""
    timings: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(blocks):
        for name, run in runners.items():
            _timed_block(run, batch, seconds / blocks, timings[name])
    return {name: _point(batch, values) for name, values in timings.items()}


def onnx_runner(path: Path, feeds_for: Callable[[int], dict], settings: EngineSettings) -> Run:
    engine = OnnxEngine(path, settings)
    return lambda batch: engine.run(feeds_for(batch))


MIN_BATCH_SIZE = 2  # BentoML refuses a batchable API with max_batch_size < 2


def choose_batching(points: list[ProfilePoint], *, slo_ms: float, min_gain: float = 0.05) -> Batching:
    """The smallest batch within `min_gain` of the best throughput among batches that leave room
    for one batch in flight ahead of them within the SLO (2 × p99 ≤ SLO): past it, larger batches
    only add latency. Judged against the best rather than step by step, so one noisy point on a
    shared machine cannot stop the search early. Never below two: merging two waiting requests
    costs no more than running them in turn, and BentoML needs at least two."""
    fitting = [p for p in points if 2 * p.p99_ms <= slo_ms] or points[:1]
    best = max(p.throughput for p in fitting)
    chosen = min((p for p in fitting if p.throughput >= (1 - min_gain) * best), key=lambda p: p.batch_size)
    reason = (
        f"batch {chosen.batch_size}: {chosen.throughput:.0f} rows/s, p99 {chosen.p99_ms:.1f} ms, within "
        f"{min_gain:.0%} of the best throughput ({best:.0f} rows/s) with 2 × p99 ≤ SLO {slo_ms:.0f} ms"
    )
    if chosen.batch_size < MIN_BATCH_SIZE:
        reason += f"; raised to {MIN_BATCH_SIZE}, BentoML's smallest batch"
    return Batching(max_batch_size=max(MIN_BATCH_SIZE, chosen.batch_size), max_latency_ms=int(slo_ms), reason=reason)


def best_point(points: list[ProfilePoint]) -> ProfilePoint:
    return max(points, key=lambda p: p.throughput)
