"""CPU variants that OpenVINO runs: the FP32 export as it is, the same computed in bf16 on CPUs
with bf16 instructions (AMX, AVX512_BF16), and NNCF's post-training INT8.

All stay ONNX files (one format in the store, one sha256 check, ONNX Runtime can still open
them); what differs is the engine recorded with them. NNCF quantizes with its ONNX backend:
it inserts QuantizeLinear/DequantizeLinear pairs where OpenVINO's CPU plugin has int8 kernels
(and only there), calibrated on the recipe's calibration rows, never on the evaluation rows.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from pipeline.variants.base import VariantInputs, kind, weighted_ends
from serving.cpu import has_bf16
from serving.engine import EngineSettings, OpenVinoEngine

# Accuracy control stops reverting layers to float once the drop on its data is this small: a
# fraction of a typical 1 % budget, since the gate then judges the bound on other inputs.
ACCURACY_CONTROL_MAX_DROP = 0.003
# Layers reverted to float one per iteration, each re-validated: the bound keeps a graph that
# will not converge from costing minutes (EfficientNet-Lite0 still missed by 0.14 after 7).
ACCURACY_CONTROL_ITERATIONS = 8


@kind("openvino", "fp32", lambda inputs: [{}], engine="openvino")
def _openvino(inputs: VariantInputs, config: dict, out: Path) -> None:
    """The FP32 export compiled by OpenVINO (its ONNX frontend; precision pinned to f32)."""
    shutil.copyfile(inputs.fp32, out)


def _without_bf16(inputs: VariantInputs) -> str | None:
    if has_bf16():
        return None
    return (
        "this CPU has no bf16 instructions (amx_bf16 or avx512_bf16): OpenVINO would compute in f32, "
        "which the `openvino` variant already is"
    )


@kind("openvino-bf16", "bf16", lambda inputs: [{}], engine="openvino-bf16", unavailable=_without_bf16)
def _openvino_bf16(inputs: VariantInputs, config: dict, out: Path) -> None:
    """The FP32 export computed by OpenVINO in bf16 (AMX or AVX512_BF16 matrix units): no
    calibration, and usually within a fraction of a point of FP32, which the gate checks."""
    shutil.copyfile(inputs.fp32, out)


def _int8_configs(inputs: VariantInputs) -> list[dict[str, Any]]:
    """Fastest first: symmetric activations (`performance`), then asymmetric ones (`mixed`), then
    `mixed` with the first and last weighted layers left in float (the most sensitive ones), then
    NNCF's accuracy control, which reverts the layers that cost most agreement until the drop
    on the calibration inputs is below ACCURACY_CONTROL_MAX_DROP."""
    model_type = "transformer" if inputs.is_transformer else None
    plain = {"model_type": model_type, "keep_ends_float": False, "accuracy_control": False}
    return [
        {**plain, "preset": "performance"},
        {**plain, "preset": "mixed"},
        {**plain, "preset": "mixed", "keep_ends_float": True},
        {**plain, "preset": "mixed", "accuracy_control": True, "max_drop": ACCURACY_CONTROL_MAX_DROP},
    ]


@kind("openvino-int8", "int8", _int8_configs, engine="openvino")
def _openvino_int8(inputs: VariantInputs, config: dict, out: Path) -> None:
    """NNCF post-training quantization (min-max calibration, fast bias correction) for OpenVINO."""
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedAccuracyRestorerParameters

    if not len(inputs.calibration):
        raise ValueError("openvino-int8 needs calibration data and the calibration set is empty")
    model = onnx.load(str(inputs.fp32))
    batches = inputs.calibration_batches()
    options = {
        "preset": nncf.QuantizationPreset(config["preset"]),
        "model_type": nncf.ModelType(config["model_type"]) if config["model_type"] else None,
        "subset_size": len(batches),
        "ignored_scope": nncf.IgnoredScope(names=weighted_ends(model)) if config["keep_ends_float"] else None,
    }
    if not config["accuracy_control"]:
        onnx.save(nncf.quantize(model, nncf.Dataset(batches), **options), str(out))
        return
    # Items carry their index so that each is compared with FP32's answer to the same batch.
    dataset = nncf.Dataset(list(enumerate(batches)), lambda item: item[1])
    agreement = _agreement_with(inputs.fp32, batches, inputs.task.agreement)
    quantized = nncf.quantize_with_accuracy_control(
        model,
        dataset,
        dataset,
        agreement,
        max_drop=config["max_drop"],
        advanced_accuracy_restorer_parameters=AdvancedAccuracyRestorerParameters(
            max_num_iterations=ACCURACY_CONTROL_ITERATIONS
        ),
        **options,
    )
    onnx.save(quantized, str(out))


def _agreement_with(fp32: Path, batches: list[dict], agreement: Callable[[np.ndarray, np.ndarray], float]):
    """NNCF's validation function: per batch, the task's agreement (top-1 for classifiers, mean
    cosine for embedders) of a graph's outputs with the FP32 graph's on OpenVINO."""
    settings = EngineSettings.from_environment()
    reference = OpenVinoEngine(fp32, settings)
    expected = [next(iter(reference.run(feeds).values())) for feeds in batches]

    def validate(model: onnx.ModelProto, items) -> tuple[float, list[float]]:
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / "candidate.onnx"
            onnx.save(model, str(path))
            engine = OpenVinoEngine(path, settings)
        values = [agreement(expected[index], next(iter(engine.run(feeds).values()))) for index, feeds in items]
        return float(np.mean(values)), values

    return validate
