"""Prediction and input monitoring, and error classes: the drift score's statistics, a model stored
without a reference, and, against the real service, shifted inputs crossing the alert's threshold
while normal ones stay below it, errors counted by class, and every metric the alert rules and
the dashboard read exported."""

from __future__ import annotations

import asyncio
import io
import logging
import math
from pathlib import Path

import httpx
import numpy as np
import pytest
from bentoml.exceptions import BentoMLException
from conftest import DRIFT_WINDOW
from PIL import Image, ImageEnhance
from prometheus_client.parser import text_string_to_metric_families
from scrape import samples
from test_deploy import alert_rules, monitoring_queries, parsed, selectors, threshold

from pipeline.datasets import CALIBRATION_PHOTOS, random_view
from pipeline.registry import register
from sample_inputs import corpus_sentences, sample_photos
from serving.api import error_class
from serving.errors import BodyTimeout, InferenceFailed, InputTooLarge, InvalidInput
from serving.manifest import read_manifest
from serving.monitoring import (
    MONITORING_KEY,
    STATISTICS,
    ModelMonitor,
    MonitoringReference,
    Reference,
    Window,
    after_answer,
)

RNG_SEED = 7


def drift_threshold() -> float:
    (rule,) = [rule for rule in alert_rules() if rule["alert"] == "OptiserveInputDrift"]
    return threshold(rule["expr"])


# --- the statistics ----------------------------------------------------------------------------


def test_a_new_sample_of_the_reference_scores_low_and_a_shifted_one_crosses_the_threshold() -> None:
    rng = np.random.default_rng(0)
    reference = Reference.of(rng.normal(100, 20, 512).round(), resolution=1.0)
    same = [reference.psi(rng.normal(100, 20, 1000).round()) for _ in range(20)]
    assert max(same) < 0.1 < drift_threshold()
    assert reference.psi(rng.normal(80, 20, 1000).round()) > drift_threshold()  # one standard deviation


def test_a_constant_statistic_drifts_only_beyond_its_resolution() -> None:
    """An L2-normalized embedding's norm is 1 up to float noise; an image model's input side, one size."""
    rng = np.random.default_rng(0)
    norms = Reference.of(1 + rng.normal(0, 1e-7, 256), resolution=STATISTICS["norm"].resolution)
    assert norms.psi(1 + rng.normal(0, 3e-7, 1000)) < 0.01
    assert norms.psi(np.full(1000, 1.01)) > drift_threshold()
    sides = Reference.of(np.full(512, 224.0), resolution=1.0)
    assert sides.psi(np.full(1000, 224.0)) < 0.01
    assert sides.psi(np.full(1000, 223.0)) > drift_threshold() < sides.psi(np.full(1000, 225.0))


@pytest.mark.parametrize(
    "fields",
    [
        {"edges": [1.0, 1.0], "proportions": [0.0, 1.0, 0.0], "size": 4},
        {"edges": [1.0, 2.0], "proportions": [0.5, 0.5], "size": 4},
        {"edges": [1.0, 2.0], "proportions": [0.0, 0.9, 0.0], "size": 4},
    ],
)
def test_a_reference_that_contradicts_itself_is_refused(fields: dict) -> None:
    with pytest.raises(ValueError, match="a reference needs"):
        Reference(**fields)


def test_the_window_keeps_the_most_recent_values() -> None:
    window = Window(4)
    window.add(np.array([1.0, 2.0, 3.0]))
    assert not window.full and window.values().tolist() == [1, 2, 3]
    window.add(np.array([4.0, 5.0]))
    assert window.full and sorted(window.values().tolist()) == [2, 3, 4, 5]
    window.add(np.arange(10.0))
    assert sorted(window.values().tolist()) == [6, 7, 8, 9]


def registry_value(name: str, **labels: str) -> float | None:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels)


def embeddings(rng: np.random.Generator, rows: int) -> np.ndarray:
    vectors = rng.normal(size=(rows, 8))
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def test_drift_is_exported_once_the_window_is_full_and_at_most_every_interval() -> None:
    rng = np.random.default_rng(0)
    centroid = np.zeros(8)
    reference = MonitoringReference(
        data="held-out",
        statistics={"tokens": Reference.of(rng.integers(5, 60, 512).astype(float), resolution=1.0)},
        centroid=centroid.tolist(),
    )
    monitor = ModelMonitor(endpoint="drift", model="m:1", reference=reference, window=100, interval_s=3600)
    labels = {"endpoint": "drift", "model": "m:1"}

    monitor.observe_embeddings([[1] * 30] * 99, embeddings(rng, 99))
    assert registry_value("optiserve_drift_psi", **labels, statistic="tokens") is None  # not full: no score yet
    monitor.observe_embeddings([[1] * 30], embeddings(rng, 1))
    assert registry_value("optiserve_text_tokens_count", **labels) == 100
    assert registry_value("optiserve_embedding_centroid_distance_sum", **labels) == pytest.approx(100, rel=1e-6)
    assert registry_value("optiserve_drift_psi", **labels, statistic="tokens") is None  # interval from the start
    scores = monitor.update_drift()
    assert scores["tokens"] > drift_threshold()  # every text 30 tokens: one bin of the reference's ten
    assert registry_value("optiserve_drift_psi", **labels, statistic="tokens") == scores["tokens"]


def test_a_released_models_drift_scores_alert_no_more() -> None:
    """After a hot swap the old model's last score stayed, and its drift alert with it, for ever."""
    rng = np.random.default_rng(1)
    reference = MonitoringReference(
        data="held-out",
        statistics={"tokens": Reference.of(rng.integers(5, 60, 512).astype(float), resolution=1.0)},
        centroid=np.zeros(8).tolist(),
    )
    monitor = ModelMonitor(endpoint="released", model="m:1", reference=reference, window=10, interval_s=0)
    labels = {"endpoint": "released", "model": "m:1", "statistic": "tokens"}
    monitor.observe_embeddings([[1] * 30] * 10, embeddings(rng, 10))
    assert registry_value("optiserve_drift_psi", **labels) > drift_threshold()

    monitor.release()
    assert math.isnan(registry_value("optiserve_drift_psi", **labels))
    monitor.observe_embeddings([[1] * 30] * 10, embeddings(rng, 10))  # a request that was in flight
    assert math.isnan(registry_value("optiserve_drift_psi", **labels))


def test_a_model_stored_before_monitoring_is_served_without_drift_and_says_so(tmp_path, caplog) -> None:
    """A real version in the test store, registered the way models were before references existed."""
    (tmp_path / "model.onnx").write_bytes(b"unused")
    stored = register("pre-monitoring", {"model.onnx": tmp_path / "model.onnx"}, labels={}, metadata={})
    assert MONITORING_KEY not in stored.info.metadata
    with caplog.at_level(logging.WARNING, logger="serving.monitoring"):
        monitor = ModelMonitor.of_stored("embed", stored)
    assert [r.getMessage() for r in caplog.records if "without a reference" in r.getMessage()]
    monitor.observe_embeddings([[1, 2, 3]], embeddings(np.random.default_rng(0), 1))
    labels = {"endpoint": "embed", "model": str(stored.tag)}
    assert registry_value("optiserve_text_tokens_sum", **labels) == 3
    assert registry_value("optiserve_embedding_centroid_distance_count", **labels) is None  # no centroid to measure
    assert monitor.update_drift() == {}


@pytest.mark.parametrize(
    ("error", "status", "expected"),
    [
        (InvalidInput("texts[1] is empty"), 422, "request"),
        (InputTooLarge("65 images"), 413, "request"),
        (BodyTimeout("the request body did not arrive within 3 s"), 408, "timeout"),
        (InferenceFailed("the embed engine failed on a batch of 4 rows"), 500, "inference"),
        (BentoMLException("model service failed", error_code=500), 500, "inference"),
        (BentoMLException("shed by the model service's batcher", error_code=503), 503, "overload"),
        (KeyError("a bug"), 500, "internal"),
    ],
)
def test_each_error_answer_has_its_class(error: Exception, status: int, expected: str) -> None:
    assert error_class(error, status) == expected


# --- against the real service ------------------------------------------------------------------


def drift_scores(client: httpx.Client, endpoint: str) -> dict[str, float]:
    return {
        labels["statistic"]: value
        for labels, value in samples(client, "optiserve_drift_psi")
        if labels["endpoint"] == endpoint
    }


# Items per request: each request well within the test server's 10 s deadline on a busy machine.
CHUNK = 50


def classify_all(client: httpx.Client, images: list[bytes]) -> None:
    for start in range(0, len(images), CHUNK):
        files = [("images", (f"{i}.jpg", data, "image/jpeg")) for i, data in enumerate(images[start : start + CHUNK])]
        response = client.post("/classify_batch", files=files)
        assert response.status_code == 200, response.text


def embed_all(client: httpx.Client, texts: list[str]) -> None:
    for start in range(0, len(texts), CHUNK):
        response = client.post("/embed", json={"texts": texts[start : start + CHUNK], "truncate": True})
        assert response.status_code == 200, response.text


def views(dim: float | None = None) -> list[bytes]:
    """Random views of the evaluation photos as the pipeline makes its held-out slice (another seed);
    `dim` darkens each photo first."""
    rng = np.random.default_rng(RNG_SEED)
    photos = [
        Image.open(io.BytesIO(data)).convert("RGB")
        for name, data in sample_photos().items()
        if name not in CALIBRATION_PHOTOS
    ]
    if dim is not None:
        photos = [ImageEnhance.Brightness(photo).enhance(dim) for photo in photos]
    return [random_view(photos[i % len(photos)], rng) for i in range(DRIFT_WINDOW)]


@pytest.fixture(scope="module")
def drift(server) -> dict[str, dict[str, float]]:
    """A window of normal inputs, then one of shifted inputs, per endpoint: the scores after each."""
    sentences = corpus_sentences()
    normal_texts = sentences[3::8][:DRIFT_WINDOW]  # the corpus the reference comes from, not its sentences
    long_texts = [" ".join(sentences[i : i + 5]) for i in range(DRIFT_WINDOW)]  # about 185 tokens
    scores = {}
    with server.client() as client:
        classify_all(client, views())
        scores["normal images"] = drift_scores(client, "classify")
        classify_all(client, views(dim=0.25))
        scores["dark images"] = drift_scores(client, "classify")
        embed_all(client, normal_texts)
        scores["normal texts"] = drift_scores(client, "embed")
        embed_all(client, long_texts)
        scores["long texts"] = drift_scores(client, "embed")
    for inputs, found in scores.items():
        print(f"drift after {DRIFT_WINDOW} {inputs}: " + ", ".join(f"{k} {v:.3f}" for k, v in found.items()))
    return scores


@pytest.mark.slow
def test_the_stored_models_carry_the_reference_of_every_statistic_they_are_monitored_on(built_models) -> None:
    expected = {
        "image-classifier": {"width", "height", "brightness", "confidence"},
        "text-embedder": {"tokens", "norm", "centroid_distance"},
    }
    for name, result in built_models.items():
        reference = MonitoringReference.model_validate(result.model.info.metadata[MONITORING_KEY])
        assert reference.data == "held-out"
        assert set(reference.statistics) == expected[name]
        assert (reference.centroid is not None) == (name == "text-embedder")


@pytest.mark.slow
@pytest.mark.parametrize("inputs", ["normal images", "normal texts"])
def test_normal_inputs_keep_every_drift_score_below_the_alerts_threshold(drift, inputs: str) -> None:
    scores = drift[inputs]
    assert len(scores) == (4 if "images" in inputs else 3), scores
    assert max(scores.values()) < drift_threshold(), scores


@pytest.mark.slow
@pytest.mark.parametrize(("inputs", "statistic"), [("dark images", "brightness"), ("long texts", "tokens")])
def test_shifted_inputs_cross_the_alerts_threshold(drift, inputs: str, statistic: str) -> None:
    assert drift[inputs][statistic] > drift_threshold(), drift[inputs]


def served_tags(manifest_file: Path) -> dict[str, str]:
    """The default endpoints' models, which the requests here go to."""
    return {endpoint: route.tag for endpoint, route in read_manifest(manifest_file).defaults().items()}


@pytest.mark.slow
def test_predictions_and_input_statistics_are_counted_per_model(server, drift, manifest_file) -> None:
    with server.client() as client:
        predicted = samples(client, "optiserve_predictions_total")
        confidences = sum(v for _, v in samples(client, "optiserve_prediction_confidence_count"))
        widths = samples(client, "optiserve_image_width_pixels_count")
    assert sum(v for _, v in predicted) == confidences >= 2 * DRIFT_WINDOW
    assert len({labels["label"] for labels, _ in predicted}) > 1
    assert {labels["model"] for labels, _ in widths if labels["endpoint"] == "classify"} == {
        served_tags(manifest_file)["classify"]
    }


BAD_REQUESTS = {
    ("classify", "undecodable_input", "422"): {"content": b"not an image", "headers": {"content-type": "image/jpeg"}},
    ("classify", "unsupported_media_type", "415"): {"content": b"hello", "headers": {"content-type": "text/plain"}},
    ("embed", "empty_input", "400"): {"json": {"texts": []}},
    ("embed", "invalid_request", "422"): {"json": {"texts": "not a list"}},
}


@pytest.mark.slow
def test_request_errors_are_counted_by_type_per_endpoint_and_model(server, manifest_file) -> None:
    def counts() -> dict[tuple[str, str, str], float]:
        with server.client() as client:
            found = samples(client, "optiserve_errors_total")
        defaults = ("classify", "embed")  # the routes BAD_REQUESTS go to; the fuzzer's reach the others too
        return {
            (s["api"], s["type"], s["status"]): v
            for s, v in found
            if s["class"] == "request" and s["endpoint"] in defaults
        }

    before = counts()
    with server.client() as client:
        for (api, _, status), request in BAD_REQUESTS.items():
            assert client.post(f"/{api}", **request).status_code == int(status)
    after = counts()
    for key in BAD_REQUESTS:
        assert after[key] == before.get(key, 0.0) + 1, key
    with server.client() as client:
        models = {(s["endpoint"], s["model"]) for s, _ in samples(client, "optiserve_errors_total")}
    assert set(served_tags(manifest_file).items()) <= models


# Labels Prometheus adds to every series it scrapes from a pod, which /metrics itself never shows.
TARGET_LABELS = {"namespace", "pod", "job", "instance", "service", "container"}


@pytest.mark.slow
def test_every_metric_the_alerts_and_panels_read_is_exported_with_the_labels_they_match(server, drift) -> None:
    """After drift, errors and a refusal (one request that cannot make its 1 ms deadline), every
    series name and matched label in the queries is on the real server's /metrics."""
    with server.client() as client:
        client.post("/classify", content=b"x", headers={"content-type": "image/jpeg"})
        client.post(
            "/classify",
            content=sample_photos()["chelsea"],
            headers={"content-type": "image/jpeg", "X-Deadline-Ms": "1"},
        )
        exported: dict[str, set[str]] = {}
        for family in text_string_to_metric_families(client.get("/metrics").text):
            for sample in family.samples:
                exported.setdefault(sample.name, set()).update(sample.labels)
    for where, expr in monitoring_queries().items():
        for selector in selectors(parsed(expr)):
            assert selector.name in exported, f"{where}: {selector.name} is not exported"
            matched = {matcher.name for matcher in selector.matchers.matchers}
            assert matched <= exported[selector.name] | TARGET_LABELS, f"{where}: {selector.name} has no {matched}"


def test_statistics_are_taken_after_the_answer_and_a_failing_monitor_fails_no_request() -> None:
    seen: list[str] = []

    async def answer() -> str:
        after_answer(seen.append, "statistics")
        after_answer(lambda: 1 / 0)
        assert seen == [], "the request's own work goes first"
        await asyncio.sleep(0)
        return "answer"

    loop, errors = asyncio.new_event_loop(), []
    loop.set_exception_handler(lambda _, context: errors.append(context["exception"]))
    try:
        assert loop.run_until_complete(answer()) == "answer"
    finally:
        loop.close()
    assert seen == ["statistics"]
    assert [type(error) for error in errors] == [ZeroDivisionError]
