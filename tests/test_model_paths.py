"""Every served model at its own path, /models/<name>/<endpoint>, with its own batcher; the default
endpoints keep their models. Against the session's real server, which also serves the digits
classifier (tests/conftest.py `manifest_file`)."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from PIL import Image
from promql_parser import MatchOp
from test_deploy import monitoring_queries, parsed, selectors

from pipeline.datasets import digits_split
from sample_inputs import sample_photos
from serving.engine import EngineSettings
from serving.model_runtime import answered_by_teacher, load_runtime
from tests.scrape import samples

DIGITS = "/models/digits-classifier"
PNG = {"content-type": "image/png"}


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def held_out_digits() -> list[np.ndarray]:
    return digits_split("held-out").rows[:24]


def test_the_digits_classifier_answers_at_its_own_path_as_its_session_does(
    server, digits_model, held_out_digits
) -> None:
    """The digits model is served as a cascade (the recipe's serving.variant): each answer also says
    which of its two models gave it."""
    rows = held_out_digits
    runtime = load_runtime("digits", digits_model.model, max_batch_size=8, settings=EngineSettings.from_environment())
    probabilities, by_teacher = answered_by_teacher(runtime.predict(np.stack(rows)))
    tag = str(digits_model.model.tag)
    with server.client() as client:
        answers = [client.post(f"{DIGITS}/classify", content=png(r), headers=PNG) for r in rows]
    assert {a.status_code for a in answers} == {200}
    assert {a.json()["model"] for a in answers} == {a.headers["x-model-tag"] for a in answers} == {tag}
    assert [a.json()["predictions"][0]["class_id"] for a in answers] == probabilities.argmax(axis=1).tolist()
    assert [a.json()["answered_by"] for a in answers] == ["teacher" if t else "student" for t in by_teacher]


def cascade_answers(client) -> dict[str, float]:
    return {
        labels["answered_by"]: value
        for labels, value in samples(client, "optiserve_cascade_answers_total")
        if labels["endpoint"] == "digits-classifier"
    }


def test_the_cascade_counts_the_images_each_of_its_models_answered_and_other_models_say_nothing(server) -> None:
    rows = digits_split("perturbed").rows[:64]  # moved digits: the student is unsure of some
    files = [("images", (f"{i}.png", png(r), "image/png")) for i, r in enumerate(rows)]
    with server.client() as client:
        before = cascade_answers(client)
        answer = client.post(f"{DIGITS}/classify_batch", files=files)
        after = cascade_answers(client)
        not_a_cascade = client.post("/classify", files={"image": ("c.jpg", sample_photos()["chelsea"], "image/jpeg")})
    assert "answered_by" not in not_a_cascade.json()
    assert answer.status_code == 200, answer.text
    answered_by = answer.json()["answered_by"]
    assert len(answered_by) == len(rows) and set(answered_by) <= {"student", "teacher"}
    for model in ("student", "teacher"):
        assert after.get(model, 0) - before.get(model, 0) == answered_by.count(model)


def test_the_digits_classifier_takes_batches_at_its_own_path(server, digits_model, held_out_digits) -> None:
    rows = held_out_digits
    files = [("images", (f"{i}.png", png(r), "image/png")) for i, r in enumerate(rows[:6])]
    with server.client() as client:
        answer = client.post(f"{DIGITS}/classify_batch", files=files, params={"top_k": 3})
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert [len(r) for r in results] == [3] * 6
    assert answer.json()["model"] == str(digits_model.model.tag)


def batches(client) -> dict[str, float]:
    """Engine calls so far, by route."""
    return {labels["endpoint"]: value for labels, value in samples(client, "optiserve_batch_rows_count")}


def test_each_model_has_its_own_batcher(server, held_out_digits) -> None:
    rows = held_out_digits
    with server.client() as client:
        before = batches(client)
        for pixels in rows[:4]:
            assert client.post(f"{DIGITS}/classify", content=png(pixels), headers=PNG).is_success
        after = batches(client)
    assert after["digits-classifier"] >= before.get("digits-classifier", 0) + 1
    assert after.get("classify", 0) == before.get("classify", 0)


def test_the_default_endpoints_keep_their_models_and_share_them_with_the_models_paths(server, built_models) -> None:
    image, text = (str(built_models[name].model.tag) for name in ("image-classifier", "text-embedder"))
    photo = {"image": ("chelsea.jpg", sample_photos()["chelsea"], "image/jpeg")}
    sentence = {"texts": ["A model is served at its own path as well."]}
    with server.client() as client:
        by_default = client.post("/classify", files=photo)
        by_name = client.post("/models/image-classifier/classify", files=photo)
        embedded = client.post("/embed", json=sentence)
        embedded_by_name = client.post("/models/text-embedder/embed", json=sentence)
    assert by_default.json()["model"] == by_name.json()["model"] == image
    assert by_default.json()["predictions"] == by_name.json()["predictions"]
    assert embedded.json()["model"] == embedded_by_name.json()["model"] == text
    assert np.allclose(embedded.json()["embeddings"], embedded_by_name.json()["embeddings"])


@pytest.mark.parametrize("path", ["/models/no-such-model/classify", "/models/text-embedder/classify"])
def test_a_path_no_model_answers_is_a_json_404_naming_the_models_endpoints(server, path: str) -> None:
    with server.client() as client:
        answer = client.post(path, content=b"\x89PNG", headers=PNG)
    assert answer.status_code == 404
    assert answer.json()["type"] == "not_found"
    assert path in answer.json()["error"]
    assert f"{DIGITS}/classify" in answer.json()["error"]
    assert "/models/text-embedder/embed" in answer.json()["error"]


def test_the_openapi_document_lists_each_models_endpoints_with_their_statuses(server) -> None:
    with server.client() as client:
        paths = client.get("/docs.json").json()["paths"]
    for path in (f"{DIGITS}/classify", f"{DIGITS}/classify_batch", "/models/text-embedder/embed"):
        assert {"200", "413", "422", "429", "503"} <= set(paths[path]["post"]["responses"])
    assert "image/png" in paths[f"{DIGITS}/classify"]["post"]["requestBody"]["content"]
    assert "/models/digits-classifier/embed" not in paths


def test_the_model_services_placement_serves_the_digits_classifier_in_its_own_service(
    model_services_server, digits_model, held_out_digits
) -> None:
    rows = held_out_digits
    with model_services_server.client() as client:
        answer = client.post(f"{DIGITS}/classify", content=png(rows[0]), headers=PNG)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == str(digits_model.model.tag)
    assert "DigitsClassifierModel" in model_services_server.log.read_text()


def test_the_alerts_and_panels_on_request_paths_watch_every_models_endpoints(server) -> None:
    """Their `endpoint` matcher (BentoML's metrics label it with the path) matches each model's
    own paths as well as the default ones, as Prometheus matches: the whole value."""
    with server.client() as client:
        paths = client.get("/docs.json").json()["paths"]
    served = [path for path in paths if path.rsplit("/", 1)[1] in ("classify", "classify_batch", "embed")]
    assert f"{DIGITS}/classify" in served and "/classify" in served
    for where, expr in monitoring_queries().items():
        for selector in selectors(parsed(expr)):
            for matcher in selector.matchers.matchers:
                is_path = (matcher.name, matcher.op) == ("endpoint", MatchOp.Re)
                if selector.name.startswith("bentoml_service_request") and is_path:
                    unmatched = [path for path in served if not re.fullmatch(matcher.value, path)]
                    assert unmatched == [], f"{where}: {matcher.value!r} misses {unmatched}"


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_path_no_route_knows_is_a_json_404_pointing_at_the_api_description(server, method: str) -> None:
    with server.client() as client:
        answer = client.request(method, "/no-such-endpoint", json={"texts": ["a"]})
        task = client.get("/embed_bulk/status", params={"task_id": "no-such-task"})
    assert answer.status_code == 404
    assert answer.json() == {
        "error": "no endpoint at /no-such-endpoint; the API is described at /docs.json",
        "type": "not_found",
    }
    assert (task.status_code, task.json()) == (404, {"error": "task_id not found"})  # BentoML's own, as it is


def test_a_method_a_route_does_not_take_is_a_json_405_with_the_methods_it_does(server) -> None:
    with server.client() as client:
        answer = client.post("/docs.json")
    assert answer.status_code == 405
    assert answer.headers["allow"] == "GET, HEAD"
    assert answer.json() == {"error": "POST /docs.json: the endpoint takes GET, HEAD", "type": "method_not_allowed"}
