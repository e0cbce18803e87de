"""A minimal keep-alive HTTP/1.1 client: pre-built request bytes out, status and body back.

Why not aiohttp: on a 2-core machine the generator shares the CPUs with the server, and an
aiohttp client saturated first (271 req/s on /embed where wrk measured 548). This one does
only what a load test needs: one request at a time per connection, a request that is one
`write` of bytes built before the load, and httptools' C parser for the response (no header
objects). Run it on uvloop (`uvloop.run`), the loop uvicorn serves with.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import time
from collections.abc import Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

import httptools

# An idle connection is reused only this long: uvicorn closes one idle for 5 s (its
# timeout_keep_alive), and a request written as it does so is answered with a reset (seen under a
# flood of clients waiting out a Retry-After), an error of the load tester's, not the server's.
KEEPALIVE_S = 4.0
# A request whose head asks `Expect: 100-continue` (curl's way with bodies over 1 MB) sends its body
# once the server answers 100, or after this long without an answer, as curl does. Header names
# are case-insensitive: the head is matched lower-cased.
EXPECT_CONTINUE = b"\r\nexpect: 100-continue\r\n"
EXPECT_WAIT_S = 1.0
# The Server-Timing step of a refusal the server held because its client came back before its
# last Retry-After (optiserve's door): such a refusal is slow by design, not for want of capacity.
HELD_TIMING = re.compile(rb"(?:^|,)\s*held;")
# The server's own time for the request, from its first middleware to the answer (optiserve's `total`).
TOTAL_TIMING = re.compile(rb"(?:^|,)\s*total;dur=([0-9.]+)")


class Response(NamedTuple):
    status: int
    body: bytes
    retry_after: str | None = None  # the one header a load test acts on: when a refused client may return
    server_timing: bytes = b""  # read only when asked: the server's own time and whether it held a refusal

    @property
    def held(self) -> bool:
        """The server held it before answering (a `held` step in its Server-Timing)."""
        return HELD_TIMING.search(self.server_timing) is not None

    @property
    def server_ms(self) -> float | None:
        """The server's own milliseconds for it, where its Server-Timing says (a `total` step)."""
        total = TOTAL_TIMING.search(self.server_timing)
        return float(total[1]) if total else None

    @property
    def error_type(self) -> str | None:
        """The `type` of an error body in optiserve's schema (`{"error": ..., "type": ...}`), if it is one."""
        try:
            body = json.loads(self.body)
        except ValueError:
            return None
        kind = body.get("type") if isinstance(body, dict) else None
        return kind if isinstance(kind, str) else None


class ServerDisconnected(ConnectionError):
    """The server closed the connection before the whole response arrived."""


def request_bytes(
    url: str,
    method: str = "GET",
    body: bytes = b"",
    content_type: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> bytes:
    """The whole request as it goes on the wire, built once and replayed."""
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    head = f"{method} {target} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    if body or method != "GET":
        head += f"Content-Length: {len(body)}\r\n"
    return (head + "\r\n").encode("latin-1") + body


class Connection(asyncio.Protocol):
    """One connection, one request in flight; reusable while the server keeps it alive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[Response] | None = None
        self.body: list[bytes] = []
        self.retry_after: str | None = None
        self.server_timing = b""
        self.unsent_body: bytes | None = None  # held for the server's 100 Continue
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc or ServerDisconnected("connection closed before the response ended"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 11 and name.lower() == b"retry-after":
            self.retry_after = value.decode("latin-1")
        elif len(name) == 13 and name.lower() == b"server-timing":
            self.server_timing = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.parser.get_status_code() == 100:  # interim: the server asks for the body
            self.send_body()
            return
        if self.unsent_body is not None or not self.parser.should_keep_alive():
            self.close()  # a body never sent leaves the connection unusable
        if self.waiter is not None and not self.waiter.done():
            status = self.parser.get_status_code()
            response = Response(status, b"".join(self.body), self.retry_after, self.server_timing)
            self.waiter.set_result(response)

    def send_body(self) -> None:
        if self.unsent_body is not None and self.transport is not None and not self.closed:
            self.transport.write(self.unsent_body)
        self.unsent_body = None

    def fail(self, exc: BaseException) -> None:
        """Give up on the connection: a response that may still come would answer the next request."""
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def request(self, data: bytes, timeout: float) -> Response:
        """Send `data`, wait for the whole response; raises TimeoutError after `timeout` seconds."""
        if self.transport is None:
            raise RuntimeError("request on a connection that was never made: open it with connect()")
        loop = asyncio.get_running_loop()
        self.waiter, self.body, self.retry_after, self.server_timing = loop.create_future(), [], None, b""
        timer = loop.call_later(timeout, self.fail, TimeoutError())
        head_end = data.find(b"\r\n\r\n") + 4
        expects = EXPECT_CONTINUE in data[:head_end].lower()
        self.unsent_body = data[head_end:] if expects else None
        if expects:
            data = data[:head_end]
        patience = loop.call_later(EXPECT_WAIT_S, self.send_body) if expects else None
        self.transport.write(data)
        try:
            return await self.waiter
        except BaseException as exc:  # cancelled or failed: the connection is not reusable
            self.fail(exc)
            raise
        finally:
            timer.cancel()
            if patience is not None:
                patience.cancel()
            self.waiter = None


def origin(url: str) -> tuple[str, int, bool]:
    """Host, port and whether it is https; ValueError for anything but an http(s) URL with a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http(s)://host[:port]/path URL, got {url!r}")
    secure = parts.scheme == "https"
    return parts.hostname, parts.port or (443 if secure else 80), secure


async def connect(url: str, timeout: float) -> Connection:
    host, port, secure = origin(url)
    context = ssl.create_default_context() if secure else None
    connecting = asyncio.get_running_loop().create_connection(Connection, host, port, ssl=context)
    _, connection = await asyncio.wait_for(connecting, timeout=timeout)
    return connection


class Pool:
    """Keep-alive connections to the origin of `url`, as many as requests in flight; the most
    recently used idle one goes first, so a lull lets the others time out, not the busy ones."""

    def __init__(self, url: str, timeout: float, keepalive_s: float = KEEPALIVE_S) -> None:
        self.url, self.timeout, self.keepalive_s = url, timeout, keepalive_s
        self.idle: list[tuple[float, Connection]] = []  # (when it was last used, it), oldest first

    async def request(self, data: bytes) -> Response:
        connection = self._reusable() or await connect(self.url, self.timeout)
        response = await connection.request(data, self.timeout)
        if not connection.closed:
            self.idle.append((time.monotonic(), connection))
        return response

    def _reusable(self) -> Connection | None:
        """The most recently used idle connection that is open and not about to be closed by the
        server (KEEPALIVE_S); the others, all older, are closed on the way."""
        now = time.monotonic()
        while self.idle:
            used, connection = self.idle.pop()
            if not connection.closed and now - used < self.keepalive_s:
                return connection
            connection.close()
        return None

    def close(self) -> None:
        for _, connection in self.idle:
            connection.close()
        self.idle.clear()


async def fetch(url: str, timeout: float) -> Response:
    """One GET on a connection of its own (the /metrics scrape)."""
    connection = await connect(url, timeout)
    try:
        return await connection.request(request_bytes(url), timeout)
    finally:
        connection.close()
