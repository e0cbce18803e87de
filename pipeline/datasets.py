"""Calibration, evaluation and profiling inputs, disjoint by construction, prepared through the
serving path.

Photos are split by name (calibration never sees an evaluation photo); each is expanded into
many seeded random views, enough for the gate to see a 1 % budget: the held-out slice takes
random crops, scales, flips, colour changes and JPEG re-compression of the evaluation photos
(at least 512 inputs), the perturbed slice shifts, rotates, blurs and adds noise to them (as many).
Texts are split by position in the `pydoc_data` corpus: every eighth sentence for evaluation,
another eighth for calibration, a third eighth for profiling (real sentence lengths, unless the
recipe names a file of real requests), the rest for distillation. A recipe's own data (`data:`)
takes the place of the photos or the corpus: its images are split by file (a quarter calibrate),
its texts by line as the corpus is. Digits use a fixed stratified
75/25 train/test split; calibration draws from train only; the perturbed slice is the held-out
digits shifted by a pixel or slightly rotated, four copies of each.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

from sample_inputs import corpus_sentences, digit_images, sample_photos
from serving.classify import ImageUpload, prepare_sized_image
from serving.errors import RequestError
from serving.images import decode_image, decode_sized
from serving.model_spec import ImageInput

CALIBRATION_PHOTOS = ("astronaut", "camera", "china")
# Views per slice: at least this many, spread evenly over the slice's photos. More photos with
# fewer views each is the better evidence: the views of one scene stand or fall together.
VIEWS_PER_SLICE = {"calibration": 96, "held-out": 512, "perturbed": 512}
PhotoSlice = Literal["calibration", "held-out", "perturbed"]
PERTURBED_DIGIT_COPIES = 4  # 1 800 moved digits: a 1-point budget needs that many to be shown
# A recipe's own images (`data.images`): a quarter of the files calibrate, the rest are judged; at
# least as many judged as the built-in photos have scenes (6): the gate's bound over files takes
# Student's t at files - 1 degrees of freedom, 2.0 at 6 files but 6.3 at 2, too wide for any budget.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
CALIBRATION_SHARE = 4
MIN_IMAGES = 8
# Every judged file has a view in the held-out and the perturbed slice, and every variant runs them:
# at 224 px, 1 024 files are 150 MB a slice and a minute or two of each trial on 2 cores.
MAX_JUDGED_IMAGES = 1024
# A recipe's own texts (`data.texts`): every eighth judged, so 12 judged texts at least, as the ten
# nearest neighbours of `knn10_agreement` need 11; as many for calibration and for profiling.
MIN_TEXTS = 96


@dataclass(frozen=True)
class Split:
    """Model-ready rows (uint8 images or token-id lists), plus labels when the data has them,
    for images decoded from files each one's (width, height) before resizing, and where rows are
    made from shared sources each one's source (a photo's name, a digit's index): the gate's bounds
    count sources, not rows (pipeline/evaluate.py)."""

    rows: list
    labels: np.ndarray | None = None
    sizes: list[tuple[int, int]] | None = None
    groups: list | None = None

    def __len__(self) -> int:
        return len(self.rows)


def random_view(image: Image.Image, rng: np.random.Generator) -> bytes:
    """What users upload of a scene: a random crop (35-100 % of the area, aspect 3:4 to 4:3), maybe
    mirrored, brightness, contrast and saturation within ±30 %, saved as JPEG at quality 40-95."""
    width, height = image.size
    area = rng.uniform(0.35, 1.0) * width * height
    aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    crop_w, crop_h = min(width, round(np.sqrt(area * aspect))), min(height, round(np.sqrt(area / aspect)))
    left, top = rng.integers(0, width - crop_w + 1), rng.integers(0, height - crop_h + 1)
    view = image.crop((left, top, left + crop_w, top + crop_h))
    if rng.random() < 0.5:
        view = ImageOps.mirror(view)
    for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        view = enhance(view).enhance(rng.uniform(0.7, 1.3))
    buffer = io.BytesIO()
    view.save(buffer, format="JPEG", quality=int(rng.integers(40, 96)))
    return buffer.getvalue()


def perturbed_view(image: Image.Image, rng: np.random.Generator) -> bytes:
    """The whole scene, slightly disturbed: shifted by up to 8 %, rotated by up to 8°, blurred,
    or with Gaussian noise (σ 4-12 grey levels); sent as BMP, lossless and quick to write."""
    width, height = image.size
    how = rng.integers(4)
    if how == 0:
        dx, dy = (rng.uniform(-0.08, 0.08, 2) * (width, height)).round().astype(int)
        view = image.rotate(0, translate=(int(dx), int(dy)))
    elif how == 1:
        view = image.rotate(rng.uniform(-8, 8), resample=Image.Resampling.BILINEAR)
    elif how == 2:
        view = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.5, 1.5)))
    else:
        noise = rng.standard_normal((height, width, 3), dtype=np.float32) * rng.uniform(4, 12)
        view = Image.fromarray(np.clip(np.asarray(image, dtype=np.float32) + noise, 0, 255).astype(np.uint8))
    buffer = io.BytesIO()
    view.convert("RGB").save(buffer, format="BMP")
    return buffer.getvalue()


def photo_split(spec: ImageInput, part: PhotoSlice) -> Split:
    """Seeded random views of the part's sample photos, decoded and resized through the request path."""
    photos = {
        name: data for name, data in sample_photos().items() if (name in CALIBRATION_PHOTOS) == (part == "calibration")
    }
    return views_split(list(photos), lambda name: decode_image(photos[name]), spec, part)


def views_split(
    sources: Sequence[str],
    open_image: Callable[[str], Image.Image],
    spec: ImageInput,
    part: PhotoSlice,
    labels: Mapping[str, int] | None = None,
) -> Split:
    """The part's views of each source image (at least one each, VIEWS_PER_SLICE in all), in
    source order, each grouped by its source and labelled with its source's class where known."""
    rng = np.random.default_rng(list(VIEWS_PER_SLICE).index(part))
    view = perturbed_view if part == "perturbed" else random_view
    views_per_image = -(-VIEWS_PER_SLICE[part] // len(sources))
    prepared = []
    for name in sources:
        image = open_image(name)
        for index in range(views_per_image):
            prepared.append(prepare_sized_image(ImageUpload(view(image, rng), None, f"{name}:{index}"), spec))
    groups = [name for name in sources for _ in range(views_per_image)]
    return Split(
        [pixels for pixels, _ in prepared],
        labels=None if labels is None else np.array([labels[name] for name in groups]),
        sizes=[size for _, size in prepared],
        groups=groups,
    )


class DataError(ValueError):
    """What is wrong with a recipe's own data (`data:`); the recipe loader names the file and field."""


@dataclass(frozen=True)
class ImageFolder:
    """A recipe's own images: each file's path relative to the folder, in name order, and each
    one's class index where the folder is laid out as class subfolders named after the labels."""

    root: Path
    names: tuple[str, ...]
    labels: dict[str, int] | None

    def part(self, part: PhotoSlice) -> list[str]:
        """The files of a part: calibration's are never evaluated."""
        chosen = set(calibration_files(self.names) if part == "calibration" else judged_files(self.names))
        return [name for name in self.names if name in chosen]

    def open(self, name: str, spec: ImageInput) -> Image.Image:
        """Decoded as the service decodes an upload, at a reduced scale where a JPEG is much larger than
        the model needs (the views are made from that)."""
        path = self.root / name
        return decode_sized(path.read_bytes(), min_side=spec.resize, name=str(path)).image

    def split(self, spec: ImageInput, part: PhotoSlice) -> Split:
        return views_split(self.part(part), lambda name: self.open(name, spec), spec, part, self.labels)


def calibration_files(names: Sequence[str]) -> list[str]:
    """The files calibration takes: a quarter, at least one and at most as many as its views (one
    view each beyond: ONNX Runtime's calibrators keep every row's activations), those whose path
    hashes lowest, so the split depends on no listing order and a file added moves at most one
    other between calibration and evaluation."""
    return ranked(names)[: calibration_count(len(names))]


def judged_files(names: Sequence[str]) -> list[str]:
    """The files the gate judges on: those after calibration's in the same order, at most
    `MAX_JUDGED_IMAGES` (each has a view in both slices, and every variant runs them all)."""
    count = calibration_count(len(names))
    return ranked(names)[count : count + MAX_JUDGED_IMAGES]


def calibration_count(files: int) -> int:
    return min(max(1, files // CALIBRATION_SHARE), VIEWS_PER_SLICE["calibration"])


def ranked(names: Sequence[str]) -> list[str]:
    return sorted(names, key=lambda name: hashlib.sha256(name.encode()).hexdigest())


def image_files(root: Path) -> tuple[str, ...]:
    """The images under `root`, as paths relative to it in name order: searched recursively, by
    suffix, hidden files and folders (macOS's `._` copies and `.DS_Store`) left out. What a build
    reads of the folder, and so all that its content hash counts."""
    found = (path.relative_to(root) for path in root.rglob("*") if path.suffix.lower() in IMAGE_SUFFIXES)
    return tuple(
        sorted(
            path.as_posix()
            for path in found
            if not any(part.startswith(".") for part in path.parts) and (root / path).is_file()
        )
    )


def image_folder(root: Path, class_names: Sequence[str]) -> ImageFolder:
    """The images under `root` (`image_files`), labelled where each lies in a first-level subfolder named after a
    label (torchvision's ImageFolder layout); a layout that is half that is refused rather than
    silently left unlabelled."""
    names = image_files(root)
    if len(names) < MIN_IMAGES:
        raise DataError(
            f"{len(names)} images ({', '.join(IMAGE_SUFFIXES)}) in {root}: at least {MIN_IMAGES} are needed, "
            f"{MIN_IMAGES // CALIBRATION_SHARE} to calibrate on and {MIN_IMAGES - MIN_IMAGES // CALIBRATION_SHARE} "
            "to judge on"
        )
    folders = {name.split("/")[0] if "/" in name else "" for name in names}
    labelled, other = sorted(folders & set(class_names)), sorted(folders - set(class_names))
    if not labelled:
        return ImageFolder(root, names, None)
    if other:
        others = ", ".join(folder or "(images at its top)" for folder in other[:3])
        raise DataError(
            f"{root}: subfolders {', '.join(labelled[:3])} are labels but {others} are not: "
            "lay it out as one subfolder per label (ImageFolder), or with none named after one"
        )
    index = {label: i for i, label in reversed(list(enumerate(class_names)))}
    return ImageFolder(root, names, {name: index[name.split("/")[0]] for name in names})


def check_images(folder: ImageFolder, spec: ImageInput) -> None:
    """Every image decodes as the service would decode it (the message names the file), found
    before any build starts."""
    for name in folder.names:
        try:
            folder.open(name, spec)
        except RequestError as exc:
            raise DataError(str(exc)) from None
        except OSError as exc:
            raise DataError(f"{folder.root / name}: not readable ({exc.strerror})") from None


TextPart = Literal["calibration", "evaluation", "profiling", "training"]
DigitsPart = Literal["calibration", "held-out", "perturbed", "threshold", "training"]


def text_split(
    encode_texts: Callable[[list[str]], list], part: TextPart, sentences: Sequence[str] | None = None
) -> Split:
    """The part of `sentences` (default: the sample corpus) by position, as the module says."""
    sentences = corpus_sentences() if sentences is None else sentences
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
    if part == "held-out":
        return Split(list(test_x), test_y)
    if part in ("perturbed", "threshold"):
        # `threshold`: other moves of the same held-out digits, on which a cascade's threshold is
        # calibrated (pipeline/cascade.py): every other digit trained the teacher, which is sure of them.
        rng = np.random.default_rng(0 if part == "perturbed" else 1)
        copies = PERTURBED_DIGIT_COPIES
        return Split(
            [perturbed_digit(image, rng) for image in test_x for _ in range(copies)],
            np.repeat(test_y, copies),
            groups=np.repeat(np.arange(len(test_x)), copies).tolist(),
        )
    if part == "calibration":
        return Split(list(train_x[:128]), train_y[:128])
    return Split(list(train_x), train_y)


def perturbed_digit(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A digit moved by one pixel in a random direction, or rotated by up to 12°: what a model that
    learned the pixels rather than the strokes gets wrong."""
    if rng.random() < 0.5:
        dy, dx = [(0, 1), (0, -1), (1, 0), (-1, 0)][rng.integers(4)]
        moved = np.zeros_like(image)
        height, width = image.shape[:2]
        moved[max(dy, 0) : height + min(dy, 0), max(dx, 0) : width + min(dx, 0)] = image[
            max(-dy, 0) : height + min(-dy, 0), max(-dx, 0) : width + min(-dx, 0)
        ]
        return moved
    rotated = Image.fromarray(image).rotate(rng.uniform(-12, 12), resample=Image.Resampling.BILINEAR)
    return np.asarray(rotated)
