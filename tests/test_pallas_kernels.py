"""Pallas kernels, compiled where JAX has a GPU and in interpret mode elsewhere (tests.conftest.INTERPRET): hot_ffn
against plain jnp references, gather_matvec against float64 numpy.

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

from cpu_offload.activation import GATED, activate
from pallas_kernels import gather as gm
from pallas_kernels import hot_ffn, hot_ffn_reference
from pallas_kernels.gather import split_for
from pallas_kernels.hot_ffn import _prepare, hot_ffn_triton
from tests.conftest import INTERPRET

pytestmark = pytest.mark.gpu   # compiled where JAX has a GPU, interpret mode elsewhere

RTOL = 1e-5


@functools.partial(jax.jit, static_argnames=("activation", "block_k", "block_d", "n_split"))
def run_poisoned(x, w_gate, w_up, w_down_t, ids, count, *, activation, b_up=None, block_k=32,
                 block_d=None, n_split=None):
    """hot_ffn's path, with NaN-poisoned kernel outputs; returns (y, act, partials)."""
    ids_p, count_1, bk, bd = _prepare(x, w_gate, w_up, w_down_t, ids, count, activation, b_up,
                                      block_k, block_d)
    n_split = split_for(x.shape[0], ids_p.shape[0], bk, bd, n_split)
    return hot_ffn_triton(x, w_gate, w_up, w_down_t, ids_p, count_1,
                          b_up if activation == "relu" else None, activation=activation,
                          block_k=bk, block_d=bd, n_split=n_split, interpret=INTERPRET, poison=True,
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
                 interpret=INTERPRET)
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
                       block_k=4, interpret=INTERPRET)

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
        hot_ffn(x, w_gate, w_up, w_down_t, ids, 3, activation="swiglu", block_k=24, interpret=INTERPRET)
    with pytest.raises(ValueError, match="power of two"):
        hot_ffn(x, w_gate, w_up, w_down_t, ids, 3, activation="swiglu", block_d=48, interpret=INTERPRET)
    with pytest.raises(ValueError, match="activation"):
        hot_ffn(x, w_gate, w_up, w_down_t, ids, 3, activation="gelu", interpret=INTERPRET)
    with pytest.raises(TypeError, match="float32"):
        hot_ffn(x.astype(jnp.bfloat16), w_gate, w_up, w_down_t, ids, 3, activation="swiglu",
                interpret=INTERPRET)


def test_poisoned_outputs_show_unwritten_elements():
    """The premise the tests lean on: with a NaN buffer aliased to the output (as run_poisoned hands the kernels
    theirs, through gather.drop_aliased_input), an element the kernel does not write reads back as NaN."""
    def kernel(o_ref):
        o_ref[pl.ds(0, 4)] = jnp.zeros((4,), jnp.float32)

    params = None if INTERPRET else plt.CompilerParams(num_warps=4, num_stages=2)
    out = pl.pallas_call(gm.drop_aliased_input(kernel), out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                         input_output_aliases={0: 0}, interpret=INTERPRET, compiler_params=params)(
        jnp.full((8,), jnp.nan, jnp.float32))
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


# ---------------------------------------------------------------------------------------------------- gather_matvec
# y = sum_{k < count} x[ids[k]] * w_t[ids[k]], the input-sparse product, on fresh random inputs each run (the seed
# is in every failure message) against float64 numpy.

@functools.partial(jax.jit, static_argnames=("block_k", "block_d", "n_split"))
def run_matvec_poisoned(x, w_t, ids, count, *, block_k=32, block_d=None, n_split=None):
    """gather_matvec's path with a NaN-poisoned kernel output; returns (y, partials)."""
    ids_p, count_1, bk, bd = gm.prepare(x, w_t, ids, count, block_k, block_d)
    ns = split_for(w_t.shape[1], ids_p.shape[0], bk, bd, n_split)
    return gm.gather_matvec_triton(x, w_t, ids_p, count_1, block_k=bk, block_d=bd, n_split=ns,
                                   interpret=INTERPRET, poison=True, return_parts=True)


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**63)
    return np.random.default_rng(seed), seed


def matvec_inputs(rng, n_in, n_out):
    x = rng.standard_normal(n_in).astype(np.float32)
    w_t = (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
    return x, w_t


def check_matvec(x, w_t, ids, count, seed, **blocks):
    """The poisoned kernel against float64: every partial written, the sum within float32's rounding bound
    ((terms + partials) units of 2**-23 of sum |x_i w_i|: the kernel sums in another order than numpy)."""
    y, parts = run_matvec_poisoned(jnp.asarray(x), jnp.asarray(w_t), jnp.asarray(ids, jnp.int32), count, **blocks)
    y, parts = np.asarray(y), np.asarray(parts)
    assert not np.isnan(parts).any(), f"partial-sum buffer not fully written (seed {seed})"
    rows = np.asarray(ids)[:count]
    terms = np.asarray(x, np.float64)[rows, None] * np.asarray(w_t, np.float64)[rows]
    want = terms.sum(axis=0)
    bound = (count + parts.shape[0] + 2) * 2.0 ** -23 * np.abs(terms).sum(axis=0) + 1e-30
    assert np.isfinite(y).all(), f"NaN/inf in the kernel output (seed {seed})"
    assert (np.abs(y - want) <= bound).all(), (f"seed {seed}: off by {np.abs(y - want).max()} "
                                               f"(bound {bound[np.argmax(np.abs(y - want))]})")
    return y


MATVEC_SHAPES = [(7, 33), (33, 7), (130, 130), (576, 1536), (1536, 576), (576, 960), (1, 1), (100, 1)]


@pytest.mark.parametrize("n_in,n_out", MATVEC_SHAPES)
def test_gather_matvec_matches_float64(n_in, n_out):
    rng, seed = fresh_rng()
    x, w_t = matvec_inputs(rng, n_in, n_out)
    count = int(rng.integers(1, n_in + 1))
    garbage = rng.integers(-10**6, 10**6, n_in - count)
    ids = np.concatenate([rng.permutation(n_in)[:count], garbage]).astype(np.int32)
    y = check_matvec(x, w_t, ids, count, seed)
    public = np.asarray(gm.gather_matvec(jnp.asarray(x), jnp.asarray(w_t), jnp.asarray(ids), count,
                                         interpret=INTERPRET))
    np.testing.assert_array_equal(public, y)        # the public entry point: the same kernel, the same numbers
    # Every input active (in random order): W @ x, dense.
    full = rng.permutation(n_in).astype(np.int32)
    y = check_matvec(x, w_t, full, n_in, seed)
    dense = np.asarray(w_t, np.float64).T @ np.asarray(x, np.float64)
    np.testing.assert_allclose(y, dense, rtol=0, atol=(n_in + 34) * 2.0 ** -23 * (np.abs(w_t).T @ np.abs(x)).max())
    # None active, padding slots of any value: exact zeros.
    assert (check_matvec(x, w_t, garbage.astype(np.int32).repeat(2)[:n_in], 0, seed) == 0).all()


def test_gather_matvec_padding_never_matters_and_k_may_exceed_n_in():
    rng, seed = fresh_rng()
    n_in, n_out, count = 130, 130, 45                 # shapes shared with MATVEC_SHAPES: no new compile
    x, w_t = matvec_inputs(rng, n_in, n_out)
    active = rng.permutation(n_in)[:count]
    ys = []
    for pad in (0, -1, n_in, 2**31 - 1, -(2**31), "random"):
        tail = rng.integers(-10**6, 10**6, n_in - count) if pad == "random" else np.full(n_in - count, pad)
        ys.append(check_matvec(x, w_t, np.concatenate([active, tail]).astype(np.int32), count, seed))
    for y in ys[1:]:
        np.testing.assert_array_equal(y, ys[0])      # bit-identical: padding is never read
    long_ids = np.concatenate([active, rng.integers(-10**6, 10**6, 77)]).astype(np.int32)   # K = 122 != n_in
    check_matvec(x, w_t, long_ids, count, seed)


def test_gather_matvec_reads_only_the_active_rows():
    """Rows of w_t outside ids[:count] (row 0 included: padding is clamped to it) and the inactive entries of x
    hold NaN; masking by multiplication (compute all, times 0) would let them through."""
    rng, seed = fresh_rng()
    n_in, n_out = 576, 960
    x, w_t = matvec_inputs(rng, n_in, n_out)
    count = 200
    ids = np.concatenate([1 + rng.permutation(n_in - 1)[:count], np.full(n_in - count, -5)]).astype(np.int32)
    inactive = np.ones(n_in, bool)
    inactive[ids[:count]] = False
    want = check_matvec(x, w_t, ids, count, seed)
    y = check_matvec(np.where(inactive, np.nan, x).astype(np.float32),
                     np.where(inactive[:, None], np.nan, w_t).astype(np.float32), ids, count, seed)
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("block_k,block_d,n_split", [(8, 16, 1), (64, 128, 3), (1, 32, 2)])
def test_gather_matvec_block_sizes_and_splits_agree(block_k, block_d, n_split):
    rng, seed = fresh_rng()
    x, w_t = matvec_inputs(rng, 130, 130)
    ids = np.concatenate([rng.permutation(130)[:61], np.full(69, 10**6)]).astype(np.int32)
    check_matvec(x, w_t, ids, 61, seed, block_k=block_k, block_d=block_d, n_split=n_split)


def test_gather_matvec_traced_count_one_compile():
    rng, seed = fresh_rng()
    x, w_t = (jnp.asarray(a) for a in matvec_inputs(rng, 33, 7))

    @jax.jit
    def f(ids, count):
        return gm.gather_matvec(x, w_t, ids, count, block_k=4, interpret=INTERPRET)

    for count in (0, 1, 5, 33):
        ids = jnp.asarray(np.concatenate([rng.permutation(33)[:count], rng.integers(-99, 99, 33 - count)]), jnp.int32)
        y = f(ids, jnp.int32(count))
        np.testing.assert_allclose(y, gm.gather_matvec_reference(x, w_t, ids, count), rtol=1e-5, atol=1e-6,
                                   err_msg=f"seed {seed}")
    assert f._cache_size() == 1


def test_compact_and_active_inputs():
    rng, seed = fresh_rng()
    mask = rng.random((3, 5, 41)) < 0.3
    ids, count = gm.compact(jnp.asarray(mask))
    assert ids.shape == mask.shape and count.shape == (3, 5) and ids.dtype == count.dtype == jnp.int32
    for i in np.ndindex(3, 5):
        on = np.flatnonzero(mask[i])
        assert int(count[i]) == len(on), seed
        np.testing.assert_array_equal(np.asarray(ids[i][:len(on)]), on)     # increasing order
        assert (np.asarray(ids[i][len(on):]) == 0).all()
    x = jnp.asarray(rng.standard_normal(41), jnp.float32)
    t = jnp.float32(np.quantile(np.abs(np.asarray(x)), 0.5))
    ids, count = gm.active_inputs(x, t)
    np.testing.assert_array_equal(np.asarray(ids[:int(count)]), np.flatnonzero(np.abs(np.asarray(x)) > float(t)))
    ids, count = gm.active_inputs(x)                  # no threshold: every entry
    assert int(count) == 41 and (np.asarray(ids) == np.arange(41)).all()
    ids, count = gm.active_inputs(x, jnp.float32(np.abs(np.asarray(x)).max()))   # |x| <= t counts as zero
    assert int(count) == 0


def test_gather_matvec_rejects_bad_arguments():
    x, w_t = jnp.ones(33, jnp.float32), jnp.ones((33, 7), jnp.float32)
    ids = jnp.arange(33, dtype=jnp.int32)
    with pytest.raises(ValueError, match="power of two"):
        gm.gather_matvec(x, w_t, ids, 3, block_k=24, interpret=INTERPRET)
    with pytest.raises(ValueError, match="power of two"):
        gm.gather_matvec(x, w_t, ids, 3, block_d=48, interpret=INTERPRET)
    with pytest.raises(ValueError, match="n_in = 33"):
        gm.gather_matvec(x, w_t.T, ids, 3, interpret=INTERPRET)
    with pytest.raises(ValueError, match="one decode token"):
        gm.gather_matvec(jnp.ones((1, 33), jnp.float32), w_t, ids, 3, interpret=INTERPRET)
    with pytest.raises(TypeError, match="float32"):
        gm.gather_matvec(x.astype(jnp.bfloat16), w_t, ids, 3, interpret=INTERPRET)


@pytest.mark.parametrize("n_in,n_out,block_k", [(576, 960, 32), (1536, 576, 32), (7, 33, 1)])
def test_gather_matvec_lowers_to_triton_for_gpu(n_in, n_out, block_k):
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    text = gm.gather_matvec.trace(f32(n_in), f32(n_in, n_out), jax.ShapeDtypeStruct((n_in,), jnp.int32),
                                  jax.ShapeDtypeStruct((), jnp.int32), block_k=block_k).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1


@pytest.mark.slow
def test_bench_command_checks_and_times_every_case(capsys):
    """`make bench-pallas`'s command at SmolLM2's shapes in interpret mode: each case is checked against float64
    before it is timed (a disagreement ends the command) and gives one row; without a GPU the compiled kernels
    are refused in one line."""
    from pallas_kernels import bench

    if INTERPRET:
        with pytest.raises(SystemExit, match="compiled kernels need a GPU and JAX here runs on cpu"):
            bench.main(["--shapes", "smollm2"])
    bench.main(["--shapes", "smollm2", "--pairs", "1", "--calls", "1", "--interpret"])
    rows = [r[:3] if r[0] == "q4" else r[:2]
            for r in (line.split() for line in capsys.readouterr().out.splitlines() if "x (" in line)]
    want = [[name, f"{share:.0%}"] for name in ("qkv", "o", "gate+up", "down") for share in bench.MATVEC_SHARES]
    want += [["ffn", f"{share:.0%}"] for share in bench.FFN_SHARES]
    assert rows == want + [["q4", "ffn", f"{share:.0%}"] for share in bench.FFN_SHARES] + [["q4", "gemv", "100%"]]
