"""optiserve: a front service (HTTP, decoding, tokenizing, batching) over one ONNX session per task.

Which stored model serves which endpoint, and its batching settings, come from the serving
manifest that `make optimize` writes (see serving/manifest.py). Where the sessions run is
`OPTISERVE_MODEL_PLACEMENT` (serving/settings.py): in the front worker, behind our batcher with
admission control (default, serving/batching.py), or in one batched BentoML model service per task.
"""

from __future__ import annotations

from pathlib import Path

import bentoml
import numpy as np
from starlette.responses import Response

from serving import api
from serving.classify import ImageClassifier, load_class_names
from serving.embed import TextEmbedder
from serving.engine import EngineSettings
from serving.manifest import Route, load_manifest
from serving.metrics import ModelMetrics
from serving.model_calls import MODEL_CONNECTIONS, BatchedModel, RemoteModel, in_process_model
from serving.model_runtime import load_runtime, read_spec
from serving.model_spec import TOKENIZER_FILE
from serving.openapi import AmendedOpenAPI
from serving.process import freeze_startup_heap
from serving.schemas import (
    ClassifyBatchRequest,
    ClassifyBatchResponse,
    ClassifyRequest,
    ClassifyResponse,
    EmbedRequest,
    EmbedResponse,
)
from serving.settings import front_workers, model_placement
from serving.text import TextTokenizer

manifest = load_manifest()
classify_route, embed_route = manifest.classify, manifest.embed
if classify_route is None and embed_route is None:
    raise RuntimeError("the serving manifest routes no endpoint: nothing to serve")
IN_PROCESS = model_placement() == "in-process"

MODEL_SERVICE = {"workers": 1, "traffic": {"timeout": 120}, "runner_connection": MODEL_CONNECTIONS}


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


if classify_route is not None and not IN_PROCESS:

    @bentoml.service(**MODEL_SERVICE)
    class ImageModel(ModelService):
        endpoint, route = "classify", classify_route
        stored = bentoml.models.BentoModel(classify_route.tag)

        @bentoml.api(
            batchable=True,
            max_batch_size=classify_route.max_batch_size,
            max_latency_ms=classify_route.max_latency_ms,
        )
        def predict(self, images: np.ndarray) -> np.ndarray:
            with self.metrics.batch(rows=len(images)):
                return self.runtime.predict(images)


if embed_route is not None and not IN_PROCESS:

    @bentoml.service(**MODEL_SERVICE)
    class TextModel(ModelService):
        endpoint, route = "embed", embed_route
        stored = bentoml.models.BentoModel(embed_route.tag)

        @bentoml.api(
            batchable=True,
            max_batch_size=embed_route.max_batch_size,
            max_latency_ms=embed_route.max_latency_ms,
        )
        def predict(self, token_ids: list[list[int]]) -> np.ndarray:
            with self.metrics.batch(rows=len(token_ids)):
                return self.runtime.predict(token_ids)


@bentoml.service(name="optiserve", workers=front_workers(), traffic={"timeout": 120})
class Optiserve:
    """Image classification and text embedding, each from a stored, measured ONNX model."""

    classifier: ImageClassifier | None = None
    classifier_tag = ""
    embedder: TextEmbedder | None = None
    embedder_tag = ""

    if classify_route is not None:
        image_stored = bentoml.models.BentoModel(classify_route.tag)
        if not IN_PROCESS:
            image_model = bentoml.depends(ImageModel)
    if embed_route is not None:
        text_stored = bentoml.models.BentoModel(embed_route.tag)
        if not IN_PROCESS:
            text_model = bentoml.depends(TextModel)

    def __init__(self) -> None:
        if classify_route is not None:
            spec = read_spec(self.image_stored.info.metadata)
            self.classifier_tag = str(self.image_stored.tag)
            self.classifier = ImageClassifier(
                spec=spec.image,
                class_names=load_class_names(Path(self.image_stored.path)),
                model=self.batched_model("classify", self.image_stored, classify_route, remote="image_model"),
                max_items_per_request=classify_route.max_items_per_request,
            )
        if embed_route is not None:
            spec = read_spec(self.text_stored.info.metadata)
            self.embedder_tag = str(self.text_stored.tag)
            self.embedder = TextEmbedder(
                tokenizer=TextTokenizer(Path(self.text_stored.path) / TOKENIZER_FILE, max_length=spec.text.max_length),
                model=self.batched_model("embed", self.text_stored, embed_route, remote="text_model"),
                max_items_per_request=embed_route.max_items_per_request,
            )
        freeze_startup_heap()

    def batched_model(self, endpoint: str, stored: bentoml.Model, route: Route, *, remote: str) -> BatchedModel:
        """The model in this process behind our batcher, or the model service's batchable API."""
        if IN_PROCESS:
            return in_process_model(endpoint, stored, route, processes=front_workers())
        return RemoteModel(lambda: getattr(self, remote).to_async.predict, route)

    # The endpoints read their own bodies (serving/api.py): BentoML passes the declared fields unread.

    @bentoml.api(input_spec=ClassifyRequest, output_spec=ClassifyResponse)
    async def classify(self, ctx: bentoml.Context, **unread: None) -> ClassifyResponse | Response:
        """Classify one image: a multipart file field `image`, or the whole body as an image."""
        return await api.answer(ctx, api.classify, self)

    @bentoml.api(input_spec=ClassifyBatchRequest, output_spec=ClassifyBatchResponse)
    async def classify_batch(self, ctx: bentoml.Context, **unread: None) -> ClassifyBatchResponse | Response:
        """Classify several images (repeated multipart field `images`), answered in request order."""
        return await api.answer(ctx, api.classify_batch, self)

    @bentoml.api(input_spec=EmbedRequest, output_spec=EmbedResponse)
    async def embed(self, ctx: bentoml.Context, **unread: None) -> EmbedResponse | Response:
        """Embed texts (interactive: refused at once when it cannot be answered in time)."""
        return await api.answer(ctx, api.embed, self)

    @bentoml.task(input_spec=EmbedRequest, output_spec=EmbedResponse)
    async def embed_bulk(self, ctx: bentoml.Context, **unread: None) -> EmbedResponse | Response:
        """Embed a large job of texts at low priority, in the engine's spare time: submit, poll, get."""
        return await api.answer(ctx, api.embed_bulk, self)


Optiserve.add_asgi_middleware(AmendedOpenAPI, service=Optiserve)
