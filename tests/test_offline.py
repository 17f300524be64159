"""The offline pipeline's train and solve stages on the real model, with a short profile so CI stays fast
(`make bundle` is the full run)."""
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.config import ConfigError
from pjinfer.load import data
from pjinfer.offline import policy
from pjinfer.offline import profile as prof
from pjinfer.offline import stages
from train.predictor import split_indices


def test_training_records_per_layer_figures_and_predictors_reload(engine, small_bundle):
    b = small_bundle.bundle
    lines = small_bundle.lines["train"]
    record = b.require("predictors")
    L = engine.config.n_layers
    assert len(record["ranks"]) == L and all(16 <= r <= 32 for r in record["ranks"])
    assert record["bytes"] > 0 and 0 < record["size_vs_model"] < 0.05
    assert "recall" in lines[0] and len(lines) == L + 2
    predictors = b.predictors(engine.config)
    training = stages.load_training_data(b)
    # The stored per-layer recall is the held-back one: recomputed here on the test split (tokens the weights
    # and the threshold never saw) with the reloaded predictors, it is the same number.
    _, _, test = split_indices(training.inputs.shape[1])
    for l in range(L):
        x, y = training.layer(l)
        predicted = np.asarray(predictors[l].active(jnp.asarray(x[test])))
        recall = (predicted & y[test]).sum() / y[test].sum()
        assert recall == pytest.approx(record["layers"][l]["recall"], abs=2e-3), l
    assert record["recall_min"] == min(m["recall"] for m in record["layers"])
    # Calibrated on validation at the 0.9 target (+0.005): measured 0.86-0.93 held back across layers.
    assert record["recall_min"] > 0.8 and np.mean([m["recall"] for m in record["layers"]]) > 0.88


def test_predictors_keep_their_recall_on_unseen_text(engine, small_bundle):
    # Wiki's evaluation slice is not in the calibration set: layer inputs and labels (contribution above the
    # profile's threshold) the predictors never saw in any split.
    stats = stages.load_stats(small_bundle.bundle)
    predictors = small_bundle.bundle.predictors(engine.config)
    ids = engine.tokenizer.encode(data.wiki_eval_text(), add_special=False)[:prof.BATCH * prof.WINDOW]
    inputs, contrib = prof.layer_activity(engine.graphdef, engine.state,
                                          jnp.asarray(np.asarray(ids, np.int32).reshape(prof.BATCH, prof.WINDOW)))
    recalls, skipped = [], []
    for l, predictor in enumerate(predictors):
        y = np.asarray(contrib[l]) > stats.thresholds[l]
        predicted = np.asarray(predictor.active(inputs[l]))
        recalls.append((predicted & y).sum() / y.sum())
        skipped.append(1 - predicted.mean())
    recalls, skipped = np.array(recalls), np.array(skipped)
    # Measured: recall 0.83-0.95 per layer (mean 0.89) against 0.86-0.93 on the held-back split.
    assert recalls.min() > 0.78 and recalls.mean() > 0.85, recalls.round(3)
    assert 0.02 < skipped.mean() < 0.3


def test_solver_places_what_fits_on_the_real_profile(engine, small_bundle):
    lines = small_bundle.lines["solve"]
    b = small_bundle.bundle
    record = b.require("placement")
    hot = b.load_stage("placement")["hot"]
    assert hot.shape == (engine.config.n_layers, engine.config.d_ff)
    assert record["bytes_used"] <= record["budget_bytes"]
    assert record["bytes_used"] == hot.sum() * stages.neuron_bytes(engine)
    assert 0.2 < record["ffn_share_on_device"] < 0.45          # 355 MiB holds about a third of the FFN
    assert record["solve_seconds"] < 10 and record["status"] == "optimal"
    assert record["objective"] >= record["topk_objective"] - 1e-6
    stats = stages.load_stats(b)
    for l in range(hot.shape[0]):  # each layer's hot neurons are its most frequent ones
        if 0 < hot[l].sum() < hot.shape[1]:
            assert stats.freq[l][hot[l]].min() >= stats.freq[l][~hot[l]].max() - 1e-6
    assert any("ILP (optimal" in l for l in lines)


def test_budget_below_the_dense_part_is_a_clear_error(engine, small_bundle):
    path = small_bundle.path
    with pytest.raises(ConfigError, match="cannot hold the dense part"):
        stages.run_solve(engine, path, device_memory=policy.parse_bytes("100MiB"), kv_tokens=2048, batch=64,
                          hardware=policy.Hardware(), out=lambda *_: None)
