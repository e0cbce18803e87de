"""Prediction and input monitoring: what a served model is asked and answers, against what it was
evaluated on.

Per request, from what the front already holds (no pass over pixels beyond one mean over every
fourth row of the resized array): classifiers record the decoded image's width and height, its
mean brightness, the top-1 confidence and the predicted class; embedders the text's tokens, the
embedding's norm and its distance to the centroid of the evaluation embeddings. Each goes into a
Prometheus histogram (classes into a counter).

The pipeline stores the distribution of each statistic on the model's held-out evaluation data in
its metadata (`monitoring`: bin edges and proportions, computed by the same functions below). The
service keeps the last `OPTISERVE_DRIFT_WINDOW` values of each statistic and, at most every
`OPTISERVE_DRIFT_INTERVAL_S`, once the window is full, exports their population stability index
against the reference as `optiserve_drift_psi{endpoint, model, statistic}`: 0 for the same
distribution, above 0.25 a major shift. A model stored before references were recorded is served
with the raw statistics only and no drift gauge. Bulk jobs are not monitored: one job of 20 000
texts would fill every window with a single client's data.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, model_validator

from serving.settings import drift_interval_s, drift_window, monitoring_enabled

logger = logging.getLogger(__name__)

MONITORING_KEY = "monitoring"  # the stored model's metadata key
REFERENCE_BINS = 10  # quantile bins of the reference, before ties merge them
DRIFT_METRIC = "optiserve_drift_psi"
PREDICTIONS_METRIC = "optiserve_predictions"  # prometheus_client appends _total
LABELS = ("endpoint", "model")


@dataclass(frozen=True)
class Statistic:
    """One monitored quantity: its histogram and the resolution below which values count as equal
    (the token count is whole, an L2-normalized embedding's norm is 1 to float noise)."""

    metric: str
    help: str
    buckets: tuple[float, ...]
    resolution: float


_SIDES = (16, 32, 64, 128, 224, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192)
STATISTICS: dict[str, Statistic] = {
    "width": Statistic("optiserve_image_width_pixels", "Decoded image width", _SIDES, 1.0),
    "height": Statistic("optiserve_image_height_pixels", "Decoded image height", _SIDES, 1.0),
    "brightness": Statistic(
        "optiserve_image_brightness", "Mean pixel value (0-255) of the resized image", tuple(range(16, 256, 16)), 1.0
    ),
    "confidence": Statistic(
        "optiserve_prediction_confidence",
        "Top-1 class probability",
        (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99),
        0.01,
    ),
    "tokens": Statistic(
        "optiserve_text_tokens", "Tokens per text, special tokens included", (4, 8, 16, 32, 64, 128, 256, 512), 1.0
    ),
    "norm": Statistic(
        "optiserve_embedding_norm", "L2 norm of the embedding", (0.5, 0.9, 0.99, 0.999, 1.001, 1.01, 1.1, 2.0), 1e-3
    ),
    "centroid_distance": Statistic(
        "optiserve_embedding_centroid_distance",
        "Euclidean distance of the embedding to the centroid of the evaluation embeddings",
        (0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5, 2.0),
        1e-3,
    ),
}


class Reference(BaseModel):
    """A statistic's distribution on `size` evaluation values: the share of them in each bin.
    Bin 0 holds values below `edges[0]`, bin i those in [edges[i-1], edges[i]), the last those at or
    above `edges[-1]`; the two outer bins are empty in the reference by construction."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    edges: list[float]
    proportions: list[float]
    size: int

    @model_validator(mode="after")
    def _consistent(self) -> Reference:
        if len(self.edges) < 2 or np.any(np.diff(self.edges) <= 0):
            raise ValueError("a reference needs at least two strictly increasing edges")
        if len(self.proportions) != len(self.edges) + 1 or not math.isclose(sum(self.proportions), 1.0):
            raise ValueError("a reference needs one proportion per bin, summing to 1")
        return self

    @classmethod
    def of(cls, values: np.ndarray, resolution: float, bins: int = REFERENCE_BINS) -> Reference:
        """Quantile bins of `values`, their edges half a `resolution` below a value (ties merge bins),
        the last half a resolution above the largest: a value one resolution off the reference's
        range falls outside it, float noise within one does not."""
        grid = np.round(np.quantile(values, np.linspace(0, 1, bins + 1)) / resolution)
        edges = np.unique(np.append(grid - 0.5, grid[-1] + 0.5)) * resolution
        counts = _counts(edges, values)
        return cls(edges=edges.tolist(), proportions=(counts / counts.sum()).tolist(), size=len(values))

    def psi(self, values: np.ndarray) -> float:
        """Population stability index of `values` against this reference, Σ (p − q)·ln(p / q), with
        one count added to every bin of both (Laplace): an empty bin would make it infinite, and the
        reference's own range, from a sample, is a little narrower than its population's."""
        bins = len(self.proportions)
        observed = (_counts(np.asarray(self.edges), values) + 1) / (len(values) + bins)
        expected = (np.asarray(self.proportions) * self.size + 1) / (self.size + bins)
        return float(np.sum((observed - expected) * np.log(observed / expected)))


def _counts(edges: np.ndarray, values: np.ndarray) -> np.ndarray:
    return np.bincount(np.searchsorted(edges, values, side="right"), minlength=len(edges) + 1)


class MonitoringReference(BaseModel):
    """What the pipeline stores under `monitoring` in a model's metadata."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    data: str  # the evaluation slice it was taken from
    statistics: dict[str, Reference]
    centroid: list[float] | None = None  # embedders: the mean evaluation embedding


def brightness(pixels: np.ndarray) -> np.ndarray:
    """Mean pixel value per image of a uint8 NHWC batch, over every fourth row of a large image:
    a fraction of a percent off the full mean at a quarter of its cost (~30 µs at 224²)."""
    step = max(1, pixels.shape[1] // 56)
    return pixels[:, ::step].reshape(len(pixels), -1).mean(axis=1)


def classifier_statistics(
    sizes: Sequence[tuple[int, int]], pixels: np.ndarray, probabilities: np.ndarray
) -> dict[str, np.ndarray]:
    """Per image: decoded (width, height), brightness of the model's input, top-1 probability."""
    sides = np.asarray(sizes, dtype=np.float64).reshape(-1, 2)
    return {
        "width": sides[:, 0],
        "height": sides[:, 1],
        "brightness": brightness(pixels),
        "confidence": probabilities.max(axis=1).astype(np.float64),
    }


def embedder_statistics(
    tokens: Sequence[int], embeddings: np.ndarray, centroid: np.ndarray | None
) -> dict[str, np.ndarray]:
    """Per text: its tokens, its embedding's norm and, given the reference centroid, the distance to it."""
    found = {"tokens": np.asarray(tokens, dtype=np.float64), "norm": np.linalg.norm(embeddings, axis=1)}
    if centroid is not None:
        found["centroid_distance"] = np.linalg.norm(embeddings - centroid, axis=1)
    return found


def reference_of(
    data: str, statistics: dict[str, np.ndarray], centroid: np.ndarray | None = None
) -> MonitoringReference:
    """The reference the pipeline stores, from the statistics of one evaluation slice."""
    return MonitoringReference(
        data=data,
        statistics={name: Reference.of(values, STATISTICS[name].resolution) for name, values in statistics.items()},
        centroid=None if centroid is None else centroid.tolist(),
    )


class Window:
    """The last `size` values of a statistic, in a ring."""

    def __init__(self, size: int) -> None:
        self._values = np.empty(size, dtype=np.float64)
        self._seen = 0

    @property
    def full(self) -> bool:
        return self._seen >= len(self._values)

    def add(self, values: np.ndarray) -> None:
        size = len(self._values)
        values = values[-size:]
        self._values[(self._seen + np.arange(len(values))) % size] = values
        self._seen += len(values)

    def values(self) -> np.ndarray:
        return self._values if self.full else self._values[: self._seen]


@cache
def _instruments() -> dict[str, Any]:
    """Registered once per process on first use, after BentoML set up multi-process metrics
    (serving/metrics.py says why). The drift gauge keeps the highest of the live workers' scores."""
    from prometheus_client import Counter, Gauge, Histogram

    found: dict[str, Any] = {
        name: Histogram(s.metric, s.help, LABELS, buckets=s.buckets) for name, s in STATISTICS.items()
    }
    found["predictions"] = Counter(PREDICTIONS_METRIC, "Predicted top-1 classes", (*LABELS, "class_id", "label"))
    found["drift"] = Gauge(
        DRIFT_METRIC,
        "Population stability index of a statistic's recent window against the evaluation data",
        (*LABELS, "statistic"),
        multiprocess_mode="livemax",
    )
    return found


def after_answer(observe: Callable[..., None], *args: Any) -> None:
    """Runs `observe(*args)` on the event loop once the current request has been answered: its
    statistics (a multi-process histogram per statistic, the drift windows) cost the loop about
    0.15 ms a photo, which a client at concurrency 1 would otherwise wait for, and a monitor that
    fails is logged by the loop instead of failing the request."""
    asyncio.get_running_loop().call_soon(observe, *args)


class ModelMonitor:
    """One served model's statistics, and their drift where the model carries a reference."""

    def __init__(
        self,
        *,
        endpoint: str,
        model: str,
        reference: MonitoringReference | None,
        class_names: Sequence[str] = (),
        window: int | None = None,
        interval_s: float | None = None,
    ) -> None:
        self._labels = {"endpoint": endpoint, "model": model}
        self._instruments = _instruments()
        self._histograms: dict[str, Any] = {}  # children made on first use: only the task's statistics show
        self._class_names = class_names
        self._classes: dict[int, Any] = {}
        self._reference = reference
        self._centroid = None if reference is None or reference.centroid is None else np.asarray(reference.centroid)
        size = window or drift_window()
        self._windows = {name: Window(size) for name in (reference.statistics if reference is not None else ())}
        self._interval_s = drift_interval_s() if interval_s is None else interval_s
        self._due = 0.0
        self._scored: set[str] = set()  # the statistics whose drift gauge has a score
        self._released = False

    @classmethod
    def of_stored(cls, endpoint: str, stored: Any, class_names: Sequence[str] = ()) -> ModelMonitor | None:
        """The monitor of a stored model (`bentoml.Model`); None where OPTISERVE_MONITORING=0. A
        model stored without a reference is monitored without drift, and the log says so once."""
        if not monitoring_enabled():
            return None
        raw = stored.info.metadata.get(MONITORING_KEY)
        if raw is None:
            logger.warning(
                "%s: %s was stored without a reference distribution (before monitoring): its statistics "
                "are exported, no drift score; `python -m pipeline --force` records one",
                endpoint,
                stored.tag,
            )
        reference = None if raw is None else MonitoringReference.model_validate(raw)
        return cls(endpoint=endpoint, model=str(stored.tag), reference=reference, class_names=class_names)

    def observe_classifications(
        self, sizes: Sequence[tuple[int, int]], pixels: np.ndarray, probabilities: np.ndarray
    ) -> None:
        self._record(classifier_statistics(sizes, pixels, probabilities))
        for class_id, count in zip(*np.unique(probabilities.argmax(axis=1), return_counts=True), strict=True):
            self._predicted(int(class_id)).inc(int(count))

    def observe_embeddings(self, ids: Sequence[Sequence[int]], embeddings: np.ndarray) -> None:
        self._record(embedder_statistics([len(row) for row in ids], embeddings, self._centroid))

    def _predicted(self, class_id: int) -> Any:
        child = self._classes.get(class_id)
        if child is None:
            label = self._class_names[class_id] if class_id < len(self._class_names) else str(class_id)
            child = self._classes[class_id] = self._instruments["predictions"].labels(
                **self._labels, class_id=str(class_id), label=label
            )
        return child

    def _record(self, statistics: dict[str, np.ndarray]) -> None:
        for name, values in statistics.items():
            histogram = self._histograms.get(name)
            if histogram is None:
                histogram = self._histograms[name] = self._instruments[name].labels(**self._labels)
            for value in values.tolist():
                histogram.observe(value)
            if name in self._windows:
                self._windows[name].add(values)
        now = time.monotonic()
        if self._windows and now >= self._due:
            self._due = now + self._interval_s
            self.update_drift()

    def update_drift(self) -> dict[str, float]:
        """Each full window's PSI against the reference, exported and returned; a score's gauge
        appears only then: at 0 before, it would say "no drift"."""
        if self._released:
            return {}
        scores = {
            name: self._reference.statistics[name].psi(window.values())
            for name, window in self._windows.items()
            if window.full
        }
        for name, score in scores.items():
            self._instruments["drift"].labels(**self._labels, statistic=name).set(score)
        self._scored |= scores.keys()
        return scores

    def release(self) -> None:
        """The model serves no more (a hot swap): its scores say nothing of the traffic now, and a
        gauge left at its last value would hold a drift alert on for ever. NaN compares true with
        no threshold; removing the series is not possible with multi-process metrics."""
        self._released = True
        for name in self._scored:
            self._instruments["drift"].labels(**self._labels, statistic=name).set(math.nan)
