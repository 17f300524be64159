"""Many tokens against one weight read: the GEMMs of ``batched_decode`` ([rows, cols] x [cols, B], B small).

``gemm(q, x, y, nt, lo, hi)`` is the Q4_1 form: y[t, r] = row r of the Q4_1 matrix q dotted with token t's input
x[t], for t < nt and r in [lo, hi). Each row's blocks are loaded from memory and dequantized in registers once for
up to GROUP tokens; every token then takes exactly the float operations ``q4.gemv`` takes for it alone (both are
``q4.emit_rows_dot``), so a token's result is the single-token GEMV's bit for bit (tests/test_batched_decode.py
checks it on random rows). A batch wider than GROUP re-reads the row from L1 for the next group.

``gemm_int8(w, s, x, y, y_rows, nt, lo, hi)`` is the int8 form (the output head, and layers with ``--weights int8``):
row by row, each row's weights are loaded and converted to floats once for up to GROUP tokens, and every token's
result is the single-token ``int8.gemv``'s bit for bit (both are ``int8.emit_rows_dot``).
"""
from __future__ import annotations

from . import _numba  # noqa: F401  (the threading layer and the BLAS check, before numba is imported)

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import ffi, int8, kernels, q4, vector_ir  # noqa: E402
from .kernels import ahead_into_l2, prefetch_lines  # noqa: E402
from .q4 import BLOCK_BYTES, PREFETCH_ROWS  # noqa: E402

ffi.purge_stale_cache("q4_gemm", kernels, int8, q4, ffi, vector_ir)

GROUP = 8     # tokens per pass over a row: 8 (Q4_1: 16) accumulators of 16 floats (AVX-512 has 32 registers)

_f32, _i32, _i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)


@intrinsic
def _rows_dot(typingctx, k, row, nb, x, x_stride, y, y_stride):
    """The dots of one Q4_1 row (nb blocks at address row) with k (1..GROUP) float32 inputs: token t's input
    starts at x + t * x_stride bytes, its result is stored at y + t * y_stride bytes. Integer addresses, no
    bounds checks: the caller owns the shapes."""
    if not all(isinstance(a, types.Integer) for a in (k, row, nb, x, x_stride, y, y_stride)):
        return None

    def codegen(context, builder, sig, args):
        k, row, nb, x, x_stride, y, y_stride = args

        def emit(n):
            xs = [builder.add(x, builder.mul(x_stride, _i64(t))) for t in range(n)]
            for t, total in enumerate(q4.emit_rows_dot(builder, row, nb, xs)):
                addr = builder.add(y, builder.mul(y_stride, _i64(t)))
                builder.store(total, builder.inttoptr(addr, _f32.as_pointer()), align=4)
        vector_ir.by_count(builder, k, range(1, GROUP + 1), emit)
        return context.get_dummy_value()
    return types.void(*[types.int64] * 7), codegen


@njit(fastmath=True, cache=True, nogil=True)
def gemm(q, x, y, nt, lo, hi):
    """y[t, r] = row r of q (uint8 [rows, q4.row_bytes(cols)], rows contiguous) dotted with x[t], for t < nt, r in
    [lo, hi); x float32 [>= nt, >= cols], rows contiguous; y float32 [>= nt, >= hi]. Rows PREFETCH_ROWS ahead are
    prefetched line by line, as q4.gemv does."""
    if nt == 1:       # the single-token GEMV itself (the same emitter): faster than the group dispatch below
        q4.gemv(q, x[0], y[0], lo, hi)
        return
    nb = q.shape[1] // BLOCK_BYTES
    rows = q.ctypes.data
    xs, ys = x.strides[0], y.strides[0]
    into_l2 = ahead_into_l2(4 * min(nt, GROUP) * x.shape[1], q.shape[1], PREFETCH_ROWS)
    for r in range(lo, hi):
        if r + PREFETCH_ROWS < hi:
            prefetch_lines(q, r + PREFETCH_ROWS, into_l2)
        for g in range(0, nt, GROUP):
            _rows_dot(min(GROUP, nt - g), rows + r * q.strides[0], nb, x.ctypes.data + g * xs, xs,
                      y.ctypes.data + g * ys + 4 * r, ys)


@intrinsic
def _int8_dot(typingctx, k, w, s, nb, x, x_stride, y, y_stride, y_rows):
    """The dots of one int8 row (weights at w, nb blocks of 64, float32 scales at s) with k (1..GROUP) float32
    inputs: token t's input at x + t * x_stride bytes, its result stored at y + y_rows[t] * y_stride bytes
    (y_rows: the address of int64s)."""
    if not all(isinstance(a, types.Integer) for a in (k, w, s, nb, x, x_stride, y, y_stride, y_rows)):
        return None

    def codegen(context, builder, sig, args):
        k, w, s, nb, x, x_stride, y, y_stride, y_rows = args

        def emit(n):
            xs = [builder.add(x, builder.mul(x_stride, _i64(t))) for t in range(n)]
            for t, total in enumerate(int8.emit_rows_dot(builder, [w], [s], nb, xs)[0]):
                out = vector_ir.load(builder, builder.add(y_rows, _i64(8 * t)), _i64, 8)
                addr = builder.add(y, builder.mul(y_stride, out))
                builder.store(total, builder.inttoptr(addr, _f32.as_pointer()), align=4)
        vector_ir.by_count(builder, k, range(1, GROUP + 1), emit)
        return context.get_dummy_value()
    return types.void(*[types.int64] * 9), codegen


@njit(fastmath=True, cache=True, nogil=True)
def gemm_int8(w, s, x, y, y_rows, nt, lo, hi):
    """y[y_rows[t], r] = int8.gemv's y[r] for input x[t], t < nt, r in [lo, hi) (int8 w [rows, cols], s
    float32 [rows, cols / 64], y_rows int64 [>= nt], contiguous; rows of w, s, x and y contiguous). Rows
    int8.PREFETCH_ROWS ahead are prefetched line by line, as int8.gemv does."""
    nb = x.shape[1] // kernels.QBLOCK
    xs, ys = x.strides[0], y.strides[0]
    into_l2 = ahead_into_l2(4 * min(nt, GROUP) * x.shape[1], w.shape[1], int8.PREFETCH_ROWS)
    for r in range(lo, hi):
        if r + int8.PREFETCH_ROWS < hi:
            prefetch_lines(w, r + int8.PREFETCH_ROWS, into_l2)
        for g in range(0, nt, GROUP):
            _int8_dot(min(GROUP, nt - g), w.ctypes.data + r * w.strides[0], s.ctypes.data + r * s.strides[0], nb,
                      x.ctypes.data + g * xs, xs, y.ctypes.data + 4 * r, ys, y_rows.ctypes.data + 8 * g)
