"""The data every variant is judged on: large enough for the budget, seeded, disjoint from
calibration, and perturbed where robustness is measured."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.datasets import CALIBRATION_PHOTOS, digits_split, photo_split
from sample_inputs import sample_photos
from serving.model_spec import ImageInput

SPEC = ImageInput(size=64, resize=72)


@pytest.fixture(scope="module")
def slices() -> dict:
    return {part: photo_split(SPEC, part) for part in ("calibration", "held-out", "perturbed")}


def test_photo_slices_are_large_enough_for_a_one_percent_budget(slices) -> None:
    evaluated = len(sample_photos()) - len(CALIBRATION_PHOTOS)
    assert len(slices["held-out"]) == len(slices["perturbed"]) == -(-512 // evaluated) * evaluated >= 512
    assert len(slices["calibration"]) == 32 * len(CALIBRATION_PHOTOS)
    assert all(row.shape == (64, 64, 3) and row.dtype == np.uint8 for row in slices["held-out"].rows)


def test_the_evaluation_photos_are_every_shipped_scene_but_the_calibration_ones() -> None:
    photos = sample_photos()
    assert {"motorcycle", "grace_hopper"} <= set(photos)
    assert len(photos) - len(CALIBRATION_PHOTOS) >= 6


def test_views_are_seeded_and_different_from_one_another(slices) -> None:
    again = photo_split(SPEC, "perturbed")
    assert all(np.array_equal(a, b) for a, b in zip(again.rows, slices["perturbed"].rows, strict=True))
    distinct = {row.tobytes() for row in slices["held-out"].rows}
    assert len(distinct) == len(slices["held-out"])


def test_each_view_names_its_photo_and_every_photo_has_as_many(slices) -> None:
    for part in ("calibration", "held-out", "perturbed"):
        names, counts = np.unique(slices[part].groups, return_counts=True)
        assert len(slices[part].groups) == len(slices[part]) and len(set(counts)) == 1
        assert (set(names) <= set(CALIBRATION_PHOTOS)) == (part == "calibration")


def test_calibration_never_sees_an_evaluated_view(slices) -> None:
    calibration = {row.tobytes() for row in slices["calibration"].rows}
    evaluated = {row.tobytes() for part in ("held-out", "perturbed") for row in slices[part].rows}
    assert not calibration & evaluated


def test_perturbed_digits_are_the_held_out_digits_moved_with_their_labels() -> None:
    held_out, perturbed = digits_split("held-out"), digits_split("perturbed")
    assert len(perturbed) == 4 * len(held_out)
    np.testing.assert_array_equal(perturbed.labels, np.repeat(held_out.labels, 4))
    assert perturbed.groups == np.repeat(np.arange(len(held_out)), 4).tolist(), "each copy names its digit"
    changed = [
        not np.array_equal(p, h) for p, h in zip(perturbed.rows, np.repeat(held_out.rows, 4, axis=0), strict=True)
    ]
    assert np.mean(changed) > 0.95
