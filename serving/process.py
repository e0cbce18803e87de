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
door is answered in the turn that read it. In the container image (Debian's 3.13 against the same
bento on its 3.11), refusals beside a 512-client flood of /embed reached the client within 4.1-5.4
ms at p99 instead of 5.3-7.5, and beside a 256-client flood of /classify within 12.1-12.6 instead
of 18.6-19.6, at the same goodput (RELIABILITY.md). Python 3.11 keeps the two turns.

A flood also leaves memory behind: glibc keeps the pages that its buffers (bodies, decoded photos,
batches) freed inside its arenas, so an image worker stayed 220 MiB up after a 20 s flood of 256
clients. `malloc_trim` gives them back (90 of the 220 MiB), but it takes 9 ms and holds malloc's
locks, and a lower `MALLOC_TRIM_THRESHOLD_` instead cost a quarter of the flood's goodput; so the
worker trims once memory has grown since its last trim and its threads have gone quiet.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import platform
import resource
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# New tracked objects between two young collections (CPython's default: 700).
YOUNG_COLLECTION_AFTER = 300
# Young collections between two of the middle generation, beyond the first (CPython's default: 10).
MIDDLE_COLLECTION_AFTER = 0
# Collections of the middle generation between two full ones (CPython's default: 10).
FULL_COLLECTION_EVERY = 1000
# Memory grown since the last trim that is worth giving back, and how quiet the worker must be:
# its threads' CPU over the last sampling interval, as a share of one core.
TRIM_AFTER_GROWTH_MIB = 32.0
QUIET_CPU_SHARE = 0.1
TRIM_SAMPLE_S = 5.0
MIB = 2**20


def freeze_startup_heap() -> None:
    """Call once the service is loaded and warmed up, before it takes traffic."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_AFTER, MIDDLE_COLLECTION_AFTER, FULL_COLLECTION_EVERY)


def raise_open_files_limit() -> tuple[int, int] | None:
    """The soft limit on open files raised to the hard one (at most the kernel's `nr_open`), as Go's
    runtime does for every program; returns (before, after) where it moved.

    Each connection holds a file, including one whose client never finishes its headers: uvicorn
    has no timeout for a request's headers (its `timeout_keep_alive` runs only between requests)
    and BentoML lets no other HTTP protocol in. At the soft limit of 1 024 that containers get from
    containerd 2.x and Docker 29 (hard: 524 288), 1 100 such connections from one client left every
    other client unanswered, for good (RELIABILITY.md); containerd asks software that needs more
    to raise its own soft limit. The event loop is epoll's: the low limit is for select()."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard, int(Path("/proc/sys/fs/nr_open").read_text())) if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return None
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    logger.info("open files: the soft limit raised from %d to %d, the hard limit", soft, target)
    return soft, target


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


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim; None where the C library is another (musl, macOS)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


@dataclass
class QuietTrim:
    """When to give freed memory back: grown by TRIM_AFTER_GROWTH_MIB over the lowest resident
    memory since the last trim, with the worker quiet (never in the middle of a burst)."""

    settled_mib: float

    def due(self, rss_mib: float, cpu_share: float) -> bool:
        self.settled_mib = min(self.settled_mib, rss_mib)
        return rss_mib >= self.settled_mib + TRIM_AFTER_GROWTH_MIB and cpu_share <= QUIET_CPU_SHARE

    def trimmed(self, rss_mib: float) -> None:
        self.settled_mib = rss_mib


async def give_back_memory_when_quiet(every_s: float = TRIM_SAMPLE_S) -> None:
    """On the serving loop, until cancelled; the trim itself runs in a thread."""
    import psutil

    trim = malloc_trim()
    if trim is None:
        return
    process = psutil.Process()
    policy = QuietTrim(process.memory_info().rss / MIB)
    cpu, at = sum(process.cpu_times()[:2]), time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        cpu_now, now = sum(process.cpu_times()[:2]), time.monotonic()
        share, cpu, at = (cpu_now - cpu) / (now - at), cpu_now, now
        rss_mib = process.memory_info().rss / MIB
        if policy.due(rss_mib, share):
            await asyncio.to_thread(trim, 0)
            policy.trimmed(process.memory_info().rss / MIB)
            logger.info("gave back %.0f MiB freed under load", rss_mib - policy.settled_mib)
