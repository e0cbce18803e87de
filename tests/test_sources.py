"""Source models: the checkpoints users have load, and those that cannot say why in one line."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torchvision
import yaml

from pipeline.recipe import LoadedRecipe, RecipeError, load_recipe
from pipeline.sources import load_class_names, load_source

ARCHITECTURE = "resnet18"
CLASSES = 3


def own_recipe(tmp_path: Path, weights: Path, size: int = 224, **source: object) -> Path:
    """A user's torchvision classifier: their weights, their labels."""
    (tmp_path / "labels.txt").write_text("cat\ndog\nbird\n")
    recipe = {
        "name": "mine",
        "task": "image-classification",
        "source": {"kind": "torchvision", "architecture": ARCHITECTURE, "weights": weights.name}
        | {"num_classes": CLASSES}
        | source,
        "labels": "labels.txt",
        "image": {"size": size, "resize": size, "mean": [123.7, 116.3, 103.5], "std": [58.4, 57.1, 57.4]},
        "export": {"tolerance": {"max_abs_diff": 1.0e-4, "min_cosine": 0.9999}},
        "serving": {},
    }
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def trained() -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.get_model(ARCHITECTURE, weights=None, num_classes=CLASSES).eval()


def prefixed(prefix: str) -> Callable[[dict], dict]:
    return lambda state: {prefix + key: value for key, value in state.items()}


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(lambda state: state, id="state_dict"),
        pytest.param(lambda state: {"state_dict": state, "epoch": 3}, id="state_dict key"),
        pytest.param(lambda state: {"model": state, "optimizer": {}, "epoch": 3}, id="model key"),
        pytest.param(lambda state: {"model_state_dict": state, "optimizer_state_dict": {}}, id="model_state_dict key"),
        pytest.param(prefixed("module."), id="DataParallel"),
        pytest.param(prefixed("_orig_mod."), id="torch.compile"),
        pytest.param(lambda state: {"state_dict": prefixed("model.")(state)}, id="Lightning"),
        pytest.param(lambda state: {"model": prefixed("_orig_mod.module.")(state)}, id="compiled DDP in a checkpoint"),
        pytest.param(lambda state: {"state_dict": prefixed("backbone.")(state)}, id="a training module's attribute"),
    ],
)
def test_common_checkpoints_load_the_same_weights(
    tmp_path: Path, trained: torch.nn.Module, wrap: Callable[[dict], object]
) -> None:
    weights = tmp_path / "mine.pt"
    torch.save(wrap(trained.state_dict()), weights)
    loaded = load_source(load_recipe(own_recipe(tmp_path, weights)))
    image = torch.rand(1, 3, 64, 64)
    with torch.inference_mode():
        assert torch.equal(loaded.module(image), trained(image))


def test_a_whole_pickled_model_is_refused_with_what_to_save(tmp_path: Path, trained: torch.nn.Module) -> None:
    weights = tmp_path / "mine.pt"
    torch.save(trained, weights)
    refusal = r"mine\.yaml: source\.weights: .*torch\.save\(model\.state_dict\(\)"
    with pytest.raises(RecipeError, match=refusal) as error:
        load_source(load_recipe(own_recipe(tmp_path, weights)))
    assert "\n" not in str(error.value)


def test_a_wrong_num_classes_is_named_in_one_line(tmp_path: Path, trained: torch.nn.Module) -> None:
    weights = tmp_path / "mine.pt"
    torch.save(trained.state_dict(), weights)
    with pytest.raises(RecipeError) as error:
        load_source(load_recipe(own_recipe(tmp_path, weights, num_classes=1000)))
    message = str(error.value)
    assert "source.weights" in message and "\n" not in message
    assert "source.num_classes is 1000, the checkpoint has 3 classes" in message


def test_another_architectures_weights_are_summarized(tmp_path: Path, trained: torch.nn.Module) -> None:
    weights = tmp_path / "mine.pt"
    torch.save(trained.state_dict(), weights)
    with pytest.raises(RecipeError, match=r"source\.architecture resnet34: missing .* and \d+ more$") as error:
        load_source(load_recipe(own_recipe(tmp_path, weights, architecture="resnet34")))
    assert "\n" not in str(error.value)


def test_a_checkpoint_without_weights_names_its_keys(tmp_path: Path) -> None:
    weights = tmp_path / "mine.pt"
    torch.save({"epoch": 3, "best_acc": 0.9}, weights)
    with pytest.raises(RecipeError, match=r"source\.weights: .*no state_dict of tensors \(keys: epoch, best_acc\)"):
        load_source(load_recipe(own_recipe(tmp_path, weights)))


def labels_recipe(tmp_path: Path) -> LoadedRecipe:
    """A recipe whose labels file the test then writes; its weights are never read."""
    (tmp_path / "mine.pt").touch()
    return load_recipe(own_recipe(tmp_path, tmp_path / "mine.pt"))


def test_labels_from_a_windows_editor_have_no_byte_order_mark(tmp_path: Path) -> None:
    recipe = labels_recipe(tmp_path)
    (tmp_path / "labels.txt").write_bytes("\ufeffchat\r\nchien\r\néléphant\r\n".encode())
    assert load_class_names(recipe, CLASSES) == ["chat", "chien", "éléphant"]


def test_labels_that_are_not_utf8_name_the_field(tmp_path: Path) -> None:
    recipe = labels_recipe(tmp_path)
    (tmp_path / "labels.txt").write_bytes("chat\nchien\néléphant\n".encode("latin-1"))
    with pytest.raises(RecipeError, match=r"mine\.yaml: labels: .*labels\.txt is not UTF-8 text"):
        load_class_names(recipe, CLASSES)


def test_a_blank_line_between_labels_is_named_when_the_count_is_off(tmp_path: Path) -> None:
    recipe = labels_recipe(tmp_path)
    (tmp_path / "labels.txt").write_text("cat\n\ndog\n\n")
    with pytest.raises(RecipeError, match=r"labels: 2 labels \(blank lines skipped: 2\) but the model has 3 classes"):
        load_class_names(recipe, CLASSES)


def test_an_image_size_the_architecture_cannot_take_is_refused_before_the_export(tmp_path: Path) -> None:
    weights = tmp_path / "mine.pt"
    torch.save(torchvision.models.get_model("squeezenet1_1", weights=None, num_classes=CLASSES).state_dict(), weights)
    recipe = own_recipe(tmp_path, weights, size=16, architecture="squeezenet1_1")
    refusal = r"mine\.yaml: image\.size: squeezenet1_1 does not take 16×16 images: .*too small"
    with pytest.raises(RecipeError, match=refusal) as error:
        load_source(load_recipe(recipe))
    assert "\n" not in str(error.value)


def test_builder_options_rebuild_the_network_as_it_was_fine_tuned(tmp_path: Path) -> None:
    """googlenet fine-tuned from ImageNet weights: torchvision built it re-normalizing its input and
    without auxiliary heads; rebuilt otherwise, its weights would load wrongly or not at all."""
    options = {"transform_input": True, "aux_logits": False}
    torch.manual_seed(0)
    tuned = torchvision.models.get_model(
        "googlenet", weights=None, num_classes=CLASSES, init_weights=False, **options
    ).eval()
    weights = tmp_path / "mine.pt"
    torch.save(tuned.state_dict(), weights)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no initialization that the weights then replace, nor its warning
        loaded = load_source(load_recipe(own_recipe(tmp_path, weights, architecture="googlenet", options=options)))
    image = torch.rand(1, 3, 64, 64)
    with torch.inference_mode():
        assert loaded.module.transform_input and torch.equal(loaded.module(image), tuned(image))


def test_an_option_the_builder_does_not_take_names_the_field(tmp_path: Path, trained: torch.nn.Module) -> None:
    weights = tmp_path / "mine.pt"
    torch.save(trained.state_dict(), weights)
    with pytest.raises(RecipeError, match=r"mine\.yaml: source\.options: resnet18: .*'drop_rate'"):
        load_source(load_recipe(own_recipe(tmp_path, weights, options={"drop_rate": 0.2})))


@pytest.mark.parametrize("content", [b"not a checkpoint at all", b"PK\x03\x04truncated zip"])
def test_a_file_torch_cannot_read_is_named_in_one_line(tmp_path: Path, content: bytes) -> None:
    weights = tmp_path / "mine.pt"
    weights.write_bytes(content)
    with pytest.raises(
        RecipeError, match=r"source\.weights: .*mine\.pt is no torch\.save or safetensors file"
    ) as error:
        load_source(load_recipe(own_recipe(tmp_path, weights)))
    assert "\n" not in str(error.value)


def test_safetensors_weights_load(tmp_path: Path, trained: torch.nn.Module) -> None:
    from safetensors.torch import save_file

    weights = tmp_path / "mine.safetensors"
    save_file(trained.state_dict(), weights)
    loaded = load_source(load_recipe(own_recipe(tmp_path, weights)))
    image = torch.rand(1, 3, 64, 64)
    with torch.inference_mode():
        assert torch.equal(loaded.module(image), trained(image))
