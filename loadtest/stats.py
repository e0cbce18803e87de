"""Per-request outcomes and the figures made from them: pure functions, no I/O."""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Outcome:
    """One request: when it finished (monotonic seconds), its latency, and its status.

    `status` is the HTTP code as text, or a client-side failure name ("timeout",
    "client_backlog", or the error's class: "ConnectionRefusedError", "ServerDisconnected", …).
    """

    finished: float
    latency: float
    status: str
    rows: int = 1
    held: bool = False  # a refusal the server held for coming back before its Retry-After
    refusal: str | None = None  # a refusal's error type (optiserve's: "overloaded", "expired", …)
    server_ms: float | None = None  # its time in the server, where its Server-Timing says

    @property
    def ok(self) -> bool:
        return self.status.isdigit() and 200 <= int(self.status) < 300


class Recorder:
    """Outcomes in completion order; one event loop appends, so the order is the clock's."""

    def __init__(self) -> None:
        self.finished: list[float] = []
        self.outcomes: list[Outcome] = []

    def add(self, outcome: Outcome) -> None:
        self.finished.append(outcome.finished)
        self.outcomes.append(outcome)

    def between(self, start: float, end: float) -> list[Outcome]:
        """Outcomes that finished in [start, end)."""
        return self.outcomes[bisect.bisect_left(self.finished, start) : bisect.bisect_left(self.finished, end)]


@dataclass(frozen=True)
class Latency:
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float


@dataclass(frozen=True)
class Summary:
    """Figures of the requests that finished in one span. Latencies (ms) are of successes only."""

    duration_s: float
    completed: int
    ok: int
    throughput: float  # successful requests per second
    rows_per_s: float  # successful items (images, texts) per second
    latency_ms: Latency | None
    errors: dict[str, int] = field(default_factory=dict)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: always a latency that was observed, never an interpolation."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def latency_ms(latencies_s: Sequence[float]) -> Latency | None:
    if not latencies_s:
        return None
    values = sorted(1000 * x for x in latencies_s)
    p50, p90, p95, p99 = (percentile(values, q) for q in PERCENTILES)
    return Latency(mean=sum(values) / len(values), p50=p50, p90=p90, p95=p95, p99=p99, max=values[-1])


def summarize(outcomes: Sequence[Outcome], duration_s: float) -> Summary:
    successes = [o for o in outcomes if o.ok]
    errors = Counter(o.status for o in outcomes if not o.ok)
    return Summary(
        duration_s=duration_s,
        completed=len(outcomes),
        ok=len(successes),
        throughput=len(successes) / duration_s,
        rows_per_s=sum(o.rows for o in successes) / duration_s,
        latency_ms=latency_ms([o.latency for o in successes]),
        errors=dict(sorted(errors.items())),
    )


def is_stable(windows: Sequence[Summary], *, count: int = 3, tolerance: float = 0.10) -> bool:
    """perf_analyzer's rule: the last `count` windows' throughput and mean latency all lie
    within `tolerance` of their own average. Mean rather than p99 latency: a 2-second window
    holds too few requests for its p99 to settle, while the reported p99 pools the windows."""
    if len(windows) < count:
        return False
    last = windows[-count:]
    if any(w.latency_ms is None for w in last):
        return False
    return _within([w.throughput for w in last], tolerance) and _within(
        [w.latency_ms.mean for w in last if w.latency_ms is not None], tolerance
    )


def _within(values: Sequence[float], tolerance: float) -> bool:
    average = sum(values) / len(values)
    return average > 0 and all(abs(v - average) <= tolerance * average for v in values)
