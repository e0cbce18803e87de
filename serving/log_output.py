"""Log output written by a thread of its own, so that a slow reader of the worker's output never
stalls the event loop.

Every access line and log record used to be a `write()` to stdout or stderr from the thread that
logged it, the event loop above all. Where that output is a pipe its reader must keep up: a
launcher's `Popen(stdout=PIPE)` that never reads it, or Docker's default `blocking` log mode in
front of a log driver that stalls. Measured with the worker's output on a pipe nobody read: the
236th request hung once the pipe's 64 kB were full, and /livez with it, so an orchestrator would
restart a healthy worker and lose its requests (RELIABILITY.md).

Now the worker's stream handlers (BentoML's, the access log's) each get a `BackgroundOutput` in
their place, as Python's `QueueHandler` does, with two differences. The handler's filters run in
the thread that logs (BentoML's adds the current trace's ids), and the queue is bounded: past
`QUEUE_LIMIT` records waiting, a record is dropped and counted, and a line says how many once
the output moves again. A worker whose output is not read keeps serving, with its memory bounded.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from collections.abc import Iterable

from serving.metrics import count_dropped_log_record

# Records waiting for the writer beyond which new ones are dropped (about 1 kB each).
QUEUE_LIMIT = 10_000
# How long the worker's exit waits for the records still queued to be written.
DRAIN_AT_EXIT_S = 2.0

logger = logging.getLogger(__name__)


class OutputWriter:
    """One thread writing every handler's records in the order they were logged."""

    def __init__(self, *, limit: int = QUEUE_LIMIT) -> None:
        self.limit = limit
        self.dropped = 0  # all dropped so far, also counted in `optiserve_log_records_dropped_total`
        self._unreported = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[logging.Handler, logging.LogRecord] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="log-output", daemon=True)
        self._thread.start()

    def put(self, target: logging.Handler, record: logging.LogRecord) -> None:
        """Queue `record` for `target`, at once whatever the output's reader does."""
        if self._queue.qsize() >= self.limit:
            with self._lock:
                self.dropped += 1
                self._unreported += 1
            count_dropped_log_record()
            return
        self._queue.put((target, record))

    def close(self, timeout: float = DRAIN_AT_EXIT_S) -> None:
        """Write what is queued, for at most `timeout` seconds (the output may not move at all)."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _write(self) -> None:
        # A record is dropped only while the queue is full, so one comes after it to report it.
        while (item := self._queue.get()) is not None:
            target, record = item
            _emit(target, record)
            self._report_dropped(target)

    def _report_dropped(self, target: logging.Handler) -> None:
        """A line saying how many records were dropped since the last one said it."""
        if not self._unreported:
            return
        with self._lock:
            count, self._unreported = self._unreported, 0
        notice = logger.makeRecord(
            logger.name,
            logging.WARNING,
            __file__,
            0,
            "%d log records dropped: the worker's output was not read as fast as it was written",
            (count,),
            None,
        )
        if target.filter(notice):  # what the target's format reads (BentoML's: the trace's ids)
            _emit(target, notice)


def _emit(target: logging.Handler, record: logging.LogRecord) -> None:
    target.acquire()
    try:
        target.emit(record)
    finally:
        target.release()


class BackgroundOutput(logging.Handler):
    """In a logger's place of `target`: its filters here, its output on the writer's thread."""

    def __init__(self, target: logging.Handler, writer: OutputWriter) -> None:
        super().__init__(target.level)
        self.target, self.writer = target, writer

    def handle(self, record: logging.LogRecord) -> bool:
        kept = self.target.filter(record)
        if not kept:
            return False
        if isinstance(kept, logging.LogRecord):  # Python 3.12+: a filter may return a new record
            record = kept
        try:
            record.msg, record.args = record.getMessage(), None  # args could change before it is written
        except Exception:  # a format and its arguments that do not match: reported as logging does
            self.handleError(record)
            return False
        self.writer.put(self.target, record)
        return True

    def emit(self, record: logging.LogRecord) -> None:  # `handle` above does the work
        self.writer.put(self.target, record)


_writer: OutputWriter | None = None


def output_writer() -> OutputWriter:
    """The process's writer, started on first use and drained at exit."""
    global _writer
    if _writer is None:
        _writer = OutputWriter()
        atexit.register(_writer.close)
    return _writer


def in_background(target: logging.Handler) -> BackgroundOutput:
    return BackgroundOutput(target, output_writer())


def write_logs_in_background(loggers: Iterable[logging.Logger] | None = None) -> int:
    """Each stream handler of `loggers` (default: every logger configured so far, the root's
    included) replaced by its `BackgroundOutput`; a handler shared by several loggers is wrapped
    once. Returns how many handlers were moved."""
    if loggers is None:
        named = logging.root.manager.loggerDict.values()
        loggers = [logging.root, *(each for each in named if isinstance(each, logging.Logger))]
    wrapped: dict[int, BackgroundOutput] = {}
    for each in loggers:
        for index, handler in enumerate(each.handlers):
            if isinstance(handler, logging.StreamHandler):
                if id(handler) not in wrapped:
                    wrapped[id(handler)] = in_background(handler)
                each.handlers[index] = wrapped[id(handler)]
    return len(wrapped)
