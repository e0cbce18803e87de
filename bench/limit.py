"""The limit: the serving code path in-process, with no HTTP, no IPC and no batching queue.

Decode and pre-process (`serving.classify.prepare_image`) or tokenize (`serving.text`), then
the model's engine through the service's own runtimes and engine settings, at the batch size
and engine streams that give the best throughput among batches 1–64 and 1, 2 or 4 streams
whose batch p99 stays within the SLO (the servers are compared at their knee, too). Not capped
at the served `max_batch_size` nor fixed at the served `engine_streams`: the limit is what the
model and machine allow, so a cap set too small or a stream count chosen badly shows as a gap
to it, not as a lower limit. With n streams, n threads each prepare and run their own batches,
one step after another, so nothing but the serving machinery separates this figure from what
the service can reach; a server that overlaps decoding with inference can exceed it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from serving.classify import ImageUpload, prepare_image
from serving.engine import EngineSettings, stream_counts
from serving.model_runtime import ImageModelRuntime, TextModelRuntime, engine_of, read_spec
from serving.model_spec import TOKENIZER_FILE
from serving.text import TextTokenizer

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class LimitResult:
    best_batch: int
    best_streams: int
    rows_per_s: dict[int, float]  # items/s, decode/tokenize + engine, at each batch size, best streams
    streams_rows_per_s: dict[int, dict[int, float]]  # the same per stream count
    throughput: float  # items/s at best_batch and best_streams
    batch_p99_ms: float  # latency of one whole batch there
    batch1_p50_ms: float  # one item, end to end in-process, on one stream of all the threads
    batch1_p99_ms: float


def _batches(items: Sequence, size: int) -> list[list]:
    """Every item once, in order, `size` at a time (the last batch wraps around): text batches
    then pad to realistic mixes of lengths instead of the first few texts only."""
    count = -(-len(items) // size)
    return [[items[(start + i) % len(items)] for i in range(size)] for start in range(0, count * size, size)]


def _ms_percentile(seconds: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(seconds) * 1000, q, method="inverted_cdf"))


def _timed_batches(
    run: Callable[[list], object], batches: list[list], seconds: float, callers: int
) -> tuple[list[float], float]:
    """Seconds per batch, and in all, `callers` threads each cycling through their share of
    `batches`, all of them at least once and for at least `seconds`."""
    times: list[float] = []
    deadline = time.monotonic() + seconds
    started = time.monotonic()

    def call(first: int) -> None:
        for index in range(first, 2**62, callers):
            if index >= len(batches) and time.monotonic() >= deadline:
                return
            begun = time.monotonic()
            run(batches[index % len(batches)])
            times.append(time.monotonic() - begun)

    threads = [threading.Thread(target=call, args=(first,)) for first in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return times, time.monotonic() - started


def _measure(
    prepare: Callable[[list], object],
    infers: dict[int, Callable[[object], object]],
    items: Sequence,
    *,
    seconds: float,
    slo_ms: float,
) -> LimitResult:
    """`infers`: the engine opened with each stream count."""
    rates: dict[int, dict[int, float]] = {}
    times: dict[tuple[int, int], list[float]] = {}
    for streams, infer in infers.items():

        def run(batch: list, infer: Callable[[object], object] = infer) -> object:
            return infer(prepare(batch))

        rates[streams] = {}
        for size in BATCH_SIZES:
            batches = _batches(items, size)
            run(batches[0])  # the first call at a new shape plans memory; not part of the figure
            times[streams, size], wall = _timed_batches(run, batches, seconds / 2 / len(infers), streams)
            rates[streams][size] = size * len(times[streams, size]) / wall
    # Like the servers' knee: only batch sizes whose own p99 is within the SLO compete.
    within = [key for key in times if key[1] == 1 or _ms_percentile(times[key], 99) <= slo_ms]
    best_streams, best_batch = max(within, key=lambda key: rates[key[0]][key[1]])
    one = min(infers)
    return LimitResult(
        best_batch=best_batch,
        best_streams=best_streams,
        rows_per_s=rates[best_streams],
        streams_rows_per_s=rates,
        throughput=rates[best_streams][best_batch],
        batch_p99_ms=_ms_percentile(times[best_streams, best_batch], 99),
        batch1_p50_ms=_ms_percentile(times[one, 1], 50),
        batch1_p99_ms=_ms_percentile(times[one, 1], 99),
    )


def _runtimes(runtime: type[ImageModelRuntime | TextModelRuntime], stored: Any) -> dict[int, Callable]:
    """`predict` of the stored model on its own engine, opened with each stream count worth timing."""
    spec, settings = read_spec(stored.info.metadata), EngineSettings.from_environment()
    return {
        n: runtime(Path(stored.path), spec, replace(settings, streams=n), engine=engine_of(stored)).predict
        for n in stream_counts(settings.intra_op_threads)
    }


def image_limit(stored: Any, photos: dict[str, bytes], *, seconds: float, slo_ms: float) -> LimitResult:
    """`stored`: the served `bentoml.Model`, run on its own engine."""
    spec = read_spec(stored.info.metadata)
    uploads = [ImageUpload(data, None, name) for name, data in photos.items()]

    def prepare(batch: list[ImageUpload]) -> np.ndarray:
        return np.stack([prepare_image(upload, spec.image) for upload in batch])

    return _measure(prepare, _runtimes(ImageModelRuntime, stored), uploads, seconds=seconds, slo_ms=slo_ms)


def text_limit(stored: Any, texts: list[str], *, seconds: float, slo_ms: float) -> LimitResult:
    spec = read_spec(stored.info.metadata)
    tokenizer = TextTokenizer(Path(stored.path) / TOKENIZER_FILE, max_length=spec.text.max_length)

    def prepare(batch: list[str]) -> list[list[int]]:
        return tokenizer.encode(batch, truncate=True)

    return _measure(prepare, _runtimes(TextModelRuntime, stored), texts, seconds=seconds, slo_ms=slo_ms)


def measure_limit(stored: Any, inputs: Sequence | dict, *, seconds: float, slo_ms: float) -> LimitResult:
    """The limit of a stored model on its task's inputs: photos (name → bytes) or texts."""
    measure = {"image-classification": image_limit, "text-embedding": text_limit}[read_spec(stored.info.metadata).task]
    return measure(stored, inputs, seconds=seconds, slo_ms=slo_ms)
