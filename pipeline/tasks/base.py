"""What a task is to the pipeline: the one interface every per-task module implements.

The build, the tuner, the export check and the variant kinds ask a task, never "image or text?",
so a new task is a module here and a line in the registry (`pipeline/tasks/__init__.py`), beside its
recipe class (pipeline/recipe.py) and its runtime (serving/model_runtime.py); tests/test_tasks.py
names any part missing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from pipeline.datasets import Split
from pipeline.evaluate import SliceFigures
from pipeline.recipe import RecipeBase
from pipeline.variants.base import Feeds
from serving.model_runtime import ModelRuntime
from serving.model_spec import ModelSpec, Task
from serving.monitoring import MonitoringReference

if TYPE_CHECKING:
    import torch

    from pipeline.export import ServingGraph
    from pipeline.recipe import LoadedRecipe, Student
    from pipeline.sources import SourceModel


@dataclass
class TaskData:
    """Everything task-specific the build needs, prepared once per build."""

    spec: ModelSpec
    files: dict[str, Path]  # file name in the stored model → file to copy there
    check_batches: list[dict[str, np.ndarray]]  # feeds the export check compares torch and ONNX on
    feeds: Feeds  # rows → engine inputs
    calibration: Split
    evaluation: dict[str, Split]  # slice name → rows the gate judges every variant on
    profiling: Split  # real rows that timed batches are drawn from
    training: Split | None = None
    threshold: Split | None = None  # where a cascade's threshold is calibrated, never judged on
    judged_on: str = ""  # which data calibrated and judged the model, for the report: the user's or the samples


class PipelineTask(ABC):
    name: ClassVar[Task]
    recipe: ClassVar[type[RecipeBase]]  # its recipe schema (pipeline/recipe.py), with the metrics a budget may bound
    runtime: ClassVar[type[ModelRuntime]]  # the serving runtime that runs its models

    @abstractmethod
    def serving_graph(self, recipe: RecipeBase, source: SourceModel) -> ServingGraph:
        """The source model wrapped as the service calls it: pre- and post-processing inside."""

    @abstractmethod
    def prepare(self, loaded: LoadedRecipe, source: SourceModel, graph: ServingGraph, workdir: Path) -> TaskData:
        """Spec, files, feeds and the separate calibration, evaluation, profiling and training data."""

    @abstractmethod
    def judge(
        self, reference: np.ndarray, candidate: np.ndarray, labels: np.ndarray | None, groups: list | None = None
    ) -> SliceFigures:
        """The task's metrics of a candidate's outputs against the reference's, with their bounds
        (`groups`: each row's source, where rows share sources)."""

    @abstractmethod
    def monitoring_reference(self, name: str, split: Split, outputs: np.ndarray) -> MonitoringReference:
        """The distribution of each statistic the service monitors (serving/monitoring.py) on an
        evaluation slice `name` and the reference model's outputs for it."""

    @abstractmethod
    def agreement(self, reference: np.ndarray, candidate: np.ndarray) -> float:
        """One score in [0, 1] of how closely a batch of outputs follows the reference's (1: the
        same answers), for quantizers that steer by it."""

    def top1_agreement(self, reference: np.ndarray, candidate: np.ndarray) -> float | None:
        """Classifiers: the share of rows whose top class is the reference's (the export check
        bounds it); None for tasks without classes."""
        return None

    @abstractmethod
    def distill(self, teacher: torch.nn.Module, training: Split, feeds: Feeds, settings: Student) -> torch.nn.Module:
        """A smaller serving graph trained to imitate `teacher` (a serving graph) on `training`."""
