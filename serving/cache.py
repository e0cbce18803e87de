"""A route's response cache: the same input to the same model gets the same answer, from memory.

Off unless the route asks for it (`cache_mb` in the recipe's `serving` or the manifest): most
traffic repeats nothing, and a cache only costs it. Where requests do repeat (a search box's
popular queries, a feed's thumbnails), an answer is kept as the JSON bytes that were sent and
served again without decoding, tokenizing or a batch.

The key is a SHA-256 of the model's tag and the request's exact inputs (the texts and options of
/embed; the image bytes and `top_k` of /classify), each part length-prefixed so that no two
inputs can run together. The tag makes a hot swap safe: once the alias names another version,
requests lease the new model and look up keys that no entry of the old one can match; a canary
and its primary never share an entry either. The old entries age out as the least recently used.
The cache holds at most `max_bytes` of memory (its answers and what each entry costs besides; an
answer larger than that is not kept), per front worker.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from serving.metrics import CacheMetrics


def cache_key(tag: str, *parts: bytes) -> bytes:
    digest = hashlib.sha256()
    for part in (tag.encode(), *parts):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.digest()


# What an entry holds beyond its answer's bytes: the key (32 bytes, an object), the answer's object
# header, the ordered dict's slots, more of them as entries come and go; under tracemalloc a cache
# of 124-byte answers held 0.87-0.88 × its size with this, 1.6-1.7 × without (answers of 2 kB, 0.99 ×).
ENTRY_BYTES = 260


def weight(answer: bytes) -> int:
    """The memory an answer holds in the cache."""
    return len(answer) + ENTRY_BYTES


class ResponseCache:
    """Least-recently-used answers of one endpoint, bounded in bytes. Used on the event loop only."""

    def __init__(self, max_bytes: int, *, endpoint: str) -> None:
        if max_bytes < 1:
            raise ValueError(f"a response cache needs a positive size, not {max_bytes} bytes")
        self.max_bytes = max_bytes
        self.size = 0
        self._answers: OrderedDict[bytes, bytes] = OrderedDict()
        self._metrics = CacheMetrics(endpoint=endpoint)

    @classmethod
    def of_megabytes(cls, megabytes: float | None, *, endpoint: str) -> ResponseCache | None:
        return None if megabytes is None else cls(int(megabytes * 1024 * 1024), endpoint=endpoint)

    def get(self, key: bytes) -> bytes | None:
        answer = self._answers.get(key)
        if answer is not None:
            self._answers.move_to_end(key)
        self._metrics.lookup(hit=answer is not None)
        return answer

    def put(self, key: bytes, answer: bytes) -> None:
        if weight(answer) > self.max_bytes or key in self._answers:
            return
        while self.size + weight(answer) > self.max_bytes:
            _, evicted = self._answers.popitem(last=False)
            self.size -= weight(evicted)
            self._metrics.evicted()
        self._answers[key] = answer
        self.size += weight(answer)
        self._metrics.held(self.size)
