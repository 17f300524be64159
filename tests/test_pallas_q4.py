"""The 4-bit Pallas kernels (pallas_kernels.q4_rows), compiled where JAX has a GPU and in interpret mode elsewhere
(tests.conftest.INTERPRET), against float64 numpy on the values the planes stand for (q4_rows.dequantize).

Inputs are fresh random ones each run (the seed is in every failure message): real ggml blocks quantized from random
float32 matrices (Q4_1 by QTensor.quantize, Q4_0 by the gguf package's quantizer, which the block table lacks) and
planes of random bytes with random float16 scales and minimums. Every kernel run hands the kernels NaN-filled output
buffers (aliased in place), so an element a kernel forgets to write comes back as NaN and fails the test.

Tolerance, derived from float32 arithmetic (EPS = 2**-23): a weight s q + m is one rounding of an exact product and
sum, each term w x one more, and a sum of n terms in any order is within (n - 1) EPS / 2 of sum |terms|; so a dot of d
terms is within (d + 4) EPS sum |w x| (twice the worst case). Through a gated activation act = f(g) u with |f'| <=
1.2 and |f(g)| <= |g| (SiLU, GELU's tanh form, ReLU), errors eg, eu of g and u give |f(g') u' - f(g) u| <= 1.2 eg
(|u| + eu) + |g| eu, plus the activation's own float32 rounding (16 EPS |g| |u|); the down sum over count slots and
n_split partials adds (count + n_split + 4) EPS sum_k |act_k down_k|.
"""
from __future__ import annotations

import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_offload.activation import reference
from cpu_offload.blocks import Q4_0, Q4_1
from cpu_offload.qtensor import QTensor
from pallas_kernels import Q4Planes, dequantize, planes_from_blocks, q4_hot_ffn, q4_matvec
from pallas_kernels import q4_rows
from pallas_kernels.gather import split_for
from tests.conftest import INTERPRET

pytestmark = pytest.mark.gpu   # compiled where JAX has a GPU, interpret mode elsewhere

EPS = 2.0 ** -23
KINDS = ("q4_0", "q4_1", "bytes")


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**63)
    return np.random.default_rng(seed), seed


def q4_blocks(rng, H, d, code):
    """Real ggml blocks uint8 [H, row bytes] of a random float32 matrix, with their QTensor."""
    w = (rng.standard_normal((H, d)) / np.sqrt(d)).astype(np.float32)
    if code == Q4_1:
        t = QTensor.quantize(Q4_1, w)
    else:   # the block table has no Q4_0 quantizer: gguf's (llama.cpp's rule)
        t = QTensor(Q4_0, (gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0),), d)
    return t.data, t


def q4_matrix(rng, H, d, kind) -> Q4Planes:
    """Planes of an [H, d] matrix: a Q4_0 or Q4_1 file's blocks, or random bytes with random float16 scales."""
    if kind == "bytes":
        f16 = lambda: (rng.standard_normal((H, d // 32)) / (8 * np.sqrt(d))).astype(np.float16)
        return Q4Planes(rng.integers(0, 256, (H, d // 2), dtype=np.uint8), f16(), f16())
    code = Q4_0 if kind == "q4_0" else Q4_1
    return planes_from_blocks(q4_blocks(rng, H, d, code)[0], code)


def random_ids(rng, H, count, K, pad="random"):
    """count distinct rows in random order, then K - count padding slots: `pad`, or garbage (huge, negative)."""
    tail = rng.integers(-10**9, 10**9, K - count) if pad == "random" else np.full(K - count, pad)
    return np.concatenate([rng.permutation(H)[:count], tail]).astype(np.int32)


def dot_bound(w, x):
    """|error| bound of float32 dots of the rows of w [n, d] (float64 values) with x: (d + 4) EPS sum |w x|."""
    return (w.shape[1] + 4) * EPS * (np.abs(w) @ np.abs(x)) + 1e-30


# ------------------------------------------------ layout

@pytest.mark.parametrize("code", [Q4_0, Q4_1])
def test_planes_hold_the_blocks_values(code):
    rng, seed = fresh_rng()
    data, t = q4_blocks(rng, 37, 160, code)
    p = planes_from_blocks(data, code)
    assert p.qs.shape == (37, 80) and p.qs.dtype == np.uint8
    assert p.scale.shape == p.minimum.shape == (37, 5) and p.scale.dtype == p.minimum.dtype == np.float16
    want = dequantize(p)
    got = t.float32()                 # the block table's float32 dequantizer (gguf's operations)
    if code == Q4_0:
        np.testing.assert_array_equal(want, got, err_msg=f"seed {seed}")    # d (q - 8) is exact in float32
    else:                             # float32's d q + m rounds once
        bound = 2.0 ** -24 * np.abs(want) + 1e-30
        assert (np.abs(want - got) <= bound).all(), f"seed {seed}"
    np.testing.assert_array_equal(gguf.quants.dequantize(data, gguf.GGMLQuantizationType(code)),
                                  got, err_msg=f"seed {seed}")


def test_q4_0_scale_limits():
    """-8 d is a float16 exactly up to |d| = 8188; a larger, infinite or NaN d is refused."""
    block = np.zeros((1, 18), np.uint8)
    block[0, 2:] = qs = np.arange(16, dtype=np.uint8) * 17          # byte j: both nibbles j
    for d, ok in ((8188.0, True), (-8188.0, True), (8192.0, False), (np.inf, False), (np.nan, False)):
        block[0, :2] = np.array([d], np.float16).view(np.uint8)
        if ok:
            q = np.concatenate([qs & 15, qs >> 4]).astype(np.float64)
            np.testing.assert_array_equal(dequantize(planes_from_blocks(block, Q4_0))[0], d * (q - 8))
        else:
            with pytest.raises(ValueError, match="Q4_0 scales"):
                planes_from_blocks(block, Q4_0)


# ------------------------------------------------ q4_hot_ffn

@functools.partial(jax.jit, static_argnames=("activation", "block_k", "block_d", "n_split"))
def run_poisoned(x, gate, up, down_t, ids, count, *, activation, block_k=q4_rows.DEFAULT_BLOCK_K, block_d=None,
                 n_split=None):
    """q4_hot_ffn's path with NaN-poisoned kernel outputs; returns (y, act, partials)."""
    gate, up, down_t, ids_p, count_1, bk, bc = q4_rows.prepare_ffn(x, gate, up, down_t, ids, count, activation,
                                                                   block_k, block_d)
    ns = split_for(x.shape[0] // 2, ids_p.shape[0], bk, bc, n_split)
    return q4_rows.q4_hot_ffn_triton(x, gate, up, down_t, ids_p, count_1, activation=activation, block_k=bk,
                                     block_c=bc, n_split=ns, interpret=INTERPRET, poison=True, return_parts=True)


def ffn_reference(x, gate, up, down_t, ids, count, activation, n_split):
    """float64 (y, act [count]) and their error bounds (module docstring)."""
    rows = np.asarray(ids)[:count]
    G, U, D = (dequantize(p)[rows] for p in (gate, up, down_t))
    x = np.asarray(x, np.float64)
    g, u = G @ x, U @ x
    eg, eu = dot_bound(G, x), dot_bound(U, x)
    act = reference(activation, g, u)
    e_act = 1.2 * eg * (np.abs(u) + eu) + np.abs(g) * eu + 16 * EPS * (np.abs(g) + eg) * (np.abs(u) + eu)
    y = act @ D
    e_y = e_act @ np.abs(D) + (count + n_split + 4) * EPS * ((np.abs(act) + e_act) @ np.abs(D)) + 1e-30
    return y, act, e_y, e_act + 1e-30


def check_ffn(x, gate, up, down_t, ids, count, activation, seed, **blocks):
    """The poisoned kernels against float64: every element written, act and y within their bounds."""
    y, act, parts = (np.asarray(a) for a in run_poisoned(jnp.asarray(x), gate, up, down_t, jnp.asarray(ids), count,
                                                         activation=activation, **blocks))
    assert not np.isnan(act).any(), f"act buffer not fully written (seed {seed})"
    assert not np.isnan(parts).any(), f"partial-sum buffer not fully written (seed {seed})"
    assert (act[count:] == 0).all(), f"slots past count must contribute nothing (seed {seed})"
    want_y, want_act, e_y, e_act = ffn_reference(x, gate, up, down_t, ids, count, activation, parts.shape[1])
    for name, got, want, bound in (("act", act[:count], want_act, e_act), ("y", y, want_y, e_y)):
        err = np.abs(got - want)
        assert np.isfinite(got).all() and (err <= bound).all(), (
            f"seed {seed}: {name} off by {err.max()} (bound {bound[np.argmax(err)]})")
    if count == 0:
        assert (y == 0).all(), f"seed {seed}: no active rows must give exact zeros"
    return y


FFN_CASES = [  # activation, planes, d, H, K
    ("swiglu", "q4_1", 96, 37, 37),
    ("geglu", "q4_0", 32, 1, 1),
    ("reglu", "bytes", 160, 100, 100),
    ("drelu", "q4_1", 160, 100, 123),       # K > H, not a power of two
]


@pytest.mark.parametrize("activation,kind,d,H,K", FFN_CASES)
def test_q4_hot_ffn_matches_float64(activation, kind, d, H, K):
    rng, seed = fresh_rng()
    x = rng.standard_normal(d).astype(np.float32)
    gate, up, down_t = (q4_matrix(rng, H, d, kind) for _ in range(3))
    for count in (0, int(rng.integers(1, H + 1)), H):   # empty, a random subset, every row (one compile: traced)
        ids = random_ids(rng, H, count, K)
        check_ffn(x, gate, up, down_t, ids, count, activation, seed)
    # The public entry point (no poisoning, default blocks): the same kernels, the same numbers.
    y = check_ffn(x, gate, up, down_t, ids, H, activation, seed)
    public = q4_hot_ffn(jnp.asarray(x), gate, up, down_t, jnp.asarray(ids), H, activation=activation,
                        interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(public), y, err_msg=f"seed {seed}")


def test_q4_hot_ffn_padding_and_inactive_rows_are_never_read():
    """Padding ids of any value give bit-identical results; so do NaN scales and minimums in every row outside
    ids[:count] (row 0 included: padding slots are clamped to it) and in the last rows."""
    rng, seed = fresh_rng()
    activation, d, H, K, count = "swiglu", 96, 37, 37, 20     # shapes shared with FFN_CASES: no new compile
    x = rng.standard_normal(d).astype(np.float32)
    mats = [q4_matrix(rng, H, d, "q4_1") for _ in range(3)]
    active = 1 + rng.permutation(H - 1)[:count]
    ys = []
    for pad in (0, -1, H, 2**31 - 1, -(2**31), "random"):
        ids = np.concatenate([active, random_ids(rng, H, 0, K - count, pad)]).astype(np.int32)
        ys.append(check_ffn(x, *mats, ids, count, activation, seed))
    for y in ys[1:]:
        np.testing.assert_array_equal(y, ys[0], err_msg=f"seed {seed}")
    inactive = np.ones(H, bool)
    inactive[active] = False
    nan = lambda a: np.where(inactive[:, None], np.float16(np.nan), a).astype(np.float16)
    poisoned = [Q4Planes(p.qs, nan(p.scale), nan(p.minimum)) for p in mats]
    y, _, _ = run_poisoned(jnp.asarray(x), *poisoned, jnp.asarray(ids), count, activation=activation)
    np.testing.assert_array_equal(np.asarray(y), ys[0], err_msg=f"seed {seed}")


@pytest.mark.parametrize("block_k,block_d,n_split", [(8, 16, 3), (1, 64, 2), (64, 256, 1)])
def test_q4_hot_ffn_block_sizes_and_splits_agree(block_k, block_d, n_split):
    rng, seed = fresh_rng()
    activation, d, H = "geglu", 96, 37
    x = rng.standard_normal(d).astype(np.float32)
    mats = [q4_matrix(rng, H, d, "q4_0") for _ in range(3)]
    for count in (0, 29, H):
        check_ffn(x, *mats, random_ids(rng, H, count, H), count, activation, seed, block_k=block_k,
                  block_d=block_d, n_split=n_split)


def test_q4_hot_ffn_traced_count_one_compile():
    rng, seed = fresh_rng()
    activation, d, H, K = "reglu", 32, 7, 12
    x = rng.standard_normal(d).astype(np.float32)
    mats = [q4_matrix(rng, H, d, "bytes") for _ in range(3)]

    @jax.jit
    def f(ids, count):
        return q4_hot_ffn(jnp.asarray(x), *mats, ids, count, activation=activation, block_k=4, interpret=INTERPRET)

    for count in (0, 1, 5, 7):
        ids = random_ids(rng, H, count, K)
        want, _, e_y, _ = ffn_reference(x, *mats, ids, count, activation, n_split=K)   # n_split <= K: a bound
        y = np.asarray(f(jnp.asarray(ids), jnp.int32(count)))
        assert (np.abs(y - want) <= e_y).all(), f"seed {seed}, count {count}"
    assert f._cache_size() == 1


# ------------------------------------------------ q4_matvec

@functools.partial(jax.jit, static_argnames=("block_r", "block_d"))
def matvec_poisoned(x, w, *, block_r=q4_rows.DEFAULT_BLOCK_R, block_d=None):
    return q4_rows.q4_matvec_pallas(x, w, block_r=block_r, block_c=q4_rows.block_c_for(x.shape[0], block_d),
                                    interpret=INTERPRET, poison=True)


MATVEC_CASES = [  # H, d, planes, block_r, block_d
    (1, 32, "q4_0", 32, None),
    (37, 96, "q4_1", 32, None),
    (100, 160, "bytes", 8, 32),
    (130, 64, "q4_1", 64, 256),
]


@pytest.mark.parametrize("H,d,kind,block_r,block_d", MATVEC_CASES)
def test_q4_matvec_both_impls_match_float64(H, d, kind, block_r, block_d):
    rng, seed = fresh_rng()
    w = q4_matrix(rng, H, d, kind)
    x = rng.standard_normal(d).astype(np.float32)
    W = dequantize(w)
    want, bound = W @ x.astype(np.float64), dot_bound(W, x.astype(np.float64))
    y = np.asarray(matvec_poisoned(jnp.asarray(x), w, block_r=block_r, block_d=block_d))
    public = np.asarray(q4_matvec(jnp.asarray(x), w, interpret=INTERPRET, block_r=block_r, block_d=block_d))
    xla = np.asarray(q4_matvec(jnp.asarray(x), w, impl="xla"))
    for name, got in (("pallas (poisoned)", y), ("pallas", public), ("xla", xla)):
        err = np.abs(got - want)
        assert got.shape == (H,) and np.isfinite(got).all(), f"seed {seed}: {name} output not fully written"
        assert (err <= bound).all(), f"seed {seed}: {name} off by {err.max()} (bound {bound[np.argmax(err)]})"


# ------------------------------------------------ bad input

def test_rejects_bad_arguments():
    rng, _ = fresh_rng()
    d, H = 64, 5
    x = jnp.ones(d, jnp.float32)
    w = q4_matrix(rng, H, d, "q4_1")
    ids = jnp.arange(H, dtype=jnp.int32)
    ffn = lambda *mats, x=x, **kw: q4_hot_ffn(x, *mats, ids, 3, **{"activation": "swiglu", **kw},
                                              interpret=INTERPRET)
    cases = [
        (ValueError, "positive multiple of 32", lambda: q4_matvec(jnp.ones(48, jnp.float32), w)),
        (ValueError, "one decode token", lambda: q4_matvec(jnp.ones((1, d), jnp.float32), w)),
        (TypeError, "x must be float32", lambda: q4_matvec(x.astype(jnp.bfloat16), w)),
        (ValueError, r"w.qs must be \[H, d / 2\]", lambda: q4_matvec(x, w._replace(qs=w.qs[:, :16]))),
        (ValueError, r"w.scale must be \[H, d / 32\]", lambda: q4_matvec(x, w._replace(scale=w.scale[:, :1]))),
        (TypeError, "w.qs must be uint8", lambda: q4_matvec(x, w._replace(qs=w.qs.astype(np.int8)))),
        (TypeError, "w.minimum must be float16", lambda: q4_matvec(x, w._replace(minimum=w.minimum.astype(
            np.float32)))),
        (TypeError, "Q4Planes", lambda: q4_matvec(x, w.qs)),
        (ValueError, "impl must be", lambda: q4_matvec(x, w, impl="cuda")),
        (ValueError, "block_r must be a power of two", lambda: q4_matvec(x, w, block_r=24)),
        (ValueError, "block_d must be a power of two", lambda: q4_matvec(x, w, block_d=48)),
        (ValueError, "block_k must be a power of two", lambda: ffn(w, w, w, block_k=24)),
        (ValueError, "gated activation", lambda: ffn(w, w, w, activation="relu")),
        (ValueError, "unknown activation", lambda: ffn(w, w, w, activation="gelu")),
        (ValueError, r"gate.qs must be \[H, d / 2\] = \(5, 32\)", lambda: ffn(w._replace(qs=w.qs[:, :8]), w, w)),
        (ValueError, r"down_t.qs must be \[H, d / 2\] = \(5, 32\)", lambda: ffn(w, w, Q4Planes(
            *(a[:4] for a in w)))),
        (TypeError, "up.scale must be float16", lambda: ffn(w, w._replace(scale=w.scale.astype(np.float32)), w)),
        (ValueError, "positive multiple of 32", lambda: ffn(w, w, w, x=jnp.ones(0, jnp.float32))),
        (ValueError, "Q4_0 .* or Q4_1 .*, not ggml type 8", lambda: planes_from_blocks(np.zeros((2, 34), np.uint8),
                                                                                        8)),
        (ValueError, "a multiple of 20 bytes", lambda: planes_from_blocks(np.zeros((2, 30), np.uint8), Q4_1)),
        (TypeError, "Q4_0 blocks must be uint8", lambda: planes_from_blocks(np.zeros((2, 18), np.int8), Q4_0)),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()


# ------------------------------------------------ Triton lowering

def _planes_spec(H, d):
    return Q4Planes(jax.ShapeDtypeStruct((H, d // 2), jnp.uint8), jax.ShapeDtypeStruct((H, d // 32), jnp.float16),
                    jax.ShapeDtypeStruct((H, d // 32), jnp.float16))


@pytest.mark.parametrize("d,H,block_k,block_d", [(576, 1536, 32, None), (160, 37, 1, 2), (96, 100, 64, 256)])
def test_lowers_to_triton_for_gpu(d, H, block_k, block_d):
    """No GPU needed: jax lowers the kernels to Triton IR for the CUDA platform, which runs the Triton lowering's
    own checks (power-of-two shapes, supported ops and casts: uint8 -> int32, float16 -> float32)."""
    f32 = jax.ShapeDtypeStruct((d,), jnp.float32)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    w = _planes_spec(H, d)
    text = q4_hot_ffn.trace(f32, w, w, w, i32(H), i32(), activation="swiglu", block_k=block_k,
                            block_d=block_d).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 2                 # the act and the down kernel
    text = q4_matvec.trace(f32, w, block_r=block_k, block_d=block_d).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
