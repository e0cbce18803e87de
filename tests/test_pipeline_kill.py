"""A pipeline run killed with SIGKILL at any point leaves the model store listable with only whole
models in it, and the serving manifest as it was; the next run completes and cleans up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RECIPE = """\
name: tiny-digits
task: image-classification
source: {kind: train-digits, epochs: 2, channels: 32, blocks: 1}
image: {size: 8, resize: 8, mean: [0.0, 0.0, 0.0], std: [255.0, 255.0, 255.0]}
export: {opset: 17, tolerance: {max_abs_diff: 1.0e-3, min_cosine: 0.999, min_top1_agreement: 0.9}}
variants: [openvino]
budget: {max_drop: {accuracy: 0.05}, p99_slo_ms: 1000}
profiling: {max_batch_size: 8, seconds_per_point: 0.1}
serving: {endpoint: classify, max_items_per_request: 8}
"""
PREVIOUS_MANIFEST = json.dumps(
    {
        "classify": {
            "tag": "image-classifier:previous",
            "recipe": "image-classifier",
            "max_batch_size": 4,
            "max_latency_ms": 1000,
            "max_items_per_request": 64,
        }
    }
)
HOME = "store-home"
# Where each run dies: (audited operation, text in its path, occurrence) and how many whole
# versions the store then holds, counting those of the runs killed before. Every run rebuilds
# (--force) and registers fp32 then openvino, 3 files each (model.yaml, class_names.json, model.onnx).
POINTS = {
    "writing the ONNX export": (("open", "model.onnx", 1), 0),
    "copying the first version's files": (("shutil.copyfile", f"{HOME}/", 2), 0),
    "renaming the first version into the store": (("os.rename", f"{HOME}/", 1), 0),
    "copying the second version's files": (("shutil.copyfile", f"{HOME}/", 5), 1),
    "pointing 'latest' at the second version": (("os.rename", f"{HOME}/", 4), 3),
    "replacing the manifest": (("os.rename", "serving-manifest.json", 1), 5),
}
STORE_CHECK = """\
import json, bentoml
from serving.artifacts import mismatched_files
print(json.dumps({str(m.tag): mismatched_files(m) for m in bentoml.models.list()}))
"""


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    (tmp_path / "tiny-digits.yaml").write_text(RECIPE)
    (tmp_path / "serving-manifest.json").write_text(PREVIOUS_MANIFEST)
    return tmp_path


def pipeline_env(workspace: Path) -> dict[str, str]:
    return {**os.environ, "BENTOML_HOME": str(workspace / HOME), "TMPDIR": str(workspace), "PYTHONPATH": str(REPO)}


def run_pipeline(workspace: Path, *wrapper: str, force: bool = False) -> subprocess.CompletedProcess:
    args = [workspace / "tiny-digits.yaml", "--manifest", workspace / "serving-manifest.json"]
    args += ["--reports", workspace / "reports", *(["--force"] if force else [])]
    return subprocess.run(
        [sys.executable, *wrapper, *map(str, args)],
        cwd=REPO,
        env=pipeline_env(workspace),
        capture_output=True,
        timeout=300,
    )


def stored_models(workspace: Path) -> dict[str, list[str]]:
    """Every version `bentoml.models.list()` reads back, with the files that fail their sha256."""
    listed = subprocess.run(
        [sys.executable, "-c", STORE_CHECK], cwd=REPO, env=pipeline_env(workspace), capture_output=True, text=True
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    return json.loads(listed.stdout)


def test_a_run_killed_at_any_point_leaves_whole_models_and_the_manifest_as_it_was(workspace: Path) -> None:
    for point, ((event, text, nth), versions) in POINTS.items():
        kill = [str(REPO / "tests" / "kill_at.py"), event, text, str(nth), "--"]
        killed = run_pipeline(workspace, *kill, force=True)
        assert killed.returncode == -9, f"{point}: the run was not killed\n{killed.stderr.decode()[-2000:]}"
        assert (workspace / "serving-manifest.json").read_text() == PREVIOUS_MANIFEST, point
        stored = stored_models(workspace)
        assert {tag: bad for tag, bad in stored.items() if bad} == {}, point
        assert len(stored) == versions, point

    finished = run_pipeline(workspace, "-m", "pipeline")
    assert finished.returncode == 0, finished.stderr.decode()[-2000:]
    served = json.loads((workspace / "serving-manifest.json").read_text())["classify"]["tag"]
    assert served in stored_models(workspace)
    assert not list((workspace / HOME / ".optiserve-staging").iterdir()), "abandoned staging left behind"
