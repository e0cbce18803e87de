"""The real service: `bentoml serve` on a free port, called over HTTP with real photos and text."""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import psutil
import pytest
from PIL import Image
from scrape import samples
from test_engines import thread_nice_values

from bench.processes import OPTISERVE, free_port, worker_rss_mib
from sample_inputs import encode, sample_photos
from serving.embed import decode_base64_f16
from serving.metrics import MEMORY_METRIC
from serving.settings import DEFAULT_ENGINE_NICE

pytestmark = pytest.mark.slow

CAT_CLASSES = {"tabby", "tiger cat", "Persian cat", "Siamese cat", "Egyptian cat", "lynx"}
PLAUSIBLE_TOP5 = {
    "chelsea": CAT_CLASSES,
    "coffee": {"espresso", "cup", "coffee mug"},
    "rocket": {"missile", "projectile", "space shuttle"},
}


def labels(predictions: list[dict]) -> list[str]:
    return [p["label"] for p in predictions]


@pytest.mark.parametrize("photo", sorted(PLAUSIBLE_TOP5))
def test_real_photos_get_plausible_imagenet_labels(server, photo: str) -> None:
    with server.client() as client:
        response = client.post("/classify", files={"image": (f"{photo}.jpg", sample_photos()[photo], "image/jpeg")})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"].startswith("image-classifier:")
    assert len(body["predictions"]) == 5
    assert PLAUSIBLE_TOP5[photo] & set(labels(body["predictions"]))
    scores = [p["score"] for p in body["predictions"]]
    assert scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1.0001


def test_raw_body_and_multipart_give_the_same_answer(server) -> None:
    photo = sample_photos()["chelsea"]
    with server.client() as client:
        raw = client.post("/classify?top_k=3", content=photo, headers={"content-type": "image/jpeg"}).json()
        form = client.post("/classify", files={"image": ("c.jpg", photo, "image/jpeg")}, data={"top_k": "3"}).json()
    assert raw == form and len(raw["predictions"]) == 3


def test_classify_batch_equals_one_by_one(server) -> None:
    photos = sample_photos()
    with server.client() as client:
        batch = client.post(
            "/classify_batch", files=[("images", (n, d, "application/octet-stream")) for n, d in photos.items()]
        )
        singles = [client.post("/classify", files={"image": (n, d)}).json()["predictions"] for n, d in photos.items()]
    assert batch.status_code == 200, batch.text
    results = batch.json()["results"]
    assert len(results) == len(photos)
    for one, single in zip(results, singles, strict=True):
        assert labels(one) == labels(single)
        np.testing.assert_allclose([p["score"] for p in one], [p["score"] for p in single], atol=1e-5)


def embed(client: httpx.Client, texts: list[str], **options) -> httpx.Response:
    return client.post("/embed", json={"texts": texts, **options})


def test_paraphrases_embed_closer_than_unrelated_sentences(server) -> None:
    texts = [
        "A man is playing a guitar.",
        "Someone is strumming a guitar.",
        "The stock market fell sharply on Monday.",
    ]
    with server.client() as client:
        response = embed(client, texts)
    assert response.status_code == 200, response.text
    body = response.json()
    vectors = np.array(body["embeddings"])
    assert vectors.shape == (3, 384) and body["dimensions"] == 384
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    paraphrase, unrelated = vectors[0] @ vectors[1], vectors[0] @ vectors[2]
    assert paraphrase > 0.5 > unrelated


def test_base64_float16_matches_float_response(server) -> None:
    texts = ["a cat", "a dog", "the cat sat on the mat"]
    with server.client() as client:
        floats = np.array(embed(client, texts).json()["embeddings"])
        compact = embed(client, texts, encoding_format="base64").json()
    assert compact["encoding_format"] == "base64"
    np.testing.assert_allclose(decode_base64_f16(compact["embeddings"]), floats, atol=1e-3)


def test_batched_embeddings_equal_single_embeddings(server) -> None:
    texts = ["short", "a somewhat longer sentence about serving models over HTTP", "mid length text"]
    with server.client() as client:
        together = np.array(embed(client, texts).json()["embeddings"])
        alone = np.array([embed(client, [t]).json()["embeddings"][0] for t in texts])
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_openapi_documents_the_endpoints_their_bodies_and_our_errors(server) -> None:
    with server.client() as client:
        spec = client.get("/docs.json").json()
    for path in ("/classify", "/classify_batch", "/embed", "/embed_bulk/submit"):
        assert "post" in spec["paths"][path]
    classify = spec["paths"]["/classify"]["post"]
    form = classify["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["properties"]["image"]["format"] == "binary" and form["required"] == ["image"]
    assert {"image/jpeg", "image/png", "image/webp", "image/bmp"} <= set(classify["requestBody"]["content"])
    assert {"400", "408", "413", "415", "422", "429", "503"} <= set(classify["responses"])
    assert classify["responses"]["422"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorBody"
    }
    embed_body = spec["paths"]["/embed"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "texts" in embed_body["properties"]
    assert {"image/jpeg", "image/png"} <= set(spec["paths"]["/classify_batch"]["post"]["requestBody"]["content"])
    assert classify["responses"]["503"]["headers"]["Retry-After"]["schema"]["type"] == "string"
    read = {(p["in"], p["name"]): p["schema"] for p in classify["parameters"]}
    assert read[("query", "top_k")] == {"type": "integer", "minimum": 1, "maximum": 1000, "default": 5}
    assert read[("header", "X-Deadline-Ms")]["minimum"] == 1 and read[("header", "X-Priority")]["enum"] == [
        "normal",
        "low",
    ]
    embed_reads = {(p["in"], p["name"]) for p in spec["paths"]["/embed"]["post"]["parameters"]}
    assert ("header", "X-Request-ID") in embed_reads and ("query", "top_k") not in embed_reads


def batch_rows(metrics: str, endpoint: str) -> tuple[float, float, float]:
    """(batches, rows, single-row batches) so far, from optiserve's batch-rows histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"count": 0.0, "sum": 0.0, "single": 0.0}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if not sample.name.startswith("optiserve_batch_rows") or sample.labels.get("endpoint") != endpoint:
                continue
            if sample.name.endswith("_count"):
                totals["count"] += sample.value
            elif sample.name.endswith("_sum"):
                totals["sum"] += sample.value
            elif sample.name.endswith("_bucket") and float(sample.labels["le"]) == 1.0:
                totals["single"] += sample.value
    return totals["count"], totals["sum"], totals["single"]


def test_concurrent_requests_are_batched(server) -> None:
    photo = sample_photos()["coffee"]

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            responses = await asyncio.gather(
                *(client.post("/classify", files={"image": ("c.jpg", photo, "image/jpeg")}) for _ in range(48))
            )
        return [r.status_code for r in responses]

    with server.client() as client:
        before = batch_rows(client.get("/metrics").text, "classify")
        assert asyncio.run(burst()) == [200] * 48
        after = batch_rows(client.get("/metrics").text, "classify")
    batches, rows, single_row_batches = (a - b for a, b in zip(after, before, strict=True))
    assert rows == 48
    assert batches < 48, "every request ran alone"
    assert single_row_batches < batches, "no batch larger than one request"


def test_metrics_say_what_the_workers_hold_in_memory(server) -> None:
    """BentoML's multi-process /metrics has no process_resident_memory_bytes: the workers report
    their own, summed, sampled every few seconds."""
    with server.client() as client:
        ((labels, value),) = samples(client, MEMORY_METRIC)
    assert labels == {}
    assert value / 2**20 == pytest.approx(worker_rss_mib(server.process.pid), rel=0.2)


@cache
def bomb() -> bytes:
    """12 000 × 12 000 pixels in a PNG of 140 kB: a few seconds to make, so made once, when needed."""
    buffer = io.BytesIO()
    Image.new("L", (12_000, 12_000)).save(buffer, format="PNG")
    return buffer.getvalue()


# name: (the request's arguments, made when its test runs; expected status)
BAD_IMAGE_REQUESTS: dict[str, tuple[Callable[[], dict], int]] = {
    "corrupt image": (lambda: {"files": {"image": ("x.jpg", sample_photos()["chelsea"][:3000], "image/jpeg")}}, 422),
    "non-image": (lambda: {"files": {"image": ("x.pdf", b"%PDF-1.4 not a picture", "application/octet-stream")}}, 422),
    "zero-byte body": (lambda: {"content": b"", "headers": {"content-type": "image/jpeg"}}, 400),
    "zero-byte file": (lambda: {"files": {"image": ("x.jpg", b"", "image/jpeg")}}, 400),
    "decompression bomb": (lambda: {"content": bomb(), "headers": {"content-type": "image/png"}}, 413),
    "wrong content type": (lambda: {"content": b"hello", "headers": {"content-type": "text/plain"}}, 415),
    "declared non-image part": (lambda: {"files": {"image": ("x.txt", b"hello", "text/plain")}}, 415),
    "text field instead of file": (
        lambda: {"data": {"image": "http://127.0.0.1/cat.jpg"}, "files": {"other": ("o", b"x")}},
        422,
    ),
    "no image field": (lambda: {"files": {"picture": ("x.jpg", sample_photos()["chelsea"], "image/jpeg")}}, 422),
    "bad top_k": (
        lambda: {"files": {"image": ("x.jpg", sample_photos()["chelsea"], "image/jpeg")}, "data": {"top_k": "many"}},
        422,
    ),
    "gif": (
        lambda: {"content": encode(np.zeros((8, 8, 3), np.uint8), "GIF"), "headers": {"content-type": "image/gif"}},
        415,
    ),
    "multipart without a boundary": (
        lambda: {"content": b"--x\r\n\r\n", "headers": {"content-type": "multipart/form-data"}},
        422,
    ),
    "two images": (lambda: {"files": [("image", ("a.jpg", sample_photos()["chelsea"]))] * 2}, 413),
    "too many form fields": (
        lambda: {"files": {"image": ("x.jpg", sample_photos()["chelsea"])}, "data": {f"f{i}": "x" for i in range(100)}},
        413,
    ),
    "a URL in a url-encoded form": (lambda: {"data": {"image": "http://127.0.0.1:9/cat.jpg"}}, 422),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGE_REQUESTS))
def test_bad_image_requests_get_a_clear_4xx(server, case: str) -> None:
    request, status = BAD_IMAGE_REQUESTS[case]
    with server.client() as client:
        response = client.post("/classify", **request())
    assert response.status_code == status, response.text
    assert response.json()["error"]


def test_too_many_images_in_one_request(server) -> None:
    files = [("images", ("x.jpg", sample_photos()["chelsea"], "image/jpeg"))] * 65
    with server.client() as client:
        response = client.post("/classify_batch", files=files)
    assert response.status_code == 413
    assert "limit of 64" in response.json()["error"]


BAD_TEXT_REQUESTS = {
    "empty list": ({"json": {"texts": []}}, 400, "texts is empty"),
    "blank text": ({"json": {"texts": ["ok", ""]}}, 422, "texts[1] is empty"),
    "over the batch limit": ({"json": {"texts": ["x"] * 257}}, 413, "limit per request is 256"),
    "over-long text": ({"json": {"texts": ["word " * 400]}}, 413, "the model takes at most 256"),
    "wrong content type": ({"content": b"hello", "headers": {"content-type": "text/plain"}}, 415, "application/json"),
    "not a list": ({"json": {"texts": "hello"}}, 422, "texts"),
    "unknown field": ({"json": {"texts": ["a"], "normalize": False}}, 422, "normalize"),
    "invalid json": ({"content": b"{bad", "headers": {"content-type": "application/json"}}, 422, "not valid JSON"),
    "invalid UTF-8": (
        {"content": b'{"texts": ["\xff\xfe"]}', "headers": {"content-type": "application/json"}},
        422,
        "not valid JSON",
    ),
    "a chunked body over the limit": (
        {"content": iter([b" " * 65536] * 80), "headers": {"content-type": "application/json"}},
        413,
        "exceeds the limit of 4194304 bytes",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_TEXT_REQUESTS))
def test_bad_text_requests_get_a_clear_4xx(server, case: str) -> None:
    request, status, message = BAD_TEXT_REQUESTS[case]
    with server.client() as client:
        response = client.post("/embed", **request)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]


def test_over_long_text_is_accepted_with_truncate(server) -> None:
    with server.client() as client:
        response = embed(client, ["word " * 400], truncate=True)
    assert response.status_code == 200
    assert response.json()["tokens"] == 256


def test_the_service_still_answers_after_bad_input(server) -> None:
    with server.client() as client:
        client.post("/classify", content=bomb(), headers={"content-type": "image/png"})
        assert client.post("/classify", files={"image": ("c.jpg", sample_photos()["chelsea"])}).status_code == 200


JPEG = {"content-type": "image/jpeg"}


def refusals(client: httpx.Client, endpoint: str) -> dict[str, float]:
    """optiserve_refused_total by reason, for one endpoint."""
    found: dict[str, float] = {}
    for labels, value in samples(client, "optiserve_refused_total"):
        if labels["endpoint"] == endpoint:
            found[labels["reason"]] = found.get(labels["reason"], 0.0) + value
    return found


def test_a_request_that_cannot_meet_its_deadline_is_refused_at_once_and_the_next_is_served(server) -> None:
    photo = sample_photos()["chelsea"]
    with server.client() as client:
        assert client.post("/classify", content=photo, headers=JPEG).status_code == 200  # the engine's speed, measured
        before = refusals(client, "classify").get("deadline", 0.0)
        refused = client.post("/classify", content=photo, headers={**JPEG, "X-Deadline-Ms": "1"})
        served = client.post("/classify", content=photo, headers=JPEG)
        after = refusals(client, "classify").get("deadline", 0.0)
    assert refused.status_code == 503, refused.text
    assert refused.json()["type"] == "overloaded" and "within 1 ms" in refused.json()["error"]
    assert int(refused.headers["retry-after"]) >= 1
    assert served.status_code == 200
    assert after == before + 1


def expect_continue_exchange(url: str, body: bytes, headers: dict[str, str]) -> tuple[bytes, bytes]:
    """A POST /classify as curl sends a body over 1 MB: its head with `Expect: 100-continue`, the
    body only once the server answers 100. Returns the interim answer and the final one, read
    until the server closes the connection (a socket timeout if it never does)."""
    parts = urlsplit(url)
    fields = {"Content-Length": str(len(body)), "Expect": "100-continue", **headers}
    head = "POST /classify HTTP/1.1\r\nHost: test\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items())
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall((head + "\r\n").encode("latin-1"))
        first = sock.recv(65536)
        interim, final = (first, b"") if first.startswith(b"HTTP/1.1 100 ") else (b"", first)
        if interim:
            sock.sendall(body)
        while chunk := sock.recv(65536):
            final += chunk
    return interim, final


def test_a_client_expecting_100_continue_is_refused_before_it_uploads_and_asked_for_its_body_when_let_in(
    server,
) -> None:
    """Refused at the door, the photo is never sent, and the connection closes (its body will not
    come); let in, the server asks for the body when it reads it."""
    photo = sample_photos()["chelsea"]
    with server.client() as client:
        assert client.post("/classify", content=photo, headers=JPEG).status_code == 200  # the engine's speed, measured

    interim, refused = expect_continue_exchange(server.url, photo, {**JPEG, "X-Deadline-Ms": "1"})
    assert interim == b""
    assert refused.startswith(b"HTTP/1.1 503 ") and b"\r\nconnection: close\r\n" in refused.lower()
    assert json.loads(refused.split(b"\r\n\r\n", 1)[1])["type"] == "overloaded"

    interim, served = expect_continue_exchange(server.url, photo, {**JPEG, "Connection": "close"})
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert served.startswith(b"HTTP/1.1 200 ") and b'"label"' in served


def test_a_low_priority_request_is_served_on_an_idle_service_and_a_bad_priority_named(server) -> None:
    photo = sample_photos()["chelsea"]
    with server.client() as client:
        by_header = client.post("/embed", json={"texts": ["hello"]}, headers={"X-Priority": "low"})
        by_query = client.post("/classify?priority=low", content=photo, headers=JPEG)
        normal = client.post("/embed", json={"texts": ["hello"]}, headers={"X-Priority": "normal"})
        bad = client.post("/embed", json={"texts": ["hello"]}, headers={"X-Priority": "urgent"})
    assert [r.status_code for r in (by_header, by_query, normal)] == [200, 200, 200]
    assert by_header.json()["embeddings"] == normal.json()["embeddings"]
    assert bad.status_code == 422 and "X-Priority" in bad.json()["error"] and "'urgent'" in bad.json()["error"]


@pytest.mark.parametrize("value", ["0", "-5", "soon", "1.5", "99999999"])
def test_a_malformed_deadline_header_is_a_422_naming_it(server, value: str) -> None:
    with server.client() as client:
        response = client.post("/embed", json={"texts": ["hello"]}, headers={"X-Deadline-Ms": value})
    assert response.status_code == 422
    assert "X-Deadline-Ms" in response.json()["error"]


def test_a_flood_gets_answers_or_fast_refusals_with_retry_after_and_the_service_recovers(server) -> None:
    """32 requests of every sample photo at once, each allowed 16 times what one takes alone: twice the work
    the deadline leaves room for, yet enough for the first ones in, however slow the host. (The
    deadline counts from each request's arrival, and reading 32 bodies side by side takes a good
    part of it before any is admitted.)"""
    files = [("images", (f"{name}.img", data)) for name, data in sample_photos().items()]
    with server.client() as client:
        alone = []
        for _ in range(3):
            response = client.post("/classify_batch", files=files)
            assert response.status_code == 200, response.text
            alone.append(response.elapsed.total_seconds())
    deadline = str(max(400, round(16_000 * min(alone))))

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(
                *(client.post("/classify_batch", files=files, headers={"X-Deadline-Ms": deadline}) for _ in range(32))
            )

    responses = asyncio.run(flood())

    statuses = [r.status_code for r in responses]
    refused = [r for r in responses if r.status_code != 200]
    assert 200 in statuses and refused, (deadline, statuses)
    assert all(r.status_code in (429, 503) and r.headers["retry-after"].isdigit() for r in refused), statuses
    kinds = {429: {"queue_full"}, 503: {"overloaded", "expired"}}
    assert all(r.json()["type"] in kinds[r.status_code] for r in refused)
    with server.client() as client:
        assert client.post("/classify", content=sample_photos()["chelsea"], headers=JPEG).status_code == 200


def held_refusals(client: httpx.Client) -> float:
    return sum(value for _, value in samples(client, "optiserve_refusals_held_total"))


def test_a_client_that_retries_before_its_retry_after_is_held_while_a_crowd_of_new_ones_is_not(server) -> None:
    """A hopeless deadline refuses every request: 60 connections at once are all answered at once;
    one that comes straight back on its connection waits out its Retry-After first, and so does a
    retry that keeps its X-Request-ID on another connection, while another request id on the
    same connection (another client of a shared pool) is answered at once."""
    photo = sample_photos()["chelsea"]
    hopeless = {**JPEG, "X-Deadline-Ms": "1"}
    with server.client() as client:
        assert client.post("/classify", content=photo, headers=JPEG).status_code == 200  # the engine's speed, measured
        held_before, refused_before = held_refusals(client), refusals(client, "classify").get("deadline", 0.0)

    async def crowd() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(client.post("/classify", content=photo, headers=hopeless) for _ in range(60)))

    responses = asyncio.run(crowd())
    with server.client() as client:
        held_after_crowd = held_refusals(client)
        first, again = (client.post("/classify", content=photo, headers=hopeless) for _ in range(2))
        held_by_connection = held_refusals(client)
        pooled = [client.post("/classify", content=photo, headers={**hopeless, "X-Request-ID": n}) for n in "ab"]
    with server.client() as another_connection:
        retried = another_connection.post("/classify", content=photo, headers={**hopeless, "X-Request-ID": "a"})
        assert another_connection.post("/classify", content=photo, headers=JPEG).status_code == 200

    everything = [*responses, first, again, *pooled, retried]
    assert {(r.status_code, r.json()["type"]) for r in everything} == {(503, "overloaded")}
    assert held_after_crowd == held_before
    assert held_by_connection == held_before + 1
    assert again.elapsed.total_seconds() >= 0.8 * int(first.headers["retry-after"])  # held: 0.9 of it, less the gap
    assert max(r.elapsed.total_seconds() for r in pooled) < 0.5  # the connection's own hold is not theirs
    gap = pooled[1].elapsed.total_seconds()  # between the refusal of "a" and its retry, at least
    assert retried.elapsed.total_seconds() >= 0.8 * int(pooled[0].headers["retry-after"]) - gap
    with server.client() as client:
        assert held_refusals(client) == held_before + 2
        assert refusals(client, "classify").get("deadline", 0.0) == refused_before + 65


def test_a_refused_upload_is_answered_before_it_arrives_and_its_connection_serves_on(server) -> None:
    """The door answers a refusal without waiting for its body: the 503 comes while most of the
    photo is still unsent; the server then discards the rest, and the connection serves the next request."""
    photo = sample_photos()["chelsea"]
    with server.client() as client:
        assert client.post("/classify", content=photo, headers=JPEG).status_code == 200  # the engine's speed
    parts = urlsplit(server.url)

    def request(deadline: str) -> bytes:
        head = f"POST /classify HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: image/jpeg\r\n"
        return f"{head}X-Deadline-Ms: {deadline}\r\nContent-Length: {len(photo)}\r\n\r\n".encode()

    def response(connection: socket.socket) -> http.client.HTTPResponse:
        answer = http.client.HTTPResponse(connection)
        answer.begin()
        answer.read()
        return answer

    with socket.create_connection((parts.hostname, parts.port), timeout=10) as connection:
        connection.sendall(request("1") + photo[:1000])
        refused = response(connection)
        connection.sendall(photo[1000:] + request("60000") + photo)
        served = response(connection)

    assert refused.status == 503 and refused.getheader("connection") is None
    assert served.status == 200


def test_models_in_their_own_services_answer_as_in_process(server, model_services_server) -> None:
    texts = ["A cat sleeps on the sofa.", "The stock market fell sharply today.", "hello"]
    answers = []
    for running in (server, model_services_server):
        with running.client() as client:
            classified = client.post("/classify_batch", files=[("images", (n, d)) for n, d in sample_photos().items()])
            embedded = client.post("/embed", json={"texts": texts})
        assert classified.status_code == embedded.status_code == 200
        answers.append((classified.json()["results"], np.asarray(embedded.json()["embeddings"])))
    (in_process, in_process_vectors), (services, services_vectors) = answers
    assert [labels(r) for r in in_process] == [labels(r) for r in services]
    for ours, theirs in zip(in_process, services, strict=True):
        np.testing.assert_allclose([p["score"] for p in ours], [p["score"] for p in theirs], atol=1e-5)
    np.testing.assert_allclose(in_process_vectors, services_vectors, atol=1e-5)


def test_the_engine_threads_run_below_the_event_loops_priority(server) -> None:
    """The worker's main thread, its event loop, keeps nice 0; each model's engine thread and
    ONNX Runtime's pool threads run at OPTISERVE_ENGINE_NICE's default."""
    with server.client() as client:
        assert client.post("/embed", json={"texts": ["a short sentence"]}).status_code == 200
        assert client.post("/classify", content=sample_photos()["chelsea"], headers=JPEG).status_code == 200
    (worker,) = [
        p
        for p in psutil.Process(server.process.pid).children(recursive=True)
        if "onnxruntime" in Path(f"/proc/{p.pid}/maps").read_text()
    ]
    nice = thread_nice_values(worker.pid)
    assert nice[worker.pid] == 0
    # two engine threads, two pool threads at least
    assert sum(value == DEFAULT_ENGINE_NICE for value in nice.values()) >= 4


def test_no_serving_process_loads_torch(server) -> None:
    """The serving image carries no torch: no process of the running service has it mapped."""
    processes = [psutil.Process(server.process.pid), *psutil.Process(server.process.pid).children(recursive=True)]
    assert len(processes) >= 2  # supervisor, front worker (holding the models)
    for process in processes:
        maps = Path(f"/proc/{process.pid}/maps").read_text()
        assert "libtorch" not in maps, f"{process.cmdline()} has torch loaded"


def test_service_import_pulls_no_training_stack(manifest_file) -> None:
    code = (
        "import sys, service\n"
        "heavy = sorted(m for m in ('torch', 'torchvision', 'transformers', 'pipeline') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "OPTISERVE_MANIFEST": str(manifest_file)},
        check=True,
    )
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_a_corrupted_model_file_stops_the_start_naming_the_model_and_file(
    manifest_file, bentoml_home, tmp_path
) -> None:
    """A copy of the test store (hard links) whose image model.onnx has one byte flipped."""
    home = tmp_path / "bentoml"
    shutil.copytree(bentoml_home / "models", home / "models", copy_function=os.link)
    tag = json.loads(manifest_file.read_text())["classify"]["tag"]
    onnx = home / "models" / Path(tag.replace(":", "/")) / "model.onnx"
    corrupted = bytearray(onnx.read_bytes())
    corrupted[len(corrupted) // 2] ^= 0xFF
    onnx.unlink()  # the link, not the test store's file
    onnx.write_bytes(bytes(corrupted))
    log = tmp_path / "bentoml.log"
    port = free_port()
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [*OPTISERVE, "--port", str(port)],
            cwd=Path(__file__).resolve().parent.parent,
            env={**os.environ, "OPTISERVE_MANIFEST": str(manifest_file), "BENTOML_HOME": str(home)},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while "does not match the sha256" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        try:
            ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            ready = False
    finally:
        os.killpg(process.pid, 9)
        process.wait()
    assert not ready
    assert f"model {tag}: model.onnx in" in log.read_text()
