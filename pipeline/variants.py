"""Variant presets: each kind lists its configurations in order of expected speed and builds one.

The accuracy-driven tuner in `pipeline.tuning` walks those configurations until one fits the
recipe's budget, so a kind only has to know how to make a graph, not whether it is good enough.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from pipeline.datasets import Split
from pipeline.export import ServingGraph
from pipeline.recipe import Student
from serving.cpu import has_vnni
from serving.engine import EngineName
from serving.model_spec import Task

Feeds = Callable[[list], dict]
# Fused transformer graphs carry contrib ops that ONNX shape inference cannot type.
QUANT_EXTRA = {"DefaultTensorType": onnx.TensorProto.FLOAT}
CALIBRATION_BATCH = 8  # rows per calibration batch, for every quantizer


@dataclass
class VariantInputs:
    """What every kind may need: the FP32 graph, data for calibration, the model's geometry."""

    task: Task
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
        return self.task == "text-embedding"

    def base(self) -> Path:
        """Quantize the fused graph when graph optimization produced one: fused ops quantize faster."""
        return self.built.get("graph-opt", self.fp32)


@dataclass(frozen=True)
class VariantKind:
    name: str
    precision: str
    configs: Callable[[VariantInputs], list[dict[str, Any]]]
    build: Callable[[VariantInputs, dict[str, Any], Path], None]
    doc: str
    requires: str | None = None  # a kind whose accepted graph this one builds on
    engine: EngineName = "onnxruntime"  # what evaluates, profiles and serves it


KINDS: dict[str, VariantKind] = {}


def kind(
    name: str,
    precision: str,
    configs: Callable[[VariantInputs], list[dict[str, Any]]],
    requires: str | None = None,
    engine: EngineName = "onnxruntime",
):
    def register(build: Callable[[VariantInputs, dict[str, Any], Path], None]):
        KINDS[name] = VariantKind(name, precision, configs, build, (build.__doc__ or "").strip(), requires, engine)
        return build

    return register


@kind("graph-opt", "fp32", lambda inputs: [{}])
def _graph_opt(inputs: VariantInputs, config: dict, out: Path) -> None:
    """ORT's transformer optimizer (attention, LayerNorm, GELU fusions) for BERT-family graphs;
    ORT's extended offline fusions otherwise."""
    if inputs.is_transformer:
        from onnxruntime.transformers import optimizer

        optimized = optimizer.optimize_model(
            str(inputs.fp32), model_type="bert", num_heads=inputs.num_heads, hidden_size=inputs.hidden_size, opt_level=1
        )
        optimized.save_model_to_file(str(out))
        return
    options = ort.SessionOptions()
    # EXTENDED, not ALL: ALL writes layout-specific kernels that tie the file to this CPU.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(out)
    ort.InferenceSession(str(inputs.fp32), options, providers=["CPUExecutionProvider"])


@kind("int8-dynamic", "int8", lambda inputs: [{"per_channel": True}, {"per_channel": False}])
def _int8_dynamic(inputs: VariantInputs, config: dict, out: Path) -> None:
    """Weights int8 ahead of time, activations quantized per batch at run time (transformers)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        str(inputs.base()),
        str(out),
        weight_type=QuantType.QInt8,
        per_channel=config["per_channel"],
        op_types_to_quantize=["MatMul", "Gemm", "Attention"],  # Attention holds the fused QKV weights
        extra_options=QUANT_EXTRA,
    )


def _static_configs(inputs: VariantInputs) -> list[dict]:
    methods = ("minmax", "entropy", "percentile")
    reduce_range = not has_vnni()
    if inputs.is_transformer:
        # Quantizing every op collapses transformer accuracy; weight MatMuls alone hold it.
        return [{"ops": "all", "method": "minmax", "reduce_range": reduce_range}] + [
            {"ops": "weight-matmuls", "method": m, "reduce_range": reduce_range} for m in methods
        ]
    # Then keep the most sensitive layers (first convolution, classifier) in float.
    return [{"ops": "all", "method": m, "reduce_range": reduce_range} for m in methods] + [
        {"ops": "all-but-ends", "method": "minmax", "reduce_range": reduce_range}
    ]


class _Reader:
    """ORT's CalibrationDataReader protocol over a calibration split."""

    def __init__(self, split: Split, feeds: Feeds, batch_size: int = CALIBRATION_BATCH) -> None:
        self._batches: Iterator[dict] = (
            feeds(split.rows[i : i + batch_size]) for i in range(0, len(split), batch_size)
        )

    def get_next(self) -> dict | None:
        return next(self._batches, None)


def _weight_matmuls(model: onnx.ModelProto) -> list[str]:
    weights = {init.name for init in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and any(i in weights for i in n.input)]


def _node_selection(base: Path, ops: str) -> dict:
    """Which nodes to quantize. Softmax always stays float: uint8 probabilities lose their ranking."""
    model = onnx.load(str(base), load_external_data=False)
    keep_float = [n.name for n in model.graph.node if n.op_type == "Softmax"]
    if ops == "weight-matmuls":
        return {"nodes_to_quantize": _weight_matmuls(model), "op_types_to_quantize": ["MatMul"]}
    if ops == "all-but-ends":
        keep_float += weighted_ends(model)
    return {"nodes_to_exclude": keep_float}


def weighted_ends(model: onnx.ModelProto) -> list[str]:
    """The first and last weighted layers: the ones quantization hurts most."""
    weighted = [node.name for node in model.graph.node if node.op_type in ("Conv", "Gemm", "MatMul")]
    return weighted[:1] + weighted[-1:]


@kind("int8-static", "int8", _static_configs)
def _int8_static(inputs: VariantInputs, config: dict, out: Path) -> None:
    """Calibrated QDQ: uint8 activations, int8 per-channel weights (the fast path on x86)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    if not len(inputs.calibration):
        raise ValueError("int8-static needs calibration data and the calibration set is empty")
    method = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[config["method"]]
    base = inputs.base() if config["ops"] == "weight-matmuls" else inputs.fp32
    quantize_static(
        str(base),
        str(out),
        _Reader(inputs.calibration, inputs.feeds),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        per_channel=True,
        reduce_range=config["reduce_range"],
        calibrate_method=method,
        extra_options=QUANT_EXTRA,
        **_node_selection(base, config["ops"]),
    )


@kind("fp16", "fp16", lambda inputs: [{}])
def _fp16(inputs: VariantInputs, config: dict, out: Path) -> None:
    """Float16 weights and compute with float32 inputs and outputs, meant for GPU providers."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(inputs.base()))
    onnx.save(convert_float_to_float16(model, keep_io_types=True), str(out))


@kind("student", "fp32", lambda inputs: [inputs.student.model_dump()])
def _student(inputs: VariantInputs, config: dict, out: Path) -> None:
    """A distilled student: a small CNN for classifiers (soft teacher targets plus labels), an
    evenly spread subset of the teacher's layers for text encoders (embedding MSE)."""
    import torch

    from pipeline.export import SentenceEmbeddingGraph, export_onnx
    from pipeline.students import SmallCNN, distill_classifier, distill_embeddings, layer_subset_student

    if inputs.graph is None or inputs.training is None or not len(inputs.training):
        raise ValueError("student needs the PyTorch teacher and a training set")
    settings = Student.model_validate(config)
    teacher = inputs.graph.module
    if inputs.is_transformer:
        student = SentenceEmbeddingGraph(layer_subset_student(teacher.model, settings.layers))
        rows = sorted(inputs.training.rows, key=len)  # length buckets: little padding, much faster
        batches = [inputs.feeds(rows[i : i + 32]) for i in range(0, len(rows), 32)]
        distill_embeddings(teacher, student, batches, epochs=settings.epochs)
    else:
        if inputs.training.labels is None:
            raise ValueError("a classifier student needs labelled training data (e.g. source kind train-digits)")
        with torch.inference_mode():
            num_classes = teacher(torch.from_numpy(np.stack(inputs.training.rows[:1]))).shape[-1]
        student = teacher.with_model(SmallCNN(num_classes, settings.channels))
        distill_classifier(
            teacher.model,
            student.model,
            teacher.normalize,
            np.stack(inputs.training.rows),
            inputs.training.labels,
            epochs=settings.epochs,
            temperature=settings.temperature,
            alpha=settings.alpha,
        )
        student.eval()
    export_onnx(replace(inputs.graph, module=student), out, opset=inputs.opset)


def _student_int8_configs(inputs: VariantInputs) -> list[dict]:
    if inputs.is_transformer:
        return [{"per_channel": True}]
    return [c for c in _static_configs(inputs) if c["ops"] == "all"]


@kind("student-int8", "int8", _student_int8_configs, requires="student")
def _student_int8(inputs: VariantInputs, config: dict, out: Path) -> None:
    """The accepted student, quantized: dynamic INT8 for text, calibrated static QDQ for CNNs."""
    stacked = replace(inputs, fp32=inputs.built["student"], built={})
    (_int8_dynamic if inputs.is_transformer else _int8_static)(stacked, config, out)


# Kinds defined in their own modules register themselves on import.
from pipeline import inc_quant, openvino_variants  # noqa: E402,F401
