"""Every response names its request and says where its time went: `X-Request-ID`, `Server-Timing`
and a JSON line in the access log.

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

The access log (logger `optiserve.access`, on stderr) has one JSON object per request, for log
pipelines to parse instead of scraping text: its time, id, method, path, status, the model that
answered (`X-Model-Tag`), the same timings in milliseconds, and the trace id (BentoML's
OpenTelemetry span's, or the caller's `traceparent` one while no exporter is configured), so that
a line and an exported trace can be joined. It
replaces BentoML's own access line, which says less in a format of its own.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from opentelemetry import trace as otel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.log_output import in_background
from serving.settings import access_log_enabled

REQUEST_ID_HEADER = "X-Request-ID"
REQUEST_ID_KEY = REQUEST_ID_HEADER.lower().encode()
SERVER_TIMING_KEY = b"server-timing"
OUR_KEYS = frozenset({REQUEST_ID_KEY, SERVER_TIMING_KEY})  # replaced on every answer
MODEL_TAG_KEY = b"x-model-tag"
SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
TRACEPARENT_KEY = b"traceparent"
W3C_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")
EVERY_URL = ".*"  # an OpenTelemetry excluded-URL pattern, searched in each request's URL
ACCESS_LOGGER = "optiserve.access"


@dataclass
class RequestTrace:
    request_id: str
    started: float = field(default_factory=time.perf_counter)  # its arrival: deadlines count from it too
    seconds: dict[str, float] = field(default_factory=dict)  # step → seconds, in the order first seen

    def add(self, step: str, seconds: float) -> None:
        self.seconds[step] = self.seconds.get(step, 0.0) + seconds

    def milliseconds(self) -> dict[str, float]:
        """Each step, and the total so far."""
        steps = {**self.seconds, "total": time.perf_counter() - self.started}
        return {step: round(1000 * seconds, 2) for step, seconds in steps.items()}

    def server_timing(self) -> str:
        return ", ".join(f"{step};dur={ms:.2f}" for step, ms in self.milliseconds().items())


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


def access_logger() -> logging.Logger:
    """`optiserve.access`, writing bare JSON lines to stderr whatever format the root logger has,
    from the log output's thread (serving/log_output.py)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(in_background(handler))
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def trace_id(scope: Scope) -> str | None:
    """The request's trace id: its OpenTelemetry span's, else its caller's W3C `traceparent` one.

    BentoML opens no span while no exporter is configured (`bentoml_tracing`), and the caller's
    id still joins this line to the caller's own trace.
    """
    context = otel.get_current_span().get_span_context()
    if context.is_valid:
        return otel.format_trace_id(context.trace_id)
    sent = next((value for key, value in scope["headers"] if key == TRACEPARENT_KEY), b"")
    parent = W3C_TRACEPARENT.fullmatch(sent.decode("latin-1").strip())
    return parent[1] if parent and parent[1] != "0" * 32 else None


def bentoml_tracing(service: str) -> dict[str, Any]:
    """Tracing defaults for `service`: with no exporter configured, BentoML's middleware opens no
    span at all.

    BentoML opens a span per request with tracing off too, and discards it; on 2 cores that halved
    /livez's throughput and put stalls of tens of ms into the p99. A configured exporter keeps its
    spans; an `excluded_urls` of the user's own overrides this default.
    """
    return {} if exporter_configured(service) else {"excluded_urls": [EVERY_URL]}


def exporter_configured(service: str) -> bool:
    """Whether BentoML's documented configuration inputs, the `BENTOML_CONFIG` file and the
    `BENTOML_CONFIG_OPTIONS` overrides, name a tracing exporter, BentoML's own or `service`'s."""
    keys = {"tracing.exporter_type", f"services.{service}.tracing.exporter_type"}
    options = dict(option.partition("=")[::2] for option in shlex.split(os.environ.get("BENTOML_CONFIG_OPTIONS", "")))
    if any(options.get(key, "").lower() not in {"", "none", "null"} for key in keys):
        return True
    path = os.environ.get("BENTOML_CONFIG")
    config = (yaml.safe_load(Path(path).read_text()) or {}) if path else {}
    for key in keys:
        value: Any = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value:
            return True
    return False


@dataclass
class Answered:
    """What the request was answered with, as its response's start said."""

    status: int | None = None  # None: the connection ended before an answer
    model: str | None = None  # X-Model-Tag, for a model's answer


def access_line(trace: RequestTrace, scope: Scope, answered: Answered, otel_trace: str | None) -> str:
    entry = {
        "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "request_id": trace.request_id,
        "method": scope["method"],
        "path": scope["path"],
        "status": answered.status,
        "model": answered.model,
        "ms": trace.milliseconds(),
        "trace_id": otel_trace,
    }
    return json.dumps(entry, separators=(",", ":"))


class RequestTracing:
    """ASGI middleware: a trace per HTTP request, its two headers on whatever answers it, and its
    access log line."""

    def __init__(self, app: ASGIApp, *, log: bool | None = None) -> None:
        """`log`: write the access log (default: unless OPTISERVE_ACCESS_LOG=0)."""
        self.app = app
        self.logger = access_logger() if (access_log_enabled() if log is None else log) else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((value for key, value in scope["headers"] if key == REQUEST_ID_KEY), None)
        trace = RequestTrace(sane_request_id(None if sent is None else sent.decode("latin-1")))
        token = CURRENT_TRACE.set(trace)
        answered = Answered()

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(key, value) for key, value in message.get("headers", []) if key.lower() not in OUR_KEYS]
                headers += [
                    (REQUEST_ID_KEY, trace.request_id.encode()),
                    (SERVER_TIMING_KEY, trace.server_timing().encode()),
                ]
                message = {**message, "headers": headers}
                model = next((value for key, value in headers if key.lower() == MODEL_TAG_KEY), None)
                answered.status, answered.model = message["status"], None if model is None else model.decode("latin-1")
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            CURRENT_TRACE.reset(token)
            if self.logger is not None:
                self.logger.info(access_line(trace, scope, answered, trace_id(scope)))
