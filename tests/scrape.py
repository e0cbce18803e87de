"""A running server's Prometheus series, as the tests read them."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def samples(client: httpx.Client, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of the metric `name` (as exported, e.g. with `_total`) on the server's /metrics."""
    families = text_string_to_metric_families(client.get("/metrics").text)
    return [(s.labels, s.value) for f in families for s in f.samples if s.name == name]
