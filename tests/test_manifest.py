"""The serving manifest and stored model specs: what the service reads before it serves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from serving.manifest import (
    ManifestError,
    Route,
    ServingManifest,
    load_manifest,
    read_manifest,
    update_manifest,
    write_manifest,
)


def route(tag: str, recipe: str) -> Route:
    return Route(tag=tag, recipe=recipe, max_batch_size=8, max_latency_ms=500, max_items_per_request=64)


IMAGE = route("image-classifier:aaa", "image-classifier")
TEXT = route("text-embedder:bbb", "text-embedder")


@pytest.fixture
def served(tmp_path: Path) -> Path:
    path = tmp_path / "serving-manifest.json"
    write_manifest(ServingManifest(classify=IMAGE, embed=TEXT), path)
    return path


def test_building_a_recipe_without_an_endpoint_keeps_both_routes(served: Path) -> None:
    update_manifest({}, served)
    assert read_manifest(served) == ServingManifest(classify=IMAGE, embed=TEXT)


def test_building_one_served_recipe_replaces_its_route_only(served: Path) -> None:
    newer = route("text-embedder:ccc", "text-embedder")
    update_manifest({"embed": newer}, served)
    assert read_manifest(served) == ServingManifest(classify=IMAGE, embed=newer)


DIGITS = route("digits-classifier:ddd", "digits-classifier")


def test_a_model_without_a_default_endpoint_is_routed_by_its_name(served: Path) -> None:
    manifest = update_manifest({"digits-classifier": DIGITS}, served)
    assert manifest == ServingManifest(classify=IMAGE, embed=TEXT, models={"digits-classifier": DIGITS})
    assert list(read_manifest(served).routes()) == ["classify", "embed", "digits-classifier"]


def test_a_model_moved_to_a_default_endpoint_leaves_its_own_route(served: Path) -> None:
    update_manifest({"digits-classifier": DIGITS}, served)
    assert update_manifest({"classify": DIGITS}, served) == ServingManifest(classify=DIGITS, embed=TEXT)


def test_a_model_moved_off_its_default_endpoint_leaves_the_endpoint(served: Path) -> None:
    manifest = update_manifest({"image-classifier": IMAGE}, served)
    assert manifest == ServingManifest(embed=TEXT, models={"image-classifier": IMAGE})


@pytest.mark.parametrize(
    ("models", "message"),
    [
        ({"digits": DIGITS}, "models.digits: the route serves 'digits-classifier'"),
        ({"image-classifier": IMAGE}, "'image-classifier' is already served by the 'classify' route"),
    ],
)
def test_a_model_route_serves_the_model_it_is_named_after_once(models: dict[str, Route], message: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        ServingManifest(classify=IMAGE, models=models)


def test_the_first_run_creates_the_manifest(tmp_path: Path) -> None:
    path = tmp_path / "serving-manifest.json"
    update_manifest({"classify": IMAGE}, path)
    assert read_manifest(path) == ServingManifest(classify=IMAGE)


def test_an_invalid_manifest_is_named_and_left_alone(served: Path) -> None:
    served.write_text('{"classify": "not a route"}')
    with pytest.raises(ManifestError, match=r"serving-manifest\.json is not a valid serving manifest"):
        update_manifest({"embed": TEXT}, served)
    assert served.read_text() == '{"classify": "not a route"}'


def test_a_manifest_naming_models_the_store_lacks_is_refused_with_where_to_look(served: Path) -> None:
    """As when the pipeline ran into another BENTOML_HOME than the one the service reads."""
    with pytest.raises(ManifestError) as refused:
        load_manifest(served)

    message = str(refused.value)
    assert str(served) in message and "image-classifier:aaa" in message
    assert f"BENTOML_HOME={os.environ['BENTOML_HOME']}" in message and "OPTISERVE_MANIFEST" in message


def test_writing_leaves_no_temporary_file_behind(served: Path) -> None:
    update_manifest({"embed": TEXT}, served)
    assert [p.name for p in served.parent.iterdir()] == ["serving-manifest.json"]


def test_a_stored_spec_without_its_tasks_input_is_refused_when_read() -> None:
    from pydantic import ValidationError

    from serving.model_runtime import read_spec

    with pytest.raises(ValidationError, match="a text-embedding model's spec needs its 'text' input"):
        read_spec({"optiserve": {"task": "text-embedding", "input_names": ["input_ids"], "output_names": ["e"]}})


def test_the_pipeline_writes_the_manifest_the_server_reads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pipeline.build_command import parse_args

    monkeypatch.setenv("OPTISERVE_MANIFEST", str(tmp_path / "elsewhere.json"))
    assert parse_args(["models/digits-classifier.yaml"]).manifest == tmp_path / "elsewhere.json"
    monkeypatch.delenv("OPTISERVE_MANIFEST")
    assert parse_args(["models/digits-classifier.yaml"]).manifest.name == "serving-manifest.json"
