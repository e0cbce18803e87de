"""The tasks the pipeline knows, one module each: a new task is a module and a line here
(and its recipe schema in pipeline/recipe.py, its runtime in serving/model_runtime.py)."""

from __future__ import annotations

from pipeline.tasks.base import PipelineTask, TaskData
from pipeline.tasks.image_classification import ImageClassification
from pipeline.tasks.text_embedding import TextEmbedding

TASKS: dict[str, PipelineTask] = {task.name: task for task in (ImageClassification(), TextEmbedding())}

__all__ = ["TASKS", "PipelineTask", "TaskData"]
