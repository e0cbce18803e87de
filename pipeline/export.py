"""torch → ONNX with serving-shaped graphs: pre- and post-processing inside where it fits."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.recipe import ImagePreprocess
from pipeline.sentence_config import PoolingMode, SentencePooling

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
    """Token ids in, sentence embeddings out, pooled (and normalized or not) as the model directory
    says (pipeline/sentence_config.py): mean-pooled and L2-normalized by default."""

    def __init__(self, model: torch.nn.Module, pooling: SentencePooling | None = None) -> None:
        super().__init__()
        self.model = model
        self.pooling = pooling or SentencePooling()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.pool(self.token_states(input_ids, attention_mask), attention_mask)

    def token_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=torch.zeros_like(input_ids)
        ).last_hidden_state

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pooled = pool_tokens(hidden, attention_mask, self.pooling.mode)
        return torch.nn.functional.normalize(pooled, p=2, dim=-1) if self.pooling.normalize else pooled


def pool_tokens(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: PoolingMode) -> torch.Tensor:
    """sentence-transformers' `Pooling` for right-padded rows (the only padding optiserve makes)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(mask == 0, float("-inf")).max(dim=1).values
    if mode == "lasttoken":
        last = (attention_mask.sum(dim=1) - 1).clamp(min=0).view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
        return torch.gather(hidden, 1, last).squeeze(1)
    if mode == "weightedmean":
        mask = mask * torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype).view(1, -1, 1)
    summed = (hidden * mask).sum(dim=1)
    count = mask.sum(dim=1).clamp(min=1e-9)
    return summed / (count.sqrt() if mode == "mean_sqrt_len_tokens" else count)


@dataclass(frozen=True)
class ServingGraph:
    module: torch.nn.Module
    input_names: list[str]
    output_names: list[str]
    example_inputs: tuple[torch.Tensor, ...]
    dynamic_axes: dict[str, dict[int, str]]


def export_onnx(graph: ServingGraph, path: Path, *, opset: int, dynamic_shapes: tuple | None = None) -> Path:
    """The TorchScript exporter: its graphs fuse well in ONNX Runtime's transformer optimizer. With
    `dynamic_shapes` (torch.export's), the dynamo exporter, the only one that takes PT2E-quantized
    modules (`pipeline.variants.neural_compressor`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    dynamo = dynamic_shapes is not None
    axes = {"dynamic_shapes": dynamic_shapes} if dynamo else {"dynamic_axes": graph.dynamic_axes}
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
            opset_version=opset,
            dynamo=dynamo,
            verbose=False,
            **axes,
        )
    if not dynamo:
        graph.module.eval()  # the TorchScript exporter restores the wrapper's mode onto every submodule
    return path
