"""Every response names its request and says where its time went: `X-Request-ID` and `Server-Timing`.

The id is the client's own `X-Request-ID` when it is sane (1–128 characters of letters, digits
and `._:-`, as load balancers and tracing proxies send them), else one generated here, so that a
client can quote any answer, an error or a refusal at the door included, in a report. The
timings are the steps a model request takes, in milliseconds, each summed over the request's
parts: `read` (its body arriving), `decode` (images) or `tokenize` (texts), `queue` (waiting for
an engine thread), `infer` (the batches it ran in, shared with the other requests in them), and
`total`, from the moment this middleware saw the request to its answer's first byte. Browsers'
developer tools and `curl -v` show them as they are; Server-Timing is the W3C header for it.

The steps are recorded through a context variable, so the code that times them needs no request
in hand: the batcher's engine thread adds `queue` and `infer` to the trace its caller submitted
with, before the caller's answer is handed back.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "X-Request-ID"
REQUEST_ID_KEY = REQUEST_ID_HEADER.lower().encode()
SERVER_TIMING_KEY = b"server-timing"
SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass
class RequestTrace:
    request_id: str
    started: float = field(default_factory=time.perf_counter)
    seconds: dict[str, float] = field(default_factory=dict)  # step → seconds, in the order first seen

    def add(self, step: str, seconds: float) -> None:
        self.seconds[step] = self.seconds.get(step, 0.0) + seconds

    def server_timing(self) -> str:
        total = time.perf_counter() - self.started
        steps = [*self.seconds.items(), ("total", total)]
        return ", ".join(f"{step};dur={1000 * seconds:.2f}" for step, seconds in steps)


CURRENT_TRACE: ContextVar[RequestTrace | None] = ContextVar("current_trace", default=None)


def current_trace() -> RequestTrace | None:
    return CURRENT_TRACE.get()


@contextmanager
def timed(step: str) -> Iterator[None]:
    """Adds the block's wall time to the current request's `step`; a no-op outside a request."""
    trace = CURRENT_TRACE.get()
    started = time.perf_counter()
    try:
        yield
    finally:
        if trace is not None:
            trace.add(step, time.perf_counter() - started)


def sane_request_id(value: str | None) -> str:
    """The client's id if it is one a log line and a header can carry as it is, else a new one."""
    if value is not None and SANE_REQUEST_ID.fullmatch(value):
        return value
    return uuid.uuid4().hex


class RequestTracing:
    """ASGI middleware: a trace per HTTP request, and its two headers on whatever answers it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((value for key, value in scope["headers"] if key == REQUEST_ID_KEY), None)
        trace = RequestTrace(sane_request_id(None if sent is None else sent.decode("latin-1")))
        token = CURRENT_TRACE.set(trace)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                ours = {REQUEST_ID_KEY, SERVER_TIMING_KEY}
                headers = [(key, value) for key, value in message.get("headers", []) if key.lower() not in ours]
                headers += [
                    (REQUEST_ID_KEY, trace.request_id.encode()),
                    (SERVER_TIMING_KEY, trace.server_timing().encode()),
                ]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            CURRENT_TRACE.reset(token)
