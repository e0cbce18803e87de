"""What a stored model promises its server: written by the pipeline into the model's metadata.

The service reads it back instead of re-deriving shapes, labels or tokenizer settings, so a
bento built from exported artifacts needs nothing but the model store.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

Task = Literal["image-classification", "text-embedding"]
TASK_INPUT: dict[Task, str] = {"image-classification": "image", "text-embedding": "text"}  # the spec field it needs

ONNX_FILE = "model.onnx"
CLASS_NAMES_FILE = "class_names.json"
TOKENIZER_FILE = "tokenizer.json"
TEACHER_FILE = "teacher.onnx"  # a cascade's second model
SPEC_KEY = "optiserve"


class ImageInput(BaseModel):
    """uint8 NHWC at `size`; the graph normalizes. `crop`: the shorter side resized to `resize`, then
    the centre square; else the whole photo squeezed to `size` × `size` (ViT's processor does that)."""

    model_config = ConfigDict(extra="forbid")
    size: int
    resize: int
    crop: bool = True


class TextInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_length: int
    pad_token_id: int
    dimensions: int


class Cascade(BaseModel):
    """Early exit: the stored model (a student) answers the rows whose top probability reaches
    `threshold`; the teacher, stored beside it, answers the rest. The pipeline calibrated the
    threshold so that the pair stays within the recipe's budget of the teacher alone."""

    model_config = ConfigDict(extra="forbid")
    threshold: float
    teacher_file: str = TEACHER_FILE
    teacher_engine: str = "onnxruntime"


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: Task
    image: ImageInput | None = None
    text: TextInput | None = None
    cascade: Cascade | None = None  # image classifiers only
    input_names: list[str]
    output_names: list[str]

    @model_validator(mode="after")
    def _has_its_task_input(self) -> ModelSpec:
        needed = TASK_INPUT[self.task]
        if getattr(self, needed) is None:
            raise ValueError(f"a {self.task} model's spec needs its {needed!r} input")
        return self
