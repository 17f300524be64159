"""A bundle's input thresholds on the Pallas gather kernels (pjinfer.runtime.gathered; compiled on a GPU, interpret
mode elsewhere: tests.conftest.PALLAS) against the XLA threshold path (dense products of the masked inputs) on the
same float32 weights, and which of a bundle's rules runs (pjinfer.runtime.backends.bundle_rule) with which weights, from the Python API and the CLI."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import ClosedJaxpr, Jaxpr

from pjinfer.config import ConfigError
from pjinfer.load.bundle import Bundle, model_record
from pjinfer.offline import teal
from pjinfer.runtime import gathered
from pjinfer.runtime.backends import Request, bundle_rule, check_bundle_stages, resolve
from pjinfer.runtime.engine import Engine
from pjinfer.runtime.model import KVCache, Transformer, set_thresholds
from pjinfer.runtime.sparse import sparsify
from tests.conftest import PALLAS, random_weights, tiny_config
from tests.support.cli import assert_clean_error, run_cli
from tests.test_sparse import decode_steps, logits, placements

pytestmark = pytest.mark.gpu   # compiled where JAX has a GPU, interpret mode elsewhere

PROMPT = [5, 17, 42, 8, 60]


def quantile_thresholds(config, weights, seed):
    """Thresholds [L, 4] at a random sparsity level per layer and input (0 to 0.6), fitted with teal's quantile
    pass on random tokens, so each input skips a real share of its entries."""
    rng = np.random.default_rng(seed)
    dense = Engine(config, weights, None)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 32)), jnp.int32)
    q = np.asarray(teal._quantiles(dense.graphdef, dense.state, tokens, jnp.asarray(teal.LEVELS, jnp.float32)))
    return teal._thresholds(q, rng.choice(teal.LEVELS[teal.LEVELS <= 0.6], (config.n_layers, 4)))


def model_of(engine):
    return nnx.merge(engine.graphdef, engine.state)


def kernel_calls(model) -> int:
    """How many Pallas kernels one decode step of `model` runs (each call counted, nested jaxprs walked)."""
    def count(jaxpr):
        n = 0
        for eqn in jaxpr.eqns:
            n += eqn.primitive.name == "pallas_call"
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    if isinstance(sub, (Jaxpr, ClosedJaxpr)):
                        n += count(getattr(sub, "jaxpr", sub))
        return n

    cache = KVCache.create(model.config, 1, 16)
    step = lambda s: nnx.merge(nnx.graphdef(model), s).decode(jnp.int32(1), jnp.int32(0), cache)  # noqa: E731
    return count(jax.make_jaxpr(step)(nnx.state(model)).jaxpr)


@pytest.mark.slow
@pytest.mark.parametrize("arch,activation", [("llama", "swiglu"), ("llama", "reglu"), ("opt", "relu")])
def test_decode_equals_the_xla_threshold_path(arch, activation):
    """Every matrix of a decode step gathered (the jaxpr holds the kernels, four per layer) gives XLA's masked
    logits; greedy generate (prefill in XLA, the while loop's steps gathered) picks the same tokens."""
    config = tiny_config(arch, activation)
    weights = random_weights(config, seed=21)
    thresholds = quantile_thresholds(config, weights, seed=22)
    xla = Engine(config, weights, None, thresholds=thresholds)
    pallas = Engine(config, weights, None, thresholds=thresholds, hot_backend=PALLAS)
    model = model_of(pallas)
    assert all(isinstance(b, gathered.GatheredBlock) for b in model.layers) and pallas.hot_backend == PALLAS
    assert kernel_calls(model) == 4 * config.n_layers and kernel_calls(model_of(xla)) == 0
    got, _ = decode_steps(model, PROMPT, reference=model_of(xla))
    want, _ = decode_steps(model_of(xla), PROMPT)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    dense, _ = decode_steps(Transformer(config, weights), PROMPT)
    assert np.abs(want - dense).max() > 1e-2          # the thresholds do skip inputs
    tokens = pallas.generate(PROMPT, max_new_tokens=8, stop_ids=[])
    assert len(tokens) == 8 and tokens == xla.generate(PROMPT, max_new_tokens=8, stop_ids=[])


def test_zero_thresholds_equal_dense_and_scoring_stays_dense_masked():
    """Thresholds of 0 skip nothing (SwiGLU is never exactly 0): decode equals the dense model. Scoring (many
    tokens) runs dense masked products over the input-major weights, no kernel, the XLA threshold path's sums."""
    config = tiny_config()
    weights = random_weights(config, seed=23)
    zeros = Engine(config, weights, None, thresholds=np.zeros((config.n_layers, 4)), hot_backend=PALLAS)
    got, _ = decode_steps(model_of(zeros), PROMPT)
    want, _ = decode_steps(Transformer(config, weights), PROMPT)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    thresholds = quantile_thresholds(config, weights, seed=24)
    pallas = Engine(config, weights, None, thresholds=thresholds, hot_backend=PALLAS)
    xla = Engine(config, weights, None, thresholds=thresholds)
    ids = np.random.default_rng(25).integers(0, config.vocab_size, 12)
    assert "pallas_call" not in str(jax.make_jaxpr(lambda s: nnx.merge(pallas.graphdef, s).forward_sequence(
        jnp.asarray(ids)[None]))(pallas.state))
    np.testing.assert_allclose(logits(model_of(pallas), ids), logits(model_of(xla), ids), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_every_input_below_its_threshold_adds_nothing():
    """Empty active sets everywhere (count 0 in every kernel): each layer adds exact zeros, so the logits are the
    head of the normed embedding."""
    config = tiny_config()
    engine = Engine(config, random_weights(config, seed=26), None, thresholds=np.full((config.n_layers, 4), 1e9),
                    hot_backend=PALLAS)
    model = model_of(engine)
    got, _ = model.decode(jnp.int32(7), jnp.int32(3), KVCache.create(config, 1, 16))
    want = model.head(model.final_norm(model.embed[...][7]))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_settings_that_cannot_run_are_refused():
    config = tiny_config()
    weights = random_weights(config)
    thresholds = np.zeros((config.n_layers, 4))
    with pytest.raises(ConfigError, match="runs a bundle's input thresholds or predictors, not dense float32"):
        Engine(config, weights, None, hot_backend="pallas-interpret")                  # no thresholds
    with pytest.raises(ConfigError, match="--weights q4_1 decodes them on the host"):
        Engine(config, weights, None, weights_format="q4_1", thresholds=thresholds, hot_backend="pallas-interpret")
    with pytest.raises(ConfigError, match="unknown hot backend"):
        Engine(config, weights, None, thresholds=thresholds, hot_backend="tpu")
    if jax.default_backend() != "gpu":   # compiled Pallas (Triton) needs a GPU: one line, not a failed compile
        for make in (lambda: Engine(config, weights, None, thresholds=thresholds, hot_backend="pallas"),
                     lambda: sparsify(Transformer(config, weights), placements(config)["mixed"], None,
                                      hot_backend="pallas")):
            with pytest.raises(ConfigError, match="compiles its kernels for a GPU and JAX here runs on cpu"):
                make()
    with pytest.raises(ValueError, match="takes one token"):
        gathered.gathered_product(jnp.ones((1, 2, 4)), jnp.ones((4, 3)), None, True)


def test_gathered_decode_step_lowers_for_the_gpu():
    """No GPU here, but the whole decode step with compiled kernels (what --hot-backend pallas runs) lowers for
    CUDA, which runs Triton's own checks on every kernel at the model's shapes: one kernel per distinct matrix
    shape (q/k/v, o, gate/up, down; jit shares a function between layers of the same shapes)."""
    config = tiny_config()
    model = Transformer(config, random_weights(config))
    set_thresholds(model, np.full((config.n_layers, 4), 0.1))
    model.layers = nnx.List([gathered.GatheredBlock(b, interpret=False) for b in model.layers])
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, t, p, c: nnx.merge(graphdef, s).decode(t, p, c))
    lowered = step.trace(state, jnp.int32(1), jnp.int32(0), KVCache.create(config, 1, 16)).lower(
        lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") == 4


def manifest_bundle(path, *stages):
    """A bundle's manifest alone, made for the default model, holding `stages` (their data absent)."""
    from pjinfer.load.loader import default_model_path, model_identity

    path.mkdir()
    model = {"identity": model_identity(default_model_path())}
    (path / "manifest.json").write_text(json.dumps({"format": 1, "stages": {s: {} for s in stages}, "model": model}))
    return path


def test_which_rule_a_bundle_runs_and_on_which_weights(tmp_path):
    """auto: thresholds when the bundle has them, else predictors; --weights auto is q4_1 (the host decode) for
    thresholds on hot backend xla, float32 for thresholds on a Pallas backend and for predictors."""
    both = manifest_bundle(tmp_path / "both", "thresholds", "predictors", "placement")
    thresholds = manifest_bundle(tmp_path / "thresholds", "thresholds")
    predictors = manifest_bundle(tmp_path / "predictors", "predictors", "placement")
    assert bundle_rule(both) == bundle_rule(thresholds) == "thresholds" and bundle_rule(predictors) == "predictors"
    assert bundle_rule(both, "predictors") == "predictors"
    with pytest.raises(ConfigError, match="sparse rule must be one of auto, thresholds, predictors"):
        bundle_rule(both, "oracle")
    def weights(bundle, **settings):
        return resolve(Request(None, bundle=bundle, **settings)).weights

    assert weights(both) == "q4_1"              # the default model's Q4_1 file
    assert weights(both, hot_backend="pallas-interpret") == "float32"
    assert weights(both, sparse_rule="predictors") == "float32"
    assert weights(predictors) == "float32"
    assert resolve(Request(None, "float32", both, hot_backend="pallas-interpret")).backend.name == "gathered"
    with pytest.raises(ConfigError, match="predictors run with --weights float32"):
        resolve(Request(None, "q4_1", both, sparse_rule="predictors"))
    with pytest.raises(ConfigError, match="--weights q4_1 decodes them on the host"):
        resolve(Request(None, "q4_1", both, hot_backend="pallas-interpret"))
    with pytest.raises(ConfigError, match="has no thresholds yet; run `pjinfer calibrate"):
        check_bundle_stages(predictors, "thresholds")
    with pytest.raises(ConfigError, match="has no predictors yet"):
        check_bundle_stages(thresholds, "predictors")


@pytest.mark.slow
def test_command_line_runs_thresholds_on_the_gather_kernels(tmp_path, capsys):
    """A float32 GGUF and a bundle with thresholds: generate on the Pallas backend says so and gives XLA's tokens;
    settings that cannot run get one line before the weights load."""
    from pjinfer.load import loader
    from tests.support.gguf_files import write_tiny_gguf

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, tiny_config(tie_embeddings=True), random_weights(tiny_config(tie_embeddings=True), seed=27))
    config, weights, _ = loader.load(path)
    bundle = Bundle.create(tmp_path / "b", model=model_record(config, path))
    bundle.save_stage("thresholds", {"thresholds": quantile_thresholds(config, weights, seed=28)}, {"target": None})
    out = {}
    for backend in ("xla", PALLAS):
        code, text, err = run_cli(capsys, "generate", "--model", str(path), "--prompt", "the the", "--bundle",
                                  str(bundle.path), "--hot-backend", backend, "--max-new-tokens", "6", "--json")
        assert code == 0, err
        out[backend] = json.loads(text)
        assert out[backend]["weights"] == "float32" and out[backend]["sparse"] is True
    assert out[PALLAS]["token_ids"] == out["xla"]["token_ids"]
    generate = ("generate", "--model", str(path), "--prompt", "x")
    for args, fragment in (
            (("--hot-backend", "pallas-interpret"), "--hot-backend pallas-interpret applies to a sparse bundle"),
            (("--sparse-rule", "predictors"), "--sparse-rule predictors applies to a sparse bundle"),
            (("--bundle", str(bundle.path), "--sparse-rule", "predictors"), "has no predictors yet"),
            (("--bundle", str(bundle.path), "--weights", "q4_1", "--hot-backend", "pallas-interpret"),
             "--weights q4_1 decodes them on the host"),
            (("--cold-weights", "int8"), "--cold-weights int8 applies to a sparse bundle"),
            (("--bundle", str(bundle.path), "--cold-weights", "int8"), "run without cold rows")):
        assert_clean_error(run_cli(capsys, *generate, *args), fragment)


def test_real_model_gathered_decode_equals_the_xla_threshold_path(engine, tmp_path):
    """The default model from a threshold bundle (`--weights float32 --bundle DIR --hot-backend pallas-interpret`)
    against the XLA threshold path, step by step on the cache the XLA steps wrote. The cache here holds float32:
    with the engine's float16 cache, a k or v the two paths compute a hair apart can round to neighbouring float16
    steps and move an input across its threshold in a later layer (measured on these eight steps: up to 0.81 of
    25.7 with a float16 cache, 3e-4 of 25.8 with float32; with teal.uniform thresholds at 30/30/30/50% on nine
    other steps, 4.9 of 18.5 on one step, its pick changed, against 9e-5 of 27.6). Thresholds: the magnitudes
    test_sparse_decode uses (about 20-40% of each input skipped). A flip can still happen on a machine that rounds
    otherwise: every step is bounded, and all but one must agree to float rounding."""
    bundle = Bundle.create(tmp_path / "b", model=model_record(engine.config, engine.source))
    thresholds = np.tile(np.float32([0.05, 0.05, 0.05, 0.03]), (engine.config.n_layers, 1))
    bundle.save_stage("thresholds", {"thresholds": thresholds}, {"target": None})
    pallas = Engine.load(weights="float32", bundle=bundle.path, hot_backend=PALLAS)
    assert pallas.path == f"weights float32, sparse (input thresholds gathered by {PALLAS}, {bundle.path})"
    model, reference = model_of(pallas), model_of(engine)
    set_thresholds(reference, thresholds)
    c = engine.config
    shape = (1, 16, c.n_kv_heads, c.head_dim)
    cache = KVCache(k=[jnp.zeros(shape, jnp.float32) for _ in range(c.n_layers)],
                    v=[jnp.zeros(shape, jnp.float32) for _ in range(c.n_layers)])
    step = lambda m: jax.jit(lambda s, t, p, cache, g=nnx.graphdef(m): nnx.merge(g, s).decode(t, p, cache))  # noqa: E731
    mine, theirs = step(model), step(reference)
    tokens = engine.tokenizer.encode("The capital of France is", add_special=False) + [11, 260, 314]
    exact = same_pick = 0
    for pos, token in enumerate(tokens):
        got, _ = mine(nnx.state(model), jnp.int32(token), jnp.int32(pos), cache)
        want, cache = theirs(nnx.state(reference), jnp.int32(token), jnp.int32(pos), cache)
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_allclose(got, want, atol=0.3 * np.abs(want).max())
        exact += np.allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        same_pick += np.argmax(got) == np.argmax(want)
    assert exact >= len(tokens) - 1 and same_pick >= len(tokens) - 1, (exact, same_pick)
