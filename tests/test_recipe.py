"""Recipes: every mistake is one line naming the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.recipe import RecipeError, load_recipe, request_texts, resolve_path

REPO = Path(__file__).resolve().parent.parent


DELETE = object()


def write_recipe(tmp_path: Path, base: str, **changes) -> Path:
    data = yaml.safe_load((REPO / "models" / f"{base}.yaml").read_text())
    for dotted, value in changes.items():
        target = data
        *parents, leaf = dotted.split("__")
        for key in parents:
            target = target[key]
        if value is DELETE:
            del target[leaf]
        else:
            target[leaf] = value
    path = tmp_path / f"{base}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("name", ["image-classifier", "text-embedder"])
def test_default_recipes_load_and_resolve_packaged_files(name: str) -> None:
    loaded = load_recipe(REPO / "models" / f"{name}.yaml")
    assert loaded.name == name
    assert all(path.exists() for path in loaded.files.values())


@pytest.mark.parametrize(
    ("base", "changes", "message"),
    [
        pytest.param(
            "image-classifier",
            {"serving__max_batchsize": 8},
            r"image-classifier\.yaml: serving\.max_batchsize: unknown key",
            id="unknown key",
        ),
        pytest.param("image-classifier", {"image__size": "large"}, r"image\.size: .*valid integer", id="wrong type"),
        pytest.param(
            "image-classifier",
            {"source__architecture": "efficientnet-lite9"},
            r": source\.architecture: ",
            id="a source field, without the union tag",
        ),
        pytest.param(
            "image-classifier",
            {"source__weights": "weights/missing.pth"},
            r"source\.weights: file not found: .*weights/missing\.pth",
            id="missing file",
        ),
        pytest.param(
            "text-embedder",
            {"source__path": "package:no_such_package_xyz/model"},
            r"source\.path: package 'no_such_package_xyz' is not installed",
            id="missing package",
        ),
        pytest.param(
            "text-embedder", {"text": DELETE}, r"text-embedder\.yaml: text: Field required", id="missing pre-processing"
        ),
        pytest.param(
            "text-embedder",
            {"source": {"kind": "torchvision", "architecture": "resnet18", "weights": "x.pth"}},
            r"text-embedder\.yaml: source: .*'torchvision'.*expected tags: 'huggingface'",
            id="a source kind the task cannot use",
        ),
        pytest.param(
            "image-classifier",
            {"labels": DELETE},
            "task image-classification needs the field 'labels'",
            id="a photo classifier without labels",
        ),
        pytest.param(
            "text-embedder",
            {"variants": ["student", "cascade"]},
            r"a cascade answers with a classifier's confidence, not a text-embedding model's",
            id="a cascade of embedders",
        ),
        pytest.param(
            "image-classifier",
            {"variants": ["openvino", "student", "cascade"]},
            r"image-classifier\.yaml: variants: student, cascade: .*only a train-digits source has",
            id="a student of a photo classifier (a rejected trial after the build's slow steps)",
        ),
        pytest.param(
            "image-classifier",
            {"source": {"kind": "torchvision", "architecture": "inception_v3", "weights": "x.pt", "num_classes": 3}},
            r"image-classifier\.yaml: source\.options\.transform_input: inception_v3 fine-tuned from .* state it",
            id="inception_v3 without transform_input (the wrong one answers wrongly)",
        ),
        pytest.param(
            "image-classifier",
            {"source__num_classes": 1},
            r"image-classifier\.yaml: source\.num_classes: 1 output is a sigmoid classifier",
            id="one output (always 1.0 through the softmax)",
        ),
        pytest.param(
            "image-classifier",
            {"serving__variant": "student"},
            r"serving\.variant: 'student' is not among the recipe's variants",
            id="serving a variant the recipe does not build",
        ),
        pytest.param(
            "image-classifier",
            {"image__resize": 200},
            r"image: resize \(200\) must be at least size \(224\)",
            id="crop larger than resize",
        ),
        pytest.param(
            "image-classifier",
            {"budget__max_drop": {"accuracy": 0.01}},
            r"budget\.max_drop\.accuracy: the evaluation photos of a efficientnet-lite source have no labels",
            id="an accuracy budget without labelled data (it judged nothing)",
        ),
        pytest.param(
            "image-classifier",
            {"serving__endpoint": "embed"},
            r"serving\.endpoint: 'embed' does not answer image-classification models; 'classify' does",
            id="an image model on the text endpoint (every request answered 500)",
        ),
        pytest.param(
            "text-embedder",
            {"budget__p99_slo_ms": 0.5},
            r"budget\.p99_slo_ms: .*greater than or equal to 1",
            id="an SLO below a millisecond (it crashed after the build)",
        ),
        pytest.param(
            "image-classifier",
            {"name": "a" * 64},
            r"name: String should have at most 63 characters",
            id="a name longer than BentoML takes (a traceback at the store)",
        ),
        pytest.param(
            "text-embedder",
            {"source__path": "package:no_such_package_xyz.inner/model"},
            r"source\.path: package 'no_such_package_xyz\.inner' is not installed",
            id="a module in a missing package (a traceback)",
        ),
        pytest.param(
            "image-classifier",
            {"labels": "."},
            r"labels: .* is not a file",
            id="a folder for a file (a traceback after the export)",
        ),
        pytest.param(
            "image-classifier",
            {"image__mean": [0.485, 0.456, 0.406], "image__std": [0.229, 0.224, 0.225]},
            r"image: mean \[0\.485, .* look like the 0-1 scale; .*mean \[123\.675, 116\.28, 103\.53\]",
            id="torchvision's mean and std on the 0-1 scale (served wrong answers)",
        ),
        pytest.param(
            "image-classifier",
            {"image__mean": [0.5, 0.5, 0.5], "image__std": [58.4, 57.1, 57.4]},
            r"image: .* look like the 0-1 scale",
            id="a mean on the 0-1 scale",
        ),
        pytest.param("image-classifier", {"image__std": [58.4, 0.0, 57.4]}, r"image: std: .* above 0", id="a std of 0"),
    ],
)
def test_a_mistake_is_one_line_naming_the_field(tmp_path: Path, base: str, changes: dict, message: str) -> None:
    with pytest.raises(RecipeError, match=message) as error:
        load_recipe(write_recipe(tmp_path, base, **changes))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("mean", "std"), [([0.0, 0.0, 0.0], [255.0, 255.0, 255.0]), ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])]
)
def test_pixels_scaled_to_0_1_or_left_raw_are_no_mistake(tmp_path: Path, mean: list, std: list) -> None:
    assert load_recipe(write_recipe(tmp_path, "image-classifier", image__mean=mean, image__std=std))


def test_a_recipe_without_serving_is_served_at_its_own_path(tmp_path: Path) -> None:
    loaded = load_recipe(write_recipe(tmp_path, "image-classifier", serving=DELETE))
    assert loaded.recipe.serving.endpoint is None and loaded.recipe.serving.max_batch_size is None


def test_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="a recipe is a YAML mapping"):
        load_recipe(path)


def test_relative_paths_resolve_against_the_recipe(tmp_path: Path) -> None:
    assert resolve_path("weights.pt", tmp_path) == tmp_path / "weights.pt"


def test_content_hash_is_stable_and_changes_with_what_the_build_makes(tmp_path: Path) -> None:
    for folder in "abcd":
        (tmp_path / folder).mkdir()
    first = load_recipe(write_recipe(tmp_path / "a", "image-classifier"))
    changed = load_recipe(write_recipe(tmp_path / "b", "image-classifier", budget__p99_slo_ms=500))
    served_otherwise = load_recipe(write_recipe(tmp_path / "c", "image-classifier", serving__max_batch_size=8))
    another_variant = load_recipe(write_recipe(tmp_path / "d", "image-classifier", serving__variant="openvino"))
    assert first.content_hash() == load_recipe(first.path).content_hash()
    assert first.content_hash() != changed.content_hash()
    assert first.content_hash() == served_otherwise.content_hash()  # serving settings go to the manifest only
    assert first.content_hash() != another_variant.content_hash()  # but the build selects the variant served


def test_missing_requests_file_names_the_field(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, "text-embedder", profiling={"requests": "traffic/requests.txt"})
    with pytest.raises(
        RecipeError, match=r"text-embedder\.yaml: profiling\.requests: file not found: .*traffic/requests\.txt"
    ):
        load_recipe(path)


def test_requests_file_without_texts_is_refused(tmp_path: Path) -> None:
    (tmp_path / "requests.txt").write_text("\n   \n")
    path = write_recipe(tmp_path, "text-embedder", profiling={"requests": "requests.txt"})
    with pytest.raises(RecipeError, match=r"profiling\.requests: no texts in .*requests\.txt"):
        load_recipe(path)


def test_requests_file_is_read_per_line_and_counts_in_the_content_hash(tmp_path: Path) -> None:
    requests = tmp_path / "requests.txt"
    requests.write_text("a cat on a mat\n\nHow do I reset my password?\n")
    loaded = load_recipe(write_recipe(tmp_path, "text-embedder", profiling={"requests": "requests.txt"}))
    assert request_texts(loaded.files["profiling.requests"]) == ["a cat on a mat", "How do I reset my password?"]
    before = loaded.content_hash()
    requests.write_text("another request\n")
    assert load_recipe(loaded.path).content_hash() != before


def test_unknown_profiling_key_names_the_field(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, "text-embedder", profiling={"sequence_length": 128})
    with pytest.raises(RecipeError, match=r"profiling\.sequence_length: unknown key"):
        load_recipe(path)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"profiling": {"requests": "requests.txt"}}, "profiling.requests"),
        ({"serving__max_batch_tokens": 512}, "serving.max_batch_tokens"),
    ],
)
def test_token_settings_are_refused_for_images(tmp_path: Path, changes: dict, field: str) -> None:
    with pytest.raises(RecipeError, match=rf"image-classifier\.yaml: {field}: text tasks only"):
        load_recipe(write_recipe(tmp_path, "image-classifier", **changes))


def test_token_cap_override_must_be_positive(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, "text-embedder", serving__max_batch_tokens=0)
    with pytest.raises(RecipeError, match=r"serving\.max_batch_tokens: .*greater than or equal to 1"):
        load_recipe(path)


def test_two_recipes_of_one_name_are_refused_before_any_build(tmp_path: Path, capsys) -> None:
    from pipeline.build_command import main

    first = write_recipe(tmp_path, "image-classifier")
    (tmp_path / "again").mkdir()
    second = write_recipe(tmp_path / "again", "image-classifier", serving__endpoint=DELETE)
    assert main([str(first), str(second), "--manifest", str(tmp_path / "m.json")]) == 2
    said = capsys.readouterr().err
    assert f"{second}: name: 'image-classifier' is also the name in {first}" in said.replace("\n", "")


def test_an_error_is_printed_as_it_is_not_read_as_markup(tmp_path: Path, capsys) -> None:
    """`[a-z0-9]` in pydantic's pattern message was eaten as a rich style tag."""
    from pipeline.build_command import main

    assert main([str(write_recipe(tmp_path, "image-classifier", name="My-Model")), "--manifest", "m.json"]) == 2
    assert "'^[a-z0-9]([a-z0-9._-]*[a-z0-9])?$'" in capsys.readouterr().err


def test_a_manifest_that_cannot_be_written_is_refused_before_any_build(tmp_path: Path, capsys) -> None:
    from pipeline.build_command import main

    recipe = str(write_recipe(tmp_path, "image-classifier"))
    assert main([recipe, "--manifest", str(tmp_path / "no-such-folder" / "m.json")]) == 2
    assert main([recipe, "--manifest", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("not a file in an existing folder") == 2


def test_a_text_longer_than_the_models_positions_is_refused_at_the_source(tmp_path: Path) -> None:
    """MiniLM has 512 positions: a 1 024-token limit built, and the service failed to start."""
    from pipeline.sources import load_source

    with pytest.raises(RecipeError, match=r"text\.max_length: 1024 tokens, but the model has positions for 512"):
        load_source(load_recipe(write_recipe(tmp_path, "text-embedder", text__max_length=1024)))


def test_a_key_given_twice_is_refused_with_its_line(tmp_path: Path) -> None:
    """PyYAML keeps the last of two `serving:` blocks silently."""
    recipe = write_recipe(tmp_path, "image-classifier")
    recipe.write_text(recipe.read_text() + "serving:\n  endpoint: classify\n")
    line = recipe.read_text().count("\n") - 1
    with pytest.raises(
        RecipeError, match=rf"image-classifier\.yaml: line {line}: 'serving' is given twice in one mapping"
    ):
        load_recipe(recipe)


@pytest.mark.parametrize(
    ("field", "value"), [("cache_mb", True), ("max_items_per_request", "16"), ("max_items_per_request", True)]
)
def test_a_number_must_be_a_number(tmp_path: Path, field: str, value: object) -> None:
    """YAML's `yes` was a 1 MB cache, "16" sixteen items."""
    with pytest.raises(RecipeError, match=rf"serving\.{field}: Input should be a valid"):
        load_recipe(write_recipe(tmp_path, "image-classifier", **{f"serving__{field}": value}))
