"""The public API's request handling: body parsing, admission order and the one error-to-status map.

The endpoints are BentoML APIs of the front service (service.py), so BentoML's clients, its
playground, `bentoml.depends` and the OpenAPI document see them; each takes its BentoML
context and calls one function here with the request. Bodies are read here, not by BentoML
(serving/schemas.py `RequestBody`): multipart and raw image bodies share one path, a file is
only ever bytes from the request, /classify is admitted before its upload is read, and every
error, ours or a bug, answers in one JSON schema with its own status, where BentoML would
answer a validation error with 400 in its own shape and anything else with 500.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Generic, Protocol, TypeVar

import bentoml
from bentoml.exceptions import BentoMLException
from pydantic import BaseModel, ValidationError
from python_multipart.multipart import parse_options_header
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive

from serving.cache import ResponseCache, cache_key
from serving.classify import ImageClassifier, ImageUpload
from serving.door import (
    DEADLINE_HEADER,
    PRIORITY_HEADER,
    PRIORITY_QUERY,
    EarlyRetries,
    Guard,
    chosen_priority,
    closing,
    parse_deadline_ms,
)
from serving.embed import TextEmbedder, encode_base64_f16
from serving.errors import (
    BodyTimeout,
    InferenceFailed,
    InputTooLarge,
    InvalidInput,
    ModelUnavailable,
    Refused,
    RequestError,
    UnsupportedMediaType,
)
from serving.images import DEFAULT_MAX_BYTES, check_content_type
from serving.lifecycle import Model, Split
from serving.manifest import DEFAULT_ENDPOINTS, model_path
from serving.metrics import count_error
from serving.schemas import UNREAD_REQUEST, ClassifyBatchResponse, ClassifyResponse, EmbedRequest, EmbedResponse
from serving.settings import body_timeout_s
from serving.shadow import shadowing
from serving.tracing import REQUEST_ID_HEADER, timed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Routed(Generic[Model]):
    """One route as its endpoints see it: its traffic split between its alias, a canary's and a
    shadow's, each model in a slot, so that a request keeps the model it started with through a hot
    swap (serving/lifecycle.py); and its response cache, where it has one (serving/cache.py)."""

    name: str  # the manifest's: a default endpoint or a model's name; `endpoint` in the metrics
    model: str  # the recipe it serves, whose name is its path: /models/<model>/...
    kind: str  # "classify" or "embed": the endpoints it answers (OPERATIONS)
    split: Split[Model] | None  # None: a default endpoint the deployment routes no model to
    cache: ResponseCache | None = None

    def paths(self) -> list[str]:
        """Every path its endpoints answer at: its model's own, and the default ones for a default route."""
        prefixes = ["", model_path(self.model)] if self.name in DEFAULT_ENDPOINTS else [model_path(self.model)]
        return [f"{prefix}/{operation}" for prefix in prefixes for operation in OPERATIONS[self.kind]]


class Front(Protocol):
    """What the front BentoML service instance offers the endpoints."""

    routes: dict[str, Routed]  # by name; the default endpoints always, their split None if unrouted
    early_retries: EarlyRetries | None  # shared with serving/door.py


# A form's parts besides its files (boundaries, part headers, top_k): room enough, and no more.
FORM_OVERHEAD_BYTES = 64 * 1024
MAX_EMBED_BODY_BYTES = 4 * 1024 * 1024
MAX_BULK_BODY_BYTES = 64 * 1024 * 1024
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
# The end of a multipart body kept to find its closing boundary (RFC 2046: at most 70 characters,
# then "--" and an epilogue that clients leave empty or end with a line break).
TAIL_BYTES = 1024
MAX_FORM_FIELDS = 64
BODY_TIMEOUT_S = body_timeout_s()
MODEL_TAG_HEADER = "X-Model-Tag"  # the stored model that produced the answer, as its body's `model`
CACHE_HEADER = "X-Cache"  # `hit` or `miss`, on the answers of an endpoint with a response cache
DEFAULT_TOP_K, MAX_TOP_K = 5, 1000
INTERNAL_ERROR = {"error": "internal error while serving the request", "type": "internal"}
# The endpoints of each kind of model, below the default path and each model's own (`Routed.paths`).
OPERATIONS = {"classify": ("classify", "classify_batch"), "embed": ("embed",)}

# The tag of the model a request leased (`leased`), for an error answered after the lease ended.
LEASED_TAG: ContextVar[str | None] = ContextVar("leased_tag", default=None)

Answer = TypeVar("Answer", bound=BaseModel)  # each names its `model`


@dataclass(frozen=True)
class CachedAnswer:
    """An answer as the JSON bytes a response cache keeps: served from it (`hit`) or just put in."""

    body: bytes
    model: str
    hit: bool

    def response(self) -> Response:
        headers = {MODEL_TAG_HEADER: self.model, CACHE_HEADER: "hit" if self.hit else "miss"}
        return Response(self.body, media_type="application/json", headers=headers)


def recalled(cache: ResponseCache | None, key: bytes, model: str) -> CachedAnswer | None:
    """The answer `cache` holds for `key`, if it has one."""
    body = None if cache is None else cache.get(key)
    return None if body is None else CachedAnswer(body, model, hit=True)


def remembered(cache: ResponseCache | None, key: bytes, result: Answer) -> Answer | CachedAnswer:
    """`result`, kept in `cache` under `key` where there is a cache."""
    if cache is None:
        return result
    body = answer_body(result)
    cache.put(key, body)
    return CachedAnswer(body, result.model, hit=False)


@dataclass(frozen=True)
class ErrorAnswer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


async def outcome(
    endpoint: Callable[[Routed, Request], Awaitable[Answer]], front: Front, route: str, request: Request
) -> Answer | CachedAnswer | ErrorAnswer:
    """`endpoint`'s answer to `request` on the route named `route`, or its error, counted."""
    routed = front.routes[route]
    try:
        return await endpoint(routed, request)
    except Refused as exc:
        if front.early_retries is not None:
            await front.early_retries.hold(request.scope, exc)
        return error_answer(exc)
    except Exception as exc:
        error = error_answer(exc)
        record_error(routed, endpoint.__name__, exc, error)
        return error


async def answer(
    ctx: bentoml.Context, endpoint: Callable[[Routed, Request], Awaitable[Answer]], front: Front, route: str
) -> Response:
    """`respond` to the request BentoML's API handler is serving (a browser's, or a task's).
    BentoML sets the status of an API's response from its context: it goes there too."""
    response = await respond(endpoint, front, route, UNREAD_REQUEST.get())
    ctx.response.status_code = response.status_code
    return response


async def respond(
    endpoint: Callable[[Routed, Request], Awaitable[Answer]], front: Front, route: str, request: Request
) -> Response:
    """`outcome` as its response: the answer's JSON with the model's tag in a header, or the
    error's body and status; the same whichever way the request came (serving/direct.py). An error
    may come before the body was read (a header at fault, a declared length over the limit): it
    closes the connection where the door's refusals do, or a client that awaits `100-continue`
    would send its next request on a connection still waiting for this body."""
    result = await outcome(endpoint, front, route, request)
    if isinstance(result, CachedAnswer):
        return result.response()
    if isinstance(result, ErrorAnswer):
        return JSONResponse(
            result.body, status_code=result.status, headers={**result.headers, **closing(request.scope)}
        )
    return Response(answer_body(result), media_type="application/json", headers={MODEL_TAG_HEADER: result.model})


def answer_body(result: BaseModel) -> bytes:
    """An answer's JSON; a field that does not apply (None: `answered_by` of a model that is no cascade) is left out."""
    return result.model_dump_json(exclude_none=True).encode()


def error_answer(exc: Exception) -> ErrorAnswer:
    """Every error's status and body; a bug of ours says nothing internal (the log has it)."""
    if isinstance(exc, RequestError):
        return ErrorAnswer(exc.status, exc.to_json(), exc.headers or {})
    if isinstance(exc, ValidationError):
        return invalid_body(exc)
    if isinstance(exc, BentoMLException):
        return model_service_error(exc)
    if isinstance(exc, ClientDisconnect):
        return ErrorAnswer(HTTPStatus.BAD_REQUEST, {"error": "the client went away", "type": "client_disconnect"})
    logger.error("internal error while serving the request", exc_info=exc)
    return ErrorAnswer(HTTPStatus.INTERNAL_SERVER_ERROR, INTERNAL_ERROR)


def error_class(exc: Exception, status: int) -> str:
    """An error answer's class in `optiserve_errors_total` (serving/metrics.py)."""
    if isinstance(exc, BentoMLException) and status == HTTPStatus.SERVICE_UNAVAILABLE:
        return "overload"  # a model service's batcher shed it: the `service` placement's refusal
    if isinstance(exc, InferenceFailed) or (isinstance(exc, BentoMLException) and status >= 500):
        return "inference"
    if status == HTTPStatus.REQUEST_TIMEOUT:
        return "timeout"
    return "request" if status < 500 else "internal"


def record_error(route: Routed, api: str, exc: Exception, error: ErrorAnswer) -> None:
    """Counts an error answer of the API named `api` against its model (serving/metrics.py)."""
    split = route.split
    count_error(
        endpoint=route.name,
        model=LEASED_TAG.get() or (split.primary.model.tag if split is not None else "none"),
        api=api,
        error_class=error_class(exc, error.status),
        status=error.status,
        kind=error.body["type"],
    )


def invalid_body(exc: ValidationError) -> ErrorAnswer:
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    summary = "; ".join(_describe(e) for e in errors)
    body = {"error": summary, "type": "invalid_request", "detail": [_json_safe(e) for e in errors]}
    return ErrorAnswer(HTTPStatus.UNPROCESSABLE_ENTITY, body)


def model_service_error(exc: BentoMLException) -> ErrorAnswer:
    """Errors of a BentoML model service (the `service` placement): its batcher's 503 is overload."""
    status = exc.error_code
    if status >= 500 and status != HTTPStatus.SERVICE_UNAVAILABLE:
        return ErrorAnswer(status, INTERNAL_ERROR)
    retry = status in (HTTPStatus.SERVICE_UNAVAILABLE, HTTPStatus.TOO_MANY_REQUESTS)
    kind = "overloaded" if status == HTTPStatus.SERVICE_UNAVAILABLE else "model_service"
    return ErrorAnswer(status, {"error": str(exc), "type": kind}, {"Retry-After": "1"} if retry else {})


def _describe(error: dict[str, Any]) -> str:
    if error["type"] == "json_invalid":
        return "request body is not valid JSON"
    location = ".".join(str(part) for part in error["loc"]) or "body"
    return f"{location}: {error['msg']}"


def _json_safe(error: dict[str, Any]) -> dict[str, Any]:
    return {"loc": list(error["loc"]), "msg": error["msg"], "type": error["type"]}


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def check_not_encoded(request: Request) -> None:
    """A compressed body (`Content-Encoding: gzip`) is not read as JSON or an image (RFC 9110 §15.5.16)."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaType(f"content encoding {encoding!r} is not accepted: send the body uncompressed")


def check_declared_length(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise InputTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")


@asynccontextmanager
async def arriving_in_time() -> AsyncIterator[None]:
    """Bounds the time a body takes to arrive (OPTISERVE_BODY_TIMEOUT_S)."""
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            yield
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {BODY_TIMEOUT_S:g} s") from None


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, uncompressed, of at most `limit` bytes (`read_within`)."""
    check_not_encoded(request)
    return await read_within(request, limit)


async def read_within(request: Request, limit: int) -> bytes:
    """The whole body, refused as soon as it passes `limit` bytes, declared or chunked, or once it
    has taken `OPTISERVE_BODY_TIMEOUT_S` to arrive."""
    check_declared_length(request, limit)
    chunks, size = [], 0
    with timed("read"):
        async with arriving_in_time():
            async for chunk in request.stream():  # the request's own: a bulk task's body is read already
                size += len(chunk)
                if size > limit:
                    raise InputTooLarge(f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
    return b"".join(chunks)


async def read_form(request: Request, limit: int, *, max_files: int, hint: str = "") -> FormData:
    """The form, parsed by Starlette, whose malformed-body errors get our statuses; refused as soon
    as its body passes `limit` bytes, declared or chunked (Starlette reads a form whole, files to disk).
    A multipart body cut short is refused as such: Starlette drops its unfinished part silently,
    and the error would otherwise be that the field is missing."""
    check_not_encoded(request)
    check_declared_length(request, limit)
    body = LimitedBody(request.receive, limit)
    try:
        with timed("read"):
            async with arriving_in_time():
                form = await Request(request.scope, body).form(max_files=max_files, max_fields=MAX_FORM_FIELDS)
    except (HTTPException, MultiPartException) as exc:
        message = exc.detail if isinstance(exc, HTTPException) else exc.message
        if message.startswith("Too many files"):
            raise InputTooLarge(f"the request has more files than its limit of {max_files}{hint}") from None
        if message.startswith("Too many fields"):
            raise InputTooLarge(f"more than {MAX_FORM_FIELDS} form fields in one request") from None
        raise InvalidInput(f"malformed form body: {message}") from None
    if media_type(request) == "multipart/form-data":
        check_closed(request.headers.get("content-type", ""), body.tail)
    return form


def check_closed(content_type: str, tail: bytes) -> None:
    """Refuses a multipart body whose end has no closing boundary (`--boundary--`)."""
    end = b"--" + parse_options_header(content_type)[1].get(b"boundary", b"") + b"--"
    if end not in tail:
        raise InvalidInput(
            f"malformed form body: it ends without its closing boundary {end.decode('latin-1')!r} (cut short?)"
        )


class LimitedBody:
    """`receive`, raising `InputTooLarge` once the body it has given passes `limit` bytes; keeps the
    body's last bytes, where a multipart body's closing boundary is."""

    def __init__(self, receive: Receive, limit: int) -> None:
        self.receive = receive
        self.limit = limit
        self.size = 0
        self.tail = b""

    async def __call__(self) -> Message:
        message = await self.receive()
        chunk = message.get("body", b"")
        self.size += len(chunk)
        if self.size > self.limit:
            raise InputTooLarge(f"request body exceeds the limit of {self.limit} bytes")
        self.tail = (self.tail + chunk)[-TAIL_BYTES:]
        return message


async def read_uploads(
    request: Request, field: str, *, max_files: int, hint: str = ""
) -> tuple[list[ImageUpload], dict[str, str]]:
    """Image files from a multipart form (field `field`) or a raw image body, plus plain form fields.
    A form is parsed no further than `max_files` files; `hint` ends the error when it has more.
    A body may be as large as the images it may carry, each up to `DEFAULT_MAX_BYTES`: a raw body
    is one image."""
    media = media_type(request)
    if media in FORM_TYPES:  # a form with no file in it is url-encoded (BentoML's client sends a URL so)
        limit = max_files * DEFAULT_MAX_BYTES + FORM_OVERHEAD_BYTES
        form = await read_form(request, limit, max_files=max_files, hint=hint)
        uploads = []
        for index, value in enumerate(form.getlist(field)):
            name = f"{field}[{index}]"
            if not isinstance(value, UploadFile):
                raise InvalidInput(f"{name} must be a file upload, not a text field (a URL or path is never fetched)")
            check_content_type(value.content_type, name=name)  # here, before a cached answer could skip it
            uploads.append(ImageUpload(await value.read(), value.content_type, name))
        if not uploads:
            raise InvalidInput(f"multipart body has no file field named {field!r}")
        fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
        return uploads, fields
    if media.startswith("image/") or media == "application/octet-stream":
        check_content_type(media, name="body")
        return [ImageUpload(await read_body(request, DEFAULT_MAX_BYTES), media, "body")], {}
    raise UnsupportedMediaType(
        f"content type {media or 'missing'!r}: send multipart/form-data with a {field!r} file, "
        "or a raw image body (image/jpeg, image/png, image/webp, image/bmp)"
    )


def client_deadline_ms(request: Request) -> float | None:
    return parse_deadline_ms(request.headers.get(DEADLINE_HEADER))


def low_priority(request: Request) -> bool:
    """Whether the client asked for low priority, in the X-Priority header or the `priority` query."""
    return chosen_priority(request.headers.get(PRIORITY_HEADER), request.query_params.get(PRIORITY_QUERY)) == "low"


def resolve_top_k(request: Request, form: dict[str, str]) -> int:
    """top_k from the query string, else the form (BentoML's clients send it JSON-encoded: the same digits)."""
    raw = request.query_params.get("top_k", form.get("top_k"))
    if raw is None:
        return DEFAULT_TOP_K
    value = raw.strip()
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_TOP_K:
        raise InvalidInput(f"top_k must be a whole number from 1 to {MAX_TOP_K}, got {raw!r}")
    return int(value)


def door_guards(routes: dict[str, Routed]) -> dict[str, Guard]:
    """What serving/door.py asks before a model endpoint's request goes further, by path: the queue
    of the model the request would lease now (its side of the split; without an id, the alias's own)."""

    def guard(split: Split[ImageClassifier] | Split[TextEmbedder]) -> Guard:
        def place(timeout_ms: float | None, request_id: str | None) -> Refused | AbstractContextManager[None]:
            slot = split.slot(request_id) if request_id else split.primary
            return slot.model.model.place_at_door(timeout_ms)

        return place

    return {path: guard(route.split) for route in routes.values() if route.split is not None for path in route.paths()}


def request_id(request: Request) -> str | None:
    """The client's id, which picks the canary and shadow shares: a retry lands where its first try did."""
    return request.headers.get(REQUEST_ID_HEADER)


@contextmanager
def leased(split: Split[Model] | None, task: str, request: Request) -> Iterator[Model]:
    """The model serving this request (its side of the split) for its whole life, or 503 where
    the deployment configures none."""
    if split is None:
        raise ModelUnavailable(f"no {task} model is configured in this deployment")
    with split.slot(request_id(request)).lease() as model:
        LEASED_TAG.set(model.tag)  # the request's own context: what its error is counted against
        yield model


async def read_images(request: Request, field: str, *, max_files: int, hint: str = "") -> tuple[list[ImageUpload], int]:
    """A classify request's images (`read_uploads`) and its top_k: what both classify routes read."""
    uploads, form = await read_uploads(request, field, max_files=max_files, hint=hint)
    return uploads, resolve_top_k(request, form)


def images_key(tag: str, api: str, uploads: list[ImageUpload], top_k: int) -> bytes:
    return cache_key(tag, api.encode(), str(top_k).encode(), *(upload.data for upload in uploads))


async def classify(route: Routed[ImageClassifier], request: Request) -> ClassifyResponse | CachedAnswer:
    cache = route.cache
    with (
        leased(route.split, "image-classification", request) as images,
        images.admit(  # before the upload is read
            1, timeout_ms=client_deadline_ms(request), low=low_priority(request)
        ) as admission,
    ):
        uploads, top_k = await read_images(request, "image", max_files=1, hint=": send several to /classify_batch")
        key = images_key(images.tag, "classify", uploads, top_k) if cache else b""
        if (hit := recalled(cache, key, images.tag)) is not None:
            return hit
        classified = await images.classify(
            uploads, top_k, admission, shadowing(route.split, route.name, images.tag, request_id(request))
        )
    (predictions,), answered_by = classified.predictions, classified.answered_by
    response = ClassifyResponse(model=images.tag, predictions=predictions, answered_by=answered_by and answered_by[0])
    return remembered(cache, key, response)


async def classify_batch(route: Routed[ImageClassifier], request: Request) -> ClassifyBatchResponse | CachedAnswer:
    cache = route.cache
    with leased(route.split, "image-classification", request) as images:
        deadline_ms, low = client_deadline_ms(request), low_priority(request)
        uploads, top_k = await read_images(request, "images", max_files=images.max_items_per_request)
        key = images_key(images.tag, "classify_batch", uploads, top_k) if cache else b""
        if (hit := recalled(cache, key, images.tag)) is not None:
            return hit
        with images.admit(len(uploads), timeout_ms=deadline_ms, low=low) as admission:  # counted, before decoding
            classified = await images.classify(
                uploads, top_k, admission, shadowing(route.split, route.name, images.tag, request_id(request))
            )
    response = ClassifyBatchResponse(
        model=images.tag, results=classified.predictions, answered_by=classified.answered_by
    )
    return remembered(cache, key, response)


async def embed_request(request: Request, limit: int) -> EmbedRequest:
    media = media_type(request)
    if media != "application/json":
        raise UnsupportedMediaType(f"content type {media or 'missing'!r}: this endpoint takes application/json")
    return EmbedRequest.model_validate_json(await read_body(request, limit))


async def embed(route: Routed[TextEmbedder], request: Request) -> EmbedResponse | CachedAnswer:
    cache = route.cache
    with leased(route.split, "text-embedding", request) as texts:
        deadline_ms, low = client_deadline_ms(request), low_priority(request)
        body = await embed_request(request, MAX_EMBED_BODY_BYTES)
        key = cache_key(texts.tag, body.model_dump_json().encode()) if cache else b""  # texts and options, parsed
        if (hit := recalled(cache, key, texts.tag)) is not None:
            return hit
        observe = shadowing(route.split, route.name, texts.tag, request_id(request))
        vectors, tokens = await texts.embed(
            body.texts, truncate=body.truncate, timeout_ms=deadline_ms, observe=observe, low=low
        )
    return remembered(cache, key, embed_response(texts, body, vectors, tokens))


async def embed_bulk(route: Routed[TextEmbedder], request: Request) -> EmbedResponse:
    with leased(route.split, "text-embedding", request) as texts:
        body = await embed_request(request, MAX_BULK_BODY_BYTES)
        vectors, tokens = await texts.embed_bulk(body.texts, truncate=body.truncate)
    return embed_response(texts, body, vectors, tokens)


def embed_response(texts: TextEmbedder, body: EmbedRequest, vectors: Any, tokens: int) -> EmbedResponse:
    encoded = encode_base64_f16(vectors) if body.encoding_format == "base64" else vectors.tolist()
    return EmbedResponse(
        model=texts.tag,
        dimensions=int(vectors.shape[1]),
        encoding_format=body.encoding_format,
        embeddings=encoded,
        tokens=tokens,
    )


# Each operation's endpoint function, by the last segment of its paths.
ENDPOINTS = {"classify": classify, "classify_batch": classify_batch, "embed": embed}


def direct_handlers(front: Front) -> dict[str, Callable[[Request], Awaitable[Response]]]:
    """What answers each served model path's requests in serving/direct.py: `respond` with the
    path's endpoint, on its route."""

    def handler(path: str, route: str) -> Callable[[Request], Awaitable[Response]]:
        endpoint = ENDPOINTS[path.rsplit("/", 1)[1]]
        return lambda request: respond(endpoint, front, route, request)

    return {
        path: handler(path, name)
        for name, routed in front.routes.items()
        if routed.split is not None
        for path in routed.paths()
    }
