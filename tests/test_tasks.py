"""The task registry: every task the recipe schema and the service know has every part, and the
parts agree with each other (a task added with one piece missing fails here, not mid-build)."""

from __future__ import annotations

import inspect
from typing import get_args

import numpy as np
import pytest

from pipeline.recipe import Recipe
from pipeline.tasks import TASKS, PipelineTask
from serving.model_runtime import RUNTIMES
from serving.model_spec import TASK_INPUT, Task


def test_the_schema_the_pipeline_and_the_service_know_the_same_tasks() -> None:
    recipe_tasks = {get_args(cls.model_fields["task"].annotation)[0] for cls in get_args(get_args(Recipe)[0])}
    assert set(TASKS) == set(get_args(Task)) == recipe_tasks == set(RUNTIMES) == set(TASK_INPUT)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_a_registered_task_implements_every_part(name: str) -> None:
    task = TASKS[name]
    assert task.name == name
    assert not inspect.isabstract(type(task))
    abstract = {n for n, v in vars(PipelineTask).items() if getattr(v, "__isabstractmethod__", False)}
    assert abstract <= {n for n in dir(task) if callable(getattr(task, n))}
    assert task.recipe in get_args(get_args(Recipe)[0]) and get_args(task.recipe.model_fields["task"].annotation) == (
        name,
    )
    assert task.runtime is RUNTIMES[name]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_the_metrics_a_budget_may_name_are_the_ones_the_task_measures(name: str) -> None:
    task = TASKS[name]
    rng = np.random.default_rng(0)
    reference = rng.random((20, 6)).astype(np.float32)
    reference /= reference.sum(-1, keepdims=True)  # a valid probability row is a valid embedding too
    labels = rng.integers(0, 6, 20)
    figures = task.judge(reference, reference, labels)
    assert set(figures.drop_bounds) == set(task.recipe.metrics)
    assert all(abs(drop) <= 1e-6 for drop in figures.drops.values())  # the reference loses nothing to itself
    assert task.agreement(reference, reference) == pytest.approx(1.0)
