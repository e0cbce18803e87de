"""Request and response bodies of the public HTTP API."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Prediction(BaseModel):
    label: str
    class_id: int
    score: float


class ClassifyResponse(BaseModel):
    model: str = Field(description="Tag of the stored model that answered")
    predictions: list[Prediction]


class ClassifyBatchResponse(BaseModel):
    model: str
    results: list[list[Prediction]] = Field(description="One top-k list per image, in request order")


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    texts: list[str] = Field(description="Texts to embed, in order")
    truncate: bool = Field(
        default=False, description="Cut texts longer than the model's limit instead of rejecting them"
    )
    encoding_format: Literal["float", "base64"] = Field(
        default="float",
        description="float: JSON numbers; base64: each vector as little-endian float16 bytes",
    )


class EmbedResponse(BaseModel):
    model: str
    dimensions: int
    encoding_format: Literal["float", "base64"]
    embeddings: list[list[float]] | list[str]
    tokens: int = Field(description="Tokens processed, special tokens included")


class ErrorBody(BaseModel):
    error: str
    type: str
