"""Serving knobs read from the environment: placement of the models and ONNX Runtime threads."""

from __future__ import annotations

import os

import pytest

from serving.engine import default_intra_op_threads
from serving.settings import OVERRUN_S, model_placement, traffic_timeout_s


def test_models_run_in_process_unless_told_otherwise(monkeypatch) -> None:
    monkeypatch.delenv("OPTISERVE_MODEL_PLACEMENT", raising=False)
    assert model_placement() == "in-process"
    monkeypatch.setenv("OPTISERVE_MODEL_PLACEMENT", "service")
    assert model_placement() == "service"


def test_an_unknown_placement_is_refused_by_name(monkeypatch) -> None:
    monkeypatch.setenv("OPTISERVE_MODEL_PLACEMENT", "gpu")
    with pytest.raises(ValueError, match="OPTISERVE_MODEL_PLACEMENT='gpu'"):
        model_placement()


def test_workers_holding_sessions_share_the_cpus(monkeypatch) -> None:
    monkeypatch.delenv("OPTISERVE_ORT_THREADS", raising=False)
    cpus = len(os.sched_getaffinity(0))
    assert default_intra_op_threads() == cpus
    assert default_intra_op_threads(processes=cpus) == 1
    assert default_intra_op_threads(processes=4 * cpus) == 1  # never zero
    monkeypatch.setenv("OPTISERVE_ORT_THREADS", "3")
    assert default_intra_op_threads(processes=2) == 3  # an explicit setting wins


def test_the_traffic_timeout_covers_the_slowest_admitted_request_and_no_more(monkeypatch) -> None:
    """BentoML keeps a timer per request for as long as the timeout: no longer than needed."""
    monkeypatch.setenv("OPTISERVE_BODY_TIMEOUT_S", "30")
    assert traffic_timeout_s(1.0, reads_bodies=True) == 30 + 1 + OVERRUN_S < 120
    assert traffic_timeout_s(1.0, reads_bodies=False) == 1 + OVERRUN_S, "a model service reads no client's body"
    monkeypatch.setenv("OPTISERVE_BODY_TIMEOUT_S", "90")
    assert traffic_timeout_s(0.2, reads_bodies=True) == 90 + 0.2 + OVERRUN_S, "a slow upload is still answered 408"
