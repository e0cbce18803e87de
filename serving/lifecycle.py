"""Hot swap: each endpoint's model follows its route's alias while the service runs.

A `Slot` holds what an endpoint serves now. A request leases the model for its whole life
(admission, reading, decoding, its batch); a swap is one assignment, after which new requests
lease the new model, and the old one is closed (its engine thread stopped, its session released)
when its last lease ends, so no request in flight loses its model.

An `AliasWatcher` polls the alias file (serving/aliases.py) every `POLL_SECONDS`. When the alias
a route serves names another version, that version is loaded in a thread, its files checked
against their sha256 and its session warmed up (lightly: serving/model_calls.py
`in_process_model`), before any traffic moves to it. One that fails any of this is logged and
refused, and the old model keeps serving.

In process only: under `OPTISERVE_MODEL_PLACEMENT=service` each model service loads its model
once, at start, so an alias change there takes a restart; an endpoint pinned by the environment
(`OPTISERVE_EMBED_MODEL`, ...) does not follow its alias either.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from serving.aliases import AliasError, label, read_aliases, refused, stored_model
from serving.classify import ImageClassifier
from serving.embed import TextEmbedder
from serving.manifest import Route, override_tag, pinned
from serving.metrics import count_swap
from serving.model_calls import batched_model, in_process_model
from serving.settings import front_workers, model_placement

logger = logging.getLogger(__name__)

POLL_SECONDS = 1.0
SWAPPED = "loaded and warmed up"  # in the log line of every swap (bench/swap.py waits for it)
FRONTS: dict[str, type[ImageClassifier] | type[TextEmbedder]] = {"classify": ImageClassifier, "embed": TextEmbedder}


class Served(Protocol):
    tag: str

    def close(self) -> None: ...


Model = TypeVar("Model", bound=Served)


@dataclass
class _Held(Generic[Model]):
    model: Model
    leases: int = 0
    retired: bool = False


class Slot(Generic[Model]):
    """The model an endpoint serves now. Leases and swaps happen on the event loop only, so the
    counts need no lock."""

    def __init__(self, model: Model) -> None:
        self._held = _Held(model)

    @property
    def model(self) -> Model:
        return self._held.model

    @contextmanager
    def lease(self) -> Iterator[Model]:
        """The current model, kept open until the block exits, whatever is swapped in meanwhile."""
        held = self._held
        held.leases += 1
        try:
            yield held.model
        finally:
            held.leases -= 1
            if held.retired and held.leases == 0:
                held.model.close()

    def swap(self, model: Model) -> Model:
        """Serve `model` from the next lease on; the previous one closes once its last lease ends."""
        old, self._held = self._held, _Held(model)
        old.retired = True
        if old.leases == 0:
            old.model.close()
        return old.model


def open_front(endpoint: str, stored: Any, route: Route, remote: Any = None) -> ImageClassifier | TextEmbedder:
    """The endpoint's front over a stored model (`bentoml.Model`), its session where the placement
    puts it (serving/model_calls.py; `remote` is the model service's client there)."""
    return FRONTS[endpoint].from_stored(stored, route, batched_model(endpoint, stored, route, remote))


class AliasWatcher:
    """Moves each watched endpoint to the version its route's alias names, as it changes."""

    def __init__(self, path: Path, routes: dict[str, Route], slots: dict[str, Slot]) -> None:
        self._path = path
        self._routes = routes
        self._slots = slots
        self._seen: tuple[int, int, int] | None = None  # the file's identity when last read

    @classmethod
    def watching(cls, path: Path, routes: dict[str, Route | None], slots: dict[str, Slot | None]) -> AliasWatcher:
        """A watcher of the endpoints that can follow an alias here (see the module docstring)."""
        if model_placement() != "in-process":
            logger.warning("aliases are followed at start only under the service placement: restart to change them")
            slots = {}
        followed = {e: s for e, s in slots.items() if s is not None and routes[e] is not None and not pinned(e)}
        return cls(path, {e: routes[e] for e in followed}, followed)

    async def run(self) -> None:
        """Poll until cancelled; a failure of one poll is logged and the next one tries again."""
        while True:
            try:
                await self.check()
            except Exception:
                logger.exception("checking the aliases in %s failed", self._path)
            await asyncio.sleep(POLL_SECONDS)

    async def check(self) -> None:
        """Swap every endpoint whose alias names another version, once per change of the file."""
        if not self._slots or (seen := _identity(self._path)) == self._seen:
            return
        self._seen = seen
        try:
            aliases = read_aliases(self._path)
        except AliasError as exc:
            logger.error("%s; every endpoint keeps its model", exc)
            return
        for endpoint, slot in self._slots.items():
            route = self._routes[endpoint]
            tag = aliases.tag(route.recipe, route.alias)
            if tag is not None and tag != slot.model.tag:
                await self._move(endpoint, slot, route, tag)

    async def _move(self, endpoint: str, slot: Slot, route: Route, tag: str) -> None:
        name = label(route.recipe, route.alias)
        try:
            front = await asyncio.to_thread(self._open, endpoint, route, tag)
        except AliasError as exc:  # whatever the new version does wrong, the old one keeps serving
            logger.error("/%s: %s; %s keeps serving", endpoint, exc, slot.model.tag)
            count_swap(endpoint, "refused")
            return
        old = slot.swap(front)
        count_swap(endpoint, "swapped")
        logger.info("/%s: %s → %s, %s; %s released", endpoint, name, tag, SWAPPED, old.tag)

    def _open(self, endpoint: str, route: Route, tag: str) -> ImageClassifier | TextEmbedder:
        """The new version's front, its files checked and its session warmed up (in a thread: it
        takes seconds); `AliasError` naming the alias and the tag for any failure."""
        name = label(route.recipe, route.alias)
        stored = stored_model(tag, alias=name)
        if stored.tag.name != route.recipe:
            raise refused(name, tag, f"/{endpoint} serves {route.recipe} models")
        try:
            served = override_tag(route, tag, named_by=f"alias {name}")
            model = in_process_model(endpoint, stored, served, processes=front_workers(), light_warm_up=True)
            return FRONTS[endpoint].from_stored(stored, served, model)
        except Exception as exc:
            raise refused(name, tag, exc) from exc


def _identity(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file is replaced or written: inode, size, modification time."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None
    return status.st_ino, status.st_size, status.st_mtime_ns
