"""The batched side: one ONNX session per model worker, fed whole batches by BentoML."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from serving.engine import EngineSettings, OnnxEngine
from serving.model_spec import ONNX_FILE, SPEC_KEY, ModelSpec
from serving.text import pad_batch

logger = logging.getLogger(__name__)


def read_spec(metadata: dict) -> ModelSpec:
    return ModelSpec.model_validate(metadata[SPEC_KEY])


class ImageModelRuntime:
    """uint8 NHWC batch in, class probabilities out."""

    def __init__(self, model_dir: Path, spec: ModelSpec, settings: EngineSettings) -> None:
        assert spec.image is not None, "an image model needs an image input spec"
        self.spec = spec
        self.engine = OnnxEngine(model_dir / ONNX_FILE, settings)

    def predict(self, images: np.ndarray) -> np.ndarray:
        (input_name,) = self.engine.input_names
        return self.engine.run({input_name: images})[self.engine.output_names[0]]

    def warm_up(self, max_batch_size: int) -> None:
        size = self.spec.image.size
        for batch in sorted({1, max_batch_size}):
            started = time.monotonic()
            self.predict(np.zeros((batch, size, size, 3), dtype=np.uint8))
            logger.info("warm-up batch %d: %.1f ms", batch, 1000 * (time.monotonic() - started))


class TextModelRuntime:
    """Unpadded token ids in, one L2-normalized embedding per row out."""

    def __init__(self, model_dir: Path, spec: ModelSpec, settings: EngineSettings) -> None:
        assert spec.text is not None, "a text model needs a text input spec"
        self.spec = spec
        self.engine = OnnxEngine(model_dir / ONNX_FILE, settings)

    def predict(self, rows: list[list[int]]) -> np.ndarray:
        feeds = pad_batch(rows, self.spec.text.pad_token_id)
        return self.engine.run(feeds)[self.engine.output_names[0]]

    def warm_up(self, max_batch_size: int) -> None:
        for batch, length in sorted({(1, 8), (max_batch_size, self.spec.text.max_length)}):
            started = time.monotonic()
            self.predict([[1] * length] * batch)
            logger.info("warm-up batch %d x %d tokens: %.1f ms", batch, length, 1000 * (time.monotonic() - started))
