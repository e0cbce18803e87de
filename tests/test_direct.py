"""The model endpoints answered by serving/direct.py, against the same requests through BentoML's
API handler (a request with an `Origin` header takes that way): the same answers, to the byte
where the model is deterministic, every error included."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from conftest import own_home, serving

from sample_inputs import sample_photos

pytestmark = pytest.mark.slow

BROWSER = {"Origin": "http://app.example"}
# Headers only BentoML's handler adds; the direct answer names its request in X-Request-ID instead.
# (Its X-BentoML-Request-ID is its span's id: with no exporter configured no span is opened, and none is sent.)
BENTOMLS_OWN = ("server",)


def photo() -> bytes:
    return sample_photos()["chelsea"]


# (name, path, request arguments for httpx); each is sent both ways.
REQUESTS = [
    ("embed", "/embed", {"json": {"texts": ["a cat on a mat", "two dogs"]}}),
    ("embed base64", "/embed", {"json": {"texts": ["a cat"], "encoding_format": "base64"}}),
    ("embed at its model's path", "/models/text-embedder/embed", {"json": {"texts": ["a cat"]}}),
    ("embed, body not JSON", "/embed", {"content": b"{texts", "headers": {"content-type": "application/json"}}),
    ("embed, unknown field", "/embed", {"json": {"texts": ["a"], "colour": "red"}}),
    ("embed, wrong media type", "/embed", {"content": b"hello", "headers": {"content-type": "text/plain"}}),
    ("embed, bad deadline", "/embed", {"json": {"texts": ["a"]}, "headers": {"X-Deadline-Ms": "soon"}}),
    ("classify, raw body", "/classify?top_k=3", {"content": photo(), "headers": {"content-type": "image/jpeg"}}),
    ("classify, multipart", "/classify", {"files": {"image": ("c.jpg", photo(), "image/jpeg")}}),
    ("classify, not an image", "/classify", {"files": {"image": ("c.jpg", b"not a jpeg", "image/jpeg")}}),
    ("classify, bad top_k", "/classify?top_k=0", {"files": {"image": ("c.jpg", photo(), "image/jpeg")}}),
    ("classify_batch", "/classify_batch", {"files": [("images", (n, d)) for n, d in sample_photos().items()]}),
    ("digits", "/models/digits-classifier/classify", {"files": {"image": ("d.png", b"\x89PNG", "image/png")}}),
]


def both_ways(client: httpx.Client, path: str, arguments: dict) -> tuple[httpx.Response, httpx.Response]:
    headers = arguments.get("headers", {})
    direct = client.post(path, **arguments)
    through_bentoml = client.post(path, **{**arguments, "headers": {**headers, **BROWSER}})
    return direct, through_bentoml


def same_body(direct: httpx.Response, through_bentoml: httpx.Response) -> None:
    """Equal JSON; embeddings within float noise (each way ran its own batch)."""
    mine, theirs = direct.json(), through_bentoml.json()
    if isinstance(mine.get("embeddings"), list) and isinstance(mine["embeddings"][0], list):
        np.testing.assert_allclose(mine.pop("embeddings"), theirs.pop("embeddings"), atol=1e-6)
    assert mine == theirs


@pytest.mark.parametrize(("name", "path", "arguments"), REQUESTS, ids=[name for name, _, _ in REQUESTS])
def test_a_model_endpoint_answers_directly_as_bentomls_handler_would(server, name, path, arguments) -> None:
    with server.client() as client:
        direct, through_bentoml = both_ways(client, path, arguments)
    assert direct.status_code == through_bentoml.status_code, (direct.text, through_bentoml.text)
    same_body(direct, through_bentoml)
    for header in ("content-type", "x-model-tag", "retry-after"):
        assert direct.headers.get(header) == through_bentoml.headers.get(header), header
    assert all(header not in direct.headers for header in BENTOMLS_OWN), direct.headers
    assert all(header in through_bentoml.headers for header in BENTOMLS_OWN), through_bentoml.headers


def test_every_other_path_and_method_is_left_to_bentoml(server) -> None:
    with server.client() as client:
        get_embed = client.get("/embed")
        task = client.post("/embed_bulk/submit", json={"texts": ["a"]})
    assert get_embed.status_code == 405
    assert task.status_code == 200 and "task_id" in task.json()


def test_a_browsers_request_gets_bentomls_cors_headers(manifest_file: Path, tmp_path) -> None:
    cors = {"enabled": True, "access_control_allow_origins": [BROWSER["Origin"]]}
    config = tmp_path / "bentoml.yaml"
    config.write_text(yaml.safe_dump({"services": {"optiserve": {"http": {"cors": cors}}}}))
    home = own_home(tmp_path / "home")
    log = tmp_path / "bentoml.log"
    env = {"BENTOML_CONFIG": str(config), "BENTOML_HOME": home}
    with serving(manifest_file, log, **env) as server, server.client() as client:
        answer = client.post("/embed", json={"texts": ["from a web page"]}, headers=BROWSER)
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == BROWSER["Origin"]
