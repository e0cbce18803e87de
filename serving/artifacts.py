"""Stored model files against the sha256 the pipeline recorded when it registered them.

The service checks them before it loads a model: a file corrupted on disk, truncated by a
failed copy or replaced by someone else stops the start with its model and file named, instead
of serving wrong answers or failing inside ONNX Runtime.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SHA256_KEY = "sha256"


class ArtifactMismatch(RuntimeError):
    pass


def file_digest(path: Path, names: Sequence[str] | None = None) -> str:
    """sha256 of a file, or of a directory's files in name order: those `names` gives (relative
    paths), else every one."""
    digest = hashlib.sha256()
    if not path.is_dir():
        paths = [path]
    elif names is None:
        paths = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        paths = sorted(path / name for name in names)
    for p in paths:
        digest.update(p.relative_to(path).as_posix().encode() if path.is_dir() else b"")
        with p.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def mismatched_files(stored: Any) -> list[str]:
    """Files of a stored model (`bentoml.Model`) that are missing or no longer match their sha256."""
    recorded: dict[str, str] = stored.info.metadata.get(SHA256_KEY, {})
    folder = Path(stored.path)
    return [
        name
        for name, digest in recorded.items()
        if not (folder / name).exists() or file_digest(folder / name) != digest
    ]


def check_artifacts(stored: Any) -> None:
    """Raise `ArtifactMismatch` naming the model and its files if any does not match."""
    if not stored.info.metadata.get(SHA256_KEY):
        raise ArtifactMismatch(f"model {stored.tag} records no sha256 of its files: register it with the pipeline")
    if bad := mismatched_files(stored):
        raise ArtifactMismatch(
            f"model {stored.tag}: {', '.join(bad)} in {stored.path} {'does' if len(bad) == 1 else 'do'} not match "
            "the sha256 recorded at registration "
            "(corrupted or replaced): rebuild it with the pipeline or import it again"
        )
