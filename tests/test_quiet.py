"""A pipeline run shows our warnings and any library's errors; the libraries' own notes, warnings
and progress bars are held back while it runs, and none of that outlasts the run."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable

import pytest
import rich
from rich.console import Console

from pipeline.quiet import third_party_quiet


def shown_during_a_run(emit: Callable[[], None]) -> str:
    out = io.StringIO()
    with third_party_quiet(Console(file=out, width=200)):
        emit()
    return out.getvalue()


def test_our_warnings_and_every_libraries_errors_are_shown() -> None:
    def emit() -> None:
        logging.getLogger("pipeline.tuning").warning("int8-static failed: no calibration data")
        logging.getLogger("onnxruntime.quantization").error("the graph is invalid")

    shown = shown_during_a_run(emit)
    assert "int8-static failed: no calibration data" in shown and "the graph is invalid" in shown


def test_the_libraries_notes_and_progress_bars_are_held_back(capsys: pytest.CaptureFixture[str]) -> None:
    def emit() -> None:
        logging.warning("Please consider to run pre-processing before quantization")  # ONNX Runtime: the root logger
        logging.getLogger("onnxruntime.quantization").warning("Expected bias to be an initializer")
        logging.getLogger("nncf").info("Statistics collection")
        compressor = logging.getLogger("neural_compressor")
        compressor.setLevel(logging.INFO)  # as neural-compressor does when it is first imported
        compressor.warning("Auto detect accelerator: CPU_Accelerator.")
        rich.get_console().print("Applying Fast Bias correction")  # NNCF's bars draw on rich's global console
        print("Collecting tensor data and making histogram ...")  # ONNX Runtime's calibrators

    assert shown_during_a_run(emit) == ""
    assert capsys.readouterr().out == ""


def test_python_warnings_are_held_with_the_libraries_notes() -> None:
    with third_party_quiet(Console(file=io.StringIO())):
        assert not logging.getLogger("py.warnings").isEnabledFor(logging.WARNING)
        assert logging.getLogger("py.warnings").isEnabledFor(logging.ERROR)


def test_nothing_outlasts_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    names = ("", "pipeline", "onnxruntime", "neural_compressor")
    levels = {name: logging.getLogger(name).level for name in names}
    handlers = list(logging.getLogger().handlers)
    with third_party_quiet(Console(file=io.StringIO())):
        assert logging.getLogger("onnxruntime.quantization").getEffectiveLevel() == logging.ERROR
        assert logging.getLogger("pipeline.build").getEffectiveLevel() == logging.WARNING
    assert {name: logging.getLogger(name).level for name in names} == levels
    assert logging.getLogger().handlers == handlers
    print("after the run")
    assert capsys.readouterr().out == "after the run\n"
    assert not logging.getLogger("neural_compressor").filters
