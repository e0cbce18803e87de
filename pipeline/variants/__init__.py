"""Variant kinds, one module per tool; each registers its kinds in `KINDS` on import."""

from pipeline.variants import distilled, neural_compressor, onnx_runtime, openvino
from pipeline.variants.base import KINDS, VariantInputs, VariantKind

__all__ = ["KINDS", "VariantInputs", "VariantKind", "distilled", "neural_compressor", "onnx_runtime", "openvino"]
