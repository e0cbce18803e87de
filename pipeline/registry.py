"""The BentoML model store: write artifacts with their proof, and find them again by content."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import bentoml
from bentoml._internal.configuration.containers import BentoMLContainer
from bentoml._internal.models.model import ModelStore

from serving.artifacts import SHA256_KEY, file_digest, mismatched_files

RECIPE_HASH = "recipe_hash"
# Beside the store, on its filesystem (so a rename is atomic), outside the folders BentoML lists.
STAGING = ".optiserve-staging"


def find_selected(name: str, recipe_hash: str) -> list[bentoml.Model]:
    """The served variants built from exactly this recipe content whose files still match their
    sha256, newest first. One that does not (a registration killed while BentoML copied it into
    the store, a file damaged since) is never reused: the recipe is built again."""
    try:
        stored = bentoml.models.list(name)
    except bentoml.exceptions.NotFound:
        return []
    matches = [m for m in stored if m.info.metadata.get(RECIPE_HASH) == recipe_hash and m.info.metadata.get("selected")]
    intact = [m for m in matches if not mismatched_files(m)]
    return sorted(intact, key=lambda m: m.info.creation_time, reverse=True)


def register(name: str, files: dict[str, Path], *, labels: dict[str, str], metadata: dict) -> bentoml.Model:
    """Copy `files` (store name → source path) into a new model version; record their sha256.

    BentoML copies a new version into its store file by file, so a run killed meanwhile would
    leave a version without its `model.yaml` (and `bentoml models list` fails on it) or with half
    its files. The version is written to a staging store beside the real one and renamed into
    place whole: the store holds all of it or nothing."""
    store = Path(BentoMLContainer.model_store_dir.get())
    remove_abandoned_staging(store.parent / STAGING)
    staging = store.parent / STAGING / f"{os.getpid()}-{uuid.uuid4().hex}"
    sha256 = {stored: file_digest(source) for stored, source in files.items()}
    try:
        with bentoml.models.create(
            name, labels=labels, metadata={**metadata, SHA256_KEY: sha256}, _model_store=ModelStore(str(staging))
        ) as model:
            for stored, source in files.items():
                shutil.copyfile(source, Path(model.path) / stored)
        tag = model.tag
        (store / tag.name).mkdir(parents=True, exist_ok=True)
        os.rename(staging / tag.name / tag.version, store / tag.name / tag.version)
        latest = store / tag.name / "latest"
        (staging / "latest").write_text(tag.version)
        os.replace(staging / "latest", latest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return bentoml.models.get(tag)


def remove_abandoned_staging(folder: Path) -> None:
    """Staging folders of registrations whose process is gone (killed before its rename)."""
    for path in folder.glob("*-*"):
        pid = int(path.name.split("-", 1)[0])
        if not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True
