"""torch → ONNX with serving-shaped graphs: pre- and post-processing inside where it fits."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.recipe import ImagePreprocess, Recipe
from pipeline.sources import SourceModel

IMAGE_INPUT = "images"
IMAGE_OUTPUT = "probabilities"
TEXT_INPUTS = ("input_ids", "attention_mask")
TEXT_OUTPUT = "embeddings"


class ImageClassifierGraph(torch.nn.Module):
    """uint8 NHWC pixels in, softmax probabilities out: clients never see normalization."""

    def __init__(self, model: torch.nn.Module, preprocess: ImagePreprocess) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(preprocess.mean).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(preprocess.std).view(1, 3, 1, 1))

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        return (images.permute(0, 3, 1, 2).float() - self.mean) / self.std

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.model(self.normalize(images)), dim=-1)

    def with_model(self, model: torch.nn.Module) -> ImageClassifierGraph:
        """The same pre- and post-processing around another network (a distilled student)."""
        graph = copy.deepcopy(self)
        graph.model = model
        return graph.eval()


class SentenceEmbeddingGraph(torch.nn.Module):
    """Token ids in, mean-pooled L2-normalized sentence embeddings out (sentence-transformers' recipe)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=torch.zeros_like(input_ids)
        ).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=-1)


@dataclass(frozen=True)
class ServingGraph:
    module: torch.nn.Module
    input_names: list[str]
    output_names: list[str]
    example_inputs: tuple[torch.Tensor, ...]
    dynamic_axes: dict[str, dict[int, str]]


def serving_graph(recipe: Recipe, source: SourceModel) -> ServingGraph:
    if recipe.task == "image-classification":
        size = recipe.image.size
        return ServingGraph(
            module=ImageClassifierGraph(source.module, recipe.image).eval(),
            input_names=[IMAGE_INPUT],
            output_names=[IMAGE_OUTPUT],
            example_inputs=(torch.randint(0, 256, (2, size, size, 3), dtype=torch.uint8),),
            dynamic_axes={IMAGE_INPUT: {0: "batch"}, IMAGE_OUTPUT: {0: "batch"}},
        )
    # Example with real padding: an all-ones mask lets the tracer drop masking from the graph.
    input_ids = torch.randint(1000, 2000, (2, 16))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 9:] = 0
    return ServingGraph(
        module=SentenceEmbeddingGraph(source.module).eval(),
        input_names=list(TEXT_INPUTS),
        output_names=[TEXT_OUTPUT],
        example_inputs=(input_ids, attention_mask),
        dynamic_axes={
            "input_ids": {0: "batch", 1: "sequence"},
            "attention_mask": {0: "batch", 1: "sequence"},
            TEXT_OUTPUT: {0: "batch"},
        },
    )


def export_onnx(graph: ServingGraph, path: Path, *, opset: int) -> Path:
    """TorchScript exporter: its graphs fuse well in ONNX Runtime's transformer optimizer."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.inference_mode(False):
        # Tracer and constant-folding notices; the export check judges the result instead.
        warnings.simplefilter("ignore", category=UserWarning)
        warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
        warnings.simplefilter("ignore", category=DeprecationWarning)
        torch.onnx.export(
            graph.module,
            graph.example_inputs,
            str(path),
            input_names=graph.input_names,
            output_names=graph.output_names,
            dynamic_axes=graph.dynamic_axes,
            opset_version=opset,
            dynamo=False,
        )
    graph.module.eval()  # the exporter restores the wrapper's mode onto every submodule
    return path
