"""The host GEMVs of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants (Q4_K, Q5_K, Q6_K) in integers, against an input
rounded to two 8-bit parts, and the batched decode's Q4_1 GEMM.

``gemv(kind, q, x, y, lo, hi)``: y[r] = row r of q (uint8 [rows, row bytes], blocks of ggml type kind, one of KINDS)
dotted with x^, for r in [lo, hi), where x^ is x rounded by ``quantize_input``. ``quants.gemv`` sends these types
here. ``gemm(kind, q, x, y, nt, lo, hi)``: the same for nt tokens' inputs against one read of each Q4_1 row; each
token's result is its gemv's, bit for bit (both emit ``_emit_rows``, whose float operations are strict). Both send
Q4_1x16 (blocks.group_rows: the dense host decode's Q4_1 layers, 16 rows interleaved) to q4_groups. The input's
rounding is q8_input's.

Why: converting every weight to float32 (q4.py's and quants.py's form) runs about 9 GB/s a thread even from cache,
so these files were compute bound at half the bandwidth. llama.cpp multiplies the codes with an 8-bit input in
integers; so does this, twice (docs/performance.md has the figures).

The input: x is rounded once a call, in lanes of four, to about 15 bits: with t = 127 x / max|x| of the lane, a code
round(t) and a residue round(FINE (t - code)), both int8, and x^ = dx (FINE code + residue), dx = max|x| /
(127 FINE). Each run takes two integer dots, codes and residues, and adds them as FINE p_codes + p_residues.
Why two: with the codes alone (8 bits a lane, as llama.cpp's inputs), the default model's answer to "What is the
capital of France?" through the chat template turned from "The capital of France is Paris." into "L'Etoile, ...":
its first token wins by 0.4% of the logit. With the residues x^ is within 2^-15 of the lane's largest value, and the
host decode matches XLA's float32 model within the tolerances its tests hold it to. Four inputs are what one int32
lane of ``dot4`` sums, so a scale per lane costs the kernel nothing over a scale per 16. Each lane also keeps its
sum of FINE codes + residues, and each group of 16 (a sub-block of Q6_K, half a sub-block of Q4_K/Q5_K, half a
block of 32) the sum of its x^.

A run is 64 weights: a quarter of a K-quant block, or two blocks of 32 (a row's odd last one is a run of 32). Per
run: the unsigned codes (4, 5 or 6 bits; Q8_0's signed codes as their absolute values, their signs moved to the
input's codes) in one <64 x i8>, the 64 input codes and residues, and ``dot4`` of each: 16 int32 lanes, lane l the
sum of products 4l..4l+3 (vpdpbusd with AVX512-VNNI; vpmaddubsw then vpmaddwd otherwise: the same integers, none of
them saturate). Each lane's FINE p_codes + p_residues is converted to float32 and multiplied by its weights' d sc
and its inputs' dx (one FMA into a 16-lane accumulator). The offsets take the input's sums: Q4_K and Q5_K's
-dmin m and Q6_K's -32 d sc the groups' sums of x^, once a block; Q4_1's and Q5_1's m their two groups' sums of x^;
Q4_0's -8 and Q5_0's -16 the lanes' sums, in integers. Float32 rounding aside, a row's result is sum_i w_i x^_i,
with w_i gguf's dequantized weight (tests/test_quants.py holds it to float64).
"""
from __future__ import annotations

import numpy as np

from ._numba import JIT  # (first: the threading layer and the BLAS check, before numba is imported)

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import blocks, ffi, kernels, q4_groups, q8_input, vector_ir  # noqa: E402
from .blocks import GGUF_TYPES, KIND_CODES, Q4_0, Q4_1, Q4_1X16, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0  # noqa: E402
from .kernels import ahead_into_l2, prefetch_lines  # noqa: E402
from .q8_input import FINE, GROUP, quantize_input, quantize_into  # noqa: E402,F401  (callers read them here too)
from .vector_ir import (F32, I8, I32, I64, V16F, V16I8, V32I8, V64I8, ZERO16, concat, dot4, half_splat,  # noqa: E402
                        hsum, i8s, lanes, load, strict)

ffi.purge_stale_cache("q8_dot", kernels, blocks, vector_ir, q8_input, q4_groups)

KINDS = (Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0)   # the block types read here
SMALL = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)   # blocks of 32, read two to a run
MINUS = {Q4_0: 8, Q5_0: 16}         # w = d (q - MINUS): taken from the lanes' code sums, in integers
WITH_M = (Q4_1, Q5_1)               # w = d q + m: m times the groups' sums of x^ (_Row.m_terms)
CODES_AT = {Q4_0: 2, Q4_1: 4, Q5_0: 6, Q5_1: 8, Q8_0: 2}   # where a block of 32's codes start
GROUP_TOKENS = 4                    # tokens per pass over a row in gemm (8 was slower a token: docs/performance.md)
PREFETCH_ROWS = 8          # rows a GEMV prefetches ahead, at least; AHEAD_BYTES, bytes ahead by type: the types whose
# dot outruns one thread's share of the memory bandwidth (Q8_0, Q6_K, and Q4_K, Q5_K since their scales are unpacked
# in integers) keep more lines in flight; the others are compute bound, and more rows ahead made Q4_1 slower
# (docs/performance.md, "Prefetch by the bytes a type streams", "K-quant scales in general-purpose registers")
AHEAD_BYTES = np.zeros(KIND_CODES, np.int64)
AHEAD_BYTES[[Q8_0, Q6_K, Q4_K, Q5_K]] = 24 * 1024
# Weights a block by type code for KINDS and Q4_1X16, 0 for a type not read here: a table Numba code can index.
BLOCK_OF = np.zeros(KIND_CODES, np.int64)
for _k in KINDS:
    BLOCK_OF[_k] = GGUF_TYPES[_k].block
BLOCK_OF[Q4_1X16] = blocks.TYPES[Q4_1X16].block
GROUP_ROWS = q4_groups.ROWS   # rows a Q4_1x16 dot reads at once (q4_groups); its row ranges are multiples of it
Q4_1_BYTES = GGUF_TYPES[Q4_1].nbytes
V2F, V4F = ir.VectorType(F32, 2), ir.VectorType(F32, 4)


# ---------------------------------------------------------------------------------------------------------------
# IR.

class _Row:
    """One row's dot with one input: a 16-lane float32 accumulator for the code products, one for the K-quants'
    offsets and a 4-lane one for Q4_1's m terms, the input's five arrays (quantize_input's) at integer addresses.
    Its float operations are strict (vector_ir.strict), so a token's dot is the same bits whether gemv or gemm
    emits it. (Two accumulators for the products, runs alternating, measured no faster with AVX-512 and slower in
    the AVX2 code, whose 16 registers hold eight 16-lane vectors.)"""

    def __init__(self, b, codes, residues, dx4, sums, lane_sums):
        self.b, self.codes, self.residues, self.dx4 = b, codes, residues, dx4
        self.sums, self.lane_sums = sums, lane_sums
        self.acc, self.off = (cgutils.alloca_once_value(b, ZERO16) for _ in range(2))
        self.off4 = cgutils.alloca_once_value(b, ir.Constant(V4F, [0.0] * 4))
        self.fma = vector_ir.vector_intrinsic(b, "llvm.fma", 3)

    def run(self, w, e, scales, minus=0, signed=False):
        """acc += the n codes w (<n x i8>, n 64 or 32: unsigned, or signed with `signed`) minus `minus` times input
        elements e..e+n-1 (e: i64), lane l's product times scales[l] (n/4 lanes: each lane's d sc) and the lane's
        dx."""
        b = self.b
        n = w.type.count
        n_lanes = n // 4
        xc, xr = (load(b, b.add(a, e), ir.VectorType(I8, n), 1) for a in (self.codes, self.residues))
        if signed:    # w x = |w| (sign(w) x): -128 becomes the unsigned 128, and |x| <= 127 stays in range
            negative = b.icmp_signed("<", w, i8s(0, n))
            w, xc, xr = (b.select(negative, b.sub(i8s(0, n), v), v) for v in (w, xc, xr))
        # FINE (w . codes) + w . residues: below 2^24 (4 128 127 (FINE + 1)), so exact in float32 too
        p = dot4(b, w, xr, b.mul(dot4(b, w, xc), ir.Constant(ir.VectorType(I32, n_lanes), [FINE] * n_lanes)))
        if minus:   # sum (w - minus) x = sum w x - minus sum x, in integers
            sums = load(b, b.add(self.lane_sums, e), ir.VectorType(I32, n_lanes), 4)   # byte e is lane e/4
            p = b.sub(p, b.mul(sums, ir.Constant(sums.type, [minus] * n_lanes)))
        s = strict(b.fmul(scales, load(b, b.add(self.dx4, e), ir.VectorType(F32, n_lanes), 4)))
        acc = self.acc
        if n_lanes == 16:
            b.store(b.call(self.fma, [b.sitofp(p, V16F), s, b.load(acc)]), acc)
            return
        product = strict(b.fmul(b.sitofp(p, s.type), s))  # a half run (a row's last small block): lanes 8.. get 0
        b.store(strict(b.fadd(_widen(b, product, 16), b.load(acc))), acc)

    def offsets(self, e, per_group):
        """off += per_group (16 lanes, one per input group of the block at element e) times the groups' sums."""
        b = self.b
        sums = load(b, b.add(self.sums, b.mul(b.udiv(e, I64(GROUP)), I64(4))), V16F, 4)
        b.store(b.call(self.fma, [per_group, sums, b.load(self.off)]), self.off)

    def m_terms(self, e, m):
        """off4 += m (<n x float>, n 4 or 2: each group of 16 inputs from element e its block's m) times the groups'
        sums of x^: the m of WITH_M's w = d q + m."""
        b = self.b
        sums = load(b, b.add(self.sums, b.mul(b.udiv(e, I64(GROUP)), I64(4))), m.type, 4)
        if m.type.count == 4:
            fma = cgutils.get_or_insert_function(b.module, ir.FunctionType(V4F, [V4F] * 3), "llvm.fma.v4f32")
            b.store(b.call(fma, [m, sums, b.load(self.off4)]), self.off4)
            return
        b.store(strict(b.fadd(_widen(b, strict(b.fmul(m, sums)), 4), b.load(self.off4))), self.off4)

    def total(self, kind):
        """The row's dot: the product lanes summed, plus the offsets of a type that has them."""
        b = self.b
        acc = hsum(b, b.load(self.acc))
        if kind in WITH_M:
            return strict(b.fadd(acc, hsum(b, _widen(b, b.load(self.off4), 16))))
        if kind in SMALL:
            return acc
        return strict(b.fadd(acc, hsum(b, b.load(self.off))))


def _widen(b, v, n):
    """The float vector v with zero lanes appended up to n lanes (v itself if it has n)."""
    k = v.type.count
    if k == n:
        return v
    zeros = ir.Constant(v.type, [0.0] * k)
    return b.shuffle_vector(v, zeros, ir.Constant(ir.VectorType(I32, n), list(range(k)) + [k] * (n - k)))


def k45_scales(b, bp):
    """A Q4_K / Q5_K block's eight (scale, min) pairs as one <16 x float>: d sc_j in lane j, -dmin m_j in lane 8 + j
    (w = d sc_j q + (-dmin m_j)).
    The 6-bit fields are unpacked as llama.cpp's get_scale_min_k4, four at a time in 32-bit words (q0, q1, q2: the
    12 bytes at bp + 4): bytewise, sc_0..3 = q0 & 63, m_0..3 = q1 & 63, sc_4..7 = (q2 & 15) | (q0 >> 6) << 4 and
    m_4..7 = (q2 >> 4) | (q1 >> 6) << 4. In general-purpose registers, which the GEMVs leave idle: in vector lanes the
    same unpacking took the vector units that bound the kernel (docs/performance.md, "K-quant scales in
    general-purpose registers"). Each lane's product is a scalar decode's."""
    q0, q1, q2 = (load(b, b.add(bp, I64(4 + 4 * k)), I32, 1) for k in range(3))
    mask = lambda word, bits: b.and_(word, ir.Constant(I32, bits))  # noqa: E731
    top = lambda word: b.shl(mask(b.lshr(word, ir.Constant(I32, 6)), 0x03030303), ir.Constant(I32, 4))  # noqa: E731
    sc_hi = b.or_(mask(q2, 0x0F0F0F0F), top(q0))
    m_hi = b.or_(mask(b.lshr(q2, ir.Constant(I32, 4)), 0x0F0F0F0F), top(q1))
    # two 64-bit moves into the vector, not four of 32
    pair = lambda lo, hi: b.or_(b.zext(lo, I64), b.shl(b.zext(hi, I64), I64(32)))  # noqa: E731
    v = ir.Constant(ir.VectorType(I64, 2), ir.Undefined)
    v = b.insert_element(v, pair(mask(q0, 0x3F3F3F3F), sc_hi), I32(0))
    v = b.insert_element(v, pair(mask(q1, 0x3F3F3F3F), m_hi), I32(1))
    dm = b.fmul(b.fpext(_two_halves(b, bp), V2F), ir.Constant(V2F, [1.0, -1.0]))        # (d, -dmin)
    return b.fmul(b.uitofp(b.bitcast(v, V16I8), V16F), lanes(b, dm, [0] * 8 + [1] * 8))


def _emit_k45(rows, kind, bp, e):
    """One Q4_K / Q5_K block at address bp, input from element e, for each of rows (_Row): run c holds the low
    nibbles of bytes 32c..32c+31 (sub-block 2c) then their high nibbles (2c + 1), Q5_K's fifth bits from qh bits 2c
    and 2c + 1."""
    b = rows[0].b
    scales = k45_scales(b, bp)
    qs = 48 if kind == Q5_K else 16
    qh = load(b, b.add(bp, I64(16)), V32I8, 1) if kind == Q5_K else None
    for c in range(4):
        nib = load(b, b.add(bp, I64(qs + 32 * c)), V32I8, 1)
        w = concat(b, b.and_(nib, i8s(15, 32)), b.lshr(nib, i8s(4, 32)))
        if qh is not None:
            fifth = concat(b, b.lshr(qh, i8s(2 * c, 32)), b.lshr(qh, i8s(2 * c + 1, 32)))
            w = b.or_(w, b.shl(b.and_(fifth, i8s(1, 64)), i8s(4, 64)))
        for row in rows:
            row.run(w, b.add(e, I64(64 * c)), lanes(b, scales, [2 * c] * 8 + [2 * c + 1] * 8))
    for row in rows:
        row.offsets(e, lanes(b, scales, [8 + j // 2 for j in range(16)]))     # w = d sc q - dmin m


def _emit_q6_k(rows, bp, e):
    """One Q6_K block at address bp (layout in blocks.py), input from element e, for each of rows: in half n, run a
    holds the nibbles a of ql bytes 64n..64n+63 with qh bits 4a (first 32) and 4a + 2 (next 32) of bytes
    32n..32n+31."""
    b = rows[0].b
    scales = b.fmul(half_splat(b, b.add(bp, I64(208))), b.sitofp(load(b, b.add(bp, I64(192)), V16I8, 1), V16F))
    for n in range(2):
        ql = load(b, b.add(bp, I64(64 * n)), V64I8, 1)
        qh = load(b, b.add(bp, I64(128 + 32 * n)), V32I8, 1)
        for a in range(2):
            low = b.and_(b.lshr(ql, i8s(4 * a, 64)), i8s(15, 64))
            high = concat(b, b.lshr(qh, i8s(4 * a, 32)), b.lshr(qh, i8s(4 * a + 2, 32)))
            w = b.or_(low, b.shl(b.and_(high, i8s(3, 64)), i8s(4, 64)))
            for row in rows:
                row.run(w, b.add(e, I64(128 * n + 64 * a)),
                        lanes(b, scales, [8 * n + 4 * a + l // 4 for l in range(16)]))
    for row in rows:
        row.offsets(e, b.fmul(scales, ir.Constant(V16F, [-32.0] * 16)))          # w = d sc (q - 32)


def _nibbles(b, addrs):
    """The 4-bit codes of one or two blocks' 16 bytes at addrs as <32 len(addrs) x i8>, block by block: the low
    nibbles (elements 0..15), then the high ones (16..31). Two blocks' bytes are split in one 32-byte vector and put
    in order by one shuffle (a split and an insert per block took three more instructions a run)."""
    nib = [load(b, a, V16I8, 1) for a in addrs]
    nib = nib[0] if len(addrs) == 1 else concat(b, *nib)
    n = nib.type.count
    low, high = b.and_(nib, i8s(15, n)), b.lshr(nib, i8s(4, n))
    order = [j for i in range(0, n, 16) for j in [*range(i, i + 16), *range(n + i, n + i + 16)]]
    return b.shuffle_vector(low, high, ir.Constant(ir.VectorType(I32, 2 * n), order))


def _small_codes(b, kind, bps):
    """The codes of one or two blocks of 32 at addresses bps as <32 len(bps) x i8>, block by block: Q4_0's and
    Q4_1's nibbles, Q5_0's and Q5_1's with their fifth bits from the uint32 qh just before the nibbles (bit j
    belongs to element j), Q8_0's signed bytes."""
    at = CODES_AT[kind]
    if kind == Q4_0 or kind == Q4_1:
        return _nibbles(b, [b.add(bp, I64(at)) for bp in bps])
    if kind == Q8_0:
        codes = [load(b, b.add(bp, I64(at)), V32I8, 1) for bp in bps]
    else:   # Q5_0, Q5_1 block by block: both blocks' nibbles in one shuffle ran 5x slower in the AVX2 code
        fifth = ir.VectorType(ir.IntType(1), 32)
        codes = [b.or_(_nibbles(b, [b.add(bp, I64(at))]),
                       b.select(b.bitcast(load(b, b.add(bp, I64(at - 4)), I32, 1), fifth), i8s(16, 32), i8s(0, 32)))
                 for bp in bps]
    return codes[0] if len(bps) == 1 else concat(b, *codes)


def _two_halves(b, addr):
    """The two float16s at addr as <2 x half>: one 32-bit load, which waits on no register (vector_ir.half_splat
    says why that matters; a lane inserted into a register here chained every run to the last one's m terms)."""
    return b.bitcast(load(b, addr, I32, 1), ir.VectorType(ir.HalfType(), 2))


def _emit_small(rows, kind, bp, e, blocks_in_run):
    """One run of blocks of 32 (two, or a row's odd last one) at address bp, input from element e, for each of
    rows, each block scaled by its d. Q4_0's and Q5_0's w = d (q - MINUS): q . x minus MINUS times the lanes' code
    sums. WITH_M's w = d q + m: q . x, and m times its groups' sums of x^ (m_terms). Q8_0's codes are signed: their
    signs move to the input's codes."""
    b = rows[0].b
    bps = [bp] if blocks_in_run == 1 else [bp, b.add(bp, I64(GGUF_TYPES[kind].nbytes))]
    q = _small_codes(b, kind, bps)
    dm = _two_halves(b, bp)                 # (d, m) of WITH_M; d and the next two bytes of the others
    if blocks_in_run == 2:
        dm = concat(b, dm, _two_halves(b, bps[1]))
    dm = b.fpext(dm, ir.VectorType(F32, dm.type.count))
    d = lanes(b, dm, [0] * 8 + [2] * 8 if blocks_in_run == 2 else [0] * 8)
    m = lanes(b, dm, [1, 1, 3, 3] if blocks_in_run == 2 else [1, 1]) if kind in WITH_M else None
    for row in rows:
        row.run(q, e, d, minus=MINUS.get(kind, 0), signed=kind == Q8_0)
        if m is not None:
            row.m_terms(e, m)


def _emit_rows(b, code, p, nb, rows):
    """The dots of the row of nb blocks of type code at address p (i64) with each of rows' inputs, as float32s."""
    nbytes = GGUF_TYPES[code].nbytes
    if code in SMALL:
        with cgutils.for_range(b, b.udiv(nb, I64(2))) as loop:
            _emit_small(rows, code, b.add(p, b.mul(loop.index, I64(2 * nbytes))), b.mul(loop.index, I64(64)), 2)
        last = b.sub(nb, I64(1))
        with b.if_then(b.trunc(nb, ir.IntType(1))):
            _emit_small(rows, code, b.add(p, b.mul(last, I64(nbytes))), b.mul(last, I64(32)), 1)
    else:
        with cgutils.for_range(b, nb) as loop:
            bp = b.add(p, b.mul(loop.index, I64(nbytes)))
            e = b.mul(loop.index, I64(256))
            if code == Q6_K:
                _emit_q6_k(rows, bp, e)
            else:
                _emit_k45(rows, code, bp, e)
    return [row.total(code) for row in rows]


@intrinsic
def row_dot(typingctx, kind, p, nb, codes, residues, dx4, sums, lane_sums):
    """An intrinsic (kind, p, nb, codes, residues, dx4, sums, lane_sums) -> float32: the dot of the row of nb blocks
    of kind (one of KINDS; each type's code is a case of a switch on kind) at address p with the input
    quantize_input made (its arrays' addresses)."""
    if not all(isinstance(a, types.Integer) for a in (kind, p, nb, codes, residues, dx4, sums, lane_sums)):
        return None

    def codegen(context, builder, sig, args):
        emit = lambda code: _emit_rows(builder, code, args[1], args[2], [_Row(builder, *args[3:])])[0]  # noqa: E731
        return vector_ir.by_value(builder, context.cast(builder, args[0], sig.args[0], types.int64), KINDS, emit, F32)
    return types.float32(kind, *[types.int64] * 7), codegen


@intrinsic
def _row_dots(typingctx, k, p, nb, codes, residues, dx4, sums, lane_sums, cols, y, y_stride):
    """An intrinsic: the dots of the Q4_1 row of nb blocks at address p with k (1..GROUP_TOKENS) inputs, token t's
    arrays at row t of quantize_into's [tokens, ...] arrays for inputs of cols elements (codes and residues + t
    cols, dx4 + t cols, sums + t cols / 4, lane_sums + t cols bytes); token t's result is stored at y + t y_stride
    bytes. Each token takes the operations row_dot takes for it alone."""
    if not all(isinstance(a, types.Integer) for a in (k, p, nb, codes, residues, dx4, sums, lane_sums, cols, y,
                                                      y_stride)):
        return None

    def codegen(context, builder, sig, args):
        k, p, nb, codes, residues, dx4, sums, lane_sums, cols, y, y_stride = args

        def emit(n):
            at = lambda base, t, per=1: builder.add(base, builder.mul(builder.udiv(cols, I64(per)), I64(t)))  # noqa
            rows = [_Row(builder, at(codes, t), at(residues, t), at(dx4, t), at(sums, t, 4), at(lane_sums, t))
                    for t in range(n)]
            for t, total in enumerate(_emit_rows(builder, Q4_1, p, nb, rows)):
                out = vector_ir.pointer(builder, builder.add(y, builder.mul(y_stride, I64(t))), F32)
                builder.store(total, out, align=4)
        vector_ir.by_value(builder, k, range(1, GROUP_TOKENS + 1), emit)
        return context.get_dummy_value()
    return types.void(*[types.int64] * 11), codegen


@njit(**JIT)
def gemv(kind, q, x, y, lo, hi):
    """y[r] = row r of q (uint8 [rows, row bytes], blocks of kind, one of KINDS) dotted with x rounded by
    quantize_input, for r in [lo, hi). Each call rounds x itself (microseconds); gemv_rounded takes x rounded once
    for several matrices."""
    if hi <= lo:
        return
    gemv_rounded(kind, q, quantize_input(x), y, lo, hi)


@njit(**JIT)
def gemv_rounded(kind, q, xr, y, lo, hi):
    """gemv of an input already rounded: xr = quantize_input(x). Q4_1X16 (q4_groups): lo and hi multiples of
    GROUP_ROWS."""
    if hi <= lo:
        return
    if kind == Q4_1X16:
        q4_groups.gemv(q, xr, y, lo, hi)
        return
    codes, residues, dx4, sums, lane_sums = xr
    cols = codes.shape[0]
    nb = cols // BLOCK_OF[kind]
    base = q.ctypes.data
    ahead = max(PREFETCH_ROWS, AHEAD_BYTES[kind] // q.shape[1])
    into_l2 = ahead_into_l2(3 * cols + sums.nbytes + lane_sums.nbytes, q.shape[1], ahead)
    for r in range(lo, min(hi, lo + ahead)):    # the first rows too, which the loop's prefetches do not reach
        prefetch_lines(q, r, into_l2)
    for r in range(lo, hi):
        if r + ahead < hi:
            prefetch_lines(q, r + ahead, into_l2)
        y[r] = row_dot(kind, base + r * q.strides[0], nb, codes.ctypes.data, residues.ctypes.data, dx4.ctypes.data,
                       sums.ctypes.data, lane_sums.ctypes.data)


@njit(**JIT)
def gemm(kind, q, x, y, nt, lo, hi):
    """The batched decode's GEMM of Q4_1 or Q4_1X16 (kind): y[t, r] = gemv's y[r] for input x[t], bit for bit, for
    t < nt and r in [lo, hi) (q uint8 [rows, row bytes] of those blocks; x float32 [>= nt, >= cols]; y float32
    [>= nt, >= hi]; rows of x and y contiguous; Q4_1X16: lo and hi multiples of GROUP_ROWS). Each row is read from
    memory once for up to GROUP_TOKENS tokens; a wider batch re-reads it from L1 for the next group."""
    if nt == 1:
        gemv(kind, q, x[0], y[0], lo, hi)
        return
    if hi <= lo:
        return
    nb = q.shape[1] // Q4_1_BYTES
    cols = nb * BLOCK_OF[Q4_1]
    codes, residues = np.empty((nt, cols), np.int8), np.empty((nt, cols), np.int8)
    dx4, lane_sums = np.empty((nt, cols // 4), np.float32), np.empty((nt, cols // 4), np.int32)
    sums = np.empty((nt, cols // GROUP), np.float32)
    for t in range(nt):
        quantize_into(x[t, :cols], codes[t], residues[t], dx4[t], sums[t], lane_sums[t])
    base = q.ctypes.data
    if kind == Q4_1X16:
        q4_groups.gemm(q, codes, residues, dx4, sums, y, nt, lo, hi)
        return
    into_l2 = ahead_into_l2(min(nt, GROUP_TOKENS) * 4 * cols, q.shape[1], PREFETCH_ROWS)
    for r in range(lo, hi):
        if r + PREFETCH_ROWS < hi:
            prefetch_lines(q, r + PREFETCH_ROWS, into_l2)
        for g in range(0, nt, GROUP_TOKENS):
            _row_dots(min(GROUP_TOKENS, nt - g), base + r * q.strides[0], nb, codes[g].ctypes.data,
                      residues[g].ctypes.data, dx4[g].ctypes.data, sums[g].ctypes.data, lane_sums[g].ctypes.data, cols,
                      y.ctypes.data + g * y.strides[0] + 4 * r, y.strides[0])
