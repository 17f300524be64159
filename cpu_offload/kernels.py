"""Numba CPU kernels for the cold FFN neurons, plus a plain numpy reference: ``cold_ffn`` for one token
(decode) and ``cold_ffn_masked_nt`` for many tokens of one layer (prefill, scoring: an [N, C] mask instead
of active lists, each row read once for all N tokens).

A neuron ``n`` is row ``n`` of ``w_gate`` [C, d] and ``w_up`` [C, d] and row ``n`` of ``w_down_t`` [C, d] (the
down projection stored transposed, so every neuron is three contiguous rows). For one token ``x`` [d] and an
active list ``ids[:count]`` (indices into the C rows, any order):

    out = sum_k act(w_gate[n_k] . x, w_up[n_k] . x + b_up[n_k]) * w_down_t[n_k]

Activations: ``act`` (cpu_offload.activation) is the activations' table in Numba, selected by code (swiglu
silu(g)*u, geglu gelu_tanh(g)*u, reglu relu(g)*u, drelu relu(g)*relu(u), relu relu(u), whose ``w_gate`` may be
empty, shape [0, d]). ``b_up`` is optional for every activation (pass an empty [0] array for none); OPT's fc1 bias
is the "relu" case.

Semantics shared by every entry point here and by the FFI bridge:
- ``out`` is overwritten, never accumulated into (a NaN-filled ``out`` comes back clean).
- ``count`` is clipped to [0, len(ids)]; ids outside [0, C) are skipped (so C == 0 gives exact zeros).
- Duplicated ids are computed as many times as they appear.
- x, out and biases are float32; ids are int32 (any integer dtype works for direct calls). Weights are float32
  (``scales`` = ``no_scales()``), or int8 rows with float32 scales [3, C, ceil(d / QBLOCK)] for gate, up and
  down, one per block of 64 elements (``int8.quantize``), dequantized inside the loops: 17/64 of the bytes.

Parallelism: the active list is cut into one contiguous chunk per thread; each thread accumulates into a private
[d] partial row, the partials are summed at the end. The masked kernel cuts the tokens instead (disjoint output
rows, nothing to sum). Small problems run serially, because a parallel launch costs
more than it saves there. Thread count is Numba's (``numba.set_num_threads``); see ``cpu_offload/__init__.py`` for
the threading layer (workqueue by default).
"""
from __future__ import annotations

from ._numba import JIT  # (first: the threading layer and the BLAS check, before numba is imported)

import numba  # noqa: E402
import numpy as np  # noqa: E402

from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import activation, ffi, vector_ir  # noqa: E402
from .activation import act, get as activation_named, reference as activation_reference  # noqa: E402

ffi.purge_stale_cache("kernels", activation, vector_ir)  # act's IR is compiled into this module's cached functions


# Below this many weight floats touched (count * d * rows), one thread does the whole job: waking a workqueue
# launch costs about as much as one core streaming 2^18 floats (1 MB) itself (docs/performance.md, "Measurements
# behind the code's choices").
SERIAL_FLOATS = 1 << 18
# Do not give a thread fewer than this many neurons.
MIN_NEURONS_PER_THREAD = 8

_F0 = np.float32(0.0)


L1_BYTES = 32 * 1024   # the smallest L1 data cache of this project's machine kinds (AMD Zen 3 and 4)


def _prefetch_intrinsic(locality: int, where: str):
    @intrinsic
    def prefetch(typingctx, arr, i, j):
        if not (isinstance(arr, types.Array) and arr.ndim == 2 and isinstance(i, types.Integer)
                and isinstance(j, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            idx = [context.cast(builder, args[k], sig.args[k], types.intp) for k in (1, 2)]
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, idx)
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(locality), i32(1)])
            return context.get_dummy_value()
        return types.void(arr, i, j), codegen
    prefetch.__doc__ = f"Software prefetch (read) of the cache line holding arr[i, j] {where}; no bounds check."
    return prefetch


prefetch = _prefetch_intrinsic(3, "into every cache level (prefetcht0)")
prefetch_l2 = _prefetch_intrinsic(2, "into L2 and L3, not L1 (prefetcht1)")


@njit(inline="always", **JIT)
def ahead_into_l2(input_bytes, row_bytes, rows_ahead):
    """Whether a GEMV should prefetch its rows ahead into L2 rather than L1: when its input and those rows would take
    more than three quarters of L1 (the lines streaming through need the rest). Prefetched into L1, the rows evict
    the input, which every row reads again (a Q4_1 down matrix of a 1.5B model, 7168 columns: a 28 KB input, 35 KB
    of rows 8 ahead). docs/performance.md, "Prefetch into L2"."""
    return input_bytes + rows_ahead * row_bytes > L1_BYTES * 3 // 4


@njit(inline="always", **JIT)
def prefetch_lines(rows, i, into_l2=False):
    """Prefetch every 64-byte line of row i of a byte matrix (uint8 or int8 [rows, row bytes]), into L1, or into
    L2 with into_l2."""
    for j in range(0, rows.shape[1], 64):
        if into_l2:
            prefetch_l2(rows, i, j)
        else:
            prefetch(rows, i, j)


PREFETCH_LINES = 4  # the first cache lines of a row; the hardware streamer takes over after that


@njit(inline="always", **JIT)
def _prefetch_row(w, n, d):
    step = 64 // w.itemsize  # elements per 64-byte line: 16 float32, 64 int8
    for j in range(0, min(d, PREFETCH_LINES * step), step):
        prefetch(w, n, j)


QBLOCK = 64  # int8 weights: one float32 scale per 64 consecutive elements of a row


# The int8 dot products look the scale up per element (scales[k, n, j // QBLOCK]) rather than summing block by
# block: LLVM vectorizes that form, while a horizontal sum per 32-element block measured several times slower.

@njit(inline="always", **JIT)
def _dot(w, n, x, scales, k):
    """Row n of w (float32, or int8 with scales[k, n, block]) dotted with x."""
    s = _F0
    if scales.shape[0] == 0:
        for j in range(x.shape[0]):
            s += w[n, j] * x[j]
    else:
        for j in range(x.shape[0]):
            s += np.float32(w[n, j]) * scales[k, n, j // QBLOCK] * x[j]
    return s


@njit(inline="always", **JIT)
def _gate_up(w_gate, w_up, n, x, scales):
    """(gate, up) dot products of neuron n in one pass over x (one loop: half the x loads of two _dot calls)."""
    g = _F0
    u = _F0
    if scales.shape[0] == 0:
        for j in range(x.shape[0]):
            g += w_gate[n, j] * x[j]
            u += w_up[n, j] * x[j]
    else:
        for j in range(x.shape[0]):
            g += np.float32(w_gate[n, j]) * scales[0, n, j // QBLOCK] * x[j]
            u += np.float32(w_up[n, j]) * scales[1, n, j // QBLOCK] * x[j]
    return g, u


@njit(inline="always", **JIT)
def _axpy(acc, a, w, n, scales, k):
    """acc += a * row n of w (float32, or int8 with scales[k, n, block])."""
    d = acc.shape[0]
    if scales.shape[0] == 0:
        for j in range(d):
            acc[j] += a * w[n, j]
        return
    full = d // QBLOCK
    for blk in range(full):  # a constant trip count of 64 vectorizes (32 measured several times slower)
        base = blk * QBLOCK
        ab = a * scales[k, n, blk]
        for j in range(QBLOCK):
            acc[base + j] += ab * np.float32(w[n, base + j])
    if full * QBLOCK < d:
        ab = a * scales[k, n, full]
        for j in range(full * QBLOCK, d):
            acc[j] += ab * np.float32(w[n, j])


@njit(inline="always", **JIT)
def _accumulate(x, w_gate, w_up, w_down_t, b_up, scales, ids, lo, hi, code, acc):
    """acc[:] += contribution of neurons ids[lo:hi] (acc is a private [d] row)."""
    d = x.shape[0]
    c = w_up.shape[0]
    gated = w_gate.shape[0] > 0
    biased = b_up.shape[0] > 0
    # Rows are visited in the active list's (random) order, so the hardware prefetcher misses each row's start:
    # prefetch the head of this neuron's down row and of the next neuron's gate/up rows while the dot products
    # run (faster from DRAM; prefetching whole rows was slower when cache-hot and no better from DRAM).
    for k in range(lo, hi):
        n = ids[k]
        if k + 1 < hi:
            m = ids[k + 1]
            if m >= 0 and m < c:
                _prefetch_row(w_up, m, d)
                if gated:
                    _prefetch_row(w_gate, m, d)
        if n < 0 or n >= c:
            continue
        _prefetch_row(w_down_t, n, d)
        if gated:
            g, u = _gate_up(w_gate, w_up, n, x, scales)
        else:
            g, u = _F0, _dot(w_up, n, x, scales, 1)
        if biased:
            u += b_up[n]
        a = np.float32(act(g, u, code))
        if a != _F0:  # exact zeros (the ReLU family) skip the down row entirely
            _axpy(acc, a, w_down_t, n, scales, 2)


@njit(**JIT)
def _cold_ffn_serial(x, w_gate, w_up, w_down_t, b_up, scales, ids, count, code, out):
    for j in range(out.shape[0]):
        out[j] = _F0
    _accumulate(x, w_gate, w_up, w_down_t, b_up, scales, ids, 0, count, code, out)


@njit(parallel=True, **JIT)
def _cold_ffn_parallel(x, w_gate, w_up, w_down_t, b_up, scales, ids, count, code, out, nt):
    d = x.shape[0]
    partial = np.zeros((nt, d), dtype=np.float32)
    for t in prange(nt):
        lo = (count * t) // nt
        hi = (count * (t + 1)) // nt
        _accumulate(x, w_gate, w_up, w_down_t, b_up, scales, ids, lo, hi, code, partial[t])
    for j in range(d):
        s = partial[0, j]
        for t in range(1, nt):
            s += partial[t, j]
        out[j] = s


@njit(**JIT)
def cold_ffn_nt(x, w_gate, w_up, w_down_t, b_up, scales, ids, count, act_code, out, max_threads):
    """``cold_ffn`` with an explicit upper bound on the threads used (1 = serial)."""
    count = min(max(count, 0), ids.shape[0])
    d = x.shape[0]
    rows = 3 if w_gate.shape[0] > 0 else 2
    nt = min(max_threads, count // MIN_NEURONS_PER_THREAD)
    if nt <= 1 or count * d * rows < SERIAL_FLOATS:
        _cold_ffn_serial(x, w_gate, w_up, w_down_t, b_up, scales, ids, count, act_code, out)
    else:
        _cold_ffn_parallel(x, w_gate, w_up, w_down_t, b_up, scales, ids, count, act_code, out, nt)


@njit(inline="always", **JIT)
def _neuron_one(xs, w_gate, w_up, w_down_t, b_up, scales, n, b, code, outs):
    """outs[b] += token b's contribution of neuron n."""
    if w_gate.shape[0] > 0:
        g, u = _gate_up(w_gate, w_up, n, xs[b], scales)
    else:
        g, u = _F0, _dot(w_up, n, xs[b], scales, 1)
    if b_up.shape[0] > 0:
        u += b_up[n]
    a = np.float32(act(g, u, code))
    if a != _F0:
        _axpy(outs[b], a, w_down_t, n, scales, 2)


@njit(inline="always", **JIT)
def _dot4(w, n, xs, b0, b1, b2, b3, scales, k):
    """Row n of w dotted with four tokens' x: each weight element loaded once for the four, which takes the
    loop from load-bound towards FMA-bound."""
    s0 = s1 = s2 = s3 = _F0
    if scales.shape[0] == 0:
        for j in range(xs.shape[1]):
            wj = w[n, j]
            s0 += wj * xs[b0, j]
            s1 += wj * xs[b1, j]
            s2 += wj * xs[b2, j]
            s3 += wj * xs[b3, j]
    else:
        for j in range(xs.shape[1]):
            wj = np.float32(w[n, j]) * scales[k, n, j // QBLOCK]
            s0 += wj * xs[b0, j]
            s1 += wj * xs[b1, j]
            s2 += wj * xs[b2, j]
            s3 += wj * xs[b3, j]
    return s0, s1, s2, s3


@njit(inline="always", **JIT)
def _axpy4(outs, b0, b1, b2, b3, c0, c1, c2, c3, w, n, lo, hi):
    for j in range(lo, hi):
        wd = np.float32(w[n, j])
        outs[b0, j] += c0 * wd
        outs[b1, j] += c1 * wd
        outs[b2, j] += c2 * wd
        outs[b3, j] += c3 * wd


@njit(inline="always", **JIT)
def _neuron_four(xs, w_gate, w_up, w_down_t, b_up, scales, n, b0, b1, b2, b3, code, outs):
    """outs[b0..b3] += the contributions of neuron n to four tokens."""
    g0 = g1 = g2 = g3 = _F0
    if w_gate.shape[0] > 0:
        g0, g1, g2, g3 = _dot4(w_gate, n, xs, b0, b1, b2, b3, scales, 0)
    u0, u1, u2, u3 = _dot4(w_up, n, xs, b0, b1, b2, b3, scales, 1)
    bias = b_up[n] if b_up.shape[0] > 0 else _F0
    a0 = np.float32(act(g0, u0 + bias, code))
    a1 = np.float32(act(g1, u1 + bias, code))
    a2 = np.float32(act(g2, u2 + bias, code))
    a3 = np.float32(act(g3, u3 + bias, code))
    d = xs.shape[1]
    if scales.shape[0] == 0:
        _axpy4(outs, b0, b1, b2, b3, a0, a1, a2, a3, w_down_t, n, 0, d)
        return
    full = d // QBLOCK
    for blk in range(full):
        scale = scales[2, n, blk]
        _axpy4(outs, b0, b1, b2, b3, a0 * scale, a1 * scale, a2 * scale, a3 * scale, w_down_t, n, blk * QBLOCK,
               blk * QBLOCK + QBLOCK)
    if full * QBLOCK < d:
        scale = scales[2, n, full]
        _axpy4(outs, b0, b1, b2, b3, a0 * scale, a1 * scale, a2 * scale, a3 * scale, w_down_t, n, full * QBLOCK, d)


@njit(**JIT)
def _masked_range(xs, w_gate, w_up, w_down_t, b_up, scales, mask, code, outs, lo, hi):
    """outs[lo:hi] = the cold FFN of tokens lo..hi-1, where token b computes neuron n iff mask[b, n].
    Neuron-major: each row is read from memory once for all the tokens of the range."""
    d = xs.shape[1]
    for b in range(lo, hi):
        for j in range(d):
            outs[b, j] = _F0
    tokens = np.empty(hi - lo, np.int64)
    for n in range(w_up.shape[0]):
        m = 0
        for b in range(lo, hi):
            if mask[b, n]:
                tokens[m] = b
                m += 1
        i = 0
        while i + 4 <= m:
            _neuron_four(xs, w_gate, w_up, w_down_t, b_up, scales, n, tokens[i], tokens[i + 1], tokens[i + 2],
                         tokens[i + 3], code, outs)
            i += 4
        while i < m:
            _neuron_one(xs, w_gate, w_up, w_down_t, b_up, scales, n, tokens[i], code, outs)
            i += 1


@njit(parallel=True, **JIT)
def _masked_parallel(xs, w_gate, w_up, w_down_t, b_up, scales, mask, code, outs, nt):
    nb = xs.shape[0]
    for t in prange(nt):  # one contiguous range of tokens per thread: disjoint output rows, no reduction
        _masked_range(xs, w_gate, w_up, w_down_t, b_up, scales, mask, code, outs, (nb * t) // nt,
                      (nb * (t + 1)) // nt)


@njit(**JIT)
def cold_ffn_masked_nt(xs, w_gate, w_up, w_down_t, b_up, scales, mask, act_code, outs, max_threads):
    """The cold FFN of many tokens of one layer at once: xs [N, d] f32, mask [N, C] (bool or uint8: token b
    computes row n iff mask[b, n]) -> outs [N, d] (overwritten). Each row is read from memory once per call,
    not once per token, which is what makes prefill and scoring of many tokens affordable."""
    nb = xs.shape[0]
    rows = 3 if w_gate.shape[0] > 0 else 2
    nt = min(max_threads, nb)
    if nt <= 1 or nb * w_up.shape[0] * xs.shape[1] * rows < SERIAL_FLOATS:
        # lo as an int64, not the literal 0: the parallel form's calls type it so, and a literal would make a second
        # specialization of _masked_range, compiled apart
        _masked_range(xs, w_gate, w_up, w_down_t, b_up, scales, mask, act_code, outs, np.int64(0), nb)
    else:
        _masked_parallel(xs, w_gate, w_up, w_down_t, b_up, scales, mask, act_code, outs, nt)


@njit(fastmath=True, nogil=True)  # not cached: numba.get_num_threads() is a dynamic global
def cold_ffn(x, w_gate, w_up, w_down_t, b_up, scales, ids, count, act_code, out):
    """out[:] = sum over the active cold neurons ids[:count] (see the module docstring). Returns nothing.

    x [d] f32; w_gate [C, d] or [0, d]; w_up, w_down_t [C, d] (C-contiguous), float32, or int8 with
    scales [3, C, ceil(d / QBLOCK)] f32 (gate, up, down block scales; ``int8.quantize``), or ``no_scales()``;
    b_up [C] f32 or [0]; ids [K] int; count int; act_code from act_code(); out [d] f32 (overwritten). Uses
    numba.get_num_threads() threads of the calling thread.
    """
    cold_ffn_nt(x, w_gate, w_up, w_down_t, b_up, scales, ids, count, act_code, out, numba.get_num_threads())


def act_code(activation: str) -> int:
    return activation_named(activation).code


def empty_gate(d: int) -> np.ndarray:
    return np.zeros((0, d), np.float32)


def empty_bias() -> np.ndarray:
    return np.zeros((0,), np.float32)


def no_scales() -> np.ndarray:
    """The scales argument for float32 weights."""
    return np.zeros((0, 0, 0), np.float32)


def cold_ffn_call(x, w_gate, w_up, w_down_t, b_up, ids, count, activation, out=None) -> np.ndarray:
    """Convenience wrapper around ``cold_ffn`` for float32 weights: None for w_gate / b_up, activation by name,
    allocates out."""
    x = np.ascontiguousarray(x, np.float32)
    d = x.shape[0]
    w_gate = empty_gate(d) if w_gate is None else np.ascontiguousarray(w_gate, np.float32)
    b_up = empty_bias() if b_up is None else np.ascontiguousarray(b_up, np.float32)
    if out is None:
        out = np.empty(d, np.float32)
    cold_ffn(x, w_gate, np.ascontiguousarray(w_up, np.float32), np.ascontiguousarray(w_down_t, np.float32), b_up,
             no_scales(), np.ascontiguousarray(ids, np.int32), int(count), act_code(activation), out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# A decode layer's vector work on the calling thread (cpu_offload.host_decode, batched_decode)

@njit(**JIT)
def rmsnorm(x, scale, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * scale (float32 [d] each)."""
    ss = _F0
    for j in range(x.shape[0]):
        ss += x[j] * x[j]
    r = np.float32(1.0) / np.sqrt(ss / np.float32(x.shape[0]) + eps)
    for j in range(x.shape[0]):
        out[j] = x[j] * r * scale[j]


@njit(**JIT)
def rope(v, heads, hd, inv_freq, pos):
    """Rotate-half RoPE in place on v = [heads * hd] at position pos (pjinfer.runtime.model.rope's layout)."""
    half = hd // 2
    for i in range(half):
        angle = np.float32(pos) * inv_freq[i]
        c = np.cos(angle)
        s = np.sin(angle)
        for h in range(heads):
            a = v[h * hd + i]
            b = v[h * hd + half + i]
            v[h * hd + i] = a * c - b * s
            v[h * hd + half + i] = b * c + a * s


# ----------------------------------------------------------------------------------------------------------------
# numpy reference (float64 internally)

def cold_ffn_ref(x, w_gate, w_up, w_down_t, b_up, ids, count, activation) -> np.ndarray:
    """Plain numpy version of ``cold_ffn`` with the same clipping rules; returns float32 [d]."""
    x = np.asarray(x, np.float64)
    ids = np.asarray(ids)[: max(0, min(int(count), len(ids)))]
    c = np.asarray(w_up).shape[0]
    ids = ids[(ids >= 0) & (ids < c)]
    if ids.size == 0:
        return np.zeros(x.shape[0], np.float32)
    u = np.asarray(w_up, np.float64)[ids] @ x
    if b_up is not None and np.asarray(b_up).size:
        u = u + np.asarray(b_up, np.float64)[ids]
    gated = w_gate is not None and np.asarray(w_gate).shape[0] > 0
    g = np.asarray(w_gate, np.float64)[ids] @ x if gated else np.zeros_like(u)
    a = activation_reference(activation, g, u)
    return (a @ np.asarray(w_down_t, np.float64)[ids]).astype(np.float32)


def dense_ffn_ref(x, w_gate, w_up, w_down_t, b_up, activation) -> np.ndarray:
    """The dense FFN over all C rows (what cold_ffn computes for count == C with every id once)."""
    x = np.asarray(x, np.float64)
    u = np.asarray(w_up, np.float64) @ x
    if b_up is not None and np.asarray(b_up).size:
        u = u + np.asarray(b_up, np.float64)
    g = np.asarray(w_gate, np.float64) @ x if activation != "relu" else np.zeros_like(u)
    return (activation_reference(activation, g, u) @ np.asarray(w_down_t, np.float64)).astype(np.float32)


def _start_numba_threads() -> None:
    """Start Numba's thread pool now. A parallel function reached only through a cached caller (or through the FFI
    cfunc) never goes through its own dispatcher, which is where Numba normally starts the pool; without this the
    first such launch crashes (seen with numba 0.68). Runs after cpu_offload/__init__ chose the threading layer."""
    try:
        from numba.np.ufunc import parallel as _parallel

        _parallel._launch_threads()
    except Exception:  # pragma: no cover - private API moved: fall back to a real parallel launch
        _cold_ffn_parallel(np.zeros(1, np.float32), np.zeros((0, 1), np.float32), np.zeros((0, 1), np.float32),
                           np.zeros((0, 1), np.float32), np.zeros(0, np.float32), no_scales(), np.zeros(0, np.int32),
                           0, 0, np.zeros(1, np.float32), 1)


_start_numba_threads()
