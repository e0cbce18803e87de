"""In-process adaptive batching: BentoML's own batcher, run in the front worker beside the model.

With the models in separate BentoML services every request crosses two more process
boundaries (front → model worker → front), each an HTTP exchange with pickled arrays in and
JSON floats out. Without them, on 2 cores, the service served 1.22× (image) and 1.26× (text)
the requests/s at the knee and answered 6.3 and 1.7 ms sooner at concurrency 1 (BENCHMARKS.md,
serving run 4). Here the front keeps the ONNX session and feeds it through the same `CorkDispatcher` that
BentoML runs for a `batchable=True` API, so batching behaves as with a model service (cork
algorithm, `max_batch_size` in rows, `max_latency_ms`, 503 when a request cannot make its
deadline) without the hops.

One thread per model runs the engine, so inference never waits behind decode work in the
front's shared thread pool, and the dispatcher keeps at most one batch in flight.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, NoReturn, TypeVar

import numpy as np
from bentoml._internal.marshal.dispatcher import CorkDispatcher, Job
from bentoml._internal.runner.container import AutoContainer
from bentoml.exceptions import ServiceUnavailable

from serving.metrics import ModelMetrics

Rows = TypeVar("Rows", np.ndarray, list)


def _overloaded() -> NoReturn:
    raise ServiceUnavailable("process is overloaded")


class _MeteredDispatcher(CorkDispatcher):
    """Reports each request's wait in the queue, from BentoML's own enqueue stamp."""

    def __init__(self, *args: Any, observe_wait: Callable[[float], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._observe_wait = observe_wait

    async def outbound_call(self, inputs_info: tuple[Job, ...], training: bool = False) -> None:
        started = time.time()  # the clock of Job.enqueue_time
        for job in inputs_info:
            self._observe_wait(max(0.0, started - job.enqueue_time))
        await super().outbound_call(inputs_info, training)


class InProcessBatcher(Generic[Rows]):
    """`await batcher(rows)` runs `predict` on a batch merged from concurrent callers' rows."""

    def __init__(
        self,
        predict: Callable[[Rows], np.ndarray],
        *,
        max_batch_size: int,
        max_latency_ms: int,
        metrics: ModelMetrics,
    ) -> None:
        self._predict = predict
        self._metrics = metrics
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{metrics.endpoint}")
        dispatcher = _MeteredDispatcher(
            max_latency_in_ms=max_latency_ms,
            max_batch_size=max_batch_size,
            fallback=_overloaded,
            get_batch_size=len,
            observe_wait=metrics.observe_queue_wait,
        )
        self._call = dispatcher(self._run_merged)

    async def __call__(self, rows: Rows) -> np.ndarray:
        return await self._call(rows)

    async def _run_merged(self, parts: Sequence[Rows]) -> list[np.ndarray]:
        batch, indices = AutoContainer.batches_to_batch(parts, 0)
        loop = asyncio.get_running_loop()
        with self._metrics.batch(rows=len(batch)):
            result = await loop.run_in_executor(self._engine_thread, functools.partial(self._predict, batch))
        return AutoContainer.batch_to_batches(result, indices, 0)
