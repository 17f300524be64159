"""4-bit weights in the GGUF's own Q4_1 block layout, and the GEMV that reads them (``host_decode``'s layers).

A row of ``cols`` weights (a multiple of 32) is cols/32 blocks of 20 bytes, exactly as llama.cpp stores Q4_1:
float16 d, float16 m, then 16 bytes whose low nibbles are elements 0..15 and high nibbles elements 16..31;
element = d * q + m. That is 0.625 bytes a weight, against 1.0625 for int8 with a scale per 64.

``quantize`` follows llama.cpp's rule (m = the block's min, d = (max - min) / 15, q rounded). Every block of a
Q4_1 tensor therefore holds a q of 0 and a q of 15, and re-quantizing the float32 values the loader dequantized
gives back the file's bytes (tests/test_real_model.py checks it on the default model): for a Q4_1 GGUF the 4-bit
decode is the file's own model, not a further approximation.

The GEMV. Per block, with c = q_lo + 16 q_hi the stored byte and q_hi = floor(c / 16):

    q_lo . x_lo + q_hi . x_hi = c . x_lo + q_hi . (x_hi - 16 x_lo)

so a block is one byte-to-float conversion, a floor and two FMAs on 16 lanes, with no nibble masking
(``emit_rows_dot``; the conversion is shared when several inputs read the row, q4_gemm).
``prepare(x, xp)`` computes x_lo, x_hi - 16 x_lo and the block sums of x once per input vector, and
``gemv(q, xp, y, lo, hi)`` gives y[r] = sum over blocks of d (c . x_lo + q_hi . x2) + m sum(x_block).
``_row_dot`` is written as LLVM vector IR because Numba's autovectorizer turned the same loop into byte-by-byte
inserts (2.4 G weights/s on one thread here); the IR form streams 11-14 G weights/s (`/tmp` microbenchmark over
30 x [3072, 576], the int8 GEMV did 12.6 in the same run), at 0.6 the bytes.
"""
from __future__ import annotations

import numpy as np

from pjinfer.config import ConfigError

from . import _threading  # noqa: F401  (sets NUMBA_THREADING_LAYER before numba is imported)

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import ffi, kernels, vector_ir  # noqa: E402
from .vector_ir import F32, I64, V16F, V16I8, ZERO16, hsum, load, splat, strict, vector_intrinsic  # noqa: E402
from .qtensor import dequantize_q4_1  # noqa: E402
from .kernels import prefetch  # noqa: E402

ffi.purge_stale_cache("q4", kernels, vector_ir)  # prefetch is compiled into this module's cached functions

BLOCK = 32          # weights per block
BLOCK_BYTES = 20    # float16 d, float16 m, 16 bytes of nibbles
PREFETCH_ROWS = 8   # rows ahead to prefetch (8 measured 13.9 G weights/s on one thread, 16: 12.4, 32: 12.1)

_F0 = np.float32(0.0)
_SIXTEEN = np.float32(16.0)
_JIT = dict(fastmath=True, cache=True, nogil=True)


# ---------------------------------------------------------------------------------------------------------------
# numpy side: quantize, dequantize (the reference the kernel is tested against).

@njit(**_JIT)
def row_bytes(cols):
    """Bytes of a row of cols weights."""
    return cols // BLOCK * BLOCK_BYTES


def quantize(w) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 32) -> uint8 [rows, cols / 32 * 20] Q4_1 blocks."""
    w = np.ascontiguousarray(w, np.float32)
    rows, cols = w.shape
    if cols % BLOCK:
        raise ConfigError(f"Q4_1 rows need a multiple of {BLOCK} elements, got {cols}")
    b = w.reshape(rows, cols // BLOCK, BLOCK)
    lo, hi = b.min(-1), b.max(-1)
    d = ((hi - lo) / 15).astype(np.float16)
    m = lo.astype(np.float16)
    step = d.astype(np.float32)
    inv = np.divide(1, step, out=np.zeros_like(step), where=step != 0)
    q = np.clip(np.rint((b - m.astype(np.float32)[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    out = np.empty((rows, cols // BLOCK, BLOCK_BYTES), np.uint8)
    out[..., 0:2] = d.view(np.uint8).reshape(rows, -1, 2)
    out[..., 2:4] = m.view(np.uint8).reshape(rows, -1, 2)
    out[..., 4:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(rows, -1)


def dequantize(blocks: np.ndarray, cols: int) -> np.ndarray:
    """uint8 [rows, cols / 32 * 20] -> float32 [rows, cols] (``qtensor.dequantize_q4_1``)."""
    return dequantize_q4_1(blocks, cols)


@njit(**_JIT)
def prepared_size(cols):
    """float32 elements ``prepare`` writes for an input of ``cols``: x_lo, x_hi - 16 x_lo, block sums."""
    return cols + cols // BLOCK


# ---------------------------------------------------------------------------------------------------------------
# The kernel.



def emit_rows_dot(builder, row, nb, xls, x2s, xss):
    """LLVM IR for the dots of one Q4_1 row (nb blocks at address row) with len(xls) prepared inputs (addresses of
    each one's x_lo, x2 and block sums); returns the float32 results. The single-token GEMV (``_row_dot``) and the
    batched one (``q4_gemm``) both emit this, so a token's result is the same in both.

    Per block, shared by the tokens: the byte-to-float conversion c, q_hi and the broadcast d; per token: the block
    dot as c x_lo + q_hi x2 (a multiply and an FMA), one FMA of d into the accumulator, m times the block sum into
    a scalar chain; finally one horizontal sum per token. (Multiplying d into c and q_hi once per block and
    keeping two accumulators per token measured no faster batched, and 1.5x slower with 8 tokens: spills.)"""
    floor = vector_intrinsic(builder, "llvm.floor", 1)
    fma = vector_intrinsic(builder, "llvm.fma", 3)
    acc = [cgutils.alloca_once_value(builder, ZERO16) for _ in xls]             # sum of d * block dot
    macc = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in xls]  # sum of m * block sum
    sixteenth = ir.Constant(V16F, [1.0 / 16] * 16)
    with cgutils.for_range(builder, nb) as loop:
        b = loop.index
        p = builder.add(row, builder.mul(b, I64(BLOCK_BYTES)))
        d = builder.fpext(load(builder, p, ir.HalfType(), 1), F32)
        m = builder.fpext(load(builder, builder.add(p, I64(2)), ir.HalfType(), 1), F32)
        c = builder.uitofp(load(builder, builder.add(p, I64(4)), V16I8, 1), V16F)
        q_hi = builder.call(floor, [strict(builder.fmul(c, sixteenth))])
        d16 = splat(builder, d)
        off = builder.mul(b, I64(64))  # 16 floats of x_lo / x2 per block
        for t in range(len(xls)):
            dot = builder.call(fma, [q_hi, load(builder, builder.add(x2s[t], off), V16F, 4),
                                     strict(builder.fmul(c, load(builder, builder.add(xls[t], off), V16F, 4)))])
            builder.store(builder.call(fma, [dot, d16, builder.load(acc[t])]), acc[t])
            s = load(builder, builder.add(xss[t], builder.mul(b, I64(4))), F32, 4)
            builder.store(strict(builder.fadd(strict(builder.fmul(m, s)), builder.load(macc[t]))), macc[t])
    return [strict(builder.fadd(hsum(builder, builder.load(acc[t])), builder.load(macc[t]))) for t in range(len(xls))]


@intrinsic
def _row_dot(typingctx, row, nb, xl, x2, xs):
    """float32 dot of one Q4_1 row (nb blocks at address row) with a prepared input (addresses of x_lo, x2 and
    the block sums). Integer addresses, no bounds checks: the caller owns the shapes."""
    if not all(isinstance(a, types.Integer) for a in (row, nb, xl, x2, xs)):
        return None

    def codegen(context, builder, sig, args):
        row, nb, xl, x2, xs = args
        return emit_rows_dot(builder, row, nb, [xl], [x2], [xs])[0]
    return types.float32(types.int64, types.int64, types.int64, types.int64, types.int64), codegen


@njit(fastmath=False, cache=True, nogil=True)
def prepare(x, xp):
    """xp[:cols] <- x_lo and x_hi - 16 x_lo per block (16 + 16 floats), xp[cols:cols + cols/32] <- block sums.
    Without fastmath, so each block sum is added in one order wherever this is compiled (see ``strict``)."""
    cols = x.shape[0]
    half = cols // 2
    for b in range(cols // BLOCK):
        total = _F0
        for j in range(16):
            lo = x[b * BLOCK + j]
            hi = x[b * BLOCK + 16 + j]
            xp[b * 16 + j] = lo
            xp[half + b * 16 + j] = hi - _SIXTEEN * lo
            total += lo + hi
        xp[cols + b] = total


@njit(**_JIT)
def gemv(q, xp, y, lo, hi):
    """y[r] = row r of the Q4_1 matrix q [rows, row_bytes(cols)] dotted with x, for r in [lo, hi); xp =
    prepare(x). Each row's bytes must be contiguous (quantize's are). Rows PREFETCH_ROWS ahead are prefetched
    line by line."""
    nb = q.shape[1] // BLOCK_BYTES
    cols = nb * BLOCK
    base = xp.ctypes.data
    xl, x2, xs = base, base + 4 * (cols // 2), base + 4 * cols
    rows = q.ctypes.data
    for r in range(lo, hi):
        if r + PREFETCH_ROWS < hi:
            for j in range(0, q.shape[1], 64):
                prefetch(q, r + PREFETCH_ROWS, j)
        y[r] = _row_dot(rows + r * q.strides[0], nb, xl, x2, xs)
