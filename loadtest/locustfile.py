"""Locust users for optiserve, for those who prefer locust's UI and distributed workers.

    pip install locust        # not a dependency of this project
    LOADTEST_IMAGES=photos/ locust -f loadtest/locustfile.py --host http://127.0.0.1:3000

Run from the repository root (or with it on PYTHONPATH). The request bodies come from
`loadtest.inputs`, the same bytes `python -m loadtest` sends: raw image bodies to /classify,
JSON texts to /embed. Environment: LOADTEST_IMAGES (folder of images; default the project's
sample photos, which need the pipeline extra), LOADTEST_TEXTS (file, one text per line;
default the project's sample texts), LOADTEST_TEXTS_PER_REQUEST (default 1). Choose a user
class on the command line (`ClassifyUser`, `EmbedUser`) or let locust mix both. Users send
back to back (closed loop); locust counts every non-2xx answer as a failure. The knee, the
server-side breakdown and the capacity plan are `python -m loadtest`'s.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

from locust import HttpUser, constant, task

from loadtest.inputs import (
    Payload,
    default_texts,
    image_payloads,
    read_image_folder,
    read_texts,
    sample_photo_files,
    text_payloads,
)


def _image_bodies() -> list[Payload]:
    folder = os.environ.get("LOADTEST_IMAGES")
    return image_payloads(read_image_folder(Path(folder)) if folder else sample_photo_files())


def _text_bodies() -> list[Payload]:
    path = os.environ.get("LOADTEST_TEXTS")
    texts = read_texts(Path(path)) if path else default_texts()
    return text_payloads(texts, per_request=int(os.environ.get("LOADTEST_TEXTS_PER_REQUEST", "1")))


class _PostingUser(HttpUser):
    """Posts `bodies` to `path` in turn; abstract, so locust runs only the users below."""

    abstract = True
    wait_time = constant(0)
    path: str
    bodies: Iterator[Payload]

    @task
    def post(self) -> None:
        body = next(self.bodies)
        self.client.post(self.path, data=body.body, headers={"content-type": body.content_type}, name=self.path)


class ClassifyUser(_PostingUser):
    path, bodies = "/classify", itertools.cycle(_image_bodies())


class EmbedUser(_PostingUser):
    path, bodies = "/embed", itertools.cycle(_text_bodies())
