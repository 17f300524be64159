"""Host attention for one decode token over a float16 KV cache: the host decode's ATTN stage.

The cache holds keys and values as IEEE float16 bits (uint16 here, jnp.float16 in XLA), [S, KV, hd] per layer
(pjinfer.runtime.model.KVCache without its batch axis); every product and sum is float32. A float16 value is widened with
LLVM's ``fpext half`` (one vcvtph2ps per 8 or 16 values with F16C) and narrowed with ``fptrunc`` (round to
nearest even: numpy's ``astype(np.float16)``, XLA's convert).

How a team of n threads shares one token's attention (``share``, ``attend_share``, ``merge``):
- long context (pos + 1 >= n * MIN_CHUNK): the positions are split into n contiguous chunks; each thread runs
  every query head over its chunk, reading each key and value row once for the GQA group that shares it, and
  leaves an unnormalized partial (its max score, its sum of exponentials, its weighted value sum) in the first
  hd + 2 score slots of its chunk; the caller ``merge``s the n partials per head (split-softmax, as in
  flash-decoding). Each thread streams a contiguous stretch of the cache.
- short context: the query heads are split; each thread writes its heads' outputs directly (merge is a no-op).

Usage (inside Numba)::

    store(k_row_f32, v_row_f32, k_cache_u16[pos], v_cache_u16[pos])   # cache[pos] = k, v as float16
    attend_share(q, k_cache, v_cache, pos, tid, n, scores, out)        # team stage, every tid in 0..n-1
    merge(pos, n, scores, out)                                         # caller, after the stage

q [H, hd] float32 (RoPE applied), caches uint16 [>= pos + 1, KV, hd], scores float32 [H, >= pos + 1] (scratch),
out float32 [H, hd]. H a multiple of KV.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_JIT = dict(fastmath=True, cache=True, nogil=True)
_F0 = np.float32(0.0)
_ONE = np.float32(1.0)
PARTIAL_EXTRA = 2   # a chunk's partial: max score, sum of exponentials, then hd weighted value sums
MIN_CHUNK = 128     # positions per thread below which the heads are split instead (and at least hd + 2)


@intrinsic
def f16_to_f32(typingctx, h):
    """float32 value of the IEEE float16 bits h (uint16)."""
    if not isinstance(h, types.Integer) or h.bitwidth != 16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(h), codegen


@intrinsic
def f32_to_f16(typingctx, x):
    """IEEE float16 bits (uint16) of float32 x, rounded to nearest even (numpy's astype(np.float16))."""
    if not isinstance(x, types.Float) or x.bitwidth != 32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(x), codegen


@njit(**_JIT)
def store(k, v, k_row, v_row):
    """k_row, v_row (uint16 [KV, hd], a cache's row at one position) <- k, v (float32 [KV * hd]) as float16."""
    kf = k_row.reshape(-1)
    vf = v_row.reshape(-1)
    for j in range(kf.shape[0]):
        kf[j] = f32_to_f16(k[j])
        vf[j] = f32_to_f16(v[j])


# exp(x) for x <= 0 as 2^k * p(r), k = round(x log2 e), |r| <= ln2 / 2, p the degree-6 Taylor polynomial
# (relative error 4e-7 over [-87, 0]), 2^k from a table. Unlike libm's expf it vectorizes: one expf call per
# score cost 5-11% of attention (positions 512 and 144, float32 cache).
_POW2 = (2.0 ** np.arange(-126, 1)).astype(np.float32)
_EXP_MIN = np.float32(-87.0)
_LOG2E = np.float32(1.4426950408889634)
_LN2 = np.float32(0.6931471805599453)
_HALF = np.float32(0.5)
_C1, _C2, _C3, _C4, _C5, _C6 = (np.float32(1.0 / f) for f in (1, 2, 6, 24, 120, 720))


@njit(**_JIT)
def exp_shifted(v, top):
    """v[s] <- exp(v[s] - top) for v[s] <= top; returns the sum."""
    total = _F0
    for s in range(v.shape[0]):
        x = max(v[s] - top, _EXP_MIN)
        k = np.floor(x * _LOG2E + _HALF)
        r = x - k * _LN2
        e = (_ONE + r * (_C1 + r * (_C2 + r * (_C3 + r * (_C4 + r * (_C5 + r * _C6)))))) * _POW2[np.int32(k) + 126]
        v[s] = e
        total += e
    return total


@njit(**_JIT)
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


@njit(**_JIT)
def _scores(q, k, lo, hi, qa, qb, scores, row):
    """scores[h, s] = q[h] . k[s, h // group] / sqrt(hd) for s in [lo, hi), h in [qa, qb); row: float32 [hd]."""
    heads, hd = q.shape
    group = heads // k.shape[1]
    scale = np.float32(1.0 / np.sqrt(hd))
    for s in range(lo, hi):
        for kvh in range(qa // group, (qb - 1) // group + 1):
            src = k[s, kvh]
            for j in range(hd):
                row[j] = f16_to_f32(src[j])
            for h in range(max(qa, kvh * group), min(qb, (kvh + 1) * group)):
                t = _F0
                for j in range(hd):
                    t += q[h, j] * row[j]
                scores[h, s] = t * scale


@njit(**_JIT)
def _values(v, lo, hi, qa, qb, scores, acc, row):
    """acc[h] = sum over s in [lo, hi) of scores[h, s] * v[s, h // group], h in [qa, qb)."""
    heads, hd = acc.shape
    group = heads // v.shape[1]
    for h in range(qa, qb):
        for j in range(hd):
            acc[h, j] = _F0
    for s in range(lo, hi):
        for kvh in range(qa // group, (qb - 1) // group + 1):
            src = v[s, kvh]
            for j in range(hd):
                row[j] = f16_to_f32(src[j])
            for h in range(max(qa, kvh * group), min(qb, (kvh + 1) * group)):
                p = scores[h, s]
                for j in range(hd):
                    acc[h, j] += p * row[j]


@njit(**_JIT)
def attend_share(q, k, v, pos, tid, n, scores, out):
    """Thread tid of n's share of softmax(q K^T / sqrt(hd)) V over positions 0..pos (see the module docstring):
    head-split, its heads' rows of out; position-split, its chunk's partials in scores[:, lo:lo + hd + 2]."""
    heads, hd = q.shape
    lo, hi, qa, qb, split = share(pos, hd, tid, n, heads)
    if lo >= hi or qa >= qb:
        return
    row = np.empty(hd, np.float32)
    acc = np.empty((heads, hd), np.float32)
    _scores(q, k, lo, hi, qa, qb, scores, row)
    tops = np.empty(heads, np.float32)
    sums = np.empty(heads, np.float32)
    for h in range(qa, qb):
        top = np.float32(-np.inf)
        for s in range(lo, hi):
            top = max(top, scores[h, s])
        tops[h] = top
        sums[h] = exp_shifted(scores[h, lo:hi], top)
    _values(v, lo, hi, qa, qb, scores, acc, row)
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


@njit(**_JIT)
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
