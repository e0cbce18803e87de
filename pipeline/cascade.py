"""Early exit: an accepted student answers what it is sure of, the FP32 teacher the rest.

The cascade is a candidate like any variant: judged by the gate against the teacher on the
held-out and perturbed slices, profiled through the serving runtime that will run it
(serving/model_runtime.py `CascadeImageRuntime`, on the same drawn rows as the others), stored
with both graphs. Its one parameter, the threshold on the student's top probability, is
calibrated on rows the gate never judges (the task's `threshold` split): the lowest threshold
whose cascade meets half the budget there, by the gate's own 95 % bounds, so that as many rows
as the budget allows stay with the student. Half: a threshold at the budget's very edge on the
calibration rows missed it on the unseen perturbed digits (top-1 agreement bound 1.33 % against
1 %, 1 800 digits). Besides the recipe's budget, the cascade must agree
with the teacher's top-1 answer within the budget's tightest drop (`cascade_budget`): what
it promises is the teacher's answers, faster, not only the teacher's accuracy.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pipeline.datasets import Split
from pipeline.recipe import Budget
from pipeline.tasks import PipelineTask
from pipeline.tuning import Candidate, Outputs, Predict, budget_failures, judge_slices
from serving.engine import EngineName
from serving.model_spec import ONNX_FILE, TEACHER_FILE, Cascade

CASCADE = "cascade"
# Its first stage: the first of these built, whatever the gate said of it alone: a student that
# misses the budget on its own may still answer the rows it is sure of.
STUDENTS = ("student-int8", "student")
THRESHOLDS = 200  # quantiles of the student's confidence tried, lowest first
CALIBRATION_SHARE = 0.5  # of each budget line, that the cascade must meet on the calibration rows
# A model's outputs on a split, by file and engine.
OutputsOn = Callable[[Path, EngineName, Split], np.ndarray]


def cascade_budget(budget: Budget) -> Budget:
    """The recipe's budget, and top-1 agreement with the teacher within its tightest drop."""
    tightest = min(budget.max_drop.values())
    return budget.model_copy(update={"max_drop": {"top1_agreement": tightest, **budget.max_drop}})


def cascade_outputs(student: np.ndarray, teacher: np.ndarray, threshold: float) -> np.ndarray:
    """What the cascade answers, from each model's outputs on the same rows."""
    return np.where((student.max(-1) < threshold)[:, None], teacher, student)


def student_share(student: np.ndarray, threshold: float) -> float:
    return float((student.max(-1) >= threshold).mean())


def calibrate(
    task: PipelineTask,
    budget: Budget,
    student: np.ndarray,
    teacher: np.ndarray,
    labels: np.ndarray | None,
    groups: list | None = None,
) -> float:
    """The lowest threshold at which the cascade meets `CALIBRATION_SHARE` of `budget` on these rows
    (inf: the teacher alone); `groups`: each row's source."""
    budget = budget.model_copy(update={"max_drop": {k: CALIBRATION_SHARE * v for k, v in budget.max_drop.items()}})
    confidences = student.max(-1)
    for threshold in np.unique(np.quantile(confidences, np.linspace(0, 1, THRESHOLDS + 1))):
        answers = cascade_outputs(student, teacher, float(threshold))
        judged = {"threshold": task.judge(teacher, answers, labels, groups)}
        if not budget_failures(budget, judged):
            return float(threshold)
    return float("inf")


def cascade_candidate(
    task: PipelineTask,
    candidates: list[Candidate],
    calibration: Split | None,
    outputs_on: OutputsOn,
    predict: Predict,
    reference: Outputs,
    evaluation: dict[str, Split],
    budget: Budget,
    workdir: Path,
) -> Candidate:
    """The cascade of the accepted student over the FP32 teacher (`candidates[0]`): calibrated on
    `calibration`, judged on the evaluation slices (`predict`, `reference`: the teacher's outputs
    there), its two files side by side in `workdir`."""
    candidate = Candidate(variant=CASCADE, precision="mixed")
    built = {c.variant: c for c in candidates if c.path is not None}
    student = next((built[name] for name in STUDENTS if name in built), None)
    if student is None or calibration is None:
        needs = "a student variant" if student is None else "a split to calibrate its threshold on"
        return candidate.model_copy(update={"reason": f"not built: needs {needs}"})
    teacher = candidates[0]
    budget = cascade_budget(budget)
    threshold = calibrate(
        task,
        budget,
        outputs_on(student.path, student.engine, calibration),
        outputs_on(teacher.path, teacher.engine, calibration),
        calibration.labels,
        calibration.groups,
    )
    if threshold == float("inf"):
        return candidate.model_copy(update={"reason": f"rejected: no threshold leaves {student.variant} any row"})
    folder = workdir / CASCADE
    folder.mkdir()
    shutil.copyfile(student.path, folder / ONNX_FILE)
    shutil.copyfile(teacher.path, folder / TEACHER_FILE)
    outputs = predict(student.path, student.engine)
    answers = {name: cascade_outputs(outputs[name], reference[name], threshold) for name in reference}
    slices = judge_slices(task, reference, answers, evaluation)
    failures = budget_failures(budget, slices)
    shares = {name: round(student_share(outputs[name], threshold), 4) for name in reference}
    return candidate.model_copy(
        update={
            "engine": student.engine,
            "path": folder / ONNX_FILE,
            "size_mb": sum(f.stat().st_size for f in folder.iterdir()) / 1e6,
            "config": {"student": student.variant, "teacher": teacher.variant, "student_share": shares},
            "cascade": Cascade(threshold=threshold, teacher_engine=teacher.engine),
            "slices": slices,
            "accepted": not failures,
            "reason": "; ".join(failures) or f"{student.variant} answers {shares} of each slice at {threshold:.4f}",
        }
    )
