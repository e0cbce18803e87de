"""The model endpoints answered by our own ASGI middleware, not by BentoML's API handler.

The endpoints are declared as BentoML APIs (service.py): the OpenAPI document, BentoML's
clients and the playground know them from there. But they read their own bodies and build
their own answers (serving/api.py), so all BentoML's handler adds per request is cost: Starlette's
routing, its context middleware, binding the API method, an input spec that reads nothing, and
an output serializer. Measured on 2 cores, /embed with one sentence per request: 790-840 req/s
at 32 connections against 625-633 through BentoML's handler, and 0.4 ms less at one connection
(BENCHMARKS.md). `DirectEndpoints`, the innermost of our middlewares, answers a POST to a served
model's path with the same function, the same status, body and headers, and passes everything
else on. BentoML's outer middleware (its HTTP metrics, OpenTelemetry spans, timeout) still sees
every request; only BentoML's own `Server` and `X-BentoML-Request-ID` headers are missing, the
request's id being in `X-Request-ID` (serving/tracing.py).

A request with an `Origin` header, a browser's cross-origin one, goes BentoML's way, where its
CORS settings (`http.cors`) apply.

Everything passed on that no route takes (Starlette's plain-text "Not Found" and "Method Not
Allowed") gets our JSON 404 or 405 instead, as a path below /models/ does at the door.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ORIGIN_KEY = b"origin"
CONTENT_TYPE_KEY = b"content-type"
ALLOW_KEY = b"allow"

# What answers a model endpoint's request, by path (filled once the service's models are loaded).
Handler = Callable[[Request], Awaitable[Response]]


class DirectEndpoints:
    """ASGI middleware answering the served models' paths itself (see above)."""

    def __init__(self, app: ASGIApp, *, handlers: Mapping[str, Handler]) -> None:
        self.app = app
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in self.handlers and scope["method"] not in ("POST", "OPTIONS"):
            await method_not_allowed(scope)(scope, receive, send)  # OPTIONS: a browser's preflight, BentoML's CORS
            return
        handler = self.handlers.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None or any(key == ORIGIN_KEY for key, _ in scope["headers"]):
            await self.app(scope, receive, json_router_errors(scope, send) if scope["type"] == "http" else send)
            return
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)


def json_router_errors(scope: Scope, send: Send) -> Send:
    """`send`, with Starlette's plain-text 404 and 405 (a path, or a method, no route takes) replaced
    by our JSON errors; BentoML's own JSON errors (a task id it does not know) go out as they are."""
    replaced: dict[bytes, bytes] | None = None  # the plain-text answer's headers, once it has begun

    async def send_json(message: Message) -> None:
        nonlocal replaced
        if message["type"] == "http.response.start" and message["status"] in (404, 405):
            headers = dict(message.get("headers", []))
            replaced = headers if headers.get(CONTENT_TYPE_KEY, b"").startswith(b"text/plain") else None
        if replaced is None:
            await send(message)
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            allow = replaced.get(ALLOW_KEY)  # Starlette's, from a set: its order changes between processes
            methods = None if allow is None else ", ".join(sorted(allow.decode("latin-1").split(", ")))
            answer = not_found(scope) if methods is None else method_not_allowed(scope, methods)
            await send({"type": "http.response.start", "status": answer.status_code, "headers": answer.raw_headers})
            await send({"type": "http.response.body", "body": answer.body})

    return send_json


def not_found(scope: Scope) -> Response:
    body = {"error": f"no endpoint at {scope['path']}; the API is described at /docs.json", "type": "not_found"}
    return JSONResponse(body, status_code=404)


def method_not_allowed(scope: Scope, allow: str = "POST") -> Response:
    """Our JSON error, where Starlette's router would answer a plain-text 405."""
    body = {"error": f"{scope['method']} {scope['path']}: the endpoint takes {allow}", "type": "method_not_allowed"}
    return JSONResponse(body, status_code=405, headers={"Allow": allow})
