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
The cache holds at most `max_bytes` of answers (an answer larger than that is not kept), per
front worker.
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
        if len(answer) > self.max_bytes or key in self._answers:
            return
        while self.size + len(answer) > self.max_bytes:
            _, evicted = self._answers.popitem(last=False)
            self.size -= len(evicted)
            self._metrics.evicted()
        self._answers[key] = answer
        self.size += len(answer)
        self._metrics.held(self.size)
