"""wrk as the yardstick for `python -m loadtest`: same endpoint, same bodies, same connections.

wrk (C, one epoll thread) costs the shared CPUs next to nothing, so when the two disagree on
a server's throughput at the same concurrency, the Python generator is the bottleneck. The
bodies go to wrk through files and bench/wrk_payloads.lua, which sends them in turn.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from loadtest.inputs import Payload

SCRIPT = Path(__file__).with_name("wrk_payloads.lua")


@dataclass(frozen=True)
class WrkResult:
    connections: int
    seconds: float  # as wrk measured it
    requests: int  # answers of any status
    throughput: float  # answers below 400 per second (wrk counts ≥ 400 as status errors)
    p50_ms: float
    p99_ms: float
    errors: dict[str, int]  # wrk's counts: connect, read, write, status (≥ 400), timeout


def wrk_installed() -> bool:
    return shutil.which("wrk") is not None


def run_wrk(url: str, payloads: list[Payload], *, connections: int, seconds: float, timeout_s: float = 30) -> WrkResult:
    """One thread and `connections` keep-alive connections for `seconds`, bodies in turn."""
    with tempfile.TemporaryDirectory(prefix="wrk-bodies-") as folder:
        lines = []
        for index, payload in enumerate(payloads):
            body = Path(folder) / f"{index}.body"
            body.write_bytes(payload.body)
            lines.append(f"{payload.content_type}\t{body}\n")
        index_file = Path(folder) / "index.tsv"
        index_file.write_text("".join(lines))
        command = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", f"--timeout={timeout_s:g}s"]
        command += ["-s", str(SCRIPT), url, "--", str(index_file)]
        run = subprocess.run(command, capture_output=True, text=True, timeout=seconds + timeout_s + 30, check=True)
    summary = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("{")))
    duration = summary["duration_us"] / 1e6
    errors = summary["errors"]
    return WrkResult(
        connections=connections,
        seconds=duration,
        requests=summary["requests"],
        throughput=(summary["requests"] - errors["status"]) / duration,
        p50_ms=summary["p50_ms"],
        p99_ms=summary["p99_ms"],
        errors=errors,
    )
