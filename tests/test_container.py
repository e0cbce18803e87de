"""The release: `make bento` and `make container` build a bento and an image that serves.

Built from the test session's own model store and serving manifest (conftest.py), never from
the user's ~/bentoml or serving-manifest.json. The image is built with podman the way
the README's Release section describes, started on a free port, asked to classify a photo and
embed sentences over HTTP, stopped, and removed with the image. podman and runc are installed
with apt-get when missing (CI starts from a clean machine); the tests skip only when that is
impossible or podman cannot work here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from podman_setup import LOCAL_BASE_IMAGE, RUN_FLAGS

from bench.processes import free_port
from pipeline.datasets import digits_split
from sample_inputs import sample_photos
from serving.manifest import read_manifest
from tests.test_model_paths import png

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent

CAT_CLASSES = {"tabby", "tiger cat", "Persian cat", "Siamese cat", "Egyptian cat", "lynx"}
PIPELINE_ONLY = {"torch", "torchvision", "transformers", "onnx", "neural-compressor", "neural_compressor"}
IMAGE_SIZE_LIMIT = 1_000_000_000  # the target for the CPU image
READY_TIMEOUT_S = 240
BENTOML_UID = 1034  # deploy/k8s/deployment.yaml runs the pod as this user


def run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)


def tail(result: subprocess.CompletedProcess, lines: int = 40) -> str:
    return "\n".join((result.stdout + result.stderr).splitlines()[-lines:])


def make(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """A make target of this repository, with this interpreter's venv and without re-installing it."""
    venv = Path(sys.prefix)
    cmd = ["make", "-C", str(REPO), "-o", str(venv / ".installed"), f"VENV={venv}", *args]
    return run(cmd, timeout=timeout)


def podman_problem() -> str | None:
    """Why podman cannot build and run images here, after installing it if it is missing; None if it can."""
    missing = [tool for tool in ("podman", "runc") if shutil.which(tool) is None]
    if missing:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            return f"{' and '.join(missing)} not installed, and installing needs root and apt-get"
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (
            ["apt-get", "update", "-q"],
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", "podman", "buildah", "runc"],
        ):
            result = run(cmd, timeout=600, env=env)
            if result.returncode != 0:
                return f"`{' '.join(cmd)}` failed, so podman cannot be installed:\n{tail(result, 10)}"
    info = run(["podman", "info"], timeout=120)
    if info.returncode != 0:
        return f"podman is installed but does not work here (`podman info` failed):\n{tail(info, 10)}"
    has_base = run(["podman", "image", "exists", LOCAL_BASE_IMAGE], timeout=60).returncode == 0
    if not has_base and os.geteuid() != 0:
        return f"{LOCAL_BASE_IMAGE} is missing and deploy/base-image/build.sh needs root to build it"
    return None


@pytest.fixture(scope="module")
def podman() -> None:
    problem = podman_problem()
    if problem:
        pytest.skip(problem)


# --- the bento ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bento:
    tag: str
    path: Path
    info: dict
    build_s: float


def built_bento_tag(output: str) -> str:
    found = re.findall(r'Successfully built Bento\(tag="([^"]+)"\)', output)
    assert found, f"no bento tag in the build output:\n{output[-3000:]}"
    return found[-1]


@pytest.fixture(scope="module")
def bento(manifest_file: Path, bentoml_home: Path) -> Bento:
    started = time.monotonic()
    result = make("bento", f"MANIFEST={manifest_file}", timeout=600)
    build_s = time.monotonic() - started
    assert result.returncode == 0, tail(result, 80)
    tag = built_bento_tag(result.stdout + result.stderr)
    name, version = tag.split(":")
    path = bentoml_home / "bentos" / name / version
    return Bento(tag, path, yaml.safe_load((path / "bento.yaml").read_text()), build_s)


def bento_model_tags(info: dict) -> set[str]:
    return {m["tag"] for m in info.get("models", [])} | {
        m["tag"] for service in info.get("services", []) for m in service.get("models", [])
    }


def requirement_names(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-") and "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def test_bento_carries_the_models_the_manifest_names(bento: Bento, manifest_file: Path) -> None:
    wanted = {route.tag for route in read_manifest(manifest_file).routes().values()}
    assert len(wanted) == 3
    assert bento_model_tags(bento.info) == wanted


def test_bento_serves_the_manifest_it_was_built_from(bento: Bento, manifest_file: Path) -> None:
    assert (bento.path / "src" / "serving-manifest.json").read_text() == manifest_file.read_text()


def test_bento_holds_the_service_code_only(bento: Bento) -> None:
    src = bento.path / "src"
    top = {p.name for p in src.iterdir()}
    assert top <= {"service.py", "serving", "serving-manifest.json", "bentofile.yaml"}, top
    assert {"service.py", "serving", "serving-manifest.json"} <= top
    assert not list(src.rglob("__pycache__"))
    assert not list(src.rglob("*.onnx")), "models belong in the bento's model store, not in src/"


def test_bento_locks_a_runtime_without_torch(bento: Bento) -> None:
    locked = requirement_names((bento.path / "env" / "python" / "requirements.lock.txt").read_text())
    assert not PIPELINE_ONLY & set(locked), PIPELINE_ONLY & set(locked)
    # nvidia-ml-py is BentoML's own (pure Python) GPU monitoring; CUDA libraries have no place here.
    assert not [name for name in locked if name.startswith("nvidia-") and name != "nvidia-ml-py"]
    assert locked["onnxruntime"] == "1.32.0" and locked["bentoml"] == "1.4.40"


def test_bento_dockerfile_takes_the_base_image_as_an_argument_and_installs_no_compilers(bento: Bento) -> None:
    dockerfile = (bento.path / "env" / "docker" / "Dockerfile").read_text()
    assert f"ARG BASE_IMAGE={LOCAL_BASE_IMAGE}\nFROM ${{BASE_IMAGE}}" in dockerfile
    assert "build-essential" not in dockerfile and " git" not in dockerfile


# --- the image ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    name: str
    size: int
    build_s: float
    base_build_s: float | None


@pytest.fixture(scope="module")
def image(podman: None, manifest_file: Path) -> Iterator[Image]:
    base_build_s = None
    if run(["podman", "image", "exists", LOCAL_BASE_IMAGE], timeout=60).returncode != 0:
        started = time.monotonic()
        result = make("base-image", timeout=900)
        base_build_s = time.monotonic() - started
        assert result.returncode == 0, tail(result, 60)
    name = f"localhost/optiserve-test:{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    result = make("container", f"MANIFEST={manifest_file}", f"IMAGE={name}", timeout=900)
    build_s = time.monotonic() - started
    try:
        assert result.returncode == 0, tail(result, 80)
        inspect = run(["podman", "image", "inspect", "--format", "{{.Size}}", name], timeout=60)
        assert inspect.returncode == 0, tail(inspect)
        yield Image(name, int(inspect.stdout.strip()), build_s, base_build_s)
    finally:
        run(["podman", "rmi", "--force", name], timeout=120)


def in_image(image: Image, script: str) -> subprocess.CompletedProcess:
    return run(["podman", "run", "--rm", *RUN_FLAGS, "--entrypoint", "sh", image.name, "-c", script], timeout=120)


def test_cpu_image_is_at_most_1_gb(image: Image) -> None:
    assert image.size <= IMAGE_SIZE_LIMIT, f"{image.size / 1e6:.0f} MB"


def test_image_runs_as_bentoml_without_torch_or_compilers(image: Image) -> None:
    probe = in_image(
        image,
        "echo uid=$(id -u); "
        "echo tools=$(command -v gcc cc g++ make git | tr '\\n' ' '); "
        'python -c "import importlib.util as u, sys, onnxruntime; '
        "print('pipeline=' + ','.join(m for m in ('torch', 'transformers', 'onnx') if u.find_spec(m))); "
        "print('runtime=%s %d.%d' % (onnxruntime.__version__, *sys.version_info[:2]))\"",
    )
    assert probe.returncode == 0, tail(probe)
    found = dict(line.split("=", 1) for line in probe.stdout.splitlines() if "=" in line)
    assert found["uid"] == str(BENTOML_UID)
    assert found["tools"].strip() == "", f"build tools in the image: {found['tools']}"
    assert found["pipeline"] == "", f"pipeline packages in the image: {found['pipeline']}"
    # Debian trixie's Python: new tasks run eagerly there (serving/process.py), refusals a turn sooner.
    assert found["runtime"] == "1.32.0 3.13"


@dataclass
class Container:
    name: str
    url: str
    ready_s: float

    def logs(self) -> str:
        return tail(run(["podman", "logs", self.name], timeout=60), 60)


def wait_ready(container: Container, started: float) -> float:
    while time.monotonic() - started < READY_TIMEOUT_S:
        state = run(["podman", "inspect", "--format", "{{.State.Status}}", container.name], timeout=60)
        if state.stdout.strip() not in ("created", "running"):
            pytest.fail(f"the container stopped before it was ready ({state.stdout.strip()}):\n{container.logs()}")
        try:
            if httpx.get(f"{container.url}/readyz", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    pytest.fail(f"not ready after {READY_TIMEOUT_S} s:\n{container.logs()}")


@pytest.fixture(scope="module")
def container(image: Image) -> Iterator[Container]:
    port = free_port()
    name = f"optiserve-test-{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    result = run(
        ["podman", "run", "--detach", "--name", name, *RUN_FLAGS, "--env", f"BENTOML_PORT={port}", image.name],
        timeout=120,
    )
    assert result.returncode == 0, tail(result)
    running = Container(name, f"http://127.0.0.1:{port}", 0.0)
    try:
        running.ready_s = wait_ready(running, started)
        yield running
    finally:
        run(["podman", "rm", "--force", "--time", "5", name], timeout=120)


def test_container_classifies_a_photo(container: Container, manifest_file: Path) -> None:
    photo = sample_photos()["chelsea"]
    response = httpx.post(
        f"{container.url}/classify", files={"image": ("chelsea.jpg", photo, "image/jpeg")}, timeout=60
    )
    assert response.status_code == 200, f"{response.text}\n{container.logs()}"
    body = response.json()
    assert body["model"] == json.loads(manifest_file.read_text())["classify"]["tag"]
    top5 = [p["label"] for p in body["predictions"]]
    assert len(top5) == 5 and CAT_CLASSES & set(top5), top5


def test_container_embeds_sentences(container: Container, manifest_file: Path) -> None:
    texts = ["A man is playing a guitar.", "Someone is strumming a guitar.", "The stock market fell sharply."]
    response = httpx.post(f"{container.url}/embed", json={"texts": texts}, timeout=60)
    assert response.status_code == 200, f"{response.text}\n{container.logs()}"
    body = response.json()
    assert body["model"] == json.loads(manifest_file.read_text())["embed"]["tag"]
    vectors = np.array(body["embeddings"])
    assert vectors.shape == (3, 384) and body["dimensions"] == 384
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    assert unit[0] @ unit[1] > unit[0] @ unit[2] + 0.2


def test_container_runs_new_tasks_eagerly(container: Container) -> None:
    logs = run(["podman", "logs", container.name], timeout=60)
    assert "new tasks run eagerly" in logs.stdout + logs.stderr, container.logs()


def test_container_serves_the_digits_classifier_at_its_own_path(container: Container, manifest_file: Path) -> None:
    digit = png(digits_split("held-out").rows[0])
    response = httpx.post(
        f"{container.url}/models/digits-classifier/classify", content=digit, headers={"content-type": "image/png"}
    )
    assert response.status_code == 200, f"{response.text}\n{container.logs()}"
    assert response.json()["model"] == read_manifest(manifest_file).models["digits-classifier"].tag


@dataclass(frozen=True)
class Stopped:
    exit_code: int
    stop_s: float
    logs: str


@pytest.fixture(scope="module")
def stopped(container: Container) -> Stopped:
    """`podman stop` after the HTTP checks: SIGTERM, then SIGKILL after 30 s (Kubernetes allows 45)."""
    started = time.monotonic()
    stop = run(["podman", "stop", "--time", "30", container.name], timeout=120)
    stop_s = time.monotonic() - started
    assert stop.returncode == 0, tail(stop)
    state = run(["podman", "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", container.name], timeout=60)
    status, code = state.stdout.split()
    assert status == "exited", state.stdout
    return Stopped(int(code), stop_s, container.logs())


def test_container_stops_and_reports_its_figures(
    stopped: Stopped,
    container: Container,
    image: Image,
    bento: Bento,
    capsys: pytest.CaptureFixture[str],
    record_property,
) -> None:
    figures = {
        "image_mb": round(image.size / 1e6),
        "base_image_build_s": None if image.base_build_s is None else round(image.base_build_s),
        "bento_build_s": round(bento.build_s, 1),
        "make_container_s": round(image.build_s, 1),
        "start_to_ready_s": round(container.ready_s, 1),
        "stop_s": round(stopped.stop_s, 1),
        "exit_code": stopped.exit_code,
    }
    for key, value in figures.items():
        record_property(key, value)
    with capsys.disabled():
        print(f"\n[container] {json.dumps(figures)}")


def test_container_exits_cleanly_on_sigterm(stopped: Stopped) -> None:
    assert stopped.exit_code == 0, f"exit code {stopped.exit_code} after {stopped.stop_s:.0f} s:\n{stopped.logs}"
