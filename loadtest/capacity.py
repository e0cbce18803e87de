"""The knee of a sweep and the replicas a target load needs: pure arithmetic, unit-tested."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    """One measured load level, reduced to what the knee needs."""

    level: float  # concurrency, or offered requests/s
    throughput: float  # successful requests/s
    p99_ms: float | None
    error_rate: float


# Levels within this share of the best throughput are on the plateau: one window's noise apart.
PLATEAU_SHARE = 0.95


@dataclass(frozen=True)
class Knee:
    level: float
    throughput: float
    p99_ms: float
    slo_ms: float
    # The lowest level already on the plateau: where added load stops adding throughput.
    saturated_at: float
    # The highest level on it within the SLO: the most clients served at the best throughput in
    # time. On a flat curve the best level, and where the plateau starts, are wherever noise puts
    # them (one server's text sweeps read 2, 32 and 128 clients), while its end is set by the SLO,
    # so a load scaled from the knee (bench.overload's flood) scales from this.
    plateau_end: float


def find_knee(points: Sequence[Point], *, slo_ms: float, max_error_rate: float = 0.0) -> Knee | None:
    """The highest throughput whose p99 is within the SLO and whose error rate is acceptable."""
    eligible = [p for p in points if p.p99_ms is not None and p.p99_ms <= slo_ms and p.error_rate <= max_error_rate]
    if not eligible:
        return None
    best = max(eligible, key=lambda p: (p.throughput, -p.level))
    plateau = [p.level for p in eligible if p.throughput >= PLATEAU_SHARE * best.throughput]
    return Knee(
        level=best.level,
        throughput=best.throughput,
        p99_ms=best.p99_ms,
        slo_ms=slo_ms,
        saturated_at=min(plateau),
        plateau_end=max(plateau),
    )


@dataclass(frozen=True)
class CapacityPlan:
    """Replicas for `target_qps`, each planned at (1 − headroom) × its knee throughput.

    Headroom is taken off the per-replica capacity, not added to the target: a replica is
    planned to run at most at `planned_per_replica_qps`, so that bursts, a replica being
    replaced, or a slower machine still find the service left of its knee. `utilization` is
    the share of the fleet's knee throughput the target uses. `replica_mib`: what one replica's
    workers held at the knee, where the server says (its memory, to size a container).
    """

    target_qps: float
    knee_qps: float
    headroom: float
    planned_per_replica_qps: float
    replicas: int
    utilization: float
    replica_mib: float | None = None

    @property
    def fleet_mib(self) -> float | None:
        return None if self.replica_mib is None else self.replicas * self.replica_mib


def capacity_plan(
    *, target_qps: float, knee_qps: float, headroom: float, replica_mib: float | None = None
) -> CapacityPlan:
    if target_qps <= 0:
        raise ValueError(f"target QPS must be positive, got {target_qps}")
    if knee_qps <= 0:
        raise ValueError(f"knee throughput must be positive, got {knee_qps}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom is a fraction in [0, 1), got {headroom}")
    planned = knee_qps * (1 - headroom)
    # A tiny epsilon keeps an exact fit (target == n × planned) from rounding up by float noise.
    replicas = max(1, math.ceil(target_qps / planned - 1e-9))
    return CapacityPlan(
        target_qps=target_qps,
        knee_qps=knee_qps,
        headroom=headroom,
        planned_per_replica_qps=planned,
        replicas=replicas,
        utilization=target_qps / (replicas * knee_qps),
        replica_mib=replica_mib,
    )
