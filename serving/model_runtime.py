"""The batched side: one engine session per served model, fed whole batches by the batcher."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from serving.artifacts import check_artifacts
from serving.cpu import describe_cpu
from serving.engine import ENGINE_LABEL, EngineSettings, open_engine
from serving.host import profile_doubts
from serving.model_spec import ONNX_FILE, SPEC_KEY, ModelSpec, Task
from serving.text import length_groups, pad_batch

logger = logging.getLogger(__name__)


def read_spec(metadata: dict) -> ModelSpec:
    return ModelSpec.model_validate(metadata[SPEC_KEY])


class _EngineRuntime:
    """A stored model's file opened on its engine, with its input spec."""

    batched_by_tokens: ClassVar[bool] = False  # whether a batch's cost is its padded tokens, not its rows

    def __init__(
        self,
        model_dir: Path,
        spec: ModelSpec,
        settings: EngineSettings,
        *,
        onnx_file: str = ONNX_FILE,
        engine: str = "onnxruntime",
    ) -> None:
        self.spec = spec
        self.engine = open_engine(engine, model_dir / onnx_file, settings)


class ImageModelRuntime(_EngineRuntime):
    """uint8 NHWC batch in, class probabilities out."""

    def predict(self, images: np.ndarray) -> np.ndarray:
        (input_name,) = self.engine.input_names
        return self.engine.run({input_name: images})[self.engine.output_names[0]]

    def predict_rows(self, rows: list[np.ndarray]) -> np.ndarray:
        return self.predict(np.stack(rows))

    def warm_up(self, max_batch_size: int, max_batch_tokens: int | None = None) -> None:
        size = self.spec.image.size
        for batch in sorted({1, max_batch_size}):
            started = time.monotonic()
            self.predict(np.zeros((batch, size, size, 3), dtype=np.uint8))
            logger.info("warm-up batch %d: %.1f ms", batch, 1000 * (time.monotonic() - started))


class CascadeImageRuntime(ImageModelRuntime):
    """A cascade (serving/model_spec.py `Cascade`) in one engine call per batch: the student on
    every row, then the teacher on the rows the student was unsure of. Its output has one column
    more than the classes: 1.0 where the teacher answered (`answered_by_teacher` splits it off),
    so that which model answered travels with each row through the batcher."""

    def __init__(self, model_dir: Path, spec: ModelSpec, settings: EngineSettings, **where: str) -> None:
        """`where`: the student's file and engine, as for any runtime."""
        super().__init__(model_dir, spec, settings, **where)
        cascade = spec.cascade
        self.threshold = cascade.threshold
        self.teacher = open_engine(cascade.teacher_engine, model_dir / cascade.teacher_file, settings)

    def predict(self, images: np.ndarray) -> np.ndarray:
        probabilities = super().predict(images)
        unsure = probabilities.max(-1) < self.threshold
        outputs = np.concatenate([probabilities, unsure[:, None].astype(probabilities.dtype)], axis=1)
        if unsure.any():
            (input_name,) = self.teacher.input_names
            outputs[unsure, :-1] = self.teacher.run({input_name: images[unsure]})[self.teacher.output_names[0]]
        return outputs

    def warm_up(self, max_batch_size: int, max_batch_tokens: int | None = None) -> None:
        super().warm_up(max_batch_size, max_batch_tokens)
        size = self.spec.image.size
        (input_name,) = self.teacher.input_names
        for batch in sorted({1, max_batch_size}):
            self.teacher.run({input_name: np.zeros((batch, size, size, 3), dtype=np.uint8)})


def answered_by_teacher(outputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A cascade's outputs split into the class probabilities and, per row, whether the teacher answered."""
    return outputs[:, :-1], outputs[:, -1] > 0.5


class TextModelRuntime(_EngineRuntime):
    """Unpadded token ids in, one embedding per row out (L2-normalized unless the model says otherwise)."""

    batched_by_tokens = True

    def predict(self, rows: list[list[int]]) -> np.ndarray:
        """Rows run in groups of similar length (serving/text.py, `length_groups`)."""
        groups = length_groups([len(row) for row in rows])
        if len(groups) == 1:
            return self._run(rows)
        embeddings = [self._run([rows[i] for i in group]) for group in groups]
        merged = np.empty((len(rows), embeddings[0].shape[1]), dtype=embeddings[0].dtype)
        for group, values in zip(groups, embeddings, strict=True):
            merged[group] = values
        return merged

    predict_rows = predict

    def _run(self, rows: list[list[int]]) -> np.ndarray:
        text = self.spec.text
        feeds = pad_batch(
            rows, text.pad_token_id, length_multiple=self.engine.length_multiple, max_length=text.max_length
        )
        return self.engine.run(feeds)[self.engine.output_names[0]]

    def warm_up(self, max_batch_size: int, max_batch_tokens: int | None = None) -> None:
        """One short text, and the largest batch of the longest texts the batcher sends: within
        `max_batch_tokens` where it has one. Beyond it (64 × 256 tokens for a cap of 2 181) the
        warm-up took 5.7 s of both cores beside the traffic of a hot swap, for shapes never sent."""
        longest = self.spec.text.max_length
        rows = max_batch_size if max_batch_tokens is None else max(1, min(max_batch_size, max_batch_tokens // longest))
        for batch, length in sorted({(1, 8), (rows, longest)}):
            started = time.monotonic()
            self.predict([[1] * length] * batch)
            logger.info("warm-up batch %d x %d tokens: %.1f ms", batch, length, 1000 * (time.monotonic() - started))


ModelRuntime = ImageModelRuntime | CascadeImageRuntime | TextModelRuntime
RUNTIMES: dict[Task, type[ModelRuntime]] = {
    "image-classification": ImageModelRuntime,
    "text-embedding": TextModelRuntime,
}


def runtime_class(spec: ModelSpec) -> type[ModelRuntime]:
    return CascadeImageRuntime if spec.cascade is not None else RUNTIMES[spec.task]


def onnx_runtime(path: Path, spec: ModelSpec, settings: EngineSettings, engine: str = "onnxruntime") -> ModelRuntime:
    """A runtime over any ONNX file (a cascade's teacher beside it): the pipeline times its
    candidates through the serving code before they are stored."""
    return runtime_class(spec)(path.parent, spec, settings, onnx_file=path.name, engine=engine)


def engine_of(stored: Any) -> str:
    """The engine a stored model (`bentoml.Model`) was measured on; models stored before engines
    were recorded ran on ONNX Runtime."""
    return stored.info.labels.get(ENGINE_LABEL, "onnxruntime")


def load_runtime(
    endpoint: str, stored: Any, *, max_batch_size: int, settings: EngineSettings, max_batch_tokens: int | None = None
) -> ModelRuntime:
    """The session for a stored model (`bentoml.Model`), its files checked against their recorded
    sha256 first, warmed up at the batch sizes it will see (text: within `max_batch_tokens`)."""
    check_artifacts(stored)
    logger.info("%s: %s runs on %s (%s)", endpoint, stored.tag, engine_of(stored), describe_cpu())
    if doubts := profile_doubts(stored.info.metadata):
        logger.warning(
            "%s: %s: %s: its variant and batching may not suit this machine; build its recipe again here, "
            "on a quiet machine (python -m pipeline models/%s.yaml --force)",
            endpoint,
            stored.tag,
            " and ".join(doubts),
            stored.tag.name,
        )
    spec = read_spec(stored.info.metadata)
    runtime = runtime_class(spec)(Path(stored.path), spec, settings, engine=engine_of(stored))
    runtime.warm_up(max_batch_size, max_batch_tokens)
    return runtime
