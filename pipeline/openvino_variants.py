"""CPU variants that OpenVINO runs: the FP32 export as it is, and NNCF's post-training INT8.

Both stay ONNX files (one format in the store, one sha256 check, ONNX Runtime can still open
them); what differs is the engine recorded with them. NNCF quantizes with its ONNX backend:
it inserts QuantizeLinear/DequantizeLinear pairs where OpenVINO's CPU plugin has int8 kernels
(and only there), calibrated on the recipe's calibration rows, never on the evaluation rows.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import onnx

from pipeline.variants import VariantInputs, kind

CALIBRATION_BATCH = 8


@kind("openvino", "fp32", lambda inputs: [{}], engine="openvino")
def _openvino(inputs: VariantInputs, config: dict, out: Path) -> None:
    """The FP32 export compiled by OpenVINO (its ONNX frontend; precision pinned to f32)."""
    shutil.copyfile(inputs.fp32, out)


def _int8_configs(inputs: VariantInputs) -> list[dict[str, Any]]:
    """Fastest first: symmetric activations (`performance`), then asymmetric ones (`mixed`), then
    `mixed` with the first and last weighted layers left in float (the most sensitive ones)."""
    model_type = "transformer" if inputs.is_transformer else None
    return [
        {"preset": "performance", "model_type": model_type, "keep_ends_float": False},
        {"preset": "mixed", "model_type": model_type, "keep_ends_float": False},
        {"preset": "mixed", "model_type": model_type, "keep_ends_float": True},
    ]


def _weighted_ends(model: onnx.ModelProto) -> list[str]:
    weighted = [node.name for node in model.graph.node if node.op_type in ("Conv", "Gemm", "MatMul")]
    return weighted[:1] + weighted[-1:]


@kind("openvino-int8", "int8", _int8_configs, engine="openvino")
def _openvino_int8(inputs: VariantInputs, config: dict, out: Path) -> None:
    """NNCF post-training quantization (min-max calibration, fast bias correction) for OpenVINO."""
    import nncf

    if not len(inputs.calibration):
        raise ValueError("openvino-int8 needs calibration data and the calibration set is empty")
    model = onnx.load(str(inputs.fp32))
    rows = inputs.calibration.rows
    batches = [inputs.feeds(rows[i : i + CALIBRATION_BATCH]) for i in range(0, len(rows), CALIBRATION_BATCH)]
    quantized = nncf.quantize(
        model,
        nncf.Dataset(batches),
        preset=nncf.QuantizationPreset(config["preset"]),
        model_type=nncf.ModelType(config["model_type"]) if config["model_type"] else None,
        subset_size=len(batches),
        ignored_scope=nncf.IgnoredScope(names=_weighted_ends(model)) if config["keep_ends_float"] else None,
    )
    onnx.save(quantized, str(out))
