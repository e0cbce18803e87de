"""Per-model serving metrics: batch-queue wait, inference time and batch size in rows.

BentoML already exports request counts, request durations per service, and
`bentoml_service_adaptive_batch_size` (requests per batch). What it does not say is how long a
request waited for its batch, how long the engine ran, and how many *rows* a batch held: a
front chunk of 32 images is one request to BentoML but 32 rows to ONNX Runtime. These are the
three figures the load tester reads to explain a latency:

- `optiserve_batch_queue_seconds{endpoint, model}`: per request to the batcher, the time
  from its arrival in BentoML's batch queue to the start of the batch that serves it.
- `optiserve_inference_seconds{endpoint, model}`: per batch, the time `predict` spends in the
  engine (padding included for text).
- `optiserve_batch_rows{endpoint, model}`: per batch, the rows `predict` received.

How the queue wait is measured, and why this way. BentoML's batcher (`CorkDispatcher`, one per
batchable method, living in the model worker, or in the front worker with in-process models,
serving/batching.py) stamps every request with `enqueue_time` when it
joins the queue and later hands a tuple of those jobs to `outbound_call`, which runs the batch.
Wrapping `outbound_call` gives the exact wait of every request, in the process that queued it,
with no clock shared between processes and no guessing which request rode in which batch.
Rejected alternatives:
- front model-call time − inference time: the difference also holds serialization and the
  HTTP hop between services, and the front cannot know which batch (so which inference time)
  served its chunk; only averages could be subtracted, with mismatched weights.
- a timestamp sent by the front: needs a clock shared across hosts and still does not map a
  request to its batch inside `predict`, which only sees the merged array.
The cost is a dependency on a private BentoML class (bentoml is pinned in pyproject.toml).
`install_queue_probe` checks the shape it relies on and, if a BentoML upgrade changed it, logs
a warning and leaves the queue metric empty rather than breaking serving;
tests/test_loadtest.py fails when the metric stops moving. `enqueue_time` is BentoML's
`time.time()` stamp, so the wait is taken on the same clock (the one exception to monotonic
durations in this code base).

Instruments are created on first use, not at import: in multi-process mode prometheus_client
must be imported after BentoML has set PROMETHEUS_MULTIPROC_DIR in the worker, and /metrics of
the front then aggregates every worker's series. (`bentoml.metrics` is only a deprecated lazy
alias of prometheus_client in BentoML 1.4.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

logger = logging.getLogger(__name__)

QUEUE_METRIC = "optiserve_batch_queue_seconds"
INFERENCE_METRIC = "optiserve_inference_seconds"
ROWS_METRIC = "optiserve_batch_rows"
LABELS = ("endpoint", "model")
# Sub-millisecond to tens of seconds: queue waits on a busy CPU span that whole range.
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

_PROBE_MARK = "_optiserve_queue_probe"


@dataclass(frozen=True)
class Instruments:
    queue: Any
    inference: Any
    rows: Any


@cache
def instruments() -> Instruments:
    """The three histograms, registered once per process on first use (see the module docstring)."""
    from prometheus_client import Histogram

    return Instruments(
        queue=Histogram(
            QUEUE_METRIC, "Wait in the batch queue per model-service request", LABELS, buckets=SECONDS_BUCKETS
        ),
        inference=Histogram(INFERENCE_METRIC, "Engine time per batch", LABELS, buckets=SECONDS_BUCKETS),
        rows=Histogram(
            ROWS_METRIC, "Rows per batch (BentoML's adaptive_batch_size counts requests)", LABELS, buckets=ROWS_BUCKETS
        ),
    )


class ModelMetrics:
    """The series of one served model; created where its engine runs."""

    def __init__(self, *, endpoint: str, model: str) -> None:
        found = instruments()
        self.endpoint = endpoint
        labels = {"endpoint": endpoint, "model": model}
        self.queue = found.queue.labels(**labels)
        self.inference = found.inference.labels(**labels)
        self.rows = found.rows.labels(**labels)

    @contextmanager
    def batch(self, rows: int) -> Iterator[None]:
        """Time one batched engine call and count its rows; failed batches are not timed."""
        started = time.monotonic()
        yield
        self.inference.observe(time.monotonic() - started)
        self.rows.observe(rows)

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue.observe(max(0.0, seconds))


def install_queue_probe(observe: Callable[[float], None]) -> bool:
    """Report each request's wait in BentoML's batch queue to `observe`; True when installed.

    For model services, whose dispatchers BentoML creates; in-process batchers report their
    own waits (serving/batching.py).
    One model service per worker process (BentoML's layout), so one probe per process serves
    every batchable method in it. Installing twice is a no-op.
    """
    try:
        from bentoml._internal.marshal.dispatcher import CorkDispatcher, Job
    except ImportError:
        logger.warning("BentoML's batch dispatcher moved: the batch-queue metric stays empty")
        return False
    original = getattr(CorkDispatcher, "outbound_call", None)
    if original is None or not _has_enqueue_time(Job):
        logger.warning("BentoML's batch dispatcher changed shape: the batch-queue metric stays empty")
        return False
    if getattr(original, _PROBE_MARK, False):
        return True

    async def outbound_call(self: Any, inputs_info: tuple[Any, ...], *args: Any, **kwargs: Any) -> Any:
        started = time.time()  # same clock as Job.enqueue_time
        for job in inputs_info:
            observe(started - job.enqueue_time)
        return await original(self, inputs_info, *args, **kwargs)

    setattr(outbound_call, _PROBE_MARK, True)
    CorkDispatcher.outbound_call = outbound_call
    return True


def _has_enqueue_time(job_class: type) -> bool:
    fields = getattr(job_class, "__attrs_attrs__", ())
    return any(getattr(field, "name", None) == "enqueue_time" for field in fields)
