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
RELIABILITY.md). Young objects are collected as often as before.
"""

from __future__ import annotations

import gc

# Collections of the middle generation between two full ones (CPython's default: 10).
FULL_COLLECTION_EVERY = 100


def freeze_startup_heap() -> None:
    """Call once the service is loaded and warmed up, before it takes traffic."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)
