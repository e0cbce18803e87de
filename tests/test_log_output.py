"""Log output from a thread of its own: whoever logs never waits for the output's reader, the
records arrive in order once it reads, and what a full queue drops is counted and said."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from conftest import REPO, own_home

from bench.processes import OPTISERVE, free_port, stop, wait_ready
from serving.log_output import BackgroundOutput, OutputWriter, write_logs_in_background

LINE = "x" * 2000  # 32 of them fill a pipe's 64 kB


class NameTheCaller(logging.Filter):
    """Like BentoML's trace filter: reads what only the logging thread knows."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.caller = threading.current_thread().name
        return True


@contextmanager
def unread_pipe() -> Iterator[tuple[logging.StreamHandler, int]]:
    """A stream handler writing into a pipe that nobody reads until the test does, and the
    pipe's read end."""
    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "w")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(caller)s %(message)s"))
    handler.addFilter(NameTheCaller())
    try:
        yield handler, read_end
    finally:
        stream.close()
        os.close(read_end)


def read_lines(read_end: int, count: int, timeout: float = 10) -> list[str]:
    """The next `count` lines from the pipe, or fewer if none come for `timeout` seconds."""
    found, pending = [], b""
    os.set_blocking(read_end, False)
    deadline = time.monotonic() + timeout
    while len(found) < count and time.monotonic() < deadline:
        try:
            chunk = os.read(read_end, 65536)
        except BlockingIOError:
            time.sleep(0.01)
            continue
        *complete, pending = (pending + chunk).split(b"\n")
        found += [line.decode() for line in complete]
        deadline = time.monotonic() + timeout
    return found


def log_from_a_thread(logger: logging.Logger, count: int) -> threading.Thread:
    def log_all() -> None:
        for index in range(count):
            logger.warning("%d %s", index, LINE)

    thread = threading.Thread(target=log_all, name="caller")
    thread.start()
    thread.join(timeout=10)
    return thread


def logger_into(handler: logging.Handler, writer: OutputWriter, name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    logger.propagate = False
    logger.handlers = [BackgroundOutput(handler, writer)]
    return logger


def test_logging_into_a_pipe_nobody_reads_returns_and_every_line_comes_in_order_once_it_is_read() -> None:
    writer = OutputWriter(limit=1000)
    with unread_pipe() as (handler, read_end):
        logger = logger_into(handler, writer, "test-log-output-unread")
        caller = log_from_a_thread(logger, 500)
        assert not caller.is_alive(), "logging waited for the pipe's reader"
        lines = read_lines(read_end, 500)
        writer.close()
    assert lines == [f"caller {index} {LINE}" for index in range(500)]
    assert writer.dropped == 0


def test_past_the_queue_limit_records_are_dropped_counted_and_said_once_the_output_moves() -> None:
    writer = OutputWriter(limit=50)
    with unread_pipe() as (handler, read_end):
        caller = log_from_a_thread(logger_into(handler, writer, "test-log-output-full"), 500)
        assert not caller.is_alive(), "logging waited for the pipe's reader"
        lines = read_lines(read_end, 500, timeout=2)
        writer.close()
    written = [line for line in lines if line.endswith(LINE)]
    notices = [line for line in lines if "log records dropped" in line]
    assert writer.dropped > 0 and len(written) + writer.dropped == 500
    said = sum(int(notice.split(" log records dropped")[0].rsplit(" ", 1)[1]) for notice in notices)
    assert said == writer.dropped


def test_each_stream_handler_is_moved_once_even_where_loggers_share_it() -> None:
    shared, own_file = logging.StreamHandler(), logging.NullHandler()
    first, second = logging.getLogger("test-log-output-a"), logging.getLogger("test-log-output-b")
    first.handlers, second.handlers = [shared, own_file], [shared]
    assert write_logs_in_background([first, second]) == 1
    assert first.handlers[0] is second.handlers[0] and first.handlers[0].target is shared
    assert first.handlers[1] is own_file
    assert write_logs_in_background([first, second]) == 0, "moved twice"


@pytest.mark.slow
def test_a_worker_whose_output_nobody_reads_keeps_answering(manifest_file: Path, tmp_path: Path) -> None:
    """Before, its 236th request hung once the pipe was full, and /livez with it."""
    port = free_port()
    env = {**os.environ, "OPTISERVE_MANIFEST": str(manifest_file), "BENTOML_HOME": own_home(tmp_path / "home")}
    process = subprocess.Popen(
        [*OPTISERVE, "--port", str(port)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_ready(process, f"http://127.0.0.1:{port}", None, timeout=300)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            statuses = [
                client.post("/embed", json={"texts": ["nobody reads this"]}, headers={"X-Request-ID": f"unread-{n}"})
                for n in range(600)
            ]
            assert [answer.status_code for answer in statuses] == [200] * 600
            assert client.get("/livez").status_code == 200
            lines = read_lines(process.stdout.fileno(), 10_000, timeout=2)
    finally:
        stop(process, timeout=60)
    assert any('"request_id":"unread-599"' in line for line in lines), "the access lines were lost"
