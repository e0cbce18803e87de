"""Typed request errors; each carries its HTTP status so one handler maps them all."""

from __future__ import annotations

import math
from http import HTTPStatus
from typing import Any


class InferenceFailed(Exception):
    """The engine failed on a batch: each request in it is answered 500 (`internal`) and counted
    as an inference error; the engine's own exception is the cause, in the log only."""


class RequestError(Exception):
    """A client mistake: answered with `status` and a JSON body naming what was wrong. A subclass
    names its own in its class line, `class X(RequestError, status=..., kind=...)`."""

    status: HTTPStatus = HTTPStatus.BAD_REQUEST
    kind: str = "bad_request"

    def __init_subclass__(cls, *, status: HTTPStatus | None = None, kind: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.status = status or cls.status
        cls.kind = kind or cls.kind

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_json(self) -> dict[str, str]:
        return {"error": self.message, "type": self.kind}

    @property
    def headers(self) -> dict[str, str] | None:
        return None


class EmptyInput(RequestError, kind="empty_input"):
    """A request with nothing to work on."""


class UnsupportedMediaType(RequestError, status=HTTPStatus.UNSUPPORTED_MEDIA_TYPE, kind="unsupported_media_type"):
    """A body in a content type the endpoint does not read."""


class InputTooLarge(RequestError, status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE, kind="input_too_large"):
    """More bytes, files, fields or items than the endpoint's limit."""


class UndecodableInput(RequestError, status=HTTPStatus.UNPROCESSABLE_ENTITY, kind="undecodable_input"):
    """Bytes that do not decode as what they claim to be."""


class InvalidInput(RequestError, status=HTTPStatus.UNPROCESSABLE_ENTITY, kind="invalid_input"):
    """A request that breaks the endpoint's rules: a field missing or malformed, a value out of bounds."""


class BodyTimeout(RequestError, status=HTTPStatus.REQUEST_TIMEOUT, kind="body_timeout"):
    """The body did not arrive in time (OPTISERVE_BODY_TIMEOUT_S)."""


class ModelUnavailable(RequestError, status=HTTPStatus.SERVICE_UNAVAILABLE, kind="model_unavailable"):
    """The endpoint exists but no model is configured for it in this deployment."""


class Refused(RequestError):
    """Admission control turned the request away before any work was spent on it; the client
    should come back after `retry_after_s` (sent as Retry-After, whole seconds, at least 1).
    `reason` labels the refusal in `optiserve_refused_total`."""

    reason: str

    def __init_subclass__(cls, *, reason: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.reason = reason

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class QueueFull(Refused, status=HTTPStatus.TOO_MANY_REQUESTS, kind="queue_full", reason="queue_full"):
    """The model's queue holds as many rows as it may: a client may retry elsewhere or later."""


class DeadlineUnmet(Refused, status=HTTPStatus.SERVICE_UNAVAILABLE, kind="overloaded", reason="deadline"):
    """The queue ahead, at the engine's measured speed, would answer after the request's deadline."""


class Shed(Refused, status=HTTPStatus.SERVICE_UNAVAILABLE, kind="shed", reason="low_priority"):
    """A low-priority request, refused because normal ones are waiting: under contention the low go first."""


class DeadlineExpired(Refused, status=HTTPStatus.SERVICE_UNAVAILABLE, kind="expired", reason="expired"):
    """Admitted, but the queue ran slower than estimated: refused before the engine ran it."""
