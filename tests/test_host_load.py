"""Other work on the machine while the pipeline profiles: measured from the kernel's own counters."""

from __future__ import annotations

import subprocess
import sys
import time

from pipeline.host_load import cpu_clock, other_load
from pipeline.report import load_text
from serving.host import OtherLoad


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_busy_neighbour_is_counted_as_other_work() -> None:
    spin = "import time\nend = time.monotonic() + 2.5\nwhile time.monotonic() < end: pass"
    neighbour = subprocess.Popen([sys.executable, "-c", spin])
    time.sleep(0.3)  # the interpreter's start-up is not the spin
    start = cpu_clock()
    time.sleep(1.5)
    load = other_load(start, cpu_clock())
    neighbour.wait()
    assert load is not None
    assert load.busy_cores >= 0.7  # a core, less its start-up and what the kernel lends to us; more if others run
    assert load.too_busy


def test_the_pipelines_own_work_is_not() -> None:
    start = cpu_clock()
    time.sleep(1.5)
    idle = other_load(start, cpu_clock())
    start = cpu_clock()
    _spin(1.5)
    spinning = other_load(start, cpu_clock())
    assert idle is not None and spinning is not None
    # Its own core, counted as other work, would read about 1.0 above what the others took anyway.
    assert spinning.busy_cores < idle.busy_cores + 0.5


def test_a_process_the_pipeline_runs_and_waits_for_is_its_own_work() -> None:
    """The working-memory measurement runs in a child process inside the profiling step: read as
    another's work, 8 s of it flagged every image build as profiled on a busy machine."""
    start = cpu_clock()
    time.sleep(1.5)
    idle = other_load(start, cpu_clock())
    spin = "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass"
    start = cpu_clock()
    subprocess.run([sys.executable, "-c", spin], check=True)
    child = other_load(start, cpu_clock())
    assert idle is not None and child is not None
    assert child.busy_cores < idle.busy_cores + 0.5


def test_a_busy_profile_is_flagged_in_the_report_and_a_quiet_one_is_not() -> None:
    assert "rebuild on a quiet machine" in load_text(OtherLoad(seconds=90, cores=2, busy_cores=1.1))
    quiet = load_text(OtherLoad(seconds=90, cores=2, busy_cores=0.04))
    assert quiet == "other processes kept 0.04 of the machine's 2 cores busy while it profiled"
    assert load_text(None) == "other work on it not measured"
    assert other_load(None, cpu_clock()) is None
