"""The gate's figures: drops with a one-sided 95 % upper confidence bound, so that a budget is
only met when the evaluation data is large enough to show it."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.evaluate import wilson_upper
from pipeline.recipe import Budget
from pipeline.tasks import TASKS
from pipeline.tuning import budget_failures

IMAGES, TEXT = TASKS["image-classification"], TASKS["text-embedding"]


def agreeing_probabilities(n: int, disagree: int) -> tuple[np.ndarray, np.ndarray]:
    """A reference over 10 classes, and a candidate that differs from it on `disagree` rows."""
    reference = np.tile(np.linspace(1.0, 0.1, 10), (n, 1))
    candidate = reference.copy()
    candidate[:disagree, [0, 1]] = candidate[:disagree, [1, 0]]
    return reference, candidate


def test_thirty_two_agreeing_images_cannot_show_a_one_percent_budget() -> None:
    figures = IMAGES.judge(*agreeing_probabilities(32, 0), None)
    assert figures.drops["top1_agreement"] == 0.0
    assert figures.drop_bounds["top1_agreement"] == pytest.approx(0.078, abs=0.001)
    assert budget_failures(Budget(max_drop={"top1_agreement": 0.01}), {"held-out": figures})


def test_a_thousand_images_can_and_the_bound_grows_with_each_disagreement() -> None:
    budget = Budget(max_drop={"top1_agreement": 0.01})
    agreeing = IMAGES.judge(*agreeing_probabilities(1024, 0), None)
    assert agreeing.drop_bounds["top1_agreement"] == pytest.approx(0.0026, abs=0.0001)
    assert not budget_failures(budget, {"held-out": agreeing})
    three = IMAGES.judge(*agreeing_probabilities(1024, 3), None)
    assert three.drops["top1_agreement"] == pytest.approx(3 / 1024)
    assert 3 / 1024 < three.drop_bounds["top1_agreement"] < 0.01
    eight = IMAGES.judge(*agreeing_probabilities(1024, 8), None)
    assert eight.drops["top1_agreement"] < 0.01 < eight.drop_bounds["top1_agreement"]
    assert budget_failures(budget, {"held-out": three, "perturbed": eight}) == [
        "perturbed: top1_agreement drop 0.0078 (95 % bound 0.0138) > budget.max_drop.top1_agreement 0.01"
    ]


def test_wilson_bound_is_sound_at_zero_and_tight_with_many() -> None:
    assert wilson_upper(0, 100) == pytest.approx(0.0264, abs=0.0001)
    assert wilson_upper(50, 100) == pytest.approx(0.582, abs=0.001)
    assert wilson_upper(100, 100) == 1.0


def test_accuracy_drop_counts_what_the_candidate_loses_less_what_it_gains() -> None:
    labels = np.zeros(400, dtype=int)
    reference = np.tile([0.9, 0.1], (400, 1))
    reference[:10] = [0.1, 0.9]  # the reference is wrong on 10
    candidate = reference.copy()
    candidate[10:30] = [0.1, 0.9]  # the candidate loses 20 ...
    candidate[:5] = [0.9, 0.1]  # ... and gets 5 of the reference's mistakes right
    figures = IMAGES.judge(reference, candidate, labels)
    assert figures.metrics["accuracy"] == pytest.approx(375 / 400)
    assert figures.drops["accuracy"] == pytest.approx(15 / 400)
    assert figures.drop_bounds["accuracy"] == pytest.approx(wilson_upper(20, 400) - 5 / 400)


def test_embedding_bounds_widen_with_the_spread_of_cosines_and_min_cosine_has_none() -> None:
    rng = np.random.default_rng(0)
    reference = rng.normal(size=(256, 16))
    steady = reference + 0.05 * rng.normal(size=reference.shape)
    uneven = reference + rng.uniform(0, 0.2, (256, 1)) * rng.normal(size=reference.shape)
    a, b = (TEXT.judge(reference, c, None) for c in (steady, uneven))
    assert a.drop_bounds["mean_cosine"] - a.drops["mean_cosine"] < b.drop_bounds["mean_cosine"] - b.drops["mean_cosine"]
    assert a.drop_bounds["min_cosine"] == a.drops["min_cosine"]


def test_top5_overlap_moves_before_top1_does() -> None:
    reference = np.tile(np.linspace(1.0, 0.1, 10), (64, 1))
    shuffled = reference.copy()  # the fifth class swaps places with the last
    shuffled[:, 4], shuffled[:, 9] = reference[:, 9], reference[:, 4]
    figures = IMAGES.judge(reference, shuffled, None)
    assert figures.metrics["top1_agreement"] == 1.0 and figures.metrics["top5_overlap"] == pytest.approx(0.8)


@pytest.mark.parametrize("classes", [2, 3, 5])
def test_a_model_of_five_classes_or_fewer_keeps_its_own_top5(classes: int) -> None:
    """Its top five are all its classes: the reference against itself overlaps fully, drops nothing."""
    reference = np.random.default_rng(0).dirichlet(np.ones(classes), size=64)
    figures = IMAGES.judge(reference, reference.copy(), None)
    assert figures.metrics["top5_overlap"] == figures.metrics["top5_agreement"] == 1.0
    assert figures.drops["top5_overlap"] == pytest.approx(0.0) and figures.drops["top5_agreement"] == 0.0
    budget = Budget(max_drop={"top1_agreement": 0.1, "top5_overlap": 0.01})
    assert not budget_failures(budget, {"held-out": figures})


def test_kl_divergence_is_zero_for_the_reference_and_grows_as_probabilities_move() -> None:
    reference = np.tile([0.7, 0.2, 0.1], (100, 1))
    same = IMAGES.judge(reference, reference, None)
    moved = IMAGES.judge(reference, np.tile([0.6, 0.3, 0.1], (100, 1)), None)
    assert same.drops["kl_divergence"] == pytest.approx(0.0, abs=1e-9)
    expected = 0.7 * np.log(0.7 / 0.6) + 0.2 * np.log(0.2 / 0.3)
    assert moved.metrics["kl_divergence"] == moved.drops["kl_divergence"] == pytest.approx(expected)
    assert moved.metrics["top1_agreement"] == 1.0, "the distribution moved, the answer did not"


def test_views_of_one_photo_count_as_one_source_when_they_disagree_together() -> None:
    """Eight photos of 128 views each: twelve disagreements all on one photo are weaker evidence
    than twelve spread over every photo, and the bound says so; spread evenly it is the rows'."""
    reference, candidate = agreeing_probabilities(1024, 12)
    photos = np.repeat([f"photo{i}" for i in range(8)], 128).tolist()
    together = IMAGES.judge(reference, candidate, None, photos)
    spread_rows = np.r_[np.arange(0, 1024, 128), np.arange(64, 1024, 256)]  # 8 + 4 rows, in every photo
    spread = candidate.copy()
    spread[:12], spread[spread_rows] = reference[:12], candidate[:12]
    apart = IMAGES.judge(reference, spread, None, photos)
    rows = IMAGES.judge(reference, candidate, None)
    assert together.drops["top1_agreement"] == apart.drops["top1_agreement"] == rows.drops["top1_agreement"]
    assert together.drop_bounds["top1_agreement"] > 1.5 * apart.drop_bounds["top1_agreement"]
    assert apart.drop_bounds["top1_agreement"] == pytest.approx(rows.drop_bounds["top1_agreement"])


def test_rows_that_are_each_their_own_source_keep_the_rows_bound() -> None:
    rng = np.random.default_rng(0)
    reference = rng.dirichlet(np.ones(10), 256)
    candidate = reference + rng.uniform(0, 0.02, reference.shape)
    candidate /= candidate.sum(-1, keepdims=True)
    alone = IMAGES.judge(reference, candidate, None, list(range(256)))
    rows = IMAGES.judge(reference, candidate, None)
    for metric in ("top1_agreement", "top5_overlap", "kl_divergence"):
        assert alone.drop_bounds[metric] == pytest.approx(rows.drop_bounds[metric], rel=0.01, abs=1e-9)


def test_a_single_source_leaves_the_rows_bound() -> None:
    reference, candidate = agreeing_probabilities(512, 3)
    one = IMAGES.judge(reference, candidate, None, ["photo"] * 512)
    assert one.drop_bounds == IMAGES.judge(reference, candidate, None).drop_bounds
