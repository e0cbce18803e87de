"""The door: overload refused before the app sees the request, and early retries held under a storm."""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractContextManager, nullcontext

import httpx
import numpy as np
import pytest

from serving.door import DISCARD_LIMIT_BYTES, MAX_HOLD_S, Door, EarlyRetries, client_of
from serving.errors import DeadlineUnmet, QueueFull, Refused
from serving.tracing import RequestTracing
from tests.test_batching import RecordingModel, make_batcher, sample, submit


class App:
    """The app behind the door: records what reached it."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        self.seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"served"})


def door_client(guard) -> tuple[httpx.AsyncClient, App]:
    app = App()
    door = Door(app, guards={"/classify": guard}, early_retries=None)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=door), base_url="http://door"), app


def full_queue(timeout_ms: float | None, request_id: str | None) -> Refused:
    return QueueFull("the test queue holds 64 rows, its limit is 64", retry_after_s=2.2)


def test_a_refused_request_never_reaches_the_app_and_gets_the_services_error_body() -> None:
    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response, list[str]]:
        client, app = door_client(full_queue)
        async with client:
            refused = await client.post("/classify", content=b"\xff\xd8 a photo")
            other_path = await client.post("/embed", json={"texts": ["hi"]})
            not_a_post = await client.get("/classify")
        return refused, other_path, not_a_post, app.seen

    refused, other_path, not_a_post, seen = asyncio.run(scenario())

    assert refused.status_code == 429
    assert refused.json() == {"error": "the test queue holds 64 rows, its limit is 64", "type": "queue_full"}
    assert refused.headers["retry-after"] == "3" and refused.headers["content-type"] == "application/json"
    assert other_path.text == not_a_post.text == "served"
    assert seen == ["/embed", "/classify"]


def test_a_refused_requests_connection_serves_on_unless_its_body_is_huge_or_of_unknown_length() -> None:
    async def chunks():
        yield b"x" * 1000

    async def scenario() -> tuple[httpx.Response, ...]:
        client, _ = door_client(full_queue)
        async with client:
            small = await client.post("/classify", content=b"x" * 300_000)
            huge = await client.post("/classify", content=b"x" * (DISCARD_LIMIT_BYTES + 300_000))
            chunked = await client.post("/classify", content=chunks())
            expecting = await client.post("/classify", content=b"x" * 300_000, headers={"Expect": "100-continue"})
        return small, huge, chunked, expecting

    small, huge, chunked, expecting = asyncio.run(scenario())

    assert small.status_code == huge.status_code == chunked.status_code == expecting.status_code == 429
    assert "connection" not in small.headers
    assert huge.headers["connection"] == chunked.headers["connection"] == "close"
    # Its client sends the body only once asked to: refused unread, it never comes.
    assert expecting.headers["connection"] == "close"


def test_the_guard_is_asked_with_the_clients_deadline_and_id_and_a_malformed_deadline_is_left_to_the_handler() -> None:
    asked: list[tuple[float | None, str | None]] = []

    def guard(timeout_ms: float | None, request_id: str | None) -> AbstractContextManager[None]:
        asked.append((timeout_ms, request_id))
        return nullcontext()

    async def scenario() -> list[str]:
        client, app = door_client(guard)
        async with client:
            for headers in ({"X-Deadline-Ms": "250", "X-Request-ID": "r-1"}, {}, {"X-Deadline-Ms": "soon"}):
                assert (await client.post("/classify", content=b"x", headers=headers)).text == "served"
        return app.seen

    assert asyncio.run(scenario()) == ["/classify"] * 3
    assert asked == [(250.0, "r-1"), (None, None), (None, None)]


def test_a_low_priority_request_takes_no_normal_place_at_the_door() -> None:
    """Its handler judges it against its own lane; a normal place held meanwhile shed the other
    low-priority requests as if normal ones waited."""
    asked: list[float | None] = []

    def guard(timeout_ms: float | None, request_id: str | None) -> AbstractContextManager[None]:
        asked.append(timeout_ms)
        return nullcontext()

    async def scenario() -> list[str]:
        client, app = door_client(guard)
        async with client:
            for path, headers in (
                ("/classify", {"X-Priority": "low"}),
                ("/classify?priority=low", {}),
                ("/classify?top_k=3&priority=%6Cow", {}),
                ("/classify", {}),
                ("/classify?priority=low", {"X-Priority": "normal"}),  # the header decides, as in the handler
                ("/classify?priority=low", {"X-Priority": "urgent"}),  # a 422 in the handler, placed as normal
            ):
                assert (await client.post(path, content=b"x", headers=headers)).text == "served"
        return app.seen

    assert asyncio.run(scenario()) == ["/classify"] * 6
    assert asked == [None, None, None], "only the normal requests were placed"


def test_a_connection_back_before_its_retry_after_is_held_until_then_and_one_that_waited_is_not() -> None:
    early = EarlyRetries()
    first, second = ("10.0.0.1", 5001), ("10.0.0.2", 5002)

    assert early.delay(first, 100.0, retry_after_s=1.0) == 0.0
    assert early.delay(first, 100.1, retry_after_s=1.0) == pytest.approx(0.8)  # its wait ends at 90 % of 1 s
    assert early.delay(second, 100.1, retry_after_s=1.0) == 0.0  # another connection is not held for it
    assert early.delay(first, 101.0 + 0.9, retry_after_s=1.0) == 0.0  # back when asked, after its held refusal


def test_a_request_id_names_the_client_on_any_connection_and_without_one_the_connection_does() -> None:
    """Behind a shared pool, two clients' requests take turns on one connection: told apart by
    their ids, neither is held for the other, and a retry keeping its id is held wherever it comes."""

    def request(port: int | None, request_id: bytes | None) -> dict:
        headers = [(b"content-type", b"image/jpeg")] + ([] if request_id is None else [(b"x-request-id", request_id)])
        return {"client": None if port is None else ("10.0.0.1", port), "headers": headers}

    assert client_of(request(5001, b"a")) == client_of(request(5002, b"a")) == ("id", "a")
    assert client_of(request(5001, None)) == client_of(request(5001, b"\x00 no id")) == ("connection", "10.0.0.1", 5001)
    assert client_of(request(None, None)) is None

    early = EarlyRetries()
    assert early.delay(client_of(request(5001, b"a")), 100.0, retry_after_s=1.0) == 0.0
    assert early.delay(client_of(request(5001, b"b")), 100.1, retry_after_s=1.0) == 0.0
    assert early.delay(client_of(request(5002, b"a")), 100.2, retry_after_s=1.0) == pytest.approx(0.7)


def test_many_connections_refused_together_are_all_answered_at_once() -> None:
    early = EarlyRetries()

    assert [early.delay(("10.0.0.1", port), 100.0, retry_after_s=1.0) for port in range(500)] == [0.0] * 500
    assert all(early.delay(("10.0.0.1", port), 101.0, retry_after_s=1.0) == 0.0 for port in range(500))


def test_a_refusal_is_held_no_longer_than_the_cap_and_an_unnamed_connection_never() -> None:
    early = EarlyRetries()
    early.delay(("10.0.0.1", 5001), 0.0, retry_after_s=600.0)

    assert early.delay(("10.0.0.1", 5001), 0.0, retry_after_s=600.0) == MAX_HOLD_S
    assert [early.delay(None, 0.0, retry_after_s=600.0) for _ in range(3)] == [0.0] * 3


def test_a_hammering_connection_waits_out_its_retry_after_while_a_new_one_is_answered_at_once() -> None:
    held: list[None] = []
    early = EarlyRetries(on_hold=lambda: held.append(None))
    soon = QueueFull("the test queue is full", retry_after_s=0.2)  # sent as Retry-After: 1

    async def scenario() -> tuple[list[float], float]:
        door = RequestTracing(Door(App(), guards={"/classify": lambda *_: soon}, early_retries=early), log=False)

        def connection(port: int) -> httpx.AsyncClient:
            transport = httpx.ASGITransport(app=door, client=("10.0.0.1", port))
            return httpx.AsyncClient(transport=transport, base_url="http://door")

        async def timed(client: httpx.AsyncClient) -> float:
            started = time.perf_counter()
            refused = await client.post("/classify", content=b"x")
            assert refused.status_code == 429
            timing.append(refused.headers["server-timing"])
            return time.perf_counter() - started

        async with connection(1) as hammering, connection(2) as fresh:
            hammered = [await timed(hammering) for _ in range(2)]
            return hammered, await timed(fresh)

    timing: list[str] = []
    hammered, fresh = asyncio.run(scenario())

    assert hammered[0] < 0.05 and hammered[1] >= 0.85, hammered  # Retry-After: 1, back at once: held ~0.9 s
    assert fresh < 0.05
    assert len(held) == 1
    assert [step.startswith("held;dur=") for step in timing] == [False, True, False], "Server-Timing says which"


def letting_in(early: EarlyRetries, path: str, per_second: float, until: float) -> None:
    """The door let requests to `path` through at `per_second` for the second before `until`."""
    for index in range(int(per_second)):
        early.let_in(path, until - 1 + index / per_second)


def test_a_refusal_asks_the_client_back_when_its_turn_can_come_behind_the_others_waiting() -> None:
    """300 clients wait out a refusal of /embed while the door lets 100 a second in: a new one's turn
    is 3 s away, whatever the queue's estimate; at /classify, where nobody waits, it is not."""
    early = EarlyRetries()
    letting_in(early, "/embed", 100, until=100.0)
    letting_in(early, "/classify", 100, until=100.0)
    for port in range(300):
        early.delay(("10.0.0.1", port), 100.0, retry_after_s=1.0, path="/embed")

    assert early.turn_in("/embed", ("10.0.0.2", 1), 100.0) == pytest.approx(3.0, rel=0.02)
    assert early.turn_in("/classify", ("10.0.0.2", 1), 100.0) == 0.0


def test_a_client_waiting_alone_is_not_asked_to_wait_for_itself_and_a_turn_is_capped() -> None:
    early = EarlyRetries()
    letting_in(early, "/embed", 100, until=50.0)
    early.delay(("10.0.0.1", 1), 50.0, retry_after_s=1.0, path="/embed")
    assert early.turn_in("/embed", ("10.0.0.1", 1), 50.5) == 0.0
    for port in range(2, 1002):
        early.delay(("10.0.0.1", port), 50.5, retry_after_s=1.0, path="/embed")
    assert early.turn_in("/embed", ("10.0.0.2", 1), 50.6) == MAX_HOLD_S  # 1 000 at 100 a second: 10 s


def test_no_turn_is_judged_from_a_rate_the_door_has_not_seen_lately() -> None:
    """A burst after a quiet spell, or deadlines so short that nobody is let in: the requests let
    in long ago say nothing of the rate now, and the queue's own estimate is the Retry-After."""
    early = EarlyRetries()
    letting_in(early, "/embed", 100, until=0.0)
    for port in range(300):
        early.delay(("10.0.0.1", port), 3600.0, retry_after_s=1.0, path="/embed")
    assert early.turn_in("/embed", ("10.0.0.2", 1), 3600.0) == 0.0


def test_the_door_sends_the_turn_as_retry_after_and_answers_a_new_client_at_once() -> None:
    early = EarlyRetries()
    now = time.monotonic()
    letting_in(early, "/classify", 50, until=now)
    for port in range(120):
        early.delay(("10.0.0.1", port), now, retry_after_s=1.0, path="/classify")
    soon = QueueFull("the test queue is full", retry_after_s=0.2)  # alone, sent as Retry-After: 1
    door = Door(App(), guards={"/classify": lambda *_: soon}, early_retries=early)

    async def refused() -> tuple[httpx.Response, float]:
        transport = httpx.ASGITransport(app=door, client=("10.0.0.2", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://door") as client:
            started = time.perf_counter()
            return await client.post("/classify", content=b"x"), time.perf_counter() - started

    answer, seconds = asyncio.run(refused())
    assert answer.status_code == 429 and seconds < 0.05
    assert answer.headers["retry-after"] == "3"  # 120 waiting, 50 let in a second: 2.4 s


def test_the_batchers_door_check_judges_the_queue_alone_and_counts_its_refusals() -> None:
    """One request of 0.1 s runs; a 120 ms deadline leaves no room for another, a 1 s one does."""
    batcher = make_batcher(RecordingModel(seconds_per_batch=0.1), endpoint="door-check", max_batch_size=1)

    async def scenario() -> tuple[object, ...]:
        await submit(batcher, np.ones((1, 1)))  # the batcher learns the engine's speed
        idle = batcher.place_at_door(120)
        running = asyncio.ensure_future(submit(batcher, np.ones((1, 1))))
        await asyncio.sleep(0.01)
        checks = batcher.place_at_door(120), batcher.place_at_door(1000), batcher.place_at_door(None)
        await running
        return idle, *checks

    idle, tight, loose, servers = asyncio.run(scenario())

    assert not any(isinstance(verdict, Refused) for verdict in (idle, loose, servers))
    assert isinstance(tight, DeadlineUnmet) and "within 120 ms" in tight.message
    assert sample("optiserve_refused_total", "door-check", reason="deadline") == 1


def test_the_batchers_door_check_refuses_when_the_queue_is_full() -> None:
    batcher = make_batcher(RecordingModel(seconds_per_batch=0.05), endpoint="door-full", max_queue_rows=2)

    async def scenario() -> object:
        with batcher.admit(2):
            return batcher.place_at_door()

    refusal = asyncio.run(scenario())

    assert isinstance(refusal, QueueFull) and refusal.status == 429
    assert refusal.to_json()["type"] == "queue_full"


def test_a_request_let_through_holds_its_place_so_the_queue_fills_at_the_door_not_in_its_handler() -> None:
    """Two requests let through together fill a two-row queue: a third is refused at the door, and
    the two are admitted in their handlers, where without their places all three would have been."""
    batcher = make_batcher(RecordingModel(seconds_per_batch=0.05), endpoint="door-place", max_queue_rows=2)
    first, second = batcher.place_at_door(), batcher.place_at_door()
    third = batcher.place_at_door()

    async def handler(place) -> np.ndarray:
        with place:
            return await submit(batcher, np.ones((1, 1)))

    async def scenario() -> list:
        return await asyncio.gather(handler(first), handler(second))

    assert isinstance(third, QueueFull)
    assert [answer.tolist() for answer in asyncio.run(scenario())] == [[[2.0]], [[2.0]]]
    assert not isinstance(batcher.place_at_door(), Refused), "both places were handed back"
    assert sample("optiserve_refused_total", "door-place", reason="queue_full") == 1


def test_a_place_its_handler_never_takes_is_handed_back_when_the_request_ends() -> None:
    """A request answered without the model (a 4xx, a cached answer) frees its place as it ends."""
    batcher = make_batcher(RecordingModel(), endpoint="door-unused", max_queue_rows=1)
    place = batcher.place_at_door()
    with place:
        assert isinstance(batcher.place_at_door(), QueueFull)
    assert not isinstance(batcher.place_at_door(), Refused)


def test_the_door_holds_a_place_while_the_app_serves_the_request() -> None:
    """Over HTTP through the door: the app, mid-request, finds the one-row queue taken by its own request."""
    batcher = make_batcher(RecordingModel(), endpoint="door-app", max_queue_rows=1)
    seen_inside: list[object] = []

    async def app(scope, receive, send) -> None:
        seen_inside.append(batcher.place_at_door())
        with batcher.admit(1) as admission:
            await batcher.run(np.ones((1, 1)), admission)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"served"})

    async def scenario() -> httpx.Response:
        door = Door(
            app, guards={"/classify": lambda deadline, request_id: batcher.place_at_door(deadline)}, early_retries=None
        )
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=door), base_url="http://door") as client:
            return await client.post("/classify", content=b"x")

    assert asyncio.run(scenario()).text == "served"
    assert isinstance(seen_inside[0], QueueFull)
    assert not isinstance(batcher.place_at_door(), Refused)
