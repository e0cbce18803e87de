"""Request and response bodies of the public API, as BentoML input and output specs."""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import bentoml
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.requests import Request

# The request whose body the endpoint reads: the one BentoML hands the input spec. (A task runs
# on the request BentoML stored at submission, whose body it has already read.)
UNREAD_REQUEST: ContextVar[Request] = ContextVar("optiserve_unread_request")


class RequestBody(bentoml.IODescriptor):
    """An input spec whose fields describe the body to BentoML's clients, playground and OpenAPI
    document, while the endpoint reads the body itself (serving/api.py): admission comes before
    an upload is read, a file is only ever bytes from the request (BentoML's file fields fetch
    URLs and open server paths), and every error answers in our schema. BentoML hands the
    endpoint each field unread, as None, and the request in `UNREAD_REQUEST`."""

    @classmethod
    async def from_http_request(cls, request: Request, serde: Any) -> RequestBody:
        UNREAD_REQUEST.set(request)
        return cls.model_construct(**dict.fromkeys(cls.model_fields))


TOP_K = Field(5, ge=1, le=1000, description="How many labels to return (a form field, or the query string)")


class ClassifyRequest(RequestBody):
    """One image: a multipart file field `image`, or the whole body as image/jpeg, image/png,
    image/webp or image/bmp."""

    image: Path = Field(description="The image file (JPEG, PNG, WebP or BMP)")
    top_k: int = TOP_K


class ClassifyBatchRequest(RequestBody):
    images: list[Path] = Field(description="Image files, repeated multipart field `images`")
    top_k: int = TOP_K


class EmbedRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")
    texts: list[str] = Field(description="Texts to embed, in order", json_schema_extra={"minItems": 1})
    truncate: StrictBool = Field(
        default=False, description="Cut texts longer than the model's limit instead of rejecting them"
    )
    encoding_format: Literal["float", "base64"] = Field(
        default="float",
        description="float: JSON numbers; base64: each vector as little-endian float16 bytes",
    )


class Prediction(BaseModel):
    label: str
    class_id: int
    score: float


AnsweredBy = Literal["student", "teacher"]
ANSWERED_BY = Field(default=None, description="A cascade's: which of its two models answered (absent for other models)")


class ClassifyResponse(BaseModel):
    model: str = Field(description="Tag of the stored model that answered")
    predictions: list[Prediction]
    answered_by: AnsweredBy | None = ANSWERED_BY


class ClassifyBatchResponse(BaseModel):
    model: str
    results: list[list[Prediction]] = Field(description="One top-k list per image, in request order")
    answered_by: list[AnsweredBy] | None = ANSWERED_BY


class EmbedResponse(BaseModel):
    model: str
    dimensions: int
    encoding_format: Literal["float", "base64"]
    embeddings: list[list[float]] | list[str]
    tokens: int = Field(description="Tokens processed, special tokens included")


class ErrorBody(BaseModel):
    error: str
    type: str
