"""BentoML's HTTP request metrics, labelled by the service's own paths, and the /metrics page.

BentoML's middleware labels every request with its raw path. Each path a scanner tries (404)
became some twenty series: 5 000 of them, sent in 7 s, grew the worker by 108 MiB and the
multi-process files by 30 MB, and /metrics to 19.5 MB and 3.8 s a scrape, without bound
(RELIABILITY.md). The service turns BentoML's off (`metrics.enabled: false`, which also removes
its /metrics route) and `HttpTraffic`, the middleware right after the tracing one (so that it
counts the door's refusals too), records the same four series under BentoML's names and labels,
so that dashboards, alerts and the autoscaler read them as before:

- `bentoml_service_request_total{endpoint, service_name, service_version, http_response_code, runner_name}`
- `bentoml_service_request_duration_seconds{...}`, with BentoML's default buckets
- `bentoml_service_request_in_progress{endpoint, service_name, service_version, runner_name}` (summed
  over the workers)
- `bentoml_service_last_request_timestamp_seconds{service_name, service_version, runner_name}`

`endpoint` is the request's path where it is one of the service's (its APIs, their task routes,
BentoML's system endpoints), and `other` for any other: the series are as many as the paths the
service has. It answers GET /metrics itself, every worker's series aggregated in a thread.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

NAMESPACE = "bentoml_service"  # BentoML's default `metrics.namespace`
METRICS_PATH = "/metrics"
OTHER = "other"
# BentoML 1.4's default duration buckets (as its own middleware exported them): an API call of
# milliseconds to an LLM's minutes.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 180.0)
# BentoML's own endpoints (its HTTP server, 1.4), besides the APIs.
SYSTEM_PATHS = frozenset({"/", "/docs", "/docs.json", "/schema.json", "/livez", "/readyz", "/healthz", METRICS_PATH})
TASK_OPERATIONS = ("submit", "status", "get", "retry", "cancel")  # a task API's routes under its own


@dataclass(frozen=True)
class Instruments:
    total: Any
    duration: Any
    in_progress: Any
    last_request: Any


@cache
def instruments() -> Instruments:
    """Registered once per process on first use: after BentoML set PROMETHEUS_MULTIPROC_DIR."""
    from prometheus_client import Counter, Gauge, Histogram

    answered = ("endpoint", "service_name", "service_version", "http_response_code", "runner_name")
    return Instruments(
        total=Counter("request", "Total number of HTTP requests", answered, namespace=NAMESPACE),
        duration=Histogram(
            "request_duration_seconds",
            "HTTP request duration in seconds",
            answered,
            namespace=NAMESPACE,
            buckets=DURATION_BUCKETS,
        ),
        in_progress=Gauge(
            "request_in_progress",
            "HTTP requests in progress",
            ("endpoint", "service_name", "service_version", "runner_name"),
            namespace=NAMESPACE,
            multiprocess_mode="livesum",
        ),
        last_request=Gauge(
            "last_request_timestamp_seconds",
            "Time of the last HTTP request",
            ("service_name", "service_version", "runner_name"),
            namespace=NAMESPACE,
            multiprocess_mode="max",
        ),
    )


def service_paths(apis: Iterable[Any]) -> frozenset[str]:
    """Every path the service answers: its APIs' routes (a `bentoml` service's `apis` values), the
    routes of its task APIs, and BentoML's system endpoints."""
    apis = list(apis)
    routes = {api.route for api in apis}
    tasks = {f"{api.route}/{operation}" for api in apis if api.is_task for operation in TASK_OPERATIONS}
    return frozenset(routes | tasks | SYSTEM_PATHS)


def metrics_page() -> bytes:
    """The Prometheus text page: every worker's series where BentoML runs several processes."""
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return generate_latest(REGISTRY)
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return generate_latest(registry)


class _Series:
    """Each label set's series, looked up once: prometheus_client's `labels()` costs 2.6 µs against
    0.8 for the update itself, four times a request on the event loop. As many as the service has
    paths (and statuses)."""

    def __init__(self, found: Instruments, labels: dict[str, str], routes: Iterable[str]) -> None:
        self.found, self.labels = found, labels
        self.last_request = found.last_request.labels(**labels)
        self._in_progress: dict[str, Any] = {}
        self._answered: dict[tuple[str, int], tuple[Any, Any]] = {}
        # 0 for each API's 200 and 500 from the start, as BentoML does: `rate()` over a series
        # that appears only with its first request reads 0 for that request.
        for route in routes:
            for status in ("200", "500"):
                found.total.labels(endpoint=route, http_response_code=status, **labels)

    def in_progress(self, endpoint: str) -> Any:
        if endpoint not in self._in_progress:
            self._in_progress[endpoint] = self.found.in_progress.labels(endpoint=endpoint, **self.labels)
        return self._in_progress[endpoint]

    def answered(self, endpoint: str, status: int) -> tuple[Any, Any]:
        """The request counter's and the duration histogram's series of one endpoint and status."""
        key = (endpoint, status)
        if key not in self._answered:
            labels = {"endpoint": endpoint, "http_response_code": str(status), **self.labels}
            self._answered[key] = (self.found.total.labels(**labels), self.found.duration.labels(**labels))
        return self._answered[key]


class HttpTraffic:
    """ASGI middleware: BentoML's HTTP series with bounded labels, and GET /metrics (see above)."""

    def __init__(self, app: ASGIApp, *, paths: Collection[str]) -> None:
        self.app = app
        self.paths = frozenset(paths)
        self._series: _Series | None = None

    def _service_series(self) -> _Series:
        """The series, for the labels naming the service, read from BentoML's server context once
        the worker runs."""
        if self._series is None:
            import bentoml

            context = bentoml.server_context
            labels = {
                "service_name": context.bento_name,
                "service_version": context.bento_version,
                "runner_name": context.service_name,
            }
            self._series = _Series(instruments(), labels, context.service_routes)
        return self._series

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] == METRICS_PATH and scope["method"] in ("GET", "HEAD"):
            return await self._answer_metrics(scope, send)
        series = self._service_series()
        endpoint = scope["path"] if scope["path"] in self.paths else OTHER
        series.last_request.set(time.time())
        started = time.perf_counter()
        status = 0

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                total, duration = series.answered(endpoint, status)
                total.inc()
                duration.observe(time.perf_counter() - started)
            await send(message)

        with series.in_progress(endpoint).track_inprogress():
            await self.app(scope, receive, counting_send)

    async def _answer_metrics(self, scope: Scope, send: Send) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST

        body = await asyncio.to_thread(metrics_page)  # reads every worker's files
        headers = [(b"content-type", CONTENT_TYPE_LATEST.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
