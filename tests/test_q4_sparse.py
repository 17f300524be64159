"""cpu_offload.q4_sparse: the output-major Q4_1 layout and the AXPY kernel that reads only active inputs, against
float64 numpy on the dequantized values."""
from __future__ import annotations

import numpy as np
import pytest

from cpu_offload import q4_sparse as qs


@pytest.mark.parametrize("out,inn", [(32, 1), (64, 33), (96, 7), (576, 576), (3072, 577), (576, 1536)])
def test_axpy_reads_only_active_inputs_and_writes_only_its_outputs(out, inn):
    rng = np.random.default_rng(out * 13 + inn)
    w = rng.standard_normal((out, inn)).astype(np.float32) * rng.uniform(0.1, 3, (1, inn)).astype(np.float32)
    blocks = qs.quantize_columns(w)
    assert blocks.shape == (inn, out // 32 * 20)
    deq = qs.dequantize_columns(blocks, out).astype(np.float64)
    assert np.abs(deq - w).max() < 0.2 * np.abs(w).max()  # a quantization of w, not something else
    x = rng.standard_normal(inn).astype(np.float32)
    idx = np.empty(inn, np.int32)
    nb = out // 32
    for t in (0.0, float(np.quantile(np.abs(x), 0.5)), float(np.abs(x).max())):  # full, half, empty
        n = qs.active(x, np.float32(t), idx)
        keep = np.abs(x) > t
        assert n == keep.sum() and (idx[:n] == np.flatnonzero(keep)).all()
        want = deq @ np.where(keep, x, 0).astype(np.float64)
        for blo, bhi in ((0, nb), (nb // 2, nb), (0, 0), (1 % nb, max(1 % nb, nb - 1))):
            y = np.full(out, np.nan, np.float32)
            qs.axpy(blocks, idx, 0, n, x, y, blo, bhi)
            lo, hi = 32 * blo, 32 * bhi
            np.testing.assert_allclose(y[lo:hi], want[lo:hi], rtol=1e-5, atol=1e-5 * max(np.abs(want).max(), 1))
            assert np.isnan(y[:lo]).all() and np.isnan(y[hi:]).all()
        # Split over the active entries: the partial sums add up to the whole.
        parts = [np.full(out, np.nan, np.float32) for _ in range(3)]
        cuts = [0, n // 3, 2 * n // 3, n]
        for part, a, b in zip(parts, cuts, cuts[1:]):
            qs.axpy(blocks, idx, a, b, x, part, 0, nb)
        np.testing.assert_allclose(sum(p.astype(np.float64) for p in parts), want, rtol=1e-5,
                                   atol=1e-5 * max(np.abs(want).max(), 1))


def test_inactive_inputs_are_never_read():
    """Rows of inactive inputs may hold anything (here NaN bytes): the result does not see them."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 40)).astype(np.float32)
    blocks = qs.quantize_columns(w)
    x = rng.standard_normal(40).astype(np.float32)
    x[::3] = 0.0
    idx = np.empty(40, np.int32)
    n = qs.active(x, np.float32(0.0), idx)
    blocks[::3] = 0xFF  # float16 d and m of 0xFFFF are NaN
    y = np.empty(64, np.float32)
    qs.axpy(blocks, idx, 0, n, x, y, 0, 2)
    ok = np.arange(40) % 3 != 0
    want = qs.dequantize_columns(blocks[ok], 64).astype(np.float64) @ x[ok]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
