"""int8 rows with a float32 scale per block of 64 inputs (blocks.py's int8 type): the quantizer, and the GEMV that
reads them: an output head that its host format (blocks.FORMATS) does not keep in the file's blocks, every layer
matrix with ``--weights int8``, and the cold rows of bridge.ColdFFN with int8 weights.

``quantize(w)``: float32 [rows, cols] -> (int8 [rows, cols], float32 [rows, ceil(cols / 64)]), symmetric, each
block's largest magnitude mapped to 127 (a last block shorter than 64 where cols is not a multiple). Blocks, not
whole rows: the default Q4_1 model's rows mix blocks of very different ranges; with the default bundle's cold rows
quantized, one scale per row cost 1.6-1.9% perplexity, one per block of 64 cost 0.1%. ``from_blocks`` makes the
same bytes from a GGUF matrix without its float32 copy.

``gemv(w, s, x, y, lo, hi)`` (and ``gemm``, the same for several inputs): y[r] = sum over blocks b of s[r, b] *
(sum over j in b of w[r, j] x[j]), for r in [lo, hi). It is vector IR (``emit_rows_dot``) whose float operations
keep one order in every caller (``vector_ir.strict``), so the single-token head, the batched head (``gemm``) and
the input-sparse decoder's head compute the same bits for a row. Per block of 64: four 16-lane FMAs of the
converted weights with x into the block's sum, one FMA of that sum with the broadcast scale into the row's
accumulator; one horizontal sum per row at the end. Four rows share each pass over x, and the rows PREFETCH_ROWS
ahead are prefetched line by line.
"""
from __future__ import annotations

from ._numba import JIT  # (first: the threading layer and the BLAS check, before numba is imported)

import numpy as np  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import blocks, ffi, kernels, vector_ir  # noqa: E402
from .kernels import QBLOCK, ahead_into_l2, prefetch_lines  # noqa: E402
from .qtensor import QTensor, aligned_empty  # noqa: E402
from .vector_ir import F32, I64, V16F, V16I8, ZERO16, hsum, load, splat, vector_intrinsic  # noqa: E402

ffi.purge_stale_cache("int8", kernels, vector_ir)

PREFETCH_ROWS = 16   # rows ahead (one thread streams much faster from DRAM with it than with none)
ROWS = 4             # rows per pass over x
GEMM_TOKENS = 8      # tokens per pass over a row in gemm (8 accumulators of 16 floats)
FROM_BLOCKS_ROWS = 1024   # rows from_blocks dequantizes at a time
_F0, _ONE = np.float32(0.0), np.float32(1.0)


@njit(parallel=True, cache=True, nogil=True)
def _quantize(w, q, s):
    """quantize's bytes into q and s, row by row on every thread. No fastmath: the division and the rounding are
    IEEE float32's, as numpy's."""
    cols = w.shape[1]
    for r in prange(w.shape[0]):
        for b in range(s.shape[1]):
            end = min(cols, (b + 1) * QBLOCK)
            peak = _F0
            for j in range(b * QBLOCK, end):
                peak = max(peak, abs(w[r, j]))
            scale = peak / np.float32(127.0) if peak > _F0 else _ONE
            s[r, b] = scale
            for j in range(b * QBLOCK, end):
                q[r, j] = np.int8(min(max(np.rint(w[r, j] / scale), np.float32(-127.0)), np.float32(127.0)))


def quantize(w) -> tuple[np.ndarray, np.ndarray]:
    """float32 [rows, cols] -> (int8 [rows, cols], float32 scales [rows, ceil(cols / 64)]), see the module
    docstring; both C-contiguous and XLA-aligned (qtensor.aligned_empty)."""
    w = np.ascontiguousarray(w, np.float32)
    q = aligned_empty(w.shape, np.int8)
    s = aligned_empty((w.shape[0], -(-w.shape[1] // QBLOCK)), np.float32)
    _quantize(w, q, s)
    return q, s


def from_blocks(code: int, data, cols: int) -> QTensor:
    """A GGUF matrix (uint8 [rows, row bytes] in the block type of code) as int8: quantize's bytes for its float32
    values, FROM_BLOCKS_ROWS rows at a time (no float32 copy of the matrix)."""
    t = blocks.block_type(code)
    rows = data.shape[0]
    q = aligned_empty((rows, cols), np.int8)
    s = aligned_empty((rows, -(-cols // QBLOCK)), np.float32)
    for lo in range(0, rows, FROM_BLOCKS_ROWS):
        hi = min(rows, lo + FROM_BLOCKS_ROWS)
        _quantize(t.dequantize((np.asarray(data[lo:hi]),), cols), q[lo:hi], s[lo:hi])
    return QTensor(blocks.INT8, (q, s), cols)


def emit_rows_dot(builder, ws, ss, nb, xs):
    """LLVM IR for the dots of len(ws) int8 rows (their weights at addresses ws, their float32 scales at ss) with
    each of the float32 inputs at addresses xs, nb blocks of 64; returns the float32 results, [row][input]. A
    row's weights are converted to floats once for all the inputs; every (row, input) pair takes the same float
    operations in the same order whatever the other rows and inputs are, so gemv (4 rows, 1 input) and the
    batched head (1 row, several inputs, gemm) give the same bits."""
    fma = vector_intrinsic(builder, "llvm.fma", 3)
    acc = [[cgutils.alloca_once_value(builder, ZERO16) for _ in xs] for _ in ws]
    with cgutils.for_range(builder, nb) as loop:
        b = loop.index
        base = builder.mul(b, I64(QBLOCK))
        for i, w in enumerate(ws):
            wvs = [builder.sitofp(load(builder, builder.add(w, builder.add(base, I64(16 * c))), V16I8, 1), V16F)
                   for c in range(QBLOCK // 16)]
            scale = splat(builder, load(builder, builder.add(ss[i], builder.mul(b, I64(4))), F32, 4))
            for t, x in enumerate(xs):
                block = ZERO16
                for c, wv in enumerate(wvs):
                    xv = load(builder, builder.add(x, builder.mul(builder.add(base, I64(16 * c)), I64(4))), V16F, 4)
                    block = builder.call(fma, [wv, xv, block])
                builder.store(builder.call(fma, [block, scale, builder.load(acc[i][t])]), acc[i][t])
    return [[hsum(builder, builder.load(a)) for a in row] for row in acc]


@intrinsic
def _rows_dot(typingctx, w, w_stride, s, s_stride, nb, x, y, n):
    """y[i] = row i's dot for i < n (a literal 1 or ROWS): rows at w + i w_stride, scales at s + i s_stride."""
    if not (all(isinstance(a, types.Integer) for a in (w, w_stride, s, s_stride, nb, x, y))
            and isinstance(n, types.IntegerLiteral)):
        return None
    count = n.literal_value

    def codegen(context, builder, sig, args):
        w, w_stride, s, s_stride, nb, x, y, _ = args
        ws = [builder.add(w, builder.mul(w_stride, I64(i))) for i in range(count)]
        ss = [builder.add(s, builder.mul(s_stride, I64(i))) for i in range(count)]
        for i, (total,) in enumerate(emit_rows_dot(builder, ws, ss, nb, [x])):
            builder.store(total, builder.inttoptr(builder.add(y, I64(4 * i)), F32.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(w, w_stride, s, s_stride, nb, x, y, n), codegen


@njit(**JIT)
def gemv(w, s, x, y, lo, hi):
    """y[r] = row r of (w, s) dotted with x for r in [lo, hi): w int8 [rows, cols], s float32 [rows, cols / 64],
    x float32 [cols], y float32 [>= hi], cols a multiple of 64; rows of w, s and x, y contiguous."""
    nb = x.shape[0] // QBLOCK
    ws, ss = w.strides[0], s.strides[0]
    r = lo
    into_l2 = ahead_into_l2(4 * x.shape[0], w.shape[1], PREFETCH_ROWS)
    while r + ROWS <= hi:
        if r + PREFETCH_ROWS + ROWS <= hi:
            for ahead in range(r + PREFETCH_ROWS, r + PREFETCH_ROWS + ROWS):
                prefetch_lines(w, ahead, into_l2)
        _rows_dot(w.ctypes.data + r * ws, ws, s.ctypes.data + r * ss, ss, nb, x.ctypes.data, y.ctypes.data + 4 * r, 4)
        r += ROWS
    while r < hi:
        _rows_dot(w.ctypes.data + r * ws, ws, s.ctypes.data + r * ss, ss, nb, x.ctypes.data, y.ctypes.data + 4 * r, 1)
        r += 1


@intrinsic
def _int8_dot(typingctx, k, w, s, nb, x, x_stride, y, y_stride, y_rows):
    """The dots of one int8 row (weights at w, nb blocks of 64, float32 scales at s) with k (1..GEMM_TOKENS) float32
    inputs: token t's input at x + t * x_stride bytes, its result stored at y + y_rows[t] * y_stride bytes
    (y_rows: the address of int64s)."""
    if not all(isinstance(a, types.Integer) for a in (k, w, s, nb, x, x_stride, y, y_stride, y_rows)):
        return None

    def codegen(context, builder, sig, args):
        k, w, s, nb, x, x_stride, y, y_stride, y_rows = args

        def emit(n):
            xs = [builder.add(x, builder.mul(x_stride, I64(t))) for t in range(n)]
            for t, total in enumerate(emit_rows_dot(builder, [w], [s], nb, xs)[0]):
                out = vector_ir.load(builder, builder.add(y_rows, I64(8 * t)), I64, 8)
                addr = builder.add(y, builder.mul(y_stride, out))
                builder.store(total, builder.inttoptr(addr, F32.as_pointer()), align=4)
        vector_ir.by_value(builder, k, range(1, GEMM_TOKENS + 1), emit)
        return context.get_dummy_value()
    return types.void(*[types.int64] * 9), codegen


@njit(**JIT)
def gemm(w, s, x, y, y_rows, nt, lo, hi):
    """The batched decode's int8 GEMM (the output head, and layers with ``--weights int8``): y[y_rows[t], r] = gemv's
    y[r] for input x[t], bit for bit, t < nt, r in [lo, hi) (int8 w [rows, cols], s float32 [rows, cols / 64],
    y_rows int64 [>= nt], contiguous; rows of w, s, x and y contiguous). Each row's weights are loaded and converted
    once for up to GEMM_TOKENS tokens; rows PREFETCH_ROWS ahead are prefetched line by line, as gemv does."""
    nb = x.shape[1] // QBLOCK
    xs, ys = x.strides[0], y.strides[0]
    into_l2 = ahead_into_l2(4 * min(nt, GEMM_TOKENS) * x.shape[1], w.shape[1], PREFETCH_ROWS)
    for r in range(lo, hi):
        if r + PREFETCH_ROWS < hi:
            prefetch_lines(w, r + PREFETCH_ROWS, into_l2)
        for g in range(0, nt, GEMM_TOKENS):
            _int8_dot(min(GEMM_TOKENS, nt - g), w.ctypes.data + r * w.strides[0], s.ctypes.data + r * s.strides[0], nb,
                      x.ctypes.data + g * xs, xs, y.ctypes.data + 4 * r, ys, y_rows.ctypes.data + 8 * g)
