"""Calibration, evaluation and profiling inputs, disjoint by construction, prepared through the
serving path.

Photos are split by name (calibration never sees an evaluation photo); each is expanded with
deterministic augmentations. Texts are split by position in the `pydoc_data` corpus: every
eighth sentence for evaluation, another eighth for calibration, a third eighth for profiling
(real sentence lengths, unless the recipe names a file of real requests), the rest for
distillation. Digits use a fixed stratified 75/25 train/test split; calibration draws from
train only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

from pipeline.samples import corpus_sentences, digit_images, encode, sample_photos
from serving.classify import ImageUpload, prepare_image
from serving.images import decode_image
from serving.model_spec import ImageInput

CALIBRATION_PHOTOS = ("astronaut", "camera", "china")
AUGMENTATIONS = ("original", "mirror", "zoom", "rotate", "darker", "brighter", "contrast", "grayscale")


@dataclass(frozen=True)
class Split:
    """Model-ready rows (uint8 images or token-id lists), plus labels when the data has them."""

    rows: list
    labels: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.rows)


def augment(image: Image.Image, how: str) -> Image.Image:
    width, height = image.size
    return {
        "original": lambda: image,
        "mirror": lambda: ImageOps.mirror(image),
        "zoom": lambda: image.crop((width // 8, height // 8, width - width // 8, height - height // 8)),
        "rotate": lambda: image.rotate(12, resample=Image.Resampling.BILINEAR, expand=False),
        "darker": lambda: ImageEnhance.Brightness(image).enhance(0.6),
        "brighter": lambda: ImageEnhance.Brightness(image).enhance(1.4),
        "contrast": lambda: ImageEnhance.Contrast(image).enhance(1.5),
        "grayscale": lambda: ImageOps.grayscale(image).convert("RGB"),
    }[how]()


def photo_split(spec: ImageInput, *, calibration: bool) -> Split:
    """Augmented photos, encoded and decoded again so they take the request path byte for byte."""
    rows = []
    for name, data in sample_photos().items():
        if (name in CALIBRATION_PHOTOS) != calibration:
            continue
        image = decode_image(data)
        for how in AUGMENTATIONS:
            upload = ImageUpload(encode(np.asarray(augment(image, how)), "PNG"), "image/png", f"{name}:{how}")
            rows.append(prepare_image(upload, spec))
    return Split(rows)


TextPart = Literal["calibration", "evaluation", "profiling", "training"]
DigitsPart = Literal["calibration", "evaluation", "training"]


def text_split(encode_texts: Callable[[list[str]], list], part: TextPart) -> Split:
    sentences = corpus_sentences()
    chosen = {
        "evaluation": sentences[1::8][:256],
        "calibration": sentences[0::8][:128],
        "profiling": sentences[2::8],
        "training": [s for i, s in enumerate(sentences) if i % 8 not in (0, 1, 2)],
    }[part]
    return Split(encode_texts(list(chosen)))


def digits_split(part: DigitsPart) -> Split:
    from sklearn.model_selection import train_test_split

    images, labels = digit_images()
    train_x, test_x, train_y, test_y = train_test_split(images, labels, test_size=0.25, random_state=0, stratify=labels)
    if part == "evaluation":
        return Split(list(test_x), test_y)
    if part == "calibration":
        return Split(list(train_x[:128]), train_y[:128])
    return Split(list(train_x), train_y)
