"""Faults under load, against a `bentoml serve` of its own: a worker killed with SIGKILL is
replaced and serving again within 10 s; SIGTERM drains what was accepted, losing none of it; an
engine that fails on a batch answers it 500, counts an inference error and serves the next."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import own_home, serving
from test_monitoring import samples

from pipeline.registry import register
from sample_inputs import sample_photos
from serving.artifacts import SHA256_KEY
from serving.manifest import ServingManifest, write_manifest
from serving.model_spec import ONNX_FILE, TOKENIZER_FILE

pytestmark = pytest.mark.slow

JPEG = {"content-type": "image/jpeg"}


def worker_pids(supervisor: int) -> set[int]:
    """The processes under the supervisor that serve HTTP (BentoML's service workers)."""
    pids = set()
    for child in psutil.Process(supervisor).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a killed worker is a zombie until reaped
            if any("_bentoml_impl.worker" in part for part in child.cmdline()):
                pids.add(child.pid)
    return pids


# BentoML's process supervisor looks at its workers every 10 s (circus check_delay) and restarts a
# dead one then: alone, a killed worker is back after up to 10 s + its start; beside a second
# worker, the service never stops answering.
@pytest.mark.parametrize(("workers", "within_s"), [(1, 15.0), (2, 2.0)])
def test_a_killed_worker_is_replaced_and_the_service_answers_again(
    manifest_file, tmp_path, workers: int, within_s: float
) -> None:
    home = own_home(tmp_path / "bentoml")
    with serving(
        manifest_file, tmp_path / "bentoml.log", OPTISERVE_FRONT_WORKERS=str(workers), BENTOML_HOME=home
    ) as server:
        pids = worker_pids(server.process.pid)
        assert len(pids) == workers
        with httpx.Client(base_url=server.url, timeout=10) as client:
            assert client.post("/classify", content=sample_photos()["chelsea"], headers=JPEG).status_code == 200
            victim = min(pids)
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            while time.monotonic() - killed < 30:
                try:
                    if client.post("/classify", content=sample_photos()["chelsea"], headers=JPEG).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            answering_after = time.monotonic() - killed
            deadline = time.monotonic() + 30
            while len(worker_pids(server.process.pid) - {victim}) < workers and time.monotonic() < deadline:
                time.sleep(0.5)
            replaced_after = time.monotonic() - killed
        assert len(worker_pids(server.process.pid) - {victim}) == workers, "the killed worker was not replaced"
    print(f"{workers} worker(s): answering {answering_after:.1f} s, replaced {replaced_after:.1f} s after SIGKILL")
    assert answering_after <= within_s


def test_sigterm_drains_the_requests_already_accepted(manifest_file, tmp_path) -> None:
    """Four requests of every sample photo each, read by the server and queued behind the engine, when
    SIGTERM arrives: every one is answered. (A request still unread in the socket when the server
    stops listening is closed unanswered: uvicorn's shutdown, before acceptance.)"""
    files = [("images", (f"{name}.jpg", data)) for name, data in sample_photos().items()]

    async def in_flight_then_terminate(url: str, supervisor: int) -> list[int | str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await asyncio.gather(*(client.get("/readyz") for _ in range(4)))  # four open connections
            requests = [asyncio.create_task(client.post("/classify_batch", files=files)) for _ in range(4)]
            await asyncio.sleep(0.2)  # read, admitted, queued
            os.kill(supervisor, signal.SIGTERM)
            answers = await asyncio.gather(*requests, return_exceptions=True)
        return [a.status_code if isinstance(a, httpx.Response) else type(a).__name__ for a in answers]

    with serving(manifest_file, tmp_path / "bentoml.log", BENTOML_HOME=own_home(tmp_path / "bentoml")) as server:
        statuses = asyncio.run(in_flight_then_terminate(server.url, server.process.pid))
        server.process.wait(timeout=30)
    assert statuses == [200] * 4


def test_an_engine_failure_is_a_500_counted_as_an_inference_error_and_the_next_request_is_served(
    built_models, default_recipes, tmp_path
) -> None:
    """The text model stored again with a tokenizer that knows one token more than the model's
    embedding table: ONNX Runtime's Gather fails on any batch holding it, as a real engine fault."""
    text = built_models["text-embedder"]
    stored = Path(text.model.path)
    tokenizer = json.loads((stored / TOKENIZER_FILE).read_text())
    tokenizer["added_tokens"].append(
        {"id": 10**6, "content": "[BEYOND]", "special": True, "single_word": False}
        | {"lstrip": False, "rstrip": False, "normalized": False}
    )
    (tmp_path / TOKENIZER_FILE).write_text(json.dumps(tokenizer))
    metadata = {k: v for k, v in text.model.info.metadata.items() if k not in (SHA256_KEY, "selected")}
    broken = register(
        "beyond-vocabulary",
        {ONNX_FILE: stored / ONNX_FILE, TOKENIZER_FILE: tmp_path / TOKENIZER_FILE},
        labels=dict(text.model.info.labels),
        metadata=metadata,
    )
    route = text.route(default_recipes["text-embedder"]).model_copy(update={"tag": str(broken.tag)})
    write_manifest(ServingManifest(embed=route), tmp_path / "manifest.json")
    home = own_home(tmp_path / "bentoml")
    with (
        serving(tmp_path / "manifest.json", tmp_path / "bentoml.log", BENTOML_HOME=home) as server,
        server.client() as client,
    ):
        failed = client.post("/embed", json={"texts": ["a word [BEYOND] the vocabulary"]})
        served = client.post("/embed", json={"texts": ["a word within it"]})
        errors = samples(client, "optiserve_errors_total")
    assert failed.status_code == 500 and failed.json()["type"] == "internal", failed.text
    assert served.status_code == 200
    assert [(labels["class"], labels["api"], labels["model"], value) for labels, value in errors] == [
        ("inference", "embed", str(broken.tag), 1.0)
    ]
    assert "indices element out of data bounds" in (tmp_path / "bentoml.log").read_text()  # the cause, logged
