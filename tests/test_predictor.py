"""Activation predictors on synthetic data with a known hidden rank.

Labels come from a hidden rank-k linear map: y = (x @ A @ B > 0), about half the neurons active.
A ReLU predictor of rank 2k represents it exactly (z = relu(z) - relu(-z)); rank k only in part.
All trainings share one data shape, so each rank compiles once for the whole file.
"""
import jax
import numpy as np
import pytest
from flax import nnx

from train.predictor import (Threshold, calibrate_threshold, evaluate, fit_layer, initial_rank,
                             split_indices, train_predictor)

HIDDEN_RANK = 16


def hidden_rank_data(n=8192, d=64, n_ff=256, k=HIDDEN_RANK, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    a = rng.standard_normal((d, k)) / np.sqrt(d)
    b = rng.standard_normal((k, n_ff)) / np.sqrt(k)
    return x, x @ a @ b > 0


@pytest.fixture(scope="module")
def data():
    return hidden_rank_data()


@pytest.fixture(scope="module")
def trained(data):
    calls = []
    model, metrics = train_predictor(*data, rank=2 * HIDDEN_RANK, progress=lambda d, t: calls.append((d, t)))
    return model, metrics, calls


def params_of(model):
    return [np.asarray(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_training_lowers_the_loss_and_reports_progress(trained):
    _, metrics, calls = trained
    first, last = metrics["train_loss"]
    assert last < 0.5 * first
    assert len(calls) > 1 and calls == [(e, len(calls)) for e in range(1, len(calls) + 1)]   # once per epoch


def test_held_back_recall_clears_the_target_and_skips_most_inactive_neurons(trained):
    model, m, _ = trained
    assert m["recall"] >= 0.95
    assert m["precision"] > 0.8
    assert 0.45 < m["true_sparsity"] < 0.55
    assert m["predicted_sparsity"] > 0.8 * m["true_sparsity"]
    assert m["rank"] == model.rank == 2 * HIDDEN_RANK
    assert m["params"] == 64 * 32 + 32 * 256 + 256


def test_active_is_logits_above_the_stored_threshold(trained, data):
    model, m, _ = trained
    x = data[0][:512]
    assert float(model.threshold[...]) == np.float32(m["threshold"])
    np.testing.assert_array_equal(np.asarray(model.active(x)), np.asarray(model(x)) > m["threshold"])
    # The threshold is part of the saved state (not a Param, so training leaves it alone).
    thresholds = jax.tree.leaves(nnx.state(model, Threshold))
    assert len(thresholds) == 1 and float(thresholds[0]) == float(model.threshold[...])


def test_threshold_is_the_highest_cutoff_that_meets_the_recall_on_a_hand_made_example():
    logits = np.array([[3.0, -1.0, 2.0, 0.5], [1.0, 2.5, -2.0, 0.0]], np.float32)
    y = np.array([[True, False, True, False], [True, False, False, True]])
    # Active logits, descending: 3.0, 2.0, 1.0, 0.0. Recall 0.75 needs 3 of 4 above the cutoff.
    t = calibrate_threshold(logits, y, 0.75)
    assert np.float32(t) < 1.0 and np.nextafter(np.float32(t), np.float32(np.inf)) == 1.0
    assert evaluate(logits, y, t)["recall"] == 0.75
    assert evaluate(logits, y, 1.0)["recall"] == 0.5          # the next float up loses the target
    m = evaluate(logits, y, t)
    assert m["precision"] == 3 / 4 and m["predicted_sparsity"] == 0.5 and m["true_sparsity"] == 0.5
    # A target between steps rounds up (0.6 of 4 needs 3); recall 1 keeps every active entry.
    assert calibrate_threshold(logits, y, 0.6) == t
    assert evaluate(logits, y, calibrate_threshold(logits, y, 1.0))["recall"] == 1.0
    # Ties: two active logits equal to the cutoff value are both kept.
    tied, all_active = np.array([[2.0, 1.0, 1.0, 0.0]], np.float32), np.ones((1, 4), bool)
    assert evaluate(tied, all_active, calibrate_threshold(tied, all_active, 0.5))["recall"] == 0.75


def test_splits_are_disjoint_deterministic_and_80_10_10():
    train, val, test = split_indices(16384)
    assert len(np.unique(np.concatenate([train, val, test]))) == 16384
    assert (len(train), len(val), len(test)) == (13312, 1536, 1536)
    assert all(np.array_equal(a, b) for a, b in zip((train, val, test), split_indices(16384)))
    assert val.min() == 8 * 256 and test.min() == 9 * 256   # whole 256-token blocks


def test_same_seed_same_predictor(data, trained):
    model, metrics, _ = trained
    again, again_metrics = train_predictor(*data, rank=2 * HIDDEN_RANK)
    for a, b in zip(params_of(model), params_of(again)):
        np.testing.assert_array_equal(a, b)
    assert again_metrics["threshold"] == metrics["threshold"] and again_metrics["recall"] == metrics["recall"]
    other, _ = train_predictor(*data, rank=2 * HIDDEN_RANK, seed=1)
    assert not np.array_equal(params_of(model)[0], params_of(other)[0])


def test_start_rank_follows_density():
    assert initial_rank(0.5, 16, 256) == 128
    assert initial_rank(0.9, 16, 256) == 32       # sparser layers start smaller
    assert initial_rank(0.99, 16, 256) == 16      # never below min_rank
    assert initial_rank(0.0, 16, 256) == 256


def test_rank_grows_when_the_start_is_too_small(data):
    _, m = fit_layer(*data, start_rank=HIDDEN_RANK, max_rank=128)
    assert m["rank"] > 16 and not m["capped"]
    assert min(m["tried"]) == 16 and m["recall"] >= 0.95
    assert m["predicted_sparsity"] > m["tried"][16]["predicted_sparsity"] + 0.05


def test_rank_shrinks_when_the_start_is_too_big(data):
    _, m = fit_layer(*data, start_rank=128, max_rank=128)
    assert m["rank"] < 128 and not m["capped"]
    assert m["rank"] > HIDDEN_RANK           # at rank k a ReLU predictor captures the map only in part
    assert 128 in m["tried"] and m["recall"] >= 0.95


def test_without_the_sparsity_bar_the_rank_stops_where_doubling_stops_paying(data):
    # Rank 64 is near-exact (2k = 32 already represents the map); 32 -> 64 still gains about 5 points.
    _, m = fit_layer(*data, start_rank=64, max_rank=128, sparsity_fraction=2.0, tolerance=0.03)
    assert m["rank"] == 64 and sorted(m["tried"]) == [32, 64, 128]
    assert m["tried"][128]["predicted_sparsity"] - m["predicted_sparsity"] < 0.03


def test_rank_search_marks_a_capped_layer(data):
    _, m = fit_layer(*data, start_rank=16, max_rank=16)
    assert m["capped"] and m["rank"] == 16 and list(m["tried"]) == [16]
