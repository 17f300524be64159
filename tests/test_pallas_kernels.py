"""Pallas kernels in interpret mode (no GPU here): hot_ffn against plain jnp references.

Every kernel run goes through `run_poisoned`, which hands the kernels NaN-filled output buffers
(aliased in place), so an element a kernel forgets to write comes back as NaN and fails the test.
"""
from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import hot_ffn, hot_ffn_reference
from pallas_kernels.hot_ffn import _prepare, default_n_split, hot_ffn_triton
from pjinfer.activations import GATED, activate

RTOL = 1e-5


@functools.partial(jax.jit, static_argnames=("activation", "block_k", "block_d", "n_split"))
def run_poisoned(x, w_gate, w_up, w_down_t, ids, count, *, activation, b_up=None, block_k=32,
                 block_d=None, n_split=None):
    """hot_ffn's path, with NaN-poisoned kernel outputs; returns (y, act, partials)."""
    ids_p, count_1, bk, bd = _prepare(x, w_gate, w_up, w_down_t, ids, count, activation, b_up,
                                      block_k, block_d)
    n_kb = ids_p.shape[0] // bk
    if n_split is None:
        n_split = default_n_split(pl.cdiv(x.shape[0], bd), n_kb)
    n_split = min(n_split, n_kb)
    return hot_ffn_triton(x, w_gate, w_up, w_down_t, ids_p, count_1,
                          b_up if activation == "relu" else None, activation=activation,
                          block_k=bk, block_d=bd, n_split=n_split, interpret=True, poison=True,
                          return_parts=True)


def make_layer(seed, d, H, activation):
    rng = np.random.default_rng(seed)
    w = lambda: jnp.asarray(rng.standard_normal((H, d)) / np.sqrt(d), jnp.float32)
    x = jnp.asarray(rng.standard_normal(d), jnp.float32)
    w_gate = w() if activation in GATED else None
    w_up, w_down_t = w(), w()
    b_up = jnp.asarray(0.5 * rng.standard_normal(H), jnp.float32) if activation == "relu" else None
    return rng, x, w_gate, w_up, w_down_t, b_up


def random_ids(rng, H, count, K=None, pad=0):
    """count distinct neurons in random order, then K - count padding slots filled with `pad`
    ("random" draws garbage from [-10**6, 10**6])."""
    K = H if K is None else K
    active = rng.permutation(H)[:count]
    if pad == "random":
        tail = rng.integers(-10**6, 10**6, K - count)
    else:
        tail = np.full(K - count, pad)
    return jnp.asarray(np.concatenate([active, tail]).astype(np.int32))


def assert_close(y, ref):
    y, ref = np.asarray(y), np.asarray(ref)
    assert np.isfinite(y).all(), "NaN/inf in the kernel output"
    scale = max(float(np.abs(ref).max()), 1e-30)
    np.testing.assert_allclose(y, ref, rtol=RTOL, atol=RTOL * scale)


def check(x, w_gate, w_up, w_down_t, ids, count, activation, b_up, **blocks):
    y, act, parts = run_poisoned(x, w_gate, w_up, w_down_t, ids, count, activation=activation,
                                 b_up=b_up, **blocks)
    ref = hot_ffn_reference(x, w_gate, w_up, w_down_t, ids, count, activation=activation, b_up=b_up)
    assert not np.isnan(np.asarray(act)).any(), "act buffer not fully written"
    assert not np.isnan(np.asarray(parts)).any(), "partial-sum buffer not fully written"
    assert (np.asarray(act)[int(count):] == 0).all(), "slots past count must contribute nothing"
    assert_close(y, ref)
    return np.asarray(y), np.asarray(ref)


CASES = [  # activation, d, H, count
    ("swiglu", 576, 1536, 768),
    ("geglu", 100, 100, 37),
    ("reglu", 33, 7, 4),
    ("drelu", 576, 100, 63),
    ("relu", 100, 1536, 300),
    ("swiglu", 33, 1, 1),
    ("relu", 33, 7, 6),
]


@pytest.mark.parametrize("activation,d,H,count", CASES)
def test_random_subset_matches_reference(activation, d, H, count):
    # A seed fixed per case: Python's hash() of strings changes from process to process.
    rng, x, w_gate, w_up, w_down_t, b_up = make_layer(zlib.crc32(f"{activation}-{d}-{H}".encode()), d, H,
                                                      activation)
    ids = random_ids(rng, H, count, pad="random")
    y, ref = check(x, w_gate, w_up, w_down_t, ids, count, activation, b_up)
    assert np.abs(ref).max() > 0, "degenerate case: reference is all zero"
    # The public entry point (no poisoning, default blocks) gives the same numbers.
    y2 = hot_ffn(x, w_gate, w_up, w_down_t, ids, count, activation=activation, b_up=b_up,
                 interpret=True)
    assert_close(y2, ref)


@pytest.mark.parametrize("activation,d,H,count", CASES)
def test_empty_active_set_is_exactly_zero(activation, d, H, count):
    rng, x, w_gate, w_up, w_down_t, b_up = make_layer(1, d, H, activation)
    ids = random_ids(rng, H, 0, pad=-5)
    y, _ = check(x, w_gate, w_up, w_down_t, ids, 0, activation, b_up)
    assert (y == 0).all()


@pytest.mark.parametrize("activation,d,H,count", CASES)
def test_full_active_set_equals_dense_ffn(activation, d, H, count):
    rng, x, w_gate, w_up, w_down_t, b_up = make_layer(2, d, H, activation)
    ids = random_ids(rng, H, H)                      # every neuron, in random order
    y, _ = check(x, w_gate, w_up, w_down_t, ids, H, activation, b_up)
    hp = jax.lax.Precision.HIGHEST
    up = jnp.dot(w_up, x, precision=hp) + (b_up if b_up is not None else 0.0)
    gate = jnp.dot(w_gate, x, precision=hp) if w_gate is not None else None
    dense = jnp.dot(activate(activation, gate, up), w_down_t, precision=hp)
    assert_close(y, dense)


def test_padding_ids_never_matter():
    activation, d, H, count = "swiglu", 100, 100, 37   # shapes shared with CASES: no new compile
    rng, x, w_gate, w_up, w_down_t, b_up = make_layer(3, d, H, activation)
    base = random_ids(rng, H, count, pad=0)
    ys = []
    for pad in (0, -1, -5, H, H + 1000, 2**31 - 1, -(2**31), "random"):
        ids = base.at[count:].set(random_ids(rng, H, 0, pad=pad)[: H - count])
        y, _ = check(x, w_gate, w_up, w_down_t, ids, count, activation, b_up)
        ys.append(y)
    for y in ys[1:]:
        np.testing.assert_array_equal(y, ys[0])      # bit-identical: padding is never read


def test_inactive_rows_are_never_used():
    """Rows outside ids[:count] (row 0 included: padding slots are clamped to it) hold NaN.
    Masking by multiplication (compute all, times 0) would let the NaN through."""
    for activation, d, H, count in (("reglu", 576, 100, 63), ("relu", 100, 1536, 300)):
        rng, x, w_gate, w_up, w_down_t, b_up = make_layer(4, d, H, activation)
        active = 1 + rng.permutation(H - 1)[:count]     # row 0 stays inactive
        ids = jnp.asarray(np.concatenate([active, np.full(H - count, -5)]).astype(np.int32))
        ref = hot_ffn_reference(x, w_gate, w_up, w_down_t, ids, count, activation=activation,
                                b_up=b_up)
        inactive = np.ones(H, bool)
        inactive[np.asarray(ids[:count])] = False
        assert inactive[0]
        poison = lambda w: None if w is None else jnp.where(inactive[:, None], jnp.nan, w)
        b_bad = None if b_up is None else jnp.where(inactive, jnp.nan, b_up)
        y, act, parts = run_poisoned(x, poison(w_gate), poison(w_up), poison(w_down_t), ids, count,
                                     activation=activation, b_up=b_bad)
        assert_close(y, ref)


@pytest.mark.parametrize("block_k,block_d,n_split", [(8, 16, 1), (64, 128, 3), (1, 32, 2)])
def test_block_sizes_and_splits_agree(block_k, block_d, n_split):
    activation, d, H, count = "geglu", 100, 100, 37
    rng, x, w_gate, w_up, w_down_t, b_up = make_layer(5, d, H, activation)
    ids = random_ids(rng, H, count, pad=H + 1000)
    check(x, w_gate, w_up, w_down_t, ids, count, activation, b_up, block_k=block_k,
          block_d=block_d, n_split=n_split)


def test_traced_count_inside_jit_and_k_larger_than_h():
    activation, d, H = "swiglu", 33, 7
    rng, x, w_gate, w_up, w_down_t, b_up = make_layer(6, d, H, activation)
    K = 12                                            # K need not equal H (nor a power of two)

    @jax.jit
    def f(ids, count):
        return hot_ffn(x, w_gate, w_up, w_down_t, ids, count, activation=activation,
                       block_k=4, interpret=True)

    for count in (0, 1, 5, 7):
        ids = random_ids(rng, H, count, K=K, pad="random")
        ref = hot_ffn_reference(x, w_gate, w_up, w_down_t, ids, count, activation=activation)
        y = f(ids, jnp.int32(count))
        assert_close(y, ref)
        if count == 0:
            assert (np.asarray(y) == 0).all()
    assert f._cache_size() == 1


def test_rejects_bad_arguments():
    rng, x, w_gate, w_up, w_down_t, _ = make_layer(7, 33, 7, "swiglu")
    ids = jnp.arange(7, dtype=jnp.int32)
    with pytest.raises(ValueError, match="power of two"):
        hot_ffn(x, w_gate, w_up, w_down_t, ids, 3, activation="swiglu", block_k=24, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        hot_ffn(x, w_gate, w_up, w_down_t, ids, 3, activation="swiglu", block_d=48, interpret=True)
    with pytest.raises(ValueError, match="activation"):
        hot_ffn(x, w_gate, w_up, w_down_t, ids, 3, activation="gelu", interpret=True)
    with pytest.raises(TypeError, match="float32"):
        hot_ffn(x.astype(jnp.bfloat16), w_gate, w_up, w_down_t, ids, 3, activation="swiglu",
                interpret=True)


def test_interpret_mode_poisons_unwritten_outputs():
    """The premise the tests lean on: an output element no kernel writes reads back as NaN."""
    def kernel(o_ref):
        o_ref[pl.ds(0, 4)] = jnp.zeros((4,), jnp.float32)

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                         interpret=True)()
    assert (np.asarray(out[:4]) == 0).all() and np.isnan(np.asarray(out[4:])).all()


@pytest.mark.parametrize("activation,d,H,block_k,block_d", [
    ("swiglu", 576, 1536, 32, None), ("geglu", 33, 7, 32, None), ("relu", 100, 1, 1, 16),
    ("drelu", 576, 100, 64, 128)])
def test_lowers_to_triton_for_gpu(activation, d, H, block_k, block_d):
    """No GPU here, but jax can still lower the kernels to Triton IR for the CUDA platform; that
    runs the Triton lowering's own checks (power-of-two load/store shapes, supported ops, loops)."""
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    text = hot_ffn.trace(f32(d), f32(H, d) if activation != "relu" else None, f32(H, d), f32(H, d),
                         i32(H), i32(), activation=activation,
                         b_up=f32(H) if activation == "relu" else None, block_k=block_k,
                         block_d=block_d).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 2                 # the act and the down kernel


def test_triton_lowering_rejects_non_power_of_two_blocks():
    """Guards the test above: the same lowering path does reject an illegal block."""
    def kernel(x_ref, o_ref):
        o_ref[pl.ds(0, 3)] = x_ref[pl.ds(0, 3)]

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32),
                          compiler_params=plt.CompilerParams())   # Triton, as hot_ffn selects
    with pytest.raises(Exception, match="power of 2"):
        jax.jit(call).trace(jax.ShapeDtypeStruct((4,), jnp.float32)).lower(
            lowering_platforms=("cuda",))
