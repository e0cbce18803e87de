"""The `service` placement's model services: one batched BentoML service per routed model.

Each runs the route's ONNX session in one worker and declares `predict` batchable, so BentoML
merges the calls of every front worker into the route's batches (serving/model_calls.py
`RemoteModel` makes those calls). The services differ only in their route and the rows they
take, so one factory makes them all; service.py makes one per route and declares each a
dependency of the front (`bentoml.depends`), where `bentoml serve` finds it.
"""

from __future__ import annotations

from typing import Any

import bentoml
import numpy as np
from pydantic import Field, create_model

from serving.engine import EngineSettings
from serving.manifest import Route
from serving.metrics import ModelMetrics
from serving.model_calls import MODEL_CONNECTIONS
from serving.model_runtime import load_runtime, read_spec
from serving.model_spec import Task
from serving.settings import model_placement, traffic_timeout_s

# Each task's rows as its model service's `predict` declares them: decoded images, or token ids.
ROWS: dict[Task, tuple[str, Any]] = {
    "image-classification": ("images", np.ndarray),
    "text-embedding": ("token_ids", list[list[int]]),
}


class ModelService:
    """One batched model per worker process: BentoML batches requests from every front worker."""

    endpoint: str
    route: Route
    stored: bentoml.Model

    def __init__(self) -> None:
        settings = EngineSettings.from_environment()
        self.runtime = load_runtime(
            self.endpoint, self.stored, max_batch_size=self.route.max_batch_size, settings=settings
        )
        self.metrics = ModelMetrics(endpoint=self.endpoint, model=str(self.stored.tag))

    # No docstring: BentoML would publish it as the API's description, which has none.
    def predict(self, rows: np.ndarray | list[list[int]]) -> np.ndarray:
        with self.metrics.batch(rows=len(rows)):
            return self.runtime.predict(rows)


def model_service(name: str, endpoint: str, route: Route | None) -> bentoml.Service | None:
    """The BentoML service `name` running the route's model under the `service` placement; None
    in process, or where the manifest routes no model to `endpoint`."""
    if route is None or model_placement() != "service":
        return None
    field, rows = ROWS[read_spec(bentoml.models.get(route.tag).info.metadata).task]
    predict = bentoml.api(
        input_spec=create_model("Input", __base__=bentoml.IODescriptor, **{field: (rows, Field())}),
        batchable=True,
        max_batch_size=route.max_batch_size,
        max_latency_ms=route.max_latency_ms,
    )(ModelService.predict)
    stored = bentoml.models.BentoModel(route.tag)
    inner = type(name, (ModelService,), {"endpoint": endpoint, "route": route, "stored": stored, "predict": predict})
    traffic = {"timeout": traffic_timeout_s(route.max_latency_ms / 1000, reads_bodies=False)}
    return bentoml.service(name=name, workers=1, traffic=traffic, runner_connection=MODEL_CONNECTIONS)(inner)
