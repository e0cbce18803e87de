"""BentoML's task routes of the bulk endpoint, guarded where BentoML would do harm.

BentoML's `submit` reads and stores the whole body before any code of ours runs, however large:
a 67 MB body was accepted (200, its 413 only at `get`), and a 2.2 GB chunked one was read whole,
left the worker at 5.8 GB and answered 500. Its `cancel` marks the task canceled and answers 400
"not supported" while the task runs on to `completed`, so a client's status loop ends on a task
that has not. `BulkTaskGuard` reads a submit's body itself, no further than the bulk limit (413
at once, declared or chunked; 408 if it trickles), and hands it on whole; and answers a cancel
with BentoML's own 400 without touching the task.
"""

from __future__ import annotations

from collections.abc import Collection
from http import HTTPStatus

from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.api import read_within
from serving.door import answer_json, closing
from serving.errors import RequestError

CANCEL_UNSUPPORTED = {"error": "task cancellation is not supported by the local server"}


class BulkTaskGuard:
    """ASGI middleware in front of the bulk endpoints' `submit` and `cancel` routes (see above)."""

    def __init__(self, app: ASGIApp, *, routes: Collection[str], limit: int) -> None:
        self.app = app
        self.submits = {f"{route}/submit" for route in routes}
        self.cancels = {f"{route}/cancel" for route in routes}
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.submits | self.cancels:
            return await self.app(scope, receive, send)
        if scope["path"] in self.cancels:
            return await answer_json(send, HTTPStatus.BAD_REQUEST, CANCEL_UNSUPPORTED, closing(scope))
        try:
            body = await read_within(Request(scope, receive), self.limit)
        except RequestError as error:
            return await answer_json(send, error.status, error.to_json(), closing(scope))
        except ClientDisconnect:  # gone before its body had arrived: nothing to submit, no one to answer
            return
        await self.app(scope, replaying(body, receive), send)


def replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` for the app behind: the body read already, in one message, then the connection's own."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
