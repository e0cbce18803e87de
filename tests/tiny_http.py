"""A tiny HTTP/1.1 server on a real socket, in a thread of its own, for testing load clients.

A POST body is a JSON object of directives: `status` (default 200), `sleep` (seconds before
answering), `close` (answer with `Connection: close`), `chunked` (a chunked answer),
`retry_after` (a Retry-After header's value), `server_timing` (a Server-Timing header's); the
answer echoes the body. A GET answers 200 with `# GET <path>` (a comment to a Prometheus parser).
The server counts connections and records every request, so tests can check keep-alive reuse
and which bodies were sent.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from loadtest.inputs import Payload


class TinyServer:
    def __init__(self) -> None:
        self.connections: dict[asyncio.Task, asyncio.StreamWriter] = {}
        self.requests: list[tuple[str, str, bytes]] = []  # method, path, body
        self.request_ids: list[str | None] = []  # each request's X-Request-ID, in the same order
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections[asyncio.current_task()] = writer  # type: ignore[index]
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, path, _ = head[0].split(" ")
                headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in head[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                self.requests.append((method, path, body))
                self.request_ids.append(headers.get("x-request-id"))
                directives = json.loads(body) if method == "POST" else {}
                await asyncio.sleep(directives.get("sleep", 0))
                reply = body if method == "POST" else f"# GET {path}\n".encode()
                writer.write(answer(reply, **directives))
                if directives.get("close"):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.close()

    @classmethod
    @contextmanager
    def running(cls) -> Iterator[TinyServer]:
        server, loop, started = cls(), asyncio.new_event_loop(), threading.Event()
        stop = asyncio.Event()

        async def serve() -> None:
            listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
            server.url = f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
            started.set()
            await stop.wait()
            listening.close()
            for writer in server.connections.values():
                writer.close()
            await asyncio.gather(*server.connections)

        thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
        thread.start()
        started.wait(10)
        try:
            yield server
        finally:
            loop.call_soon_threadsafe(stop.set)
            thread.join(10)
            loop.close()


def answer(
    body: bytes,
    *,
    status: int = 200,
    close: bool = False,
    chunked: bool = False,
    retry_after: str | None = None,
    server_timing: str | None = None,
    **_: object,
) -> bytes:
    head = f"HTTP/1.1 {status} Whatever\r\n" + ("Connection: close\r\n" if close else "")
    head += f"Retry-After: {retry_after}\r\n" if retry_after is not None else ""
    head += f"Server-Timing: {server_timing}\r\n" if server_timing is not None else ""
    if not chunked:
        return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
    half = len(body) // 2
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:half], body[half:]) if part)
    return f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + chunks + b"0\r\n\r\n"


def directives(**fields: object) -> Payload:
    """A request body of the directives above."""
    body = json.dumps(fields).encode()
    return Payload(body.decode(), body, "application/json")
