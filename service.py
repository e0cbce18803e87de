"""optiserve: a front service (HTTP, decoding, tokenizing, batching) over one ONNX session per model.

Which stored models are served, which of them answer the default endpoints (/classify, /embed),
and their batching settings, come from the serving manifest that `make optimize` writes (see
serving/manifest.py); every model is also served at its own path, /models/<name>/<endpoint>, with
its own batcher. Where the sessions run is `OPTISERVE_MODEL_PLACEMENT` (serving/settings.py): in
the front worker, behind our batcher with admission control (default, serving/batching.py), or in
one batched BentoML model service per model (serving/model_services.py); serving/model_calls.py
`batched_model` gives the front its handle either way. Each route serves its alias once one is
set (serving/aliases.py); in process, the service follows an alias change without a restart
(serving/lifecycle.py).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import bentoml
from starlette.responses import Response

from serving import api
from serving.aliases import aliases_path
from serving.bulk_routes import BulkTaskGuard
from serving.cache import ResponseCache
from serving.direct import DirectEndpoints, Handler
from serving.door import Door, EarlyRetries, Guard
from serving.http_metrics import HttpTraffic, service_paths
from serving.lifecycle import AliasWatcher, Split, front_class, open_front
from serving.log_output import write_logs_in_background
from serving.manifest import DEFAULT_ENDPOINTS, Route, load_manifest, manifest_path, model_path
from serving.metrics import sample_resident_memory
from serving.model_services import model_service
from serving.openapi import AmendedOpenAPI
from serving.process import (
    freeze_startup_heap,
    give_back_memory_when_quiet,
    raise_open_files_limit,
    run_new_tasks_eagerly,
)
from serving.schemas import (
    ClassifyBatchRequest,
    ClassifyBatchResponse,
    ClassifyRequest,
    ClassifyResponse,
    EmbedRequest,
    EmbedResponse,
)
from serving.settings import front_workers, traffic_timeout_s
from serving.tracing import RequestTracing, bentoml_tracing


def identifier(model: str) -> str:
    """A model's name as a Python name: its APIs' and its class attributes' names derive from it."""
    return re.sub(r"\W", "_", model)


def service_name(model: str) -> str:
    """The model service's name for a model: image-classifier → ImageClassifierModel."""
    return re.sub(r"[^A-Za-z0-9]", "", model.title()) + "Model"


def kind_of(name: str, route: Route) -> str:
    """The endpoints a route answers: its default endpoint's, or those of its stored model's task."""
    return name if name in DEFAULT_ENDPOINTS else front_class(bentoml.models.get(route.tag)).kind


manifest = load_manifest()
routes = manifest.routes()
if not routes:
    raise RuntimeError("the serving manifest routes no model: nothing to serve")
door_guards: dict[str, Guard] = {}  # filled once the models are loaded (serving/door.py)
direct_handlers: dict[str, Handler] = {}  # the same (serving/direct.py)
early_retries = EarlyRetries.from_environment()
kinds = {name: kind_of(name, route) for name, route in routes.items()}
# Under the `service` placement, one model service per route, a dependency of the front's (else None).
model_services = {name: model_service(service_name(route.recipe), name, route) for name, route in routes.items()}


class Optiserve:
    """Image classification and text embedding, each from a stored, measured ONNX model."""

    early_retries = early_retries

    def __init__(self) -> None:
        self.routes: dict[str, api.Routed] = {
            endpoint: api.Routed(endpoint, endpoint, endpoint, None) for endpoint in DEFAULT_ENDPOINTS
        }
        for name, route in routes.items():
            stored = getattr(self, f"stored_{identifier(name)}")
            service = getattr(self, f"model_{identifier(name)}", None)
            # A canary or a shadow joins once the alias watcher has loaded it, within seconds of the start.
            split = Split.of(route, open_front(name, stored, route, service))
            cache = ResponseCache.of_megabytes(route.cache_mb, endpoint=name)
            self.routes[name] = api.Routed(name, route.recipe, kinds[name], split, cache)
        self.watcher = AliasWatcher.watching(
            aliases_path(manifest_path()), routes, {name: self.routes[name].split for name in routes}
        )
        door_guards.update(api.door_guards(self.routes))
        direct_handlers.update(api.direct_handlers(self))
        freeze_startup_heap()

    @bentoml.on_startup
    async def start_background_tasks(self) -> None:
        """On the serving loop while the service runs: hot swaps (polling the alias file) and the
        worker's memory gauge and its return of what a burst freed. New tasks run eagerly from here
        on where Python has them, log output is written by a thread of its own, and the worker may
        hold as many connections as the hard limit on open files allows."""
        run_new_tasks_eagerly()
        write_logs_in_background()
        raise_open_files_limit()
        self.background = [
            asyncio.create_task(self.watcher.run(), name="alias-watcher"),
            asyncio.create_task(sample_resident_memory(), name="memory-sampler"),
            asyncio.create_task(give_back_memory_when_quiet(), name="memory-trim"),
        ]

    @bentoml.on_shutdown
    async def stop_background_tasks(self) -> None:
        for task in self.background:
            task.cancel()

    # The endpoints read their own bodies (serving/api.py): BentoML passes the declared fields unread.
    # Each model is also served at its own path (`model_endpoints`, below).

    @bentoml.api(input_spec=ClassifyRequest, output_spec=ClassifyResponse)
    async def classify(self, ctx: bentoml.Context, **unread: None) -> Response:
        """Classify one image: a multipart file field `image`, or the whole body as an image."""
        return await api.answer(ctx, api.classify, self, "classify")

    @bentoml.api(input_spec=ClassifyBatchRequest, output_spec=ClassifyBatchResponse)
    async def classify_batch(self, ctx: bentoml.Context, **unread: None) -> Response:
        """Classify several images (repeated multipart field `images`), answered in request order."""
        return await api.answer(ctx, api.classify_batch, self, "classify")

    @bentoml.api(input_spec=EmbedRequest, output_spec=EmbedResponse)
    async def embed(self, ctx: bentoml.Context, **unread: None) -> Response:
        """Embed texts (interactive: refused at once when it cannot be answered in time)."""
        return await api.answer(ctx, api.embed, self, "embed")

    @bentoml.task(input_spec=EmbedRequest, output_spec=EmbedResponse)
    async def embed_bulk(self, ctx: bentoml.Context, **unread: None) -> Response:
        """Embed a large job of texts at low priority, in the engine's spare time: submit, poll, get."""
        return await api.answer(ctx, api.embed_bulk, self, "embed")


# The BentoML APIs of one operation at a model's own path: the specs and the description (the
# endpoint function is api.ENDPOINTS').
MODEL_OPERATIONS = {
    "classify": (ClassifyRequest, ClassifyResponse, "Classify one image with {model}, as /classify."),
    "classify_batch": (
        ClassifyBatchRequest,
        ClassifyBatchResponse,
        "Classify several images with {model}, as /classify_batch.",
    ),
    "embed": (EmbedRequest, EmbedResponse, "Embed texts with {model}, as /embed."),
}


def model_endpoint(name: str, model: str, operation: str) -> Any:
    """The BentoML API answering `operation` at /models/<model>/<operation>, on the route `name`."""
    endpoint, (request, response, description) = api.ENDPOINTS[operation], MODEL_OPERATIONS[operation]

    async def answer(self: Optiserve, ctx: bentoml.Context, **unread: None) -> Any:
        return await api.answer(ctx, endpoint, self, name)

    # BentoML names an API after its function, and finds it on the service by that name.
    answer.__name__ = answer.__qualname__ = f"{identifier(model)}_{operation}"
    answer.__doc__ = description.format(model=model)
    route = f"{model_path(model)}/{operation}"
    return answer.__name__, bentoml.api(route=route, input_spec=request, output_spec=response)(answer)


# Per route: its stored model (which `bentoml build` packs), its model service, its model's own APIs.
for _name, _route in routes.items():
    setattr(Optiserve, f"stored_{identifier(_name)}", bentoml.models.BentoModel(_route.tag))
    if model_services[_name] is not None:
        setattr(Optiserve, f"model_{identifier(_name)}", bentoml.depends(model_services[_name]))
    for _operation in api.OPERATIONS[kinds[_name]]:
        setattr(Optiserve, *model_endpoint(_name, _route.recipe, _operation))

# BentoML's own access line is replaced by serving/tracing.py's JSON one (OPTISERVE_ACCESS_LOG).
Optiserve = bentoml.service(
    name="optiserve",
    workers=front_workers(),
    traffic={"timeout": traffic_timeout_s(max(r.max_latency_ms for r in routes.values()) / 1000, reads_bodies=True)},
    logging={"access": {"enabled": False}},
    metrics={"enabled": False},  # BentoML's HTTP series label raw paths: serving/http_metrics.py's instead
    tracing=bentoml_tracing("optiserve"),
)(Optiserve)
Optiserve.add_asgi_middleware(RequestTracing)  # the outermost of ours: refusals at the door carry its headers too
Optiserve.add_asgi_middleware(HttpTraffic, paths=service_paths(Optiserve.apis.values()))
Optiserve.add_asgi_middleware(
    BulkTaskGuard, routes=(Optiserve.apis["embed_bulk"].route,), limit=api.MAX_BULK_BODY_BYTES
)
Optiserve.add_asgi_middleware(Door, guards=door_guards, early_retries=early_retries)
Optiserve.add_asgi_middleware(AmendedOpenAPI, service=Optiserve)
Optiserve.add_asgi_middleware(DirectEndpoints, handlers=direct_handlers)
