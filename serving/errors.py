"""Typed request errors; each carries its HTTP status so one handler maps them all."""

from __future__ import annotations

from http import HTTPStatus


class RequestError(Exception):
    """A client mistake: answered with `status` and a JSON body naming what was wrong."""

    status: HTTPStatus = HTTPStatus.BAD_REQUEST
    kind: str = "bad_request"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_json(self) -> dict[str, str]:
        return {"error": self.message, "type": self.kind}


class EmptyInput(RequestError):
    kind = "empty_input"


class UnsupportedMediaType(RequestError):
    status = HTTPStatus.UNSUPPORTED_MEDIA_TYPE
    kind = "unsupported_media_type"


class InputTooLarge(RequestError):
    status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    kind = "input_too_large"


class UndecodableInput(RequestError):
    status = HTTPStatus.UNPROCESSABLE_ENTITY
    kind = "undecodable_input"


class InvalidInput(RequestError):
    status = HTTPStatus.UNPROCESSABLE_ENTITY
    kind = "invalid_input"


class ModelUnavailable(RequestError):
    """The endpoint exists but no model is configured for it in this deployment."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    kind = "model_unavailable"
