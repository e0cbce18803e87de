"""Worker-process hygiene that keeps the latency tail flat.

A worker holds a large, long-lived heap once BentoML, Starlette, pydantic and ONNX Runtime are
imported and the models loaded. CPython's full (generation-2) collection walks all of it: in a
front worker under load it ran every few seconds and took 55-110 ms, stalling every request in
flight, which put p99 at concurrency 1 at many times p50. Freezing the heap after start-up moves
those objects to a permanent generation that collections skip; what requests allocate is still
collected as usual.

What lives for a while under load still piles up in the oldest generation: BentoML's timeout
middleware keeps a timer per request for its whole traffic timeout (46 s). In a 90 s flood of
/embed (512 clients) full collections came every 2-3 s and grew to 50-70 ms; the event loop
answers nothing meanwhile, and refusals took 40 ms at p99 at the client. With a full collection
after every 100th of the middle generation instead of every 10th: three in the 90 s, refusals
8 ms at p99, and the worker's memory after the flood the same (537 against 541 MiB;
RELIABILITY.md).

The middle generation was the next stall. Under a flood each of the 512 requests in flight
holds some 120 tracked objects (coroutines, cells, contexts, futures) for most of a second, so
they survive a young collection and wait in the middle generation, and every tenth young
collection walked ten collections' worth of them: 16 ms at the median, 25 at most, about one
refusal in fifty waiting behind one. Now a young collection comes after 300 new objects instead
of 700 and each is followed by a middle one, which so walks one small collection's survivors
(0.2 ms at the median, 5.6 at most); the middle collections being some 17 times as many, a full
collection waits for 1 000 of them, about as often as before in time. Refusals' p99 at the
client under that flood: 16-18 ms before, 5.9 after, with answers handed back one a turn.

Each request also waited a turn of the event loop before the service saw it, twice: uvicorn
starts it in a new task, and BentoML's timeout middleware starts the rest of the app in another.
On Python 3.12+ new tasks run eagerly, up to their first real wait, so a request refused at the
door is answered in the turn that read it: under a 512-client flood of /embed, refusals left the
server within 4.1-4.3 ms at p99 instead of 5.7, and /classify's within 10.7 instead of 21, with the
same goodput (RELIABILITY.md). Python 3.11 keeps the two turns.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import platform
import sys
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)

# New tracked objects between two young collections (CPython's default: 700).
YOUNG_COLLECTION_AFTER = 300
# Young collections between two of the middle generation, beyond the first (CPython's default: 10).
MIDDLE_COLLECTION_AFTER = 0
# Collections of the middle generation between two full ones (CPython's default: 10).
FULL_COLLECTION_EVERY = 1000


def freeze_startup_heap() -> None:
    """Call once the service is loaded and warmed up, before it takes traffic."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_AFTER, MIDDLE_COLLECTION_AFTER, FULL_COLLECTION_EVERY)


def run_new_tasks_eagerly() -> bool:
    """Call on the serving loop before it takes traffic; False where Python has no eager tasks (3.11)."""
    eager = sys.version_info >= (3, 12)
    if eager:
        asyncio.get_running_loop().set_task_factory(eager_task)
    logger.info(
        "serving on Python %s, %s event loop, new tasks run %s",
        platform.python_version(),
        type(asyncio.get_running_loop()).__module__.split(".")[0],
        "eagerly" if eager else "a turn later",
    )
    return eager


def eager_task(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **options: Any) -> asyncio.Task:
    """asyncio.eager_task_factory, taking the `eager_start` that uvloop passes on Python 3.13 (which
    3.13's own factory refuses)."""
    options.pop("eager_start", None)
    return asyncio.Task(coro, loop=loop, eager_start=True, **options)
