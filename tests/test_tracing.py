"""Every answer names its request (`X-Request-ID`) and says where its time went (`Server-Timing`)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import own_home, serving
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from sample_inputs import sample_photos
from serving.tracing import EVERY_URL, bentoml_tracing, sane_request_id, trace_id

JPEG = {"Content-Type": "image/jpeg"}
GENERATED = re.compile(r"[0-9a-f]{32}")


def timings(response: httpx.Response) -> dict[str, float]:
    """Server-Timing's steps in milliseconds, in the order the header gives them."""
    found = {}
    for entry in response.headers["server-timing"].split(","):
        name, duration = entry.strip().split(";dur=")
        found[name] = float(duration)
    return found


@pytest.mark.parametrize("sent", ["abc-123", "trace:7f.2_b", "x" * 128])
def test_a_sane_client_id_is_kept(sent: str) -> None:
    assert sane_request_id(sent) == sent


@pytest.mark.parametrize("sent", [None, "", "has space", "x" * 129, "id\r\nSet-Cookie: a=b", "naïve"])
def test_a_missing_or_insane_client_id_is_replaced_by_a_new_one(sent: str | None) -> None:
    assert GENERATED.fullmatch(sane_request_id(sent))
    assert sane_request_id(sent) != sane_request_id(sent)


def test_with_no_exporter_configured_bentoml_opens_no_span_for_any_path(monkeypatch, tmp_path: Path) -> None:
    config = tmp_path / "bentoml.yaml"
    config.write_text(yaml.safe_dump({"services": {"optiserve": {"tracing": {"sample_rate": 1.0}}}}))
    monkeypatch.setenv("BENTOML_CONFIG", str(config))
    monkeypatch.setenv("BENTOML_CONFIG_OPTIONS", "api_server.workers=2 tracing.exporter_type=")
    assert bentoml_tracing("optiserve") == {"excluded_urls": [EVERY_URL]}
    assert re.search(EVERY_URL, "http://127.0.0.1:3000/embed")


@pytest.mark.parametrize(
    ("file", "options"),
    [
        ({"tracing": {"exporter_type": "otlp"}}, ""),  # BentoML's tracing section
        ({"services": {"optiserve": {"tracing": {"exporter_type": "zipkin"}}}}, ""),  # the service's own
        ({}, "services.optiserve.tracing.exporter_type=otlp"),  # an override of BENTOML_CONFIG_OPTIONS
    ],
)
def test_a_configured_exporter_keeps_bentomls_spans(monkeypatch, tmp_path: Path, file: dict, options: str) -> None:
    config = tmp_path / "bentoml.yaml"
    config.write_text(yaml.safe_dump(file))
    monkeypatch.setenv("BENTOML_CONFIG", str(config))
    monkeypatch.setenv("BENTOML_CONFIG_OPTIONS", options)
    assert bentoml_tracing("optiserve") == {}


def request_scope(*headers: tuple[bytes, bytes]) -> dict:
    return {"type": "http", "headers": list(headers)}


def test_without_a_span_the_trace_id_is_the_callers_traceparent_one() -> None:
    sent = (b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    assert trace_id(request_scope(sent)) == "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"traceparent", b"not a traceparent")],
        [(b"traceparent", b"00-00000000000000000000000000000000-00f067aa0ba902b7-01")],  # W3C: invalid id
    ],
)
def test_without_a_span_or_a_valid_traceparent_there_is_no_trace_id(headers: list) -> None:
    assert trace_id(request_scope(*headers)) is None


@pytest.mark.slow
def test_every_answer_carries_the_clients_id_or_a_generated_one(server) -> None:
    with server.client() as client:
        kept = client.post("/embed", json={"texts": ["hello"]}, headers={"X-Request-ID": "order-42"})
        replaced = client.post("/embed", json={"texts": ["hello"]}, headers={"X-Request-ID": "two words"})
        first, second = (client.post("/embed", json={"texts": ["hello"]}) for _ in range(2))
        assert client.post("/classify", content=sample_photos()["chelsea"], headers=JPEG).status_code == 200
        others = [  # the last is refused: the engine's speed is measured, and one photo takes over 1 ms
            client.get("/livez"),
            client.get("/no-such-path"),
            client.post("/embed", content=b"{not json", headers={"Content-Type": "application/json"}),
            client.post("/classify", content=b"not an image", headers=JPEG),
            client.post("/classify", content=sample_photos()["chelsea"], headers={**JPEG, "X-Deadline-Ms": "1"}),
        ]
    assert kept.status_code == 200 and kept.headers["x-request-id"] == "order-42"
    assert GENERATED.fullmatch(replaced.headers["x-request-id"])
    assert (
        GENERATED.fullmatch(first.headers["x-request-id"])
        and first.headers["x-request-id"] != second.headers["x-request-id"]
    )
    assert [r.status_code for r in others] == [200, 404, 422, 422, 503]
    for response in others:
        assert GENERATED.fullmatch(response.headers["x-request-id"]), response.request.url
        assert list(timings(response))[-1] == "total"


@pytest.mark.slow
def test_server_timing_breaks_an_embedding_and_a_classification_into_their_steps(server) -> None:
    with server.client() as client:
        embedded = client.post("/embed", json={"texts": ["The quick brown fox jumps over the lazy dog."]})
        classified = client.post("/classify", content=sample_photos()["chelsea"], headers=JPEG)
    assert embedded.status_code == classified.status_code == 200
    for response, steps in (
        (embedded, ["read", "tokenize", "queue", "infer", "total"]),
        (classified, ["read", "decode", "queue", "infer", "total"]),
    ):
        found = timings(response)
        assert list(found) == steps, response.headers["server-timing"]
        assert all(ms >= 0 for ms in found.values())
        assert found["infer"] > 0
        # The steps follow one another within the request: together they fit in its total.
        assert sum(ms for step, ms in found.items() if step != "total") <= found["total"] + 0.05


def access_lines(log: Path, request_id: str) -> list[dict]:
    """The access log's JSON lines for one request id, waiting a little for them to be written."""
    deadline = time.monotonic() + 10
    while True:
        found = []
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{") and f'"request_id":"{request_id}"' in line:
                found.append(json.loads(line))
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.mark.slow
def test_each_request_is_one_json_line_in_the_access_log(server) -> None:
    caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with server.client() as client:
        embedded = client.post(
            "/embed",
            json={"texts": ["hello"]},
            headers={"X-Request-ID": "log-embed-1", "traceparent": f"00-{caller_trace}-00f067aa0ba902b7-01"},
        )
        missing = client.get("/no-such-path", headers={"X-Request-ID": "log-404-1"})
    assert embedded.status_code == 200 and missing.status_code == 404

    (line,) = access_lines(server.log, "log-embed-1")
    assert (line["method"], line["path"], line["status"], line["model"]) == (
        "POST",
        "/embed",
        200,
        embedded.json()["model"],
    )
    assert list(line["ms"]) == [*timings(embedded)]  # the same steps as the answer's Server-Timing
    assert line["ms"]["total"] >= timings(embedded)["total"]  # to the last byte, the header's to the first
    assert line["trace_id"] == caller_trace  # no exporter here: the caller's trace, and no span of BentoML's
    assert datetime.fromisoformat(line["time"]).tzinfo is not None
    (other,) = access_lines(server.log, "log-404-1")
    assert (other["path"], other["status"], other["model"], other["trace_id"]) == ("/no-such-path", 404, None, None)
    log = server.log.read_text(errors="replace")
    assert "path=/embed" not in log, "BentoML's own access line is still written beside ours"


@contextmanager
def otlp_collector() -> Iterator[tuple[str, list[ExportTraceServiceRequest]]]:
    """An OTLP/HTTP trace collector on a free port: what BentoML's exporter sends, parsed."""
    received: list[ExportTraceServiceRequest] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            received.append(ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()


def exported_spans(received: list[ExportTraceServiceRequest]) -> list[tuple[str, str, str]]:
    """(trace id, service name, span name) of every span exported so far."""
    spans = []
    for request in list(received):
        for resource in request.resource_spans:
            service = next(a.value.string_value for a in resource.resource.attributes if a.key == "service.name")
            spans += [(s.trace_id.hex(), service, s.name) for scope in resource.scope_spans for s in scope.spans]
    return spans


@pytest.mark.slow
def test_bentomls_own_tracing_settings_export_each_requests_trace_over_otlp(manifest_file: Path, tmp_path) -> None:
    with otlp_collector() as (url, received):
        tracing = {
            "exporter_type": "otlp",
            "sample_rate": 1.0,
            "otlp": {"protocol": "http", "endpoint": f"{url}/v1/traces"},
        }
        config = tmp_path / "bentoml.yaml"
        config.write_text(yaml.safe_dump({"services": {"optiserve": {"tracing": tracing}}}))
        home = own_home(tmp_path / "home")
        with serving(manifest_file, tmp_path / "bentoml.log", BENTOML_CONFIG=str(config), BENTOML_HOME=home) as server:
            with server.client() as client:
                answer = client.post("/embed", json={"texts": ["traced"]}, headers={"X-Request-ID": "otlp-1"})
            assert answer.status_code == 200
            (line,) = access_lines(server.log, "otlp-1")
            deadline = time.monotonic() + 30  # the batch span processor exports every 5 s
            while not any(trace == line["trace_id"] for trace, _, _ in exported_spans(received)):
                assert time.monotonic() < deadline, (
                    f"no span of trace {line['trace_id']} exported: {exported_spans(received)}"
                )
                time.sleep(0.2)
    ours = [(service, name) for trace, service, name in exported_spans(received) if trace == line["trace_id"]]
    assert ("optiserve", "POST /embed") in ours, ours
