"""The BentoML model store: write artifacts with their proof, and find them again by content."""

from __future__ import annotations

import shutil
from pathlib import Path

import bentoml

from serving.artifacts import SHA256_KEY, file_digest, mismatched_files

RECIPE_HASH = "recipe_hash"


def find_selected(name: str, recipe_hash: str) -> bentoml.Model | None:
    """The newest served variant built from exactly this recipe content whose files still match
    their sha256, if any. One that does not (a registration killed while BentoML copied it into
    the store, a file damaged since) is never reused: the recipe is built again."""
    try:
        stored = bentoml.models.list(name)
    except bentoml.exceptions.NotFound:
        return None
    matches = [m for m in stored if m.info.metadata.get(RECIPE_HASH) == recipe_hash and m.info.metadata.get("selected")]
    intact = [m for m in matches if not mismatched_files(m)]
    return max(intact, key=lambda m: m.info.creation_time, default=None)


def register(name: str, files: dict[str, Path], *, labels: dict[str, str], metadata: dict) -> bentoml.Model:
    """Copy `files` (store name → source path) into a new model version; record their sha256."""
    sha256 = {stored: file_digest(source) for stored, source in files.items()}
    with bentoml.models.create(name, labels=labels, metadata={**metadata, SHA256_KEY: sha256}) as model:
        for stored, source in files.items():
            shutil.copyfile(source, Path(model.path) / stored)
    return bentoml.models.get(model.tag)
