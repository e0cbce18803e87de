"""Sentence embedding: token ids in, pooled vectors out (as the model directory says), judged by cosine to FP32."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.datasets import Split, text_split
from pipeline.evaluate import SliceFigures, embedding_figures, row_cosines
from pipeline.export import TEXT_INPUTS, TEXT_OUTPUT, SentenceEmbeddingGraph, ServingGraph
from pipeline.export_check import text_batches
from pipeline.own_data import own_texts
from pipeline.recipe import REQUESTS_FIELD, TEXTS_FIELD, TextEmbeddingRecipe, request_texts
from pipeline.sentence_config import lowercasing_tokenizer
from pipeline.students import distill_embeddings, layer_subset_student
from pipeline.tasks.base import PipelineTask, TaskData
from pipeline.tuning import HELD_OUT
from pipeline.variants.base import Feeds
from serving.model_runtime import TextModelRuntime
from serving.model_spec import TOKENIZER_FILE, ModelSpec, TextInput
from serving.monitoring import MonitoringReference, embedder_statistics, reference_of
from serving.text import TextTokenizer, pad_batch

if TYPE_CHECKING:
    from pipeline.recipe import LoadedRecipe, Student
    from pipeline.sources import SourceModel

DISTILLATION_BATCH = 32


class TextEmbedding(PipelineTask):
    name = "text-embedding"
    recipe = TextEmbeddingRecipe
    runtime = TextModelRuntime

    def serving_graph(self, recipe: TextEmbeddingRecipe, source: SourceModel) -> ServingGraph:
        # Example with real padding: an all-ones mask lets the tracer drop masking from the graph.
        # Ids the vocabulary has: a small one (characters, amino acids) failed with "index out of range".
        high = min(2000, source.module.config.vocab_size)
        input_ids = torch.randint(high // 2, high, (2, 16))
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, 9:] = 0
        return ServingGraph(
            module=SentenceEmbeddingGraph(source.module, source.pooling).eval(),
            input_names=list(TEXT_INPUTS),
            output_names=[TEXT_OUTPUT],
            example_inputs=(input_ids, attention_mask),
            dynamic_axes={
                "input_ids": {0: "batch", 1: "sequence"},
                "attention_mask": {0: "batch", 1: "sequence"},
                TEXT_OUTPUT: {0: "batch"},
            },
        )

    def prepare(self, loaded: LoadedRecipe, source: SourceModel, graph: ServingGraph, workdir: Path) -> TaskData:
        """Splits the recipe's own texts where it gives them, else the sample corpus; profiles on
        the recipe's file of real requests where it names one, else on that data's profiling part."""
        recipe = loaded.recipe
        tokenizer_file = source.model_dir / TOKENIZER_FILE
        if source.lowercase:
            tokenizer_file = lowercasing_tokenizer(tokenizer_file, workdir / "lowercasing" / TOKENIZER_FILE)
        config = source.module.config
        text = TextInput(
            max_length=recipe.text.max_length, pad_token_id=config.pad_token_id or 0, dimensions=config.hidden_size
        )
        tokenizer = TextTokenizer(tokenizer_file, max_length=recipe.text.max_length)

        def encode(texts: list[str]) -> list[list[int]]:
            return tokenizer.encode(texts, truncate=True)

        requests = loaded.files.get(REQUESTS_FIELD)
        texts = own_texts(loaded)
        calibration, evaluation = (text_split(encode, part, texts) for part in ("calibration", "evaluation"))
        judged_on = (
            f"the recipe's {TEXTS_FIELD} ({loaded.files[TEXTS_FIELD]}): {len(texts)} texts"
            if texts
            else "the built-in pydoc_data sentences"
        )
        return TaskData(
            spec=ModelSpec(task=self.name, text=text, input_names=graph.input_names, output_names=graph.output_names),
            files={TOKENIZER_FILE: tokenizer_file},
            check_batches=text_batches(tokenizer_file, recipe.text.max_length),
            feeds=lambda rows: pad_batch(rows, tokenizer.pad_id),
            calibration=calibration,
            evaluation={HELD_OUT: evaluation},
            profiling=Split(encode(request_texts(requests))) if requests else text_split(encode, "profiling", texts),
            training=text_split(encode, "training", texts),
            judged_on=f"{judged_on}, {len(evaluation)} judged and {len(calibration)} calibrated on",
        )

    def judge(
        self, reference: np.ndarray, candidate: np.ndarray, labels: np.ndarray | None, groups: list | None = None
    ) -> SliceFigures:
        """Sentences are distinct inputs: no sources to count."""
        return embedding_figures(reference, candidate)

    def monitoring_reference(self, name: str, split: Split, outputs: np.ndarray) -> MonitoringReference:
        centroid = outputs.astype(np.float64).mean(axis=0)
        statistics = embedder_statistics([len(row) for row in split.rows], outputs, centroid)
        return reference_of(name, statistics, centroid)

    def agreement(self, reference: np.ndarray, candidate: np.ndarray) -> float:
        return float(row_cosines(reference, candidate).mean())

    def distill(self, teacher: torch.nn.Module, training: Split, feeds: Feeds, settings: Student) -> torch.nn.Module:
        """An evenly spread subset of the teacher's layers, trained on its embeddings and token states."""
        student = SentenceEmbeddingGraph(layer_subset_student(teacher.model, settings.layers), teacher.pooling)
        rows = sorted(training.rows, key=len)  # length buckets: little padding, much faster
        batches = [feeds(rows[i : i + DISTILLATION_BATCH]) for i in range(0, len(rows), DISTILLATION_BATCH)]
        return distill_embeddings(teacher, student, batches, epochs=settings.epochs)
