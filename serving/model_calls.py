"""The front's calls into the batched model services, hardened against dropped connections.

BentoML's client to a dependency service replaces its aiohttp session every
`runner_connection.max_requests` requests (default 100) and `max_age` seconds (default 300),
closing the old session while other requests are still in flight on it. Those requests fail
with `ServerDisconnectedError`, which reached users as 500s: about 3 % of /classify requests
at concurrency 4 and more at higher concurrency, measured with `python -m loadtest`. Two
measures, both through BentoML's public surface:

- `MODEL_CONNECTIONS` is the model services' `runner_connection` setting: the front's
  loopback connections to a sibling worker are kept instead of being recycled.
- `call_model` retries a model call once on a connection-level failure. A model call is a
  pure function of its input, so repeating it is safe; a keep-alive connection the server
  closes at the moment of reuse is then invisible to the user.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp

logger = logging.getLogger(__name__)

MODEL_CONNECTIONS = {"max_requests": 2**31 - 1, "max_age": 1.0e9}

In = TypeVar("In")
Out = TypeVar("Out")


async def call_model(call: Callable[[In], Awaitable[Out]], value: In) -> Out:
    """`await call(value)`, once more if the connection to the model service broke."""
    try:
        return await call(value)
    except aiohttp.ClientConnectionError as exc:
        logger.warning("model call lost its connection (%s); retrying once", exc)
        return await call(value)
