"""Many tokens against one weight read: the GEMMs of ``batched_decode`` ([rows, cols] x [cols, B], B small).

``gemm(q, xp, y, nt, lo, hi)`` is the Q4_1 form: y[t, r] = row r of the Q4_1 matrix q dotted with token t's input,
for t < nt and r in [lo, hi), xp[t] = ``q4.prepare`` of token t's input. Each row's blocks are loaded from memory
once and their bytes converted to floats once (c and q_hi of ``q4``'s identity) for up to GROUP tokens; every
token then takes exactly the float operations ``q4.gemv`` takes for it alone (both are ``q4.emit_rows_dot``), so a
token's result is the single-token GEMV's bit for bit (tests/test_batched_decode.py checks it on random rows). A
batch wider than GROUP re-reads the row from L1 for the next group.

``gemm_int8(w, s, x, y, y_rows, nt, lo, hi)`` is the int8 form (the output head, and layers with ``--weights int8``): it
walks the rows in tiles of TILE rows and runs ``int8.gemv`` over the tile for each token in turn, so the tile is
read from memory once and from cache nt - 1 times, and every token's result is the single-token GEMV's bit for bit
(each row's dot is the same IR in a fixed order, ``vector_ir``).
"""
from __future__ import annotations

from . import _threading  # noqa: F401  (sets NUMBA_THREADING_LAYER before numba is imported)

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import ffi, int8, kernels, q4, vector_ir  # noqa: E402
from .kernels import prefetch  # noqa: E402
from .q4 import BLOCK, BLOCK_BYTES, PREFETCH_ROWS  # noqa: E402

ffi.purge_stale_cache("q4_gemm", kernels, int8, q4, ffi, vector_ir)

GROUP = 8     # tokens per pass over a row: 8 accumulators of 16 floats (AVX-512 has 32 vector registers)
TILE = 16     # int8 rows per tile: 16 x 576 bytes sit in L1

_f32, _i32, _i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)


def _make_rows_dot(nt: int):
    """The intrinsic dot of one Q4_1 row (nb blocks at address row) with nt prepared inputs: token t's prepared
    input starts at xp + t * xp_stride bytes (x_lo, then x2 at + 2 cols bytes, block sums at + 4 cols bytes), its
    result is stored at y + t * y_stride bytes. Integer addresses, no bounds checks: the caller owns the shapes."""

    @intrinsic
    def rows_dot(typingctx, row, nb, xp, xp_stride, y, y_stride):
        if not all(isinstance(a, types.Integer) for a in (row, nb, xp, xp_stride, y, y_stride)):
            return None

        def codegen(context, builder, sig, args):
            row, nb, xp, xp_stride, y, y_stride = args
            cols4 = builder.mul(nb, _i64(4 * BLOCK))            # bytes of cols floats
            xls = [builder.add(xp, builder.mul(xp_stride, _i64(t))) for t in range(nt)]
            x2s = [builder.add(a, builder.udiv(cols4, _i64(2))) for a in xls]
            xss = [builder.add(a, cols4) for a in xls]
            for t, total in enumerate(q4.emit_rows_dot(builder, row, nb, xls, x2s, xss)):
                addr = builder.add(y, builder.mul(y_stride, _i64(t)))
                builder.store(total, builder.inttoptr(addr, _f32.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64), codegen
    return rows_dot


_dot1, _dot2, _dot3, _dot4, _dot5, _dot6, _dot7, _dot8 = (_make_rows_dot(n) for n in range(1, GROUP + 1))


@njit(nogil=True, cache=True)
def _rows_dot(k, row, nb, xp, xp_stride, y, y_stride):
    """k (1..GROUP) tokens against one row."""
    if k == 8:
        _dot8(row, nb, xp, xp_stride, y, y_stride)
    elif k == 7:
        _dot7(row, nb, xp, xp_stride, y, y_stride)
    elif k == 6:
        _dot6(row, nb, xp, xp_stride, y, y_stride)
    elif k == 5:
        _dot5(row, nb, xp, xp_stride, y, y_stride)
    elif k == 4:
        _dot4(row, nb, xp, xp_stride, y, y_stride)
    elif k == 3:
        _dot3(row, nb, xp, xp_stride, y, y_stride)
    elif k == 2:
        _dot2(row, nb, xp, xp_stride, y, y_stride)
    elif k == 1:
        _dot1(row, nb, xp, xp_stride, y, y_stride)


@njit(fastmath=True, cache=True, nogil=True)
def gemm(q, xp, y, nt, lo, hi):
    """y[t, r] = row r of q (uint8 [rows, q4.row_bytes(cols)], rows contiguous) dotted with token t's input, for
    t < nt, r in [lo, hi); xp float32 [>= nt, >= q4.prepared_size(cols)] rows of q4.prepare; y float32
    [>= nt, >= hi]. Rows PREFETCH_ROWS ahead are prefetched line by line, as q4.gemv does."""
    if nt == 1:       # the single-token GEMV itself (the same emitter): faster than the group dispatch below
        q4.gemv(q, xp[0], y[0], lo, hi)
        return
    nb = q.shape[1] // BLOCK_BYTES
    rows = q.ctypes.data
    xs, ys = xp.strides[0], y.strides[0]
    for r in range(lo, hi):
        if r + PREFETCH_ROWS < hi:
            for j in range(0, q.shape[1], 64):
                prefetch(q, r + PREFETCH_ROWS, j)
        for g in range(0, nt, GROUP):
            _rows_dot(min(GROUP, nt - g), rows + r * q.strides[0], nb, xp.ctypes.data + g * xs, xs,
                      y.ctypes.data + g * ys + 4 * r, ys)


@njit(fastmath=True, cache=True, nogil=True)
def gemm_int8(w, s, x, y, y_rows, nt, lo, hi):
    """y[y_rows[t], r] = int8.gemv's y[r] for input x[t], t < nt, r in [lo, hi) (int8 w [rows, cols], s
    float32 [rows, cols / 64], y_rows int64 [>= nt]); lo a multiple of 4, as host_decode's thread shares are."""
    for a in range(lo, hi, TILE):
        b = min(hi, a + TILE)
        for ahead in range(b, min(hi, b + TILE)):   # the next tile, while this one runs nt times from cache
            for j in range(0, w.shape[1], 64):
                prefetch(w, ahead, j)
        for t in range(nt):
            int8.gemv(w, s, x[t], y[y_rows[t]], a, b)
