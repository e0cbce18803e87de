"""Calibration and evaluation inputs, disjoint by construction, prepared through the serving path.

Photos are split by name (calibration never sees an evaluation photo); each is expanded with
deterministic augmentations. Texts are split by position in the `pydoc_data` corpus.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

from pipeline.samples import encode, sample_photos, sample_texts
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


def text_split(encode_texts, *, calibration: bool, size: int = 128) -> Split:
    """Alternate sentences of the corpus go to calibration and evaluation."""
    texts = sample_texts(limit=2 * size)
    chosen = texts[0::2] if calibration else texts[1::2]
    return Split(encode_texts(chosen))
