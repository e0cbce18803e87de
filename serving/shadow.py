"""Shadow traffic: a share of an endpoint's requests also runs on its shadow model, in the background.

The primary's answer goes back as soon as it is ready; the shadow gets the same model rows (the
decoded pixels, the token ids) afterwards, on its own batcher, and its answer is never returned.
At most `MAX_IN_FLIGHT` shadow runs per endpoint are under way at once; a request beyond that,
or one the shadow's batcher refuses (its queue, its deadline), is dropped and counted, so a slow
or busy shadow never queues up behind the traffic. Its session runs on one thread at the lowest
CPU priority (serving/model_calls.py `in_process_model`), on the cores the answers leave idle.

Each compared request is exported per pair of models (serving/metrics.py `ShadowMetrics`): for a
classifier top-1 agreement and how far the shadow's score of the primary's top class is from the
primary's, for an embedder the cosine of the two vectors, each model's call time.
`python -m pipeline shadow-report URL` prints them, for a user deciding whether to promote.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import numpy as np

from serving.errors import Refused
from serving.lifecycle import Slot, Split
from serving.manifest import route_path
from serving.metrics import ShadowMetrics
from serving.model_calls import Observer
from serving.model_runtime import answered_by_teacher

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT = 2  # shadow runs per endpoint at once; more are dropped


def compare_classes(primary: np.ndarray, shadow: np.ndarray) -> dict[str, np.ndarray]:
    """Per row: 1 where the shadow's top class is the primary's, else 0; and the difference of the
    two models' scores of the primary's top class."""
    top = primary.argmax(axis=1)
    rows = np.arange(len(top))
    return {
        "top1_agreement": (shadow.argmax(axis=1) == top).astype(np.float64),
        "score_difference": np.abs(primary[rows, top] - shadow[rows, top]),
    }


def compare_embeddings(primary: np.ndarray, shadow: np.ndarray) -> dict[str, np.ndarray]:
    """Per row: the cosine of the two models' vectors."""
    norms = np.linalg.norm(primary, axis=1) * np.linalg.norm(shadow, axis=1)
    return {"cosine": (primary * shadow).sum(axis=1) / np.maximum(norms, 1e-12)}


COMPARE: dict[str, Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]] = {  # by the models' kind
    "classify": compare_classes,
    "embed": compare_embeddings,
}


def shadowing(split: Split, endpoint: str, primary: str, request_id: str | None) -> Observer | None:
    """What hands the request's model call to the endpoint's shadow once the primary has answered,
    if the request is in the shadow's share; None otherwise."""
    slot = split.shadowed(request_id)
    if slot is None:
        return None

    def offer(rows: np.ndarray | list, outputs: np.ndarray, seconds: float) -> None:
        if len(split.shadow_runs) >= MAX_IN_FLIGHT:
            ShadowMetrics(endpoint=endpoint, primary=primary, shadow=slot.model.tag).count("dropped")
            return
        run = asyncio.get_running_loop().create_task(_shadow(slot, endpoint, primary, rows, outputs, seconds))
        split.shadow_runs.add(run)
        run.add_done_callback(split.shadow_runs.discard)

    return offer


async def _shadow(
    slot: Slot, endpoint: str, primary: str, rows: np.ndarray | list, outputs: np.ndarray, seconds: float
) -> None:
    with slot.lease() as front:
        metrics = ShadowMetrics(endpoint=endpoint, primary=primary, shadow=front.tag)
        started = time.perf_counter()
        try:
            with front.model.admit(len(rows)) as admission:
                shadowed = await front.model.run(rows, admission)
            if front.cascade:
                shadowed, _ = answered_by_teacher(shadowed)
            elapsed = time.perf_counter() - started
        except Refused:
            metrics.count("dropped")
            return
        except Exception:  # a fault of the shadow's is the shadow's: logged and counted, no one waits on it
            logger.exception("%s: the shadow %s failed", route_path(endpoint), front.tag)
            metrics.count("failed")
            return
    metrics.compared(COMPARE[front.kind](outputs, shadowed), {"primary": seconds, "shadow": elapsed})
