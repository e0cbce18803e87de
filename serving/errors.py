"""Typed request errors; each carries its HTTP status so one handler maps them all."""

from __future__ import annotations

import math
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

    @property
    def headers(self) -> dict[str, str] | None:
        return None


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


class BodyTimeout(RequestError):
    status = HTTPStatus.REQUEST_TIMEOUT
    kind = "body_timeout"


class ModelUnavailable(RequestError):
    """The endpoint exists but no model is configured for it in this deployment."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    kind = "model_unavailable"


class Refused(RequestError):
    """Admission control turned the request away before any work was spent on it; the client
    should come back after `retry_after_s` (sent as Retry-After, whole seconds, at least 1)."""

    reason: str

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class QueueFull(Refused):
    """The model's queue holds as many rows as it may: a client may retry elsewhere or later."""

    status = HTTPStatus.TOO_MANY_REQUESTS
    kind = "queue_full"
    reason = "queue_full"


class DeadlineUnmet(Refused):
    """The queue ahead, at the engine's measured speed, would answer after the request's deadline."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    kind = "overloaded"
    reason = "deadline"


class DeadlineExpired(Refused):
    """Admitted, but the queue ran slower than estimated: refused before the engine ran it."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    kind = "expired"
    reason = "expired"
