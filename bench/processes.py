"""Start a server as a child process group, wait for its readiness probe, stop it cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NamedTuple

import httpx

# OPTISERVE_SERVE_PYTHON: the interpreter that serves, in tests and benches (default: this one), e.g.
# a serving-only venv (`pip install -e .`) of the Python the container image runs.
SERVE_PYTHON = os.environ.get("OPTISERVE_SERVE_PYTHON") or sys.executable
OPTISERVE = [SERVE_PYTHON, "-m", "bentoml", "serve", "service:Optiserve", "--host", "127.0.0.1"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Started(NamedTuple):
    url: str
    process: subprocess.Popen  # the command's own process: BentoML's supervisor, for `bentoml serve`

    @property
    def pid(self) -> int:
        return self.process.pid


@contextmanager
def running(
    command: list[str], *, url: str, env: dict[str, str], cwd: Path, log: Path, timeout: float = 300
) -> Iterator[Started]:
    """Yield once GET <url>/readyz answers 200; the whole process group goes on exit."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_ready(process, url, log, timeout)
        yield Started(url, process)
    finally:
        stop(process)


def stop(process: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM to the process group, so that BentoML's supervisor stops its workers (they run in
    groups of their own, which a SIGKILL of its group would leave behind); SIGKILL after `timeout`.
    Output the process pipes to us is read meanwhile: a supervisor blocked on a full pipe would
    stop nothing."""
    with suppress(ProcessLookupError):  # the caller may have stopped it already
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()


@contextmanager
def on_free_port(command: list[str], *, env: dict[str, str], cwd: Path, log: Path) -> Iterator[Started]:
    """`command --port N` on a free local port, as `running` does."""
    port = free_port()
    with running([*command, "--port", str(port)], url=f"http://127.0.0.1:{port}", env=env, cwd=cwd, log=log) as started:
        yield started


def worker_rss_mib(supervisor: int) -> float:
    """Resident memory of BentoML's service worker(s) under the supervisor."""
    import psutil

    total = 0
    for child in psutil.Process(supervisor).children(recursive=True):
        try:
            if any("_bentoml_impl.worker" in part for part in child.cmdline()):
                total += child.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


def wait_ready(process: subprocess.Popen, url: str, log: Path | None, timeout: float) -> None:
    """Until GET <url>/readyz answers 200; an error quotes the end of `log`, where there is one."""

    def tail() -> str:
        return "" if log is None else "\n" + log.read_text()[-4000:]

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[:4]} exited early:{tail()}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s:{tail()}")
