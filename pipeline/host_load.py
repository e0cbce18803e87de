"""How much of the machine other work took while the pipeline timed its variants.

A profile is only as good as the quiet it was taken in: the same text recipe chose 8-row batches
on a build that shared two cores with a test run and 64-row ones on a quiet machine, and nothing
in the model or its report told the two apart. The CPU time the whole machine spent busy, less
this process's own, is what everyone else took (the hypervisor's steal included): recorded with
the profile, shown in the report, and warned about when it was enough to move the figures.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple

from serving.host import OtherLoad

# /proc/stat's columns after "cpu": user nice system idle iowait irq softirq steal guest guest_nice;
# guest time is counted in user already.
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


class CpuClock(NamedTuple):
    wall: float
    machine_busy: float  # CPU-seconds every core of the machine spent busy since boot
    own: float  # CPU-seconds this process and its finished children have used


def cpu_clock() -> CpuClock | None:
    """None where the kernel does not publish /proc/stat (macOS)."""
    stat = Path("/proc/stat")
    if not stat.exists():
        return None
    columns = stat.read_text().split("\n", 1)[0].split()[1:]
    ticks = sum(int(columns[i]) for i in _BUSY_COLUMNS if i < len(columns))
    own = os.times()  # with the children it has waited for: the working-memory measurement's process is its own work
    return CpuClock(
        time.monotonic(),
        ticks / os.sysconf("SC_CLK_TCK"),
        own.user + own.system + own.children_user + own.children_system,
    )


def other_load(start: CpuClock | None, end: CpuClock | None) -> OtherLoad | None:
    if start is None or end is None or end.wall <= start.wall:
        return None
    others = (end.machine_busy - start.machine_busy) - (end.own - start.own)
    seconds = end.wall - start.wall
    return OtherLoad(seconds=seconds, cores=os.cpu_count() or 1, busy_cores=max(others, 0.0) / seconds)
