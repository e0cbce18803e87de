"""The service's traffic timeout: a 504 for a request that runs past it, and no timer left behind
by one that does not."""

from __future__ import annotations

import asyncio
import gc

import bentoml
import httpx
import pytest
from bentoml._internal.server.http import traffic
from starlette.testclient import TestClient

from serving.timeouts import RequestTimeout, install


def pending_timers() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is asyncio.TimerHandle and not o.cancelled())


def answering_after(delay_s: float, *, then_body_after_s: float = 0.0):
    """An app that starts its answer after `delay_s`, and ends it `then_body_after_s` later."""

    async def app(scope, receive, send) -> None:
        await asyncio.sleep(delay_s)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await asyncio.sleep(then_body_after_s)
        await send({"type": "http.response.body", "body": b"answered"})

    return app


async def get(app, path: str = "/") -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://service") as client:
        return await client.get(path)


def test_a_request_not_answered_in_time_gets_504_in_the_services_error_schema() -> None:
    response = asyncio.run(get(RequestTimeout(answering_after(5.0), timeout=0.05)))

    assert response.status_code == 504
    assert response.json() == {"error": "not answered within the service's timeout of 0.05 s", "type": "timeout"}


def test_an_answer_that_has_begun_is_never_cut() -> None:
    response = asyncio.run(get(RequestTimeout(answering_after(0.0, then_body_after_s=0.2), timeout=0.05)))

    assert response.status_code == 200 and response.text == "answered"


def test_the_apps_own_timeout_error_is_not_taken_for_the_services() -> None:
    async def app(scope, receive, send) -> None:
        raise TimeoutError("the app's own")

    with pytest.raises(TimeoutError, match="the app's own"):
        asyncio.run(get(RequestTimeout(app, timeout=60)))


def test_answered_requests_leave_no_timer_behind_where_bentomls_middleware_leaves_one_each() -> None:
    async def scenario(middleware: type) -> int:
        app = middleware(answering_after(0.0), timeout=120)
        before = pending_timers()
        for _ in range(50):
            assert (await get(app)).status_code == 200
        return pending_timers() - before

    assert asyncio.run(scenario(RequestTimeout)) == 0
    # BentoML 1.4.40's own: the day it leaves none, `install` can go.
    assert asyncio.run(scenario(traffic.TimeoutMiddleware)) == 50


def test_the_app_runs_in_the_requests_own_task_where_bentomls_middleware_starts_another() -> None:
    """A task of its own starts a turn of the event loop later: under a flood, that turn is part of
    every refusal's wait."""

    async def runs_in_the_callers_task(middleware: type) -> bool:
        tasks: list[asyncio.Task | None] = []

        async def app(scope, receive, send) -> None:
            tasks.append(asyncio.current_task())
            await answering_after(0.0)(scope, receive, send)

        async def discard(message) -> None:
            pass

        await middleware(app, timeout=120)({"type": "http"}, None, discard)
        return tasks == [asyncio.current_task()]

    assert asyncio.run(runs_in_the_callers_task(RequestTimeout))
    assert not asyncio.run(runs_in_the_callers_task(traffic.TimeoutMiddleware))


@bentoml.service(traffic={"timeout": 0.2})
class Waiting:
    @bentoml.api
    async def wait(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "done"


def test_a_bentoml_service_built_after_install_answers_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traffic, "TimeoutMiddleware", traffic.TimeoutMiddleware)  # restored after the test
    install()
    app = Waiting.to_asgi()

    with TestClient(app) as client:
        quick = client.post("/wait", json={"seconds": 0.01})
        slow = client.post("/wait", json={"seconds": 1.0})

    assert RequestTimeout in [middleware.cls for middleware in app.user_middleware]
    assert quick.status_code == 200 and quick.text == "done"
    assert slow.status_code == 504 and slow.json()["type"] == "timeout"
