"""One client beside a flood, in a process of its own: a refusal as a client apart from the flood sees it.

The flood's clients read their answers on one event loop that hundreds of them keep busy, so
their latencies carry that loop's lag too (2-3 ms at p99 with 512 of them; RELIABILITY.md).
This client sends one request every `EVERY_S` from its own process, on its own kept-alive
connection, each with an `X-Request-ID` of its own (so the door never holds it as an early
retry) and `X-Deadline-Ms: 1`, which a queue with any work ahead refuses on admission: what it
reads is the time a service under the flood takes to turn one more client away, as that client
sees it and as the server's Server-Timing says. Its requests are refusals the server counts
with the flood's (`sent` in the bench's JSON says how many).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import secrets
import time
from concurrent.futures import ProcessPoolExecutor

from loadtest.client import Pool
from loadtest.generator import Request, post_requests, send, with_request_id
from loadtest.inputs import Payload
from loadtest.stats import Outcome, Recorder

EVERY_S = 0.02
DEADLINE_MS = 1


async def probe(url: str, request: Request, seconds: float, every_s: float = EVERY_S) -> list[Outcome]:
    """`request` every `every_s` for `seconds`, one at a time, each under an id of its own."""
    pool, recorder, run = Pool(url, timeout=30), Recorder(), secrets.token_hex(4)
    ends, sent = time.perf_counter() + seconds, 0
    while (started := time.perf_counter()) < ends:
        await send(pool, with_request_id(request, f"lone-client-{run}-{sent}"), recorder, started)
        sent += 1
        await asyncio.sleep(max(0.0, every_s - (time.perf_counter() - started)))
    pool.close()
    return recorder.outcomes


def probe_in_this_process(url: str, request: Request, seconds: float) -> list[Outcome]:
    return asyncio.run(probe(url, request, seconds))


async def beside(url: str, payload: Payload, seconds: float) -> list[Outcome]:
    """`probe` of `payload` under `DEADLINE_MS`, in a fresh process (spawned: nothing of the
    flood's loop comes with it)."""
    (request,) = post_requests(url, [payload], {"X-Deadline-Ms": str(DEADLINE_MS)})
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as process:
        return await asyncio.get_running_loop().run_in_executor(process, probe_in_this_process, url, request, seconds)
