"""The hybrid sparse engine against the dense one: exact when every neuron is computed (or, for the
ReLU family, when the oracle picks exactly the non-zero ones), for any hot/cold split."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pjinfer.config import ConfigError
from pjinfer.engine import Engine
from pjinfer.model import KVCache, Transformer
from pjinfer.sparse import SparseFFN, sparsify
from cpu_offload.kernels import dequantize_rows, quantize_rows
from tests.conftest import random_weights, tiny_config
from train.predictor import Predictor

FAMILIES = [("llama", "swiglu"), ("llama", "geglu"), ("llama", "reglu"), ("llama", "drelu"), ("opt", "relu")]


def logits(model, ids):
    hidden, _ = model(jnp.asarray(ids)[None], 0, KVCache.create(model.config, 1, len(ids)))
    return np.asarray(model.logits(hidden[0]))


def placements(config, seed=0):
    rng = np.random.default_rng(seed)
    shape = (config.n_layers, config.d_ff)
    mixed = rng.random(shape) < 0.4
    mixed[0, :] = True  # one layer all hot, one all cold inside the mixed case too
    mixed[-1, :] = False
    return {"all hot": np.ones(shape, bool), "all cold": np.zeros(shape, bool), "mixed": mixed}


@pytest.mark.parametrize("arch,activation", FAMILIES)
@pytest.mark.parametrize("split", ["all hot", "all cold", "mixed"])
def test_every_neuron_active_equals_dense(arch, activation, split):
    config = tiny_config(arch, activation)
    weights = random_weights(config, seed=5)
    ids = np.random.default_rng(6).integers(0, config.vocab_size, 9)
    dense = logits(Transformer(config, weights), ids)
    model = Transformer(config, weights)
    sparsify(model, placements(config)[split], predictors=None)
    assert all(isinstance(layer.ffn, SparseFFN) for layer in model.layers)
    np.testing.assert_allclose(logits(model, ids), dense, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("arch,activation", FAMILIES)
def test_many_tokens_at_once_equal_one_at_a_time(arch, activation):
    # Decode gathers one token's active rows; prefill and scoring read each row once for the batch (masked hot
    # product, masked cold kernel). With predictors that skip about half the neurons, both give what the dense
    # FFN gives with the skipped neurons left out.
    config = tiny_config(arch, activation)
    weights = random_weights(config, seed=13)
    dense = Transformer(config, weights)
    model = Transformer(config, weights)
    predictors = [Predictor(config.d_model, config.d_ff, 8, rngs=nnx.Rngs(l)) for l in range(config.n_layers)]
    sparsify(model, placements(config, seed=2)["mixed"], predictors)
    x = jnp.asarray(np.random.default_rng(14).standard_normal((11, config.d_model)), jnp.float32)
    for layer, dense_layer in zip(model.layers, dense.layers):
        active = np.asarray(layer.ffn.active(x))
        assert 0.2 < active.mean() < 0.8
        ffn = dense_layer.ffn
        want = (np.asarray(ffn.neurons(x)) * active) @ np.asarray(ffn.w_down_t[...])
        want = want if ffn.b_down is None else want + np.asarray(ffn.b_down[...])
        at_once = np.asarray(layer.ffn(x))
        one_by_one = np.concatenate([np.asarray(layer.ffn(x[i:i + 1])) for i in range(x.shape[0])])
        np.testing.assert_allclose(at_once, want, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(one_by_one, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("arch,activation", [("llama", "swiglu"), ("opt", "relu")])
def test_int8_cold_rows_equal_dense_on_the_dequantized_weights(arch, activation):
    # Quantizing the cold rows is the only approximation: against a dense model whose FFN rows went
    # through the same quantize-dequantize round trip, the sparse logits agree to float tolerance.
    config = tiny_config(arch, activation)
    weights = random_weights(config, seed=15)
    rounded = dict(weights)
    for name, w in weights.items():
        if name.rsplit(".", 1)[-1] in ("w_gate", "w_up", "w_down_t"):
            rounded[name] = dequantize_rows(*quantize_rows(np.asarray(w)))
    ids = np.random.default_rng(16).integers(0, config.vocab_size, 9)
    model = Transformer(config, weights)
    sparsify(model, placements(config)["all cold"], predictors=None, cold_weights="int8")
    np.testing.assert_allclose(logits(model, ids), logits(Transformer(config, rounded), ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch,activation", [("llama", "reglu"), ("llama", "drelu"), ("opt", "relu")])
def test_relu_family_oracle_is_exact(arch, activation):
    # Only the neurons whose activation is non-zero are computed, yet the logits equal dense.
    config = tiny_config(arch, activation)
    weights = random_weights(config, seed=7)
    ids = np.random.default_rng(8).integers(0, config.vocab_size, 9)
    dense = logits(Transformer(config, weights), ids)
    model = Transformer(config, weights)
    sparsify(model, placements(config, seed=1)["mixed"], predictors=None, oracle=True)
    active = np.asarray(model.layers[0].ffn.active(jnp.ones((3, config.d_model))))
    assert 0 < active.mean() < 1  # the oracle does skip neurons
    np.testing.assert_allclose(logits(model, ids), dense, rtol=2e-5, atol=2e-5)


def test_pallas_interpret_backend_matches_xla():
    config = tiny_config("llama", "swiglu")
    weights = random_weights(config, seed=9)
    ids = np.random.default_rng(10).integers(0, config.vocab_size, 5)
    out = {}
    for backend in ("xla", "pallas-interpret"):
        model = Transformer(config, weights)
        sparsify(model, placements(config)["mixed"], predictors=None, hot_backend=backend)
        out[backend] = logits(model, ids)
    np.testing.assert_allclose(out["pallas-interpret"], out["xla"], rtol=2e-5, atol=2e-5)


def test_sparse_generate_equals_dense_generate_when_all_active():
    # The whole jitted generate (prefill + while_loop) through the FFI cold path.
    config = tiny_config()
    weights = random_weights(config, seed=11)
    dense = Engine(config, weights, tokenizer=None)
    sparse = Engine(config, weights, tokenizer=None)
    model = nnx.merge(sparse.graphdef, sparse.state)
    sparsify(model, placements(config)["mixed"], predictors=None)
    sparse.graphdef, sparse.state = nnx.split(model)
    prompt = [4, 8, 15, 16, 23, 42]
    assert sparse.generate(prompt, max_new_tokens=12, stop_ids=[]) == dense.generate(prompt, max_new_tokens=12,
                                                                                       stop_ids=[])
    assert list(sparse.stream(prompt, max_new_tokens=6, stop_ids=[])) == dense.generate(prompt, max_new_tokens=6,
                                                                                        stop_ids=[])


def test_real_model_all_active_equals_dense(engine):
    # SmolLM2 with a third of each layer's neurons hot and the rest computed by Numba through the FFI.
    ids = engine.tokenizer.encode("The hybrid engine must agree with the dense one.")
    model = nnx.merge(engine.graphdef, engine.state)
    dense = logits(model, ids)
    hot = np.zeros((engine.config.n_layers, engine.config.d_ff), bool)
    hot[:, ::3] = True
    sparsify(model, hot, predictors=None)
    np.testing.assert_allclose(logits(model, ids), dense, rtol=1e-4, atol=1e-4)


def test_bad_placement_and_backend():
    config = tiny_config()
    with pytest.raises(ConfigError, match="placement shape"):
        sparsify(Transformer(config, random_weights(config)), np.ones((1, 3), bool), None)
    with pytest.raises(ConfigError, match="unknown hot backend"):
        sparsify(Transformer(config, random_weights(config)), placements(config)["mixed"], None, hot_backend="tpu")


def test_bad_bundles_are_clear_errors(engine, tmp_path):
    import subprocess
    import sys

    from pjinfer import offline
    from pjinfer.bundle import Bundle

    def generate(bundle):
        return subprocess.run([sys.executable, "-m", "pjinfer.cli", "generate", "--prompt", "Hi", "--bundle",
                               str(bundle), "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)

    other = Bundle.create(tmp_path / "other", model={"identity": "0123456789abcdef", "name": "another model"})
    other.save_stage("profile", {"freq": np.zeros((2, 2), np.float32)}, {})
    corrupt = Bundle.create(tmp_path / "corrupt", model=offline.model_record(engine))
    corrupt.save_stage("predictors", {"0": {"x": np.zeros(2, np.float32)}}, {"ranks": [16] * engine.config.n_layers})
    corrupt.save_stage("placement", {"hot": np.zeros((2, 2), bool)}, {})
    for f in (corrupt.path / "predictors").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00 not an orbax file")
    for bundle, fragment in ((tmp_path / "none", "not a pjinfer bundle"),
                             (other.path, "made for another model"),
                             (corrupt.path, "cannot read predictors")):
        r = generate(bundle)
        assert r.returncode == 2, r.stderr
        lines = [l for l in r.stderr.splitlines() if l.startswith("pjinfer:")]
        assert len(lines) == 1 and fragment in lines[0], r.stderr
        assert "Traceback" not in r.stderr and r.stdout == ""
