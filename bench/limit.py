"""The limit: the serving code path in-process, with no HTTP, no IPC and no batching queue.

Decode and pre-process (`serving.classify.prepare_image`) or tokenize (`serving.text`), then
ONNX Runtime through the service's own runtimes and engine settings, at the batch size that
gives the best throughput among 1–64 whose batch p99 stays within the SLO (the servers are
compared at their knee, too). Not capped at the served `max_batch_size`: the limit is what the
model and machine allow, so a batch cap set too small shows as a gap to it, not as a lower
limit. Steps run one after another in one process, so nothing but the serving machinery
separates this figure from what the service can reach; a server that overlaps decoding with
inference can exceed it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serving.classify import ImageUpload, prepare_image
from serving.engine import EngineSettings
from serving.model_runtime import ImageModelRuntime, TextModelRuntime, engine_of, read_spec
from serving.model_spec import TOKENIZER_FILE
from serving.text import TextTokenizer

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class LimitResult:
    best_batch: int
    rows_per_s: dict[int, float]  # items/s, decode/tokenize + engine, at each batch size
    throughput: float  # items/s at best_batch
    batch_p99_ms: float  # latency of one whole batch at best_batch
    batch1_p50_ms: float  # one item, end to end in-process
    batch1_p99_ms: float


def _batches(items: Sequence, size: int) -> list[list]:
    """Every item once, in order, `size` at a time (the last batch wraps around): text batches
    then pad to realistic mixes of lengths instead of the first few texts only."""
    count = -(-len(items) // size)
    return [[items[(start + i) % len(items)] for i in range(size)] for start in range(0, count * size, size)]


def _ms_percentile(seconds: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(seconds) * 1000, q, method="inverted_cdf"))


def _timed_batches(run: Callable[[list], object], batches: list[list], seconds: float) -> list[float]:
    """Seconds per batch, cycling through `batches` at least once and for at least `seconds`."""
    times: list[float] = []
    deadline = time.monotonic() + seconds
    while len(times) < len(batches) or time.monotonic() < deadline:
        batch = batches[len(times) % len(batches)]
        started = time.monotonic()
        run(batch)
        times.append(time.monotonic() - started)
    return times


def _measure(
    prepare: Callable[[list], object],
    infer: Callable[[object], object],
    items: Sequence,
    *,
    seconds: float,
    slo_ms: float,
    batch_sizes: Sequence[int] = BATCH_SIZES,
) -> LimitResult:
    def run(batch: list) -> object:
        return infer(prepare(batch))

    rates: dict[int, float] = {}
    times: dict[int, list[float]] = {}
    for size in batch_sizes:
        batches = _batches(items, size)
        run(batches[0])  # the first call at a new shape plans memory; not part of the figure
        times[size] = _timed_batches(run, batches, seconds / 2)
        rates[size] = size * len(times[size]) / sum(times[size])
    # Like the servers' knee: only batch sizes whose own p99 is within the SLO compete.
    within = [b for b in batch_sizes if b == 1 or _ms_percentile(times[b], 99) <= slo_ms]
    best = max(within, key=lambda b: rates[b])
    return LimitResult(
        best_batch=best,
        rows_per_s=rates,
        throughput=rates[best],
        batch_p99_ms=_ms_percentile(times[best], 99),
        batch1_p50_ms=_ms_percentile(times[1], 50),
        batch1_p99_ms=_ms_percentile(times[1], 99),
    )


def image_limit(
    stored: Any, photos: dict[str, bytes], *, seconds: float, slo_ms: float, batch_sizes: Sequence[int] = BATCH_SIZES
) -> LimitResult:
    """`stored`: the served `bentoml.Model`, run on its own engine."""
    spec = read_spec(stored.info.metadata)
    runtime = ImageModelRuntime(Path(stored.path), spec, EngineSettings.from_environment(), engine=engine_of(stored))
    uploads = [ImageUpload(data, None, name) for name, data in photos.items()]

    def prepare(batch: list[ImageUpload]) -> np.ndarray:
        return np.stack([prepare_image(upload, spec.image) for upload in batch])

    return _measure(prepare, runtime.predict, uploads, seconds=seconds, slo_ms=slo_ms, batch_sizes=batch_sizes)


def text_limit(
    stored: Any, texts: list[str], *, seconds: float, slo_ms: float, batch_sizes: Sequence[int] = BATCH_SIZES
) -> LimitResult:
    spec = read_spec(stored.info.metadata)
    runtime = TextModelRuntime(Path(stored.path), spec, EngineSettings.from_environment(), engine=engine_of(stored))
    tokenizer = TextTokenizer(Path(stored.path) / TOKENIZER_FILE, max_length=spec.text.max_length)

    def prepare(batch: list[str]) -> list[list[int]]:
        return tokenizer.encode(batch, truncate=True)

    return _measure(prepare, runtime.predict, texts, seconds=seconds, slo_ms=slo_ms, batch_sizes=batch_sizes)


def measure_limit(
    stored: Any, inputs: Sequence | dict, *, seconds: float, slo_ms: float, batch_sizes: Sequence[int] = BATCH_SIZES
) -> LimitResult:
    """The limit of a stored model on its task's inputs: photos (name → bytes) or texts;
    `batch_sizes=(1,)` times one input alone, as a server at concurrency 1 gets it."""
    measure = {"image-classification": image_limit, "text-embedding": text_limit}[read_spec(stored.info.metadata).task]
    return measure(stored, inputs, seconds=seconds, slo_ms=slo_ms, batch_sizes=batch_sizes)
