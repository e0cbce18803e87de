"""The text-embedding front: validate and tokenize here, pad and run in the batched model worker."""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import anyio
import bentoml
import numpy as np

from serving.manifest import Route
from serving.model_calls import BatchedModel, Observer
from serving.model_runtime import read_spec
from serving.model_spec import TOKENIZER_FILE
from serving.monitoring import ModelMonitor, after_answer
from serving.text import TextTokenizer, check_text_batch
from serving.tracing import timed

# Texts up to this many characters in all are tokenized on the event loop: about 35 µs per short
# sentence, less than a hand-off to a worker thread and back costs; longer inputs (1.4 ms for
# 2 000 characters) go to a thread so they never hold up other requests.
INLINE_TOKENIZE_CHARS = 512
# A bulk job is tokenized this many texts at a time in a worker thread, so that interactive
# requests interleave with it instead of waiting behind thousands of texts.
BULK_TOKENIZE_CHUNK = 128
MAX_BULK_TEXTS = 20_000


def encode_base64_f16(embeddings: np.ndarray) -> list[str]:
    little_endian = embeddings.astype("<f2")
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in little_endian]


def decode_base64_f16(encoded: list[str]) -> np.ndarray:
    """The client side of `encode_base64_f16`, kept beside it so the two cannot drift."""
    return np.stack([np.frombuffer(base64.b64decode(s), dtype="<f2") for s in encoded])


@dataclass(frozen=True, kw_only=True)
class TextEmbedder:
    kind: ClassVar[str] = "embed"  # the endpoint it serves
    cascade: ClassVar[bool] = False  # no embedder is a cascade (serving/classify.py)
    tokenizer: TextTokenizer
    model: BatchedModel
    max_items_per_request: int
    tag: str  # the stored model's, named in every answer
    monitor: ModelMonitor | None = None

    @classmethod
    def from_stored(cls, stored: bentoml.Model, route: Route, model: BatchedModel, *, endpoint: str) -> TextEmbedder:
        """The embedder of a stored model: its tokenizer is stored with it. `endpoint`: the
        route's name in the metrics."""
        spec = read_spec(stored.info.metadata).text
        return cls(
            tokenizer=TextTokenizer(Path(stored.path) / TOKENIZER_FILE, max_length=spec.max_length),
            model=model,
            max_items_per_request=route.max_items_per_request,
            tag=str(stored.tag),
            monitor=ModelMonitor.of_stored(endpoint, stored),
        )

    def close(self) -> None:
        """Release the model once no request uses it any more (a hot swap: serving/lifecycle.py)."""
        self.model.close()
        if self.monitor is not None:
            self.monitor.release()

    async def embed(
        self,
        texts: list[str],
        *,
        truncate: bool,
        timeout_ms: float | None = None,
        observe: Observer | None = None,
        low: bool = False,
    ) -> tuple[np.ndarray, int]:
        """Embeddings in request order and the number of tokens processed; admitted (or refused)
        before tokenizing. `low`: at low priority (serving/batching.py)."""
        check_text_batch(texts, max_items=self.max_items_per_request)
        with self.model.admit(len(texts), timeout_ms=timeout_ms, low=low) as admission:
            with timed("tokenize"):
                if sum(len(text) for text in texts) <= INLINE_TOKENIZE_CHARS:
                    ids = self.tokenizer.encode(texts, truncate=truncate)
                else:
                    ids = await anyio.to_thread.run_sync(lambda: self.tokenizer.encode(texts, truncate=truncate))
            started = time.perf_counter()
            embeddings = await self.model.run(ids, admission)
        if observe is not None:
            observe(ids, embeddings, time.perf_counter() - started)
        if self.monitor is not None:
            after_answer(self.monitor.observe_embeddings, ids, embeddings)
        return embeddings, sum(len(row) for row in ids)

    async def embed_bulk(self, texts: list[str], *, truncate: bool) -> tuple[np.ndarray, int]:
        """As `embed`, for up to MAX_BULK_TEXTS texts at low priority: never refused for a
        deadline, run only in the engine's spare time (serving/batching.py)."""
        check_text_batch(texts, max_items=MAX_BULK_TEXTS)
        ids: list[list[int]] = []
        for start in range(0, len(texts), BULK_TOKENIZE_CHUNK):
            chunk = texts[start : start + BULK_TOKENIZE_CHUNK]
            ids += await anyio.to_thread.run_sync(
                lambda: self.tokenizer.encode(chunk, truncate=truncate, first_index=start)  # noqa: B023 (awaited here)
            )
        embeddings = await self.model.run_bulk(ids)
        return embeddings, sum(len(row) for row in ids)
