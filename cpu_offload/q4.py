"""The GEMV of Q4_1 (and Q4_0) rows in the GGUF's own blocks against a float32 input: the PowerInfer predicted
decode's (``quants.gemv`` without ``rounded``, and ``quants.row_dot``), whose neuron decisions its tests hold to XLA's
float32 model. The dense host decode and its batched GEMM read these rows against a rounded input instead
(``q8_dot.py``: integer dots, about 1.5x the GB/s a thread).

A row of ``cols`` weights (a multiple of 32) is cols/32 blocks of 20 bytes, exactly as llama.cpp stores Q4_1
(``blocks.py`` has the layout, the dequantizer and the quantizer): float16 d, float16 m, then 16 bytes whose low
nibbles are elements 0..15 and high nibbles elements 16..31; element = d * q + m. Q4_0's blocks are 18 bytes, d
and the nibbles, element = d (q - 8).

The GEMV dequantizes in registers and takes the dot in float32. Per block: the block's weights w = d q + m, 16
floats for elements 0..15 (w_lo) and 16 for 16..31 (w_hi) (``emit_weights``: on AVX-512 the 16 values d i + m
are made by one FMA and each half picks its weights from them by a vpermps on its nibbles; on AVX2 each nibble is
converted to float and takes its FMA); two FMAs of those weights with the input's two halves of the block, into
two accumulators; one horizontal sum at the end (``emit_row_dot``). Every weight is its dequantized value, so the
dot does not cancel large terms. The row dot is written as LLVM vector IR because Numba's autovectorizer turned
the same loop into byte-by-byte inserts. ``emit_nibbles`` and ``pick`` are shared with q4_sparse.py and
quants.py.
"""
from __future__ import annotations

from ._numba import JIT  # (first: the threading layer and the BLAS check, before numba is imported)

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import blocks, ffi, kernels, vector_ir  # noqa: E402
from .vector_ir import (F32, I64, V16F, V16I8, V16I32, ZERO16, by_value, half_splat, hsum, ints, load,  # noqa: E402
                        strict, vector_intrinsic)
from .kernels import ahead_into_l2, prefetch_lines  # noqa: E402

ffi.purge_stale_cache("q4", kernels, vector_ir, blocks)  # prefetch is compiled into this module's cached functions

BLOCK, BLOCK_BYTES = blocks.TYPES[blocks.Q4_1].block, blocks.TYPES[blocks.Q4_1].nbytes
# The two 4-bit block types this GEMV reads: where their 16 nibble bytes start. Q4_1 stores its m after d; Q4_0's
# elements are d (q - 8), so its m is -8 d.
NIBBLES_AT = {blocks.Q4_0: 2, blocks.Q4_1: 4}
KINDS = tuple(NIBBLES_AT)
Q4_0_BYTES = blocks.TYPES[blocks.Q4_0].nbytes
PREFETCH_ROWS = 8   # rows ahead to prefetch (8 beat 16 and 32 on one thread: docs/performance.md)



PERMUTE = vector_ir.cpu_has("avx512f")   # AVX-512F's vpermps picks 16 floats by 4-bit index


def emit_nibbles(builder, addr, permute=PERMUTE):
    """IR: the 16 bytes at addr as (low nibbles, high nibbles), 16 float32 each (exact small integers). With
    AVX-512, the low nibbles are a vpermps of the floats 0..15 by each byte (it reads an index's low 4 bits)."""
    z = builder.zext(load(builder, addr, V16I8, 1), V16I32)
    hi = builder.sitofp(builder.lshr(z, ints(4)), V16F)
    if permute:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F, V16I32]),
                                            "llvm.x86.avx512.permvar.sf.512")
        return builder.call(fn, [ir.Constant(V16F, [float(v) for v in range(16)]), z]), hi
    return builder.sitofp(builder.and_(z, ints(15)), V16F), hi


_IOTA = ir.Constant(V16F, [float(v) for v in range(16)])


def emit_weights(builder, d, m, addr, permute=PERMUTE):
    """IR: a block's 32 weights fma(d, q, m) (d, m: 16-lane splats; q: the nibbles of the 16 bytes at addr) as
    (elements 0..15, elements 16..31). With AVX-512 the 16 possible weights fma(d, 0..15, m) are made once and
    each half is a vpermps of them by its nibbles: the same values as converting every nibble and taking its FMA,
    in fewer operations."""
    if not permute:
        fma = vector_intrinsic(builder, "llvm.fma", 3)
        q_lo, q_hi = emit_nibbles(builder, addr, permute)
        return builder.call(fma, [d, q_lo, m]), builder.call(fma, [d, q_hi, m])
    z = builder.zext(load(builder, addr, V16I8, 1), V16I32)
    return pick(builder, d, m, z), pick(builder, d, m, builder.lshr(z, ints(4)))


def pick(builder, d, m, codes):
    """IR, AVX-512 only: fma(d, codes, m) for 4-bit codes (<16 x i32>; d, m: 16-lane splats), the 16 possible
    values made by one FMA and each lane picking its own by a vpermps. Calls with the same d and m make the values
    once (LLVM merges the identical FMAs)."""
    values = builder.call(vector_intrinsic(builder, "llvm.fma", 3), [d, _IOTA, m])
    permvar = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F, V16I32]),
                                             "llvm.x86.avx512.permvar.sf.512")
    return builder.call(permvar, [values, codes])


def emit_row_dot(builder, row, nb, x, kind=blocks.Q4_1):
    """LLVM IR for the dot of one Q4_1 row (or Q4_0: kind) of nb blocks at address row with the float32 input at
    address x; returns the float32 result."""
    fma = vector_intrinsic(builder, "llvm.fma", 3)
    acc_lo = cgutils.alloca_once_value(builder, ZERO16)   # elements 0..15 of every block
    acc_hi = cgutils.alloca_once_value(builder, ZERO16)   # elements 16..31
    with cgutils.for_range(builder, nb) as loop:
        b = loop.index
        p = builder.add(row, builder.mul(b, I64(blocks.TYPES[kind].nbytes)))
        d = half_splat(builder, p)
        m = half_splat(builder, builder.add(p, I64(2))) if kind == blocks.Q4_1 \
            else builder.fmul(d, ir.Constant(V16F, [-8.0] * 16))
        w_lo, w_hi = emit_weights(builder, d, m, builder.add(p, I64(NIBBLES_AT[kind])))
        at = builder.add(x, builder.mul(b, I64(4 * BLOCK)))   # the block's 32 input floats
        builder.store(builder.call(fma, [w_lo, load(builder, at, V16F, 4), builder.load(acc_lo)]), acc_lo)
        builder.store(builder.call(fma, [w_hi, load(builder, builder.add(at, I64(64)), V16F, 4),
                                         builder.load(acc_hi)]), acc_hi)
    return hsum(builder, strict(builder.fadd(builder.load(acc_lo), builder.load(acc_hi))))


@intrinsic
def row_dot(typingctx, kind, row, nb, x):
    """An intrinsic (kind, row, nb, x) -> float32: the dot of one row of kind (Q4_0 or Q4_1: a case each; nb blocks
    at address row) with the float32 input at address x. Integer addresses, no bounds checks: the caller owns the
    shapes."""
    if not all(isinstance(a, types.Integer) for a in (kind, row, nb, x)):
        return None

    def codegen(context, builder, sig, args):
        kind, row, nb, x = args
        emit = lambda code: emit_row_dot(builder, row, nb, x, code)  # noqa: E731
        return by_value(builder, context.cast(builder, kind, sig.args[0], types.int64), KINDS, emit, F32)
    return types.float32(kind, types.int64, types.int64, types.int64), codegen


@njit(**JIT)
def gemv(q, x, y, lo, hi, kind=blocks.Q4_1):
    """y[r] = row r of the Q4_1 (or Q4_0: kind) matrix q [rows, row bytes] dotted with x (float32 [cols],
    contiguous), for r in [lo, hi). Each row's bytes must be contiguous (quantize's are). Rows PREFETCH_ROWS ahead
    are prefetched line by line (kernels.ahead_into_l2 says into which cache)."""
    nb = q.shape[1] // (Q4_0_BYTES if kind == blocks.Q4_0 else BLOCK_BYTES)
    rows = q.ctypes.data
    into_l2 = ahead_into_l2(4 * x.shape[0], q.shape[1], PREFETCH_ROWS)
    for r in range(lo, hi):
        if r + PREFETCH_ROWS < hi:
            prefetch_lines(q, r + PREFETCH_ROWS, into_l2)
        y[r] = row_dot(kind, rows + r * q.strides[0], nb, x.ctypes.data)
