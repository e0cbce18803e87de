"""Distilled students as variant kinds: the task trains the student (`PipelineTask.distill`), the
kind exports it with the teacher's serving graph around it; `student-int8` quantizes an accepted one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pipeline.export import export_onnx
from pipeline.recipe import Student
from pipeline.variants.base import VariantInputs, kind
from pipeline.variants.onnx_runtime import int8_dynamic, int8_static, static_configs


@kind("student", "fp32", lambda inputs: [inputs.student.model_dump()])
def _student(inputs: VariantInputs, config: dict, out: Path) -> None:
    """A distilled student, as the task makes one (a small CNN for classifiers, a subset of the
    teacher's layers for text encoders)."""
    if inputs.graph is None or inputs.training is None or not len(inputs.training):
        raise ValueError("student needs the PyTorch teacher and a training set")
    student = inputs.task.distill(inputs.graph.module, inputs.training, inputs.feeds, Student.model_validate(config))
    export_onnx(replace(inputs.graph, module=student), out, opset=inputs.opset)


def _student_int8_configs(inputs: VariantInputs) -> list[dict]:
    if inputs.is_transformer:
        return [{"per_channel": True}]
    return [c for c in static_configs(inputs) if c["ops"] == "all"]


@kind("student-int8", "int8", _student_int8_configs, requires="student")
def _student_int8(inputs: VariantInputs, config: dict, out: Path) -> None:
    """The accepted student, quantized: dynamic INT8 for text, calibrated static QDQ for CNNs."""
    stacked = replace(inputs, fp32=inputs.built["student"], built={})
    (int8_dynamic if inputs.is_transformer else int8_static)(stacked, config, out)
