"""The public HTTP API: request parsing, content negotiation and the one error-to-status map.

Mounted into the front BentoML service. Image endpoints read the body themselves so that a
file is only ever bytes from the request (BentoML's file inputs would fetch URLs) and so that
multipart and raw bodies share one path.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Protocol

import bentoml
from bentoml.exceptions import BentoMLException
from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile

from serving.classify import ImageClassifier, ImageUpload
from serving.embed import TextEmbedder, encode_base64_f16
from serving.errors import InputTooLarge, InvalidInput, ModelUnavailable, RequestError, UnsupportedMediaType
from serving.images import DEFAULT_MAX_BYTES
from serving.schemas import ClassifyBatchResponse, ClassifyResponse, EmbedRequest, EmbedResponse, ErrorBody


class Front(Protocol):
    """What the front BentoML service instance offers the routes."""

    classifier: ImageClassifier | None
    classifier_tag: str
    embedder: TextEmbedder | None
    embedder_tag: str


MAX_BODY_BYTES = 64 * DEFAULT_MAX_BYTES
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody} for status in (400, 413, 415, 422, 429, 503)
}
DEADLINE_HEADER = "X-Deadline-Ms"
MAX_DEADLINE_MS = 600_000


def _image_body(*, multipart_field: str, many: bool) -> dict[str, Any]:
    binary = {"type": "string", "format": "binary"}
    field = {"type": "array", "items": binary} if many else binary
    content: dict[str, Any] = {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {multipart_field: field, "top_k": {"type": "integer", "default": 5}},
                "required": [multipart_field],
            }
        }
    }
    if not many:
        content.update({media: {"schema": binary} for media in ("image/jpeg", "image/png", "image/webp", "image/bmp")})
    return {"requestBody": {"required": True, "content": content}}


app = FastAPI(title="optiserve", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(RequestError)
async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.to_json(), status_code=exc.status, headers=exc.headers)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    summary = "; ".join(_describe(e) for e in errors)
    body = {"error": summary, "type": "invalid_request", "detail": _json_safe(errors)}
    return JSONResponse(body, status_code=HTTPStatus.UNPROCESSABLE_ENTITY)


INTERNAL_ERROR = {"error": "internal error while serving the request", "type": "internal"}


@app.exception_handler(BentoMLException)
async def _bentoml_error(_: Request, exc: BentoMLException) -> JSONResponse:
    """Overload (the batcher's 503, in process or in a model service) and model-service errors."""
    status = exc.error_code
    if status >= 500 and status != HTTPStatus.SERVICE_UNAVAILABLE:
        return JSONResponse(INTERNAL_ERROR, status_code=status)
    headers = {"Retry-After": "1"} if status in (HTTPStatus.SERVICE_UNAVAILABLE, HTTPStatus.TOO_MANY_REQUESTS) else None
    kind = "overloaded" if status == HTTPStatus.SERVICE_UNAVAILABLE else "model_service"
    return JSONResponse({"error": str(exc), "type": kind}, status_code=status, headers=headers)


@app.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    """Our fault (an engine failure, a bug): JSON like every other error, with nothing internal in
    it. Starlette re-raises the exception after this response, so the traceback reaches the log."""
    return JSONResponse(INTERNAL_ERROR, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)


def _describe(error: dict[str, Any]) -> str:
    if error["type"] == "json_invalid":
        return f"request body is not valid JSON (at character {error['loc'][-1]})"
    location = ".".join(str(part) for part in error["loc"] if part != "body") or "body"
    return f"{location}: {error['msg']}"


def _json_safe(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in errors]


def front() -> Front:
    return bentoml.get_current_service()


def require_json(request: Request) -> None:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise UnsupportedMediaType(f"content type {media or 'missing'!r}: this endpoint takes application/json")


async def read_uploads(request: Request, field: str) -> tuple[list[ImageUpload], dict[str, str]]:
    """Image files from a multipart form (field `field`) or a raw image body, plus plain form fields."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise InputTooLarge(f"request body of {declared} bytes exceeds the limit of {MAX_BODY_BYTES} bytes")
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media == "multipart/form-data":
        form = await request.form(max_files=1024, max_fields=64)
        uploads = []
        for index, value in enumerate(form.getlist(field)):
            name = f"{field}[{index}]"
            if not isinstance(value, UploadFile):
                raise InvalidInput(f"{name} must be a file upload, not a text field")
            uploads.append(ImageUpload(await value.read(), value.content_type, name))
        if not uploads:
            raise InvalidInput(f"multipart body has no file field named {field!r}")
        fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
        return uploads, fields
    if media.startswith("image/") or media == "application/octet-stream":
        return [ImageUpload(await request.body(), media, "body")], {}
    raise UnsupportedMediaType(
        f"content type {media or 'missing'!r}: send multipart/form-data with a {field!r} file, "
        "or a raw image body (image/jpeg, image/png, image/webp, image/bmp)"
    )


def client_deadline_ms(
    value: str | None = Header(
        None,
        alias=DEADLINE_HEADER,
        description="Answer within this many milliseconds or refuse at once (503); capped by the server's own",
    ),
) -> float | None:
    """The client's time budget for this request, if it sent one."""
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_DEADLINE_MS:
        raise InvalidInput(f"{DEADLINE_HEADER} must be whole milliseconds from 1 to {MAX_DEADLINE_MS}, got {value!r}")
    return float(value)


def resolve_top_k(query_value: int | None, form: dict[str, str]) -> int:
    raw = form.get("top_k")
    if query_value is not None:
        return query_value
    if raw is None:
        return 5
    if not (raw.strip().isascii() and raw.strip().isdigit()):
        raise InvalidInput(f"top_k must be a positive integer, got {raw!r}")
    return int(raw)


def classifier(service: Front) -> ImageClassifier:
    if service.classifier is None:
        raise ModelUnavailable("no image-classification model is configured in this deployment")
    return service.classifier


@app.post(
    "/classify",
    response_model=ClassifyResponse,
    responses=ERROR_RESPONSES,
    openapi_extra=_image_body(multipart_field="image", many=False),
    summary="Classify one image",
)
async def classify(
    request: Request,
    top_k: int | None = Query(None, ge=1, le=1000, description="How many labels (default 5)"),
    deadline_ms: float | None = Depends(client_deadline_ms),
) -> ClassifyResponse:
    service = front()
    images = classifier(service)
    with images.admit(1, timeout_ms=deadline_ms) as admission:  # before the upload is even read
        uploads, form = await read_uploads(request, "image")
        if len(uploads) != 1:
            raise InvalidInput(f"/classify takes one image, got {len(uploads)}; use /classify_batch")
        (predictions,) = await images.classify(uploads, resolve_top_k(top_k, form), admission)
    return ClassifyResponse(model=service.classifier_tag, predictions=predictions)


@app.post(
    "/classify_batch",
    response_model=ClassifyBatchResponse,
    responses=ERROR_RESPONSES,
    openapi_extra=_image_body(multipart_field="images", many=True),
    summary="Classify several images in one request",
)
async def classify_batch(
    request: Request,
    top_k: int | None = Query(None, ge=1, le=1000, description="How many labels (default 5)"),
    deadline_ms: float | None = Depends(client_deadline_ms),
) -> ClassifyBatchResponse:
    service = front()
    images = classifier(service)
    uploads, form = await read_uploads(request, "images")
    with images.admit(len(uploads), timeout_ms=deadline_ms) as admission:
        results = await images.classify(uploads, resolve_top_k(top_k, form), admission)
    return ClassifyBatchResponse(model=service.classifier_tag, results=results)


@app.post(
    "/embed",
    response_model=EmbedResponse,
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_json)],
    summary="Embed texts",
)
async def embed(body: EmbedRequest, deadline_ms: float | None = Depends(client_deadline_ms)) -> EmbedResponse:
    service = front()
    if service.embedder is None:
        raise ModelUnavailable("no text-embedding model is configured in this deployment")
    vectors, tokens = await service.embedder.embed(body.texts, truncate=body.truncate, timeout_ms=deadline_ms)
    encoded = encode_base64_f16(vectors) if body.encoding_format == "base64" else vectors.tolist()
    return EmbedResponse(
        model=service.embedder_tag,
        dimensions=int(vectors.shape[1]),
        encoding_format=body.encoding_format,
        embeddings=encoded,
        tokens=tokens,
    )
