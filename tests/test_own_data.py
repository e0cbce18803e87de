"""A recipe's own data (`data:`): images split by file into calibration and evaluation (labelled by
class subfolders), texts by line; mistakes refused in one line naming the field; a build judged on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
import yaml
from PIL import Image, ImageDraw
from test_variants import TINY_PROFILE, tiny_bert_dir

from pipeline import datasets
from pipeline.build import JUDGED_ON, build
from pipeline.build_command import load_all
from pipeline.datasets import MIN_TEXTS, calibration_files, image_folder, judged_files, text_split
from pipeline.own_data import check_data, own_images, own_texts
from pipeline.recipe import RecipeError, load_recipe
from pipeline.report import write_report
from pipeline.tuning import HELD_OUT
from serving.model_spec import ImageInput

REPO = Path(__file__).resolve().parent.parent
CLASSES = ("circle", "square", "triangle")
SPEC = ImageInput(size=32, resize=36)


def shape_image(path: Path, shape: str, seed: int) -> Path:
    """A coloured shape on a noisy background, at a random place: different files, alike classes."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 80, (56, 72, 3), dtype=np.uint8))
    x, y, r = int(rng.integers(16, 56)), int(rng.integers(16, 40)), int(rng.integers(8, 15))
    colour = tuple(int(c) for c in rng.integers(120, 256, 3))
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=colour)
    elif shape == "square":
        draw.rectangle((x - r, y - r, x + r, y + r), fill=colour)
    else:
        draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=colour)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def shapes_folder(root: Path, per_class: int = 8, labelled: bool = True) -> Path:
    """`per_class` images of each shape: in subfolders named after the classes (ImageFolder), else in
    folders that are no label, with every format the service takes."""
    suffixes = (".png", ".jpg", ".webp", ".bmp")
    for c, shape in enumerate(CLASSES):
        for i in range(per_class):
            folder = shape if labelled else f"batch-{i % 2}/roll-{c}"
            shape_image(root / folder / f"{shape}-{i}{suffixes[i % len(suffixes)]}", shape, seed=100 * c + i)
    return root


def image_recipe(tmp_path: Path, data: dict | None, **changes) -> Path:
    """A user's 3-class resnet18 on 32-pixel inputs: their weights, their labels, their data."""
    torch.manual_seed(0)
    weights = tmp_path / "shapes.pt"
    if not weights.exists():
        torch.save(torchvision.models.get_model("resnet18", weights=None, num_classes=3).state_dict(), weights)
    (tmp_path / "labels.txt").write_text("\n".join(CLASSES) + "\n")
    recipe = {
        "name": "shapes",
        "task": "image-classification",
        "source": {"kind": "torchvision", "architecture": "resnet18", "weights": weights.name, "num_classes": 3},
        "labels": "labels.txt",
        "image": {"size": SPEC.size, "resize": SPEC.resize, "mean": [127.0] * 3, "std": [128.0] * 3},
        "export": {"tolerance": {"max_abs_diff": 1.0e-4, "min_cosine": 0.9999}},
        "profiling": TINY_PROFILE,
        **({"data": data} if data is not None else {}),
        **changes,
    }
    path = tmp_path / "shapes.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def text_recipe(tmp_path: Path, texts: str) -> Path:
    recipe = yaml.safe_load((REPO / "models" / "text-embedder.yaml").read_text())
    recipe["data"] = {"texts": texts}
    path = tmp_path / "text-embedder.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> Path:
    return shapes_folder(tmp_path_factory.mktemp("labelled") / "photos")


def test_images_are_split_by_file_disjointly_and_the_same_whatever_the_listing(tmp_path: Path) -> None:
    folder = image_folder(shapes_folder(tmp_path / "photos", labelled=False), CLASSES)
    calibration, evaluation = folder.part("calibration"), folder.part(HELD_OUT)
    assert folder.labels is None, "no subfolder is a label: unlabelled"
    assert len(folder.names) == 24 and any(name.endswith(".webp") for name in folder.names)
    assert len(calibration) == 6 and not set(calibration) & set(evaluation)
    assert sorted(calibration + evaluation) == sorted(folder.names)
    assert folder.part("perturbed") == evaluation
    assert calibration_files(list(reversed(folder.names))) == calibration_files(list(folder.names))
    (tmp_path / "photos" / "batch-0" / "._circle-0.png").write_bytes(b"macOS metadata")
    assert image_folder(tmp_path / "photos", CLASSES) == folder, "hidden files are no images"


def test_an_added_image_moves_at_most_one_other_between_the_parts() -> None:
    names = [f"scan-{i}.png" for i in range(40)]
    before = set(calibration_files(names))
    for added in ("scan-40.png", "new/scan-a.png", "zzz.jpg"):
        after = set(calibration_files([*names, added]))
        assert len((before ^ after) - {added}) <= 1
    many = [f"{i}.png" for i in range(10_000)]
    assert len(calibration_files(many)) == datasets.VIEWS_PER_SLICE["calibration"]
    assert len(judged_files(many)) == datasets.MAX_JUDGED_IMAGES and not set(judged_files(many)) & set(
        calibration_files(many)
    ), "a large folder is judged on a fixed share of its files, none calibrated on"


def test_views_count_files_and_keep_the_minimum_number_of_inputs(labelled: Path) -> None:
    folder = image_folder(labelled, CLASSES)
    held_out, perturbed, calibration = (folder.split(SPEC, part) for part in (HELD_OUT, "perturbed", "calibration"))
    assert len(held_out) == len(perturbed) == -(-512 // 18) * 18 >= 512
    assert len(calibration) >= 96 and set(calibration.groups) == set(folder.part("calibration"))
    for split in (held_out, perturbed):
        files, counts = np.unique(split.groups, return_counts=True)
        assert set(files) == set(folder.part(HELD_OUT)) and len(set(counts)) == 1
    assert not {row.tobytes() for row in calibration.rows} & {row.tobytes() for row in held_out.rows}
    again = folder.split(SPEC, "perturbed")
    assert all(np.array_equal(a, b) for a, b in zip(again.rows, perturbed.rows, strict=True)), "seeded"


def test_many_images_get_one_view_each(labelled: Path, monkeypatch) -> None:
    monkeypatch.setitem(datasets.VIEWS_PER_SLICE, HELD_OUT, 4)
    folder = image_folder(labelled, CLASSES)
    split = folder.split(SPEC, HELD_OUT)
    assert sorted(split.groups) == sorted(folder.part(HELD_OUT))


def test_class_subfolders_named_after_the_labels_label_every_view(labelled: Path) -> None:
    folder = image_folder(labelled, CLASSES)
    assert folder.labels == {name: CLASSES.index(name.split("/")[0]) for name in folder.names}
    split = folder.split(SPEC, "perturbed")
    assert split.labels.tolist() == [CLASSES.index(group.split("/")[0]) for group in split.groups]


def test_texts_are_split_by_line_into_disjoint_parts() -> None:
    texts = [f"report {i}: the valve on line {i % 7} leaks" for i in range(400)]
    parts = {
        part: text_split(list, part, texts).rows for part in ("evaluation", "calibration", "profiling", "training")
    }
    assert [len(rows) for rows in parts.values()] == [50, 50, 50, 250]
    assert sorted(row for rows in parts.values() for row in rows) == sorted(texts)
    assert parts["evaluation"] == texts[1::8] == text_split(list, "evaluation", texts).rows


def test_a_recipes_texts_are_read_per_line_and_count_in_the_content_hash(tmp_path: Path) -> None:
    texts = tmp_path / "tickets.txt"
    texts.write_text("".join(f"ticket {i}: printer jams\n\n" for i in range(MIN_TEXTS)))
    loaded = load_recipe(text_recipe(tmp_path, "tickets.txt"))
    assert own_texts(loaded) == [f"ticket {i}: printer jams" for i in range(MIN_TEXTS)]
    before = loaded.content_hash()
    texts.write_text("".join(f"ticket {i}: screen flickers\n" for i in range(MIN_TEXTS)))
    assert load_recipe(loaded.path).content_hash() != before


def test_a_changed_image_changes_the_content_hash(tmp_path: Path) -> None:
    photos = shapes_folder(tmp_path / "photos")
    loaded = load_recipe(image_recipe(tmp_path, {"images": "photos"}))
    assert loaded.files["data.images"] == photos
    before = loaded.content_hash()
    shape_image(photos / "circle" / "circle-0.png", "square", seed=7)
    assert load_recipe(loaded.path).content_hash() != before


def test_only_the_images_of_a_folder_count_in_the_content_hash(tmp_path: Path) -> None:
    """What the build never reads rebuilds nothing: Finder's `.DS_Store`, a `._` copy, notes."""
    photos = shapes_folder(tmp_path / "photos")
    loaded = load_recipe(image_recipe(tmp_path, {"images": "photos"}))
    before = loaded.content_hash()
    (photos / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (photos / "circle" / "._circle-0.png").write_bytes(b"\0\5\26\7")
    (photos / "README.txt").write_text("shapes drawn for the tests\n")
    assert load_recipe(loaded.path).content_hash() == before
    shape_image(photos / "extra.png", "square", seed=8)
    assert load_recipe(loaded.path).content_hash() != before


def test_accuracy_is_bounded_on_a_labelled_folder_and_refused_on_an_unlabelled_one(tmp_path: Path) -> None:
    budget = {"max_drop": {"accuracy": 0.02}}
    shapes_folder(tmp_path / "labelled")
    shapes_folder(tmp_path / "unlabelled", labelled=False)
    check_data(load_recipe(image_recipe(tmp_path, {"images": "labelled"}, budget=budget)))
    with pytest.raises(RecipeError, match=r"shapes\.yaml: budget\.max_drop\.accuracy: .*unlabelled have no labels"):
        check_data(load_recipe(image_recipe(tmp_path, {"images": "unlabelled"}, budget=budget)))
    with pytest.raises(RecipeError, match=r"budget\.max_drop\.accuracy: .*or give data\.images"):
        load_recipe(image_recipe(tmp_path, None, budget=budget))


def _too_few(root: Path) -> str:
    for i in range(5):
        shape_image(root / "few" / f"part-{i}.png", "circle", seed=i)
    return "few"


def _unreadable(root: Path) -> str:
    shapes_folder(root / "photos")
    (root / "photos" / "square" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")
    return "photos"


def _half_labelled(root: Path) -> str:
    shapes_folder(root / "photos")
    shape_image(root / "photos" / "unsorted" / "x.png", "circle", seed=1)
    return "photos"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(_too_few, r"data\.images: 5 images .* at least 8 are needed", id="too few images"),
        pytest.param(_unreadable, r"data\.images: .*square/broken\.jpg: corrupt or truncated image", id="unreadable"),
        pytest.param(_half_labelled, r"data\.images: .*circle, square, triangle are labels but unsorted", id="mixed"),
    ],
)
def test_unusable_images_are_refused_naming_the_field(tmp_path: Path, make, message: str) -> None:
    loaded = load_recipe(image_recipe(tmp_path, {"images": make(tmp_path)}))
    with pytest.raises(RecipeError, match=r"shapes\.yaml: " + message):
        load_all([loaded.path])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param({"images": "labels.txt"}, r"data\.images: .*labels\.txt is not a folder", id="a file"),
        pytest.param({"images": "nowhere"}, r"data\.images: file not found", id="missing"),
        pytest.param({"texts": "labels.txt"}, r"data\.texts: unknown key", id="texts for images"),
    ],
)
def test_a_data_mistake_is_one_line_naming_the_field(tmp_path: Path, data: dict, message: str) -> None:
    with pytest.raises(RecipeError, match=r"shapes\.yaml: " + message):
        load_recipe(image_recipe(tmp_path, data))


def test_data_is_refused_for_a_source_that_trains_on_digits(tmp_path: Path) -> None:
    recipe = yaml.safe_load((REPO / "models" / "digits-classifier.yaml").read_text())
    (tmp_path / "photos").mkdir()
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump({**recipe, "data": {"images": "photos"}}))
    with pytest.raises(RecipeError, match=r"digits\.yaml: data: a train-digits source .*leave data out"):
        load_recipe(path)


def test_too_few_texts_are_refused_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "few.txt").write_text("one text\n\nanother\n")
    with pytest.raises(RecipeError, match=rf"data\.texts: 2 texts in .*few\.txt: at least {MIN_TEXTS} are needed"):
        check_data(load_recipe(text_recipe(tmp_path, "few.txt")))


def test_a_build_is_calibrated_judged_and_reported_on_the_recipes_images(tmp_path: Path, labelled: Path) -> None:
    """FP32 and an INT8 variant judged on views of the user's evaluation files, accuracy counted on
    their class subfolders, the drift reference taken on them, and the report saying so."""
    recipe = image_recipe(
        tmp_path,
        {"images": str(labelled)},
        variants=["int8-static"],
        budget={"max_drop": {"accuracy": 1.0, "top1_agreement": 1.0}, "p99_slo_ms": 2000},
    )
    loaded = load_all([recipe])[0]
    result = build(loaded)
    evaluated = own_images(loaded, list(CLASSES)).part(HELD_OUT)
    fp32 = result.candidates[0]
    assert fp32.slices[HELD_OUT].size == fp32.slices["perturbed"].size == -(-512 // len(evaluated)) * len(evaluated)
    assert "accuracy" in fp32.slices[HELD_OUT].metrics, "the class subfolders' labels were carried"
    assert [c.variant for c in result.candidates] == ["fp32", "int8-static"]
    judged_on = result.model.info.metadata[JUDGED_ON]
    assert judged_on == result.judged_on
    assert f"data.images ({labelled}): 24 images, 18 judged and 6 calibrated on, labelled" in judged_on
    width = result.model.info.metadata["monitoring"]["statistics"]["width"]  # the drift reference's
    assert width["size"] == fp32.slices[HELD_OUT].size and max(width["edges"]) <= 72, "views of the 72-pixel shapes"
    report = write_report(loaded.recipe, result, tmp_path / "report").read_text()
    assert f"Calibrated and judged on the recipe's data.images ({labelled}): 24 images" in report


def test_a_text_build_is_judged_on_the_recipes_texts(tmp_path: Path) -> None:
    lines = [
        f"ticket {i}: the {('printer', 'badge reader', 'VPN')[i % 3]} fails after update {i % 11}" for i in range(200)
    ]
    (tmp_path / "tickets.txt").write_text("\n".join(lines) + "\n")
    recipe = {
        "name": "tickets",
        "task": "text-embedding",
        "source": {"kind": "huggingface", "path": str(tiny_bert_dir(tmp_path))},
        "text": {"max_length": 32},
        "export": {"tolerance": {"max_abs_diff": 1e-4, "min_cosine": 0.9999}},
        "profiling": TINY_PROFILE,
        "data": {"texts": "tickets.txt"},
    }
    path = tmp_path / "tickets.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = build(load_all([path])[0])
    assert result.candidates[0].slices[HELD_OUT].size == 25, "every eighth of the 200 texts"
    texts = tmp_path / "tickets.txt"
    assert result.judged_on == f"the recipe's data.texts ({texts}): 200 texts, 25 judged and 25 calibrated on"
    assert result.model.info.metadata["monitoring"]["statistics"]["tokens"]["size"] == 25
