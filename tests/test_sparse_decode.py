"""cpu_offload.sparse_decode and pjinfer.offline.teal: the host decode that reads only inputs above fixed thresholds,
against XLA applying the same thresholds to the same (dequantized) values."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from cpu_offload.sparse_decode import SparseHostDecoder
from pjinfer.config import ConfigError
from pjinfer.offline import teal
from pjinfer.runtime import host as pjinfer_host
from pjinfer.runtime.engine import Engine
from pjinfer.runtime.model import set_thresholds
from tests.conftest import random_weights, tiny_config

jax = pytest.importorskip("jax")
jnp = jax.numpy
nnx = pytest.importorskip("flax").nnx

# The smallest Llama the 4-bit layout takes: every output a multiple of 32, d_model of 64 (the int8 head);
# d_ff = 96 is three blocks, the vocabulary odd.
CONFIG = dict(d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=96, vocab_size=97)


def _xla_twin(engine: Engine) -> Engine:
    """The same engine with its host decoder removed: one-token steps run through XLA on the same values."""
    twin = copy.copy(engine)
    model = nnx.merge(engine.graphdef, engine.state)
    pjinfer_host.detach(model)
    twin.host = None
    twin.graphdef, twin.state = nnx.split(model)
    return twin


def _jitted_step(engine: Engine):
    """engine's one-token decode step, jitted: (state, token, pos, cache) -> (logits, cache)."""
    return jax.jit(lambda state, *args: nnx.merge(engine.graphdef, state).decode(*args))


def _step_logits(engine: Engine, prompt, tokens):
    """Logits of each decode step feeding `tokens` after the prompt (prefill by XLA in both)."""
    step = _jitted_step(engine)
    _, cache = engine.prefill(prompt, cache_len=engine.plan(len(prompt), len(tokens) + 1)[1])
    out = []
    for i, t in enumerate(tokens):
        logits, cache = step(engine.state, jnp.int32(t), jnp.int32(len(prompt) + i), cache)
        out.append(np.asarray(logits))
    return np.stack(out)


def _quantile_thresholds(config, weights, levels, seed=0):
    """Thresholds at the given per-tensor sparsity levels, fitted on random tokens with teal's own quantile pass."""
    dense = Engine(config, weights, None)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, config.vocab_size, (2, 64)), jnp.int32)
    q = np.asarray(teal._quantiles(dense.graphdef, dense.state, tokens, jnp.asarray(teal.LEVELS, jnp.float32)))
    return teal._thresholds(q, np.broadcast_to(np.asarray(levels, float), (config.n_layers, 4)))


@pytest.mark.slow
@pytest.mark.parametrize("activation,levels", [("swiglu", (0.3, 0.2, 0.4, 0.5)), ("swiglu", (0.0, 0.0, 0.0, 0.0)),
                                               ("reglu", (0.5, 0.5, 0.5, 0.0))])
def test_host_decode_equals_xla_with_the_same_thresholds(activation, levels):
    config = tiny_config(activation=activation, **CONFIG)
    weights = random_weights(config, seed=3)
    thresholds = _quantile_thresholds(config, weights, levels)
    host = Engine(config, weights, None, weights_format="q4_1", thresholds=thresholds)
    assert isinstance(host.host, SparseHostDecoder)
    assert isinstance(nnx.merge(host.graphdef, host.state).head, pjinfer_host.HostHead)
    xla = _xla_twin(host)
    prompt = [5, 17, 42, 8, 60]
    got = host.generate(prompt, max_new_tokens=16, stop_ids=[])
    assert len(got) == 16 and got == xla.generate(prompt, max_new_tokens=16, stop_ids=[])
    a, b = _step_logits(host, prompt, got), _step_logits(xla, prompt, got)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())


def test_thresholds_change_the_model_and_zero_thresholds_do_not():
    """Thresholds of 0 on SwiGLU skip nothing: the same logits as XLA without thresholds on the same values; real
    thresholds give other logits (the rule is applied, not ignored)."""
    config = tiny_config(**CONFIG)
    weights = random_weights(config, seed=4)
    zeros = Engine(config, weights, None, weights_format="q4_1", thresholds=np.zeros((config.n_layers, 4)))
    plain = _xla_twin(zeros)
    model = nnx.merge(plain.graphdef, plain.state)
    set_thresholds(model, None)
    plain.graphdef, plain.state = nnx.split(model)
    prompt, tokens = [1, 2, 3], [4, 5, 6, 7]
    np.testing.assert_allclose(_step_logits(zeros, prompt, tokens), _step_logits(plain, prompt, tokens),
                               rtol=1e-4, atol=1e-4)
    sparse = Engine(config, weights, None, weights_format="q4_1",
                    thresholds=_quantile_thresholds(config, weights, (0.5, 0.5, 0.5, 0.5)))
    assert np.abs(_step_logits(sparse, prompt, tokens) - _step_logits(zeros, prompt, tokens)).max() > 1e-2


def test_every_input_below_its_threshold_leaves_the_residual_stream_alone():
    """Empty active sets: every matrix adds nothing, so the final hidden state is the embedding, normed."""
    config = tiny_config(**CONFIG)
    weights = random_weights(config, seed=5)
    host = Engine(config, weights, None, weights_format="q4_1", thresholds=np.full((config.n_layers, 4), 1e9))
    model = nnx.merge(host.graphdef, host.state)
    from pjinfer.runtime.model import KVCache

    cache = KVCache.create(config, 1, config.max_seq_len)
    hidden, _ = jax.jit(lambda state, c: nnx.merge(host.graphdef, state)(jnp.asarray([[7]], jnp.int32), 3, c))(
        host.state, cache)
    np.testing.assert_allclose(np.asarray(hidden[0, 0]), np.asarray(model.final_norm(model.embed[...][7])),
                               rtol=1e-5, atol=1e-6)


def test_bad_thresholds_are_refused():
    config = tiny_config(**CONFIG)
    weights = random_weights(config)
    for bad, fragment in ((np.zeros((config.n_layers, 3)), "thresholds must be"),
                          (np.full((config.n_layers, 4), -1.0), ">= 0"),
                          (np.full((config.n_layers, 4), np.nan), "finite")):
        with pytest.raises(ConfigError, match=fragment):
            Engine(config, weights, None, weights_format="q4_1", thresholds=bad)
    with pytest.raises(ConfigError, match="--weights int8 is the dense host decode"):
        Engine(config, weights, None, weights_format="int8", thresholds=np.zeros((config.n_layers, 4)))


def test_calibrate_refuses_bad_targets_and_short_text():
    config = tiny_config(**CONFIG)
    engine = Engine(config, random_weights(config), None)
    for target in (-0.1, 0.95):
        with pytest.raises(ConfigError, match=r"target sparsity must be in \[0, 0.9\]"):
            teal.calibrate(engine, list(range(5000)), target=target, relu_family=False)
    with pytest.raises(ConfigError, match="calibration text has 100 tokens"):
        teal.calibrate(engine, list(range(100)), target=0.3, relu_family=False)


def test_calibrate_reaches_its_target_on_held_back_text():
    config = tiny_config(**CONFIG)
    engine = Engine(config, random_weights(config, seed=6), None)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (teal.FIT_WINDOWS + teal.HELD_WINDOWS) * teal.WINDOW)
    fitted = teal.calibrate(engine, ids.tolist(), target=0.3, relu_family=False)
    shares = teal.weight_shares(config)
    achieved = (fitted["levels"] * shares).sum() / (shares.sum() * config.n_layers)
    assert 0.3 - 1e-9 <= achieved < 0.3 + teal.STEP and (fitted["thresholds"] > 0).all()
    assert fitted["loss"] != fitted["loss_dense"]
    relu_config = tiny_config(activation="reglu", **CONFIG)
    relu = teal.calibrate(Engine(relu_config, random_weights(relu_config), None), ids.tolist(), target=0.3,
                          relu_family=True)
    assert (relu["thresholds"][:, 3] == 0).all() and (relu["thresholds"][:, :3] > 0).all()
    achieved = (relu["levels"] * shares).sum() / (shares.sum() * config.n_layers)
    assert 0.3 - 1e-9 <= achieved < 0.3 + teal.STEP   # the three other inputs carry the target


def test_uniform_levels_hit_the_target_on_the_grid():
    config = tiny_config(**CONFIG)
    shares = teal.weight_shares(config)
    for target in (0.0, 0.05, 0.123, 0.3, 0.9):
        levels = teal.uniform_levels(config, target, relu_family=False)
        assert set(np.unique(levels)) <= set(teal.LEVELS) and np.all(levels == levels[0, 0])
        achieved = (levels * shares).sum() / (shares.sum() * config.n_layers)
        assert target - 1e-9 <= achieved < target + teal.STEP
    capped = teal.uniform_levels(config, 0.9, relu_family=True)   # 0.9 of three inputs is all the grid allows
    assert (capped[:, :3] == 0.9).all() and (capped[:, 3] == 0).all()


# ------------------------------------------------------------------------------------------------ command line
def test_calibrate_and_q4_1_bundle_bad_input_get_one_line(tmp_path, capsys):
    import json

    from tests.support.cli import assert_clean_error, run_cli

    def pjinfer(*args):
        return run_cli(capsys, *args)

    assert_clean_error(pjinfer("calibrate", "--bundle", str(tmp_path / "b"), "--target", "0.95"),
                       "--target must be in [0, 0.9]")
    short = tmp_path / "short.txt"
    short.write_text("Too short to fit thresholds on. " * 20)
    assert_clean_error(pjinfer("calibrate", "--bundle", str(tmp_path / "b"), "--text-file", str(short)),
                       "calibration text has")
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps({"format": 1, "stages": {}, "model": {
        "identity": "0" * 16, "name": "another model"}}))
    assert_clean_error(pjinfer("calibrate", "--bundle", str(other)), "made for another model")
    assert_clean_error(pjinfer("generate", "--prompt", "x", "--weights", "q4_1", "--bundle", str(other)),
                       "made for another model")


@pytest.mark.real_model
def test_real_model_host_decode_equals_xla_with_the_same_thresholds():
    """The default model, thresholds of the calibrated magnitudes (about 20-40% of each input skipped): each decode
    step, run by the host and by XLA on the same cache (fed the host's greedy tokens, then fixed ones), agrees to float
    rounding in most steps, and picks the same token in all but at most one. The others differ: within a step each
    path writes its own float16 k and v, a value the two compute a hair apart can round to neighbouring float16
    steps, and an input within that of its threshold lands on different sides in a later layer (measured: up to
    0.85 of 20 on one machine; on another, one step of 15 by 3.7 of 29, which changed its pick). For the same
    reason free-running greedy texts of the two paths can part: on this prompt after 7 tokens, on a 0.25 margin;
    even XLA eager and jitted part there. A wrong rule in either path differs at nearly every step."""
    from pjinfer.load import loader

    config, weights, tokenizer = loader.load(None)
    thresholds = np.tile(np.float32([0.05, 0.05, 0.05, 0.03]), (config.n_layers, 1))
    host = Engine(config, weights, tokenizer, weights_format="q4_1", thresholds=thresholds)
    xla = _xla_twin(host)
    prompt = tokenizer.encode("The capital of France is", add_special=False)
    tokens = host.generate(prompt, max_new_tokens=12, stop_ids=[])
    assert len(tokens) == 12
    step, reference = _jitted_step(host), _jitted_step(xla)
    feed = [*tokens[:-1], 11, 260, 314, 1000]
    _, cache = host.prefill(prompt, cache_len=host.plan(len(prompt), len(feed) + 1)[1])
    exact = same_pick = 0
    for i, t in enumerate(feed):
        got, _ = step(host.state, jnp.int32(t), jnp.int32(len(prompt) + i), cache)
        want, cache = reference(xla.state, jnp.int32(t), jnp.int32(len(prompt) + i), cache)
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_allclose(got, want, atol=0.25 * np.abs(want).max())
        close = np.allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        assert not close or np.argmax(got) == np.argmax(want)
        exact += close
        same_pick += np.argmax(got) == np.argmax(want)
    assert exact >= len(feed) // 2 and same_pick >= len(feed) - 1, (exact, same_pick)


def test_a_threshold_bundle_is_the_engine_path_that_runs(engine, tmp_path, capsys):
    """--weights auto with a bundle holding thresholds runs them on q4_1, and says so: Engine.bundle (what eval
    records), Engine.path and generate's --json `sparse` flag (both said "dense" for a threshold bundle before)."""
    import json

    from pjinfer.load.bundle import Bundle, model_record
    from tests.support.cli import run_cli

    path = tmp_path / "thresholds"
    bundle = Bundle.create(path, model=model_record(engine.config, engine.source))
    thresholds = np.tile(np.float32([0.05, 0.05, 0.05, 0.03]), (engine.config.n_layers, 1))
    bundle.save_stage("thresholds", {"thresholds": thresholds}, {"target": None})
    sparse = Engine.load(bundle=path)
    assert sparse.weights_format == "q4_1" and sparse.bundle.path == path
    np.testing.assert_array_equal(sparse.thresholds, thresholds)
    assert sparse.path == f"weights q4_1, sparse (input thresholds, {path})"
    code, out, err = run_cli(capsys, "generate", "--prompt", "Hi", "--max-new-tokens", "2", "--bundle", str(path),
                             "--json")
    assert code == 0, err
    assert json.loads(out)["sparse"] is True and json.loads(out)["weights"] == "q4_1"


def test_skipped_shares_measure_what_the_thresholds_leave_unread():
    """teal.skipped_shares (bench's bytes per token for a threshold engine) on the model as it runs, against the
    levels the thresholds were fitted at; SparseHostDecoder.input_bytes against the matrices' sizes."""
    config = tiny_config(**CONFIG)
    weights = random_weights(config, seed=4)
    levels = (0.3, 0.2, 0.4, 0.5)
    engine = Engine(config, weights, None, weights_format="q4_1",
                    thresholds=_quantile_thresholds(config, weights, levels, seed=0))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 64)).reshape(-1).tolist()  # the fit's
    shares = teal.skipped_shares(engine, tokens)
    assert shares.shape == (config.n_layers, 4)
    assert abs(shares[0, 0] - levels[0]) < 0.02    # layer 0's attention input is the normalized embedding fitted on
    assert np.all(np.abs(shares - levels) < 0.1)   # later inputs come from the sparse model: near their levels
    zero = Engine(config, weights, None, weights_format="q4_1", thresholds=np.zeros((config.n_layers, 4), np.float32))
    assert teal.skipped_shares(zero, tokens).max() < 1e-3   # only exact zeros sit at a threshold of 0
    c = config
    attn, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    nibbles = [(attn + 2 * kv) * c.d_model / 2, attn * c.d_model / 2, 2 * c.d_ff * c.d_model / 2, c.d_ff * c.d_model / 2]
    np.testing.assert_array_equal(engine.host.input_bytes(), np.tile(nibbles, (c.n_layers, 1)))
    with pytest.raises(ConfigError, match="no input thresholds"):
        teal.skipped_shares(Engine(config, weights, None), tokens)
