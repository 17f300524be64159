"""The GGUF's own Q4_1 blocks, re-laid by input column, and the kernel that reads only the active inputs' nibbles.

A Q4_1 matrix W [out, in] (q4.py: blocks of 32 inputs per row, W[r, i] = d[r, b] q[r, i] + m[r, b], b = i // 32)
is kept with the same numbers, laid out so that one input's weights are contiguous (``relayout``):

    nib [in, out / 2] uint8   column i: per group of 32 rows, 16 bytes (low nibbles rows 0..15, high 16..31)
    d, m [in / 32, out] uint16    the blocks' float16 scales and minimums (their bits: Numba has no float16 on the
                                  CPU), one row per block of 32 inputs

Then, with a_b = sum over active i in block b of x_i q[:, i] and s_b = sum over active i in b of x_i,

    y = sum over blocks b with an active input of d[b] * a_b + m[b] * s_b

which reads the nibbles of the active inputs only, plus the scales of the blocks that have one: the exact
model of the file (no second quantization), in the same 0.625 bytes a weight. Reading k of a block's 32
inputs reads 4 + k / 2 bytes per output instead of 20: 20% fewer at 25% of the inputs skipped, 40% at 50%.
(Blocks laid along the output dimension instead, i.e. W's transpose re-quantized to Q4_1, cost 18% perplexity
on the default model with every threshold at 0: README.md.)

``matvec(nib, d, m, idx, n, x, y, acc, b0, b1)`` computes y over the input blocks [b0, b1), so a team splits
the blocks (each thread streams its own columns into its own partial y; the caller adds the partials).
``_nib_axpy`` and ``_scale_add`` are LLVM vector IR (16-lane FMAs; float16 converted in registers: Numba has no
float16 on the CPU).
"""
from __future__ import annotations

import numpy as np

from pjinfer.config import ConfigError

from . import _threading  # noqa: F401  (sets NUMBA_THREADING_LAYER before numba is imported)

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import ffi, kernels, q4  # noqa: E402
from .kernels import prefetch  # noqa: E402
from .q4 import BLOCK, BLOCK_BYTES  # noqa: E402

ffi.purge_stale_cache("q4_sparse", kernels, q4)

PREFETCH_AHEAD = 4  # active columns ahead whose nibbles are prefetched
_F0 = np.float32(0.0)
_JIT = dict(fastmath=True, cache=True, nogil=True)


def relayout(blocks: np.ndarray, out: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q4.quantize's blocks of W [out, cols] -> (nib [cols, out / 2] uint8, d [cols / 32, out], m [cols / 32, out]:
    float16 bits as uint16), the same numbers by input column. out and cols multiples of 32."""
    if out % BLOCK or cols % BLOCK:
        raise ConfigError(f"Q4_1 columns need rows and columns in multiples of {BLOCK}, got {out} x {cols}")
    b = np.ascontiguousarray(blocks).reshape(out, cols // BLOCK, BLOCK_BYTES)
    d = np.ascontiguousarray(np.ascontiguousarray(b[..., 0:2]).view(np.uint16)[..., 0].T)
    m = np.ascontiguousarray(np.ascontiguousarray(b[..., 2:4]).view(np.uint16)[..., 0].T)
    q = np.concatenate([b[..., 4:] & 15, b[..., 4:] >> 4], -1).reshape(out, cols)   # [out, cols] nibbles
    qt = q.T.reshape(cols, out // BLOCK, BLOCK)                                       # column, row group, row
    nib = (qt[..., :16] | (qt[..., 16:] << 4)).astype(np.uint8).reshape(cols, out // 2)
    return np.ascontiguousarray(nib), d, m


def dequantize(nib: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """What relayout's arrays stand for, as W [out, cols] float32."""
    cols, half = nib.shape
    out = 2 * half
    g = nib.reshape(cols, out // BLOCK, 16)
    q = np.concatenate([g & 15, g >> 4], -1).reshape(cols, out).astype(np.float32)   # [cols, out]
    blk = np.arange(cols) // BLOCK
    f32 = lambda a: a.view(np.float16).astype(np.float32)
    return np.ascontiguousarray((q * f32(d)[blk] + f32(m)[blk]).T)


_f32, _i32, _i64, _i8 = ir.FloatType(), ir.IntType(32), ir.IntType(64), ir.IntType(8)
_v16f = ir.VectorType(_f32, 16)
_v16h = ir.VectorType(ir.HalfType(), 16)
_v16b = ir.VectorType(_i8, 16)


def _load(builder, addr, ty, align):
    return builder.load(builder.inttoptr(addr, ty.as_pointer()), align=align)


def _store(builder, value, addr, align):
    builder.store(value, builder.inttoptr(addr, value.type.as_pointer()), align=align)


def _splat(builder, s):
    v = builder.insert_element(ir.Constant(_v16f, ir.Undefined), s, _i32(0))
    return builder.shuffle_vector(v, ir.Constant(_v16f, ir.Undefined), ir.Constant(ir.VectorType(_i32, 16), [0] * 16))


def _fma(builder):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_v16f, [_v16f] * 3), "llvm.fma.v16f32")


@intrinsic
def _nib_axpy(typingctx, acc, col, groups, x):
    """acc[32 g + j] += x * q_j for g < groups: col (an address) holds 16 bytes per group of 32 rows (low nibbles
    rows 0..15, high nibbles 16..31); acc an address of float32. No bounds checks: the caller owns the shapes."""
    if not (isinstance(acc, types.Integer) and isinstance(col, types.Integer) and isinstance(groups, types.Integer)
            and isinstance(x, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        acc, col, groups = args[:3]
        xv = _splat(builder, context.cast(builder, args[3], sig.args[3], types.float32))
        fma = _fma(builder)
        mask, four = ir.Constant(_v16b, [15] * 16), ir.Constant(_v16b, [4] * 16)
        with cgutils.for_range(builder, groups) as loop:
            g = loop.index
            c = _load(builder, builder.add(col, builder.mul(g, _i64(16))), _v16b, 1)
            a = builder.add(acc, builder.mul(g, _i64(4 * BLOCK)))
            b = builder.add(a, _i64(64))
            lo = builder.uitofp(builder.and_(c, mask), _v16f)
            hi = builder.uitofp(builder.lshr(c, four), _v16f)
            _store(builder, builder.call(fma, [lo, xv, _load(builder, a, _v16f, 4)]), a, 4)
            _store(builder, builder.call(fma, [hi, xv, _load(builder, b, _v16f, 4)]), b, 4)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64, types.float32), codegen


@intrinsic
def _scale_add(typingctx, y, acc, d, m, lanes16, s):
    """y[j] += d[j] * acc[j] + m[j] * s for j < 16 lanes16: y and acc float32 addresses, d and m float16."""
    if not (all(isinstance(a, types.Integer) for a in (y, acc, d, m, lanes16)) and isinstance(s, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        y, acc, d, m, lanes16 = args[:5]
        sv = _splat(builder, context.cast(builder, args[5], sig.args[5], types.float32))
        fma = _fma(builder)
        with cgutils.for_range(builder, lanes16) as loop:
            j = loop.index
            off4, off2 = builder.mul(j, _i64(64)), builder.mul(j, _i64(32))
            ya = builder.add(y, off4)
            dv = builder.fpext(_load(builder, builder.add(d, off2), _v16h, 2), _v16f)
            mv = builder.fpext(_load(builder, builder.add(m, off2), _v16h, 2), _v16f)
            av = _load(builder, builder.add(acc, off4), _v16f, 4)
            t = builder.call(fma, [mv, sv, _load(builder, ya, _v16f, 4)])
            _store(builder, builder.call(fma, [dv, av, t]), ya, 4)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64, types.int64, types.int64, types.float32), codegen


@njit(**_JIT)
def active(x, threshold, idx):
    """idx[:n] <- the i with |x[i]| > threshold, in increasing order; returns n. A threshold of 0 keeps every
    non-zero."""
    n = 0
    for i in range(x.shape[0]):
        if abs(x[i]) > threshold:
            idx[n] = i
            n += 1
    return n


@njit(**_JIT)
def matvec(nib, d, m, idx, n, x, y, acc, b0, b1):
    """y = the part of W x from input blocks [b0, b1), active inputs only: idx[:n] (increasing, from ``active``)
    selects the inputs; W is relayout's (nib [cols, out / 2], d, m [cols / 32, out] float16 bits). Writes all of
    y [out]; acc [out] is scratch. idx entries must lie in [0, cols); they are not checked."""
    out = y.shape[0]
    for j in range(out):
        y[j] = _F0
    groups = out // BLOCK
    k = 0
    while k < n and idx[k] < BLOCK * b0:  # the first active input of the range (n <= cols: a short scan)
        k += 1
    stride = nib.strides[0]
    base = nib.ctypes.data
    ya, aa = y.ctypes.data, acc.ctypes.data
    for b in range(b0, b1):
        end = BLOCK * (b + 1)
        if k >= n or idx[k] >= end:
            continue  # no active input in this block: its scales are not read either
        for j in range(out):
            acc[j] = _F0
        s = _F0
        while k < n and idx[k] < end:
            if k + PREFETCH_AHEAD < n:
                for j in range(0, nib.shape[1], 64):
                    prefetch(nib, idx[k + PREFETCH_AHEAD], j)
            i = idx[k]
            _nib_axpy(aa, base + i * stride, groups, x[i])
            s += x[i]
            k += 1
        _scale_add(ya, aa, d.ctypes.data + b * d.strides[0], m.ctypes.data + b * m.strides[0], out // 16, s)
