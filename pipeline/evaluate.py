"""Task metrics of a candidate against the FP32 reference, on held-out data, with the confidence
the data allows.

Every metric but one is "higher is better" and is 1.0 for the reference against itself
(accuracy: the reference's own accuracy), so a budget is a maximum drop per metric; the
exception, `kl_divergence`, is 0 for the reference and its "drop" is its value. The gate decides on the
drop's one-sided 95 % upper confidence bound, not on the point value: 32 images that all agree
cannot show a 1 % budget holds (the bound is 7.8 %); 1 024 can (0.26 %).

Rows made from one source (the views of one photo, the moved copies of one digit) are not
independent inputs: they agree or disagree with the reference together (INT8 EfficientNet-Lite0
kept 0.98 of one photo's views and 0.66 of another's). Where a slice names each row's source, the
bound is also taken with the sources as the units (a cluster-robust standard error and Student's
t with one degree of freedom fewer than there are sources), and the wider of the two decides.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from pydantic import BaseModel
from scipy.stats import t as student_t

from pipeline.datasets import Split

Predict = Callable[[list], np.ndarray]
Z_95 = 1.6449  # one-sided 95 %
TOP_K = 5  # top5_agreement, top5_overlap


class SliceFigures(BaseModel):
    """One evaluation slice: point figures, their drops from the reference, and each drop's
    one-sided 95 % upper confidence bound (what the gate decides on)."""

    size: int
    metrics: dict[str, float]
    drops: dict[str, float]
    drop_bounds: dict[str, float]


def run_batched(predict: Predict, split: Split, batch_size: int = 32) -> np.ndarray:
    return np.concatenate([predict(split.rows[i : i + batch_size]) for i in range(0, len(split), batch_size)])


def wilson_upper(count: int, n: int, z: float = Z_95) -> float:
    """Upper confidence bound of a proportion (Wilson score): sound at 0 of n, where the normal
    approximation claims certainty."""
    p = count / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z * z / n))


def clustered_upper(values: np.ndarray, sources: np.ndarray) -> float:
    """One-sided 95 % upper bound of the mean of `values` with the sources (`sources[i]`: row i's,
    0 … k − 1) as the units sampled: cluster-robust standard error, Student's t at k − 1 degrees
    of freedom. With a single source there is no spread between sources to measure: -inf, so that
    the rows' own bound stands."""
    count = int(sources.max()) + 1
    if count < 2:
        return -math.inf
    mean = float(values.mean())
    totals = np.bincount(sources, weights=values, minlength=count)
    sizes = np.bincount(sources, minlength=count)
    variance = count / (count - 1) * float(np.sum((totals - mean * sizes) ** 2)) / len(values) ** 2
    return mean + float(student_t.ppf(0.95, count - 1)) * math.sqrt(variance)


class _Figures:
    """Collects (metric, drop, bound) per metric for one slice; `groups`: each row's source, where
    rows share sources."""

    def __init__(self, n: int, groups: Sequence | None = None) -> None:
        self.n, self.metrics, self.drops, self.bounds = n, {}, {}, {}
        self.sources = None if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1].ravel()

    def paired(self, name: str, candidate_right: np.ndarray, reference_right: np.ndarray) -> None:
        """A 0/1 score per item: the drop is the share lost less the share gained; its bound takes
        the Wilson bound of the share lost (or the sources' bound, if wider)."""
        lost_rows = reference_right & ~candidate_right
        lost = int(lost_rows.sum())
        gained = int((candidate_right & ~reference_right).sum())
        self.metrics[name] = float(candidate_right.mean())
        self.drops[name] = (lost - gained) / self.n
        self.bounds[name] = self._wider(wilson_upper(lost, self.n), lost_rows.astype(np.float64)) - gained / self.n

    def mean(self, name: str, scores: np.ndarray) -> None:
        """A score in [0, 1] per item, 1 for the reference: the normal bound of the mean."""
        self.metrics[name] = float(scores.mean())
        self._normal(name, 1.0 - scores)

    def divergence(self, name: str, scores: np.ndarray) -> None:
        """A divergence per item, 0 for the reference: the mean is the drop, with its normal bound."""
        self.metrics[name] = float(scores.mean())
        self._normal(name, scores)

    def _normal(self, name: str, row_drops: np.ndarray) -> None:
        spread = float(row_drops.std(ddof=1)) if self.n > 1 else 0.0
        drop = float(row_drops.mean())
        self.drops[name] = drop
        self.bounds[name] = self._wider(drop + Z_95 * spread / math.sqrt(self.n), row_drops)

    def _wider(self, bound: float, row_values: np.ndarray) -> float:
        """`bound`, taken over rows, or the one over sources where the rows have them, whichever is wider."""
        return bound if self.sources is None else max(bound, clustered_upper(row_values, self.sources))

    def extreme(self, name: str, value: float) -> None:
        """A worst case (min cosine) has no interval: its bound is the value itself."""
        self.metrics[name], self.drops[name], self.bounds[name] = value, 1.0 - value, 1.0 - value

    def result(self) -> SliceFigures:
        return SliceFigures(size=self.n, metrics=self.metrics, drops=self.drops, drop_bounds=self.bounds)


def classification_figures(
    reference: np.ndarray, candidate: np.ndarray, labels: np.ndarray | None, groups: Sequence | None = None
) -> SliceFigures:
    figures = _Figures(len(reference), groups)
    # "Top 5" of a model with fewer classes is all of them: overlap is over what there is to keep.
    k = min(TOP_K, reference.shape[-1])
    reference_top1 = reference.argmax(-1)
    reference_top5 = np.argsort(-reference, axis=-1)[:, :k]
    candidate_top5 = np.argsort(-candidate, axis=-1)[:, :k]
    everyone = np.ones(len(reference), dtype=bool)
    figures.paired("top1_agreement", candidate.argmax(-1) == reference_top1, everyone)
    # The reference's answer is still among the candidate's five best.
    figures.paired("top5_agreement", (candidate_top5 == reference_top1[:, None]).any(-1), everyone)
    # How much of the reference's top five the candidate keeps: moves before top-1 does.
    overlap = np.array([len(set(a) & set(b)) / k for a, b in zip(candidate_top5, reference_top5, strict=True)])
    figures.mean("top5_overlap", overlap)
    # KL(reference ‖ candidate) in nats: how far the whole distribution moved, top-1 or not.
    p, q = np.clip(reference, 1e-12, None), np.clip(candidate, 1e-12, None)
    figures.divergence("kl_divergence", (p * np.log(p / q)).sum(-1))
    if labels is not None:
        figures.paired("accuracy", candidate.argmax(-1) == labels, reference_top1 == labels)
    return figures.result()


def knn_overlap(reference: np.ndarray, candidate: np.ndarray, k: int = 10) -> np.ndarray:
    """Per item: the overlap of its k nearest neighbours in the two embedding spaces."""
    k = min(k, len(reference) - 1)

    def neighbours(vectors: np.ndarray) -> np.ndarray:
        unit = vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)
        similarity = unit @ unit.T
        np.fill_diagonal(similarity, -np.inf)
        return np.argsort(-similarity, axis=-1)[:, :k]

    ours, theirs = neighbours(candidate), neighbours(reference)
    return np.array([len(set(a) & set(b)) / k for a, b in zip(ours, theirs, strict=True)])


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64 * b64).sum(-1) / (np.linalg.norm(a64, axis=-1) * np.linalg.norm(b64, axis=-1) + 1e-12)


def embedding_figures(reference: np.ndarray, candidate: np.ndarray) -> SliceFigures:
    figures = _Figures(len(reference))
    cosine = row_cosines(reference, candidate)
    figures.mean("mean_cosine", cosine)
    figures.extreme("min_cosine", float(cosine.min()))
    figures.mean("knn10_agreement", knn_overlap(reference, candidate))
    return figures.result()
