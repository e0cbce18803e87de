"""The service's traffic timeout, run inside the request's own task, with a timer that ends with it.

BentoML 1.4.40 answers 504 to a request not answered within the service's `traffic.timeout`
through its `TimeoutMiddleware`, which costs every request twice:
- it runs the rest of the app, our door included, in a task of its own (`ensure_future`), which
  starts a turn of the event loop later. Under a flood that turn shows in every refusal: by
  tcpdump on the loopback, the server's time from a refused request to its answer at p50 / p90 /
  p99 went from 1.0-1.4 / 2.6-3.5 / 5.0-10.3 ms to 0.8-0.9 / 1.7-2.1 / 5.3-6.8 (/embed, 512
  clients) and from 0.9-1.4 / 6.4-8.9 / 14.7-17.9 to 1.0-1.1 / 5.9-6.7 / 11.9-12.9 (/classify,
  256), in alternated rounds (RELIABILITY.md);
- it schedules `loop.call_later(timeout, ...)` and never cancels it, so each answered request
  leaves a timer, a future, a context and a bound method alive until its timeout would have
  passed (46 s here; at 120 s the worker's memory rose from flood to flood and CPython's full
  collections walked those objects; RELIABILITY.md).

`RequestTimeout` keeps the behaviour (a 504 once the timeout passes before the answer has begun;
an answer that has begun, a stream, is never cut) with `asyncio.timeout` in the request's task,
whose timer is cancelled when the request ends, and the 504 in our error schema. `install` puts it
in BentoML's place under the name BentoML's app builder looks up: a private name of the BentoML
release that pyproject.toml pins, so tests/test_timeouts.py fails on the release that moves it or
mends the original.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.door import answer_json


class RequestTimeout:
    """ASGI middleware: 504 for an HTTP request not answered within `timeout` seconds."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = asyncio.timeout(self.timeout)
        answering = False

        async def answer(message: Message) -> None:
            nonlocal answering
            if not answering:
                answering = True
                limit.reschedule(None)
            await send(message)

        try:
            async with limit:
                await self.app(scope, receive, answer)
        except TimeoutError:
            if answering or not limit.expired():
                raise  # the app's own TimeoutError, not the service's timeout
            body = {"error": f"not answered within the service's timeout of {self.timeout:g} s", "type": "timeout"}
            await answer_json(send, HTTPStatus.GATEWAY_TIMEOUT, body)


def install() -> None:
    """Serve every BentoML app built in this process with `RequestTimeout` in place of BentoML's
    `TimeoutMiddleware` (see above). Call before the service's app is built."""
    from bentoml._internal.server.http import traffic

    traffic.TimeoutMiddleware = RequestTimeout  # type: ignore[misc]
