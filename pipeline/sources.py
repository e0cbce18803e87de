"""Load a recipe's source model into torch, one loader per source kind."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.recipe import (
    EfficientNetLiteSource,
    HuggingFaceSource,
    LoadedRecipe,
    RecipeError,
    TorchvisionSource,
    TrainDigitsSource,
)
from pipeline.sentence_config import SentenceConfigError, SentencePooling, read_sentence_config


@dataclass
class SourceModel:
    """The reference model in eval mode plus what serving needs beside the weights."""

    module: torch.nn.Module
    class_names: list[str] | None = None
    model_dir: Path | None = None
    pooling: SentencePooling | None = None  # text models: how the directory makes one vector per text
    lowercase: bool = False  # text models: texts are lowercased before the tokenizer


Loader = Callable[[LoadedRecipe], SourceModel]
LOADERS: dict[type, Loader] = {}


def loader(kind: type) -> Callable[[Loader], Loader]:
    def register(function: Loader) -> Loader:
        LOADERS[kind] = function
        return function

    return register


def load_source(loaded: LoadedRecipe) -> SourceModel:
    source = LOADERS[type(loaded.recipe.source)](loaded)
    source.module.eval()
    return source


def load_class_names(loaded: LoadedRecipe, num_classes: int | None) -> list[str]:
    """A classifier recipe's labels: ImageNet's, or its labels file, one per line."""
    if loaded.recipe.labels == "imagenet":
        from torchvision.models._meta import _IMAGENET_CATEGORIES

        names = list(_IMAGENET_CATEGORIES)
        blank = []
    else:
        lines = read_labels(loaded)
        names = [line.strip() for line in lines if line.strip()]
        # Blank lines between labels, where a class without a name would shift every label after it.
        last = max((number for number, line in enumerate(lines, 1) if line.strip()), default=0)
        blank = [number for number, line in enumerate(lines[:last], 1) if not line.strip()]
    if num_classes is not None and len(names) != num_classes:
        skipped = f" (blank lines skipped: {', '.join(map(str, blank[:5]))})" if blank else ""
        raise RecipeError(
            f"{loaded.path}: labels: {len(names)} labels{skipped} but the model has {num_classes} classes"
        )
    return names


def declared_class_names(loaded: LoadedRecipe) -> list[str]:
    """A classifier recipe's class names before its model loads: its labels, or where it has none a
    Hugging Face directory's `id2label`, read from config.json as the model will read it (nothing
    where that file is missing: the loader refuses it, naming the field)."""
    source = loaded.recipe.source
    if loaded.recipe.labels is not None or not isinstance(source, HuggingFaceSource):
        return load_class_names(loaded, getattr(source, "num_classes", None))
    config = loaded.files["source.path"] / "config.json"
    id2label = json.loads(config.read_text()).get("id2label", {}) if config.is_file() else {}
    return [str(id2label[key]) for key in sorted(id2label, key=int)]


def read_labels(loaded: LoadedRecipe) -> list[str]:
    """The labels file's lines, as UTF-8 whatever the locale; a byte-order mark (Windows editors write
    one) would otherwise become part of the first label the service answers."""
    path = loaded.files["labels"]
    try:
        return path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as exc:
        raise RecipeError(
            f"{loaded.path}: labels: {path} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None


# Where training scripts keep the weights in a checkpoint: Lightning and timm's `state_dict`,
# PyTorch's tutorial `model_state_dict`, torchvision's reference scripts `model`.
CHECKPOINT_KEYS = ("state_dict", "model_state_dict", "model")
# What wrappers prefix every key with: DataParallel/DDP `module.`, torch.compile `_orig_mod.`,
# a Lightning module holding the network as `self.model`.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.")
SHOWN_KEYS = 3


def unwrap_checkpoint(state: object, own_keys: Collection[str]) -> object:
    """The state_dict inside a training checkpoint ({'model_state_dict': ..., 'optimizer': ...}), with
    wrappers' key prefixes removed where every key has one and the network's own keys (`own_keys`) do not."""
    while isinstance(state, dict) and not any(isinstance(v, torch.Tensor) for v in state.values()):
        inner = next((state[key] for key in CHECKPOINT_KEYS if isinstance(state.get(key), dict)), None)
        if inner is None:
            break
        state = inner
    stripped = True
    while stripped and isinstance(state, dict) and state:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            theirs = all(isinstance(key, str) and key.startswith(prefix) for key in state)
            if theirs and not all(key.startswith(prefix) for key in own_keys):
                state = {key[len(prefix) :]: value for key, value in state.items()}
                stripped = True
    return _without_attribute_prefix(state, own_keys)


def _without_attribute_prefix(state: object, own_keys: Collection[str]) -> object:
    """A network kept under another attribute of a training module (`self.net`, `self.backbone`):
    one first part shared by every key, stripped only where what remains is exactly the network's keys."""
    if not isinstance(state, dict) or not state or not all(isinstance(key, str) and "." in key for key in state):
        return state
    firsts = {key.split(".", 1)[0] for key in state}
    inner = {key.split(".", 1)[1]: value for key, value in state.items()}
    return inner if len(firsts) == 1 and inner.keys() == set(own_keys) else state


def _named(keys: list[str]) -> str:
    more = f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else ""
    return ", ".join(keys[:SHOWN_KEYS]) + more


def state_dict_misfit(state: dict, module: torch.nn.Module, num_classes: int) -> str | None:
    """Why `state` cannot load into `module`, in one line (torch's own lists every key), or None."""
    own = module.state_dict()
    missing = [key for key in own if key not in state]
    unexpected = [key for key in state if key not in own]
    shapes = [
        f"{key} {tuple(state[key].shape)} (the architecture's: {tuple(value.shape)})"
        for key, value in own.items()
        if isinstance(state.get(key), torch.Tensor) and state[key].shape != value.shape
    ]
    problems = [f"missing {_named(missing)}"] if missing else []
    problems += [f"unexpected {_named(unexpected)}"] if unexpected else []
    problems += [f"shape of {_named(shapes)}"] if shapes else []
    if not problems:
        return None
    # The classifier head: the last weight with a row per class, where a wrong num_classes shows.
    head = next((key for key in reversed(own) if own[key].ndim >= 1 and own[key].shape[0] == num_classes), None)
    theirs = state.get(head)
    mismatch = isinstance(theirs, torch.Tensor) and theirs.ndim >= 1 and theirs.shape[0] != num_classes
    hint = f"; source.num_classes is {num_classes}, the checkpoint has {theirs.shape[0]} classes" if mismatch else ""
    return "; ".join(problems) + hint


def _load_state_dict(loaded: LoadedRecipe, module: torch.nn.Module) -> None:
    path = loaded.files["source.weights"]
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Unsupported global" not in str(exc):  # bytes that are no pickle at all
            raise RecipeError(f"{loaded.path}: source.weights: {path} is no torch.save or safetensors file") from None
        # weights_only refuses code: a whole pickled model (torch.save(model)) would run whatever it holds.
        raise RecipeError(
            f"{loaded.path}: source.weights: {path} holds pickled Python objects, e.g. a whole model saved with "
            "torch.save(model); save its weights instead: torch.save(model.state_dict(), path)"
        ) from None
    except Exception as exc:  # torch raises several unrelated types for a bad file (a KeyError: 101 for text)
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise RecipeError(
            f"{loaded.path}: source.weights: {path} is no torch.save or safetensors file "
            f"({type(exc).__name__}: {first})"
        ) from None
    state = unwrap_checkpoint(state, module.state_dict().keys())
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        keys = f" (keys: {_named([str(k) for k in state])})" if isinstance(state, dict) else ""
        raise RecipeError(
            f"{loaded.path}: source.weights: {path} is no state_dict of tensors{keys}; save model.state_dict(), "
            f"or a checkpoint holding it under one of {', '.join(CHECKPOINT_KEYS)}"
        )
    misfit = state_dict_misfit(state, module, loaded.recipe.source.num_classes)
    if misfit is not None:
        raise RecipeError(
            f"{loaded.path}: source.weights: {path} does not fit source.architecture "
            f"{loaded.recipe.source.architecture}: {misfit}"
        )
    module.load_state_dict(state)


@loader(EfficientNetLiteSource)
def _efficientnet_lite(loaded: LoadedRecipe) -> SourceModel:
    from efficientnet_lite_pytorch import EfficientNet

    source = loaded.recipe.source
    module = EfficientNet.from_name(source.architecture, num_classes=source.num_classes)
    _load_state_dict(loaded, module)
    return SourceModel(module=module)


# Builders that initialize through scipy's truncated normal unless told not to, with a FutureWarning.
INITIALIZES_WITH_SCIPY = frozenset({"googlenet", "inception_v3"})


@loader(TorchvisionSource)
def _torchvision(loaded: LoadedRecipe) -> SourceModel:
    import torchvision

    source = loaded.recipe.source
    known = torchvision.models.list_models(module=torchvision.models)
    if source.architecture not in known:
        raise RecipeError(
            f"{loaded.path}: source.architecture: unknown torchvision classifier {source.architecture!r} "
            f"(known: {', '.join(sorted(known))})"
        )
    # The recipe's weights replace any initialization: skip the slow one that warns (scipy's truncnorm).
    skipped = {"init_weights": False} if source.architecture in INITIALIZES_WITH_SCIPY else {}
    try:
        module = torchvision.models.get_model(
            source.architecture, weights=None, num_classes=source.num_classes, **{**skipped, **source.options}
        )
    except (TypeError, ValueError) as exc:  # an argument the builder does not take, or a wrong value
        raise RecipeError(f"{loaded.path}: source.options: {source.architecture}: {exc}") from None
    _load_state_dict(loaded, module)
    _check_image_size(loaded, module)
    return SourceModel(module=module)


def _check_image_size(loaded: LoadedRecipe, module: torch.nn.Module) -> None:
    """One image of `image.size` through the network: a ViT built for 224 pixels, or an image too
    small for an architecture's kernels, fails here in a line, not in a traceback from the export."""
    size = loaded.recipe.image.size
    module.eval()
    try:
        with torch.inference_mode():
            module(torch.zeros(1, 3, size, size))
    except (AssertionError, RuntimeError, ValueError) as exc:
        raise RecipeError(
            f"{loaded.path}: image.size: {loaded.recipe.source.architecture} does not take {size}×{size} "
            f"images: {str(exc).splitlines()[0]}"
        ) from None


class PixelLogits(torch.nn.Module):
    """A Hugging Face image classifier as a plain module: normalized pixel values in, logits out."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits


def _pretrained(loaded: LoadedRecipe, auto_class: type) -> torch.nn.Module:
    """`auto_class.from_pretrained` on the recipe's directory, never from a hub."""
    model_dir = loaded.files["source.path"]
    if not (model_dir / "config.json").is_file():
        raise RecipeError(f"{loaded.path}: source.path: {model_dir} has no config.json")
    try:
        # Eager attention exports to plain MatMul/Softmax that ORT's transformer optimizer can fuse.
        return auto_class.from_pretrained(str(model_dir), attn_implementation="eager", local_files_only=True)
    except ValueError as exc:  # a config of another kind of model: "Unrecognized configuration class ..."
        raise RecipeError(f"{loaded.path}: source.path: {model_dir}: {str(exc).splitlines()[0]}") from exc


@loader(HuggingFaceSource)
def _huggingface(loaded: LoadedRecipe) -> SourceModel:
    return _huggingface_classifier(loaded) if loaded.recipe.task == "image-classification" else _sentences(loaded)


def _huggingface_classifier(loaded: LoadedRecipe) -> SourceModel:
    """Labels from config.json's id2label unless the recipe gives its own (as many); a processor the
    recipe's `image` came from is checked against the service's pixels on the sample photos."""
    from transformers import AutoModelForImageClassification

    from pipeline.image_processor import ImageProcessorError, check_processor

    model_dir = loaded.files["source.path"]
    module = _pretrained(loaded, AutoModelForImageClassification)
    channels = getattr(module.config, "num_channels", 3)
    if channels != 3:
        raise RecipeError(f"{loaded.path}: source.path: {model_dir}: num_channels {channels}; the service sends RGB")
    count = module.config.num_labels
    if count < 2:
        raise RecipeError(
            f"{loaded.path}: source.path: {model_dir}: num_labels {count}: a single (sigmoid or regression) output "
            "is always 1.0 under the softmax this serves; a classifier needs an output per class"
        )
    if loaded.recipe.labels is None:
        names = [str(module.config.id2label[index]) for index in range(count)]
    else:
        names = load_class_names(loaded, count)
    if "image" in loaded.derived:
        try:
            check_processor(model_dir, loaded.recipe.image)
        except ImageProcessorError as exc:
            raise RecipeError(f"{loaded.path}: image: {exc}") from exc
    return SourceModel(module=PixelLogits(module), class_names=names, model_dir=model_dir)


def _sentences(loaded: LoadedRecipe) -> SourceModel:
    from transformers import AutoModel

    model_dir = loaded.files["source.path"]
    if not (model_dir / "tokenizer.json").is_file():
        raise RecipeError(
            f"{loaded.path}: source.path: {model_dir} has no tokenizer.json (the fast tokenizer's file, which the "
            f"service reads); AutoTokenizer.from_pretrained(path).save_pretrained(path) writes one beside vocab.txt"
        )
    try:
        sentence = read_sentence_config(model_dir)
    except SentenceConfigError as exc:
        raise RecipeError(f"{loaded.path}: source.path: {exc}") from exc
    module = _pretrained(loaded, AutoModel)
    positions = usable_positions(module)
    if positions is not None and loaded.recipe.text.max_length > positions:
        raise RecipeError(
            f"{loaded.path}: text.max_length: {loaded.recipe.text.max_length} tokens, but the model has "
            f"positions for {positions}: a longer text would fail in the service"
        )
    trained = sentence.max_seq_length
    if trained is not None and loaded.recipe.text.max_length > trained:
        raise RecipeError(
            f"{loaded.path}: text.max_length: {loaded.recipe.text.max_length} tokens, but {model_dir}/"
            f"sentence_bert_config.json has max_seq_length {trained}: sentence-transformers cuts texts there"
        )
    return SourceModel(module=module, model_dir=model_dir, pooling=sentence.pooling, lowercase=sentence.do_lower_case)


def usable_positions(module: torch.nn.Module) -> int | None:
    """Tokens a text may have: `max_position_embeddings`, less the positions RoBERTa-style models
    (XLM-R, MPNet, CamemBERT) keep for padding, numbering a text's tokens from `padding_idx + 1`:
    their 514 positions take 512 tokens (a text of 513 failed in the service)."""
    positions = getattr(module.config, "max_position_embeddings", None)
    padding_idx = getattr(getattr(module, "embeddings", None), "padding_idx", None)
    if positions is None or not isinstance(padding_idx, int):
        return positions
    return positions - padding_idx - 1


@loader(TrainDigitsSource)
def _train_digits(loaded: LoadedRecipe) -> SourceModel:
    """Train the teacher here, on the training part of the same split evaluation holds out."""
    from pipeline.datasets import digits_split
    from pipeline.export import ImageClassifierGraph
    from pipeline.students import SmallResNet, seeded, train_classifier

    source = loaded.recipe.source
    model = seeded(lambda: SmallResNet(num_classes=10, channels=source.channels, blocks=source.blocks))
    normalize = ImageClassifierGraph(model, loaded.recipe.image).normalize
    training = digits_split("training")
    train_classifier(model, normalize, np.stack(training.rows), training.labels, epochs=source.epochs)
    return SourceModel(module=model, class_names=[str(digit) for digit in range(10)])
