"""Load generation: closed-loop workers (fixed concurrency) and open-loop Poisson arrivals.

aiohttp rather than httpx: on a 2-core machine the client shares the CPUs with the server, and
aiohttp spends about half the CPU per request. Bodies are pre-built bytes (loadtest.inputs).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence

import aiohttp
import numpy as np

from loadtest.inputs import Payload
from loadtest.stats import Outcome, Recorder


async def send(session: aiohttp.ClientSession, url: str, payload: Payload, recorder: Recorder, since: float) -> None:
    """One request; latency runs from `since` (the send time, or the scheduled arrival in open loop)."""
    try:
        async with session.post(url, data=payload.body, headers={"content-type": payload.content_type}) as response:
            await response.read()
            status = str(response.status)
    except TimeoutError:
        status = "timeout"
    except aiohttp.ClientError as exc:
        status = type(exc).__name__
    finished = time.perf_counter()
    recorder.add(Outcome(finished=finished, latency=finished - since, status=status, rows=payload.rows))


async def closed_loop(
    session: aiohttp.ClientSession,
    url: str,
    payloads: Sequence[Payload],
    *,
    concurrency: int,
    stop: asyncio.Event,
    recorder: Recorder,
) -> None:
    """`concurrency` workers, each sending its next request as soon as the last one answered."""
    order = itertools.cycle(payloads)

    async def worker() -> None:
        while not stop.is_set():
            await send(session, url, next(order), recorder, time.perf_counter())

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def open_loop(
    session: aiohttp.ClientSession,
    url: str,
    payloads: Sequence[Payload],
    *,
    rate: float,
    stop: asyncio.Event,
    recorder: Recorder,
    max_outstanding: int,
    seed: int = 0,
) -> None:
    """Poisson arrivals at `rate`/s regardless of answers; latency counts from the scheduled
    arrival, so a late client or a slow server cannot hide queueing (no coordinated omission).
    Arrivals beyond `max_outstanding` in flight are recorded as 'client_backlog' failures."""
    rng = np.random.default_rng(seed)
    order = itertools.cycle(payloads)
    in_flight: set[asyncio.Task[None]] = set()
    arrival = time.perf_counter()
    while not stop.is_set():
        arrival += float(rng.exponential(1.0 / rate))
        delay = arrival - time.perf_counter()
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
                break
            except TimeoutError:
                pass
        if len(in_flight) >= max_outstanding:
            now = time.perf_counter()
            recorder.add(Outcome(finished=now, latency=now - arrival, status="client_backlog"))
            continue
        task = asyncio.create_task(send(session, url, next(order), recorder, arrival))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    if in_flight:
        await asyncio.wait(in_flight)
