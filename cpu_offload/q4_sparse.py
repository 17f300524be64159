"""Q4_1 matrices laid out along the output dimension, and the AXPY kernel that reads only the active inputs.

For a matrix W [out, in] whose input x is sparse (TEAL, arXiv 2408.14690: |x_i| below a calibrated threshold
counts as zero), ``quantize_columns(W)`` stores W's transpose in q4.py's Q4_1 blocks: row i holds column i of W,
cut into out/32 blocks of 32 outputs. Then

    y = sum over active i of x_i * W[:, i]            (active: |x_i| > threshold)

reads only the rows of the active inputs: PowerInfer's CPU operator in AXPY form, at 0.625 bytes a weight. For the
down projection pjinfer.model already keeps one row per neuron (w_down_t), so the same layout is W_down^T's
rows quantized as they are.

These blocks are a different quantization of the same float weights than the GGUF's (its blocks run along the
input dimension); README.md gives the perplexity cost measured with every threshold at 0.

``axpy(blocks, idx, klo, khi, x, y, blo, bhi)`` sums the active entries idx[klo:khi] into output blocks [blo, bhi)
of y, so a team can split the active inputs (each thread streams whole rows into its own partial y; the caller
adds the partials) or the outputs. ``_axpy_intrinsic(k)`` is LLVM vector IR for k rows per pass over the y slice:
per block one 16-byte load, a mask and a shift for the two nibble halves, and two 16-lane FMAs per row.
"""
from __future__ import annotations

import numpy as np

from . import _threading  # noqa: F401  (sets NUMBA_THREADING_LAYER before numba is imported)

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import ffi, kernels, q4  # noqa: E402
from .kernels import _prefetch  # noqa: E402
from .q4 import BLOCK, BLOCK_BYTES  # noqa: E402

ffi.purge_stale_cache("q4_sparse", kernels, q4)

PREFETCH_AHEAD = 4  # active rows ahead whose slice is prefetched
_F0 = np.float32(0.0)
_JIT = dict(fastmath=True, cache=True, nogil=True)


def quantize_columns(w) -> np.ndarray:
    """float32 W [out, in] (out a multiple of 32) -> uint8 [in, out / 32 * 20]: row i is column i of W in Q4_1."""
    return q4.quantize(np.ascontiguousarray(np.asarray(w, np.float32).T))


def dequantize_columns(blocks: np.ndarray, out: int) -> np.ndarray:
    """What quantize_columns' blocks stand for, as W [out, in] float32."""
    return np.ascontiguousarray(q4.dequantize(blocks, out).T)


_f32, _i32, _i64, _i8 = ir.FloatType(), ir.IntType(32), ir.IntType(64), ir.IntType(8)
_v16f = ir.VectorType(_f32, 16)
_v16b = ir.VectorType(_i8, 16)


def _load(builder, addr, ty, align):
    return builder.load(builder.inttoptr(addr, ty.as_pointer()), align=align)


def _splat(builder, s):
    v = builder.insert_element(ir.Constant(_v16f, ir.Undefined), s, _i32(0))
    return builder.shuffle_vector(v, ir.Constant(_v16f, ir.Undefined), ir.Constant(ir.VectorType(_i32, 16), [0] * 16))


def _axpy_codegen(k):
    """Codegen of y[32 b + j] += sum over r < k of x_r * W_r[b, j] for b < nb; args (y, row_0..row_k-1, nb,
    x_0..x_k-1): integer addresses, float32 weights."""
    def codegen(context, builder, sig, args):
        y, rows, nb = args[0], args[1:1 + k], args[1 + k]
        xs = [context.cast(builder, a, t, types.float32) for a, t in zip(args[2 + k:], sig.args[2 + k:])]
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_v16f, [_v16f] * 3), "llvm.fma.v16f32")
        mask = ir.Constant(_v16b, [15] * 16)
        four = ir.Constant(_v16b, [4] * 16)
        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            ya = builder.add(y, builder.mul(b, _i64(4 * BLOCK)))
            yb = builder.add(ya, _i64(64))
            ylo = _load(builder, ya, _v16f, 4)
            yhi = _load(builder, yb, _v16f, 4)
            msum = ir.Constant(_f32, 0.0)
            for r, x in zip(rows, xs):
                p = builder.add(r, builder.mul(b, _i64(BLOCK_BYTES)))
                d = builder.fpext(_load(builder, p, ir.HalfType(), 1), _f32)
                m = builder.fpext(_load(builder, builder.add(p, _i64(2)), ir.HalfType(), 1), _f32)
                c = _load(builder, builder.add(p, _i64(4)), _v16b, 1)
                lo = builder.uitofp(builder.and_(c, mask), _v16f)
                hi = builder.uitofp(builder.lshr(c, four), _v16f)
                a = _splat(builder, builder.fmul(x, d))
                ylo = builder.call(fma, [lo, a, ylo])
                yhi = builder.call(fma, [hi, a, yhi])
                msum = builder.fadd(msum, builder.fmul(x, m))
            ms = _splat(builder, msum)
            builder.store(builder.fadd(ylo, ms), builder.inttoptr(ya, _v16f.as_pointer()), align=4)
            builder.store(builder.fadd(yhi, ms), builder.inttoptr(yb, _v16f.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


def _axpy_intrinsic(k):
    """The intrinsic _axpy{k}(y, r0..r{k-1}, nb, x0..x{k-1}) (named parameters: Numba intrinsics take no *args)."""
    names = ["y", *(f"r{i}" for i in range(k)), "nb", *(f"x{i}" for i in range(k))]
    src = (f"def _axpy{k}(typingctx, {', '.join(names)}):\n"
           f"    return _axpy_typer({k}, ({', '.join(names)},))\n")
    scope = {"_axpy_typer": _axpy_typer}
    exec(src, scope)
    return intrinsic(scope[f"_axpy{k}"])


def _axpy_typer(k, args):
    if not all(isinstance(a, types.Integer) for a in args[:2 + k]):
        return None
    if not all(isinstance(a, types.Float) for a in args[2 + k:]):
        return None
    return types.void(*([types.int64] * (2 + k) + [types.float32] * k)), _axpy_codegen(k)


_axpy1 = _axpy_intrinsic(1)


@njit(**_JIT)
def active(x, threshold, idx):
    """idx[:n] <- the i with |x[i]| > threshold, in order; returns n. A threshold of 0 keeps every non-zero."""
    n = 0
    for i in range(x.shape[0]):
        if abs(x[i]) > threshold:
            idx[n] = i
            n += 1
    return n


@njit(**_JIT)
def axpy(blocks, idx, klo, khi, x, y, blo, bhi):
    """y[32 blo : 32 bhi] = sum over k in [klo, khi) of x[idx[k]] * W[32 blo : 32 bhi, idx[k]], where blocks =
    quantize_columns(W) ([in, out / 32 * 20], rows contiguous). Every output of the range is written, also for an
    empty k range. idx entries must lie in [0, in); they are not checked.

    One row a pass, its whole slice in order (one memory stream, as q4.gemv), the rows PREFETCH_AHEAD entries
    ahead prefetched line by line. Measured on 90 x [3072, 576] (above the L3), one thread: one row a pass read
    about as fast per byte as q4.gemv; four or eight rows a pass (fewer loads and stores of y) 1.3-1.4x slower."""
    for j in range(BLOCK * blo, BLOCK * bhi):
        y[j] = _F0
    nb = bhi - blo
    if nb <= 0:
        return
    stride = blocks.strides[0]
    base = blocks.ctypes.data + blo * BLOCK_BYTES
    ya = y.ctypes.data + 4 * BLOCK * blo
    first, last = blo * BLOCK_BYTES, bhi * BLOCK_BYTES
    for k in range(klo, khi):
        if k + PREFETCH_AHEAD < khi:
            for j in range(first, last, 64):
                _prefetch(blocks, idx[k + PREFETCH_AHEAD], j)
        i = idx[k]
        _axpy1(ya, base + i * stride, nb, x[i])
