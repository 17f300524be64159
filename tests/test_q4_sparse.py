"""cpu_offload.q4_sparse: the Q4_1 blocks re-laid by input column and the kernel that reads only active inputs,
against float64 numpy on the dequantized values."""
from __future__ import annotations

import numpy as np
import pytest

from cpu_offload import q4, q4_sparse as qs


def _matrix(rng, out, cols):
    w = rng.standard_normal((out, cols)).astype(np.float32) * rng.uniform(0.1, 3, (out, 1)).astype(np.float32)
    w[0, :32] = 0.25  # a constant block (d = 0)
    return w


@pytest.mark.parametrize("out,cols", [(32, 32), (64, 96), (96, 64), (576, 576), (3072, 576), (576, 1536)])
def test_relayout_keeps_the_numbers_of_the_q4_1_blocks(out, cols):
    rng = np.random.default_rng(out + 7 * cols)
    blocks = q4.quantize(_matrix(rng, out, cols))
    nib, d, m = qs.relayout(blocks, out, cols)
    assert nib.shape == (cols, out // 2) and d.shape == m.shape == (cols // 32, out)
    assert nib.nbytes + d.nbytes + m.nbytes == blocks.nbytes  # the same 0.625 bytes a weight
    np.testing.assert_array_equal(qs.dequantize(nib, d, m), q4.dequantize(blocks, cols))
    with pytest.raises(ValueError, match="multiples of 32"):
        qs.relayout(q4.quantize(np.zeros((48, 32), np.float32)), 48, 32)


@pytest.mark.parametrize("out,cols", [(32, 32), (64, 96), (96, 64), (576, 576), (3072, 576), (576, 1536)])
def test_matvec_reads_active_inputs_and_its_blocks_only(out, cols):
    rng = np.random.default_rng(out * 13 + cols)
    blocks = q4.quantize(_matrix(rng, out, cols))
    nib, d, m = qs.relayout(blocks, out, cols)
    w = q4.dequantize(blocks, cols).astype(np.float64)
    x = rng.standard_normal(cols).astype(np.float32)
    x[32:64] *= 0.01  # a block whose inputs are all small: skipped whole at the middle threshold
    idx = np.empty(cols, np.int32)
    acc = np.empty(out, np.float32)
    nb = cols // 32
    for t in (0.0, float(np.quantile(np.abs(x), 0.5)), float(np.abs(x).max())):  # full, half, empty
        n = qs.active(x, np.float32(t), idx)
        keep = np.abs(x) > t
        assert n == keep.sum() and (idx[:n] == np.flatnonzero(keep)).all()
        for b0, b1 in ((0, nb), (0, 0), (nb // 2, nb), (1 % nb, max(1 % nb, nb - 1))):
            sel = keep & (np.arange(cols) // 32 >= b0) & (np.arange(cols) // 32 < b1)
            want = w @ np.where(sel, x, 0).astype(np.float64)
            y = np.full(out, np.nan, np.float32)
            acc[:] = np.nan
            qs.matvec(nib, d, m, idx, n, x, y, acc, b0, b1)
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * max(np.abs(want).max(), 1))


def test_inactive_columns_and_blocks_are_never_read():
    """Nibbles of inactive inputs and scales of blocks without an active input may hold anything (here NaN
    scales and garbage nibbles): the result does not see them."""
    rng = np.random.default_rng(5)
    out, cols = 64, 128
    blocks = q4.quantize(_matrix(rng, out, cols))
    nib, d, m = qs.relayout(blocks, out, cols)
    w = q4.dequantize(blocks, cols).astype(np.float64)
    x = rng.standard_normal(cols).astype(np.float32)
    x[32:64] = 0.0   # block 1 inactive
    x[::3] = 0.0
    keep = x != 0
    nib[~keep] = 0xFF
    d[1] = np.float16(np.nan).view(np.uint16)
    m[1] = np.float16(np.nan).view(np.uint16)
    idx = np.empty(cols, np.int32)
    n = qs.active(x, np.float32(0.0), idx)
    y = np.empty(out, np.float32)
    qs.matvec(nib, d, m, idx, n, x, y, np.empty(out, np.float32), 0, cols // 32)
    np.testing.assert_allclose(y, w @ np.where(keep, x, 0), rtol=1e-5, atol=1e-5)
