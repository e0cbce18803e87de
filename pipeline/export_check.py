"""Post-export validation: the ONNX graph against the PyTorch model on real inputs.

Checks names and dynamic axes, then values over several batch shapes, and collects every
failure into one error instead of stopping at the first.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.evaluate import row_cosines
from pipeline.export import ServingGraph
from pipeline.recipe import ExportTolerance
from sample_inputs import sample_photos, sample_texts
from serving.classify import ImageUpload, prepare_image
from serving.engine import EngineSettings, OnnxEngine
from serving.model_spec import ImageInput
from serving.text import TextTokenizer, pad_batch

if TYPE_CHECKING:
    from pipeline.tasks import PipelineTask


class ExportCheckError(RuntimeError):
    def __init__(self, onnx_path: Path, failures: list[str]) -> None:
        super().__init__(f"export check failed for {onnx_path}:\n  - " + "\n  - ".join(failures))
        self.failures = failures


@dataclass(frozen=True)
class ExportCheck:
    samples: int
    batch_sizes: list[int]
    max_abs_diff: float
    min_cosine: float
    mean_cosine: float
    top1_agreement: float | None

    def as_metadata(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def image_batches(spec: ImageInput) -> list[dict[str, np.ndarray]]:
    """Sample photos through the serving pre-processing, grouped as batches of 1, 3 and all."""
    pixels = [prepare_image(ImageUpload(data, None, name), spec) for name, data in sample_photos().items()]
    return [{"images": np.stack(group)} for group in (pixels[:1], pixels[1:4], pixels)]


def text_batches(tokenizer_file: Path, max_length: int) -> list[dict[str, np.ndarray]]:
    """The sample sentences at batch sizes 1, several and all, and a text of the recipe's whole
    `max_length` beside a short one: the sentences stop near 180 tokens, and a model whose
    positions end before `max_length` would pass on them and fail in the service."""
    tokenizer = TextTokenizer(tokenizer_file, max_length=max_length)
    texts = sample_texts()
    rows = tokenizer.encode(texts, truncate=True)
    (longest,) = tokenizer.encode([" ".join(texts * math.ceil(max_length / len(texts)))], truncate=True)
    return [pad_batch(group, tokenizer.pad_id) for group in (rows[:1], rows[1:6], rows, [longest, rows[0]])]


def _signature_failures(engine: OnnxEngine, graph: ServingGraph) -> list[str]:
    failures = []
    if engine.input_names != graph.input_names:
        failures.append(f"inputs are {engine.input_names}, expected {graph.input_names}")
    if engine.output_names != graph.output_names:
        failures.append(f"outputs are {engine.output_names}, expected {graph.output_names}")
    for tensor in engine.session.get_inputs():
        for axis, name in graph.dynamic_axes.get(tensor.name, {}).items():
            if not isinstance(tensor.shape[axis], str):
                failures.append(f"input {tensor.name} axis {axis} ({name}) is fixed at {tensor.shape[axis]}")
    return failures


def check_export(
    task: PipelineTask,
    tolerance: ExportTolerance,
    graph: ServingGraph,
    onnx_path: Path,
    batches: list[dict[str, np.ndarray]],
) -> ExportCheck:
    engine = OnnxEngine(onnx_path, EngineSettings.from_environment())
    failures = _signature_failures(engine, graph)
    references, candidates = [], []
    for feeds in batches:
        with torch.inference_mode():
            expected = graph.module(*(torch.from_numpy(feeds[name]) for name in graph.input_names))
        references.append(expected.numpy())
        candidates.append(engine.run(feeds)[graph.output_names[0]])
    reference, candidate = np.concatenate(references), np.concatenate(candidates)
    cosines = row_cosines(reference, candidate)
    check = ExportCheck(
        samples=len(reference),
        batch_sizes=[len(r) for r in references],
        max_abs_diff=float(np.abs(reference - candidate).max()),
        min_cosine=float(cosines.min()),
        mean_cosine=float(cosines.mean()),
        top1_agreement=task.top1_agreement(reference, candidate),
    )
    if check.max_abs_diff > tolerance.max_abs_diff:
        failures.append(
            f"max abs diff {check.max_abs_diff:.3g} > export.tolerance.max_abs_diff {tolerance.max_abs_diff}"
        )
    if check.min_cosine < tolerance.min_cosine:
        failures.append(f"min cosine {check.min_cosine:.6f} < export.tolerance.min_cosine {tolerance.min_cosine}")
    if check.top1_agreement is not None and check.top1_agreement < tolerance.min_top1_agreement:
        failures.append(
            f"top-1 agreement {check.top1_agreement:.3f} < export.tolerance.min_top1_agreement "
            f"{tolerance.min_top1_agreement}"
        )
    if failures:
        raise ExportCheckError(onnx_path, failures)
    return check
