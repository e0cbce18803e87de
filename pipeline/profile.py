"""Latency and throughput against batch size on the machine at hand, and the batching they imply.

A profile point is a batch of the traffic the service will get: each timed call runs the serving
runtime's own `predict` (texts in length groups, each padded to its longest) on rows drawn at
random from real inputs, so short and long texts weigh as they do in requests, not as synthetic
rows of one length. Candidates and batch sizes are timed interleaved, in short blocks taken in
turn, so that a noisy neighbour on a shared machine slows them all alike and their ratios stay
meaningful. Each
block starts with an untimed call: thread pools of the previous runtime (PyTorch's OpenMP pool
spins after a run) must not be billed to the next one, and the runtime's weights come back into
cache. At the point's batch size in a runner's first block, where the first call of a new size
sizes the engine's buffers; of one row after that, which does the rest as well: at the largest
batches the untimed calls had been a third of a point's time (EfficientNet-Lite0 at 64 on 2
cores, 0.4 s a call), and one-row warm-ups left its p50s where they were, alternated in one run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from serving.engine import EngineSettings, open_engine
from serving.model_runtime import ModelRuntime
from serving.text import padded_tokens

# One call at a batch size, on rows the runner draws itself; returns the padded tokens it ran
# (text) or None. Drawing and counting cost microseconds against milliseconds per call.
Run = Callable[[int], int | None]
Draw = Callable[[int], list]
Sample = tuple[float, int | None]  # seconds, padded tokens
# A build screens every variant for this share of the recipe's seconds per batch size, in
# SCREEN_BLOCKS blocks, and times the contenders in full in FULL_BLOCKS (pipeline/build.py).
SCREEN_SHARE = 0.25
SCREEN_BLOCKS = 2
FULL_BLOCKS = 4


class ProfilePoint(BaseModel):
    """One batch size. Throughputs are over all timed calls: real batches differ in cost."""

    batch_size: int
    p50_ms: float
    p99_ms: float
    throughput: float  # rows per second
    mean_tokens: float | None = None  # text: padded tokens per call, length groups included
    max_tokens: int | None = None
    tokens_per_s: float | None = None
    memory_mib: float | None = None  # the served variant's: its engine's working memory (pipeline/working_memory.py)


class Batching(BaseModel):
    max_batch_size: int
    max_batch_tokens: int | None = None  # text: padded tokens per engine call
    max_latency_ms: int
    reason: str


def _point(batch_size: int, samples: list[Sample]) -> ProfilePoint:
    seconds = np.array([s for s, _ in samples])
    tokens = [t for _, t in samples]
    p50, p99 = np.percentile(seconds, [50, 99]) * 1000
    total = float(seconds.sum())
    text = (
        {}
        if None in tokens
        else {"mean_tokens": float(np.mean(tokens)), "max_tokens": max(tokens), "tokens_per_s": sum(tokens) / total}
    )
    return ProfilePoint(
        batch_size=batch_size, p50_ms=p50, p99_ms=p99, throughput=batch_size * len(samples) / total, **text
    )


def _timed_block(run: Run, batch: int, seconds: float, samples: list[Sample], *, warm_up: int) -> None:
    run(warm_up)  # untimed
    block_end = time.monotonic() + seconds
    while True:
        started = time.perf_counter()
        tokens = run(batch)
        samples.append((time.perf_counter() - started, tokens))
        if time.monotonic() >= block_end:
            return


def profile(
    runners: dict[str, Run],
    max_batch_size: int,
    *,
    slo_ms: float,
    seconds_per_point: float = 2.0,
    blocks: int = FULL_BLOCKS,
) -> dict[str, list[ProfilePoint]]:
    """Powers of two up to `max_batch_size`. The first block takes the sizes in increasing order,
    and a runner stops growing once its median call there takes over half the SLO: every larger
    batch would then be too slow for batching to choose (`servable`), and the largest batches cost
    the most time to profile. Each further block takes every size again, in turn, the order
    reversed from one block to the next, as the runners are interleaved at each size: a shared
    host that runs slower for a while then slows every size alike, and the batch chosen
    (`choose_batching`) is the best size, not the best moment. Timed one size after another, a
    flat curve's best batch followed the host's drift: MiniLM INT8's row cap came out 4, 8, 64
    and 64 in four builds of one recipe on 2 AVX2 cores."""
    share = seconds_per_point / blocks
    samples: dict[str, dict[int, list[Sample]]] = {name: {} for name in runners}
    active, batch = dict(runners), 1
    while batch <= max_batch_size and active:
        for name, run in active.items():
            _timed_block(run, batch, share, samples[name].setdefault(batch, []), warm_up=batch)
        active = {name: run for name, run in active.items() if 2 * _point(batch, samples[name][batch]).p50_ms <= slo_ms}
        batch *= 2
    sizes = sorted({size for by_size in samples.values() for size in by_size})
    for block in range(1, blocks):
        for size in sizes[::-1] if block % 2 else sizes:
            for name, run in runners.items():
                if size in samples[name]:
                    _timed_block(run, size, share, samples[name][size], warm_up=1)
    return {name: [_point(size, timed) for size, timed in sorted(by_size.items())] for name, by_size in samples.items()}


def time_interleaved(runners: dict[str, Run], batch: int, *, seconds: float, blocks: int) -> dict[str, ProfilePoint]:
    """One point per runner at `batch`: `blocks` rounds, each runner timed for its share in turn."""
    samples: dict[str, list[Sample]] = {name: [] for name in runners}
    for block in range(blocks):
        for name, run in runners.items():
            _timed_block(run, batch, seconds / blocks, samples[name], warm_up=batch if block == 0 else 1)
    return {name: _point(batch, values) for name, values in samples.items()}


def sampler(rows: Sequence, seed: int = 0) -> Draw:
    """Batches drawn at random with replacement, one seeded sequence per batch size: runners that
    each hold a sampler over the same rows see the same batches, however many calls came before."""
    generators: dict[int, np.random.Generator] = {}

    def draw(batch: int) -> list:
        if batch not in generators:
            generators[batch] = np.random.default_rng([seed, batch])
        return [rows[i] for i in generators[batch].integers(len(rows), size=batch)]

    return draw


def runtime_runner(runtime: ModelRuntime, draw: Draw) -> Run:
    """Calls through the serving runtime, exactly as the service makes them per batch; counts
    padded tokens where they are the batch's cost."""

    def run(batch: int) -> int | None:
        rows = draw(batch)
        runtime.predict_rows(rows)
        return padded_tokens([len(row) for row in rows]) if runtime.batched_by_tokens else None

    return run


def engine_runner(path: Path, feeds_for: Callable[[int], dict], settings: EngineSettings, engine_name: str) -> Run:
    """Given feeds straight into an engine: `bench.variants` times every variant at one batch."""
    engine = open_engine(engine_name, path, settings)

    def run(batch: int) -> None:
        engine.run(feeds_for(batch))

    return run


MIN_BATCH_SIZE = 2  # BentoML refuses a batchable API with max_batch_size < 2
NOISE_MARGIN = 0.05  # a speed-up smaller than this is within one run's noise on a shared machine


def servable(points: list[ProfilePoint], slo_ms: float) -> list[ProfilePoint]:
    """The batch sizes a service may run within the SLO: room for one batch in flight ahead of a
    request and its own (2 × p99 ≤ SLO)."""
    return [p for p in points if 2 * p.p99_ms <= slo_ms]


def choose_batching(points: list[ProfilePoint], *, slo_ms: float, max_length: int | None = None) -> Batching:
    """Rows: the largest batch within the noise margin of the best throughput among those that
    leave room for one batch in flight ahead of them within the SLO (2 × p99 ≤ SLO), as Triton's
    model analyzer maximises throughput under a latency bound. A larger cap costs no latency at a
    given load: the batcher only fills what the queue holds, and once it holds that much, fewer
    rows a call mean a longer queue; and a served batch carries per-call costs the in-process
    profile does not see (the batcher's turn, waking its callers), which larger batches spread.
    Served on 2 AVX2 cores at equal concurrency, caps of 64 rows against 8 (images) and 16 (text)
    gave 4 % and 11 % more requests/s at p99s no higher, where the profile read them within 5 %:
    on such a flat curve the best point is the noise's choice (EfficientNet-Lite0's cap came out
    64, 64 and 4 in three builds, 150–157 rows/s from 4 to 64 rows). Never below two: merging two
    waiting requests costs no more than running them in turn, and BentoML needs at least two.

    Text (`max_length`: the model's tokens per text) also gets a padded-token cap, `choose_token_cap`,
    at the latency the row cap was chosen at; images are bounded by rows alone."""
    fitting = servable(points, slo_ms) or points[:1]
    best = max(fitting, key=lambda p: p.throughput)
    within_noise = [p for p in fitting if p.throughput * (1 + NOISE_MARGIN) >= best.throughput]
    chosen = max(within_noise, key=lambda p: p.batch_size)
    rows = max(MIN_BATCH_SIZE, chosen.batch_size)
    reason = f"batch {chosen.batch_size}: {chosen.throughput:.0f} rows/s, p99 {chosen.p99_ms:.1f} ms{_memory(chosen)}, "
    if chosen is best:
        reason += "the best throughput"
    else:
        reason += (
            f"the largest batch within {NOISE_MARGIN * 100:g} % of the best throughput"
            f" (batch {best.batch_size}: {best.throughput:.0f} rows/s{_memory(best)})"
        )
    reason += f" with 2 × p99 ≤ SLO {slo_ms:.0f} ms"
    if chosen.batch_size < MIN_BATCH_SIZE:
        reason += f"; raised to {MIN_BATCH_SIZE}, BentoML's smallest batch"
    tokens = None
    if max_length is not None:
        tokens, why = choose_token_cap(chosen, max_rows=rows, max_length=max_length)
        reason += f"; {why}"
    return Batching(max_batch_size=rows, max_batch_tokens=tokens, max_latency_ms=int(slo_ms), reason=reason)


def _memory(point: ProfilePoint) -> str:
    return "" if point.memory_mib is None else f", {point.memory_mib:.0f} MiB of engine memory"


def choose_token_cap(chosen: ProfilePoint, *, max_rows: int, max_length: int) -> tuple[int, str]:
    """The padded tokens one engine call runs within the p99 of the batch the row cap was chosen
    at, at the rate (padded tokens/s) measured there: on that line a batch of long texts takes no
    longer than the slowest calls of a typical batch at the row cap, while batches of short texts
    still fill up to the row cap. The chosen batch's own rate rather than a line fitted across
    batch sizes: the largest batches weigh most in such a fit, yet they are the noisiest on a
    shared machine and the least like the batches the cap decides (their activations outgrow the
    caches: on 2 cores MiniLM INT8 took 1.5 × as long per token at 2048 tokens a call as at 256).
    The per-call overhead, small at such a batch, is counted as cost per token, which errs
    towards a lower cap. Never below `max_length` (one text of the model's longest must fit a call), nor above
    `max_rows × max_length` (past it the row cap binds first)."""
    solved = chosen.tokens_per_s * chosen.p99_ms / 1000
    ceiling = max_rows * max_length
    cap = int(min(max(solved, max_length), ceiling))
    reason = (
        f"{cap} padded tokens per call: batch {chosen.batch_size} ran {chosen.tokens_per_s:.0f} padded tokens/s "
        f"({chosen.mean_tokens:.0f} a call on average, at most {chosen.max_tokens}), {int(solved)} "
        f"within its p99 {chosen.p99_ms:.1f} ms"
    )
    if solved < max_length:
        reason += f"; raised to {max_length}, one text of the model's longest"
    elif solved > ceiling:
        reason += f"; lowered to {max_rows} rows × {max_length} tokens, where the row cap binds first"
    return cap, reason


def best_point(points: list[ProfilePoint]) -> ProfilePoint:
    return max(points, key=lambda p: p.throughput)
