"""The front's handle on a batched model: in this process (our batcher) or in a model service.

Both offer `admit(rows)`, a context in which the request holds its place, and `run(rows,
admission)`. In process, admission is the batcher's (serving/batching.py). In a BentoML model
service, BentoML's batcher queues the request on the far side and sheds it with a 503 when
it cannot make `max_latency_ms`; the front admits everything.

Calls into a model service are hardened against dropped connections. BentoML's client to a
dependency service replaces its aiohttp session every `runner_connection.max_requests`
requests (default 100) and `max_age` seconds (default 300), closing the old session while
other requests are still in flight on it. Those requests fail with `ServerDisconnectedError`,
which reached users as 500s: about 3 % of /classify requests at concurrency 4 and more at
higher concurrency, measured with `python -m loadtest`. Two measures, both through BentoML's
public surface:

- `MODEL_CONNECTIONS` is the model services' `runner_connection` setting: the front's
  loopback connections to a sibling worker are kept instead of being recycled.
- `call_model` retries a model call once on a connection-level failure. A model call is a
  pure function of its input, so repeating it is safe; a keep-alive connection the server
  closes at the moment of reuse is then invisible to the user.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol, TypeVar

import aiohttp
import bentoml
import numpy as np

from serving.batching import Admission, Batcher, BatchLimits
from serving.engine import EngineSettings
from serving.errors import Refused
from serving.manifest import Route
from serving.metrics import ModelMetrics
from serving.model_runtime import TextModelRuntime, load_runtime
from serving.settings import engine_niceness, front_workers, max_queue_rows, model_placement

logger = logging.getLogger(__name__)

MODEL_CONNECTIONS = {"max_requests": 2**31 - 1, "max_age": 1.0e9}
LOWEST_PRIORITY = 19  # how much a background model's engine thread is lowered: to nice 19

# Sees a model call's rows, outputs and seconds once the answer is ready (a shadow: serving/shadow.py).
Observer = Callable[[np.ndarray | list, np.ndarray, float], None]

In = TypeVar("In")
Out = TypeVar("Out")


class BatchedModel(Protocol):
    def admit(
        self, rows: int, *, timeout_ms: float | None = None, low: bool = False
    ) -> AbstractContextManager[Admission]: ...

    def place_at_door(self, timeout_ms: float | None = None) -> Refused | AbstractContextManager[None]: ...

    async def run(self, rows: np.ndarray | list, admission: Admission) -> np.ndarray: ...

    async def run_bulk(self, rows: np.ndarray | list) -> np.ndarray: ...

    def close(self) -> None: ...


def batched_model(endpoint: str, stored: bentoml.Model, route: Route, service: Any) -> BatchedModel:
    """The route's model where OPTISERVE_MODEL_PLACEMENT puts it: in this process behind our
    batcher, or in its model service (serving/model_services.py), `service` the front's client."""
    if model_placement() == "in-process":
        return in_process_model(endpoint, stored, route, processes=front_workers())
    return RemoteModel(service, route)


def in_process_model(
    endpoint: str, stored, route: Route, *, processes: int, light_warm_up: bool = False, background: bool = False
) -> Batcher:
    """The stored model's session in this process, behind our batcher with the route's limits.
    `light_warm_up`: one row (texts: one short, one of the longest) instead of the largest batch,
    for a hot swap beside traffic (serving/lifecycle.py), where the largest batch, 8 × 256 tokens,
    took 1.4–1.9 s of both cores; a larger batch then grows the session's memory once, on traffic.
    `background` (a shadow, serving/shadow.py): one intra-op thread, the engine thread's own, at
    the lowest CPU priority, so that it takes only the cores the answers leave idle; at normal
    priority (one thread too) it slowed /embed's p50 at concurrency 1 by 24 %.

    Every engine thread, the batcher's and the engine's own pool, runs below the event loop's
    priority (`engine_niceness`): the session is opened on a thread lowered first, whose pool
    threads inherit its nice value, and the batcher's thread lowers itself on its first batch."""
    settings = EngineSettings.from_environment(processes=processes)
    niceness = LOWEST_PRIORITY if background else engine_niceness()
    if background:
        settings = dataclasses.replace(settings, intra_op_threads=1)
    runtime = on_lowered_thread(
        niceness,
        lambda: load_runtime(
            endpoint,
            stored,
            max_batch_size=1 if light_warm_up else route.max_batch_size,
            max_batch_tokens=None if light_warm_up else route.max_batch_tokens,
            settings=settings,
        ),
    )
    limits = BatchLimits(
        max_batch_size=route.max_batch_size,
        max_batch_tokens=route.max_batch_tokens,
        max_latency_ms=route.max_latency_ms,
        max_queue_rows=max_queue_rows(route.max_batch_size),
    )
    metrics = ModelMetrics(endpoint=endpoint, model=str(stored.tag))
    predict = at_priority(runtime.predict, niceness)
    return Batcher(predict, limits=limits, metrics=metrics, tokens=isinstance(runtime, TextModelRuntime))


def lower_this_thread(niceness: int) -> None:
    """This thread's nice value raised by `niceness`. Linux sets it per thread, threads inherit it
    from the thread that starts them, and raising it needs no privilege."""
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + niceness))
    except OSError as exc:
        logger.warning("could not lower the priority of thread %d (%s): it runs at the normal one", thread, exc)


def on_lowered_thread(niceness: int, build: Callable[[], Out]) -> Out:
    """`build()`, run on a thread of its own lowered by `niceness`, so that the threads it starts
    (ONNX Runtime's intra-op pool) run lowered too."""
    if not niceness:
        return build()
    with ThreadPoolExecutor(1, initializer=lower_this_thread, initargs=(niceness,)) as pool:
        return pool.submit(build).result()


def at_priority(predict: Callable[[Any], np.ndarray], niceness: int) -> Callable[[Any], np.ndarray]:
    """`predict`, its calling thread (a batcher's engine thread: its own) lowered by `niceness`
    on its first call."""
    if not niceness:
        return predict
    lowered: set[int] = set()

    def run(rows: Any) -> np.ndarray:
        thread = threading.get_native_id()
        if thread not in lowered:
            lowered.add(thread)
            lower_this_thread(niceness)
        return predict(rows)

    return run


class RemoteModel:
    """A model service's batchable `predict`, called in chunks of at most its batch size."""

    def __init__(self, service: Any, route: Route):
        """`service` is the front's client of the model service (its `bentoml.depends`): BentoML
        sets up the client's methods only once the front has started, so `predict` is looked up per call."""
        self._service = service
        self._route = route

    @contextmanager
    def admit(self, rows: int, *, timeout_ms: float | None = None, low: bool = False) -> Iterator[Admission]:
        """Everything: the model service's batcher has no admission control, nor priorities."""
        yield Admission(deadline=math.inf, reserved_rows=0, reserved_cost=0.0)

    def place_at_door(self, timeout_ms: float | None = None) -> Refused | AbstractContextManager[None]:
        return nullcontext()

    async def run(self, rows: np.ndarray | list, admission: Admission) -> np.ndarray:
        return await self.run_bulk(rows)

    async def run_bulk(self, rows: np.ndarray | list) -> np.ndarray:
        """The model service's batcher has no priorities: bulk rows queue like any others."""
        size = self._route.max_batch_size
        chunks = [rows[start : start + size] for start in range(0, len(rows), size)]
        return np.concatenate(await asyncio.gather(*(call_model(self._service.to_async.predict, c) for c in chunks)))

    def close(self) -> None:
        """Nothing to release: the model service owns the session."""


async def call_model(call: Callable[[In], Awaitable[Out]], value: In) -> Out:
    """`await call(value)`, once more if the connection to the model service broke."""
    try:
        return await call(value)
    except aiohttp.ClientConnectionError as exc:
        logger.warning("model call lost its connection (%s); retrying once", exc)
        return await call(value)
