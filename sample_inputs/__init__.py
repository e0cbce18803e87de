"""Real inputs that every machine has: photos shipped by scikit-image, scikit-learn and
matplotlib, and English text from Python's own documentation.

The pipeline evaluates on them, the load tester and the benchmarks send them, the tests use them:
a leaf that imports nothing of the project and only numpy and Pillow at import time (the
photo packages when photos are first asked for)."""

from __future__ import annotations

import io
import re
from functools import cache

import numpy as np
from PIL import Image

SKIMAGE_PHOTOS = ("chelsea", "coffee", "astronaut", "rocket", "camera")


@cache
def sample_photos() -> dict[str, bytes]:
    """Photo name → encoded file bytes (JPEG and PNG), as a client would upload them: every photo
    of a scene those packages ship, so that the pipeline's held-out slice has as many scenes as
    this machine has (the views of one photo agree or disagree together)."""
    from skimage import data
    from sklearn.datasets import load_sample_images

    arrays = {name: getattr(data, name)() for name in SKIMAGE_PHOTOS}
    sklearn_images = load_sample_images()
    for filename, array in zip(sklearn_images.filenames, sklearn_images.images, strict=True):
        arrays[filename.rsplit("/", 1)[-1].removesuffix(".jpg")] = array
    arrays["motorcycle"] = data.stereo_motorcycle()[0]  # the left view of the stereo pair
    arrays["grace_hopper"] = np.asarray(Image.open(_matplotlib_sample("grace_hopper.jpg")))
    return {name: encode(array, "PNG" if i % 2 else "JPEG") for i, (name, array) in enumerate(arrays.items())}


PHONE_LONG_SIDE = 4032  # a 12-megapixel phone camera's 4032 × 3024


@cache
def phone_photos() -> dict[str, bytes]:
    """The sample photos as phones upload them: a service's real traffic, whose decoding costs
    more than its inference (a 12-megapixel JPEG, 35 ms to decode at reduced scale on an AVX2
    core, against 7.3 ms for EfficientNet-Lite0 at batch 1, the pipeline's profile p50 there)."""
    return {name: as_phone_photo(data) for name, data in sample_photos().items()}


def as_phone_photo(data: bytes, size: tuple[int, int] | None = None, exif: Image.Exif | None = None) -> bytes:
    """A photo upscaled to `size` (default: PHONE_LONG_SIDE on its long side, its aspect kept),
    with sensor-like noise, as a JPEG of quality 90."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    scale = PHONE_LONG_SIDE / max(image.size)
    width, height = size or (round(image.width * scale), round(image.height * scale))
    noisy = np.asarray(image.resize((width, height), Image.BICUBIC)) + np.random.default_rng(0).normal(
        0, 3, (height, width, 3)
    )
    buffer = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90, exif=exif or Image.Exif())
    return buffer.getvalue()


def _matplotlib_sample(filename: str) -> str:
    """A file of matplotlib's sample data, found without importing matplotlib (a second or so)."""
    import importlib.util
    import os.path

    spec = importlib.util.find_spec("matplotlib")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("matplotlib (the pipeline extra) ships the sample photo " + filename)
    return os.path.join(spec.submodule_search_locations[0], "mpl-data", "sample_data", filename)


def encode(array: np.ndarray, image_format: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).convert("RGB").save(buffer, format=image_format, quality=92)
    return buffer.getvalue()


@cache
def corpus_sentences() -> tuple[str, ...]:
    """Every distinct sentence of 20-600 characters in `pydoc_data.topics` (ships with CPython)."""
    from pydoc_data.topics import topics

    sentences: dict[str, None] = {}
    for key in sorted(topics):
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(topics[key].split())):
            if 20 <= len(sentence) <= 600:
                sentences.setdefault(sentence)
    return tuple(sentences)


def sample_texts(limit: int = 64) -> list[str]:
    """Sentences spread across the corpus rather than the first topics only."""
    sentences = corpus_sentences()
    return list(sentences[:: max(1, len(sentences) // limit)][:limit])


@cache
def digit_images() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8×8 digits as uint8 RGB images (0-16 scaled to 0-255) and their labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    gray = np.clip(digits.images * 16, 0, 255).astype(np.uint8)
    return np.repeat(gray[..., None], 3, axis=-1), digits.target.astype(np.int64)
