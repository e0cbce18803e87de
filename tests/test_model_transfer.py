"""Moving models to another machine: `bentoml models export` here, `bentoml models import` there.

The default models go from the test store to .bentomodel archives, and from those into a second,
fresh BentoML home (another process, as on another machine), where a bento could then be built.
Tags, labels and metadata must survive, and every file must still match the sha256 the
pipeline recorded when it registered the model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.build import BuildResult

REPO = Path(__file__).resolve().parent.parent

# Runs in the fresh home: what the store there says about each imported model.
DESCRIBE = """
import json, sys
from pathlib import Path
import bentoml
from serving.artifacts import mismatched_files
described = {}
for tag in sys.argv[1:]:
    model = bentoml.models.get(tag)
    described[tag] = {
        "labels": model.info.labels,
        "metadata": model.info.metadata,
        "files": sorted(p.name for p in Path(model.path).iterdir() if p.name != "model.yaml"),
        "mismatched": mismatched_files(model),
    }
print(json.dumps({"store": [str(m.tag) for m in bentoml.models.list()], "models": described}, default=str))
"""


def in_home(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "BENTOML_HOME": str(home)}
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )


def as_json(value: object) -> object:
    return json.loads(json.dumps(value, default=str))


@pytest.fixture(scope="module")
def archives(built_models: dict[str, BuildResult], bentoml_home: Path, tmp_path_factory) -> dict[str, Path]:
    """Model tag → its exported .bentomodel file."""
    out = tmp_path_factory.mktemp("exported")
    exported = {}
    for name, result in built_models.items():
        tag, path = str(result.model.tag), out / f"{name}.bentomodel"
        done = in_home(bentoml_home, "-m", "bentoml", "models", "export", tag, str(path))
        assert done.returncode == 0, done.stdout + done.stderr
        exported[tag] = path
    return exported


@pytest.fixture(scope="module")
def other_machine(archives: dict[str, Path], tmp_path_factory) -> dict:
    home = tmp_path_factory.mktemp("other-machine-bentoml")
    for path in archives.values():
        done = in_home(home, "-m", "bentoml", "models", "import", str(path))
        assert done.returncode == 0, done.stdout + done.stderr
    described = in_home(home, "-c", DESCRIBE, *archives)
    assert described.returncode == 0, described.stderr
    return json.loads(described.stdout.strip().splitlines()[-1])


def test_each_default_model_exports_to_one_archive(archives: dict[str, Path]) -> None:
    assert {path.name for path in archives.values()} == {"image-classifier.bentomodel", "text-embedder.bentomodel"}
    assert all(path.stat().st_size > 1_000_000 for path in archives.values())


def test_the_fresh_store_holds_exactly_the_imported_tags(other_machine: dict, archives: dict[str, Path]) -> None:
    assert sorted(other_machine["store"]) == sorted(archives)


def test_imported_files_match_the_sha256_recorded_at_registration(
    other_machine: dict, built_models: dict[str, BuildResult]
) -> None:
    for result in built_models.values():
        imported = other_machine["models"][str(result.model.tag)]
        recorded = result.model.info.metadata["sha256"]
        assert imported["metadata"]["sha256"] == recorded
        assert set(recorded) <= set(imported["files"])
        assert imported["mismatched"] == []


def test_labels_and_metadata_survive_the_round_trip(other_machine: dict, built_models: dict[str, BuildResult]) -> None:
    for result in built_models.values():
        imported = other_machine["models"][str(result.model.tag)]
        assert imported["labels"] == result.model.info.labels
        assert imported["metadata"] == as_json(result.model.info.metadata)
