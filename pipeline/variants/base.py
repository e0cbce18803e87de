"""What a variant kind is: the inputs every kind may use, the registry kinds add themselves to,
and what several quantizers share. A leaf: the kind modules import it, never the other way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from pipeline.datasets import Split
from pipeline.export import ServingGraph
from pipeline.recipe import Student
from serving.engine import EngineName

if TYPE_CHECKING:
    from pipeline.tasks import PipelineTask

Feeds = Callable[[list], dict[str, np.ndarray]]  # rows → engine inputs
CALIBRATION_BATCH = 8  # rows per calibration batch, for the ONNX-side quantizers


@dataclass
class VariantInputs:
    """What every kind may need: the FP32 graph, data for calibration, the model's geometry."""

    task: PipelineTask
    fp32: Path
    workdir: Path
    calibration: Split
    feeds: Feeds
    num_heads: int = 0
    hidden_size: int = 0
    graph: ServingGraph | None = None  # the PyTorch serving graph, for torch-side variants
    opset: int = 17
    training: Split | None = None  # distillation data (labelled for classifiers)
    student: Student = field(default_factory=Student)
    built: dict[str, Path] = field(default_factory=dict)  # kind → accepted graph, for stacking

    @property
    def is_transformer(self) -> bool:
        """A BERT-family encoder (attention heads): its fusions and quantization differ from a CNN's."""
        return self.num_heads > 0

    def base(self) -> Path:
        """Quantize the fused graph when graph optimization produced one: fused ops quantize faster."""
        return self.built.get("graph-opt", self.fp32)

    def calibration_batches(self, batch_size: int = CALIBRATION_BATCH) -> list[dict]:
        rows = self.calibration.rows
        return [self.feeds(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]


@dataclass(frozen=True)
class VariantKind:
    name: str
    precision: str
    configs: Callable[[VariantInputs], list[dict[str, Any]]]
    build: Callable[[VariantInputs, dict[str, Any], Path], None]
    doc: str
    requires: str | None = None  # a kind whose accepted graph this one builds on
    engine: EngineName = "onnxruntime"  # what evaluates, profiles and serves it
    # Why this machine or this model cannot use the kind as meant, or None: such a kind is not
    # built, and its reason reported, rather than tried and failed or timed for nothing.
    unavailable: Callable[[VariantInputs], str | None] = lambda inputs: None


KINDS: dict[str, VariantKind] = {}


def kind(
    name: str,
    precision: str,
    configs: Callable[[VariantInputs], list[dict[str, Any]]],
    requires: str | None = None,
    engine: EngineName = "onnxruntime",
    unavailable: Callable[[VariantInputs], str | None] = lambda inputs: None,
):
    def register(build: Callable[[VariantInputs, dict[str, Any], Path], None]):
        doc = (build.__doc__ or "").strip()
        KINDS[name] = VariantKind(name, precision, configs, build, doc, requires, engine, unavailable)
        return build

    return register


def weighted_ends(model: onnx.ModelProto) -> list[str]:
    """The first and last weighted layers: the ones quantization hurts most."""
    weighted = [node.name for node in model.graph.node if node.op_type in ("Conv", "Gemm", "MatMul")]
    return weighted[:1] + weighted[-1:]
