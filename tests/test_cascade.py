"""Early exit: the cascade's threshold, its answers in the serving runtime, and the pipeline's
cascade of the digits classifier, built and judged like any variant."""

from __future__ import annotations

import shutil
from pathlib import Path

import bentoml
import numpy as np
import pytest

from pipeline.cascade import calibrate, cascade_outputs, student_share
from pipeline.datasets import digits_split
from pipeline.recipe import Budget
from pipeline.report import write_report
from pipeline.tasks import TASKS
from serving.engine import EngineSettings, open_engine
from serving.model_runtime import CascadeImageRuntime, answered_by_teacher, read_spec
from serving.model_spec import CLASS_NAMES_FILE, ONNX_FILE, TEACHER_FILE

CLASSIFIER = TASKS["image-classification"]


def one_hot(classes: list[int], confidence: float, n: int = 4) -> np.ndarray:
    rows = np.full((len(classes), n), (1 - confidence) / (n - 1), dtype=np.float32)
    rows[np.arange(len(classes)), classes] = confidence
    return rows


def test_the_cascade_takes_the_students_answer_where_it_is_sure_and_the_teachers_elsewhere() -> None:
    student = np.concatenate([one_hot([0, 1], 0.95), one_hot([2, 3], 0.5)])
    teacher = one_hot([0, 1, 1, 1], 0.9)

    answers = cascade_outputs(student, teacher, threshold=0.9)

    np.testing.assert_array_equal(answers, np.concatenate([student[:2], teacher[2:]]))
    assert student_share(student, 0.9) == 0.5


def test_the_threshold_is_the_lowest_that_keeps_the_cascade_within_the_budget() -> None:
    """900 rows the student gets right and is sure of, 100 it gets wrong at low confidence: a
    threshold must send those 100 to the teacher, and need not send more."""
    rng = np.random.default_rng(0)
    labels = rng.integers(4, size=1000)
    wrong = (labels[900:] + 1) % 4
    student = np.concatenate([one_hot(list(labels[:900]), 0.97), one_hot(list(wrong), 0.6)])
    teacher = one_hot(list(labels), 0.9)
    budget = Budget(max_drop={"accuracy": 0.02})  # the threshold meets half of it

    threshold = calibrate(CLASSIFIER, budget, student, teacher, labels)

    assert 0.6 < threshold <= 0.97
    assert student_share(student, threshold) == 0.9


def test_a_student_unsure_of_everything_leaves_every_row_to_the_teacher() -> None:
    labels = np.arange(400) % 4
    student = one_hot(list((labels + 1) % 4), 0.9)  # always wrong, always sure
    teacher = one_hot(list(labels), 0.9)

    assert calibrate(CLASSIFIER, Budget(max_drop={"accuracy": 0.01}), student, teacher, labels) == float("inf")


@pytest.fixture(scope="module")
def stored_digits_models(digits_model) -> dict[str, bentoml.Model]:
    """Every stored variant of the session's digits build, by variant."""
    return {m.info.labels["variant"]: m for m in bentoml.models.list("digits-classifier")}


def test_the_cascade_runtime_answers_with_the_student_where_sure_and_the_teacher_elsewhere(
    stored_digits_models, tmp_path: Path
) -> None:
    """Real sessions: the stored cascade's student and teacher, at a threshold of 0.9."""
    stored = Path(stored_digits_models["cascade"].path)
    for name in (ONNX_FILE, TEACHER_FILE, CLASS_NAMES_FILE):
        shutil.copyfile(stored / name, tmp_path / name)
    spec = read_spec(stored_digits_models["cascade"].info.metadata)
    spec = spec.model_copy(update={"cascade": spec.cascade.model_copy(update={"threshold": 0.9})})
    settings = EngineSettings.from_environment()
    runtime = CascadeImageRuntime(tmp_path, spec, settings)
    images = np.stack(digits_split("perturbed").rows[:256])

    probabilities, by_teacher = answered_by_teacher(runtime.predict(images))

    engines = {name: open_engine("onnxruntime", tmp_path / name, settings) for name in (ONNX_FILE, TEACHER_FILE)}
    alone = {name: e.run({e.input_names[0]: images})[e.output_names[0]] for name, e in engines.items()}
    np.testing.assert_allclose(probabilities, cascade_outputs(alone[ONNX_FILE], alone[TEACHER_FILE], 0.9), atol=1e-6)
    np.testing.assert_array_equal(by_teacher, alone[ONNX_FILE].max(-1) < 0.9)
    assert 0 < by_teacher.sum() < len(images)  # both models answered some


def test_the_pipeline_stores_a_calibrated_cascade_with_both_graphs_and_serves_it(
    digits_model, digits_recipe, tmp_path: Path
) -> None:
    served = digits_model.model
    cascade = next(c for c in digits_model.candidates if c.variant == "cascade")
    assert cascade.accepted, cascade.reason
    assert served.info.labels["variant"] == "cascade"  # the recipe's serving.variant
    spec = read_spec(served.info.metadata)
    assert spec.cascade is not None and spec.cascade.threshold == cascade.cascade.threshold
    assert {ONNX_FILE, TEACHER_FILE} <= {p.name for p in Path(served.path).iterdir()}
    shares = cascade.config["student_share"]
    assert set(shares) == {"held-out", "perturbed"} and all(0 < share <= 1 for share in shares.values())
    assert {"held-out", "perturbed"} == set(cascade.slices) and cascade.profile
    report = write_report(digits_recipe.recipe, digits_model, tmp_path).read_text()
    assert f"at least {spec.cascade.threshold:.4f}" in report and "| perturbed |" in report
