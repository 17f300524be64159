"""The GEMV of the K-quants (Q4_K, Q5_K, Q6_K), Q5_0 and Q8_0 against an input rounded to 8 bits, in integers.

``gemv(kind, q, x, y, lo, hi)``: y[r] = row r of q (uint8 [rows, row bytes], blocks of ggml type kind, one of KINDS)
dotted with x^, for r in [lo, hi), where x^ is x rounded by ``quantize_input``. ``quants.gemv`` sends these types
here.

Why: converting every weight to float32 (quants.py's form) runs about 8-9 GB/s a thread even from cache, so these
files were compute bound at half the bandwidth. llama.cpp multiplies the codes with an 8-bit input in integers; so
does this (docs/performance.md has both).

The input: x is rounded once a call, in lanes of four: dx = max|x| / 127 of the lane, codes round(x / dx) in
[-127, 127]. Four inputs are what one int32 lane of ``dot4`` sums, so a scale per lane costs the kernel nothing over
a scale per 16, and an outlier coarsens three neighbours instead of fifteen (the final hidden state of the default
model has a few large channels: with a scale per 16, its Q8_0 head's logits moved by up to 1.6% of the largest).
Each lane also keeps its sum of codes, and each group of 16 (a sub-block of Q6_K, half a sub-block of Q4_K/Q5_K)
the sum of its x^ = dx codes.

A run is 64 weights: a quarter of a K-quant block, or two blocks of 32 (a row's odd last one is a run of 32). Per
run: the unsigned codes (4, 5 or 6 bits; Q8_0's signed codes as their absolute values, their signs moved to the
input's codes) in one <64 x i8>, the 64 input codes, and ``dot4``: 16 int32 lanes, lane l the sum of products
4l..4l+3 (vpdpbusd with AVX512-VNNI; vpmaddubsw then vpmaddwd otherwise: the same integers, none of them saturate).
Each lane is converted to float32 and multiplied by its weights' d sc and its inputs' dx (one FMA into a 16-lane
accumulator). The offsets take the input's sums: Q4_K and Q5_K's -dmin m and Q6_K's -32 d sc the groups'
sums of x^, once a block; Q5_0's -16 the lanes' sums of codes, in integers. Float32 rounding aside, a row's result
is sum_i w_i x^_i, with w_i gguf's dequantized weight (tests/test_quants.py holds it to float64).
"""
from __future__ import annotations

import numpy as np

from . import _numba  # noqa: F401  (the threading layer and the BLAS check, before numba is imported)

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import blocks, ffi, kernels, vector_ir  # noqa: E402
from .blocks import GGUF_TYPES, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0  # noqa: E402
from .kernels import ahead_into_l2, prefetch_lines  # noqa: E402
from .vector_ir import F32, I32, I64, V16F, V16I8, V16I32, ZERO16, half_splat, hsum, load  # noqa: E402

ffi.purge_stale_cache("q8_dot", kernels, blocks, vector_ir)

KINDS = (Q4_K, Q5_K, Q6_K, Q5_0, Q8_0)   # the block types read here
GROUP = 16                 # input elements per scale
PREFETCH_ROWS = 8
_JIT = dict(fastmath=True, cache=True, nogil=True)
# Weights a block by ggml type number for KINDS, 0 for a type not read here: a table Numba code can index.
BLOCK_OF = np.zeros(16, np.int64)
for _k in KINDS:
    BLOCK_OF[_k] = GGUF_TYPES[_k].block
I8, I16 = ir.IntType(8), ir.IntType(16)
V32I8, V64I8 = ir.VectorType(I8, 32), ir.VectorType(I8, 64)
V8F, V8I32 = ir.VectorType(F32, 8), ir.VectorType(I32, 8)
VNNI, AVX512BW = vector_ir.cpu_has("avx512vnni"), vector_ir.cpu_has("avx512bw")


# ---------------------------------------------------------------------------------------------------------------
# The input.

@njit(**_JIT)
def quantize_input(x):
    """x (float32 [cols], cols a multiple of 16) rounded in lanes of 4 -> (codes, dx4, sums, lane_sums): for lane k
    (elements 4k..4k+3), dx4[k] = max|x| / 127 of the lane (float32 [cols / 4]; 0, and codes 0, for a lane of zeros)
    and codes[i] = round(x[i] / dx4[k]) (int8 [cols]); lane_sums[k] = the lane's sum of codes (int32 [cols / 4]);
    sums[g] = the sum of x^ = codes dx over group g of 16 elements (float32 [cols / 16])."""
    cols = x.shape[0]
    codes, dx4, lane_sums = np.empty(cols, np.int8), np.empty(cols // 4, np.float32), np.empty(cols // 4, np.int32)
    sums = np.empty(cols // GROUP, np.float32)
    for k in range(cols // 4):
        amax = max(max(abs(x[4 * k]), abs(x[4 * k + 1])), max(abs(x[4 * k + 2]), abs(x[4 * k + 3])))
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        total = 0
        for i in range(4 * k, 4 * k + 4):
            c = np.int32(np.rint(x[i] * inv))
            codes[i] = c
            total += c
        dx4[k] = amax / np.float32(127.0)
        lane_sums[k] = total
    for g in range(cols // GROUP):
        total = np.float32(0.0)
        for k in range(4 * g, 4 * g + 4):
            total += dx4[k] * np.float32(lane_sums[k])
        sums[g] = total
    return codes, dx4, sums, lane_sums


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
    """<n/4 x i32>: lane l = sum over k < 4 of w[4l + k] (unsigned) * xc[4l + k] (signed), both <n x i8>, n 64 or
    32. Exact: with w <= 128 and |xc| <= 127 no 16-bit pair sum (the non-VNNI forms: at most 2 128 127 = 32512)
    saturates."""
    n = w.type.count
    if VNNI:
        lanes = ir.VectorType(I32, n // 4)
        return _call(b, f"llvm.x86.avx512.vpdpbusd.{8 * n}", lanes, [ir.Constant(lanes, [0] * (n // 4)), w, xc])
    if AVX512BW and n == 64:
        pairs = _call(b, "llvm.x86.avx512.pmaddubs.w.512", ir.VectorType(I16, 32), [w, xc])
        return _call(b, "llvm.x86.avx512.pmaddw.d.512", V16I32, [pairs, ir.Constant(pairs.type, [1] * 32)])
    quarters = []
    for h in range(n // 32):
        half = range(32 * h, 32 * h + 32)
        pairs = _call(b, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(I16, 16), [_lanes(b, w, half),
                                                                                _lanes(b, xc, half)])
        quarters.append(_call(b, "llvm.x86.avx2.pmadd.wd", V8I32, [pairs, ir.Constant(pairs.type, [1] * 16)]))
    return quarters[0] if n == 32 else _concat(b, *quarters)


class _Row:
    """One row's dot: a 16-lane float32 accumulator for the code products and one for the offsets, the input's four
    arrays (quantize_input's) at integer addresses. (Two accumulators for the products, runs alternating, measured
    no faster with AVX-512 and slower in the AVX2 code, whose 16 registers hold eight 16-lane vectors.)"""

    def __init__(self, b, codes, dx4, sums, lane_sums):
        self.b, self.codes, self.dx4, self.sums, self.lane_sums = b, codes, dx4, sums, lane_sums
        self.acc, self.off = (cgutils.alloca_once_value(b, ZERO16) for _ in range(2))
        self.fma = vector_ir.vector_intrinsic(b, "llvm.fma", 3)

    def run(self, w, e, scales, minus=0, signed=False):
        """acc += the n codes w (<n x i8>, n 64 or 32: unsigned, or signed with `signed`) minus `minus` times input
        elements e..e+n-1 (e: i64), lane l's product times scales[l] (n/4 lanes: each lane's d sc) and the lane's
        dx."""
        b = self.b
        n = w.type.count
        lanes = n // 4
        xc = load(b, b.add(self.codes, e), ir.VectorType(I8, n), 1)
        if signed:    # w x = |w| (sign(w) x): -128 becomes the unsigned 128, and |x| <= 127 stays in range
            negative = b.icmp_signed("<", w, _i8s(0, n))
            w, xc = (b.select(negative, b.sub(_i8s(0, n), v), v) for v in (w, xc))
        p = dot4(b, w, xc)
        if minus:   # sum (w - minus) x = sum w x - minus sum x, in integers
            sums = load(b, b.add(self.lane_sums, e), ir.VectorType(I32, lanes), 4)   # byte e is lane e/4
            p = b.sub(p, b.mul(sums, ir.Constant(sums.type, [minus] * lanes)))
        s = b.fmul(scales, load(b, b.add(self.dx4, e), ir.VectorType(F32, lanes), 4))
        acc = self.acc
        if lanes == 16:
            b.store(b.call(self.fma, [b.sitofp(p, V16F), s, b.load(acc)]), acc)
            return
        product = b.fmul(b.sitofp(p, s.type), s)     # a half run (a row's last Q5_0 block): lanes 8..15 get 0
        wide = ir.Constant(ir.VectorType(I32, 16), list(range(lanes)) + [lanes] * (16 - lanes))
        b.store(b.fadd(b.shuffle_vector(product, ir.Constant(product.type, [0.0] * lanes), wide), b.load(acc)), acc)

    def offsets(self, e, per_group):
        """off += per_group (16 lanes, one per input group of the block at element e) times the groups' sums."""
        b = self.b
        sums = load(b, b.add(self.sums, b.mul(b.udiv(e, I64(GROUP)), I64(4))), V16F, 4)
        b.store(b.call(self.fma, [per_group, sums, b.load(self.off)]), self.off)

    def total(self, with_offsets):
        """The row's dot: the accumulators' lanes summed, plus the offsets' (with_offsets: a type that has them)."""
        b = self.b
        acc = hsum(b, b.load(self.acc))
        return vector_ir.strict(b.fadd(acc, hsum(b, b.load(self.off)))) if with_offsets else acc


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
    row.offsets(e, _lanes(b, b.fneg(mins), [j // 2 for j in range(16)]))     # w = d sc q - dmin m


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
    row.offsets(e, b.fmul(scales, ir.Constant(V16F, [-32.0] * 16)))          # w = d sc (q - 32)


def _q5_0_codes(b, bp):
    """A Q5_0 block's 32 codes q (0..31) as <32 x i8>: the low nibbles, then the high ones, each with its fifth
    bit from the uint32 qh (bit j belongs to element j)."""
    nib = load(b, b.add(bp, I64(6)), V16I8, 1)
    q = _concat(b, b.and_(nib, _i8s(15, 16)), b.lshr(nib, _i8s(4, 16)))
    fifth = b.bitcast(load(b, b.add(bp, I64(2)), I32, 1), ir.VectorType(ir.IntType(1), 32))
    return b.or_(q, b.select(fifth, _i8s(16, 32), _i8s(0, 32)))


def _small_codes(b, kind, bp):
    """A Q5_0 or Q8_0 block's 32 codes as <32 x i8> (Q8_0's signed)."""
    return _q5_0_codes(b, bp) if kind == Q5_0 else load(b, b.add(bp, I64(2)), V32I8, 1)


def _emit_small(row, kind, bp, e, blocks_in_run):
    """One run of Q5_0 or Q8_0 blocks (two, or a row's odd last one) at address bp, input from element e, each
    block scaled by its d. Q5_0's w = d (q - 16): q . x minus 16 times the lanes' code sums. Q8_0's codes are
    signed: their signs move to the input's codes."""
    b = row.b
    q = _small_codes(b, kind, bp)
    d = half_splat(b, bp)
    if blocks_in_run == 2:
        nxt = b.add(bp, I64(GGUF_TYPES[kind].nbytes))
        q = _concat(b, q, _small_codes(b, kind, nxt))
        d = b.shuffle_vector(d, half_splat(b, nxt), ir.Constant(V16I32, [0] * 8 + [16] * 8))
    else:
        d = _lanes(b, d, range(8))
    row.run(q, e, d, minus=16 if kind == Q5_0 else 0, signed=kind == Q8_0)


@intrinsic
def _dot_row(typingctx, kind, p, nb, codes, dx4, sums, lane_sums):
    """An intrinsic (kind, p, nb, codes, dx4, sums, lane_sums) -> float32: the dot of the row of nb blocks of kind
    (a literal, one of KINDS) at address p with the input quantize_input made (its arrays' addresses)."""
    if not isinstance(kind, types.IntegerLiteral):
        return None
    code = kind.literal_value
    nbytes = GGUF_TYPES[code].nbytes

    def codegen(context, builder, sig, args):
        row = _Row(builder, *args[3:])
        p, nb = args[1], args[2]
        if code in (Q5_0, Q8_0):
            with cgutils.for_range(builder, builder.udiv(nb, I64(2))) as loop:
                _emit_small(row, code, builder.add(p, builder.mul(loop.index, I64(2 * nbytes))),
                            builder.mul(loop.index, I64(64)), 2)
            last = builder.sub(nb, I64(1))
            with builder.if_then(builder.trunc(nb, ir.IntType(1))):
                _emit_small(row, code, builder.add(p, builder.mul(last, I64(nbytes))), builder.mul(last, I64(32)), 1)
            return row.total(False)
        with cgutils.for_range(builder, nb) as loop:
            bp = builder.add(p, builder.mul(loop.index, I64(nbytes)))
            e = builder.mul(loop.index, I64(256))
            if code == Q6_K:
                _emit_q6_k(row, bp, e)
            else:
                _emit_k45(row, code, bp, e)
        return row.total(True)
    return types.float32(kind, *[types.int64] * 6), codegen


@njit(inline="always", **_JIT)
def row_dot(kind, p, nb, codes, dx4, sums, lane_sums):
    """float32 dot of one row (nb blocks of kind, one of KINDS, at address p) with a quantize_input input (its
    arrays' addresses)."""
    if kind == Q4_K:
        return _dot_row(Q4_K, p, nb, codes, dx4, sums, lane_sums)
    if kind == Q6_K:
        return _dot_row(Q6_K, p, nb, codes, dx4, sums, lane_sums)
    if kind == Q5_0:
        return _dot_row(Q5_0, p, nb, codes, dx4, sums, lane_sums)
    if kind == Q8_0:
        return _dot_row(Q8_0, p, nb, codes, dx4, sums, lane_sums)
    return _dot_row(Q5_K, p, nb, codes, dx4, sums, lane_sums)


@njit(**_JIT)
def gemv(kind, q, x, y, lo, hi):
    """y[r] = row r of q (uint8 [rows, row bytes], blocks of kind, one of KINDS) dotted with x rounded by
    quantize_input, for r in [lo, hi). Each call rounds x itself (microseconds: the caller's threads need no shared
    step)."""
    if hi <= lo:
        return
    cols = x.shape[0]
    codes, dx4, sums, lane_sums = quantize_input(x)
    nb = cols // BLOCK_OF[kind]
    base = q.ctypes.data
    into_l2 = ahead_into_l2(codes.nbytes + dx4.nbytes + sums.nbytes + lane_sums.nbytes, q.shape[1], PREFETCH_ROWS)
    for r in range(lo, hi):
        if r + PREFETCH_ROWS < hi:
            prefetch_lines(q, r + PREFETCH_ROWS, into_l2)
        y[r] = row_dot(kind, base + r * q.strides[0], nb, codes.ctypes.data, dx4.ctypes.data, sums.ctypes.data,
                       lane_sums.ctypes.data)
