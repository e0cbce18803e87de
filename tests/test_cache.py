"""A route's response cache: repeated inputs answered from memory, bounded in bytes, never stale
across a hot swap; off unless the route asks for it."""

from __future__ import annotations

import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import REPO, RunningServer, new_version, own_home, serving
from scrape import samples

from sample_inputs import sample_photos
from serving.cache import ENTRY_BYTES, ResponseCache, cache_key
from serving.manifest import read_manifest, write_manifest

JPEG = {"Content-Type": "image/jpeg"}


def test_the_least_recently_used_answers_go_first_and_the_bytes_stay_bounded() -> None:
    cache = ResponseCache(2 * ENTRY_BYTES + 10, endpoint="unit-lru")
    cache.put(b"a", b"1234")
    cache.put(b"b", b"5678")
    assert cache.get(b"a") == b"1234"  # now the most recently used
    cache.put(b"c", b"90ab")  # a third entry would not fit: b, the least recently used, goes
    assert (cache.get(b"a"), cache.get(b"b"), cache.get(b"c")) == (b"1234", None, b"90ab")
    assert cache.size == 2 * ENTRY_BYTES + 8 <= cache.max_bytes
    cache.put(b"huge", b"x" * (ENTRY_BYTES + 11))  # larger than the whole cache: not kept, nothing evicted for it
    assert cache.get(b"huge") is None and cache.size == 2 * ENTRY_BYTES + 8


def test_the_cache_holds_no_more_memory_than_its_size_with_small_answers() -> None:
    """What each entry costs besides its answer counts: 124-byte answers held 1.6 × the size."""
    cache = ResponseCache(1024 * 1024, endpoint="unit-memory")
    tracemalloc.start()
    try:
        for n in range(20_000):
            cache.put(cache_key("m:1", n.to_bytes(8, "little")), b'{"predictions":[' + bytes(108))
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert cache.size <= cache.max_bytes and held <= 1.1 * cache.max_bytes


def test_keys_tell_models_and_the_boundaries_between_inputs_apart() -> None:
    assert cache_key("m:1", b"ab", b"c") != cache_key("m:1", b"a", b"bc")
    assert cache_key("m:1", b"abc") != cache_key("m:2", b"abc")
    assert cache_key("m:1", b"abc") == cache_key("m:1", b"abc")


@dataclass
class Cached:
    server: RunningServer
    manifest: Path
    rebuilt: str  # another version of the text model


@pytest.fixture(scope="module")
def cached(built_models, manifest_file: Path, tmp_path_factory) -> Iterator[Cached]:
    """Both default models with a 1 MB cache each, from a copy of the suite's manifest."""
    folder = tmp_path_factory.mktemp("cache")
    manifest = folder / "serving-manifest.json"
    routes = read_manifest(manifest_file)
    with_cache = {side: getattr(routes, side).model_copy(update={"cache_mb": 1.0}) for side in ("classify", "embed")}
    write_manifest(routes.model_copy(update=with_cache), manifest)
    rebuilt = str(new_version(built_models["text-embedder"].model).tag)
    with serving(manifest, folder / "bentoml.log", BENTOML_HOME=own_home(folder / "home")) as server:
        yield Cached(server, manifest, rebuilt)


def lookups(client: httpx.Client, endpoint: str) -> dict[str, float]:
    return {
        labels["result"]: value
        for labels, value in samples(client, "optiserve_cache_lookups_total")
        if labels["endpoint"] == endpoint
    }


@pytest.mark.slow
def test_a_repeated_input_is_answered_from_the_cache_and_a_new_one_by_the_model(cached) -> None:
    photo = sample_photos()["chelsea"]
    with cached.server.client() as client:
        first, again = (client.post("/embed", json={"texts": ["a cached sentence"]}) for _ in range(2))
        other = client.post("/embed", json={"texts": ["a cached sentence"], "encoding_format": "base64"})
        photo_first, photo_again = (client.post("/classify", content=photo, headers=JPEG) for _ in range(2))
        fewer = client.post("/classify?top_k=2", content=photo, headers=JPEG)
        as_gif = client.post("/classify", content=photo, headers={"Content-Type": "image/gif"})
        as_text = client.post("/classify", files={"image": ("c.jpg", photo, "text/plain")})
        broken = [client.post("/embed", json={"texts": [""]}) for _ in range(2)]
        embed_lookups = lookups(client, "embed")
    assert [r.headers["x-cache"] for r in (first, again, other)] == ["miss", "hit", "miss"]
    assert again.content == first.content and again.headers["x-model-tag"] == first.json()["model"]
    assert [r.headers["x-cache"] for r in (photo_first, photo_again, fewer)] == ["miss", "hit", "miss"]
    assert photo_again.json() == photo_first.json() and len(fewer.json()["predictions"]) == 2
    assert as_gif.status_code == as_text.status_code == 415, "a refused type is refused, cached bytes or not"
    assert [r.status_code for r in broken] == [422, 422] and all("x-cache" not in r.headers for r in broken)
    assert embed_lookups == {"hit": 1.0, "miss": 4.0}  # the two blank texts were looked up and not kept


@pytest.mark.slow
def test_after_a_hot_swap_the_new_model_answers_what_the_old_one_had_cached(cached) -> None:
    body = {"texts": ["cached before the swap"]}
    with cached.server.client() as client:
        before = client.post("/embed", json=body)
        assert client.post("/embed", json=body).headers["x-cache"] == "hit"
        command = [sys.executable, "-m", "pipeline", "promote", cached.rebuilt, "--manifest", str(cached.manifest)]
        assert subprocess.run(command, cwd=REPO, capture_output=True, timeout=120).returncode == 0
        deadline = time.monotonic() + 120
        while (after := client.post("/embed", json=body)).headers["x-model-tag"] != cached.rebuilt:
            assert time.monotonic() < deadline, "the swap did not happen within 120 s"
            assert after.headers["x-cache"] == "hit"  # still the old model, still its own entry
            time.sleep(0.2)
    assert before.headers["x-model-tag"] != cached.rebuilt
    assert after.headers["x-cache"] == "miss" and after.json()["model"] == cached.rebuilt


@pytest.mark.slow
def test_without_cache_mb_there_is_no_cache(server) -> None:
    with server.client() as client:
        answers = [client.post("/embed", json={"texts": ["never cached"]}) for _ in range(2)]
    assert all(r.status_code == 200 and "x-cache" not in r.headers for r in answers)
