"""Aliases and their history in a real model store: promote, rollback, refusals, the command line;
the slot a hot swap moves, the canary's split and the shadow (the service doing all of it end to
end: tests/test_lifecycle.py)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import bentoml
import numpy as np
import pytest
from prometheus_client import REGISTRY

from pipeline.__main__ import main
from pipeline.registry import register
from serving.aliases import Alias, AliasError, Aliases, Version, aliases_path, promote, read_aliases, rollback
from serving.batching import Batcher, BatchLimits
from serving.files import write_atomically
from serving.lifecycle import AliasWatcher, Slot, Split
from serving.manifest import ManifestError, Route, ServingManifest, load_manifest, write_manifest
from serving.metrics import ModelMetrics
from serving.shadow import MAX_IN_FLIGHT, compare_classes, compare_embeddings, shadowing

REPO = Path(__file__).resolve().parent.parent
MODEL = "alias-test"


def stored_version(folder: Path, content: bytes, *, batching: dict | None = None) -> str:
    """A real version in the test store: one file, its sha256 recorded by the pipeline's registry."""
    source = folder / f"weights-{content.hex()}.bin"
    source.write_bytes(content)
    return str(register(MODEL, {"model.onnx": source}, labels={}, metadata={"batching": batching or {}}).tag)


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("versions")
    return [stored_version(folder, bytes([i]) * 64) for i in range(3)]


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "serving-aliases.json"


def test_promote_keeps_the_history_and_rollback_goes_back_one_step(path: Path, versions: list[str]) -> None:
    first, second, third = versions
    for tag in versions:
        promote(path, tag)
    assert [v.tag for v in read_aliases(path).models[MODEL]["stable"].history] == [first, second]
    assert read_aliases(path).tag(MODEL, "stable") == third

    assert rollback(path, MODEL).current.tag == second
    assert rollback(path, MODEL).current.tag == first
    with pytest.raises(AliasError, match=f"alias-test@stable → {first} has no earlier version"):
        rollback(path, MODEL)


def test_aliases_of_one_model_move_independently(path: Path, versions: list[str]) -> None:
    promote(path, versions[0])
    promote(path, versions[1], alias="canary")
    assert read_aliases(path).tag(MODEL, "stable") == versions[0]
    assert read_aliases(path).tag(MODEL, "canary") == versions[1]
    with pytest.raises(AliasError, match="alias alias-test@shadow is not set"):
        rollback(path, MODEL, alias="shadow")


def test_a_tag_is_kept_under_the_model_name_the_store_gives_it(path: Path, versions: list[str]) -> None:
    """BentoML lowercases names: a capitalised tag moves the alias the route reads, not another."""
    promote(path, versions[0])
    promote(path, versions[1].upper())
    assert list(read_aliases(path).models) == [MODEL]
    assert read_aliases(path).tag(MODEL, "stable") == versions[1]
    assert rollback(path, MODEL.upper()).current.tag == versions[0]


def test_rolling_a_canary_back_from_its_first_version_unsets_it(path: Path, versions: list[str]) -> None:
    promote(path, versions[0], alias="canary")
    promote(path, versions[1], alias="canary")
    assert rollback(path, MODEL, alias="canary", withdraw=True).current.tag == versions[0]
    assert rollback(path, MODEL, alias="canary", withdraw=True) is None
    assert read_aliases(path).tag(MODEL, "canary") is None
    with pytest.raises(AliasError, match="alias alias-test@canary is not set"):
        rollback(path, MODEL, alias="canary", withdraw=True)


def test_promoting_what_the_alias_names_already_changes_nothing(path: Path, versions: list[str]) -> None:
    promote(path, versions[0])
    before = path.read_text()
    promote(path, versions[0])
    assert path.read_text() == before


def test_latest_is_recorded_as_the_version_it_resolves_to(path: Path, versions: list[str]) -> None:
    assert promote(path, f"{MODEL}:latest").current.tag == str(bentoml.models.get(f"{MODEL}:latest").tag)


def test_a_model_missing_from_the_store_is_refused_and_the_file_left_alone(path: Path, versions: list[str]) -> None:
    promote(path, versions[0])
    before = path.read_text()
    with pytest.raises(AliasError, match=r"alias alias-test@stable → alias-test:nosuchversion refused: .*not in the"):
        promote(path, f"{MODEL}:nosuchversion")
    assert path.read_text() == before


def test_a_model_whose_files_do_not_match_their_sha256_is_refused(path: Path, tmp_path: Path) -> None:
    tag = stored_version(tmp_path, b"tampered later")
    (Path(bentoml.models.get(tag).path) / "model.onnx").write_bytes(b"someone else's weights")
    with pytest.raises(AliasError, match=rf"alias alias-test@canary → {tag} refused: .*model\.onnx .* sha256"):
        promote(path, tag, alias="canary")
    assert not path.exists()


def test_rollback_to_a_version_damaged_since_is_refused(path: Path, tmp_path: Path, versions: list[str]) -> None:
    damaged = stored_version(tmp_path, b"damaged after its promote")
    promote(path, damaged)
    promote(path, versions[0])
    (Path(bentoml.models.get(damaged).path) / "model.onnx").write_bytes(b"")
    with pytest.raises(AliasError, match=f"alias alias-test@stable → {damaged} refused"):
        rollback(path, MODEL)
    assert read_aliases(path).tag(MODEL, "stable") == versions[0]


def test_a_bad_alias_name_is_refused(path: Path, versions: list[str]) -> None:
    with pytest.raises(AliasError, match=r"alias name '\.\./etc'"):
        promote(path, versions[0], alias="../etc")


def test_concurrent_promotes_lose_none(path: Path, versions: list[str]) -> None:
    names = [f"a{i}" for i in range(8)]
    threads = [
        threading.Thread(target=promote, args=(path, versions[i % 3]), kwargs={"alias": name})
        for i, name in enumerate(names)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(read_aliases(path).models[MODEL]) == names
    assert [p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")] == [path.name]


def test_a_route_serves_its_alias_once_set_with_that_models_batching(tmp_path: Path) -> None:
    old = stored_version(tmp_path, b"old")
    new = stored_version(tmp_path, b"new", batching={"max_batch_size": 16, "max_latency_ms": 250})
    manifest = tmp_path / "serving-manifest.json"
    route = Route(tag=old, recipe=MODEL, max_batch_size=4, max_latency_ms=900, max_items_per_request=8)
    write_manifest(ServingManifest(embed=route), manifest)
    assert load_manifest(manifest).embed == route

    promote(aliases_path(manifest), new)
    served = load_manifest(manifest).embed
    assert (served.tag, served.max_batch_size, served.max_latency_ms) == (new, 16, 250)


def test_the_command_line_promotes_lists_and_rolls_back(tmp_path: Path, versions: list[str], capsys) -> None:
    manifest = tmp_path / "serving-manifest.json"
    route = Route(tag=versions[0], recipe=MODEL, max_batch_size=4, max_latency_ms=900, max_items_per_request=8)
    write_manifest(ServingManifest(embed=route), manifest)
    where = ["--manifest", str(manifest)]

    assert main(["promote", versions[1], *where]) == 0  # the first promote: the route's tag goes to the history
    assert capsys.readouterr().out.splitlines()[-1] == f"alias-test@stable → {versions[1]} (before: {versions[0]})"
    assert main(["aliases", *where]) == 0
    listing = capsys.readouterr().out
    assert "/embed serves alias-test@stable" in listing and versions[0] in listing.split(versions[1], 1)[1]
    assert main(["rollback", MODEL, *where]) == 0
    assert capsys.readouterr().out.strip() == f"alias-test@stable → {versions[0]}"
    assert main(["promote", f"{MODEL}:nosuchversion", *where]) == 1
    assert "error: alias alias-test@stable → alias-test:nosuchversion refused" in capsys.readouterr().err
    assert (
        json.loads((tmp_path / "serving-aliases.json").read_text())["models"][MODEL]["stable"]["current"]["tag"]
        == (versions[0])
    )


def test_the_command_line_withdraws_a_canary_and_keeps_the_routes_alias(
    tmp_path: Path, versions: list[str], capsys
) -> None:
    """A canary's alias has no route of its own: rolled back from its first version, it is unset.
    The route's own alias, rolled back as far as it goes, keeps serving and says so."""
    manifest = tmp_path / "serving-manifest.json"
    route = Route(tag=versions[0], recipe=MODEL, max_batch_size=4, max_latency_ms=900, max_items_per_request=8)
    write_manifest(ServingManifest(embed=route), manifest)
    where = ["--manifest", str(manifest)]
    assert main(["promote", versions[1], "--alias", "canary", *where]) == 0
    assert main(["rollback", MODEL, "--alias", "canary", *where]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "alias-test@canary unset: its share of the traffic ends"
    assert read_aliases(aliases_path(manifest)).tag(MODEL, "canary") is None

    assert main(["promote", versions[0], *where]) == 0
    assert main(["rollback", MODEL, *where]) == 1
    assert "has no earlier version to roll back to" in capsys.readouterr().err


def test_alias_commands_do_not_load_torch() -> None:
    """A promote is quick: the build's imports (torch, about 10 s here) stay out of it."""
    code = "import sys, pipeline.__main__; print('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False"


def test_an_unreadable_alias_file_names_itself(path: Path) -> None:
    path.write_text('{"models": {"m": {"stable": "m:1"}}}')
    with pytest.raises(AliasError, match=r"serving-aliases\.json is not a valid alias file"):
        read_aliases(path)
    assert read_aliases(path.with_name("absent.json")) == Aliases()
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(AliasError, match=r"serving-aliases\.json is not a valid alias file"):
        read_aliases(path)
    a_folder = path.parent / "elsewhere" / "serving-aliases.json"
    a_folder.mkdir(parents=True)
    with pytest.raises(AliasError, match=r"serving-aliases\.json cannot be read: .*Is a directory"):
        read_aliases(a_folder)


def test_the_alias_file_is_written_readable_by_the_service_user(path: Path, versions: list[str]) -> None:
    """A temporary file's 0600 would hide a host's promote from a container's non-root user."""
    umask = os.umask(0o022)
    try:
        promote(path, versions[0])
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        path.chmod(0o640)
        promote(path, versions[1])
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
    finally:
        os.umask(umask)


def test_a_route_refuses_an_alias_naming_another_recipes_model(tmp_path: Path, versions: list[str]) -> None:
    """At start as while serving: all of the route's requests would fail on it."""
    manifest = tmp_path / "serving-manifest.json"
    route = Route(
        tag="text-embedder:built", recipe="text-embedder", max_batch_size=4, max_latency_ms=900, max_items_per_request=8
    )
    write_manifest(ServingManifest(embed=route), manifest)
    hand_edited = Aliases(
        models={"text-embedder": {"stable": Alias(current=Version(tag=versions[0], since="2026-12-01T00:00:00Z"))}}
    )
    write_atomically(aliases_path(manifest), hand_edited.model_dump_json())
    with pytest.raises(ManifestError, match=rf"alias text-embedder@stable names {versions[0]}, a model of another"):
        load_manifest(manifest)


@dataclass
class Front:
    """What a slot holds in the service (an endpoint's front), here over a real batcher."""

    tag: str
    model: Batcher
    kind: str = "embed"
    cascade: bool = False

    def close(self) -> None:
        self.model.close()


def front(tag: str) -> Front:
    def slow_double(rows: np.ndarray) -> np.ndarray:
        time.sleep(0.05)
        return rows * 2

    limits = BatchLimits(max_batch_size=4, max_latency_ms=10_000, max_queue_rows=100)
    return Front(tag, Batcher(slow_double, limits=limits, metrics=ModelMetrics(endpoint=tag, model=tag)))


def test_a_swap_lets_the_request_in_flight_finish_on_the_old_model_then_closes_it() -> None:
    slot = Slot(front("old"))

    async def swap_during_a_request() -> tuple[str, np.ndarray, str]:
        async def request() -> tuple[str, np.ndarray]:
            with slot.lease() as model, model.model.admit(1) as admission:
                return model.tag, await model.model.run(np.ones((1, 1)), admission)

        in_flight = asyncio.ensure_future(request())
        await asyncio.sleep(0.01)
        old = slot.swap(front("new"))
        assert not old.model._closed, "closed while a request still used it"
        tag, result = await in_flight
        assert old.model._closed
        return tag, result, (await asyncio.ensure_future(request()))[0]

    tag, result, after = asyncio.run(swap_during_a_request())
    assert (tag, result.tolist(), after) == ("old", [[2.0]], "new")


def test_a_swap_closes_an_idle_model_at_once() -> None:
    slot = Slot(front("old"))
    old = slot.swap(front("new"))
    assert old.model._closed and slot.model.tag == "new"


def test_a_split_sends_its_share_of_request_ids_to_the_canary_and_an_id_always_to_the_same_side() -> None:
    split = Split(Slot(front("primary")), canary_percent=20.0)
    assert {split.slot(f"id-{i}").model.tag for i in range(100)} == {"primary"}, "no canary yet"
    assert split.put(front("canary"), "canary") is None

    sides = [split.slot(f"id-{i}").model.tag for i in range(10_000)]
    assert 18.5 <= 100 * sides.count("canary") / len(sides) <= 21.5  # 3 standard deviations
    assert all(split.slot(f"id-{i}").model.tag == sides[i] for i in range(100))
    assert split.put(front("canary-2"), "canary").tag == "canary"
    assert split.slot("id-0").model.tag == sides[0].replace("canary", "canary-2")


def test_the_watcher_refuses_a_version_of_another_model_and_keeps_serving(
    tmp_path: Path, versions: list[str], caplog
) -> None:
    path = tmp_path / "serving-aliases.json"
    hand_edited = Aliases(
        models={"text-embedder": {"stable": Alias(current=Version(tag=versions[0], since="2026-12-01T00:00:00Z"))}}
    )
    write_atomically(path, hand_edited.model_dump_json())
    route = Route(
        tag="text-embedder:built", recipe="text-embedder", max_batch_size=4, max_latency_ms=900, max_items_per_request=8
    )
    split = Split(Slot(front("text-embedder:built")))
    refusals = {"endpoint": "embed", "outcome": "refused"}
    before = REGISTRY.get_sample_value("optiserve_model_swaps_total", refusals) or 0.0

    asyncio.run(AliasWatcher(path, {"embed": route}, {"embed": split}).check())

    assert split.primary.model.tag == "text-embedder:built"
    assert REGISTRY.get_sample_value("optiserve_model_swaps_total", refusals) == before + 1
    assert f"alias text-embedder@stable → {versions[0]} refused: /embed serves text-embedder models" in caplog.text


def test_the_watcher_withdraws_a_canary_whose_alias_is_unset(tmp_path: Path, versions: list[str], caplog) -> None:
    path = tmp_path / "serving-aliases.json"
    promote(path, versions[1], alias="canary")
    route = Route(
        tag=versions[0],
        recipe=MODEL,
        max_batch_size=4,
        max_latency_ms=900,
        max_items_per_request=8,
        canary={"alias": "canary", "percent": 50},
    )
    split = Split(Slot(front(versions[0])), canary_percent=50.0)
    canary = front(versions[1])
    split.put(canary, "canary")
    watcher = AliasWatcher(path, {"embed": route}, {"embed": split})
    asyncio.run(watcher.check())
    assert split.canary is not None, "its alias names what it serves: nothing moves"

    withdrawals = {"endpoint": "embed", "outcome": "withdrawn"}
    before = REGISTRY.get_sample_value("optiserve_model_swaps_total", withdrawals) or 0.0
    rollback(path, MODEL, alias="canary", withdraw=True)
    with caplog.at_level("INFO"):
        asyncio.run(watcher.check())

    assert split.canary is None and canary.model._closed
    assert {split.slot(f"id-{i}").model.tag for i in range(100)} == {versions[0]}
    assert REGISTRY.get_sample_value("optiserve_model_swaps_total", withdrawals) == before + 1
    assert f"/embed: alias-test@canary unset, {versions[1]} withdrawn" in caplog.text


def test_shadow_comparisons_per_row() -> None:
    primary = np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]])
    classes = compare_classes(primary, np.array([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1]]))
    np.testing.assert_allclose(classes["top1_agreement"], [1.0, 0.0])
    np.testing.assert_allclose(classes["score_difference"], [0.1, 0.5])
    cosines = compare_embeddings(np.array([[1.0, 0.0], [0.0, 2.0]]), np.array([[3.0, 0.0], [1.0, 1.0]]))["cosine"]
    np.testing.assert_allclose(cosines, [1.0, 2**-0.5])


def test_a_busy_shadow_drops_what_it_cannot_take_counts_it_and_compares_the_rest() -> None:
    split = Split(Slot(front("busy-primary")), shadow_percent=100.0)
    assert shadowing(split, "embed", "busy-primary", "id") is None, "no shadow until its alias is set"
    split.put(front("busy-shadow"), "shadow")
    pair = {"endpoint": "embed", "primary": "busy-primary", "shadow": "busy-shadow"}

    async def five_answers_at_once() -> None:
        for index in range(5):
            observe = shadowing(split, "embed", "busy-primary", f"id-{index}")
            observe(np.ones((1, 2)), np.full((1, 2), 2.0), 0.01)  # returns at once, whatever the shadow does
        assert len(split.shadow_runs) == MAX_IN_FLIGHT
        await asyncio.gather(*split.shadow_runs)

    asyncio.run(five_answers_at_once())
    assert REGISTRY.get_sample_value("optiserve_shadow_total", {**pair, "outcome": "dropped"}) == 5 - MAX_IN_FLIGHT
    assert REGISTRY.get_sample_value("optiserve_shadow_total", {**pair, "outcome": "compared"}) == MAX_IN_FLIGHT
    cosine = {**pair, "measure": "cosine"}
    assert REGISTRY.get_sample_value("optiserve_shadow_similarity_sum", cosine) == pytest.approx(MAX_IN_FLIGHT)
