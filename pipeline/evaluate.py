"""Task metrics of a candidate against the FP32 reference, on held-out data.

Every metric is "higher is better" and the FP32 model's own score is the baseline, so a
budget is simply a maximum drop per metric.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pipeline.datasets import Split
from serving.model_spec import Task

Predict = Callable[[list], np.ndarray]


def run_batched(predict: Predict, split: Split, batch_size: int = 32) -> np.ndarray:
    return np.concatenate([predict(split.rows[i : i + batch_size]) for i in range(0, len(split), batch_size)])


def classification_metrics(reference: np.ndarray, candidate: np.ndarray, labels: np.ndarray | None) -> dict:
    reference_top1 = reference.argmax(-1)
    candidate_top5 = np.argsort(-candidate, axis=-1)[:, :5]
    figures = {
        "top1_agreement": float((candidate.argmax(-1) == reference_top1).mean()),
        # The reference's answer is still among the candidate's five best.
        "top5_agreement": float((candidate_top5 == reference_top1[:, None]).any(-1).mean()),
    }
    if labels is not None:
        figures["accuracy"] = float((candidate.argmax(-1) == labels).mean())
    return figures


def knn_agreement(reference: np.ndarray, candidate: np.ndarray, k: int = 10) -> float:
    """Mean overlap of each item's k nearest neighbours in the two embedding spaces."""
    k = min(k, len(reference) - 1)

    def neighbours(vectors: np.ndarray) -> np.ndarray:
        unit = vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)
        similarity = unit @ unit.T
        np.fill_diagonal(similarity, -np.inf)
        return np.argsort(-similarity, axis=-1)[:, :k]

    ours, theirs = neighbours(candidate), neighbours(reference)
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(ours, theirs, strict=True)]))


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64 * b64).sum(-1) / (np.linalg.norm(a64, axis=-1) * np.linalg.norm(b64, axis=-1) + 1e-12)


def embedding_metrics(reference: np.ndarray, candidate: np.ndarray) -> dict:
    cosine = row_cosines(reference, candidate)
    return {
        "mean_cosine": float(cosine.mean()),
        "min_cosine": float(cosine.min()),
        "knn10_agreement": knn_agreement(reference, candidate),
    }


def evaluate(task: Task, reference: np.ndarray, candidate: np.ndarray, labels: np.ndarray | None) -> dict:
    if task == "image-classification":
        return classification_metrics(reference, candidate, labels)
    return embedding_metrics(reference, candidate)


def drops(baseline: dict, figures: dict) -> dict:
    return {name: baseline[name] - value for name, value in figures.items()}
