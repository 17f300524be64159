"""GEMV over llama.cpp's block formats as stored in a GGUF (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).

``gemv(kind, q, x, y, lo, hi, rounded=True)``: y[r] = row r of the matrix q (uint8 [rows, row bytes], rows of
``kind``'s blocks, ``blocks.py`` has the layouts) dotted with x (float32 [cols]), for r in [lo, hi). Only y[lo:hi]
is written. No bounds checks beyond the shapes: the caller owns them. With ``rounded`` the rows of the types
q8_dot reads (every type here; q8_dot.KINDS) go to ``q8_dot.gemv``, which multiplies them with x rounded
to about 15 bits, in integers. Without it, Q4_0 and Q4_1 rows go to ``q4.gemv`` (its nibbles through vpermps are
faster than the general form below: docs/performance.md), and so do ``row_dot``'s. The other types are walked
here without ``rounded``, and so are their rows of ``row_dot`` (predicted_ffn's row dots).
``emit_block`` reads Q4_0 and Q4_1 too (predicted_ffn's AXPY rows).

How: each row's dot is one function of LLVM vector IR per type (``row_dot``: Numba's autovectorizer turns byte
unpacking into byte-by-byte inserts, see q4.py). ``emit_block`` emits one block: 16 weights at a time it loads 16
bytes, extracts each weight's integer code as ((b >> s) & m) | (((h >> hs) & hm) << hu) from one or two byte
vectors (the fifth bit of Q5_0 and Q5_1 from a uint32, signed bytes for Q8_0), and accumulates
(scale * code + bias) * x into two 16-lane float32 accumulators (``_Row``), summed once per row. The block's scales
are 16-lane vectors too (``vector_ir.half_splat``; the K-quants' 6-bit scales decoded 8 lanes at a time), and the
K-quants walk their sub-blocks in loops that fit the registers.
Each weight is computed as (scale * q + bias) with scale and bias in float32, so a row's dot differs from the
float64 dot of gguf's dequantized values by float32 rounding only (tests/test_quants.py).
"""
from __future__ import annotations

import numpy as np

from ._numba import JIT  # (first: the threading layer and the BLAS check, before numba is imported)

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import ffi, kernels, q4, q8_dot, vector_ir  # noqa: E402
from . import blocks  # noqa: E402
from .blocks import GGUF_TYPES, KIND_CODES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, TYPES  # noqa: E402
from .kernels import ahead_into_l2, prefetch_lines  # noqa: E402
from .vector_ir import F32, I32, I64, V16F, V16I32, V16I8, ints, load, splat  # noqa: E402

ffi.purge_stale_cache("quants", kernels, blocks, q4, q8_dot, vector_ir)

PREFETCH_ROWS = 8
_F0 = np.float32(0.0)
# Block bytes by type code, as a table Numba code can index (0: not a block type here).
_BLOCK_BYTES = np.zeros(KIND_CODES, np.int64)
_BLOCK = np.zeros(KIND_CODES, np.int64)
for _k, _t in ((k, t) for k, t in TYPES.items() if t.values is not None):   # the GGUF types and Q4_1x16
    _BLOCK_BYTES[_k], _BLOCK[_k] = _t.nbytes, _t.block


class _Row:
    """Emits one row's dot product: 16-lane float32 accumulators (allocas, so registers), one per 16-weight
    group of a 32-weight run (two independent FMA chains)."""

    def __init__(self, builder, xa):
        self.b, self.xa = builder, xa
        self.acc = [cgutils.alloca_once_value(builder, vector_ir.ZERO16) for _ in range(2)]
        self.fma = vector_ir.vector_intrinsic(builder, "llvm.fma", 3)

    def addr(self, base, off):
        return self.b.add(base, I64(off)) if isinstance(off, int) else self.b.add(base, off)

    def bytes16(self, addr):
        """16 bytes at addr, zero-extended to <16 x i32>."""
        return self.b.zext(load(self.b, addr, V16I8, 1), V16I32)

    def scalar(self, addr, ty):
        return load(self.b, addr, ty, 1)

    def f16(self, addr):
        """The float16 at addr as float32 in 16 lanes (vector_ir.half_splat: no wait on an earlier value)."""
        return vector_ir.half_splat(self.b, addr)

    def add(self, w, x_elem, slot):
        """acc[slot] += w * x[x_elem : x_elem + 16] (x_elem an i64 value: the element index)."""
        b = self.b
        xs = load(b, b.add(self.xa, b.mul(x_elem, I64(4))), V16F, 4)
        b.store(b.call(self.fma, [w, xs, b.load(self.acc[slot])]), self.acc[slot])

    def affine(self, code, scale, bias, table=False):
        """fma(float(code), scale, bias) on 16 lanes (code <16 x i32>; scale, bias: 16 lanes). With table (codes of
        4 bits) and AVX-512, the lanes pick their values from the 16 possible ones (q4.pick): the same values in
        fewer operations. A 32-entry table for 5-bit codes (vpermi2ps) measured slower than converting, so those
        convert."""
        b = self.b
        if table and q4.PERMUTE:
            return q4.pick(b, scale, bias, code)
        return b.call(self.fma, [b.uitofp(code, V16F), scale, bias])

    def total(self):
        b = self.b
        return vector_ir.hsum(b, vector_ir.strict(b.fadd(b.load(self.acc[0]), b.load(self.acc[1]))))


def _nibbles(row, addr, shift):
    return row.b.and_(row.b.lshr(row.bytes16(addr), ints(shift)), ints(15))


def _emit_small(row, kind, bp, x0):
    """One block of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) at address bp, input elements from x0."""
    b = row.b
    d = row.f16(bp)
    x1 = b.add(x0, I64(16))
    if kind == Q8_0:
        for half, xe in enumerate((x0, x1)):
            q = b.sitofp(load(b, row.addr(bp, 2 + 16 * half), V16I8, 1), V16F)
            row.add(b.fmul(q, d), xe, half)
        return
    qs = {Q4_0: 2, Q4_1: 4, Q5_0: 6, Q5_1: 8}[kind]
    if kind in (Q4_1, Q5_1):
        bias = row.f16(row.addr(bp, 2))
    else:
        bias = b.fmul(d, ir.Constant(V16F, [-8.0 if kind == Q4_0 else -16.0] * 16))
    qh = splat(b, row.scalar(row.addr(bp, qs - 4), I32)) if kind in (Q5_0, Q5_1) else None
    for half, xe in enumerate((x0, x1)):
        code = _nibbles(row, row.addr(bp, qs), 4 * half)
        if qh is not None:
            code = _fifth_bit(b, code, qh, ir.Constant(V16I32, list(range(16 * half, 16 * half + 16))))
        row.add(row.affine(code, d, bias, table=qh is None), xe, half)


def _fifth_bit(b, code, lanes, shifts):
    """code | 16 in each lane whose bit number `shifts` of `lanes` is set (<16 x i32> each). With AVX-512 a test
    into a mask register and one masked or; AVX2 has no mask registers, and shifts each lane's bit into place."""
    if q4.PERMUTE:
        is_set = b.icmp_unsigned("!=", b.and_(lanes, b.shl(ints(1), shifts)), ints(0))
        return b.select(is_set, b.or_(code, ints(16)), code)
    return b.or_(code, b.shl(b.and_(b.lshr(lanes, shifts), ints(1)), ints(4)))


def _stored_lane(b, slot, k):
    """Lane k (an i64 known at run time) of the float32 vector stored at slot, in 16 lanes: one broadcast load
    where a vector_ir.memory_fence after the store keeps the vector in memory (a lane of a vector in a register
    took two shuffles)."""
    return splat(b, b.load(b.gep(b.bitcast(slot, F32.as_pointer()), [k])))


def _emit_k45(row, kind, bp, x0):
    """One Q4_K / Q5_K block of 256 at address bp: sub-block j = 2c + h holds the low (h = 0) or high nibbles of
    bytes 32c..32c+31, with scale and min from q8_dot.k45_scales. A loop over c, not unrolled: the block unrolled kept
    about 55 values on the stack (16 AVX2 registers for 16-lane vectors)."""
    b = row.b
    table = cgutils.alloca_once(b, V16F)   # d sc_j, -dmin m_j; the entry block's: no stack growth per block
    b.store(q8_dot.k45_scales(b, bp), table)
    vector_ir.memory_fence(b, table)
    qs = 48 if kind == Q5_K else 16
    with cgutils.for_range(b, I64(4)) as loop:
        c = loop.index
        for h in range(2):
            j = b.add(b.mul(c, I64(2)), I64(h))
            scale, minus_m = _stored_lane(b, table, j), _stored_lane(b, table, b.add(j, I64(8)))
            for g in range(2):
                code = _nibbles(row, b.add(row.addr(bp, qs + 16 * g), b.mul(c, I64(32))), 4 * h)
                if kind == Q5_K:
                    code = _fifth_bit(b, code, row.bytes16(row.addr(bp, 16 + 16 * g)), splat(b, b.trunc(j, I32)))
                row.add(row.affine(code, scale, minus_m, table=kind == Q4_K),
                        b.add(x0, b.add(b.mul(j, I64(32)), I64(16 * g))), g)


def _emit_q6_k(row, bp, x0):
    """One Q6_K block of 256 (layout in blocks.py): its 16 scales d sc_k made in one vector, then a loop over the two
    halves n, not unrolled (as _emit_k45)."""
    b = row.b
    table = [cgutils.alloca_once(b, V16F) for _ in range(2)]   # d sc_k, and -32 d sc_k
    sc = b.sitofp(load(b, row.addr(bp, 192), V16I8, 1), V16F)
    scales = b.fmul(row.f16(row.addr(bp, 208)), sc)
    for slot, v in zip(table, (scales, b.fmul(scales, ir.Constant(V16F, [-32.0] * 16)))):
        b.store(v, slot)
    vector_ir.memory_fence(b, *table)
    with cgutils.for_range(b, I64(2)) as loop:
        n = loop.index
        for i in range(4):
            for g in range(2):
                k = b.add(b.mul(n, I64(8)), I64(2 * i + g))
                scale, bias = (_stored_lane(b, t, k) for t in table)
                ql = b.add(row.addr(bp, 32 * (i % 2) + 16 * g), b.mul(n, I64(64)))
                code = _nibbles(row, ql, 4 * (i // 2))
                qh = b.add(row.addr(bp, 128 + 16 * g), b.mul(n, I64(32)))
                high = b.and_(b.lshr(row.bytes16(qh), ints(2 * i)), ints(3))
                code = b.or_(code, b.shl(high, ints(4)))
                row.add(row.affine(code, scale, bias), b.add(x0, b.add(b.mul(n, I64(128)), I64(32 * i + 16 * g))),
                        g)


def emit_block(row, kind, bp, x0):
    """One block of ggml type kind at address bp, its weights' inputs from element x0, through ``row`` (a _Row, or
    a subclass whose ``add`` does something else with each 16 weights: predicted_ffn's AXPY)."""
    if kind == Q6_K:
        _emit_q6_k(row, bp, x0)
    elif GGUF_TYPES[kind].block == 256:
        _emit_k45(row, kind, bp, x0)
    else:
        _emit_small(row, kind, bp, x0)


@intrinsic
def row_dot(typingctx, kind, p, nb, xa):
    """An intrinsic (kind, p, nb, xa) -> float32: the dot of the row of nb blocks of ggml type kind (of GGUF_TYPES;
    each type's code is a case of a switch on kind; Q4_0 and Q4_1 are q4's) at address p with the float32 input at
    address xa (addresses as integers)."""
    if not all(isinstance(a, types.Integer) for a in (kind, p, nb, xa)):
        return None

    def codegen(context, builder, sig, args):
        emit = lambda code: emit_row_dot(builder, *args[1:], code)  # noqa: E731
        return vector_ir.by_value(builder, context.cast(builder, args[0], sig.args[0], types.int64), GGUF_TYPES, emit,
                                  F32)
    return types.float32(kind, types.int64, types.int64, types.int64), codegen


def emit_row_dot(builder, p, nb, xa, code):
    """IR: row_dot's case for the block type code (a float32 value), as q4.emit_row_dot's for its types."""
    if code in q4.KINDS:
        return q4.emit_row_dot(builder, p, nb, xa, code)
    row = _Row(builder, xa)
    with cgutils.for_range(builder, nb) as loop:
        bp = builder.add(p, builder.mul(loop.index, I64(GGUF_TYPES[code].nbytes)))
        emit_block(row, code, bp, builder.mul(loop.index, I64(GGUF_TYPES[code].block)))
    return row.total()


@njit(**JIT)
def gemv(kind, q, x, y, lo, hi, rounded=True):
    """y[r] = row r of q (uint8 [rows, row bytes], blocks of ggml type kind) dotted with x, for r in [lo, hi); with
    rounded, a type q8_dot has is dotted with x rounded there (to about 15 bits)."""
    if rounded and q8_dot.BLOCK_OF[kind]:     # a type q8_dot reads
        q8_dot.gemv(kind, q, x, y, lo, hi)
        return
    if kind == Q4_1 or kind == Q4_0:
        q4.gemv(q, x, y, lo, hi, kind)
        return
    nb = q.shape[1] // _BLOCK_BYTES[kind]
    base = q.ctypes.data
    xa = x.ctypes.data
    into_l2 = ahead_into_l2(4 * x.shape[0], q.shape[1], PREFETCH_ROWS)
    for r in range(lo, hi):
        if r + PREFETCH_ROWS < hi:
            prefetch_lines(q, r + PREFETCH_ROWS, into_l2)
        y[r] = row_dot(kind, base + r * q.strides[0], nb, xa)


@njit(**JIT)
def row_bytes(kind, cols):
    """Bytes of a row of cols weights in blocks of ggml type kind (0 for a type without a kernel here)."""
    return cols // _BLOCK[kind] * _BLOCK_BYTES[kind] if _BLOCK[kind] else 0
