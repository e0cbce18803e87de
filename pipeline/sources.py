"""Load a recipe's source model into torch, one loader per source kind."""

from __future__ import annotations

from collections.abc import Callable
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
    else:
        names = [line.strip() for line in loaded.files["labels"].read_text().splitlines() if line.strip()]
    if num_classes is not None and len(names) != num_classes:
        raise RecipeError(f"{loaded.path}: labels: {len(names)} labels but source.num_classes is {num_classes}")
    return names


def _load_state_dict(loaded: LoadedRecipe, module: torch.nn.Module) -> None:
    path = loaded.files["source.weights"]
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several unrelated types for a bad file
        raise RecipeError(f"{loaded.path}: source.weights: cannot read {path} as a state_dict: {exc}") from exc
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    try:
        module.load_state_dict(state)
    except RuntimeError as exc:
        raise RecipeError(f"{loaded.path}: source.weights: {path} does not fit source.architecture: {exc}") from exc


@loader(EfficientNetLiteSource)
def _efficientnet_lite(loaded: LoadedRecipe) -> SourceModel:
    from efficientnet_lite_pytorch import EfficientNet

    source = loaded.recipe.source
    module = EfficientNet.from_name(source.architecture, num_classes=source.num_classes)
    _load_state_dict(loaded, module)
    return SourceModel(module=module)


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
    module = torchvision.models.get_model(source.architecture, weights=None, num_classes=source.num_classes)
    _load_state_dict(loaded, module)
    return SourceModel(module=module)


@loader(HuggingFaceSource)
def _huggingface(loaded: LoadedRecipe) -> SourceModel:
    from transformers import AutoModel

    model_dir = loaded.files["source.path"]
    if not (model_dir / "config.json").is_file():
        raise RecipeError(f"{loaded.path}: source.path: {model_dir} has no config.json")
    if not (model_dir / "tokenizer.json").is_file():
        raise RecipeError(
            f"{loaded.path}: source.path: {model_dir} has no tokenizer.json (the fast tokenizer's file, which the "
            f"service reads); AutoTokenizer.from_pretrained(path).save_pretrained(path) writes one beside vocab.txt"
        )
    try:
        sentence = read_sentence_config(model_dir)
    except SentenceConfigError as exc:
        raise RecipeError(f"{loaded.path}: source.path: {exc}") from exc
    # Eager attention exports to plain MatMul/Softmax that ORT's transformer optimizer can fuse.
    module = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager", local_files_only=True)
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
