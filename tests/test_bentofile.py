"""What goes into the bento and how `make bento` / `make container` build it, checked without building.

The slow tests/test_container.py builds and runs the real thing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from podman_setup import LOCAL_BASE_IMAGE

REPO = Path(__file__).resolve().parent.parent
CPU = yaml.safe_load((REPO / "bentofile.yaml").read_text())
GPU = yaml.safe_load((REPO / "bentofile.gpu.yaml").read_text())
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PIPELINE_ONLY = {"torch", "torchvision", "transformers", "onnx", "onnxscript", "neural-compressor"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(bentofile: dict) -> dict[str, str]:
    pinned = {}
    for requirement in bentofile["python"]["packages"]:
        name, sep, pinned_version = requirement.partition("==")
        assert sep and pinned_version, f"{requirement!r} is not pinned with =="
        pinned[canonical(name)] = pinned_version
    return pinned


def declared_runtime() -> set[str]:
    return {canonical(re.split(r"[\s<>=!~;\[]", dep, maxsplit=1)[0]) for dep in PYPROJECT["project"]["dependencies"]}


def test_bento_installs_exactly_the_runtime_pyproject_declares() -> None:
    assert set(pins(CPU)) == declared_runtime()
    assert not PIPELINE_ONLY & set(pins(CPU))


def test_bento_pins_the_versions_installed_here() -> None:
    installed = {name: version(name) for name in pins(CPU)}
    assert pins(CPU) == installed


def test_packages_are_locked_with_their_dependencies() -> None:
    assert CPU["python"]["lock_packages"] is True
    assert GPU["python"]["lock_packages"] is True


def test_gpu_bento_swaps_only_the_onnx_runtime() -> None:
    cpu, gpu = pins(CPU), pins(GPU)
    assert set(gpu) - set(cpu) == {"onnxruntime-gpu", "tensorrt-cu13"}
    assert set(cpu) - set(gpu) == {"onnxruntime"}
    assert {name: gpu[name] for name in cpu if name in gpu} == {name: cpu[name] for name in cpu if name in gpu}
    for key in ("service", "include", "exclude"):
        assert GPU[key] == CPU[key], key
    assert GPU["docker"]["dockerfile_template"] == CPU["docker"]["dockerfile_template"]
    assert GPU["docker"]["base_image"].startswith("nvidia/cuda:")
    assert GPU["name"] != CPU["name"], "make container GPU=1 containerizes the GPU bento by name"


def test_bento_includes_the_service_and_the_manifest() -> None:
    assert CPU["service"] == "service:Optiserve"
    assert {"service.py", "serving/**", "serving-manifest.json"} <= set(CPU["include"])


def test_local_base_image_name_is_the_same_everywhere() -> None:
    assert CPU["docker"]["base_image"] == LOCAL_BASE_IMAGE
    build_sh = (REPO / "deploy" / "base-image" / "build.sh").read_text()
    assert f'IMAGE="${{OPTISERVE_BASE_IMAGE:-{LOCAL_BASE_IMAGE}}}"' in build_sh
    assert re.search(rf"^LOCAL_BASE_IMAGE := {re.escape(LOCAL_BASE_IMAGE)}$", (REPO / "Makefile").read_text(), re.M)


def test_template_exists_where_the_bentofile_points() -> None:
    template = (REPO / CPU["docker"]["dockerfile_template"]).read_text()
    assert template.startswith("{% extends bento_base_template %}")
    assert "ARG BASE_IMAGE={{ __base_image__ }}\nFROM ${BASE_IMAGE}" in template


def test_setup_installs_uv_for_bentoml_build() -> None:
    assert "uv" in {
        canonical(re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0])
        for d in PYPROJECT["project"]["optional-dependencies"]["dev"]
    }
    version("uv")


def dry_run(*args: str, manifest: Path) -> str:
    """The commands `make` would run (-n), with this interpreter's venv taken as installed."""
    venv = Path(sys.prefix)
    cmd = ["make", "-n", "-C", str(REPO), "-o", str(venv / ".installed"), f"VENV={venv}", f"MANIFEST={manifest}", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    return " ".join(result.stdout.replace("\\\n", " ").split())


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    path = tmp_path / "serving-manifest.json"
    path.write_text("{}")
    return path


def test_make_container_defaults_to_podman_on_the_local_base_image(manifest: Path) -> None:
    commands = dry_run("container", manifest=manifest)
    assert "build -f bentofile.yaml ." in commands
    assert f"podman image exists {LOCAL_BASE_IMAGE} || deploy/base-image/build.sh" in commands
    assert "containerize --backend podman --opt isolation=chroot -t optiserve:latest optiserve:latest" in commands
    assert "build-arg" not in commands
    assert "-m pipeline" not in commands, "an explicit MANIFEST is used as it is"


def test_one_variable_switches_to_docker_and_python_slim(manifest: Path) -> None:
    commands = dry_run("container", "BASE_IMAGE=python:3.13-slim", "BACKEND=docker", manifest=manifest)
    assert "containerize --backend docker --opt build-arg=BASE_IMAGE=python:3.13-slim" in commands
    assert "isolation=chroot" not in commands
    assert "deploy/base-image/build.sh" not in commands


def test_gpu_switch_builds_the_gpu_bento(manifest: Path) -> None:
    commands = dry_run("container", "GPU=1", manifest=manifest)
    assert "build -f bentofile.gpu.yaml ." in commands
    assert "-t optiserve-gpu:latest optiserve-gpu:latest" in commands
    assert "deploy/base-image/build.sh" not in commands


def test_default_manifest_is_rebuilt_by_the_pipeline_first() -> None:
    venv = Path(sys.prefix)
    cmd = ["make", "-n", "-C", str(REPO), "-o", str(venv / ".installed"), f"VENV={venv}", "bento"]
    commands = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "-m pipeline" in commands


def test_the_bento_takes_the_manifest_the_pipeline_wrote_where_optiserve_manifest_points(tmp_path: Path) -> None:
    venv = Path(sys.prefix)
    cmd = ["make", "-n", "-C", str(REPO), "-o", str(venv / ".installed"), f"VENV={venv}", "bento"]
    elsewhere = tmp_path / "elsewhere.json"
    env = {**os.environ, "OPTISERVE_MANIFEST": str(elsewhere)}
    commands = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True, env=env).stdout
    assert "-m pipeline" in commands and f'cp "{elsewhere}" ' in commands
