"""Aliases: names (`stable`, `canary`, any) for a stored model version, each with its history.

A route of the serving manifest names an alias; `python -m pipeline promote TAG --alias NAME`
moves it, `python -m pipeline rollback MODEL --alias NAME` moves it back one step. They live in
one file beside the manifest (`serving-aliases.json`, or `OPTISERVE_ALIASES`), not in it: the
pipeline rewrites the manifest on every build, while an alias moves only on a user's decision,
so a build never puts its model into traffic by itself. A running service polls the file and
swaps models without a restart (serving/lifecycle.py).

Every move is checked before it is written: the model must be in the store with its files
matching the sha256 recorded at registration. The file is replaced in one step (a reader sees
the old file or the new) under a lock, so that two moves at once cannot lose one.
"""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from serving.artifacts import ArtifactMismatch, check_artifacts
from serving.files import write_atomically

ALIASES_ENV = "OPTISERVE_ALIASES"
ALIASES_FILE = "serving-aliases.json"
DEFAULT_ALIAS = "stable"
ALIAS_NAME = r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"
MAX_HISTORY = 50  # versions an alias remembers: rollback goes back this many steps at most


class AliasError(RuntimeError):
    """An alias that cannot be read or moved; the message names the alias and the tag."""


class Version(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tag: str
    since: datetime


class Alias(BaseModel):
    model_config = ConfigDict(extra="forbid")
    current: Version
    history: list[Version] = Field(default_factory=list)  # the tags it named before, oldest first


AliasName = Annotated[str, StringConstraints(pattern=ALIAS_NAME)]


class Aliases(BaseModel):
    """The alias file: model name → alias name → the version it names now and before."""

    model_config = ConfigDict(extra="forbid")
    models: dict[str, dict[AliasName, Alias]] = Field(default_factory=dict)

    def tag(self, model: str, alias: str) -> str | None:
        entry = self.models.get(model, {}).get(alias)
        return entry.current.tag if entry is not None else None


def aliases_path(manifest: Path) -> Path:
    """`OPTISERVE_ALIASES`, else the file beside the manifest."""
    return Path(os.environ[ALIASES_ENV]) if os.environ.get(ALIASES_ENV) else manifest.with_name(ALIASES_FILE)


def read_aliases(path: Path) -> Aliases:
    """The aliases; none set while the file does not exist."""
    try:
        return Aliases.model_validate_json(path.read_text())
    except FileNotFoundError:
        return Aliases()
    except (ValidationError, UnicodeDecodeError) as exc:
        raise AliasError(f"{path} is not a valid alias file:\n{exc}") from exc
    except OSError as exc:
        raise AliasError(f"{path} cannot be read: {exc}") from exc


def model_name(tag: str) -> str:
    """The model a tag names, as the store names it: BentoML lowercases names (`Text-Embedder:1`
    is `text-embedder:1`), so an alias is kept under the name the routes use."""
    return tag.partition(":")[0].lower()


def servable(tag: str, *, alias: str) -> Any:
    """The stored model (`bentoml.Model`) named `tag` if it may serve: in the store, its files
    matching their recorded sha256; else `AliasError` naming the alias and the tag."""
    stored = stored_model(tag, alias=alias)
    try:
        check_artifacts(stored)
    except ArtifactMismatch as exc:
        raise refused(alias, tag, exc) from None
    return stored


def stored_model(tag: str, *, alias: str) -> Any:
    """The stored model named `tag`, its files unchecked (loading it checks them)."""
    import bentoml

    try:
        return bentoml.models.get(tag)
    except bentoml.exceptions.NotFound:
        raise refused(alias, tag, "the model is not in the model store") from None
    except (bentoml.exceptions.BentoMLException, ValueError) as exc:
        raise refused(alias, tag, exc) from None


def refused(alias: str, tag: str, reason: object) -> AliasError:
    return AliasError(f"alias {alias} → {tag} refused: {reason}")


def promote(path: Path, tag: str, *, alias: str = DEFAULT_ALIAS, unset: str | None = None) -> Alias:
    """Point the tag's model's `alias` at `tag` (its full tag: `name:latest` is resolved now), the
    version it named before kept in its history; for an alias not set yet, that is `unset`, what
    its route served meanwhile (the manifest's tag), so that the first promote can be rolled back
    too. Promoting the version it names already is a no-op."""
    model = model_name(tag)
    name = label(model, _checked_name(alias))
    full = str(servable(tag, alias=name).tag)
    now = datetime.now(UTC)
    with _locked(path):
        aliases = read_aliases(path)
        entry = aliases.models.get(model, {}).get(alias)
        if entry is not None and entry.current.tag == full:
            return entry
        if entry is not None:
            history = [*entry.history, entry.current]
        else:
            history = [Version(tag=unset, since=now)] if unset not in (None, full) else []
        moved = Alias(current=Version(tag=full, since=now), history=history[-MAX_HISTORY:])
        aliases.models.setdefault(model, {})[alias] = moved
        _write(aliases, path)
    return moved


def rollback(path: Path, model: str, *, alias: str = DEFAULT_ALIAS, withdraw: bool = False) -> Alias | None:
    """Point `alias` back at the version it named before the last promote; that version must still
    be servable. The version rolled back from leaves the history. With no earlier version, `withdraw`
    unsets the alias (None) instead of refusing: a canary's or a shadow's, whose share of the
    traffic then ends, as it was before its first promote."""
    model = model_name(model)
    name = label(model, _checked_name(alias))
    with _locked(path):
        aliases = read_aliases(path)
        entry = aliases.models.get(model, {}).get(alias)
        if entry is None:
            raise AliasError(f"alias {name} is not set: nothing to roll back")
        if not entry.history and withdraw:
            del aliases.models[model][alias]
            _write(aliases, path)
            return None
        if not entry.history:
            raise AliasError(f"alias {name} → {entry.current.tag} has no earlier version to roll back to")
        previous = entry.history[-1]
        servable(previous.tag, alias=name)
        moved = Alias(current=Version(tag=previous.tag, since=datetime.now(UTC)), history=entry.history[:-1])
        aliases.models[model][alias] = moved
        _write(aliases, path)
    return moved


def label(model: str, alias: str) -> str:
    """How messages and logs name an alias: `text-embedder@stable`."""
    return f"{model}@{alias}"


def _checked_name(alias: str) -> str:
    if not re.match(ALIAS_NAME, alias):
        raise AliasError(f"alias name {alias!r}: up to 64 letters, digits, '_', '.' or '-', starting with a letter")
    return alias


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock for one read-modify-write of the alias file (a lock file beside it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with (path.parent / f".{path.name}.lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _write(aliases: Aliases, path: Path) -> None:
    write_atomically(path, aliases.model_dump_json(indent=2) + "\n")
