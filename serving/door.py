"""Overload refused at the door, and early retries held so that refusals cannot take the event loop.

Admission in the handler (serving/batching.py `admit`) protects the engine, but a request gets
there only after BentoML's middleware and Starlette's routing and, for /embed, its JSON. `Door`,
the first middleware after `serving/tracing.py`'s, answers a model endpoint's request at once when the
model's queue alone rules it out (full, or more work ahead than the deadline allows), before
the rest of the app sees it. A request it lets through holds a row's place in the queue from
then on, so that those let through after it count it, and is judged again, with its own size,
by `admit`.

Cheap refusals are not enough on their own. Clients that retry the instant they are refused
(wrk, or a naive retry loop) turn every refusal into another request, so the cheaper a refusal,
the more of them: measured with 256 such connections on /classify, 2 cores, refusing at the door
instead of in the handler raised refusals from 470 to 750 a second and cut goodput from 14 to
4 requests/s, because admitted requests waited behind hundreds of refusals for every step of
their body, decoding and answer. So a client that comes back before the `Retry-After` of its
last refusal, and is refused again, has that refusal held (`EarlyRetries`) until the time it
was asked to wait, costing nothing but a timer: a client that hammers gets one refusal per
`Retry-After`, and the requests that were let in keep the loop. A client that waits as asked, or
a new one, is answered at once however many arrive together.

Who is "the client": a request that carries an `X-Request-ID` is known by it, so a retry that
keeps its id (as tracing clients and SDKs' retries do) is the same client on any connection,
and another request on the same pooled connection is not. A request without one is known by its
TCP connection, which behind a pool or a proxy may be shared: then a patient client's refusal
may be held for another's haste, never longer than a `Retry-After`. Measured with 64 and 128
clients that honour Retry-After from one pool of connections (2 cores): known by connection,
1 672 and 3 452 of their refusals were held in a minute and the refusals' p99 was 0.9 s; known by
request id, none was (p99 0.25-0.4 s, set by admitted requests that expired in the queue;
RELIABILITY.md). A pacer of refusals
per second, the rule before both, could not tell patient clients from a storm and held them
1.4-1.8 s. `OPTISERVE_HOLD_EARLY_RETRIES=0` answers every refusal at once.

A refusal's Retry-After is also the client's turn: at least the other clients now waiting out a
refusal of the same endpoint over the requests the door lets in there per second (`turn_in`), where
the queue's own estimate (how late the request would be, or how long the queue takes to drain)
says less. The queue's estimate asks every refused client back within a second or two, whatever
their number, and under a flood of many more clients than the queue holds most of them are
refused again when they come: measured with 512 clients on /embed (2 cores), about 520 refusals a
second, each an HTTP request the event loop parses and answers while the engine waits for the
loop. Asked back when their turn can come, 190 a second, and goodput rose from 130 to 168 requests
a second (RELIABILITY.md). A turn is never counted longer than `MAX_HOLD_S`,
a client waiting alone is not asked to wait for itself, and none is judged from a rate the door
has not seen lately.

A path below /models/ that no served model answers gets its 404 here too, in our error schema and
naming the models' endpoints, where BentoML's would be a bare "Not Found".

Refusals answered at the door skip BentoML's API handler; they are counted in
`optiserve_refused_total` by reason, as every refusal is, and held ones also in
`optiserve_refusals_held_total`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Receive, Scope, Send

from serving.errors import InvalidInput, Refused
from serving.metrics import count_held_refusal
from serving.settings import hold_early_retries
from serving.tracing import REQUEST_ID_KEY, SANE_REQUEST_ID, timed

DEADLINE_HEADER = "X-Deadline-Ms"
DEADLINE_HEADER_KEY = DEADLINE_HEADER.lower().encode()
MAX_DEADLINE_MS = 600_000
# A refused request's body up to this size is left for the server to discard, so that its
# connection serves the next one; a larger one's connection is closed instead.
DISCARD_LIMIT_BYTES = 1024 * 1024
PRIORITY_HEADER = "X-Priority"  # `low` or `normal` (default); also the query parameter `priority`
PRIORITY_KEY = PRIORITY_HEADER.lower().encode()
PRIORITY_QUERY = "priority"
PRIORITIES = ("normal", "low")
# A refusal is never held longer than this, whatever Retry-After it follows.
MAX_HOLD_S = 5.0
# A connection back before this share of its last Retry-After came back early (clocks and timers differ).
EARLY_SHARE = 0.9
PRUNE_AT = 4096  # clients remembered before those whose Retry-After has ended are forgotten
LET_IN_WINDOW = 64  # requests let in remembered per endpoint: the rate at which the door lets them in
# The rate is judged from the requests let in over the last this many seconds, and from no fewer
# than LET_IN_LEAST: a window reaching into a quiet spell would understate what the queue takes.
LET_IN_HORIZON_S = 2 * MAX_HOLD_S
LET_IN_LEAST = 8
COUNT_EVERY_S = 0.1  # how often the clients waiting out a refusal are counted again
HELD_STEP = "held"  # the Server-Timing step of a refusal held for coming back early
MODELS_PREFIX = "/models/"  # each model's own endpoints (service.py); an unknown one is answered here

# A client as the door knows it: its request's id (`("id", value)`) or, without one, its TCP
# connection (`("connection", host, port)`, as ASGI's scope has it).
Client = tuple[Any, ...]

# The refusal a model endpoint's queue gives now, or the place it holds for the request while the
# app serves it (serving/batching.py `place_at_door`), for the client's deadline in milliseconds
# and the request's id (its side of a canary split), if it sent them.
Guard = Callable[[float | None, str | None], Refused | AbstractContextManager[None]]


class EarlyRetries:
    """When each client refused lately may be answered its next refusal at once, and when its turn
    can come (see above)."""

    def __init__(self, *, on_hold: Callable[[], None] | None = None) -> None:
        self.on_hold = on_hold
        self._due: dict[Client, tuple[float, str]] = {}  # client → when its Retry-After ends, and where
        self._let_in: defaultdict[str, deque[float]] = defaultdict(lambda: deque(maxlen=LET_IN_WINDOW))
        self._waiting: dict[str, int] = {}  # endpoint → clients waiting out a refusal, as last counted
        self._counted_at = -math.inf

    def let_in(self, path: str, now: float) -> None:
        """A request to `path` was let through the door at `now`."""
        self._let_in[path].append(now)

    def turn_in(self, path: str, client: Client | None, now: float) -> float:
        """Seconds until the turn of `client`, refused on `path` at `now`, can come: the other
        clients waiting out a refusal there over the requests let in per second, at most `MAX_HOLD_S`;
        none where too few were let in lately to tell the rate (a quiet spell, or hopeless deadlines)."""
        let_in = self._let_in[path]
        while let_in and let_in[0] < now - LET_IN_HORIZON_S:
            let_in.popleft()
        if len(let_in) < LET_IN_LEAST:
            return 0.0
        if now - self._counted_at >= COUNT_EVERY_S:
            self._waiting = {}
            for due, where in self._due.values():
                if due > now:
                    self._waiting[where] = self._waiting.get(where, 0) + 1
            self._counted_at = now
        itself = client in self._due and self._due[client][0] > now
        others = max(0, self._waiting.get(path, 0) - itself)
        return min(MAX_HOLD_S, others * max(now - let_in[0], 0.001) / len(let_in))

    def delay(self, client: Client | None, now: float, retry_after_s: float, path: str = "") -> float:
        """Seconds the refusal of `client` arriving at `now` on `path` is held; it then asks the
        client to wait `retry_after_s`. A client the server cannot name (None) is never held."""
        if client is None:
            return 0.0
        wait = min(MAX_HOLD_S, max(0.0, self._due.get(client, (0.0, path))[0] - now))
        self._due[client] = (now + wait + EARLY_SHARE * retry_after_s, path)
        if len(self._due) > PRUNE_AT:
            self._due = {key: due for key, due in self._due.items() if due[0] > now}
        return wait

    @classmethod
    def from_environment(cls) -> EarlyRetries | None:
        """Holding early retries, counted in the metrics; None where OPTISERVE_HOLD_EARLY_RETRIES=0."""
        return cls(on_hold=count_held_refusal) if hold_early_retries() else None

    async def hold(self, scope: Scope, refusal: Refused) -> None:
        """Waits as long as the refusal of the request in `scope` is held; its Server-Timing then
        has a `held` step, so that a client (and the overload bench) can tell a refusal held for
        coming back early from one that waited for a busy server. Its Retry-After is its turn's
        (`turn_in`) where the queue's own estimate asks for less."""
        now, client, path = time.monotonic(), client_of(scope), scope["path"]
        refusal.retry_after_s = max(refusal.retry_after_s, self.turn_in(path, client, now))
        wait = self.delay(client, now, float(refusal.headers["Retry-After"]), path)
        if wait > 0:
            if self.on_hold is not None:
                self.on_hold()
            with timed(HELD_STEP):
                await asyncio.sleep(wait)


class Door:
    """ASGI middleware refusing what a guarded path's model cannot answer in time (see above)."""

    def __init__(self, app: ASGIApp, *, guards: Mapping[str, Guard], early_retries: EarlyRetries | None) -> None:
        """`guards` may be filled after the app is built: the service's models load later. No
        `early_retries`: refusals are answered at once, however soon a client comes back."""
        self.app = app
        self.guards = guards
        self.early_retries = early_retries

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(MODELS_PREFIX) and scope["path"] not in self.guards:
            await answer_json(send, HTTPStatus.NOT_FOUND, self.no_such_model(scope["path"]), closing(scope))
            return
        guarded = scope["type"] == "http" and scope["method"] == "POST" and not low_priority(scope)
        guard = self.guards.get(scope["path"]) if guarded else None
        verdict = guard(*deadline_and_id(scope)) if guard is not None else nullcontext()
        if not isinstance(verdict, Refused):
            if guard is not None and self.early_retries is not None:
                self.early_retries.let_in(scope["path"], time.monotonic())
            with verdict:
                await self.app(scope, receive, send)
            return
        if self.early_retries is not None:
            await self.early_retries.hold(scope, verdict)
        await refuse(send, verdict, scope)

    def no_such_model(self, path: str) -> dict[str, str]:
        """The 404 for a path below /models/ that no served model answers, naming those that do."""
        served = ", ".join(sorted(p for p in self.guards if p.startswith(MODELS_PREFIX))) or "none"
        return {"error": f"no model endpoint at {path}; the models' endpoints: {served}", "type": "not_found"}


def client_of(scope: Scope) -> Client | None:
    """Who sent the request, as far as the door can tell (see above): an id the client sent that
    a log line could carry (serving/tracing.py), else its connection, if the server knows it."""
    sent = next((value for key, value in scope["headers"] if key == REQUEST_ID_KEY), None)
    if sent is not None and SANE_REQUEST_ID.fullmatch(request_id := sent.decode("latin-1")):
        return ("id", request_id)
    connection = scope.get("client")
    return None if connection is None else ("connection", *connection)


def low_priority(scope: Scope) -> bool:
    """A low-priority request is judged in its handler against its own lane: a place here is a
    normal request's, and low-priority ones were shed for each other's places ("normal requests
    wait") with no normal request about. Read as the handler reads it (`chosen_priority`); one it
    will refuse as malformed is placed as a normal one."""
    header = next((value.decode("latin-1") for key, value in scope["headers"] if key == PRIORITY_KEY), None)
    raw_query = scope.get("query_string", b"")  # parsed only where it may say so: this runs for every POST
    query = dict(parse_qsl(raw_query.decode("latin-1"), keep_blank_values=True)) if b"priority" in raw_query else {}
    try:
        return chosen_priority(header, query.get(PRIORITY_QUERY)) == "low"
    except InvalidInput:
        return False


def chosen_priority(header: str | None, query: str | None) -> str:
    """The request's priority: its header's, else its query's, else normal."""
    value = header if header is not None else query if query is not None else "normal"
    if value not in PRIORITIES:
        raise InvalidInput(f"{PRIORITY_HEADER} (or the query's priority) must be 'normal' or 'low', got {value!r}")
    return value


def deadline_and_id(scope: Scope) -> tuple[float | None, str | None]:
    """The client's deadline (None also when malformed: the handler answers that with 422) and
    the request's id, from the request's headers."""
    deadline = request_id = None
    for key, value in scope["headers"]:
        if key == DEADLINE_HEADER_KEY:
            deadline = value.decode("latin-1")
        elif key == REQUEST_ID_KEY:
            request_id = value.decode("latin-1")
    try:
        return parse_deadline_ms(deadline), request_id
    except InvalidInput:
        return None, request_id


def parse_deadline_ms(value: str | None) -> float | None:
    """The client's time budget for a request (its X-Deadline-Ms header's value), if it sent one."""
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_DEADLINE_MS:
        raise InvalidInput(f"{DEADLINE_HEADER} must be whole milliseconds from 1 to {MAX_DEADLINE_MS}, got {value!r}")
    return float(value)


def closing(scope: Scope) -> dict[str, str]:
    """The header that closes the connection after an answer sent from here, where the request's
    body is too large to be worth receiving, or of a length not declared (chunked), or will never
    come: a client that sent `Expect: 100-continue` (curl does for bodies over 1 MB) sends its body
    only when the server asks for it, which uvicorn does when the app first reads it; refused
    here, the body is never sent, and the connection cannot serve on (RFC 9110 §10.1.1).

    Answers from here go out before the body is read; the server (uvicorn) discards the rest as it
    arrives and the connection serves on. Reading it first, as the door once did, kept a refusal in
    the server until its body had arrived: under an image flood, 23–77 ms p99 with the bench's
    photos of up to 642 kB, against 0.3–0.8 ms answered first; with wrk at concurrency 1, 1 300
    refusals a second of a 642 kB PNG against 1 800–1 950 (RELIABILITY.md)."""
    headers = dict(scope["headers"])  # one pass; the HTTP parser refuses conflicting duplicates
    length = headers.get(b"content-length")
    too_large = b"transfer-encoding" in headers or (
        length is not None and (not length.isdigit() or int(length) > DISCARD_LIMIT_BYTES)
    )
    awaits_continue = headers.get(b"expect", b"").lower() == b"100-continue"
    return {"Connection": "close"} if too_large or awaits_continue else {}


async def refuse(send: Send, refusal: Refused, scope: Scope) -> None:
    """The refusal in the body and headers every refusal of the service has (serving/api.py), on
    a connection closed after it where the request's body calls for it (`closing`)."""
    await answer_json(send, refusal.status, refusal.to_json(), {**(refusal.headers or {}), **closing(scope)})


async def answer_json(send: Send, status: int, body: dict[str, str], headers: Mapping[str, str] | None = None) -> None:
    """An answer in our error schema, sent from here: the app behind never sees the request."""
    encoded = json.dumps(body).encode()
    head = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(encoded)).encode()),
        *((name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in (headers or {}).items()),
    ]
    await send({"type": "http.response.start", "status": int(status), "headers": head})
    await send({"type": "http.response.body", "body": encoded})
