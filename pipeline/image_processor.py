"""A Hugging Face image classifier's pre-processing, as the service reproduces it.

`AutoImageProcessor` resizes, crops, rescales and normalizes each photo; the service resizes the
shorter side and crops the centre square, or squeezes the whole photo to a square as ViT's
processor does (bilinear, antialiased: serving/images.py), and the graph normalizes on the 0-255
scale. So a recipe without `image:` takes its geometry and its mean/std from
`preprocessor_config.json`, and a processor the service would not reproduce (a warp to a
rectangle, no crop, another channel order, padding) is refused, naming the setting, rather than
served differently. At build time `check_processor` compares both on the sample photos, which also
catches processor classes with resize rules of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from sample_inputs import sample_photos
from serving.classify import ImageUpload, prepare_image
from serving.images import decode_image

if TYPE_CHECKING:  # pipeline.recipe reads a processor through this module when a recipe has no `image`
    from pipeline.recipe import ImagePreprocess

PROCESSOR_FILE = "preprocessor_config.json"
# PIL's resampling filters, as processors record them; the service resizes with BILINEAR (2).
# Lanczos and bicubic are sharper and differ by a few levels on edges; nearest, box and hamming
# differ more, and are refused.
SMOOTH_RESAMPLING = {1: "lanczos", 2: "bilinear", 3: "bicubic"}
CONVNEXT_WARP_EDGE = 384  # ConvNextImageProcessor warps to a square from this shortest_edge on, with no crop
# Largest mean absolute difference, in levels of 0-255, between the processor's pixels and the
# service's on a sample photo. On the nine, bilinear standing in for bicubic and the processor's
# whole-pixel crop offset differ by at most 7 (3 on average; the finely detailed motorcycle the
# most); a resize 3 % too large by 23, a warp instead of a crop by 45, LevitImageProcessor's own
# rule (256/224 × shortest_edge) read as a plain shortest_edge by 46.
MAX_PIXEL_DIFF = 15.0


class ImageProcessorError(ValueError):
    """A processor whose pre-processing the service cannot reproduce; says which setting."""


class ProcessorPreprocess(NamedTuple):
    """The fields of a recipe's `image:` (pipeline.recipe.ImagePreprocess) that reproduce a processor."""

    size: int
    resize: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop: bool = True


def preprocess_of(model_dir: Path) -> ProcessorPreprocess:
    """The `image:` that reproduces the directory's processor; errors name its file."""
    processor = load_processor(model_dir)
    try:
        return serving_preprocess(processor)
    except ImageProcessorError as exc:
        raise ImageProcessorError(f"{model_dir / PROCESSOR_FILE}: {exc}") from None


def _field(settings: Any, key: str) -> Any:
    """A field of a processor's size dict (a `SizeDict` in transformers 5, a dict before)."""
    return settings.get(key) if isinstance(settings, dict) else getattr(settings, key, None)


def _three(name: str, values: Any) -> tuple[float, ...]:
    """A per-channel setting for the three RGB channels (one value stands for all three)."""
    values = [float(v) for v in (values if isinstance(values, list | tuple) else [values])]
    if len(values) not in (1, 3):
        raise ImageProcessorError(f"{name} has {len(values)} values; the service sends 3 channels (RGB)")
    return tuple(values * 3 if len(values) == 1 else values)


def load_processor(model_dir: Path) -> Any:
    from transformers import AutoImageProcessor

    if not (model_dir / PROCESSOR_FILE).is_file():
        raise ImageProcessorError(
            f"{model_dir} has no {PROCESSOR_FILE}: give `image:` in the recipe, or save the processor the model "
            "was trained with beside it (AutoImageProcessor.from_pretrained(...).save_pretrained(path))"
        )
    try:
        return AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ImageProcessorError(f"{model_dir / PROCESSOR_FILE}: not an image processor: {exc}") from exc


def _geometry(processor: Any) -> tuple[int, int, bool]:
    """(resize, size, crop): the shorter side before the crop, and the crop's side; or, where the
    processor squeezes every photo to a square (ViT's), the square's side twice and no crop."""
    size, crop = processor.size, getattr(processor, "crop_size", None)
    shortest = _field(size, "shortest_edge")
    if shortest is None:
        height, width = _field(size, "height"), _field(size, "width")
        if height != width or getattr(processor, "do_center_crop", None):
            raise ImageProcessorError(
                f"resizes every photo to {height}x{width}{' and crops it' if height == width else ''}, where the "
                "service squeezes a photo to a square, or keeps its aspect ratio and crops the centre square"
            )
        return height, height, False
    if getattr(processor, "do_center_crop", None) and crop is not None:
        height, width = _field(crop, "height"), _field(crop, "width")
        if height != width:
            raise ImageProcessorError(f"crops {height}x{width}; the service crops a square")
        if height > shortest:
            raise ImageProcessorError(f"crops {height}x{height} from a shorter side of {shortest}")
        return shortest, height, True
    crop_pct = getattr(processor, "crop_pct", None)
    if crop_pct is not None and not 0 < crop_pct <= 1:
        raise ImageProcessorError(f"crop_pct {crop_pct}: a crop is a share of the photo, between 0 and 1")
    if crop_pct is not None and shortest < CONVNEXT_WARP_EDGE:  # ConvNeXt's rule, which its processor applies
        return int(shortest / crop_pct), shortest, True
    if crop_pct is not None:  # from 384 on, ConvNeXt's processor squeezes the photo, as ViT's does
        return shortest, shortest, False
    raise ImageProcessorError("resizes the shorter side without a centre crop; the service crops a square")


def _scale(processor: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """mean and std on the 0-255 scale: (x·f − m)/s is (x − m/f)/(s/f)."""
    factor = processor.rescale_factor if processor.do_rescale else 1.0
    if not processor.do_normalize:
        return (0.0, 0.0, 0.0), (round(1 / factor, 6),) * 3
    mean, std = _three("image_mean", processor.image_mean), _three("image_std", processor.image_std)
    return tuple(round(m / factor, 6) for m in mean), tuple(round(s / factor, 6) for s in std)


def serving_preprocess(processor: Any) -> ProcessorPreprocess:
    """The recipe's `image:` that reproduces `processor`, or ImageProcessorError naming what cannot be."""
    for flag, why in (
        ("do_flip_channel_order", "flips RGB to BGR"),
        ("do_pad", "pads photos"),
        ("rescale_offset", "rescales to [-1, 1] by an offset"),
    ):
        if getattr(processor, flag, None):
            raise ImageProcessorError(f"{flag}: {why}, which the service does not")
    if not processor.do_resize:
        raise ImageProcessorError("do_resize false: the model takes photos at any size; the service crops a square")
    resample = int(getattr(processor, "resample", 2))
    if resample not in SMOOTH_RESAMPLING:
        raise ImageProcessorError(
            f"resample {resample}: the service resizes bilinearly, and only stands in for "
            f"{', '.join(SMOOTH_RESAMPLING.values())}"
        )
    mean, std = _scale(processor)
    try:
        resize, size, crop = _geometry(processor)
    except ImageProcessorError as exc:
        side = _field(processor.size, "shortest_edge") or _field(processor.size, "height")
        crop = getattr(processor, "crop_size", None)
        size = _field(crop, "height") if getattr(processor, "do_center_crop", None) and crop is not None else side
        raise ImageProcessorError(
            f"{exc}; to serve it with the service's centre crop instead, give the recipe "
            f"image: {{size: {size}, resize: {side}, mean: {_listed(mean)}, std: {_listed(std)}}}"
        ) from None
    return ProcessorPreprocess(size=size, resize=resize, mean=mean, std=std, crop=crop)


def geometry(preprocess: ImagePreprocess) -> str:
    if not preprocess.crop:
        return f"the whole photo to {preprocess.size}x{preprocess.size}"
    return f"resize {preprocess.resize}, centre crop {preprocess.size}"


def _listed(values: tuple[float, ...]) -> str:
    return "[" + ", ".join(f"{value:.6g}" for value in values) + "]"


@dataclass(frozen=True)
class ProcessorMatch:
    """How far the service's pixels are from the processor's on the sample photos, in levels of 0-255."""

    mean_abs_diff: dict[str, float]  # photo → mean |service − processor| over its pixel values

    @property
    def worst(self) -> tuple[str, float]:
        return max(self.mean_abs_diff.items(), key=lambda item: item[1])


def processor_inputs(processor: Any, photos: dict[str, bytes]) -> dict[str, np.ndarray]:
    """photo → the processor's pixel values (CHW float), from the photo decoded as the service decodes it."""
    return {
        name: np.asarray(processor(images=decode_image(data), return_tensors="np")["pixel_values"][0])
        for name, data in photos.items()
    }


def compare_with_processor(processor: Any, preprocess: ImagePreprocess, photos: dict[str, bytes]) -> ProcessorMatch:
    spec = preprocess.input_spec()
    mean, std = np.array(preprocess.mean).reshape(3, 1, 1), np.array(preprocess.std).reshape(3, 1, 1)
    diffs = {}
    for name, normalized in processor_inputs(processor, photos).items():
        served = prepare_image(ImageUpload(photos[name], None, name), spec).transpose(2, 0, 1)
        expected = normalized * std + mean  # back on the 0-255 scale the service's pixels are on
        diffs[name] = float(np.abs(served - expected).mean()) if served.shape == expected.shape else float("inf")
    return ProcessorMatch(diffs)


def check_processor(model_dir: Path, preprocess: ImagePreprocess) -> ProcessorMatch:
    """The service's pixels against the processor's on the sample photos; ImageProcessorError names
    the photo where they part by more than MAX_PIXEL_DIFF (a processor class with a rule of its own)."""
    match = compare_with_processor(load_processor(model_dir), preprocess, sample_photos())
    photo, diff = match.worst
    if diff > MAX_PIXEL_DIFF:
        raise ImageProcessorError(
            f"{model_dir / PROCESSOR_FILE}: the service's pixels ({geometry(preprocess)}) differ from the "
            f"processor's by {diff:.0f} levels of 255 on average on the sample photo {photo!r} (resampling alone "
            f"stays under {MAX_PIXEL_DIFF:.0f}): its resize rule is not reproduced; "
            "give `image:` in the recipe"
        )
    return match
