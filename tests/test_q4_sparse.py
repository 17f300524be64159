"""cpu_offload.q4_sparse: the Q4_1 blocks re-laid by input column in row tiles and the kernel that reads only
active inputs, against float64 numpy on the dequantized values."""
from __future__ import annotations

import numpy as np
import pytest

from cpu_offload import q4_sparse as qs
from tests.conftest import q4_1, q4_1_values

# out = 576 (4.5 tiles: a remainder tile of 2 groups), 1536 (12 tiles), 96 / 160 / 224 (remainders of 3, 1, 3)
SHAPES = [(32, 32), (64, 96), (96, 64), (160, 64), (224, 96), (576, 576), (1536, 576), (576, 1536), (960, 576)]


def _matrix(rng, out, cols):
    w = rng.standard_normal((out, cols)).astype(np.float32) * rng.uniform(0.1, 3, (out, 1)).astype(np.float32)
    w[0, :32] = 0.25  # a constant block (d = 0)
    return w


def _run(nib, d, m, x, threshold, threads=1):
    """The kernel's y over every tile, split as a team of ``threads`` splits it; y poisoned with NaN first."""
    cols, out = x.shape[0], d.shape[1]
    idx = np.full(cols, -1, np.int32)
    seg = np.full(cols // 32 + 1, -1, np.int32)
    n = qs.active(x, np.float32(threshold), idx)
    nseg = qs.segments(idx, n, seg)
    y = np.full(out, np.nan, np.float32)
    for tid in range(threads):
        qs.matvec(nib, d, m, idx, seg, nseg, x, y, *qs.tile_share(out, tid, threads))
    return y, idx[:n], seg[:nseg + 1]


@pytest.mark.parametrize("out,cols", SHAPES)
def test_relayout_keeps_the_numbers_of_the_q4_1_blocks(out, cols):
    rng = np.random.default_rng(out + 7 * cols)
    blocks = q4_1(_matrix(rng, out, cols))
    nib, d, m = qs.relayout(blocks, out, cols)
    assert nib.shape == (cols * out // 2,) and d.shape == m.shape == (cols // 32, out)
    assert nib.ctypes.data % 64 == 0  # a full tile's column is one cache line
    assert nib.nbytes + d.nbytes + m.nbytes == blocks.nbytes  # the same 0.625 bytes a weight
    np.testing.assert_array_equal(qs.dequantize(nib, d, m), q4_1_values(blocks, cols))
    with pytest.raises(ValueError, match="multiples of 32"):
        qs.relayout(q4_1(np.zeros((48, 32), np.float32)), 48, 32)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("out,cols", SHAPES)
def test_matvec_against_float64_over_empty_partial_and_full_active_sets(out, cols, threads):
    rng = np.random.default_rng()  # fresh inputs every run
    blocks = q4_1(_matrix(rng, out, cols))
    nib, d, m = qs.relayout(blocks, out, cols)
    w = q4_1_values(blocks, cols).astype(np.float64)
    x = rng.standard_normal(cols).astype(np.float32)
    if cols >= 64:
        x[32:64] *= 0.01  # a block whose inputs are all small: skipped whole at the middle threshold
    x[-1] = 0.0
    for t in (0.0, float(np.quantile(np.abs(x), 0.25)), float(np.quantile(np.abs(x), 0.5)),
              float(np.quantile(np.abs(x), 0.97)), float(np.abs(x).max())):
        keep = np.abs(x) > t
        y, idx, seg = _run(nib, d, m, x, t, threads)
        assert (idx == np.flatnonzero(keep)).all()
        blocks_on = np.unique(idx // 32)
        assert seg[-1] == len(idx) and (idx[seg[:-1]] // 32 == blocks_on).all()
        xa = np.where(keep, x, 0).astype(np.float64)
        want = w @ xa
        # The kernel's rounding: per block, sums of up to 32 x_i c (c <= 255) less 16 sums of x_i q_hi, times d;
        # then one FMA per block into y.
        absx = np.abs(xa).reshape(-1, 32).sum(1)
        f16 = lambda a: np.abs(a.view(np.float16).astype(np.float64))
        bound = 64 * 2.0 ** -24 * (255 * f16(d).T @ absx + f16(m).T @ absx + np.abs(w) @ np.abs(xa)) + 1e-30
        assert np.isfinite(y).all()
        np.testing.assert_array_less(np.abs(y - want), bound)
        if not keep.any():
            assert (y == 0).all()


def test_tile_share_covers_every_tile_once():
    for out in (32, 96, 576, 960, 1536, 3072):
        tiles = -(-out // 128)
        for n in (1, 2, 3, 4, 8):
            shares = [qs.tile_share(out, t, n) for t in range(n)]
            assert shares[0][0] == 0 and shares[-1][1] == tiles
            assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(shares, shares[1:]))
    assert [qs.tile_share(576, t, 2) for t in range(2)] == [(0, 2), (2, 5)]     # 8 and 10 of 18 groups
    assert [qs.tile_share(1536, t, 2) for t in range(2)] == [(0, 6), (6, 12)]


@pytest.mark.parametrize("out,cols", [(576, 576), (160, 128), (576, 1536)])
def test_inactive_columns_and_blocks_are_never_read(out, cols):
    """Nibbles of inactive inputs and scales of blocks without an active input may hold anything (here NaN
    scales and garbage nibbles): the result is the same bits as with the true ones."""
    rng = np.random.default_rng()
    blocks = q4_1(_matrix(rng, out, cols))
    nib, d, m = qs.relayout(blocks, out, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    x[32:64] *= 0.01   # block 1 inactive at the threshold below
    t = float(np.quantile(np.abs(x), 0.4))
    keep = np.abs(x) > t
    assert not keep[32:64].any()
    want, _, _ = _run(nib, d, m, x, t, 2)
    for g in range(0, out // 32, 4):   # every inactive column's bytes in every tile
        n = min(4, out // 32 - g)
        tile = nib[g * 16 * cols:(g + n) * 16 * cols].reshape(cols, 16 * n)
        tile[~keep] = ~tile[~keep]
    d[1] = np.float16(np.nan).view(np.uint16)
    m[1] = np.float16(np.nan).view(np.uint16)
    assert not np.array_equal(qs.dequantize(nib, d, m)[:, ~keep], q4_1_values(blocks, cols)[:, ~keep])
    y, _, _ = _run(nib, d, m, x, t, 2)
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("groups", [1, 2, 3, 4])
def test_the_portable_ir_gives_the_bits_of_the_avx512_one(groups):
    """The tile kernel without vpermps (a mask and a conversion for the low nibbles) computes the same bits as
    matvec's, whichever form matvec was compiled with."""
    from numba import njit

    tile = qs._make_tile(groups, False)

    @njit
    def run(nib, d, m, idx, seg, nseg, x, y):
        tile(nib.ctypes.data, idx.ctypes.data, seg.ctypes.data, nseg, x.ctypes.data, d.ctypes.data, m.ctypes.data,
             d.strides[0], y.ctypes.data)

    rng = np.random.default_rng()
    out, cols = 32 * groups, 160
    nib, d, m = qs.relayout(q4_1(_matrix(rng, out, cols)), out, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    want, idx, seg = _run(nib, d, m, x, 0.5)
    y = np.full(out, np.nan, np.float32)
    run(nib, d, m, idx, seg, len(seg) - 1, x, y)
    np.testing.assert_array_equal(y, want)
