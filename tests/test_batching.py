"""The in-process batcher: BentoML's dispatcher merging concurrent callers' rows in the front."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from serving.batching import InProcessBatcher
from serving.metrics import ModelMetrics


class RecordingModel:
    """A real (tiny) model: doubles its rows, slowly enough for callers to queue up."""

    def __init__(self, seconds: float = 0.02) -> None:
        self.seconds = seconds
        self.batches: list[int] = []
        self.threads: set[str] = set()

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        self.batches.append(len(rows))
        self.threads.add(threading.current_thread().name)
        time.sleep(self.seconds)
        return np.asarray(rows, dtype=np.float32) * 2


def batcher(model, *, max_batch_size: int = 8, endpoint: str = "test") -> InProcessBatcher:
    return InProcessBatcher(
        model,
        max_batch_size=max_batch_size,
        max_latency_ms=10_000,
        metrics=ModelMetrics(endpoint=endpoint, model="m:1"),
    )


async def call_concurrently(run: InProcessBatcher, requests: list) -> list[np.ndarray]:
    return await asyncio.gather(*(run(r) for r in requests))


def test_concurrent_callers_share_batches_and_get_their_own_rows_back() -> None:
    model = RecordingModel()
    run = batcher(model, max_batch_size=8)
    requests = [np.full((1 + i % 3, 4), i, dtype=np.float32) for i in range(40)]

    results = asyncio.run(call_concurrently(run, requests))

    for request, result in zip(requests, results, strict=True):
        np.testing.assert_array_equal(result, request * 2)
    assert sum(model.batches) == sum(len(r) for r in requests)
    assert len(model.batches) < len(requests), "no request shared a batch"
    assert max(model.batches) <= 8, "a batch exceeded max_batch_size rows"


def test_token_rows_are_merged_as_lists() -> None:
    def lengths(rows: list[list[int]]) -> np.ndarray:
        return np.asarray([[len(row)] for row in rows], dtype=np.float32)

    run = batcher(lengths, max_batch_size=4)
    requests = [[[1] * (i + 1), [2] * (i + 2)] for i in range(6)]

    results = asyncio.run(call_concurrently(run, requests))

    assert [r.ravel().tolist() for r in results] == [[i + 1, i + 2] for i in range(6)]


def test_the_engine_runs_on_its_own_thread() -> None:
    model = RecordingModel(seconds=0)
    asyncio.run(call_concurrently(batcher(model, endpoint="thread"), [np.ones((1, 2))] * 5))
    assert model.threads == {"engine-thread_0"}


def test_a_failing_batch_fails_its_callers_and_the_next_batch_runs() -> None:
    calls = []

    def fails_once(rows: np.ndarray) -> np.ndarray:
        calls.append(len(rows))
        if len(calls) == 1:
            raise RuntimeError("engine error")
        return np.asarray(rows)

    run = batcher(fails_once)

    async def scenario() -> None:
        with pytest.raises(RuntimeError, match="engine error"):
            await run(np.ones((1, 2)))
        np.testing.assert_array_equal(await run(np.zeros((2, 2))), np.zeros((2, 2)))

    asyncio.run(scenario())


def test_queue_wait_inference_time_and_rows_are_recorded_per_model() -> None:
    from prometheus_client import REGISTRY

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"endpoint": "metered", "model": "m:1"}) or 0.0

    requests = [np.ones((2, 3))] * 6
    asyncio.run(call_concurrently(batcher(RecordingModel(), endpoint="metered"), requests))

    assert sample("optiserve_batch_rows_sum") == 12
    assert sample("optiserve_inference_seconds_count") == sample("optiserve_batch_rows_count") >= 1
    assert sample("optiserve_inference_seconds_sum") > 0
    assert sample("optiserve_batch_queue_seconds_count") == 6


def test_requests_that_cannot_make_their_deadline_are_shed_as_overload() -> None:
    from bentoml.exceptions import ServiceUnavailable

    run = InProcessBatcher(
        RecordingModel(seconds=0.1),
        max_batch_size=2,
        max_latency_ms=150,
        metrics=ModelMetrics(endpoint="shed", model="m:1"),
    )

    async def flood() -> list:
        return await asyncio.gather(*(run(np.ones((1, 2))) for _ in range(24)), return_exceptions=True)

    outcomes = asyncio.run(flood())
    shed = [o for o in outcomes if isinstance(o, ServiceUnavailable)]
    served = [o for o in outcomes if isinstance(o, np.ndarray)]
    assert shed and served and len(shed) + len(served) == 24
