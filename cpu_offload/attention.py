"""Host attention for one decode token over a float16 KV cache: the host decode's ATTN stage.

The cache holds keys and values as IEEE float16 bits (uint16 here, jnp.float16 in XLA), [S, KV, hd] per layer
(pjinfer.runtime.model.KVCache without its batch axis); every product and sum is float32. A float16 value is widened with
LLVM's ``fpext half`` (one vcvtph2ps per 8 or 16 values with F16C) and narrowed with ``fptrunc`` (round to
nearest even: numpy's ``astype(np.float16)``, XLA's convert).

How a team of n threads shares one token's attention (``share``, ``attend_share``, ``merge``):
- long context (pos + 1 >= n * MIN_CHUNK): the positions are split into n contiguous chunks; each thread runs
  every query head over its chunk (a GQA group's heads read the same key and value rows, the later ones from
  cache), and leaves an unnormalized partial (its max score, its sum of exponentials, its weighted value sum) in the first
  hd + 2 score slots of its chunk; the caller ``merge``s the n partials per head (split-softmax, as in
  flash-decoding). Each thread streams a contiguous stretch of the cache.
- short context: the query heads are split; each thread writes its heads' outputs directly (merge is a no-op).

The two products over the positions are LLVM vector IR (``_dots``, ``_weighted``), one case per head_dim / 16
and per count of heads taken together (vector_ir.by_value): the query heads of one KV head (a GQA group, as many
as REGISTER_BUDGET allows) share each key row, widened once from float16 in registers, against their vectors, held
in registers across the positions, and each head sums 16 rows' products at once by a shuffle tree; their values sum
rows of V, widened once, weighted by each head's probabilities into accumulators held in registers (Numba's loops
kept them in memory, and summed each score's products alone). Each head's arithmetic is the same whichever heads
share its rows. head_dim must be a multiple of LANES (every real model's is; the host decoders refuse others).

Usage (inside Numba)::

    store(k_row_f32, v_row_f32, k_cache_u16[pos], v_cache_u16[pos])   # cache[pos] = k, v as float16
    attend_share(q, k_cache, v_cache, pos, tid, n, scores, out)        # team stage, every tid in 0..n-1
    merge(pos, n, scores, out)                                         # caller, after the stage

q [H, hd] float32 (RoPE applied), caches uint16 [>= pos + 1, KV, hd], scores float32 [H, >= pos + 1] (scratch),
out float32 [H, hd]. H a multiple of KV; q's rows, each cache row's hd values and scores' rows contiguous (the IR
products read them by address).
"""
from __future__ import annotations

from ._numba import JIT  # (first: the threading layer and the BLAS check, before numba is imported)

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import ffi, vector_ir  # noqa: E402
from .vector_ir import F32, I64, V16F, load, splat, strict  # noqa: E402

ffi.purge_stale_cache("attention", vector_ir)  # the products' IR is compiled into this module's cached functions

_F0 = np.float32(0.0)
_ONE = np.float32(1.0)
PARTIAL_EXTRA = 2   # a chunk's partial: max score, sum of exponentials, then hd weighted value sums
MIN_CHUNK = 128     # positions per thread below which the heads are split instead (and at least hd + 2)
LANES = 16          # float32 lanes of one vector: head_dim is a whole number of them
MAX_CHUNKS = 16     # head_dim up to 256
MAX_TOGETHER = 4    # query heads of one KV head that one call of the products takes together
# 16-lane query vectors (heads together x chunks) one call keeps in registers: 12 of AVX-512's 32 (more heads together
# spilled); AVX2's 16 registers hold 8 such vectors, and 4 keeps the one-head-a-call form at head_dim 64
REGISTER_BUDGET = 12 if vector_ir.cpu_has("avx512f") else 4
_V16H = ir.VectorType(ir.HalfType(), LANES)


@intrinsic
def f32_to_f16(typingctx, x):
    """IEEE float16 bits (uint16) of float32 x, rounded to nearest even (numpy's astype(np.float16))."""
    if not isinstance(x, types.Float) or x.bitwidth != 32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(x), codegen


@njit(**JIT)
def store(k, v, k_row, v_row):
    """k_row, v_row (uint16 [KV, hd], a cache's row at one position) <- k, v (float32 [KV * hd]) as float16."""
    kf = k_row.reshape(-1)
    vf = v_row.reshape(-1)
    for j in range(kf.shape[0]):
        kf[j] = f32_to_f16(k[j])
        vf[j] = f32_to_f16(v[j])


# exp(x) for x <= 0 as 2^k * p(r), k = round(x log2 e), |r| <= ln2 / 2, p the degree-6 Taylor polynomial
# (relative error 4e-7 over [-87, 0]), 2^k built from its exponent bits (_pow2). Unlike libm's expf, or a table
# of 2^k (a gather), it vectorizes.
_EXP_MIN = np.float32(-87.0)
_LOG2E = np.float32(1.4426950408889634)
_LN2 = np.float32(0.6931471805599453)
_HALF = np.float32(0.5)
_C1, _C2, _C3, _C4, _C5, _C6 = (np.float32(1.0 / f) for f in (1, 2, 6, 24, 120, 720))


@intrinsic
def _pow2(typingctx, k):
    """2^k as float32 for an int32 k in [-126, 127]: the bits (k + 127) << 23."""
    if not isinstance(k, types.Integer) or k.bitwidth != 32:
        return None

    def codegen(context, builder, sig, args):
        bits = builder.shl(builder.add(args[0], ir.Constant(ir.IntType(32), 127)), ir.Constant(ir.IntType(32), 23))
        return builder.bitcast(bits, ir.FloatType())
    return types.float32(k), codegen


@njit(**JIT)
def exp_shifted(v, top):
    """v[s] <- exp(v[s] - top) for v[s] <= top; returns the sum."""
    total = _F0
    for s in range(v.shape[0]):
        x = max(v[s] - top, _EXP_MIN)
        k = np.floor(x * _LOG2E + _HALF)
        r = x - k * _LN2
        e = (_ONE + r * (_C1 + r * (_C2 + r * (_C3 + r * (_C4 + r * (_C5 + r * _C6)))))) * _pow2(np.int32(k))
        v[s] = e
        total += e
    return total


@njit(**JIT)
def share(pos, hd, tid, n, heads):
    """Thread tid's work: (lo, hi, qa, qb, split): positions [lo, hi) and query heads [qa, qb); split says the
    positions are divided (partials to merge) rather than the heads."""
    length = pos + 1
    if n > 1 and length >= n * (max(MIN_CHUNK, hd + PARTIAL_EXTRA) + n):  # every chunk >= hd + 2
        chunk = (length + n - 1) // n
        lo = tid * chunk
        return lo, min(length, lo + chunk), 0, heads, True
    per = (heads + n - 1) // n
    qa = min(heads, tid * per)
    return 0, length, qa, min(heads, qa + per), False


def _row(builder, rows, i, step, c):
    """IR: lanes 16c..16c+15 of float16 row i (at rows + i * step) widened to float32."""
    at = builder.add(builder.add(rows, builder.mul(i, step)), I64(2 * LANES * c))
    return builder.fpext(load(builder, at, _V16H, 2), V16F)


def _fold(builder, a, b, width):
    """IR: two vectors, each of 16 / width groups of width lanes (a group: partial sums of one row), as one vector of
    groups of width / 2: each group's first half plus its second half, a's groups first."""
    half, firsts, seconds = width // 2, [], []
    for base in (0, LANES):
        for g in range(LANES // width):
            firsts += [base + g * width + t for t in range(half)]
            seconds += [base + g * width + half + t for t in range(half)]
    pick = lambda lanes: builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), LANES), lanes))
    return strict(builder.fadd(pick(firsts), pick(seconds)))


# The most heads one call of _dots or _weighted takes together, by chunks - 1 (head_dim / 16 - 1): each row is
# widened once for all of them, and their query vectors (chunks each) and accumulators stay in the vector registers.
MOST_TOGETHER = tuple(max(1, min(MAX_TOGETHER, REGISTER_BUDGET // c)) for c in range(1, MAX_CHUNKS + 1))


def _passes(chunks):
    """The head counts the products emit a case for at this chunk count."""
    return range(1, MOST_TOGETHER[chunks - 1] + 1)


def _emit_by_size(builder, chunks, together, emit):
    """IR: emit(c, g) for the chunk count c == chunks and head count g == together (both known at run time)."""
    vector_ir.by_value(builder, chunks, range(1, MAX_CHUNKS + 1),
                       lambda c: vector_ir.by_value(builder, together, _passes(c), lambda g: emit(c, g)))


@intrinsic
def _dots(typingctx, chunks, together, n, q, rows, step, out, out_step):
    """out_g[i] = q_g . row i for i < n and each of `together` query heads g: q_g float32 [16 chunks] at address
    q + g * 64 * chunks, row i float16 [16 chunks] at rows + i * step bytes, out_g float32 at out + g * out_step
    (addresses as integers). Each row is widened once for all the heads. Per head and row the chunks' products go
    into one vector (an FMA chain in chunk order); 16 rows' vectors are then summed lane-wise by a fixed tree of
    _folds into one vector of their 16 dots (built as the rows come, the same tree), and the last n % 16 rows each
    by vector_ir.hsum."""
    if not all(isinstance(a, types.Integer) for a in (chunks, together, n, q, rows, step, out, out_step)):
        return None

    def codegen(context, builder, sig, args):
        chunks, together, n, q, rows, step, out, out_step = args
        fma = vector_ir.vector_intrinsic(builder, "llvm.fma", 3)

        def emit(c, heads):
            qv = [[load(builder, builder.add(q, I64(4 * LANES * (g * c + j))), V16F, 4) for j in range(c)]
                  for g in range(heads)]
            outs = [builder.add(out, builder.mul(out_step, I64(g))) for g in range(heads)]

            def products(i):
                row = [_row(builder, rows, i, step, j) for j in range(c)]
                found = []
                for g in range(heads):
                    acc = strict(builder.fmul(qv[g][0], row[0]))
                    for j in range(1, c):
                        acc = builder.call(fma, [qv[g][j], row[j], acc])
                    found.append(acc)
                return found
            blocks = builder.udiv(n, I64(LANES))
            with cgutils.for_range(builder, blocks) as loop:
                first = builder.mul(loop.index, I64(LANES))
                stacks = [[] for _ in range(heads)]   # (width, vector): a binary counter over the tree's levels
                for t in range(LANES):
                    for g, p in enumerate(products(builder.add(first, I64(t)))):
                        stack, width = stacks[g], LANES
                        while stack and stack[-1][0] == width:
                            p = _fold(builder, stack.pop()[1], p, width)
                            width //= 2
                        stack.append((width, p))
                for g in range(heads):
                    at = builder.add(outs[g], builder.mul(first, I64(4)))
                    builder.store(stacks[g][0][1], builder.inttoptr(at, V16F.as_pointer()), align=4)
            with cgutils.for_range(builder, builder.sub(n, builder.mul(blocks, I64(LANES)))) as loop:
                i = builder.add(builder.mul(blocks, I64(LANES)), loop.index)
                for g, p in enumerate(products(i)):
                    at = builder.add(outs[g], builder.mul(i, I64(4)))
                    builder.store(vector_ir.hsum(builder, p), builder.inttoptr(at, F32.as_pointer()), align=4)
        _emit_by_size(builder, chunks, together, emit)
        return context.get_dummy_value()
    return types.void(*[types.int64] * 8), codegen


@intrinsic
def _weighted(typingctx, chunks, together, n, p, p_step, rows, step, acc):
    """acc_g += sum over i < n of p_g[i] * row i for each of `together` heads g: acc_g float32 [16 chunks] at address
    acc + g * 64 * chunks, p_g float32 at p + g * p_step, row i float16 [16 chunks] at rows + i * step bytes. Each
    row is widened once for all the heads. Per head, even rows sum into one set of registers and odd rows into
    another, each in row order; acc_g + (even + odd) at the end."""
    if not all(isinstance(a, types.Integer) for a in (chunks, together, n, p, p_step, rows, step, acc)):
        return None

    def codegen(context, builder, sig, args):
        chunks, together, n, p, p_step, rows, step, acc = args
        fma = vector_ir.vector_intrinsic(builder, "llvm.fma", 3)
        zero = ir.Constant(V16F, [0.0] * LANES)

        def emit(c, heads):
            sets = [[[cgutils.alloca_once_value(builder, zero) for _ in range(c)] for _ in range(2)]
                    for _ in range(heads)]
            ps = [builder.add(p, builder.mul(p_step, I64(g))) for g in range(heads)]

            def add_row(i, parity):
                row = [_row(builder, rows, i, step, j) for j in range(c)]
                for g in range(heads):
                    w = splat(builder, load(builder, builder.add(ps[g], builder.mul(i, I64(4))), F32, 4))
                    regs = sets[g][parity]
                    for j in range(c):
                        builder.store(builder.call(fma, [w, row[j], builder.load(regs[j])]), regs[j])
            with cgutils.for_range(builder, builder.udiv(n, I64(2))) as loop:
                i = builder.mul(loop.index, I64(2))
                add_row(i, 0)
                add_row(builder.add(i, I64(1)), 1)
            with cgutils.if_unlikely(builder, builder.trunc(n, ir.IntType(1))):   # an odd last row
                add_row(builder.sub(n, I64(1)), 0)
            for g in range(heads):
                for j in range(c):
                    ptr = builder.inttoptr(builder.add(acc, I64(4 * LANES * (g * c + j))), V16F.as_pointer())
                    both = strict(builder.fadd(builder.load(sets[g][0][j]), builder.load(sets[g][1][j])))
                    builder.store(strict(builder.fadd(builder.load(ptr, align=4), both)), ptr, align=4)
        _emit_by_size(builder, chunks, together, emit)
        return context.get_dummy_value()
    return types.void(*[types.int64] * 8), codegen


@njit(**JIT)
def _together(h, qb, group, chunks):
    """Heads the call that starts at query head h (of heads up to qb) takes together: those of h's KV head, at most
    MOST_TOGETHER at this chunk count."""
    return min(MOST_TOGETHER[chunks - 1], qb - h, group - h % group)


@njit(**JIT)
def _scores(q, k, lo, hi, qa, qb, scores):
    """scores[h, s] = q[h] . k[s, h // group] / sqrt(hd) for s in [lo, hi), h in [qa, qb)."""
    heads, hd = q.shape
    group = heads // k.shape[1]
    scale = np.float32(1.0 / np.sqrt(hd))
    h = qa
    while h < qb:
        g = _together(h, qb, group, hd // LANES)
        _dots(hd // LANES, g, hi - lo, q[h].ctypes.data, k[lo:, h // group].ctypes.data, k.strides[0],
              scores[h, lo:hi].ctypes.data, scores.strides[0])
        h += g
    for h in range(qa, qb):
        for s in range(lo, hi):
            scores[h, s] *= scale


@njit(**JIT)
def _values(v, lo, hi, qa, qb, scores, acc):
    """acc[h] = sum over s in [lo, hi) of scores[h, s] * v[s, h // group], h in [qa, qb)."""
    heads, hd = acc.shape
    group = heads // v.shape[1]
    for h in range(qa, qb):
        for j in range(hd):
            acc[h, j] = _F0
    h = qa
    while h < qb:
        g = _together(h, qb, group, hd // LANES)
        _weighted(hd // LANES, g, hi - lo, scores[h, lo:hi].ctypes.data, scores.strides[0],
                  v[lo:, h // group].ctypes.data, v.strides[0], acc[h].ctypes.data)
        h += g


@njit(**JIT)
def attend_share(q, k, v, pos, tid, n, scores, out):
    """Thread tid of n's share of softmax(q K^T / sqrt(hd)) V over positions 0..pos (see the module docstring):
    head-split, its heads' rows of out; position-split, its chunk's partials in scores[:, lo:lo + hd + 2]."""
    heads, hd = q.shape
    lo, hi, qa, qb, split = share(pos, hd, tid, n, heads)
    if lo >= hi or qa >= qb:
        return
    acc = np.empty((heads, hd), np.float32)
    _scores(q, k, lo, hi, qa, qb, scores)
    tops = np.empty(heads, np.float32)
    sums = np.empty(heads, np.float32)
    for h in range(qa, qb):
        top = np.float32(-np.inf)
        for s in range(lo, hi):
            top = max(top, scores[h, s])
        tops[h] = top
        sums[h] = exp_shifted(scores[h, lo:hi], top)
    _values(v, lo, hi, qa, qb, scores, acc)
    for h in range(qa, qb):
        if split:
            part = scores[h, lo:lo + hd + PARTIAL_EXTRA]
            part[0] = tops[h]
            part[1] = sums[h]
            for j in range(hd):
                part[PARTIAL_EXTRA + j] = acc[h, j]
        else:
            inv = _ONE / sums[h]
            for j in range(hd):
                out[h, j] = acc[h, j] * inv


@njit(**JIT)
def merge(pos, n, scores, out):
    """After every thread's attend_share: out[h] from the chunks' partials when the positions were split."""
    heads, hd = out.shape
    if not share(pos, hd, 0, n, heads)[4]:
        return
    for h in range(heads):
        top = np.float32(-np.inf)
        for t in range(n):
            lo = share(pos, hd, t, n, heads)[0]
            top = max(top, scores[h, lo])
        total = _F0
        for j in range(hd):
            out[h, j] = _F0
        for t in range(n):
            lo = share(pos, hd, t, n, heads)[0]
            w = np.exp(scores[h, lo] - top)
            total += w * scores[h, lo + 1]
            for j in range(hd):
                out[h, j] += w * scores[h, lo + PARTIAL_EXTRA + j]
        inv = _ONE / total
        for j in range(hd):
            out[h, j] *= inv


def attend(q, k, v, pos, n=1):
    """Python entry for tests and benchmarks: out [H, hd] float32 from q [H, hd] and float16 caches
    [S, KV, hd] (numpy float16 or uint16), every thread's share run in turn on this thread."""
    q = np.ascontiguousarray(q, np.float32)
    k = np.ascontiguousarray(k).view(np.uint16)
    v = np.ascontiguousarray(v).view(np.uint16)
    scores = np.full((q.shape[0], k.shape[0]), np.nan, np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    for tid in range(n):
        attend_share(q, k, v, pos, tid, n, scores, out)
    merge(pos, n, scores, out)
    return out
