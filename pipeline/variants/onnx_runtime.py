"""ONNX Runtime's own tools as variant kinds: the transformer optimizer and graph fusions, dynamic
and calibrated static INT8, FP16. Each kind lists its configurations in order of expected speed;
the accuracy-driven tuner (`pipeline.tuning`) walks them until one fits the recipe's budget, so
a kind only has to know how to make a graph, not whether it is good enough.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator
from pathlib import Path

import onnx

from pipeline.variants.base import CALIBRATION_BATCH, VariantInputs, kind, weighted_ends
from serving.cpu import has_vnni
from serving.engine import available_providers

# Fused transformer graphs carry contrib ops that ONNX shape inference cannot type.
QUANT_EXTRA = {"DefaultTensorType": onnx.TensorProto.FLOAT}


def _fused_at_load(inputs: VariantInputs) -> str | None:
    """Outside BERT-family graphs the offline fusions are ONNX Runtime's own, which every session
    of the service applies when it loads the FP32 export: the graph would run as FP32 does
    (EfficientNet-Lite0: 0.97-1.02 × FP32 in five builds)."""
    if inputs.is_transformer:
        return None
    return (
        "ONNX Runtime applies these fusions to the FP32 export whenever it loads it (the service's "
        "sessions run at its highest optimization level): it would run as FP32 does; the transformer "
        "optimizer, which goes further, applies to BERT-family graphs"
    )


@kind("graph-opt", "fp32", lambda inputs: [{}], unavailable=_fused_at_load)
def _graph_opt(inputs: VariantInputs, config: dict, out: Path) -> None:
    """ORT's transformer optimizer (attention, LayerNorm, GELU fusions) for BERT-family graphs."""
    from onnxruntime.transformers import optimizer

    optimized = optimizer.optimize_model(
        str(inputs.fp32), model_type="bert", num_heads=inputs.num_heads, hidden_size=inputs.hidden_size, opt_level=1
    )
    optimized.save_model_to_file(str(out))


@kind("int8-dynamic", "int8", lambda inputs: [{"per_channel": True}, {"per_channel": False}])
def int8_dynamic(inputs: VariantInputs, config: dict, out: Path) -> None:
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


def static_configs(inputs: VariantInputs) -> list[dict]:
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
    """ORT's CalibrationDataReader protocol over the calibration rows, in batches of one shape: its
    histogram calibrators (entropy, percentile) stack every batch's activations into one array, and
    failed ("inhomogeneous shape") on a short last batch (99 views of 9 photos in batches of 8) or on
    texts padded per batch. So the rows are padded together, and cut into equal batches of at most
    `CALIBRATION_BATCH` rows (one row each where their number is prime): none is left out."""

    def __init__(self, inputs: VariantInputs) -> None:
        rows = len(inputs.calibration)
        size = max(d for d in range(1, CALIBRATION_BATCH + 1) if rows % d == 0)
        feeds = inputs.feeds(inputs.calibration.rows)
        self._batches: Iterator[dict] = (
            {name: array[start : start + size] for name, array in feeds.items()} for start in range(0, rows, size)
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


@kind("int8-static", "int8", static_configs)
def int8_static(inputs: VariantInputs, config: dict, out: Path) -> None:
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
        _Reader(inputs),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        per_channel=True,
        reduce_range=config["reduce_range"],
        calibrate_method=method,
        extra_options=QUANT_EXTRA,
        **_node_selection(base, config["ops"]),
    )


def _cast_back_on_x86_cpus(inputs: VariantInputs) -> str | None:
    """Without a GPU provider, on x86, ONNX Runtime runs an fp16 graph in f32 behind the Casts it
    inserts around each op its CPU provider has no x86 fp16 kernel for (microsoft/onnxruntime#16778):
    0.60-1.10 × FP32 on these CPUs, build after build, never clearly faster, so building, judging
    and screening it bought nothing. ARM CPUs have fp16 kernels: there it is built, and kept only if it
    measures faster than FP32 (`pipeline.build`)."""
    if available_providers() != ["CPUExecutionProvider"] or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return (
        "no GPU provider here, and on x86 CPUs ONNX Runtime computes fp16 graphs in f32 behind Casts it "
        "inserts (0.60-1.10 × FP32 measured, never clearly faster)"
    )


@kind("fp16", "fp16", lambda inputs: [{}], unavailable=_cast_back_on_x86_cpus)
def _fp16(inputs: VariantInputs, config: dict, out: Path) -> None:
    """Float16 weights and compute with float32 inputs and outputs, meant for GPU providers."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(inputs.base()))
    onnx.save(convert_float_to_float16(model, keep_io_types=True), str(out))
