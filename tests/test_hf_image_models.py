"""Your own Hugging Face image classifier (a `save_pretrained` directory): served with its own
labels and its processor's pre-processing, answering as `AutoImageProcessor` + the PyTorch model
do, or refused naming the processor setting the service would not reproduce."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import own_home, serving
from PIL import Image

from pipeline.build import build
from pipeline.image_processor import MAX_PIXEL_DIFF, check_processor
from pipeline.recipe import RecipeError, load_recipe
from pipeline.sources import load_source
from sample_inputs import sample_photos
from serving.classify import ImageUpload, prepare_image
from serving.engine import EngineSettings, OnnxEngine
from serving.manifest import ServingManifest, write_manifest
from serving.model_runtime import read_spec
from serving.model_spec import CLASS_NAMES_FILE, ImageInput

LABELS = {0: "cat", 1: "dog", 2: "rocket"}
TINY_PROFILE = {"max_batch_size": 4, "seconds_per_point": 0.1}
CENTRE_CROP = {"size": 224, "resize": 224, "mean": [127.5] * 3, "std": [127.5] * 3}


def vit_dir(root: Path, processor: object | None = None) -> Path:
    """A two-layer ViT and, unless given, ViT's own processor (a warp to 224×224)."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    config = ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=224,
        patch_size=16,
        num_labels=3,
        id2label=LABELS,
        label2id={name: index for index, name in LABELS.items()},
    )
    directory = root / "vit"
    ViTForImageClassification(config).save_pretrained(directory)
    (processor or ViTImageProcessor()).save_pretrained(directory)
    return directory


def convnext_dir(root: Path, **processor: object) -> Path:
    """A one-block-per-stage ConvNeXt with ConvNeXt's processor at 224 (resize 256, crop 224, bicubic)."""
    from transformers import ConvNextConfig, ConvNextForImageClassification, ConvNextImageProcessor

    torch.manual_seed(0)
    config = ConvNextConfig(hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1], num_labels=3, id2label=LABELS)
    directory = root / "convnext"
    ConvNextForImageClassification(config).save_pretrained(directory)
    settings = {"size": {"shortest_edge": 224}, "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
    ConvNextImageProcessor(**{**settings, **processor}).save_pretrained(directory)
    return directory


def recipe_for(model_dir: Path, **fields: object) -> Path:
    path = model_dir.parent / f"{model_dir.name}.yaml"
    recipe = {
        "name": f"hf-{model_dir.name}",
        "task": "image-classification",
        "source": {"kind": "huggingface", "path": f"./{model_dir.name}"},
        "export": {"tolerance": {"max_abs_diff": 1e-4, "min_cosine": 0.9999}},
        "profiling": TINY_PROFILE,
        "serving": {},
        **fields,
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_the_processor_gives_the_image_preprocessing(tmp_path: Path) -> None:
    loaded = load_recipe(recipe_for(convnext_dir(tmp_path)))
    image = loaded.recipe.image
    assert (image.size, image.resize) == (224, 256)  # ConvNeXt: shortest_edge / crop_pct, then the crop
    np.testing.assert_allclose(image.mean, [123.675, 116.28, 103.53])  # 0-1 scale × 255
    np.testing.assert_allclose(image.std, [58.395, 57.12, 57.375])
    assert loaded.derived == ("image",)


def test_a_processor_with_a_centre_crop_and_its_own_rescale(tmp_path: Path) -> None:
    from transformers import BitImageProcessor

    processor = BitImageProcessor(
        size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}, rescale_factor=1 / 127.5
    )
    image = load_recipe(recipe_for(vit_dir(tmp_path, processor))).recipe.image
    assert (image.size, image.resize) == (224, 256)
    np.testing.assert_allclose(image.mean, np.array([0.48145466, 0.4578275, 0.40821073]) * 127.5, rtol=1e-6)


def test_vits_processor_squeezes_the_whole_photo_and_the_service_does_the_same(tmp_path: Path) -> None:
    """ViT's processor resizes every photo to 224×224 whatever its shape: no crop, the aspect ratio
    not kept. The service does the same, to the processor's pixels within rounding."""
    model_dir = vit_dir(tmp_path)
    image = load_recipe(recipe_for(model_dir)).recipe.image
    assert (image.size, image.resize, image.crop) == (224, 224, False)
    assert check_processor(model_dir, image).worst[1] < 0.05


def test_the_recipes_image_wins(tmp_path: Path) -> None:
    """ViT's processor squeezes photos to a square; a recipe that gives `image` chooses the centre crop."""
    loaded = load_recipe(recipe_for(vit_dir(tmp_path), image=CENTRE_CROP))
    assert loaded.recipe.image.resize == 224
    assert loaded.derived == ()
    source = load_source(loaded)
    assert source.class_names == ["cat", "dog", "rocket"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: vit_dir(root, rectangle()), "resizes every photo to 224x320, where the service squeezes"),
        (lambda root: convnext_dir(root, resample=0), "resample 0: the service resizes bilinearly"),
        (lambda root: convnext_dir(root, do_resize=False), "do_resize false"),
        (lambda root: convnext_dir(root, crop_pct=1.2), "crop_pct 1.2: a crop is a share of the photo"),
    ],
)
def test_a_processor_the_service_would_not_reproduce_is_refused(tmp_path: Path, make, message: str) -> None:
    model_dir = make(tmp_path)
    with pytest.raises(RecipeError, match=message) as refused:
        load_recipe(recipe_for(model_dir))
    assert str(refused.value).startswith(f"{model_dir.parent}/{model_dir.name}.yaml: image: {model_dir}/")
    assert "\n" not in str(refused.value)


def rectangle() -> object:
    from transformers import ViTImageProcessor

    return ViTImageProcessor(size={"height": 224, "width": 320}, image_mean=0.5, image_std=0.5)


def test_the_warp_refusal_says_what_to_write(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as refused:
        load_recipe(recipe_for(vit_dir(tmp_path, rectangle())))
    suggested = str(refused.value).split("give the recipe image: ", 1)[1]
    assert yaml.safe_load(suggested) == CENTRE_CROP


def test_a_convnext_from_384_squeezes_the_photo_as_its_processor_does(tmp_path: Path) -> None:
    model_dir = convnext_dir(tmp_path, size={"shortest_edge": 384})
    image = load_recipe(recipe_for(model_dir)).recipe.image
    assert (image.size, image.resize, image.crop) == (384, 384, False)
    assert check_processor(model_dir, image).worst[1] < MAX_PIXEL_DIFF / 2  # bicubic against bilinear


def test_a_directory_without_a_processor_needs_the_image(tmp_path: Path) -> None:
    model_dir = convnext_dir(tmp_path)
    (model_dir / "preprocessor_config.json").unlink()
    with pytest.raises(RecipeError, match=r"has no preprocessor_config\.json: give `image:` in the recipe"):
        load_recipe(recipe_for(model_dir))
    assert load_recipe(recipe_for(model_dir, image=CENTRE_CROP)).recipe.image.resize == 224


def test_a_labels_file_must_have_as_many_labels_as_the_model(tmp_path: Path) -> None:
    model_dir = convnext_dir(tmp_path)
    (tmp_path / "labels.txt").write_text("a\nb\n")
    with pytest.raises(RecipeError, match="labels: 2 labels but the model has 3 classes"):
        load_source(load_recipe(recipe_for(model_dir, labels="labels.txt")))
    (tmp_path / "labels.txt").write_text("a\nb\nc\n")
    assert load_source(load_recipe(recipe_for(model_dir, labels="labels.txt"))).class_names == ["a", "b", "c"]


def test_not_an_image_classifier_is_refused(tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    model_dir = convnext_dir(tmp_path)
    BertModel(
        BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    ).save_pretrained(model_dir)
    with pytest.raises(RecipeError, match=r"source.path: .*Unrecognized configuration class"):
        load_source(load_recipe(recipe_for(model_dir)))


def test_a_model_of_other_than_three_channels_is_refused(tmp_path: Path) -> None:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    model_dir = convnext_dir(tmp_path)
    config = ConvNextConfig(num_channels=1, hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1], num_labels=3)
    ConvNextForImageClassification(config).save_pretrained(model_dir)
    with pytest.raises(RecipeError, match="num_channels 1; the service sends RGB"):
        load_source(load_recipe(recipe_for(model_dir)))


def test_a_processor_with_a_resize_rule_of_its_own_is_caught_on_the_photos(tmp_path: Path) -> None:
    """LevitImageProcessor resizes the shorter side to 256/224 × shortest_edge: read as a plain
    shortest_edge, the service's pixels would be another crop of the photo."""
    from transformers import LevitImageProcessor

    loaded = load_recipe(recipe_for(vit_dir(tmp_path, LevitImageProcessor())))
    with pytest.raises(RecipeError, match="its resize rule is not reproduced"):
        load_source(loaded)


def test_the_served_pixels_are_the_processors(tmp_path: Path) -> None:
    """Bicubic (the processor) against bilinear (the service), and whole-pixel crop offsets against
    exact ones: at most a few levels on edges."""
    model_dir = convnext_dir(tmp_path)
    match = check_processor(model_dir, load_recipe(recipe_for(model_dir)).recipe.image)
    assert match.worst[1] < MAX_PIXEL_DIFF / 2
    assert np.mean(list(match.mean_abs_diff.values())) < 5


def processor_answers(model_dir: Path, photos: dict[str, bytes]) -> np.ndarray:
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    processor = AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForImageClassification.from_pretrained(str(model_dir), local_files_only=True).eval()
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in photos.values()]
    with torch.inference_mode():
        return torch.softmax(model(**processor(images=images, return_tensors="pt")).logits, -1).numpy()


@pytest.mark.parametrize(("make", "spec"), [(convnext_dir, ImageInput(size=224, resize=256)), (vit_dir, None)])
def test_a_built_model_answers_as_the_processor_and_pytorch(tmp_path: Path, make, spec: ImageInput | None) -> None:
    """The whole build (export, check, gate, register) on the processor's pre-processing, and the
    stored graph fed as the service feeds it against `AutoImageProcessor` + PyTorch."""
    model_dir = make(tmp_path)
    result = build(load_recipe(recipe_for(model_dir, variants=[])), force=True)
    stored = Path(result.model.path)
    assert json.loads((stored / CLASS_NAMES_FILE).read_text()) == ["cat", "dog", "rocket"]
    photos = sample_photos()
    spec = spec or ImageInput(size=224, resize=224, crop=False)
    assert read_spec(result.model.info.metadata).image == spec, "the stored spec is what the service will do"
    pixels = np.stack([prepare_image(ImageUpload(data, None, name), spec) for name, data in photos.items()])
    engine = OnnxEngine(stored / "model.onnx", EngineSettings.from_environment())
    served = engine.run({"images": pixels})["probabilities"]
    expected = processor_answers(model_dir, photos)
    assert (served.argmax(-1) == expected.argmax(-1)).mean() >= 8 / 9
    assert np.abs(served - expected).max() < 0.01


def test_other_sources_still_need_the_image(tmp_path: Path) -> None:
    recipe = yaml.safe_load(recipe_for(convnext_dir(tmp_path)).read_text())
    recipe["source"] = {"kind": "torchvision", "architecture": "resnet18", "weights": "w.pt", "num_classes": 3}
    path = tmp_path / "resnet.yaml"
    path.write_text(yaml.safe_dump({**recipe, "labels": "imagenet"}))
    with pytest.raises(RecipeError, match="needs the field 'image' \\(only a huggingface source has its own\\)"):
        load_recipe(path)


@pytest.mark.slow
def test_served_over_http_with_its_own_labels(tmp_path: Path) -> None:
    """`bentoml serve` of a built Hugging Face classifier: the default endpoint and its own path
    answer with id2label's names, and the top class `AutoImageProcessor` + PyTorch give."""
    model_dir = convnext_dir(tmp_path)
    loaded = load_recipe(recipe_for(model_dir, variants=[], serving={"endpoint": "classify"}))
    result = build(loaded, force=True)
    manifest = tmp_path / "serving-manifest.json"
    write_manifest(ServingManifest().with_routes({"classify": result.route(loaded)}), manifest)
    photos = sample_photos()
    expected = [LABELS[int(index)] for index in processor_answers(model_dir, photos).argmax(-1)]
    home = own_home(tmp_path / "home")  # the session's server runs beside it, on the shared store
    with serving(manifest, tmp_path / "bentoml.log", BENTOML_HOME=home) as running, running.client() as client:
        for path in ("/classify", "/models/hf-convnext/classify"):
            answers = [
                client.post(path, content=data, headers={"content-type": "image/png"}).json()
                for data in photos.values()
            ]
            assert {answer["model"] for answer in answers} == {str(result.model.tag)}
            labels = [answer["predictions"][0]["label"] for answer in answers]
            assert np.mean([label == want for label, want in zip(labels, expected, strict=True)]) >= 8 / 9


def test_its_own_images_in_folders_named_after_id2label_are_labelled(tmp_path: Path) -> None:
    """A recipe without a labels file: the data's class subfolders are matched to config.json's names."""
    from pipeline.build_command import load_all
    from pipeline.own_data import own_images
    from pipeline.sources import declared_class_names

    model_dir = convnext_dir(tmp_path)
    photos = list(sample_photos().values())
    for index, name in enumerate(LABELS.values()):
        for copy in range(4):
            (tmp_path / "photos" / name).mkdir(parents=True, exist_ok=True)
            (tmp_path / "photos" / name / f"{copy}.jpg").write_bytes(photos[(index + copy) % len(photos)])
    budget = {"max_drop": {"accuracy": 0.05}, "p99_slo_ms": 2000}
    (loaded,) = load_all([recipe_for(model_dir, data={"images": "./photos"}, budget=budget)])

    folder = own_images(loaded, declared_class_names(loaded))

    assert declared_class_names(loaded) == list(LABELS.values())
    assert folder is not None and folder.labels == {f"{n}/{c}.jpg": i for i, n in LABELS.items() for c in range(4)}


def test_a_single_output_model_is_refused(tmp_path: Path) -> None:
    from transformers import ConvNextConfig, ConvNextForImageClassification, ConvNextImageProcessor

    directory = tmp_path / "regressor"
    config = ConvNextConfig(hidden_sizes=[8, 16, 24, 32], depths=[1] * 4, num_labels=1)
    ConvNextForImageClassification(config).save_pretrained(directory)
    ConvNextImageProcessor(size={"shortest_edge": 224}).save_pretrained(directory)
    with pytest.raises(RecipeError, match=r"source\.path: .*num_labels 1: a single"):
        load_source(load_recipe(recipe_for(directory)))
