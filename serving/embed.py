"""The text-embedding front: validate and tokenize here, pad and run in the batched model worker."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable

import anyio
import numpy as np

from serving.text import TextTokenizer, check_text_batch

EmbedIds = Callable[[list[list[int]]], Awaitable[np.ndarray]]


def encode_base64_f16(embeddings: np.ndarray) -> list[str]:
    little_endian = embeddings.astype("<f2")
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in little_endian]


def decode_base64_f16(encoded: list[str]) -> np.ndarray:
    """The client side of `encode_base64_f16`, kept beside it so the two cannot drift."""
    return np.stack([np.frombuffer(base64.b64decode(s), dtype="<f2") for s in encoded])


class TextEmbedder:
    def __init__(
        self,
        *,
        tokenizer: TextTokenizer,
        embed_ids: EmbedIds,
        max_batch_size: int,
        max_items_per_request: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.embed_ids = embed_ids
        self.max_batch_size = max_batch_size
        self.max_items_per_request = max_items_per_request

    async def embed(self, texts: list[str], *, truncate: bool) -> tuple[np.ndarray, int]:
        """Embeddings in request order and the number of tokens processed."""
        check_text_batch(texts, max_items=self.max_items_per_request)
        ids = await anyio.to_thread.run_sync(lambda: self.tokenizer.encode(texts, truncate=truncate))
        chunks = [ids[start : start + self.max_batch_size] for start in range(0, len(ids), self.max_batch_size)]
        embeddings = np.concatenate(await asyncio.gather(*(self.embed_ids(c) for c in chunks)))
        return embeddings, sum(len(row) for row in ids)
