"""Shared fixtures. Every test session gets its own BentoML home, so no user store is touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

_BENTOML_HOME = Path(tempfile.mkdtemp(prefix="optiserve-test-bentoml-"))
os.environ["BENTOML_HOME"] = str(_BENTOML_HOME)  # before anything imports bentoml
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
from tiny_http import TinyServer  # noqa: E402

from bench.processes import OPTISERVE, on_free_port  # noqa: E402
from pipeline.build import BuildResult, build  # noqa: E402
from pipeline.recipe import LoadedRecipe, Profiling, load_recipe  # noqa: E402
from pipeline.registry import RECIPE_HASH, register  # noqa: E402
from serving.artifacts import SHA256_KEY  # noqa: E402
from serving.manifest import ServingManifest, write_manifest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RECIPES = ("image-classifier", "text-embedder")
BODY_TIMEOUT_S = 3
DRIFT_WINDOW = 300  # values per drift score in the `server` fixture, recomputed at every request


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_BENTOML_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def bentoml_home() -> Path:
    return _BENTOML_HOME


def quick(loaded: LoadedRecipe, **changes) -> LoadedRecipe:
    """The same recipe with a short profile and no variants unless given: service tests need the
    FP32 artifacts, not a full optimization run (variants have their own tests). Requests get a
    10 s deadline so that a busy test machine does not shed bursts; deadline tests send their own."""
    serving = loaded.recipe.serving.model_copy(update={"max_latency_ms": 10_000})
    settings = {
        "variants": [],
        "profiling": Profiling(max_batch_size=8, seconds_per_point=0.2),
        "serving": serving,
        **changes,
    }
    return loaded.model_copy(update={"recipe": loaded.recipe.model_copy(update=settings)})


@pytest.fixture(scope="session")
def default_recipes() -> dict[str, LoadedRecipe]:
    return {name: quick(load_recipe(REPO / "models" / f"{name}.yaml")) for name in DEFAULT_RECIPES}


@pytest.fixture(scope="session")
def built_models(default_recipes: dict[str, LoadedRecipe]) -> dict[str, BuildResult]:
    """Both default models exported, checked and registered once per test session."""
    return {name: build(loaded) for name, loaded in default_recipes.items()}


def new_version(stored):
    """Another version of a stored model (`bentoml.Model`), its files copied, in a second instead of
    a rebuild's minutes; without the recipe hash, so no build ever reuses it."""
    metadata = {k: v for k, v in stored.info.metadata.items() if k not in (RECIPE_HASH, SHA256_KEY)}
    files = {name: Path(stored.path) / name for name in stored.info.metadata[SHA256_KEY]}
    return register(stored.tag.name, files, labels=dict(stored.info.labels), metadata=metadata)


@pytest.fixture(scope="session")
def digits_recipe() -> LoadedRecipe:
    """The digits classifier, its teacher and student trained for a few epochs, served as a cascade
    of the two: a third model, served only at its own path (/models/digits-classifier/...), as every
    recipe without a default endpoint is."""
    loaded = load_recipe(REPO / "models" / "digits-classifier.yaml")
    return quick(
        loaded,
        source=loaded.recipe.source.model_copy(update={"epochs": 3}),
        variants=["student", "cascade"],  # served as the recipe says: the cascade
        student=loaded.recipe.student.model_copy(update={"epochs": 5}),
    )


@pytest.fixture(scope="session")
def digits_model(digits_recipe: LoadedRecipe) -> BuildResult:
    return build(digits_recipe)


@pytest.fixture(scope="session")
def manifest_file(
    built_models: dict[str, BuildResult],
    default_recipes: dict[str, LoadedRecipe],
    digits_model: BuildResult,
    digits_recipe: LoadedRecipe,
    tmp_path_factory,
) -> Path:
    """What `make serve` serves: both default models at the default endpoints, and the digits
    classifier at its own path; every model also at /models/<name>/."""
    built = [(default_recipes[name], result) for name, result in built_models.items()]
    routes = {
        loaded.recipe.serving.endpoint or loaded.name: result.route(loaded)
        for loaded, result in [*built, (digits_recipe, digits_model)]
    }
    path = tmp_path_factory.mktemp("manifest") / "serving-manifest.json"
    write_manifest(ServingManifest().with_routes(routes), path)
    return path


@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen
    log: Path  # its stdout and stderr

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)


@contextmanager
def serving(manifest_file: Path, log: Path, **env: str) -> Iterator[RunningServer]:
    """A real `bentoml serve` of service.py on a free port, over the test store."""
    env = {**os.environ, "OPTISERVE_MANIFEST": str(manifest_file), **env}
    with on_free_port(OPTISERVE, env=env, cwd=REPO, log=log) as started:
        yield RunningServer(started.url, started.process, log)


@pytest.fixture(scope="session")
def server(manifest_file: Path, tmp_path_factory) -> Iterator[RunningServer]:
    """The default deployment: models in the front process; a slow body times out after 3 s; drift
    over the last DRIFT_WINDOW values, recomputed at every request."""
    log = tmp_path_factory.mktemp("server") / "bentoml.log"
    env = {
        "OPTISERVE_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
        "OPTISERVE_DRIFT_WINDOW": str(DRIFT_WINDOW),
        "OPTISERVE_DRIFT_INTERVAL_S": "0",
    }
    with serving(manifest_file, log, **env) as running:
        yield running


def own_home(folder: Path) -> str:
    """A BENTOML_HOME of its own for a second server, sharing the test model store: `bentoml
    serve` empties $BENTOML_HOME/prometheus_multiproc_dir at start, which would wipe the metrics
    of the `server` fixture running beside it, and opens $BENTOML_HOME/task_result.db, which two
    servers cannot share."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "models").symlink_to(_BENTOML_HOME / "models")
    return str(folder)


@pytest.fixture(scope="session")
def model_services_server(manifest_file: Path, tmp_path_factory) -> Iterator[RunningServer]:
    """The same models, each in its own batched BentoML model service."""
    home = own_home(tmp_path_factory.mktemp("bentoml-home"))
    log = tmp_path_factory.mktemp("server") / "bentoml.log"
    with serving(manifest_file, log, OPTISERVE_MODEL_PLACEMENT="service", BENTOML_HOME=home) as running:
        yield running


@pytest.fixture
def tiny_server() -> Iterator[TinyServer]:
    """A tiny HTTP/1.1 server on a real socket (tests/tiny_http.py), fresh per test."""
    with TinyServer.running() as running:
        yield running
