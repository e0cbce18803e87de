"""Per-model serving metrics: batch-queue wait, inference time, batch size in rows, refusals.

Request counts and durations per endpoint are BentoML's series, recorded by serving/http_metrics.py,
and `bentoml_service_adaptive_batch_size` (requests per batch) comes from BentoML's batcher in the
model services (`OPTISERVE_MODEL_PLACEMENT=service` only). What they
does not say is how long a request waited for its batch, how long the engine ran, how many *rows*
a batch held (a front chunk of 32 images is one request but 32 rows), and how many requests
admission control turned away and why. These are the figures the load tester reads to explain a
latency:

- `optiserve_batch_queue_seconds{endpoint, model}`: per request to the batcher (once, however many
  batches its rows take), the time from joining the queue to the start of the first batch that
  serves it (serving/batching.py stamps both).
- `optiserve_inference_seconds{endpoint, model}`: per batch, the time `predict` spends in the
  engine (padding included for text).
- `optiserve_batch_rows{endpoint, model}`: per batch, the rows `predict` received.
- `optiserve_refused_total{endpoint, model, reason}`: requests refused by admission control:
  `queue_full` (429), `deadline` (503 at the door: the queue ahead would make it late),
  `expired` (503 in the queue: admitted, but the queue ran slower than estimated).
- `optiserve_refusals_held_total`: refusals held back before they were answered
  (serving/door.py): connections that came back before their last refusal's Retry-After.
- `optiserve_errors_total{endpoint, model, api, class, status, type}`: every other error answer
  of a model endpoint (`api`: the HTTP API, e.g. classify_batch), by class: `request` (a 4xx of
  the client's making, `type` as in the body), `timeout` (408: the body did not arrive in time),
  `inference` (500: the engine, or the model service, failed), `internal` (500: any other fault),
  `overload` (503: a model service's batcher shed the request, `service` placement only).
  Refusals of our batcher are not errors here: `optiserve_refused_total` counts them, at the door
  or in the handler.
- `optiserve_model_swaps_total{endpoint, outcome}`: alias changes the service followed
  (`swapped`) or refused (`refused`: the version is missing, tampered or failed to load), so a
  deployment tool can wait for a promote to take effect (serving/lifecycle.py).
- `optiserve_cache_lookups_total{endpoint, result}` (`hit`, `miss`), `optiserve_cache_evictions_total{endpoint}`
  and `optiserve_cache_bytes{endpoint}` (answers held, summed over the workers): a route's
  response cache, where it has one (serving/cache.py).
- `optiserve_cascade_answers_total{endpoint, model, answered_by}`: images a cascade answered with
  its student (`student`) or, where the student was unsure, its teacher (`teacher`).
- `optiserve_workers_resident_memory_bytes`: the service workers' resident memory, summed, each
  worker sampling its own every `MEMORY_SAMPLE_S` seconds. BentoML's multi-process registry drops
  prometheus_client's process collector (`process_resident_memory_bytes`), and a worker's memory
  is mostly its engines' working memory, which the row caps set (pipeline/working_memory.py):
  what a replica needs, to size its container.
- per pair of models (`endpoint`, `primary`, `shadow`), shadow traffic (serving/shadow.py):
  `optiserve_shadow_total{outcome}` (requests `compared`, `dropped` while the shadow was busy,
  `failed`), `optiserve_shadow_similarity{measure}` per row (`top1_agreement` 1 or 0 and
  `score_difference` for classifiers, `cosine` for embeddings: its mean is sum / count) and
  `optiserve_shadow_model_seconds{side}` (each model's call, `primary` and `shadow`).

With the models in BentoML model services (`OPTISERVE_MODEL_PLACEMENT=service`) BentoML's own
batcher queues the requests and exposes no queue time through its public API, so the queue
metric and the refusals stay empty there.

Instruments are created on first use, not at import: in multi-process mode prometheus_client
must be imported after BentoML has set PROMETHEUS_MULTIPROC_DIR in the worker, and /metrics of
the front then aggregates every worker's series. (`bentoml.metrics` is only a deprecated lazy
alias of prometheus_client in BentoML 1.4.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

QUEUE_METRIC = "optiserve_batch_queue_seconds"
INFERENCE_METRIC = "optiserve_inference_seconds"
ROWS_METRIC = "optiserve_batch_rows"
REFUSED_METRIC = "optiserve_refused"  # prometheus_client appends _total
HELD_METRIC = "optiserve_refusals_held"
ERRORS_METRIC = "optiserve_errors"
SWAPS_METRIC = "optiserve_model_swaps"
SHADOW_METRIC = "optiserve_shadow"
SIMILARITY_METRIC = "optiserve_shadow_similarity"
SHADOW_SECONDS_METRIC = "optiserve_shadow_model_seconds"
CACHE_LOOKUPS_METRIC = "optiserve_cache_lookups"
CACHE_EVICTIONS_METRIC = "optiserve_cache_evictions"
CACHE_BYTES_METRIC = "optiserve_cache_bytes"
CASCADE_METRIC = "optiserve_cascade_answers"
MEMORY_METRIC = "optiserve_workers_resident_memory_bytes"
LOG_DROPPED_METRIC = "optiserve_log_records_dropped"
MEMORY_SAMPLE_S = 5.0
PAIR = ("endpoint", "primary", "shadow")
# Agreement is 0 or 1, score differences near 0, cosines near 1: both ends resolved.
SIMILARITY_BUCKETS = (0.0, 0.001, 0.01, 0.05, 0.1, 0.5, 0.9, 0.95, 0.99, 0.999, 0.9999, 1.0)
LABELS = ("endpoint", "model")
# Sub-millisecond to tens of seconds: queue waits on a busy CPU span that whole range.
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class Instruments:
    queue: Any
    inference: Any
    rows: Any
    refused: Any
    held: Any
    errors: Any
    swaps: Any
    shadow: Any
    similarity: Any
    shadow_seconds: Any
    cache_lookups: Any
    cache_evictions: Any
    cache_bytes: Any
    cascade: Any
    memory: Any
    log_dropped: Any


@cache
def instruments() -> Instruments:
    """The instruments, registered once per process on first use (see the module docstring)."""
    from prometheus_client import Counter, Gauge, Histogram

    return Instruments(
        queue=Histogram(
            QUEUE_METRIC, "Wait in the batch queue per request to the batcher", LABELS, buckets=SECONDS_BUCKETS
        ),
        inference=Histogram(INFERENCE_METRIC, "Engine time per batch", LABELS, buckets=SECONDS_BUCKETS),
        rows=Histogram(
            ROWS_METRIC, "Rows per batch (BentoML's adaptive_batch_size counts requests)", LABELS, buckets=ROWS_BUCKETS
        ),
        refused=Counter(REFUSED_METRIC, "Requests refused by admission control", (*LABELS, "reason")),
        held=Counter(HELD_METRIC, "Refusals held until the Retry-After their connection ignored"),
        errors=Counter(
            ERRORS_METRIC, "Error answers of model endpoints by class", (*LABELS, "api", "class", "status", "type")
        ),
        swaps=Counter(SWAPS_METRIC, "Alias changes followed or refused", ("endpoint", "outcome")),
        shadow=Counter(SHADOW_METRIC, "Requests offered to a shadow model, by outcome", (*PAIR, "outcome")),
        similarity=Histogram(
            SIMILARITY_METRIC, "Shadow against primary, per row", (*PAIR, "measure"), buckets=SIMILARITY_BUCKETS
        ),
        shadow_seconds=Histogram(
            SHADOW_SECONDS_METRIC,
            "Model call of each side of a shadowed request",
            (*PAIR, "side"),
            buckets=SECONDS_BUCKETS,
        ),
        cache_lookups=Counter(CACHE_LOOKUPS_METRIC, "Response cache lookups by result", ("endpoint", "result")),
        cache_evictions=Counter(CACHE_EVICTIONS_METRIC, "Answers the response cache let go for room", ("endpoint",)),
        cache_bytes=Gauge(
            CACHE_BYTES_METRIC, "Bytes of answers the response cache holds", ("endpoint",), multiprocess_mode="livesum"
        ),
        cascade=Counter(
            CASCADE_METRIC, "Images a cascade answered, by the model that answered", (*LABELS, "answered_by")
        ),
        memory=Gauge(MEMORY_METRIC, "Resident memory of the service's workers, summed", multiprocess_mode="livesum"),
        log_dropped=Counter(LOG_DROPPED_METRIC, "Log records dropped: the worker's output was not read in time"),
    )


async def sample_resident_memory(every_s: float = MEMORY_SAMPLE_S) -> None:
    """This worker's resident memory into the gauge, now and every `every_s` seconds, until cancelled."""
    import psutil

    process, gauge = psutil.Process(), instruments().memory
    while True:
        gauge.set(process.memory_info().rss)
        await asyncio.sleep(every_s)


def count_cascade_answers(endpoint: str, model: str, *, student: int, teacher: int) -> None:
    for answered_by, images in (("student", student), ("teacher", teacher)):
        if images:
            instruments().cascade.labels(endpoint=endpoint, model=model, answered_by=answered_by).inc(images)


def count_held_refusal() -> None:
    instruments().held.inc()


def count_dropped_log_record() -> None:
    instruments().log_dropped.inc()


def count_error(*, endpoint: str, model: str, api: str, error_class: str, status: int, kind: str) -> None:
    instruments().errors.labels(
        endpoint=endpoint, model=model, api=api, **{"class": error_class}, status=str(status), type=kind
    ).inc()


class ModelMetrics:
    """The series of one served model; created where its engine runs."""

    def __init__(self, *, endpoint: str, model: str) -> None:
        found = instruments()
        self.endpoint = endpoint
        labels = {"endpoint": endpoint, "model": model}
        self.queue = found.queue.labels(**labels)
        self.inference = found.inference.labels(**labels)
        self.rows = found.rows.labels(**labels)
        self._refused = found.refused
        self._labels = labels

    @contextmanager
    def batch(self, rows: int) -> Iterator[None]:
        """Time one batched engine call and count its rows; failed batches are not timed."""
        started = time.perf_counter()
        yield
        self.observe_batch(seconds=time.perf_counter() - started, rows=rows)

    def observe_batch(self, *, seconds: float, rows: int) -> None:
        self.inference.observe(seconds)
        self.rows.observe(rows)

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue.observe(max(0.0, seconds))

    def refused(self, reason: str) -> None:
        self._refused.labels(**self._labels, reason=reason).inc()


def count_swap(endpoint: str, outcome: str) -> None:
    """One alias change of `endpoint`'s route: `swapped`, `refused`, or `withdrawn` (a canary's or
    a shadow's alias unset)."""
    instruments().swaps.labels(endpoint=endpoint, outcome=outcome).inc()


class ShadowMetrics:
    """The series of one pair of models: an endpoint's primary and its shadow."""

    def __init__(self, *, endpoint: str, primary: str, shadow: str) -> None:
        self._found = instruments()
        self._pair = {"endpoint": endpoint, "primary": primary, "shadow": shadow}

    def count(self, outcome: str) -> None:
        self._found.shadow.labels(**self._pair, outcome=outcome).inc()

    def compared(self, measures: dict[str, Any], seconds: dict[str, float]) -> None:
        """One compared request: each measure's value per row, each side's model time."""
        self.count("compared")
        for measure, values in measures.items():
            series = self._found.similarity.labels(**self._pair, measure=measure)
            for value in values:
                series.observe(float(value))
        for side, value in seconds.items():
            self._found.shadow_seconds.labels(**self._pair, side=side).observe(value)


class CacheMetrics:
    """The series of one endpoint's response cache."""

    def __init__(self, *, endpoint: str) -> None:
        found = instruments()
        self._hits = found.cache_lookups.labels(endpoint=endpoint, result="hit")
        self._misses = found.cache_lookups.labels(endpoint=endpoint, result="miss")
        self._evictions = found.cache_evictions.labels(endpoint=endpoint)
        self._bytes = found.cache_bytes.labels(endpoint=endpoint)

    def lookup(self, *, hit: bool) -> None:
        (self._hits if hit else self._misses).inc()

    def evicted(self) -> None:
        self._evictions.inc()

    def held(self, size: int) -> None:
        self._bytes.set(size)
