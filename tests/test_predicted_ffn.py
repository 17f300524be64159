"""cpu_offload/predicted_ffn.py, PowerInfer's predicted FFN in the file's row types, against float64 numpy: every
row type (the block types, F16, F32) for the row dot and the row AXPY, then the whole FFN (predictor, gate/up over
the predicted rows, activation, down AXPY over ffn_down_t's rows, threads' partial sums) with empty, full and
partial active sets, odd sizes, outputs poisoned before the run."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from numba import njit

from cpu_offload import blocks, predicted_ffn as pf
from tests.test_quants import random_blocks

KINDS = sorted(pf.KINDS)
CODES = {"swiglu": 0, "reglu": 2, "drelu": 3}


def random_rows(rng, kind, rows, cols):
    """(uint8 rows, float64 values [rows, cols]) of a fresh random matrix of row type kind."""
    if kind in (pf.F32, pf.F16):
        w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32 if kind == pf.F32 else np.float16)
        data, got_kind = pf.stored_rows(w)
        assert got_kind == kind and data.shape == (rows, pf.row_bytes(kind, cols))
        return data, w.astype(np.float64)
    data = random_blocks(rng, kind, rows, cols // blocks.TYPES[kind].block)
    return data, gguf.quants.dequantize(data, gguf.GGMLQuantizationType(kind)).astype(np.float64)


def block_of(kind):
    return pf.KINDS[kind][1]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: pf.KINDS[k][0])
def test_row_dot_and_axpy_match_float64(kind):
    rng = np.random.default_rng(kind + 50)
    cols = 3 * block_of(kind)
    data, w = random_rows(rng, kind, 5, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    y0 = rng.standard_normal(cols).astype(np.float32)
    for r in range(5):
        got = _row_dot(kind, data, r, x)
        bound = 1e-6 * (np.abs(w[r]) @ np.abs(x)) + 1e-30
        assert abs(got - w[r] @ x) <= bound, (r, got, w[r] @ x)
        y = y0.copy()
        a = np.float32(rng.standard_normal())
        _row_axpy(kind, data, r, y, a)
        np.testing.assert_allclose(y, y0 + float(a) * w[r], rtol=0, atol=1e-6 * (1 + np.abs(w[r]).max()))


@njit
def _row_dot(kind, data, r, x):
    return pf.row_dot(kind, data.ctypes.data + r * data.strides[0], x.shape[0] // pf.KINDS_BLOCK[kind], x.ctypes.data)


@njit
def _row_axpy(kind, data, r, y, a):
    pf.row_axpy(kind, data.ctypes.data + r * data.strides[0], y.shape[0] // pf.KINDS_BLOCK[kind], y.ctypes.data, a)


def reference_ffn(h, r, fc1, fc2, t, wg, wu, wd, activation):
    """float64: (y, mask, the float32 rounding bound on y per output). The mask is PowerInfer's rule."""
    h64, r64 = h.astype(np.float64), r.astype(np.float64)
    score = fc2.astype(np.float64) @ np.maximum(fc1.astype(np.float64) @ r64, 0)
    mask = score >= t
    g, u = wg @ h64, wu @ h64
    a = {"reglu": np.maximum(g, 0) * u, "drelu": np.maximum(g, 0) * np.maximum(u, 0),
         "swiglu": 0.5 * g * (1 + np.tanh(g / 2)) * u}[activation]
    a = np.where(mask, a, 0.0)
    sg, su = np.abs(wg) @ np.abs(h64), np.abs(wu) @ np.abs(h64)
    bound = 1e-5 * (np.where(mask, (sg + 1) * (su + 1), 0.0) @ np.abs(wd)) + 1e-30
    return a @ wd, mask, score, bound


CASES = [  # (gate/up kind, down kind, d, d_ff, rank, threshold: "empty", "full" or a number, activation, threads,
           #  the predictor's dtype: PowerInfer's files store float16; a rank off 32 is padded)
    (blocks.Q4_0, blocks.Q4_0, 64, 37, 16, 0.0, "reglu", 2, np.float32),
    (blocks.Q4_0, blocks.Q4_0, 96, 1, 5, 0.0, "drelu", 1, np.float32),
    (blocks.Q8_0, blocks.Q8_0, 32, 53, 7, 0.02, "reglu", 3, np.float32),
    (pf.F16, pf.F16, 64, 41, 16, 0.0, "drelu", 2, np.float32),
    (blocks.Q4_1, blocks.Q4_1, 160, 29, 16, -0.01, "swiglu", 2, np.float32),
    (pf.F32, pf.F32, 32, 17, 3, 0.0, "reglu", 5, np.float32),
    (blocks.Q4_K, blocks.Q6_K, 256, 23, 16, 0.0, "reglu", 2, np.float32),
    (blocks.Q5_K, blocks.Q5_0, 256, 19, 16, 0.0, "drelu", 3, np.float32),
    (blocks.Q5_1, blocks.Q8_0, 64, 31, 9, 0.0, "reglu", 2, np.float32),
    (blocks.Q4_0, blocks.Q4_0, 64, 37, 16, "empty", "reglu", 2, np.float32),
    (blocks.Q4_0, pf.F16, 64, 37, 16, "full", "drelu", 3, np.float32),
    (blocks.Q4_0, blocks.Q4_0, 64, 40, 16, "full", "swiglu", 64, np.float32),   # more threads than neurons
    (blocks.Q4_0, blocks.Q4_0, 64, 37, 16, 0.0, "reglu", 2, np.float16),
    (blocks.Q8_0, blocks.Q4_0, 96, 45, 32, 0.0, "drelu", 3, np.float16),
    (pf.F16, pf.F16, 32, 53, 7, 0.02, "reglu", 2, np.float16),
]


@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"{pf.KINDS[c[0]][0]}-{pf.KINDS[c[1]][0]}-{c[3]}-{c[5]}-{c[6]}-{c[7]}-"
                                       f"{np.dtype(c[8]).name}")
def test_ffn_matches_float64(case):
    gu_kind, down_kind, d, d_ff, rank, t, activation, threads, dtype = case
    rng = np.random.default_rng()   # fresh inputs each run; drawn again while a decision is within rounding
    threshold = {"empty": np.float32(np.inf), "full": np.float32(-np.inf)}.get(t, t)
    for _ in range(50):
        (gate, wg), (up, wu), (down, wd) = (random_rows(rng, gu_kind, d_ff, d), random_rows(rng, gu_kind, d_ff, d),
                                            random_rows(rng, down_kind, d_ff, d))
        h = rng.standard_normal(d).astype(np.float32)
        r = (rng.standard_normal(d) * 2).astype(np.float32)
        fc1 = (rng.standard_normal((rank, d)) / 4).astype(dtype)
        fc2 = (rng.standard_normal((d_ff, rank)) / 4 - 0.05).astype(dtype)
        want, want_mask, score, bound = reference_ffn(h, r, fc1, fc2, float(threshold), wg, wu, wd, activation)
        if t in ("empty", "full") or (np.abs(score - threshold).min() > 1e-4
                                        and (0 < want_mask.sum() < d_ff or d_ff == 1)):
            break
    if t not in ("empty", "full"):
        assert np.abs(score - threshold).min() > 1e-4          # no decision within float32 rounding
        assert 0 < want_mask.sum() < d_ff or d_ff == 1
    y, mask = pf.ffn(h, r, fc1, fc2, threshold, (gate, gu_kind), (up, gu_kind), (down, down_kind),
                     CODES[activation], threads)
    np.testing.assert_array_equal(mask.astype(bool), want_mask)
    assert set(np.unique(mask)) <= {0, 1}
    if t == "empty":
        assert not mask.any() and (y == 0).all()
    if t == "full":
        assert mask.all()
    assert np.isfinite(y).all()
    np.testing.assert_array_less(np.abs(y - want), bound)


def test_threads_split_the_ids_and_their_partial_sums_add_up():
    """The same FFN on 1, 2, 3 and 7 simulated threads: the float64 answer each time; 1 thread's and the split's
    sums differ only by the order of the partial sums."""
    rng = np.random.default_rng(9)
    d, d_ff = 64, 45
    (gate, wg), (up, wu), (down, wd) = (random_rows(rng, blocks.Q4_0, d_ff, d) for _ in range(3))
    h, r = rng.standard_normal(d).astype(np.float32), rng.standard_normal(d).astype(np.float32)
    fc1, fc2 = rng.standard_normal((8, d)).astype(np.float32), rng.standard_normal((d_ff, 8)).astype(np.float32)
    want, want_mask, _, bound = reference_ffn(h, r, fc1, fc2, 0.0, wg, wu, wd, "reglu")
    outs = []
    for n in (1, 2, 3, 7):
        y, mask = pf.ffn(h, r, fc1, fc2, 0.0, (gate, 2), (up, 2), (down, 2), CODES["reglu"], n)
        np.testing.assert_array_equal(mask.astype(bool), want_mask)
        np.testing.assert_array_less(np.abs(y - want), bound)
        outs.append(y)
    assert any((o != outs[0]).any() for o in outs[1:]) or want_mask.sum() < 2


def test_gate_at_or_below_zero_skips_up_and_down_rows():
    """ReGLU / dReLU: a neuron whose gate is <= 0 reads neither its up nor its down row (huge rows there leave the
    output small); SwiGLU reads them."""
    rng = np.random.default_rng(4)
    d, d_ff = 32, 6
    wg = rng.standard_normal((d_ff, d)).astype(np.float32)
    h = np.abs(rng.standard_normal(d)).astype(np.float32)
    wg[::2] = -np.abs(wg[::2])    # even neurons: gate < 0
    wg[1::2] = np.abs(wg[1::2])
    wu, wd = rng.standard_normal((d_ff, d)).astype(np.float32), rng.standard_normal((d_ff, d)).astype(np.float32)
    wu[::2] = 1e20
    wd[::2] = 1e20
    fc1, fc2 = np.ones((1, d), np.float32), np.ones((d_ff, 1), np.float32)
    rows = [pf.stored_rows(w) for w in (wg, wu, wd)]
    for code in (2, 3):
        y, mask = pf.ffn(h, h, fc1, fc2, -np.inf, *rows, code, 2)
        assert mask.all() and np.abs(y).max() < 1e3
    y, _ = pf.ffn(h, h, fc1, fc2, -np.inf, *rows, CODES["swiglu"], 2)
    assert np.abs(y).min() > 1e10


def test_row_bytes_and_refusals():
    assert pf.row_bytes(pf.F16, 64) == 128 and pf.row_bytes(pf.F32, 64) == 256
    assert pf.row_bytes(blocks.Q4_0, 64) == 36 and pf.row_bytes(blocks.Q6_K, 512) == 420
    with pytest.raises(ValueError, match="multiple of 32"):
        pf.row_bytes(pf.F16, 48)
    with pytest.raises(ValueError, match="no row kernel"):
        pf.stored_rows(np.zeros((2, 32), np.int8))


def test_predictor_rows_read_the_file_in_place_and_pad_an_odd_rank_with_zeros():
    rng = np.random.default_rng()
    fc1, fc2 = rng.standard_normal((64, 96)).astype(np.float16), rng.standard_normal((40, 64)).astype(np.float16)
    (a, a_kind), (b, b_kind), rank = pf.predictor_rows(fc1, fc2)
    assert (a_kind, b_kind, rank) == (pf.F16, pf.F16, 64)
    assert np.shares_memory(a, fc1) and np.shares_memory(b, fc2)     # no copy of the file's predictor
    (a, _), (b, _), rank = pf.predictor_rows(fc1[:7], fc2[:, :7])
    assert rank == 32 and a.shape == (32, pf.row_bytes(pf.F16, 96)) and b.shape == (40, pf.row_bytes(pf.F16, 32))
    np.testing.assert_array_equal(pf.float32_rows(a, pf.F16, 96), np.pad(fc1[:7], ((0, 25), (0, 0))))
    np.testing.assert_array_equal(pf.float32_rows(b, pf.F16, 32), np.pad(fc2[:, :7], ((0, 0), (0, 25))))
    with pytest.raises(ValueError, match="multiple of 32 weights, not 48"):
        pf.predictor_rows(fc1[:, :48], fc2)
    with pytest.raises(ValueError, match="no row kernel"):
        pf.predictor_rows(fc1.astype(np.int8), fc2)
