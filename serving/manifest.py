"""Which stored model serves which endpoint, with its batching settings.

The pipeline writes the manifest; the service reads it at import time because BentoML takes
the model reference and the batching settings in its decorators. A route names an alias
(serving/aliases.py): once the alias is set, its tag is served instead of the route's own, the
pipeline's latest build, and the service follows the alias while it runs (serving/lifecycle.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from serving.aliases import ALIAS_NAME, DEFAULT_ALIAS, Aliases, aliases_path, label, model_name, read_aliases
from serving.files import write_atomically

MANIFEST_ENV = "OPTISERVE_MANIFEST"
DEFAULT_MANIFEST = Path(__file__).resolve().parent.parent / "serving-manifest.json"
TAG_OVERRIDE_ENV = {"classify": "OPTISERVE_CLASSIFY_MODEL", "embed": "OPTISERVE_EMBED_MODEL"}


class Share(BaseModel):
    """Another alias of the endpoint's model, for a share of its requests: a canary answers them,
    a shadow runs them beside and is never returned (serving/lifecycle.py `Split`). The share is
    drawn from the request id: the same ids always, so a client's retry lands on the same side."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    alias: str = Field(pattern=ALIAS_NAME)
    percent: float = Field(gt=0, le=100)


def check_sides(alias: str, canary: Share | None, shadow: Share | None) -> None:
    """A canary and a shadow serve other aliases than the route's own and each other's (recipes and
    routes both check)."""
    named = [("canary", canary), ("shadow", shadow)]
    seen = {alias: "the route's own alias"}
    for side, share in named:
        if share is not None:
            if share.alias in seen:
                raise ValueError(f"{side}.alias: {share.alias!r} is {seen[share.alias]}")
            seen[share.alias] = f"the {side}'s alias"


class Route(BaseModel):
    """One endpoint's model and the batching its profile chose (serving/batching.py)."""

    model_config = ConfigDict(extra="forbid")
    tag: str  # the pipeline's latest build, served until the alias is set
    recipe: str
    alias: str = Field(default=DEFAULT_ALIAS, pattern=ALIAS_NAME)  # `python -m pipeline promote` moves it
    canary: Share | None = None  # answers its share of the requests once its alias is set
    shadow: Share | None = None  # runs its share of the requests beside, never answering
    max_batch_size: int = Field(ge=2)  # rows per engine call; BentoML's batchable APIs need at least 2
    max_batch_tokens: int | None = Field(default=None, ge=1)  # text: padded tokens per engine call
    max_latency_ms: int = Field(ge=1)  # a request's deadline in the server: queue wait plus its batch
    max_items_per_request: int = Field(ge=1)
    cache_mb: float | None = Field(default=None, gt=0)  # a response cache per front worker (serving/cache.py)

    @model_validator(mode="after")
    def _sides_are_other_aliases(self) -> Route:
        check_sides(self.alias, self.canary, self.shadow)
        return self


DEFAULT_ENDPOINTS = ("classify", "embed")


def model_path(model: str) -> str:
    """The prefix of a model's own endpoints: /models/<name>/classify, /models/<name>/embed, ..."""
    return f"/models/{model}"


def route_path(name: str) -> str:
    """Where a route's requests arrive, for logs: its default endpoint, or its model's own prefix."""
    return f"/{name}" if name in DEFAULT_ENDPOINTS else model_path(name)


class ServingManifest(BaseModel):
    """The default endpoints' routes, and every other served model's by its name: each model is
    served at /models/<name>/<its task's endpoint> (the defaults too), with its own batcher."""

    model_config = ConfigDict(extra="forbid")
    classify: Route | None = None
    embed: Route | None = None
    models: dict[str, Route] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_route_per_model(self) -> ServingManifest:
        defaults = {route.recipe: endpoint for endpoint, route in self.defaults().items()}
        for name, route in self.models.items():
            if name != route.recipe:
                raise ValueError(f"models.{name}: the route serves {route.recipe!r}, not the model it is named after")
            if name in defaults:
                raise ValueError(f"models.{name}: {name!r} is already served by the {defaults[name]!r} route")
        return self

    def defaults(self) -> dict[str, Route]:
        """The default endpoints' routes, where the manifest sets them."""
        return {e: route for e in DEFAULT_ENDPOINTS if (route := getattr(self, e)) is not None}

    def routes(self) -> dict[str, Route]:
        """Every route by its name: the default endpoints', then each other model's."""
        return {**self.defaults(), **self.models}

    def with_routes(self, routes: dict[str, Route]) -> ServingManifest:
        """These routes set (by name: a default endpoint or a model), every other kept, except
        another route of the same model: a recipe moved to or from a default endpoint moves."""
        recipes = {route.recipe for route in routes.values()}
        kept = {n: r for n, r in self.routes().items() if n not in routes and r.recipe not in recipes}
        merged = {**kept, **routes}
        defaults = {e: merged.pop(e, None) for e in DEFAULT_ENDPOINTS}
        return ServingManifest(**defaults, models=merged)


class ManifestError(RuntimeError):
    pass


def manifest_path() -> Path:
    return Path(os.environ.get(MANIFEST_ENV, DEFAULT_MANIFEST))


def read_manifest(path: Path) -> ServingManifest:
    if not path.is_file():
        raise ManifestError(f"no serving manifest at {path}: run `make optimize` (or set {MANIFEST_ENV})")
    try:
        return ServingManifest.model_validate_json(path.read_text())
    except ValidationError as exc:
        raise ManifestError(f"{path} is not a valid serving manifest:\n{exc}") from exc


def load_manifest(path: Path | None = None) -> ServingManifest:
    """Read the manifest, serve each route's alias where it is set, and apply per-endpoint tag
    overrides from the environment (which pin the endpoint: see `pinned`)."""
    path = path or manifest_path()
    manifest = read_manifest(path)
    aliases_file = aliases_path(path)
    aliases = read_aliases(aliases_file)
    manifest = manifest.with_routes(
        {name: aliased(route, aliases, aliases_file) for name, route in manifest.routes().items()}
    )
    for endpoint, env in TAG_OVERRIDE_ENV.items():
        route = getattr(manifest, endpoint)
        if pinned(endpoint) and route is not None:
            setattr(manifest, endpoint, override_tag(route, os.environ[env], named_by="the environment"))
    check_stored(manifest, path)
    return manifest


def check_stored(manifest: ServingManifest, path: Path) -> None:
    """Every route's model is in the store the service reads. A manifest written by a pipeline run
    into another store (another `BENTOML_HOME`) names models this one lacks, and BentoML would say
    only that it could not fetch them from BentoCloud."""
    import bentoml

    for name, route in manifest.routes().items():
        try:
            bentoml.models.get(route.tag)
        except bentoml.exceptions.NotFound as exc:
            home = os.environ.get("BENTOML_HOME", "~/bentoml, the default")
            raise ManifestError(
                f"{path} routes {name} to {route.tag}, which the model store of BENTOML_HOME={home} does not "
                f"hold: build it into that store (`make optimize`), or set {MANIFEST_ENV} to the manifest "
                "written with the store that holds it"
            ) from exc


def pinned(endpoint: str) -> bool:
    """Whether the environment names this endpoint's model: aliases do not move it then. Only the
    default endpoints can be pinned so."""
    return endpoint in TAG_OVERRIDE_ENV and bool(os.environ.get(TAG_OVERRIDE_ENV[endpoint]))


def aliased(route: Route, aliases: Aliases, path: Path) -> Route:
    """The route serving its alias's tag, with that model's batching; unchanged while the alias is
    unset. A hand-edited alias naming another recipe's model is refused here as a swap to it is
    while serving (serving/lifecycle.py): its route's requests would all fail."""
    tag = aliases.tag(route.recipe, route.alias)
    if tag is None or tag == route.tag:
        return route
    if model_name(tag) != route.recipe:
        raise ManifestError(
            f"{path}: alias {label(route.recipe, route.alias)} names {tag}, a model of another recipe: "
            f"its route serves {route.recipe} models"
        )
    return override_tag(route, tag, named_by=f"alias {route.alias!r}")


def override_tag(route: Route, tag: str, *, named_by: str) -> Route:
    """Serve another stored model; its own profiled batching comes with it when it has one."""
    import bentoml

    try:
        stored = bentoml.models.get(tag)
    except bentoml.exceptions.NotFound as exc:
        raise ManifestError(f"model {tag!r} named by {named_by} is not in the model store") from exc
    return serving_model(route, stored)


def serving_model(route: Route, stored: Any) -> Route:
    """The route serving a stored model (`bentoml.Model`, its metadata read already: a hot swap
    reads it once), with that model's profiled batching where it has one."""
    batching = stored.info.metadata.get("batching") or {}
    return route.model_copy(
        update={
            "tag": str(stored.tag),
            "max_batch_size": batching.get("max_batch_size", route.max_batch_size),
            "max_batch_tokens": batching.get("max_batch_tokens", route.max_batch_tokens),
            "max_latency_ms": batching.get("max_latency_ms", route.max_latency_ms),
        }
    )


def write_manifest(manifest: ServingManifest, path: Path) -> None:
    """Replace the file in one step: a service starting meanwhile reads the old one or the new."""
    write_atomically(path, manifest.model_dump_json(indent=2) + "\n")


def update_manifest(routes: dict[str, Route], path: Path) -> ServingManifest:
    """Set the routes one pipeline run built and keep every other: building one recipe never drops
    another recipe's endpoint. A manifest that is there but invalid stops the update, named."""
    current = read_manifest(path) if path.exists() else ServingManifest()
    updated = current.with_routes(routes)
    write_manifest(updated, path)
    return updated
