"""The server-side breakdown, from two scrapes of a Prometheus /metrics page.

Histograms are cumulative, so the mean over a span is Δsum / Δcount between a scrape at its
start and one at its end. Works with optiserve's own series (serving/metrics.py) and BentoML's
request durations; another server simply yields no breakdown.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

QUEUE = "optiserve_batch_queue_seconds"
INFERENCE = "optiserve_inference_seconds"
ROWS = "optiserve_batch_rows"
REQUEST_DURATION = "bentoml_service_request_duration_seconds"
MODEL_METHOD = "/predict"  # the model services' batched method (service.py)
RESIDENT = "optiserve_workers_resident_memory_bytes"  # a gauge: read as it is at a span's end

Labels = frozenset[tuple[str, str]]
Snapshot = dict[tuple[str, Labels], float]


def parse(text: str) -> Snapshot:
    """Every `_sum` and `_count` sample of the page, and the workers' memory, keyed by (sample
    name, labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    snapshot: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")) or sample.name == RESIDENT:
                snapshot[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return snapshot


@dataclass(frozen=True)
class Breakdown:
    """Means over one span. `front_ms` is BentoML's own duration of the endpoint under test;
    `model_service_ms` its duration of the batched model method (`/predict`) in the model
    services, so front_ms − model_service_ms is the front's own share (parsing, decoding,
    the client side of the call) and model_service_ms − queue − inference the model
    service's (deserialization, batching, serialization). With the models in the front process
    (the default) there is no `/predict` and `model_service_ms` is None. `workers_mib`: the
    service workers' resident memory at the span's end, where the server exports it."""

    queue_ms: float | None
    inference_ms: float | None
    batch_rows: float | None
    batches: int
    model_requests: int
    front_ms: float | None
    model_service_ms: float | None
    workers_mib: float | None = None


def metrics_url(url: str) -> str:
    """The /metrics page of the server that `url` is on."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/metrics", "", ""))


def endpoint_label(path: str, exported: Snapshot) -> str:
    """The `endpoint` label of the model route a URL path feeds: '/classify_batch' → 'classify',
    '/embed' → 'embed', '/models/digits/classify' → 'digits', unless the server exports nothing of
    that name: a default endpoint's model, whose own path shares the default's route."""
    parts = path.strip("/").split("/")
    operation = parts[-1].split("_", 1)[0]
    if len(parts) == 3 and parts[0] == "models" and any(("endpoint", parts[1]) in labels for _, labels in exported):
        return parts[1]
    return operation


def breakdown(before: Snapshot, after: Snapshot, *, path: str) -> Breakdown | None:
    """None when the server exports none of these series (not an optiserve / BentoML server)."""
    endpoint = endpoint_label(path, after)

    def delta(metric: str, suffix: str, match: dict[str, str]) -> float:
        total = 0.0
        for (name, labels), value in after.items():
            if name == metric + suffix and all((k, v) in labels for k, v in match.items()):
                total += value - before.get((name, labels), 0.0)
        return total

    def mean(metric: str, match: dict[str, str], scale: float = 1.0) -> float | None:
        count = delta(metric, "_count", match)
        return scale * delta(metric, "_sum", match) / count if count > 0 else None

    if not any(name.startswith(("optiserve_", "bentoml_")) for name, _ in after):
        return None
    model = {"endpoint": endpoint}
    return Breakdown(
        queue_ms=mean(QUEUE, model, 1000),
        inference_ms=mean(INFERENCE, model, 1000),
        batch_rows=mean(ROWS, model),
        batches=round(delta(INFERENCE, "_count", model)),
        model_requests=round(delta(QUEUE, "_count", model)),
        front_ms=mean(REQUEST_DURATION, {"endpoint": "/" + path.strip("/")}, 1000),
        model_service_ms=mean(REQUEST_DURATION, {"endpoint": MODEL_METHOD}, 1000),
        workers_mib=after[(RESIDENT, frozenset())] / 2**20 if (RESIDENT, frozenset()) in after else None,
    )
