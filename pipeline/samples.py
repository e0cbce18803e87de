"""Real inputs that every machine has: photos shipped by scikit-image and scikit-learn, and
English text from Python's own documentation. Used by export checks and tests."""

from __future__ import annotations

import io
import re
from functools import cache

import numpy as np
from PIL import Image

SKIMAGE_PHOTOS = ("chelsea", "coffee", "astronaut", "rocket", "camera")


@cache
def sample_photos() -> dict[str, bytes]:
    """Photo name → encoded file bytes (JPEG and PNG), as a client would upload them."""
    from skimage import data
    from sklearn.datasets import load_sample_images

    arrays = {name: getattr(data, name)() for name in SKIMAGE_PHOTOS}
    sklearn_images = load_sample_images()
    for filename, array in zip(sklearn_images.filenames, sklearn_images.images, strict=True):
        arrays[filename.rsplit("/", 1)[-1].removesuffix(".jpg")] = array
    return {name: encode(array, "PNG" if i % 2 else "JPEG") for i, (name, array) in enumerate(arrays.items())}


def encode(array: np.ndarray, image_format: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).convert("RGB").save(buffer, format=image_format, quality=92)
    return buffer.getvalue()


@cache
def sample_texts(limit: int = 64) -> list[str]:
    """Sentences of varied length from `pydoc_data.topics` (ships with CPython)."""
    from pydoc_data.topics import topics

    sentences: list[str] = []
    for key in sorted(topics):
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(topics[key].split())):
            if 20 <= len(sentence) <= 600 and sentence not in sentences:
                sentences.append(sentence)
    # Spread across the corpus rather than the first topics only.
    step = max(1, len(sentences) // limit)
    return sentences[::step][:limit]
