"""Image decoding and geometry: the one place both the service and the pipeline prepare pixels.

Normalization lives inside the ONNX graph, so this module only produces uint8 HWC arrays at
the model's input size.
"""

from __future__ import annotations

import io
import math
import warnings
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from serving.errors import EmptyInput, InputTooLarge, UndecodableInput, UnsupportedMediaType

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP")
ALLOWED_CONTENT_TYPES = frozenset({"image/jpeg", "image/jpg", "image/png", "image/webp", "image/bmp", "image/x-ms-bmp"})
DEFAULT_MAX_PIXELS = 40_000_000
DEFAULT_MAX_BYTES = 20 * 1024 * 1024


# Big images are brought down to this multiple of the size the model needs before they are
# resampled: JPEGs decoded at 1/2, 1/4 or 1/8 scale by libjpeg's scaled IDCT (Pillow's `draft`),
# others reduced by a whole factor first (`reducing_gap`). Pillow's own two-step reduction, which
# its documentation calls practically indistinguishable from fair resampling at 3. A 12-megapixel
# phone photo took 99 ms to decode and crop in full and 35 ms so on 2 cores; over 1 080 views of
# the sample photos (0.3-13 megapixels) the FP32 image model's top-1 agreed on 99.7 %, more than on
# the same views re-saved as JPEG at quality 95 (98.7 %; BENCHMARKS.md).
REDUCING_GAP = 3.0
ORIENTATION_TAG = 0x0112
TURNED_ORIENTATIONS = frozenset({5, 6, 7, 8})  # EXIF orientations that swap width and height
# How Pillow opens a 16-bit grayscale PNG (`I` in Pillow before 10.x): values up to 65 535.
SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})


class DecodedImage(NamedTuple):
    image: Image.Image  # RGB, upright, reduced where `min_side` allowed it
    size: tuple[int, int]  # (width, height) of the image as sent, upright: what monitoring records


def decode_image(
    data: bytes,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_bytes: int = DEFAULT_MAX_BYTES,
    name: str = "image",
) -> Image.Image:
    """Decode untrusted bytes to RGB at full size, refusing bombs before any pixel is decompressed."""
    return decode_sized(data, min_side=None, max_pixels=max_pixels, max_bytes=max_bytes, name=name).image


def decode_sized(
    data: bytes,
    *,
    min_side: int | None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_bytes: int = DEFAULT_MAX_BYTES,
    name: str = "image",
) -> DecodedImage:
    """`decode_image` for a consumer that needs the shorter side no longer than `min_side`: a JPEG
    is decoded at the smallest scale that keeps it `REDUCING_GAP` times that."""
    if not data:
        raise EmptyInput(f"{name}: the file is empty (0 bytes)")
    if len(data) > max_bytes:
        raise InputTooLarge(f"{name}: {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        with warnings.catch_warnings():
            # PIL's warnings are about the input: a decompression bomb, which our own pixel limit
            # below decides, corrupt EXIF data, ignored as a bad orientation is. In the log they
            # would only let any client fill it.
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
            width, height = image.size
            if width * height > max_pixels:
                raise InputTooLarge(
                    f"{name}: {width}x{height} = {width * height} pixels exceeds the limit of {max_pixels} pixels"
                )
            if min_side is not None and (reduced := REDUCING_GAP * min_side / min(width, height)) < 1:
                image.draft(None, (math.ceil(width * reduced), math.ceil(height * reduced)))  # JPEG only
            image.load()
            turned = image.getexif().get(ORIENTATION_TAG) in TURNED_ORIENTATIONS
            ImageOps.exif_transpose(image, in_place=True)  # a phone photo stored sideways is seen as shown
    except UnidentifiedImageError as exc:
        raise UndecodableInput(
            f"{name}: not a decodable image (supported formats: {', '.join(ALLOWED_FORMATS)})"
        ) from exc
    except Image.DecompressionBombError as exc:  # beyond PIL's own limit: refused before our size check
        raise InputTooLarge(f"{name}: more than {max_pixels} pixels") from exc
    except (OSError, SyntaxError, ValueError) as exc:  # PIL's text would name its internals, not the input
        raise UndecodableInput(f"{name}: corrupt or truncated image") from exc
    return DecodedImage(eight_bit(image).convert("RGB"), (height, width) if turned else (width, height))


def eight_bit(image: Image.Image) -> Image.Image:
    """A 16-bit grayscale image (PNG) scaled to 8 bits: Pillow's `convert("RGB")` clips its
    values at 255, and all but the darkest pixels would come out white."""
    if image.mode not in SIXTEEN_BIT_MODES:
        return image
    pixels = np.asarray(image).astype(np.uint32) >> 8
    return Image.fromarray(np.minimum(pixels, 255).astype(np.uint8), "L")


def resize_center_crop(image: Image.Image, *, resize: int, crop: int) -> np.ndarray:
    """Shorter side to `resize`, then a centred `crop` square: the ImageNet evaluation geometry.

    Done as one resize of just the source region that lands in the crop, so the cost is the
    crop's, whatever the shape: resizing the whole image first made a 30000×1 PNG into a
    7.7-gigapixel intermediate (10 s of CPU and gigabytes for one request)."""
    width, height = image.size
    side = crop * min(width, height) / resize  # the crop's side in source pixels
    left, top = (width - side) / 2, (height - side) / 2
    box = (left, top, left + side, top + side)
    resized = image.resize((crop, crop), Image.Resampling.BILINEAR, box=box, reducing_gap=REDUCING_GAP)
    return np.asarray(resized, dtype=np.uint8)


def resize_whole(image: Image.Image, *, size: int) -> np.ndarray:
    """The whole photo to `size` × `size`, its aspect ratio not kept: the geometry of processors
    that warp (ViT's), for a model trained so."""
    resized = image.resize((size, size), Image.Resampling.BILINEAR, reducing_gap=REDUCING_GAP)
    return np.asarray(resized, dtype=np.uint8)


def check_content_type(content_type: str | None, *, name: str = "image") -> None:
    """Reject declared non-image types early; a missing or generic type is sniffed by decoding."""
    if content_type is None:
        return
    media = content_type.split(";")[0].strip().lower()
    if media in ("", "application/octet-stream") or media in ALLOWED_CONTENT_TYPES:
        return
    raise UnsupportedMediaType(
        f"{name}: content type {media!r} is not an accepted image type ({', '.join(sorted(ALLOWED_CONTENT_TYPES))})"
    )
