"""The K-quants' GEMV (Q4_K, Q5_K, Q6_K rows) against an input rounded to 8 bits, in integers.

``gemv(kind, q, x, y, lo, hi)``: y[r] = row r of q (uint8 [rows, row bytes], blocks of ggml type kind) dotted with
x^, for r in [lo, hi), where x^ is x rounded by ``quantize_input``. ``quants.gemv`` sends these three types here.

Why: converting every weight to float32 (quants.py's form) runs about 8 GB/s a thread even from cache, so a
K-quant file was compute bound at half the bandwidth. llama.cpp multiplies the codes with an 8-bit input in
integers; so does this (docs/performance.md has both).

The input: x is rounded once a call, in groups of 16: dx = max|x| / 127, codes round(x / dx) in [-127, 127]; each
group also keeps the sum of its x^ = dx codes. A group of 16 shares one scale with a 16-weight sub-block of Q6_K
and half a sub-block of Q4_K/Q5_K, so no scale of the input spans two of the weights' scales.

A block of 256 is four runs of 64 weights. Per run: the 64 unsigned codes (4, 5 or 6 bits) in one <64 x i8>, its
64 input codes, and ``dot4``: 16 int32 lanes, lane l the sum of products 4l..4l+3 (vpdpbusd with AVX512-VNNI;
vpmaddubsw then vpmaddwd otherwise: the same integers, none of them saturate). Four lanes are one input group, so
each lane is converted to float32 and multiplied by its d sc dx (one FMA into a 16-lane accumulator). The offsets
(Q4_K and Q5_K's -dmin m, Q6_K's -32 d sc) take each group's sum of x^, once a block. Float32 rounding aside, a row's
result is sum_i w_i x^_i, with w_i gguf's dequantized weight (tests/test_quants.py holds it to float64).
"""
from __future__ import annotations

import numpy as np

from . import _numba  # noqa: F401  (the threading layer and the BLAS check, before numba is imported)

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import blocks, ffi, kernels, vector_ir  # noqa: E402
from .blocks import GGUF_TYPES, Q4_K, Q5_K, Q6_K  # noqa: E402
from .kernels import ahead_into_l2, prefetch_lines  # noqa: E402
from .vector_ir import F32, I32, I64, V16F, V16I8, V16I32, ZERO16, half_splat, hsum, load  # noqa: E402

ffi.purge_stale_cache("q8_dot", kernels, blocks, vector_ir)

GROUP = 16                 # input elements per scale
PREFETCH_ROWS = 8
_JIT = dict(fastmath=True, cache=True, nogil=True)
I8, I16 = ir.IntType(8), ir.IntType(16)
V32I8, V64I8 = ir.VectorType(I8, 32), ir.VectorType(I8, 64)
V8F, V8I32 = ir.VectorType(F32, 8), ir.VectorType(I32, 8)
VNNI, AVX512BW = vector_ir.cpu_has("avx512vnni"), vector_ir.cpu_has("avx512bw")


# ---------------------------------------------------------------------------------------------------------------
# The input.

@njit(**_JIT)
def quantize_input(x, codes, dx4, sums):
    """Round x (float32 [cols], cols a multiple of 16) in groups of 16: codes[i] = round(x[i] / dx) (int8 [cols]),
    dx = max|x| / 127 of the group (0 and codes 0 for a group of zeros), stored four times, once per int32 lane of
    the group (dx4: float32 [cols / 4]); sums[g] = dx * (the group's sum of codes) (float32 [cols / 16])."""
    for g in range(x.shape[0] // GROUP):
        at = g * GROUP
        amax = np.float32(0.0)
        for i in range(GROUP):
            amax = max(amax, abs(x[at + i]))
        dx = amax / np.float32(127.0)
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        total = 0
        for i in range(GROUP):
            c = np.int32(np.rint(x[at + i] * inv))
            codes[at + i] = c
            total += c
        for k in range(4):
            dx4[4 * g + k] = dx
        sums[g] = dx * np.float32(total)


@njit(**_JIT)
def input_buffers(cols):
    """Fresh (codes, dx4, sums) for an input of cols elements: quantize_input's arrays."""
    return np.empty(cols, np.int8), np.empty(cols // 4, np.float32), np.empty(cols // GROUP, np.float32)


# ---------------------------------------------------------------------------------------------------------------
# IR.

def _i8s(value: int, n: int):
    return ir.Constant(ir.VectorType(I8, n), [value] * n)


def _concat(b, lo, hi):
    """Two byte vectors of n lanes as one of 2n."""
    n = lo.type.count
    return b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 2 * n), list(range(2 * n))))


def _lanes(b, v, idx):
    """The lanes idx of v (a constant shuffle)."""
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, len(idx)), list(idx)))


def _call(b, name, ret, args):
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return b.call(fn, args)


def dot4(b, w, xc):
    """<16 x i32>: lane l = sum over k < 4 of w[4l + k] (unsigned) * xc[4l + k] (signed), both <64 x i8>. Exact:
    with w < 64 and |xc| <= 127 no 16-bit pair sum (the non-VNNI forms) can saturate."""
    zero = ir.Constant(V16I32, [0] * 16)
    if VNNI:
        return _call(b, "llvm.x86.avx512.vpdpbusd.512", V16I32, [zero, w, xc])
    if AVX512BW:
        pairs = _call(b, "llvm.x86.avx512.pmaddubs.w.512", ir.VectorType(I16, 32), [w, xc])
        return _call(b, "llvm.x86.avx512.pmaddw.d.512", V16I32, [pairs, ir.Constant(pairs.type, [1] * 32)])
    halves = []
    for h in range(2):
        half = range(32 * h, 32 * h + 32)
        pairs = _call(b, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(I16, 16), [_lanes(b, w, half),
                                                                                _lanes(b, xc, half)])
        halves.append(_call(b, "llvm.x86.avx2.pmadd.wd", V8I32, [pairs, ir.Constant(pairs.type, [1] * 16)]))
    return _concat(b, *halves)


class _Row:
    """One row's dot: a 16-lane float32 accumulator for the code products (acc) and one for the offsets (off),
    the input's three arrays at integer addresses."""

    def __init__(self, b, codes, dx4, sums):
        self.b, self.codes, self.dx4, self.sums = b, codes, dx4, sums
        self.acc, self.off = (cgutils.alloca_once_value(b, ZERO16) for _ in range(2))
        self.fma = vector_ir.vector_intrinsic(b, "llvm.fma", 3)

    def run(self, w, e, scales):
        """acc += the 64 codes w (<64 x i8>) times input elements e..e+63 (e: i64), lane l's product times
        scales[l] (16 lanes: each lane's d sc) and the lane's dx."""
        b = self.b
        p = dot4(b, w, load(b, b.add(self.codes, e), V64I8, 1))
        s = b.fmul(scales, load(b, b.add(self.dx4, e), V16F, 4))      # dx4 holds cols / 4 floats: byte e is lane e/4
        b.store(b.call(self.fma, [b.sitofp(p, V16F), s, b.load(self.acc)]), self.acc)

    def offsets(self, e, per_group):
        """off += per_group (16 lanes, one per input group of the block at element e) times the groups' sums."""
        b = self.b
        sums = load(b, b.add(self.sums, b.mul(b.udiv(e, I64(GROUP)), I64(4))), V16F, 4)
        b.store(b.call(self.fma, [per_group, sums, b.load(self.off)]), self.off)

    def total(self, off_times):
        b = self.b
        return b.fsub(hsum(b, b.load(self.acc)), b.fmul(F32(off_times), hsum(b, b.load(self.off))))


def k45_scales(b, bp):
    """A Q4_K / Q5_K block's eight (scale, min) pairs as two <8 x float> (d sc_j, dmin m_j), unpacked as llama.cpp's
    get_scale_min_k4 in eight lanes at once: for j < 4, sc = q[j] & 63 and m = q[j + 4] & 63; for j >= 4,
    sc = (q[j + 4] & 15) | (q[j - 4] >> 6) << 4 and m = q[j + 4] >> 4 | (q[j] >> 6) << 4 (q: the 12 bytes at
    bp + 4). Each lane's products are the ones a scalar decode computes."""
    c8 = lambda vals: ir.Constant(V8I32, list(vals))  # noqa: E731
    q = b.zext(load(b, b.add(bp, I64(4)), V16I8, 1), V16I32)     # the 12 scale bytes, then 4 code bytes (unused)
    top = lambda idx: b.shl(b.lshr(_lanes(b, q, idx), c8([6] * 8)), c8([4] * 8))  # noqa: E731
    upper = c8([0] * 4 + [-1] * 4)              # lanes j >= 4 take the top bits
    sc = b.or_(b.and_(_lanes(b, q, [0, 1, 2, 3, 8, 9, 10, 11]), c8([63] * 4 + [15] * 4)),
               b.and_(top([0, 1, 2, 3, 0, 1, 2, 3]), upper))
    mn = b.or_(b.and_(b.lshr(_lanes(b, q, [4, 5, 6, 7, 8, 9, 10, 11]), c8([0] * 4 + [4] * 4)), c8([63] * 8)),
               b.and_(top([4, 5, 6, 7, 4, 5, 6, 7]), upper))
    d8 = lambda at: _lanes(b, half_splat(b, b.add(bp, I64(at))), range(8))  # noqa: E731
    return b.fmul(d8(0), b.uitofp(sc, V8F)), b.fmul(d8(2), b.uitofp(mn, V8F))


def _emit_k45(row, kind, bp, e):
    """One Q4_K / Q5_K block at address bp, input from element e: run c holds the low nibbles of bytes 32c..32c+31
    (sub-block 2c) then their high nibbles (2c + 1), Q5_K's fifth bits from qh bits 2c and 2c + 1."""
    b = row.b
    scales, mins = k45_scales(b, bp)
    qs = 48 if kind == Q5_K else 16
    qh = load(b, b.add(bp, I64(16)), V32I8, 1) if kind == Q5_K else None
    for c in range(4):
        nib = load(b, b.add(bp, I64(qs + 32 * c)), V32I8, 1)
        w = _concat(b, b.and_(nib, _i8s(15, 32)), b.lshr(nib, _i8s(4, 32)))
        if qh is not None:
            fifth = _concat(b, b.lshr(qh, _i8s(2 * c, 32)), b.lshr(qh, _i8s(2 * c + 1, 32)))
            w = b.or_(w, b.shl(b.and_(fifth, _i8s(1, 64)), _i8s(4, 64)))
        row.run(w, b.add(e, I64(64 * c)), _lanes(b, scales, [2 * c] * 8 + [2 * c + 1] * 8))
    row.offsets(e, _lanes(b, mins, [j // 2 for j in range(16)]))


def _emit_q6_k(row, bp, e):
    """One Q6_K block at address bp (layout in blocks.py), input from element e: in half n, run a holds the
    nibbles a of ql bytes 64n..64n+63 with qh bits 4a (first 32) and 4a + 2 (next 32) of bytes 32n..32n+31."""
    b = row.b
    scales = b.fmul(half_splat(b, b.add(bp, I64(208))), b.sitofp(load(b, b.add(bp, I64(192)), V16I8, 1), V16F))
    for n in range(2):
        ql = load(b, b.add(bp, I64(64 * n)), V64I8, 1)
        qh = load(b, b.add(bp, I64(128 + 32 * n)), V32I8, 1)
        for a in range(2):
            low = b.and_(b.lshr(ql, _i8s(4 * a, 64)), _i8s(15, 64))
            high = _concat(b, b.lshr(qh, _i8s(4 * a, 32)), b.lshr(qh, _i8s(4 * a + 2, 32)))
            w = b.or_(low, b.shl(b.and_(high, _i8s(3, 64)), _i8s(4, 64)))
            row.run(w, b.add(e, I64(128 * n + 64 * a)), _lanes(b, scales, [8 * n + 4 * a + l // 4 for l in range(16)]))
    row.offsets(e, scales)


@intrinsic
def _dot_row(typingctx, kind, p, nb, codes, dx4, sums):
    """An intrinsic (kind, p, nb, codes, dx4, sums) -> float32: the dot of the row of nb blocks of K-quant kind at
    address p with the input quantize_input made (its three arrays' addresses). kind must be a literal."""
    if not isinstance(kind, types.IntegerLiteral):
        return None
    code = kind.literal_value
    nbytes = GGUF_TYPES[code].nbytes

    def codegen(context, builder, sig, args):
        _, p, nb, codes, dx4, sums = args
        row = _Row(builder, codes, dx4, sums)
        with cgutils.for_range(builder, nb) as loop:
            bp = builder.add(p, builder.mul(loop.index, I64(nbytes)))
            e = builder.mul(loop.index, I64(256))
            if code == Q6_K:
                _emit_q6_k(row, bp, e)
            else:
                _emit_k45(row, code, bp, e)
        return row.total(32.0 if code == Q6_K else 1.0)
    return types.float32(kind, types.int64, types.int64, types.int64, types.int64, types.int64), codegen


@njit(inline="always", **_JIT)
def row_dot(kind, p, nb, codes, dx4, sums):
    """float32 dot of one row (nb blocks of K-quant kind at address p) with a quantize_input input (addresses)."""
    if kind == Q4_K:
        return _dot_row(Q4_K, p, nb, codes, dx4, sums)
    if kind == Q6_K:
        return _dot_row(Q6_K, p, nb, codes, dx4, sums)
    return _dot_row(Q5_K, p, nb, codes, dx4, sums)


@njit(**_JIT)
def gemv(kind, q, x, y, lo, hi):
    """y[r] = row r of q (uint8 [rows, row bytes], blocks of K-quant kind) dotted with x rounded by quantize_input,
    for r in [lo, hi). Each call rounds x itself (a few microseconds: the caller's threads need no shared step)."""
    if hi <= lo:
        return
    cols = x.shape[0]
    codes, dx4, sums = input_buffers(cols)
    quantize_input(x, codes, dx4, sums)
    nb = cols // 256
    base = q.ctypes.data
    into_l2 = ahead_into_l2(cols + cols + cols // 4, q.shape[1], PREFETCH_ROWS)
    for r in range(lo, hi):
        if r + PREFETCH_ROWS < hi:
            prefetch_lines(q, r + PREFETCH_ROWS, into_l2)
        y[r] = row_dot(kind, base + r * q.strides[0], nb, codes.ctypes.data, dx4.ctypes.data, sums.ctypes.data)
