"""The service's traffic timeout, with a timer that ends with its request.

BentoML 1.4 answers 504 to a request not answered within the service's `traffic.timeout` through
its `TimeoutMiddleware`, which schedules `loop.call_later(timeout, ...)` for every request and
never cancels it. So each answered request leaves a timer, a future, a context and a bound method
alive until its timeout would have passed: at our 120 s, every request of the last two minutes.
Measured with wrk on /embed (512 connections, four 20 s floods, 2 vCPUs), the front worker's
resident memory grew 474 → 590 → 624 → 646 → 670 MiB, by 19 000-29 000 of each of those objects
every 15 s; the objects also swell the heap that CPython's full collections walk (see
serving/process.py), and each request paid for a second task besides its own.

`RequestTimeout` keeps the behaviour (a 504 once the timeout passes before the answer has begun;
an answer that has begun, a stream, is never cut) with `asyncio.timeout`, whose timer is
cancelled when the request ends, in the request's own task, and the 504 in our error schema.
`install` puts it in BentoML's place, under the name BentoML's app builder looks up.
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
                if not limit.expired():  # else the app answers as it is cancelled: let it
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
