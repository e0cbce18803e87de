"""What a pipeline run shows: our progress, our table, our warnings, and any library's errors.

The libraries the pipeline drives talk a lot and none of it is for its user: ONNX Runtime's
quantizers give advice and notes on initializers on the root logger (`logging.warning`) and its
calibrators print their settings, neural-compressor and NNCF log every step on handlers of their
own (neural-compressor resets its logger's level to INFO when it is first imported), torch and
onnx warn about their internals, and NNCF and transformers draw progress bars of their own: 20
lines around ours for a two-layer text model, more for the real ones. What matters of it, a
configuration that failed and why, is in the trial records and the report.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout

from rich.console import Console
from rich.logging import RichHandler

OURS = ("pipeline", "serving")
THIRD_PARTY = ("onnxruntime", "onnx", "onnxscript", "torch", "transformers", "neural_compressor", "nncf", "openvino")


def errors_only(record: logging.LogRecord) -> bool:
    """A logger filter: unlike a level, a library resetting its own logger does not undo it."""
    return record.levelno >= logging.ERROR


@contextmanager
def third_party_quiet(console: Console) -> Iterator[None]:
    """Our loggers at WARNING, printed on `console` above its progress bars; everyone else's at
    ERROR, Python warnings included; what libraries print or draw hidden. Logging and stdout are as
    they were once the block ends."""
    with _only_our_warnings(console), _their_output_hidden():
        yield


@contextmanager
def _only_our_warnings(console: Console) -> Iterator[None]:
    root = logging.getLogger()
    levels = {name: logging.getLogger(name).level for name in ("", *OURS, *THIRD_PARTY)}
    handler = RichHandler(console=console, show_time=False, show_path=False)
    root.addHandler(handler)
    root.setLevel(logging.ERROR)  # also holds ONNX Runtime's `logging.warning` on the root logger
    for name in OURS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(logging.ERROR)
        logging.getLogger(name).addFilter(errors_only)
    logging.captureWarnings(True)  # Python warnings become records of `py.warnings`, below ERROR
    try:
        yield
    finally:
        logging.captureWarnings(False)
        for name in THIRD_PARTY:
            logging.getLogger(name).removeFilter(errors_only)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        root.removeHandler(handler)


@contextmanager
def _their_output_hidden() -> Iterator[None]:
    """The pipeline writes to stderr only, so its stdout is the libraries': ONNX Runtime's calibrators
    print their histogram settings there and NNCF draws its bars there (on rich's global console)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars, on stderr; read at import
    with open(os.devnull, "w") as sink, redirect_stdout(sink):
        yield
