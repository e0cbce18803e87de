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
SPEC_KEY = "optiserve"


class ImageInput(BaseModel):
    """uint8 NHWC at `size`; the graph normalizes."""

    model_config = ConfigDict(extra="forbid")
    size: int
    resize: int


class TextInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_length: int
    pad_token_id: int
    dimensions: int


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: Task
    image: ImageInput | None = None
    text: TextInput | None = None
    input_names: list[str]
    output_names: list[str]

    @model_validator(mode="after")
    def _has_its_task_input(self) -> ModelSpec:
        needed = TASK_INPUT[self.task]
        if getattr(self, needed) is None:
            raise ValueError(f"a {self.task} model's spec needs its {needed!r} input")
        return self
