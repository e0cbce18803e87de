"""The OpenAPI document at /docs.json: BentoML's, made true to what the service answers.

BentoML generates the document from the input and output specs, with one error list for every
API (its own 400, 404 and 500 bodies). Our endpoints answer other statuses, in our own error
schema; /classify also takes a raw image body; and BentoML's task routes answer task states
(`completed`, `failed`) its own schema does not list; BentoML keeps only the first member
of a union; every answer names its model in a header; refusals say when to retry; and the
endpoints read headers and query parameters besides their body. A client generator or a fuzzer that
trusts the document should find it right, so the service serves it amended (`amend`).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from serving.api import DEFAULT_TOP_K, MAX_TOP_K, MODEL_TAG_HEADER
from serving.door import DEADLINE_HEADER, MAX_DEADLINE_MS, PRIORITIES, PRIORITY_HEADER
from serving.schemas import EmbedResponse, ErrorBody
from serving.tracing import REQUEST_ID_HEADER

DOCUMENT_PATH = "/docs.json"
SCHEMA_PATH = "/schema.json"  # BentoML's description of its APIs, which its clients read
ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
# The statuses each endpoint answers with our error body (README, "The HTTP API").
ERROR_STATUSES = {
    400: "Empty input",
    408: "The body did not arrive in time",
    413: "Too large: body, image, item count or text length",
    415: "Unsupported content type or image format",
    422: "Invalid or undecodable input",
    429: "The model's queue is full (Retry-After)",
    500: "A fault of ours (details only in the server log)",
    503: "Overloaded: refused for its deadline (Retry-After), or no model configured",
}
OPERATIONS = ("classify", "classify_batch", "embed", "embed_bulk")  # at / and at each model's /models/<name>/
RAW_IMAGE_TYPES = ("image/jpeg", "image/png", "image/webp", "image/bmp", "application/octet-stream")
TASK_STATES = ["in_progress", "completed", "failed", "canceled"]
MODEL_TAG = {
    "description": "the stored model that produced the answer (serving/lifecycle.py)",
    "schema": {"type": "string"},
}


RETRY_AFTER = {
    "description": "seconds to wait before sending the request again",
    "schema": {"type": "string", "pattern": "^[0-9]+$"},
}


def error_responses() -> dict[str, Any]:
    responses = {
        str(status): {"description": text, "content": {"application/json": {"schema": ERROR_REF}}}
        for status, text in ERROR_STATUSES.items()
    }
    for status in ("429", "503"):
        responses[status]["headers"] = {"Retry-After": RETRY_AFTER}
    return responses


def parameters(operation: str) -> list[dict[str, Any]]:
    """What a model endpoint reads besides its body (README, "The HTTP API")."""
    priority = {"type": "string", "enum": list(PRIORITIES), "default": "normal"}
    found = [
        {
            "name": REQUEST_ID_HEADER,
            "in": "header",
            "description": "the request's id, echoed: one of 1-128 letters, digits and ._:- is kept, "
            "another replaced; it picks the request's side of a canary split",
            "schema": {"type": "string"},
        },
        {
            "name": DEADLINE_HEADER,
            "in": "header",
            "description": "the client's deadline, milliseconds from the request's arrival: it only shortens the "
            "server's",
            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_DEADLINE_MS},
        },
        {"name": PRIORITY_HEADER, "in": "header", "description": "low: shed first, batched apart", "schema": priority},
        {"name": "priority", "in": "query", "description": f"as the {PRIORITY_HEADER} header", "schema": priority},
    ]
    if operation.startswith("classify"):
        top_k = {"type": "integer", "minimum": 1, "maximum": MAX_TOP_K, "default": DEFAULT_TOP_K}
        found.append({"name": "top_k", "in": "query", "description": "predictions per image", "schema": top_k})
    return found


def bentoml_error(description: str) -> dict[str, Any]:
    """The body BentoML's own task routes answer errors with."""
    schema = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def amend(document: dict[str, Any]) -> dict[str, Any]:
    paths, schemas = document["paths"], document["components"]["schemas"]
    schemas["ErrorBody"] = ErrorBody.model_json_schema()
    endpoints = {path: path.rsplit("/", 1)[1] for path in paths if path.rsplit("/", 1)[1] in OPERATIONS}
    for path, name in endpoints.items():
        operation = paths[path]["post"]
        operation["responses"] = {"200": operation["responses"]["200"], **error_responses()}
        operation["responses"]["200"]["headers"] = {MODEL_TAG_HEADER: MODEL_TAG}
        operation["parameters"] = [*operation.get("parameters", []), *parameters(name)]
    # BentoML keeps only the first member of a union: embeddings are float lists or base64 strings.
    embeddings = EmbedResponse.model_json_schema()["properties"]["embeddings"]
    embedding = [(path, "post") for path, operation in endpoints.items() if operation.startswith("embed")]
    for path, method in [*embedding, ("/embed_bulk/get", "get")]:
        schema = paths[path][method]["responses"]["200"]["content"]["application/json"]["schema"]
        schema["properties"]["embeddings"] = embeddings
    raw = {"schema": {"type": "string", "format": "binary"}}
    for path in (path for path, operation in endpoints.items() if operation.startswith("classify")):
        paths[path]["post"]["requestBody"]["content"].update(dict.fromkeys(RAW_IMAGE_TYPES, raw))
    status = schemas["TaskStatusResponse"]
    status["properties"]["status"]["enum"] = TASK_STATES
    status["required"] = ["task_id", "status"]  # submit and retry answer these two only
    task_errors = {"400": bentoml_error("task_id missing, task not finished"), "404": bentoml_error("no such task")}
    for path, method in (("/embed_bulk/submit", "post"), ("/embed_bulk/status", "get"), ("/embed_bulk/retry", "post")):
        paths[path][method]["responses"] = {"200": paths[path][method]["responses"]["200"], **task_errors}
    result = paths["/embed_bulk/get"]["get"]
    result["responses"] = {"200": result["responses"]["200"], **error_responses(), **task_errors}
    result["responses"]["400"] = {
        "description": "task not finished, or the task's own 400",
        "content": {
            "application/json": {
                "schema": {"anyOf": [ERROR_REF, task_errors["400"]["content"]["application/json"]["schema"]]}
            }
        },
    }
    cancel = paths["/embed_bulk/cancel"]["put"]
    cancel["responses"] = {"400": bentoml_error("cancellation is not supported by the local server"), **task_errors}
    return document


def amend_service_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """BentoML's clients read /schema.json, where BentoML also kept only the first member of the
    embeddings' union: they decoded each base64 vector into a list of its characters."""
    embeddings = EmbedResponse.model_json_schema()["properties"]["embeddings"]
    for route in schema["routes"]:
        properties = route.get("output", {}).get("properties", {})
        if "embeddings" in properties:
            properties["embeddings"] = embeddings
    return schema


class AmendedOpenAPI:
    """ASGI middleware answering GET /docs.json and /schema.json with the amended documents, each
    computed once."""

    def __init__(self, app: ASGIApp, *, service: Any) -> None:
        self.app = app
        self.service = service
        self.bodies: dict[str, bytes] = {}

    def document(self, path: str) -> bytes:
        if path not in self.bodies:
            if path == DOCUMENT_PATH:  # through JSON: statuses as strings, as served
                amended = amend(json.loads(json.dumps(self.service.openapi_spec.asdict())))
            else:
                amended = amend_service_schema(self.service.schema())
            self.bodies[path] = json.dumps(amended).encode()
        return self.bodies[path]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in (DOCUMENT_PATH, SCHEMA_PATH) or scope["method"] != "GET":
            return await self.app(scope, receive, send)
        body = self.document(scope["path"])
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
