"""Process-level serving knobs read from the environment, with defaults sized for small CPUs."""

from __future__ import annotations

import os
from typing import Literal

Placement = Literal["in-process", "service"]
PLACEMENT_ENV = "OPTISERVE_MODEL_PLACEMENT"


def front_workers() -> int:
    """Front workers decode and tokenize; one async worker with a thread pool fills two cores."""
    return int(os.environ.get("OPTISERVE_FRONT_WORKERS", "1"))


def model_placement() -> Placement:
    """Where the ONNX sessions run: `in-process` (default) in each front worker, batched there;
    `service`: one batched BentoML model service per model, called over HTTP. The second suits
    a GPU shared by many front workers; on CPUs the first saves two process hops per request
    (BENCHMARKS.md)."""
    value = os.environ.get(PLACEMENT_ENV, "in-process")
    if value not in ("in-process", "service"):
        raise ValueError(f"{PLACEMENT_ENV}={value!r}: expected 'in-process' or 'service'")
    return value


# 10 served more at 8 connections (+12-29 % on one host, +5-10 % on another) but cost /embed 0.4-1.4 ms
# at one beside the load generator; 5 kept one connection's latency with nice 0's (BENCHMARKS.md).
DEFAULT_ENGINE_NICE = 5


def engine_niceness() -> int:
    """How much lower than the event loop's the engine threads' CPU priority is (nice, 0-19): on
    a few cores the loop, which reads, admits, refuses and answers, must not wait behind a batch
    that can as well take the cycles it leaves. `OPTISERVE_ENGINE_NICE`; 0 runs them alike."""
    value = int(os.environ.get("OPTISERVE_ENGINE_NICE", str(DEFAULT_ENGINE_NICE)))
    if not 0 <= value <= 19:
        raise ValueError(f"OPTISERVE_ENGINE_NICE={value}: expected 0 to 19")
    return value


def max_queue_rows(max_batch_size: int) -> int:
    """Rows a model's queue may hold (admitted, not yet running) before it answers 429: bounds
    memory whatever the deadline. `OPTISERVE_MAX_QUEUE_ROWS` overrides; default 32 full batches."""
    return int(os.environ.get("OPTISERVE_MAX_QUEUE_ROWS", 32 * max_batch_size))


def body_timeout_s() -> float:
    """Seconds a request body may take to arrive before it is answered 408: a client that trickles
    its upload holds a connection and, for /classify, a place in the queue. `OPTISERVE_BODY_TIMEOUT_S`."""
    return float(os.environ.get("OPTISERVE_BODY_TIMEOUT_S", "30"))


# BentoML answers 504 to a request not answered within its service's `traffic.timeout`, and
# BentoML 1.4.40 keeps a timer alive that long after every request, answered or not (RELIABILITY.md):
# at 120 s and 2 000 requests a second, 240 000 of them. So the timeout is as long as the slowest
# request the service admits may need, and no longer: its body's time, its deadline, and this, for one
# too large for its deadline that runs anyway on an idle engine (serving/batching.py).
OVERRUN_S = 15.0


def traffic_timeout_s(deadline_s: float, *, reads_bodies: bool) -> float:
    """The `traffic.timeout` of a service whose longest deadline is `deadline_s`; `reads_bodies`:
    its requests' bodies arrive through it (the front), so their `body_timeout_s` counts too."""
    return (body_timeout_s() if reads_bodies else 0.0) + deadline_s + OVERRUN_S


def hold_early_retries() -> bool:
    """Whether a refusal of a connection that comes back before its last Retry-After is held
    until then (serving/door.py). A refusal still crosses BentoML's outer middleware, and a
    storm of instant retries would take the event loop from the requests it let in.
    `OPTISERVE_HOLD_EARLY_RETRIES`; 0 answers every refusal at once."""
    return os.environ.get("OPTISERVE_HOLD_EARLY_RETRIES", "1") != "0"


def access_log_enabled() -> bool:
    """One JSON line per request on stderr (serving/tracing.py), in place of BentoML's access log;
    `OPTISERVE_ACCESS_LOG=0` turns it off."""
    return os.environ.get("OPTISERVE_ACCESS_LOG", "1") != "0"


def monitoring_enabled() -> bool:
    """Prediction and input monitoring (serving/monitoring.py); `OPTISERVE_MONITORING=0` turns it off."""
    return os.environ.get("OPTISERVE_MONITORING", "1") != "0"


def drift_window() -> int:
    """Values of each statistic a drift score is computed over, the most recent ones:
    `OPTISERVE_DRIFT_WINDOW`. 1 000 keeps a PSI of unchanged inputs near 0.02 (10 bins)."""
    return int(os.environ.get("OPTISERVE_DRIFT_WINDOW", "1000"))


def drift_interval_s() -> float:
    """Seconds between two drift computations of a model, at most: `OPTISERVE_DRIFT_INTERVAL_S`."""
    return float(os.environ.get("OPTISERVE_DRIFT_INTERVAL_S", "10"))
