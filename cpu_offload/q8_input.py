"""The input of q8_dot's integer dots: x rounded once a call to two 8-bit parts a lane of four (about 15 bits);
q8_dot's docstring says why and how the kernels read it."""
from __future__ import annotations

import numpy as np

from ._numba import JIT  # (first: the threading layer and the BLAS check, before numba is imported)

from numba import njit  # noqa: E402

GROUP = 16                 # input elements per sum of x^
FINE = 256                 # a code's step over its residue's: x^ has about 15 bits a lane (quantize_input)


@njit(**JIT)
def quantize_input(x):
    """x (float32 [cols], cols a multiple of 16) rounded in lanes of 4 -> (codes, residues, dx4, sums, lane_sums).
    Lane k (elements 4k..4k+3) has the unit dx4[k] = max|x| / (127 FINE) of the lane (float32 [cols / 4]; 0, and
    codes 0, for a lane of zeros), and x[i] is rounded to x^_i = dx4[k] (FINE codes[i] + residues[i]) (int8
    [cols] each, both in [-127, 127]): codes[i] = round(t) for t = 127 x[i] / max|x|, residues[i] = round(FINE
    (t - codes[i])). lane_sums[k] = the lane's sum of FINE codes + residues (int32 [cols / 4]); sums[g] = the sum of
    x^ over group g of 16 elements (float32 [cols / 16])."""
    cols = x.shape[0]
    codes, residues = np.empty(cols, np.int8), np.empty(cols, np.int8)
    dx4, lane_sums = np.empty(cols // 4, np.float32), np.empty(cols // 4, np.int32)
    sums = np.empty(cols // GROUP, np.float32)
    quantize_into(x, codes, residues, dx4, sums, lane_sums)
    return codes, residues, dx4, sums, lane_sums


@njit(**JIT)
def quantize_into(x, codes, residues, dx4, sums, lane_sums):
    """quantize_input's arrays for x, written into the given ones (their shapes as quantize_input's)."""
    for k in range(x.shape[0] // 4):
        amax = max(max(abs(x[4 * k]), abs(x[4 * k + 1])), max(abs(x[4 * k + 2]), abs(x[4 * k + 3])))
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        total = 0
        for i in range(4 * k, 4 * k + 4):
            t = x[i] * inv
            c = np.rint(t)
            r = min(max(np.int32(np.rint((t - c) * np.float32(FINE))), -127), 127)
            codes[i], residues[i] = np.int32(c), r
            total += FINE * np.int32(c) + r
        dx4[k] = amax / np.float32(127.0 * FINE)
        lane_sums[k] = total
    for g in range(x.shape[0] // GROUP):
        total = np.float32(0.0)
        for k in range(4 * g, 4 * g + 4):
            total += dx4[k] * np.float32(lane_sums[k])
        sums[g] = total
