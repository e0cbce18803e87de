"""A recipe's own data (`data:`): checked before any build, and read for the tasks' splits.

Calibrated and judged on general photos or Python's documentation, a domain model (X-rays, factory
parts, contracts) is quantized for the wrong inputs and its gate says little of the traffic it will
serve; with `data.images` or `data.texts`, calibration, the gate's slices and the drift reference
(texts: profiling and distillation too) use the user's data instead (pipeline/datasets.py splits it).
"""

from __future__ import annotations

from pipeline.datasets import MIN_TEXTS, DataError, ImageFolder, check_images, image_folder
from pipeline.recipe import IMAGES_FIELD, TEXTS_FIELD, LoadedRecipe, RecipeError, field_texts
from pipeline.sources import declared_class_names


def own_images(loaded: LoadedRecipe, class_names: list[str]) -> ImageFolder | None:
    """The recipe's `data.images`, labelled where its subfolders are `class_names`; None without."""
    if IMAGES_FIELD not in loaded.files:
        return None
    try:
        return image_folder(loaded.files[IMAGES_FIELD], class_names)
    except DataError as exc:
        raise RecipeError(f"{loaded.path}: {IMAGES_FIELD}: {exc}") from None


def own_texts(loaded: LoadedRecipe) -> list[str] | None:
    """The recipe's `data.texts`, one per line, blank lines skipped; None without."""
    if TEXTS_FIELD not in loaded.files:
        return None
    texts = field_texts(loaded, TEXTS_FIELD)
    if len(texts) < MIN_TEXTS:
        raise RecipeError(
            f"{loaded.path}: {TEXTS_FIELD}: {len(texts)} texts in {loaded.files[TEXTS_FIELD]}: at least {MIN_TEXTS} "
            "are needed, one per line (an eighth each to judge, calibrate and profile on)"
        )
    return texts


def check_data(loaded: LoadedRecipe) -> None:
    """Everything `data:` names is usable (every image decodes, labels where the budget counts
    accuracy), found before any build starts rather than after an export."""
    own_texts(loaded)
    recipe = loaded.recipe
    if IMAGES_FIELD not in loaded.files:
        return
    folder = own_images(loaded, declared_class_names(loaded))
    try:
        check_images(folder, recipe.image.input_spec())
    except DataError as exc:
        raise RecipeError(f"{loaded.path}: {IMAGES_FIELD}: {exc}") from None
    if folder.labels is None and recipe.budget and "accuracy" in recipe.budget.max_drop:
        raise RecipeError(
            f"{loaded.path}: budget.max_drop.accuracy: the images in {folder.root} have no labels to count it on "
            f"({IMAGES_FIELD}: one subfolder per class, named as in the labels)"
        )
