"""The image-classification front: decode and resize in threads, batch-limited model calls, top-k."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import bentoml
import numpy as np

from serving.batching import Admission
from serving.errors import InputTooLarge, InvalidInput
from serving.images import check_content_type, decode_sized, resize_center_crop, resize_whole
from serving.manifest import Route
from serving.metrics import count_cascade_answers
from serving.model_calls import BatchedModel, Observer
from serving.model_runtime import answered_by_teacher, read_spec
from serving.model_spec import CLASS_NAMES_FILE, ImageInput
from serving.monitoring import ModelMonitor, after_answer
from serving.schemas import AnsweredBy, Prediction
from serving.tracing import timed


@dataclass(frozen=True)
class ImageUpload:
    data: bytes
    content_type: str | None
    name: str


def load_class_names(model_dir: Path) -> list[str]:
    return json.loads((model_dir / CLASS_NAMES_FILE).read_text())


def prepare_sized_image(upload: ImageUpload, spec: ImageInput) -> tuple[np.ndarray, tuple[int, int]]:
    """Bytes to the model's uint8 HWC input, the path every request and every evaluation takes,
    with the decoded image's (width, height), which monitoring records."""
    check_content_type(upload.content_type, name=upload.name)
    decoded = decode_sized(upload.data, min_side=spec.resize, name=upload.name)
    if not spec.crop:
        return resize_whole(decoded.image, size=spec.size), decoded.size
    return resize_center_crop(decoded.image, resize=spec.resize, crop=spec.size), decoded.size


def prepare_image(upload: ImageUpload, spec: ImageInput) -> np.ndarray:
    return prepare_sized_image(upload, spec)[0]


def top_k_predictions(probabilities: np.ndarray, class_names: Sequence[str], k: int) -> list[Prediction]:
    k = min(k, probabilities.shape[-1])
    best = np.argpartition(-probabilities, k - 1)[:k]
    best = best[np.argsort(-probabilities[best])]
    return [Prediction(label=class_names[i], class_id=int(i), score=float(probabilities[i])) for i in best]


@dataclass(frozen=True)
class Classified:
    predictions: list[list[Prediction]]  # per image, in order
    answered_by: list[AnsweredBy] | None = None  # a cascade's, per image


@dataclass(frozen=True, kw_only=True)
class ImageClassifier:
    kind: ClassVar[str] = "classify"  # the endpoints it serves: classify and classify_batch
    spec: ImageInput
    class_names: list[str]
    model: BatchedModel
    max_items_per_request: int
    tag: str  # the stored model's, named in every answer
    monitor: ModelMonitor | None = None
    cascade: bool = False  # a student and its teacher (serving/model_runtime.py `CascadeImageRuntime`)
    endpoint: str = ""  # the route's name in the metrics

    @classmethod
    def from_stored(cls, stored: bentoml.Model, route: Route, model: BatchedModel, *, endpoint: str) -> ImageClassifier:
        """The classifier of a stored model: its input spec and class names are stored with it.
        `endpoint`: the route's name in the metrics."""
        class_names = load_class_names(Path(stored.path))
        spec = read_spec(stored.info.metadata)
        return cls(
            spec=spec.image,
            class_names=class_names,
            model=model,
            max_items_per_request=route.max_items_per_request,
            tag=str(stored.tag),
            monitor=ModelMonitor.of_stored(endpoint, stored, class_names),
            cascade=spec.cascade is not None,
            endpoint=endpoint,
        )

    def close(self) -> None:
        """Release the model once no request uses it any more (a hot swap: serving/lifecycle.py)."""
        self.model.close()
        if self.monitor is not None:
            self.monitor.release()

    def admit(
        self, images: int, *, timeout_ms: float | None = None, low: bool = False
    ) -> AbstractContextManager[Admission]:
        """A place in the model's queue for `images` images, or a refusal (serving/batching.py):
        taken before anything costly, the body's upload for one image, its decoding for several."""
        if images < 1:
            raise InvalidInput("no image in the request")
        if images > self.max_items_per_request:
            raise InputTooLarge(f"{images} images in one request; the limit is {self.max_items_per_request}")
        return self.model.admit(images, timeout_ms=timeout_ms, low=low)

    async def classify(
        self, uploads: list[ImageUpload], top_k: int, admission: Admission, observe: Observer | None = None
    ) -> Classified:
        if top_k < 1:
            raise InvalidInput(f"top_k must be at least 1, got {top_k}")
        with timed("decode"):
            prepared = await asyncio.gather(
                *(asyncio.to_thread(prepare_sized_image, upload, self.spec) for upload in uploads)
            )
        pixels, started = np.stack([image for image, _ in prepared]), time.perf_counter()
        outputs = await self.model.run(pixels, admission)
        probabilities, by_teacher = answered_by_teacher(outputs) if self.cascade else (outputs, None)
        if observe is not None:
            observe(pixels, probabilities, time.perf_counter() - started)
        if self.monitor is not None:
            after_answer(self.monitor.observe_classifications, [size for _, size in prepared], pixels, probabilities)
        predictions = [top_k_predictions(row, self.class_names, top_k) for row in probabilities]
        if by_teacher is None:
            return Classified(predictions)
        count_cascade_answers(self.endpoint, self.tag, teacher=int(by_teacher.sum()), student=int((~by_teacher).sum()))
        return Classified(predictions, ["teacher" if teacher else "student" for teacher in by_teacher])
