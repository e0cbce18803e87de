"""optiserve: a front service (HTTP, decoding, tokenizing, batching) over one ONNX session per task.

Which stored model serves which endpoint, and its batching settings, come from the serving
manifest that `make optimize` writes (see serving/manifest.py). Where the sessions run is
`OPTISERVE_MODEL_PLACEMENT` (serving/settings.py): in the front worker, behind our batcher with
admission control (default, serving/batching.py), or in one batched BentoML model service per task
(serving/model_services.py); serving/model_calls.py `batched_model` gives the front its handle either way.
Each route serves its alias once one is set (serving/aliases.py); in process, the service follows
an alias change without a restart (serving/lifecycle.py).
"""

from __future__ import annotations

import asyncio

import bentoml
from starlette.responses import Response

from serving import api
from serving.aliases import aliases_path
from serving.cache import ResponseCache
from serving.classify import ImageClassifier
from serving.door import Door, Guard, RefusalPacer
from serving.embed import TextEmbedder
from serving.lifecycle import AliasWatcher, Split, open_front
from serving.manifest import load_manifest, manifest_path
from serving.model_services import model_service
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
from serving.settings import front_workers
from serving.tracing import RequestTracing

manifest = load_manifest()
classify_route, embed_route = manifest.classify, manifest.embed
if classify_route is None and embed_route is None:
    raise RuntimeError("the serving manifest routes no endpoint: nothing to serve")
door_guards: dict[str, Guard] = {}  # filled once the models are loaded (serving/door.py)
refusal_pacer = RefusalPacer.from_environment()
ImageModel = model_service("ImageModel", "classify", classify_route)  # None unless the placement is `service`
TextModel = model_service("TextModel", "embed", embed_route)


# BentoML's own access line is replaced by serving/tracing.py's JSON one (OPTISERVE_ACCESS_LOG).
@bentoml.service(
    name="optiserve", workers=front_workers(), traffic={"timeout": 120}, logging={"access": {"enabled": False}}
)
class Optiserve:
    """Image classification and text embedding, each from a stored, measured ONNX model."""

    image_stored = bentoml.models.BentoModel(classify_route.tag) if classify_route is not None else None
    image_model = bentoml.depends(ImageModel) if ImageModel is not None else None
    text_stored = bentoml.models.BentoModel(embed_route.tag) if embed_route is not None else None
    text_model = bentoml.depends(TextModel) if TextModel is not None else None
    classifier: Split[ImageClassifier] | None = None  # set in __init__ where the manifest routes a model
    embedder: Split[TextEmbedder] | None = None
    refusal_pacer = refusal_pacer

    def __init__(self) -> None:
        self.caches = {
            endpoint: cache
            for endpoint, route in (("classify", classify_route), ("embed", embed_route))
            if route is not None and (cache := ResponseCache.of_megabytes(route.cache_mb, endpoint=endpoint))
        }
        # A canary or a shadow joins once the alias watcher has loaded it, within seconds of the start.
        if classify_route is not None:
            front = open_front("classify", self.image_stored, classify_route, self.image_model)
            self.classifier = Split.of(classify_route, front)
        if embed_route is not None:
            front = open_front("embed", self.text_stored, embed_route, self.text_model)
            self.embedder = Split.of(embed_route, front)
        self.watcher = AliasWatcher.watching(
            aliases_path(manifest_path()),
            {"classify": classify_route, "embed": embed_route},
            {"classify": self.classifier, "embed": self.embedder},
        )
        door_guards.update(api.door_guards(self))
        freeze_startup_heap()

    @bentoml.on_startup
    async def follow_aliases(self) -> None:
        """Hot swap: poll the alias file on the serving loop while the service runs."""
        self.following = asyncio.create_task(self.watcher.run(), name="alias-watcher")

    @bentoml.on_shutdown
    async def stop_following(self) -> None:
        self.following.cancel()

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


Optiserve.add_asgi_middleware(RequestTracing)  # the outermost of ours: refusals at the door carry its headers too
Optiserve.add_asgi_middleware(Door, guards=door_guards, pacer=refusal_pacer)
Optiserve.add_asgi_middleware(AmendedOpenAPI, service=Optiserve)
