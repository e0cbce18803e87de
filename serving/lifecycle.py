"""Hot swap: each endpoint's models follow its route's aliases while the service runs.

A `Slot` holds what one alias of an endpoint serves now; a `Split` is the endpoint's traffic: its
alias's slot and, where the route names them, a canary's slot answering a share of the requests
and a shadow's running a share of them beside (serving/shadow.py). A request leases its model
for its whole life (admission, reading, decoding, its batch); a swap is one assignment, after
which new requests lease the new model, and the old one is closed (its engine thread stopped,
its session released) when its last lease ends, so no request in flight loses its model.

An `AliasWatcher` polls the alias file (serving/aliases.py) every `POLL_SECONDS`. When an alias a
route serves (its own, its canary's, its shadow's) names another version, that version is loaded
in a thread, its files checked against their sha256 and its session warmed up (lightly:
serving/model_calls.py `in_process_model`), before any traffic moves to it. One that fails any of
this is logged and refused, and the old model keeps serving.

In process only: under `OPTISERVE_MODEL_PLACEMENT=service` each model service loads its model
once, at start, so an alias change there takes a restart; an endpoint pinned by the environment
(`OPTISERVE_EMBED_MODEL`, ...) does not follow its alias either.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

from serving.aliases import AliasError, label, read_aliases, refused, stored_model
from serving.classify import ImageClassifier
from serving.embed import TextEmbedder
from serving.manifest import Route, pinned, route_path, serving_model
from serving.metrics import count_swap
from serving.model_calls import batched_model, in_process_model
from serving.model_runtime import read_spec
from serving.model_spec import Task
from serving.settings import front_workers, model_placement

logger = logging.getLogger(__name__)

POLL_SECONDS = 1.0
SWAPPED = "loaded and warmed up"  # in the log line of every swap (bench/swap.py waits for it)
FRONTS: dict[Task, type[ImageClassifier] | type[TextEmbedder]] = {
    "image-classification": ImageClassifier,
    "text-embedding": TextEmbedder,
}


class Served(Protocol):
    tag: str
    kind: str  # the endpoints it answers: "classify" or "embed"

    def close(self) -> None: ...


Model = TypeVar("Model", bound=Served)


@dataclass
class _Held(Generic[Model]):
    model: Model
    leases: int = 0
    retired: bool = False


class Slot(Generic[Model]):
    """The model one alias of an endpoint serves now. Leases and swaps happen on the event loop
    only, so the counts need no lock."""

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
        return _retire(old)

    def retire(self) -> Model:
        """Serve nothing more: the slot's model closes once its last lease ends."""
        return _retire(self._held)


def _retire(held: _Held[Model]) -> Model:
    held.retired = True
    if held.leases == 0:
        held.model.close()
    return held.model


Side = Literal["primary", "canary", "shadow"]


@dataclass
class Split(Generic[Model]):
    """An endpoint's traffic: the slot of its route's alias and, once their aliases are set, a
    canary's slot answering `canary_percent` of the requests and a shadow's running
    `shadow_percent` of them beside, never answering (serving/shadow.py). A request's shares are
    drawn from its id (`X-Request-ID`), so a client's retry lands where the first try did; a
    request without one lands at random."""

    primary: Slot[Model]
    canary_percent: float = 0.0
    shadow_percent: float = 0.0
    canary: Slot[Model] | None = None
    shadow: Slot[Model] | None = None
    shadow_runs: set[asyncio.Task] = field(default_factory=set)  # in flight (serving/shadow.py)

    @classmethod
    def of(cls, route: Route, model: Model) -> Split[Model]:
        """The split a route asks for, serving `model` until its other aliases are set."""
        shares = {f"{side}_percent": share.percent for side in ("canary", "shadow") if (share := getattr(route, side))}
        return cls(Slot(model), **shares)

    def slot(self, request_id: str | None) -> Slot[Model]:
        if self.canary is None or _bucket(request_id, "canary") >= self.canary_percent:
            return self.primary
        return self.canary

    def shadowed(self, request_id: str | None) -> Slot[Model] | None:
        """The shadow's slot if this request is in its share."""
        if self.shadow is None or _bucket(request_id, "shadow") >= self.shadow_percent:
            return None
        return self.shadow

    def put(self, model: Model, side: Side) -> Model | None:
        """Serve `model` on one side from the next request on; the model it replaces, if any."""
        slot = getattr(self, side)
        if slot is None:
            setattr(self, side, Slot(model))
            return None
        return slot.swap(model)

    def withdraw(self, side: Side) -> Model | None:
        """End a canary's or a shadow's share from the next request on; its model, if it had one,
        closes once the requests in flight on it are done."""
        slot = getattr(self, side)
        setattr(self, side, None)
        return slot.retire() if slot is not None else None


def _bucket(request_id: str | None, share: str) -> float:
    """The request's place in [0, 100) for one share: fixed by its id (the same in every worker and
    run), drawn apart for each share so that a canary's requests are not all shadowed too."""
    if not request_id:
        return random.uniform(0, 100)
    digest = hashlib.blake2b(f"{share}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest) / 2**64 * 100


def front_class(stored: Any) -> type[ImageClassifier] | type[TextEmbedder]:
    """The front a stored model's task needs."""
    return FRONTS[read_spec(stored.info.metadata).task]


def open_front(endpoint: str, stored: Any, route: Route, remote: Any = None) -> ImageClassifier | TextEmbedder:
    """The route's front over a stored model (`bentoml.Model`), its session where the placement
    puts it (serving/model_calls.py; `remote` is the model service's client there)."""
    model = batched_model(endpoint, stored, route, remote)
    return front_class(stored).from_stored(stored, route, model, endpoint=endpoint)


class AliasWatcher:
    """Moves each watched endpoint's sides (its alias, its canary's, its shadow's) to the versions
    they name, as they change; a canary or a shadow joins its endpoint when its alias is set, and
    leaves it when its alias is unset again."""

    def __init__(self, path: Path, routes: dict[str, Route], splits: dict[str, Split]) -> None:
        self._path = path
        self._routes = routes
        self._splits = splits
        self._seen: tuple[int, int, int] | None = None  # the file's identity when last read

    @classmethod
    def watching(cls, path: Path, routes: dict[str, Route | None], splits: dict[str, Split | None]) -> AliasWatcher:
        """A watcher of the endpoints that can follow an alias here (see the module docstring)."""
        if model_placement() != "in-process":
            logger.warning("aliases are followed at start only under the service placement: restart to change them")
            splits = {}
        followed = {e: s for e, s in splits.items() if s is not None and routes[e] is not None and not pinned(e)}
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
        """Move every side whose alias names another version, once per change of the file. The file
        is read in a thread: on a mount that hangs (a network volume shared by the pods) only this
        watcher waits, not the event loop and every request with it."""
        if not self._splits or (seen := await asyncio.to_thread(_identity, self._path)) == self._seen:
            return
        self._seen = seen
        try:
            aliases = await asyncio.to_thread(read_aliases, self._path)
        except AliasError as exc:
            logger.error("%s; every endpoint keeps its model", exc)
            return
        for endpoint, split in self._splits.items():
            route = self._routes[endpoint]
            sides: list[tuple[Side, str]] = [("primary", route.alias)]
            sides += [(side, share.alias) for side in ("canary", "shadow") if (share := getattr(route, side))]
            for side, alias in sides:
                tag, slot = aliases.tag(route.recipe, alias), getattr(split, side)
                if tag is not None and (slot is None or tag != slot.model.tag):
                    await self._move(endpoint, route, split, (side, alias), tag)
                elif tag is None and slot is not None and side != "primary":
                    self._withdraw(endpoint, route, split, (side, alias))

    async def _move(self, endpoint: str, route: Route, split: Split, side: tuple[Side, str], tag: str) -> None:
        name = label(route.recipe, side[1])
        try:
            front = await asyncio.to_thread(self._open, endpoint, route, side, tag)
        except AliasError as exc:  # whatever the new version does wrong, the old one keeps serving
            kept = getattr(split, side[0])
            keeps = f"{kept.model.tag} keeps serving" if kept else "not served"
            logger.error("%s: %s; %s", route_path(endpoint), exc, keeps)
            count_swap(endpoint, "refused")
            return
        old = split.put(front, side[0])
        count_swap(endpoint, "swapped")
        if old is not None:
            released = f"{old.tag} released"
        else:
            released = f"now {getattr(split, f'{side[0]}_percent'):g} % of the requests ({side[0]})"
        logger.info("%s: %s → %s, %s; %s", route_path(endpoint), name, tag, SWAPPED, released)

    def _withdraw(self, endpoint: str, route: Route, split: Split, side: tuple[Side, str]) -> None:
        withdrawn = split.withdraw(side[0])
        count_swap(endpoint, "withdrawn")
        logger.info("%s: %s unset, %s withdrawn", route_path(endpoint), label(route.recipe, side[1]), withdrawn.tag)

    def _open(self, endpoint: str, route: Route, side: tuple[Side, str], tag: str) -> ImageClassifier | TextEmbedder:
        """The new version's front, its files checked and its session warmed up (in a thread: it
        takes seconds); `AliasError` naming the alias and the tag for any failure. A shadow runs in
        the background: it must leave the cores to the answers."""
        name = label(route.recipe, side[1])
        stored = stored_model(tag, alias=name)
        if stored.tag.name != route.recipe:
            raise refused(name, tag, f"{route_path(endpoint)} serves {route.recipe} models")
        try:
            served = serving_model(route, stored)
            shadow = side[0] == "shadow"
            model = in_process_model(
                endpoint, stored, served, processes=front_workers(), light_warm_up=True, background=shadow
            )
            return front_class(stored).from_stored(stored, served, model, endpoint=endpoint)
        except Exception as exc:
            raise refused(name, tag, exc) from exc


def _identity(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file is replaced or written: inode, size, modification time."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None
    return status.st_ino, status.st_size, status.st_mtime_ns
