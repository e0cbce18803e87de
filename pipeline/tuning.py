"""Accuracy-driven tuning and the gate: try a kind's configurations in order of expected speed,
keep the first that fits the budget, and record every trial either way."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, Field

from pipeline.datasets import Split
from pipeline.evaluate import SliceFigures
from pipeline.profile import ProfilePoint
from pipeline.recipe import Budget
from pipeline.variants.base import VariantInputs, VariantKind
from serving.engine import EngineName
from serving.model_spec import Cascade

if TYPE_CHECKING:
    from pipeline.tasks import PipelineTask

logger = logging.getLogger(__name__)
Outputs = dict[str, np.ndarray]  # evaluation slice → a graph's outputs on it
Predict = Callable[[Path, EngineName], Outputs]
HELD_OUT = "held-out"  # the slice the report's headline figures come from


class Judged(BaseModel):
    """Figures per evaluation slice; `metrics` and `drops` are the held-out slice's."""

    slices: dict[str, SliceFigures] = Field(default_factory=dict)

    @property
    def metrics(self) -> dict[str, float]:
        return self.slices[HELD_OUT].metrics if self.slices else {}

    @property
    def drops(self) -> dict[str, float]:
        return self.slices[HELD_OUT].drops if self.slices else {}


class Trial(Judged):
    config: dict
    failed: list[str] = Field(default_factory=list, description="budget lines this trial broke")
    error: str | None = None
    seconds: float = 0.0


class Candidate(Judged):
    """One variant's outcome: what it is, how it measured, and whether it may be served."""

    variant: str
    precision: str
    engine: EngineName = "onnxruntime"
    path: Path | None = None
    size_mb: float = 0.0
    config: dict = Field(default_factory=dict)
    accepted: bool = False
    reason: str = ""
    trials: list[Trial] = Field(default_factory=list)
    profile: list[ProfilePoint] = Field(default_factory=list)
    profile_seconds: float = 0.0  # timed per batch size: the recipe's full time, or screening's share
    cascade: Cascade | None = None  # a cascade's threshold and teacher (pipeline/cascade.py)


def budget_failures(budget: Budget, slices: dict[str, SliceFigures]) -> list[str]:
    """Budget lines broken on any slice, judged by the drop's 95 % upper bound."""
    return [
        f"{name}: {metric} drop {figures.drops[metric]:.4f} (95 % bound {figures.drop_bounds[metric]:.4f}) "
        f"> budget.max_drop.{metric} {limit}"
        for name, figures in slices.items()
        for metric, limit in budget.max_drop.items()
        if metric in figures.drop_bounds and figures.drop_bounds[metric] > limit
    ]


def judge_slices(
    task: PipelineTask, reference: Outputs, outputs: Outputs, evaluation: dict[str, Split]
) -> dict[str, SliceFigures]:
    """Each slice judged with its labels and its rows' sources."""
    return {
        name: task.judge(reference[name], outputs[name], evaluation[name].labels, evaluation[name].groups)
        for name in reference
    }


def tune(
    kind: VariantKind,
    inputs: VariantInputs,
    *,
    predict: Predict,
    reference: Outputs,
    evaluation: dict[str, Split],
    budget: Budget,
) -> Candidate:
    candidate = Candidate(variant=kind.name, precision=kind.precision, engine=kind.engine)
    if kind.requires and kind.requires not in inputs.built:
        return candidate.model_copy(update={"reason": f"not built: needs an accepted {kind.requires} variant"})
    if missing := kind.unavailable(inputs):
        return candidate.model_copy(update={"reason": f"not built: {missing}"})
    for index, config in enumerate(kind.configs(inputs)):
        out = trial_file(inputs, kind, index)
        started = time.monotonic()
        trial = Trial(config=config)
        try:
            kind.build(inputs, config, out)
            trial.config = config  # a kind may record what it chose inside its config while building
            trial.slices = judge_slices(inputs.task, reference, predict(out, kind.engine), evaluation)
        except Exception as exc:  # a quantizer or runtime refusing a graph is a failed trial, not a crash
            logger.warning("%s %s failed: %s", kind.name, config, exc)
            trial.error = f"{type(exc).__name__}: {exc}"
        trial.seconds = time.monotonic() - started
        if trial.error is None:
            trial.failed = budget_failures(budget, trial.slices)
        candidate.trials.append(trial)
        if trial.error is None and not trial.failed:
            return candidate.model_copy(
                update={
                    "path": out,
                    "size_mb": out.stat().st_size / 1e6,
                    "config": config,
                    "slices": trial.slices,
                    "accepted": True,
                    "reason": f"fits the budget on trial {index + 1}",
                }
            )
    index, closest = closest_trial(budget, candidate.trials)
    reason = closest.error or f"closest, trial {index + 1}: " + "; ".join(closest.failed)
    return candidate.model_copy(
        update={
            # built, though never served: a cascade may still use it
            "path": None if closest.error else trial_file(inputs, kind, index),
            "slices": closest.slices,
            "config": closest.config,
            "reason": f"rejected after {len(candidate.trials)} trial(s): {reason}",
        }
    )


def trial_file(inputs: VariantInputs, kind: VariantKind, index: int) -> Path:
    """Where a kind's trial writes its graph: every trial its own, so a rejected kind keeps its closest."""
    return inputs.workdir / f"{kind.name}-{index}.onnx"


def closest_trial(budget: Budget, trials: list[Trial]) -> tuple[int, Trial]:
    """The trial that came nearest the budget (the least excess of a drop's bound over its line, on
    its worst slice), and its index: what the report shows of a rejected variant, rather than its
    last configuration, which is often a more cautious one that did worse (ONNX Runtime's INT8 of
    EfficientNet-Lite0 kept 0.91 of top-1 with every op quantized and 0.85 with its ends in float).
    The last trial where none ran, for its error."""
    judged = [(i, t) for i, t in enumerate(trials) if t.error is None]
    if not judged:
        return len(trials) - 1, trials[-1]

    def excess(trial: Trial) -> float:
        return max(
            figures.drop_bounds[metric] - limit
            for figures in trial.slices.values()
            for metric, limit in budget.max_drop.items()
            if metric in figures.drop_bounds
        )

    return min(judged, key=lambda pair: excess(pair[1]))
