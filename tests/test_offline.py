"""The offline pipeline's train and solve stages on the real model, with a short profile so CI stays fast
(`make bundle` is the full run)."""
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer import offline, policy
from pjinfer.config import ConfigError


@pytest.fixture(scope="module")
def bundle(engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("pipeline") / "b"
    offline.run_profile(engine, path, tokens=2048, sparsity=0.5, train_tokens=1024, out=lambda *_: None)
    lines = []
    offline.run_train(engine, path, recall=0.9, max_rank=32, epochs=2, out=lines.append)
    return path, lines


def test_training_records_per_layer_figures_and_predictors_reload(engine, bundle):
    path, lines = bundle
    b = offline.open_bundle(engine, path)
    record = b.require("predictors")
    L = engine.config.n_layers
    assert len(record["ranks"]) == L and all(16 <= r <= 32 for r in record["ranks"])
    assert record["bytes"] > 0 and 0 < record["size_vs_model"] < 0.05
    assert "recall" in lines[0] and len(lines) == L + 2
    predictors = offline.load_predictors(engine, b)
    training = offline.load_training_data(b)
    # The reloaded predictor reproduces the stored figures' regime on its own training data:
    # it keeps most active neurons (recall was calibrated on held-out tokens of this data).
    for l in (0, 29):
        x, y = training.layer(l)
        predicted = np.asarray(predictors[l].active(jnp.asarray(x)))
        assert predicted.shape == y.shape
        assert (predicted & y).sum() / y.sum() > 0.85


def test_solver_places_what_fits_on_the_real_profile(engine, bundle):
    path, _ = bundle
    lines = []
    offline.run_solve(engine, path, device_memory=policy.parse_bytes("400MiB"), kv_tokens=2048, batch=64,
                      hardware=policy.Hardware(), out=lines.append)
    b = offline.open_bundle(engine, path)
    record = b.require("placement")
    hot = b.load_stage("placement")["hot"]
    assert hot.shape == (engine.config.n_layers, engine.config.d_ff)
    assert record["bytes_used"] <= record["budget_bytes"]
    assert record["bytes_used"] == hot.sum() * offline.neuron_bytes(engine)
    assert 0.2 < record["ffn_share_on_device"] < 0.45          # 400 MiB holds about a third of the FFN
    assert record["solve_seconds"] < 10 and record["status"] == "optimal"
    assert record["objective"] >= record["topk_objective"] - 1e-6
    stats = offline.load_stats(b)
    for l in range(hot.shape[0]):  # each layer's hot neurons are its most frequent ones
        if 0 < hot[l].sum() < hot.shape[1]:
            assert stats.freq[l][hot[l]].min() >= stats.freq[l][~hot[l]].max() - 1e-6
    assert any("ILP (optimal" in l for l in lines)


def test_budget_below_the_dense_part_is_a_clear_error(engine, bundle):
    path, _ = bundle
    with pytest.raises(ConfigError, match="cannot hold the dense part"):
        offline.run_solve(engine, path, device_memory=policy.parse_bytes("100MiB"), kv_tokens=2048, batch=64,
                          hardware=policy.Hardware(), out=lambda *_: None)


def test_cli_stages_fail_cleanly(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "pjinfer.cli", *a], capture_output=True, text=True,
                                    timeout=300)
    r = run("solve", "--bundle", str(tmp_path / "none"), "--device-memory", "1GiB")
    assert r.returncode == 2 and "not a pjinfer bundle" in r.stderr and "Traceback" not in r.stderr
    r = run("solve", "--bundle", str(tmp_path), "--device-memory", "lots")
    assert r.returncode == 2 and "pjinfer: error:" in r.stderr and "Traceback" not in r.stderr
    assert not any(tmp_path.iterdir())  # nothing half-written
