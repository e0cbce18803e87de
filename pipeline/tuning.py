"""Accuracy-driven tuning and the gate: try a kind's configurations in order of expected speed,
keep the first that fits the budget, and record every trial either way."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field

from pipeline.evaluate import drops, evaluate
from pipeline.profile import ProfilePoint
from pipeline.recipe import Budget
from pipeline.variants import VariantInputs, VariantKind
from serving.engine import EngineName

logger = logging.getLogger(__name__)
Predict = Callable[[Path, EngineName], np.ndarray]  # a graph's outputs on the evaluation split


class Trial(BaseModel):
    config: dict
    metrics: dict[str, float] = Field(default_factory=dict)
    drops: dict[str, float] = Field(default_factory=dict)
    failed: list[str] = Field(default_factory=list, description="budget lines this trial broke")
    error: str | None = None
    seconds: float = 0.0


class Candidate(BaseModel):
    """One variant's outcome: what it is, how it measured, and whether it may be served."""

    variant: str
    precision: str
    engine: EngineName = "onnxruntime"
    path: Path | None = None
    size_mb: float = 0.0
    config: dict = Field(default_factory=dict)
    metrics: dict[str, float] = Field(default_factory=dict)
    drops: dict[str, float] = Field(default_factory=dict)
    accepted: bool = False
    reason: str = ""
    trials: list[Trial] = Field(default_factory=list)
    profile: list[ProfilePoint] = Field(default_factory=list)


def budget_failures(budget: Budget, measured_drops: dict[str, float]) -> list[str]:
    return [
        f"{metric} drop {measured_drops[metric]:.4f} > budget.max_drop.{metric} {limit}"
        for metric, limit in budget.max_drop.items()
        if metric in measured_drops and measured_drops[metric] > limit
    ]


def tune(
    kind: VariantKind,
    inputs: VariantInputs,
    *,
    predict: Predict,
    reference: np.ndarray,
    baseline: dict[str, float],
    labels: np.ndarray | None,
    budget: Budget,
) -> Candidate:
    candidate = Candidate(variant=kind.name, precision=kind.precision, engine=kind.engine)
    if kind.requires and kind.requires not in inputs.built:
        return candidate.model_copy(update={"reason": f"not built: needs an accepted {kind.requires} variant"})
    for index, config in enumerate(kind.configs(inputs)):
        out = inputs.workdir / f"{kind.name}-{index}.onnx"
        started = time.monotonic()
        trial = Trial(config=config)
        try:
            kind.build(inputs, config, out)
            trial.config = config  # a kind may record what it chose inside its config while building
            trial.metrics = evaluate(inputs.task, reference, predict(out, kind.engine), labels)
        except Exception as exc:  # a quantizer or runtime refusing a graph is a failed trial, not a crash
            logger.warning("%s %s failed: %s", kind.name, config, exc)
            trial.error = f"{type(exc).__name__}: {exc}"
        trial.seconds = time.monotonic() - started
        if trial.error is None:
            trial.drops = drops(baseline, trial.metrics)
            trial.failed = budget_failures(budget, trial.drops)
        candidate.trials.append(trial)
        if trial.error is None and not trial.failed:
            return candidate.model_copy(
                update={
                    "path": out,
                    "size_mb": out.stat().st_size / 1e6,
                    "config": config,
                    "metrics": trial.metrics,
                    "drops": trial.drops,
                    "accepted": True,
                    "reason": f"fits the budget on trial {index + 1}",
                }
            )
    last = candidate.trials[-1]
    reason = last.error or "; ".join(last.failed)
    return candidate.model_copy(
        update={
            "metrics": last.metrics,
            "drops": last.drops,
            "config": last.config,
            "reason": f"rejected after {len(candidate.trials)} trial(s): {reason}",
        }
    )
