"""The dense decode step on the host CPU with quantized weights: one XLA FFI call per layer and one for the head.

Why: at batch 1 a decode step reads every weight once. XLA on the CPU keeps weights in float32 (a jitted dot on
int8 weights converted to float32 measured slower, not faster) and spends ~1000 thunks on one token's small ops.
Here every matrix of a Llama-family layer is stored quantized and one Numba call does the whole layer. Two
formats (``FORMATS``): "int8", a float32 scale per block of 64 inputs (``kernels.quantize_rows``: 17/64 of the
float32 bytes), and "q4_1", the GGUF's own 4-bit blocks (``q4.py``: 5/32 of the bytes; for a Q4_1 GGUF it is the
file's model exactly). The output head is int8 in both. A third, "gguf", keeps every matrix in the file's own
llama.cpp block type (``quants.py``: Q8_0, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; Q4_1 through ``q4.py``), the head
too, so a Q4_K_M file decodes in its own mix; its ggml type number sits in the table slot after the blocks.

Usage::

    stored = quantize_weights(config, weights, "q4_1")  # every matrix as the host stores it (qtensor forms):
                                                        # a Q4Tensor of the file is kept as it is
    host = HostDecoder(config, stored, "q4_1")      # reads the stored arrays in place (numpy views, no copy:
                                                    # jax arrays too), and keeps them alive
    reference = host.dequantized(stored)            # canonical float32: what the stored weights stand for
    x, k, v = host.layer(l, x, pos, k_cache, v_cache)    # inside jit; x [..., d] with d elements
    logits = host.head(hidden)                     # hidden [d] -> [vocab]

One layer (``_execute_layer``), under the ffi lock:
    h = rmsnorm(x) * attn_norm                            caller thread
    qkv = Wqkv h                                          team: rows split (stage QKV)
    rope(q, k); cache[pos] = k, v (float16)               caller thread
    att = softmax(q K^T / sqrt(hd)) V per head            team: positions or heads split (ATTN, attention.py)
    x += Wo att                                           team: rows split (O)
    h = rmsnorm(x) * ffn_norm                             caller thread
    a = act(Wgate h, Wup h)                               team: neurons split (GATE_UP)
    x += Wdown a                                          team: rows split (DOWN)
The team (``team.py``) is this thread plus workers that wait spinning, so a stage costs ~1 us to hand out. The
KV cache arrays (float16, [..., S, KV, hd]) are operands aliased to results: XLA donates them and the layer writes
position ``pos`` in place.

Matrices are stored one row per output (a stored w_down_t is [d, d_ff], untransposed: pjinfer.runtime.model's rule for
quantized matrices), so every stage is a GEMV over contiguous rows: ``_gemv`` (int8) takes four rows at a time against one pass over x; ``q4.gemv``
takes one row at a time against x prepared once per stage by the caller thread (``_prepare``).

Supported: the Llama family (RMSNorm, RoPE, grouped-query attention, gated FFN, no biases but Qwen2's q/k/v ones)
with d_model, n_heads*head_dim and d_ff multiples of 64. Anything else is refused with a ConfigError-style ValueError.

Lifetime: like ``bridge.ColdFFN``, the header whose address compiled executables carry is never freed; the
weights live as long as the HostDecoder (a jitted function holding the model holds it).
"""
from __future__ import annotations

import numpy as np

from . import attention, ffi, kernels, q4, quants, tables, team
from .ffi import (BUF_DATA, BUF_DIMS, BUF_DTYPE, BUF_RANK, CF_ARGS, CF_NARGS, CF_NRETS, CF_RETS, DT_F16, DT_F32, DT_S32,
                  ERRC_INVALID_ARGUMENT, ERRC_OUT_OF_RANGE, NOJIT, RUNTIME_ADDR, buffer_numel, cstr, find_table_attr,
                  last_dim, load_i32, load_i64, lock, make_error, ptr_f32, ptr_f64, ptr_i8, ptr_i32, ptr_u8, ptr_u16,
                  store_i64, unlock)
from .kernels import QBLOCK, act, prefetch
from .qtensor import Int8Tensor, Q4Tensor, QBlocks, is_quantized

from numba import carray, cfunc, njit, prange, types  # noqa: E402

TARGET_NAME = "pjinfer_host_decode"
MAGIC = 0x706A686F7374_0001  # "pjhost" + 1

# Header slots (int64; eps as a float64 bit pattern).
(H_MAGIC, H_NLAYERS, H_D, H_HEADS, H_KV, H_HD, H_FF, H_VOCAB, H_ACT, H_EPS, H_MAXLEN, H_TABLE, H_HEAD,
 H_HEAD_SCALES, H_INV_FREQ, H_SCRATCH, H_TASK, H_TEAM, H_STAGE, H_RUNTIME, H_FORMAT, H_HEAD_KIND) = range(22)
H_WIDTH = 24
# How the layers' matrices are stored: int8, or GGUF blocks ("q4_1": every layer matrix Q4_1; "gguf": each in the
# file's own block type where quants.py has a kernel, Q8_0 otherwise).
FORMATS = {"int8": 0, "q4_1": 1, "gguf": 1}
F_Q4_1 = FORMATS["q4_1"]
# Layer table slots: (int8 rows, float32 block scales), (Q4_1 blocks, 0) or (blocks, ggml type number) per
# matrix, then the two norm scales.
(L_Q, L_Q_S, L_K, L_K_S, L_V, L_V_S, L_O, L_O_S, L_GATE, L_GATE_S, L_UP, L_UP_S, L_DOWN, L_DOWN_S, L_ATTN_NORM,
 L_FFN_NORM, L_QKV_BIAS) = range(17)
L_WIDTH = 17   # L_QKV_BIAS: Qwen2's q, k and v biases as one float32 [(H + 2 KV) hd], or 0
# The stored matrices of a layer: canonical name -> table slot.
MATRICES = {"wq": L_Q, "wk": L_K, "wv": L_V, "wo": L_O, "w_gate": L_GATE, "w_up": L_UP, "w_down_t": L_DOWN}
# Task slots: what the current stage works on.
K_STAGE, K_LAYER, K_POS, K_KCACHE, K_VCACHE, K_OUT = range(6)
ST_QKV, ST_ATTN, ST_O, ST_GATE_UP, ST_DOWN, ST_HEAD = range(6)

PREFETCH_ROWS = 16
_F0 = np.float32(0.0)
_ONE = np.float32(1.0)
_JIT = dict(fastmath=True, cache=True, nogil=True)


# ---------------------------------------------------------------------------------------------------------------
# Kernels (plain Numba; the stage function below picks each thread's share).

@njit(**_JIT)
def _gemv(w, s, x, y, lo, hi):
    """y[r] = sum_j w[r, j] * s[r, j // 64] * x[j] for rows lo..hi-1 (int8 rows, len(x) a multiple of 64).

    Four rows share each pass over x; within a 64-block the products are summed, then scaled once. The rows
    PREFETCH_ROWS ahead are prefetched line by line: one thread then streams 2.6x faster from DRAM (4.4 -> 11.5
    G weights/s measured on 30 x [3072, 576], 16 rows ahead; 4 ahead gave 8.2, 32 gave 7.9)."""
    nb = x.shape[0] // QBLOCK
    r = lo
    while r + 4 <= hi:
        if r + PREFETCH_ROWS + 4 <= hi:
            for ahead in range(r + PREFETCH_ROWS, r + PREFETCH_ROWS + 4):
                for j in range(0, x.shape[0], 64):
                    prefetch(w, ahead, j)
        a0 = _F0
        a1 = _F0
        a2 = _F0
        a3 = _F0
        for b in range(nb):
            base = b * QBLOCK
            t0 = _F0
            t1 = _F0
            t2 = _F0
            t3 = _F0
            for j in range(base, base + QBLOCK):
                xv = x[j]
                t0 += np.float32(w[r, j]) * xv
                t1 += np.float32(w[r + 1, j]) * xv
                t2 += np.float32(w[r + 2, j]) * xv
                t3 += np.float32(w[r + 3, j]) * xv
            a0 += t0 * s[r, b]
            a1 += t1 * s[r + 1, b]
            a2 += t2 * s[r + 2, b]
            a3 += t3 * s[r + 3, b]
        y[r] = a0
        y[r + 1] = a1
        y[r + 2] = a2
        y[r + 3] = a3
        r += 4
    while r < hi:
        a = _F0
        for b in range(nb):
            t = _F0
            for j in range(b * QBLOCK, (b + 1) * QBLOCK):
                t += np.float32(w[r, j]) * x[j]
            a += t * s[r, b]
        y[r] = a
        r += 1


@njit(**_JIT)
def _rmsnorm(x, scale, eps, out):
    ss = _F0
    for j in range(x.shape[0]):
        ss += x[j] * x[j]
    r = _ONE / np.sqrt(ss / np.float32(x.shape[0]) + eps)
    for j in range(x.shape[0]):
        out[j] = x[j] * r * scale[j]


@njit(**_JIT)
def _rope(v, heads, hd, inv_freq, pos):
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


# ---------------------------------------------------------------------------------------------------------------
# Views of the host memory a header describes.

@njit(**NOJIT)
def _i8(addr, rows, cols):
    return carray(ptr_i8(addr), (rows, cols))


@njit(**NOJIT)
def _f32(addr, n):
    return carray(ptr_f32(addr), (n,))


@njit(**NOJIT)
def _f32_2d(addr, rows, cols):
    return carray(ptr_f32(addr), (rows, cols))


@njit(**NOJIT)
def _dims(header):
    return (load_i64(header + 8 * H_D), load_i64(header + 8 * H_HEADS), load_i64(header + 8 * H_KV),
            load_i64(header + 8 * H_HD), load_i64(header + 8 * H_FF))


@njit(**NOJIT)
def _scratch(header):
    """The float32 working vectors: h [d], qkv [(H + 2 KV) hd], att [H hd], o [d], gate [F], up [F], down [d],
    scores [H, max_len], then (Q4_1 only) the prepared GEMV input xp [q4.prepared_size(max(d, H hd, F))]."""
    d, nh, nkv, hd, ff = _dims(header)
    base = load_i64(header + 8 * H_SCRATCH)
    nqkv = (nh + 2 * nkv) * hd
    sizes = (d, nqkv, nh * hd, d, ff, ff, d)
    views = []
    off = base
    for n in sizes:
        views.append(_f32(off, n))
        off += 4 * n
    scores = _f32_2d(off, nh, load_i64(header + 8 * H_MAXLEN))
    return views[0], views[1], views[2], views[3], views[4], views[5], views[6], scores


@njit(**NOJIT)
def _prepared(header, cols):
    """The Q4_1 GEMV input scratch, sized for an input of cols: right after _scratch's last view."""
    scores = _scratch(header)[7]
    return _f32(scores.ctypes.data + 4 * scores.size, q4.prepared_size(cols))


@njit(**NOJIT)
def _prepare(header, x):
    """Q4_1 layers read their input through q4.prepare's form: done once per input vector, by the caller."""
    if load_i64(header + 8 * H_FORMAT) == F_Q4_1:
        q4.prepare(x, _prepared(header, x.shape[0]))


@njit(**NOJIT)
def _matrix(header, layer, slot, rows, cols):
    table = load_i64(header + 8 * H_TABLE) + 8 * L_WIDTH * layer
    return (_i8(load_i64(table + 8 * slot), rows, cols),
            _f32_2d(load_i64(table + 8 * (slot + 1)), rows, cols // QBLOCK))


@njit(**NOJIT)
def _matvec(header, layer, slot, rows, x, y, lo, hi):
    """y[lo:hi] = rows lo..hi-1 of the layer's matrix in slot times x (Q4_1: x prepared by _prepare; another
    block type: its ggml type number in the slot after the blocks, quants.gemv)."""
    cols = x.shape[0]
    if load_i64(header + 8 * H_FORMAT) == F_Q4_1:
        entry = load_i64(header + 8 * H_TABLE) + 8 * (L_WIDTH * layer + slot)
        kind = load_i64(entry + 8)
        if kind == 0:
            blocks = carray(ptr_u8(load_i64(entry)), (rows, q4.row_bytes(cols)))
            q4.gemv(blocks, _prepared(header, cols), y, lo, hi)
        else:
            quants.gemv(kind, carray(ptr_u8(load_i64(entry)), (rows, quants.row_bytes(kind, cols))), x, y, lo, hi)
    else:
        w, s = _matrix(header, layer, slot, rows, cols)
        _gemv(w, s, x, y, lo, hi)


@njit(**NOJIT)
def _share(rows, tid, n, step):
    """Thread tid's rows [lo, hi) of n equal shares, each a multiple of step."""
    chunk = ((rows + n - 1) // n + step - 1) // step * step
    lo = min(rows, tid * chunk)
    return lo, min(rows, lo + chunk)


@njit(**NOJIT)
def _cache(task, slot, pos, nkv, hd):
    """The float16 cache (uint16 bits) in task slot K_KCACHE or K_VCACHE, positions 0..pos: [pos + 1, KV, hd]."""
    return carray(ptr_u16(load_i64(task + 8 * slot)), (pos + 1, nkv, hd))


@njit(**NOJIT)
def attend_stage(header, tid, n):
    """The ATTN stage (thread tid of n): attention.attend_share over the task's caches, q from the qkv scratch."""
    task = load_i64(header + 8 * H_TASK)
    pos = load_i64(task + 8 * K_POS)  # < the cache length <= max_len, checked by the handler
    d, nh, nkv, hd, ff = _dims(header)
    h, qkv, att, o, gate, up, down, scores = _scratch(header)
    attention.attend_share(qkv[:nh * hd].reshape((nh, hd)), _cache(task, K_KCACHE, pos, nkv, hd),
                           _cache(task, K_VCACHE, pos, nkv, hd), pos, tid, n, scores, att.reshape((nh, hd)))


@njit(**NOJIT)
def attend(header, pos, k_ptr, v_ptr):
    """The layer's attention after RoPE: writes k and v (from the qkv scratch) into the caches at pos as float16,
    runs the ATTN stage on the team and merges its partials into the att scratch."""
    d, nh, nkv, hd, ff = _dims(header)
    h, qkv, att, o, gate, up, down, scores = _scratch(header)
    task = load_i64(header + 8 * H_TASK)
    store_i64(task + 8 * K_POS, pos)
    store_i64(task + 8 * K_KCACHE, k_ptr)
    store_i64(task + 8 * K_VCACHE, v_ptr)
    kv = nkv * hd
    attention.store(qkv[nh * hd:nh * hd + kv], qkv[nh * hd + kv:nh * hd + 2 * kv],
                    _cache(task, K_KCACHE, pos, nkv, hd)[pos], _cache(task, K_VCACHE, pos, nkv, hd)[pos])
    _run(header, ST_ATTN)
    attention.merge(pos, load_i64(load_i64(header + 8 * H_TEAM) + 8 * team.C_SIZE), scores, att.reshape((nh, hd)))


def _stage_py(header, tid, n):
    task = load_i64(header + 8 * H_TASK)
    stage = load_i64(task + 8 * K_STAGE)
    layer = load_i64(task + 8 * K_LAYER)
    d, nh, nkv, hd, ff = _dims(header)
    h, qkv, att, o, gate, up, down, scores = _scratch(header)
    if stage == ST_QKV:  # q, k and v are three matrices; the team splits their rows as one
        lo, hi = _share(qkv.shape[0], tid, n, 4)
        nq, nk = nh * hd, nkv * hd
        for slot, r0, r1 in ((L_Q, 0, nq), (L_K, nq, nq + nk), (L_V, nq + nk, nq + 2 * nk)):
            a, b = max(lo, r0), min(hi, r1)
            if a < b:
                _matvec(header, layer, slot, r1 - r0, h, qkv[r0:r1], a - r0, b - r0)
    elif stage == ST_ATTN:
        attend_stage(header, tid, n)
    elif stage == ST_O:
        lo, hi = _share(d, tid, n, 4)
        _matvec(header, layer, L_O, d, att, o, lo, hi)
    elif stage == ST_GATE_UP:
        lo, hi = _share(ff, tid, n, 4)
        _matvec(header, layer, L_GATE, ff, h, gate, lo, hi)
        _matvec(header, layer, L_UP, ff, h, up, lo, hi)
        code = load_i64(header + 8 * H_ACT)
        for i in range(lo, hi):
            gate[i] = act(gate[i], up[i], code)
    elif stage == ST_DOWN:
        lo, hi = _share(d, tid, n, 4)
        _matvec(header, layer, L_DOWN, d, gate, down, lo, hi)
    elif stage == ST_HEAD:
        vocab = load_i64(header + 8 * H_VOCAB)
        lo, hi = _share(vocab, tid, n, 4)
        kind = load_i64(header + 8 * H_HEAD_KIND)
        if kind:  # GGUF blocks (quants.py)
            blocks = carray(ptr_u8(load_i64(header + 8 * H_HEAD)), (vocab, quants.row_bytes(kind, d)))
            quants.gemv(kind, blocks, h, _f32(load_i64(task + 8 * K_OUT), vocab), lo, hi)
        else:
            w = _i8(load_i64(header + 8 * H_HEAD), vocab, d)
            s = _f32_2d(load_i64(header + 8 * H_HEAD_SCALES), vocab, d // QBLOCK)
            _gemv(w, s, h, _f32(load_i64(task + 8 * K_OUT), vocab), lo, hi)


ffi.purge_stale_cache("host_decode", attention, kernels, ffi, q4, quants, tables, team)

# void stage(int64 header, int64 tid, int64 n): what the team runs.
_stage = cfunc(types.void(types.int64, types.int64, types.int64), nopython=True, cache=True)(_stage_py)


@njit(**NOJIT)
def _run(header, stage):
    store_i64(load_i64(header + 8 * H_TASK) + 8 * K_STAGE, stage)
    team.run(load_i64(header + 8 * H_TEAM), load_i64(header + 8 * H_STAGE), header)


@njit(**NOJIT)
def _layer(header, layer, pos, x, k_ptr, v_ptr):
    """One decoder layer for one token, x [d] updated in place; caches [S, KV, hd] written at pos."""
    d, nh, nkv, hd, ff = _dims(header)
    eps = np.float32(carray(ptr_f64(header + 8 * H_EPS), (1,))[0])
    h, qkv, att, o, gate, up, down, scores = _scratch(header)
    table = load_i64(header + 8 * H_TABLE) + 8 * L_WIDTH * layer
    task = load_i64(header + 8 * H_TASK)
    store_i64(task + 8 * K_LAYER, layer)

    _rmsnorm(x, _f32(load_i64(table + 8 * L_ATTN_NORM), d), eps, h)
    _prepare(header, h)
    _run(header, ST_QKV)
    bias = load_i64(table + 8 * L_QKV_BIAS)
    if bias != 0:
        b = _f32(bias, qkv.shape[0])
        for j in range(qkv.shape[0]):
            qkv[j] += b[j]
    inv_freq = _f32(load_i64(header + 8 * H_INV_FREQ), hd // 2)
    _rope(qkv[:nh * hd], nh, hd, inv_freq, pos)
    _rope(qkv[nh * hd:(nh + nkv) * hd], nkv, hd, inv_freq, pos)
    attend(header, pos, k_ptr, v_ptr)
    _prepare(header, att)
    _run(header, ST_O)
    for j in range(d):
        x[j] += o[j]
    _rmsnorm(x, _f32(load_i64(table + 8 * L_FFN_NORM), d), eps, h)
    _prepare(header, h)
    _run(header, ST_GATE_UP)
    _prepare(header, gate)
    _run(header, ST_DOWN)
    for j in range(d):
        x[j] += down[j]


@njit(**NOJIT)
def _head(header, hidden, logits_ptr):
    d = load_i64(header + 8 * H_D)
    h = _scratch(header)[0]
    for j in range(d):
        h[j] = hidden[j]
    store_i64(load_i64(header + 8 * H_TASK) + 8 * K_OUT, logits_ptr)
    _run(header, ST_HEAD)


# ---------------------------------------------------------------------------------------------------------------
# The handler. Two call forms, told apart by their operand count:
# - layer: (layer i32 [], pos i32 [], x f32 [d elements], k f16 [..., S, KV, hd], v like k)
#          -> (x f32 like the operand, k, v), k and v aliased to operands 3 and 4;
# - head:  (hidden f32 [d elements]) -> logits f32 [vocab elements].

@njit(**NOJIT)
def _cache_rows(buf, nkv, hd):
    """S of a [..., S, KV, hd] cache buffer, or -1 when its shape does not end in (KV, hd)."""
    rank = load_i64(buf + BUF_RANK)
    if rank < 3 or last_dim(buf) != hd:
        return -1
    if load_i64(load_i64(buf + BUF_DIMS) + 8 * (rank - 2)) != nkv:
        return -1
    return buffer_numel(buf, False) // (nkv * hd)


@njit(**NOJIT)
def _execute(frame, api):
    header = tables.find_table(frame)
    if header == 0 or load_i64(header + 8 * H_MAGIC) != MAGIC:
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr("pjinfer_host_decode: 'table' is not a HostDecoder"))
    nargs = load_i64(frame + CF_NARGS)
    nrets = load_i64(frame + CF_NRETS)
    args = load_i64(frame + CF_ARGS)
    rets = load_i64(frame + CF_RETS)
    d, nh, nkv, hd, ff = _dims(header)
    if nargs == 1 and nrets == 1:
        b_x = load_i64(args)
        b_out = load_i64(rets)
        if (load_i32(b_x + BUF_DTYPE) != DT_F32 or load_i32(b_out + BUF_DTYPE) != DT_F32
                or buffer_numel(b_x, False) != d or buffer_numel(b_out, False) != load_i64(header + 8 * H_VOCAB)):
            return make_error(api, ERRC_INVALID_ARGUMENT,
                              cstr("pjinfer_host_decode: head form is hidden f32 [d] -> logits f32 [vocab]"))
        lock(load_i64(header + 8 * H_RUNTIME))
        env = team.enter()
        _head(header, _f32(load_i64(b_x + BUF_DATA), d), load_i64(b_out + BUF_DATA))
        team.leave(env)
        unlock(load_i64(header + 8 * H_RUNTIME))
        return 0
    if nargs != 5 or nrets != 3:
        return make_error(api, ERRC_INVALID_ARGUMENT,
                          cstr("pjinfer_host_decode: expected 5 operands and 3 results, or 1 and 1"))
    b_layer, b_pos, b_x = load_i64(args), load_i64(args + 8), load_i64(args + 16)
    b_k, b_v = load_i64(args + 24), load_i64(args + 32)
    r_x, r_k, r_v = load_i64(rets), load_i64(rets + 8), load_i64(rets + 16)
    if (load_i32(b_layer + BUF_DTYPE) != DT_S32 or load_i32(b_pos + BUF_DTYPE) != DT_S32
            or load_i32(b_x + BUF_DTYPE) != DT_F32 or load_i32(b_k + BUF_DTYPE) != DT_F16
            or load_i32(b_v + BUF_DTYPE) != DT_F16 or load_i32(r_x + BUF_DTYPE) != DT_F32
            or buffer_numel(b_layer, False) != 1 or buffer_numel(b_pos, False) != 1
            or buffer_numel(b_x, False) != d or buffer_numel(r_x, False) != d):
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr(
            "pjinfer_host_decode: layer form is (int32 [], int32 [], f32 [d], f16 cache, f16 cache)"))
    length = _cache_rows(b_k, nkv, hd)
    if length < 1 or _cache_rows(b_v, nkv, hd) != length or length > load_i64(header + 8 * H_MAXLEN):
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr(
            "pjinfer_host_decode: caches must be [..., S, kv_heads, head_dim], S at most the model's context"))
    k_ptr, v_ptr = load_i64(b_k + BUF_DATA), load_i64(b_v + BUF_DATA)
    if load_i64(r_k + BUF_DATA) != k_ptr or load_i64(r_v + BUF_DATA) != v_ptr:
        return make_error(api, ERRC_INVALID_ARGUMENT,
                          cstr("pjinfer_host_decode: the caches must be aliased to results 2 and 3"))
    layer = carray(ptr_i32(load_i64(b_layer + BUF_DATA)), (1,))[0]
    pos = carray(ptr_i32(load_i64(b_pos + BUF_DATA)), (1,))[0]
    if layer < 0 or layer >= load_i64(header + 8 * H_NLAYERS):
        return make_error(api, ERRC_OUT_OF_RANGE, cstr("pjinfer_host_decode: layer index out of range"))
    if pos < 0 or pos >= length:
        return make_error(api, ERRC_OUT_OF_RANGE, cstr("pjinfer_host_decode: position outside the cache"))
    x_in = _f32(load_i64(b_x + BUF_DATA), d)
    x = _f32(load_i64(r_x + BUF_DATA), d)
    for j in range(d):
        x[j] = x_in[j]
    lock(load_i64(header + 8 * H_RUNTIME))
    env = team.enter()
    _layer(header, layer, pos, x, k_ptr, v_ptr)
    team.leave(env)
    unlock(load_i64(header + 8 * H_RUNTIME))
    return 0


def _handler_py(frame):
    done, result = ffi.prelude(frame)
    if done:
        return result
    return _execute(frame, load_i64(frame + ffi.CF_API))


_handler = cfunc(types.intp(types.intp), nopython=True, cache=True)(_handler_py)


# ---------------------------------------------------------------------------------------------------------------

_HEADERS: list[np.ndarray] = []  # every header ever made; never freed (executables hold their address)


@njit(parallel=True, cache=True, nogil=True)
def _quantize_rows(w, q, s):
    """kernels.quantize_rows for cols a multiple of 64, row by row on every thread, the same float32 operations
    (no fastmath: the division and the rounding must be numpy's) so the bytes are the same; 20-30x faster."""
    nb = w.shape[1] // QBLOCK
    for r in prange(w.shape[0]):
        for b in range(nb):
            peak = _F0
            for j in range(b * QBLOCK, (b + 1) * QBLOCK):
                peak = max(peak, abs(w[r, j]))
            scale = peak / np.float32(127.0) if peak > _F0 else _ONE
            s[r, b] = scale
            for j in range(b * QBLOCK, (b + 1) * QBLOCK):
                q[r, j] = np.int8(min(max(np.rint(w[r, j] / scale), np.float32(-127.0)), np.float32(127.0)))


def quantize(w) -> tuple[np.ndarray, np.ndarray]:
    """float32 [rows, cols] -> (int8 rows, float32 scale per block of 64): kernels.quantize_rows' bytes,
    C-contiguous."""
    w = np.ascontiguousarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % QBLOCK:
        q, s = kernels.quantize_rows(w)
        return np.ascontiguousarray(q), np.ascontiguousarray(s)
    q = np.empty(w.shape, np.int8)
    s = np.empty((w.shape[0], w.shape[1] // QBLOCK), np.float32)
    _quantize_rows(w, q, s)
    return q, s


Q8_0_BLOCK_BYTES = 34  # GGUF Q8_0: float16 d, then 32 int8; element = d * q


@njit(parallel=True, cache=True, nogil=True)
def _int8_from_q8_0(qs, d, q, s):
    """quantize's output for the float32 values of Q8_0 blocks (qs int8 [rows, blocks, 32], d float32 [rows,
    blocks]), computed 64 values at a time without the float32 matrix."""
    vals = np.empty((qs.shape[0], QBLOCK), np.float32)
    for r in prange(qs.shape[0]):
        v = vals[r]
        for b in range(qs.shape[1] // 2):
            peak = _F0
            for h in range(2):
                for j in range(32):
                    x = np.float32(qs[r, 2 * b + h, j]) * d[r, 2 * b + h]
                    v[32 * h + j] = x
                    peak = max(peak, abs(x))
            scale = peak / np.float32(127.0) if peak > _F0 else _ONE
            s[r, b] = scale
            for j in range(QBLOCK):
                q[r, b * QBLOCK + j] = np.int8(min(max(np.rint(v[j] / scale), np.float32(-127.0)), np.float32(127.0)))


def int8_from_q8_0(blocks, cols: int) -> Int8Tensor:
    """A GGUF Q8_0 matrix (uint8 [rows, cols / 32 * 34]) as the host decode's int8 head: the bytes quantize gives
    for its float32 values (the int8 GEMV takes a float32 scale per 64; issue 16 may read Q8_0 as stored)."""
    if cols % QBLOCK:
        raise ValueError(f"int8 rows need a multiple of {QBLOCK} columns, got {cols}")
    rows = blocks.shape[0]
    b = np.asarray(blocks).reshape(rows, cols // 32, Q8_0_BLOCK_BYTES)
    d = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    q = np.empty((rows, cols), np.int8)
    s = np.empty((rows, cols // QBLOCK), np.float32)
    _int8_from_q8_0(b[..., 2:].view(np.int8), d, q, s)
    return Int8Tensor(q, s)


def check_supported(config, weights: dict, fmt: str) -> None:
    """Raises ValueError (one line) unless the host decode can run this model in this format."""
    c = config
    if fmt not in FORMATS:
        raise ValueError(f"host decode weights must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not (c.uses_rope and c.gated):
        raise ValueError(f"host decode supports Llama-family models, not {c.arch!r}")
    biases = [k for k in weights if k.rsplit(".", 1)[-1] in ("bo", "b_up", "b_down", "bias")]
    if biases:
        raise ValueError(f"host decode supports no biases but q/k/v ones, this one has {biases[0]!r}")
    for l in range(c.n_layers):
        have = [f"layers.{l}.{b}" in weights for b in ("bq", "bk", "bv")]
        if any(have) and not all(have):
            raise ValueError(f"host decode needs all of layer {l}'s q/k/v biases or none")
    for name, n in (("d_model", c.d_model), ("n_heads * head_dim", c.n_heads * c.head_dim), ("d_ff", c.d_ff)):
        if n % QBLOCK:
            raise ValueError(f"host decode needs {name} to be a multiple of {QBLOCK}, got {n}")
    if c.head_dim % 2:
        raise ValueError(f"host decode needs an even head_dim, got {c.head_dim}")


def _head_name(config) -> str:
    return "embed" if config.tie_embeddings else "lm_head"


def _stored_float32(name: str, w) -> np.ndarray:
    """A matrix's values in the stored orientation (a w_down_t as [d, F])."""
    if is_quantized(w):
        return w.float32()
    w = np.asarray(w, np.float32)
    return w.T if name.endswith("w_down_t") else w


def _q8_0(values: np.ndarray) -> QBlocks:
    """float32 [rows, cols] as Q8_0 blocks (gguf's quantizer, llama.cpp's rule)."""
    import gguf

    q = gguf.quants.quantize(np.ascontiguousarray(values, np.float32), gguf.GGMLQuantizationType.Q8_0)
    return QBlocks(q, values.shape[1], gguf.GGMLQuantizationType.Q8_0.value)


def quantize_weights(config, weights: dict, fmt: str, *, check: bool = True) -> dict:
    """The weights as the host decode stores them (cpu_offload.qtensor forms), one matrix at a time: every layer
    matrix in fmt ("q4_1": a Q4Tensor is kept as it is, the file's bytes, anything else becomes one; "gguf": a
    Q4Tensor or QBlocks is kept as it is, anything else becomes Q8_0 blocks; "int8": Int8Tensor), a w_down_t
    untransposed [d, F]; the output head Int8Tensor (a QBlocks head is kept with "gguf"); everything else as
    given. weights may hold canonical float32 arrays (pjinfer.runtime.model's names) or quantized matrices. check=False
    skips this decoder's shape rules (for another decoder of the same weights that has checked its own)."""
    if check:
        check_supported(config, weights, fmt)
    out = dict(weights)
    names = [f"layers.{l}.{m}" for l in range(config.n_layers) for m in MATRICES]
    for name in names:
        w = weights[name]
        if fmt == "q4_1" and not isinstance(w, Q4Tensor):
            values = _stored_float32(name, w)
            out[name] = Q4Tensor(q4.quantize(values), values.shape[1])
        elif fmt == "gguf" and not isinstance(w, (Q4Tensor, QBlocks)):
            out[name] = _q8_0(_stored_float32(name, w))
        elif fmt == "int8" and not isinstance(w, Int8Tensor):
            out[name] = Int8Tensor(*quantize(_stored_float32(name, w)))
    head = _head_name(config)
    w = weights[head]
    if fmt == "gguf" and isinstance(w, Q4Tensor):   # the head reads its blocks through quants.gemv
        out[head] = QBlocks(w.data, w.cols, quants.Q4_1)
    elif not (isinstance(w, Int8Tensor) or fmt == "gguf" and isinstance(w, QBlocks)):
        out[head] = Int8Tensor(*quantize(_stored_float32(head, w)))
    return out


class HostDecoder:
    """A Llama-family model's decode step on the host with quantized weights (see the module docstring).

    config: pjinfer.runtime.model's ModelConfig. weights: canonical float32 weights, or what quantize_weights returns
    (the matrices then read in place: numpy arrays, or jax CPU arrays through zero-copy views, kept alive here).
    fmt: how the layers' matrices are stored: "int8" (a float32 scale per 64), "q4_1" (the GGUF's 4-bit
    blocks, cpu_offload/q4.py) or "gguf" (each matrix in the file's own block type, quants.py). The output head
    is int8 in the first two (the GGUF keeps it at 8 bits too, Q8_0) and its own block type in "gguf"."""

    target = TARGET_NAME    # the FFI target layer() and head() call (a subclass with its own handler names its own)

    def __init__(self, config, weights: dict, fmt: str = "int8"):
        c = config
        weights = quantize_weights(config, weights, fmt)
        self.config = c
        self.format = fmt
        self.team = team.shared()
        self._keep = []  # every array the header points at
        table = np.zeros((c.n_layers, L_WIDTH), np.int64)
        self._quantized = {}  # (layer, slot) -> Q4Tensor or Int8Tensor, one row per output
        for l in range(c.n_layers):
            p = f"layers.{l}"
            for m, slot in MATRICES.items():
                w = weights[f"{p}.{m}"]
                stored = (w.data,) if isinstance(w, (Q4Tensor, QBlocks)) else (w.q, w.scales)
                table[l, slot:slot + len(stored)] = [self._hold(np.asarray(a)) for a in stored]
                if isinstance(w, QBlocks):
                    table[l, slot + 1] = w.kind
                self._quantized[(l, slot)] = w
            table[l, L_ATTN_NORM] = self._hold(np.asarray(weights[f"{p}.attn_norm.scale"], np.float32))
            table[l, L_FFN_NORM] = self._hold(np.asarray(weights[f"{p}.ffn_norm.scale"], np.float32))
            if f"{p}.bq" in weights:
                table[l, L_QKV_BIAS] = self._hold(np.concatenate(
                    [np.asarray(weights[f"{p}.{b}"], np.float32) for b in ("bq", "bk", "bv")]))
        self._head_name = _head_name(c)
        self._head = weights[self._head_name]
        if isinstance(self._head, QBlocks):
            head_q, head_s, head_kind = np.asarray(self._head.data), np.zeros(1, np.float32), self._head.kind
        else:
            head_q, head_s, head_kind = np.asarray(self._head.q), np.asarray(self._head.scales), 0
        inv_freq = (1.0 / (np.float32(c.rope_theta) ** (np.arange(0, c.head_dim, 2, dtype=np.float32)
                                                        / np.float32(c.head_dim)))).astype(np.float32)
        nqkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        widest = max(c.d_model, c.n_heads * c.head_dim, c.d_ff)
        scratch = np.zeros(3 * c.d_model + nqkv + c.n_heads * c.head_dim + 2 * c.d_ff
                           + c.n_heads * c.max_seq_len + q4.prepared_size(widest), np.float32)
        header = np.zeros(H_WIDTH, np.int64)
        header[[H_NLAYERS, H_D, H_HEADS, H_KV, H_HD, H_FF, H_VOCAB, H_ACT, H_MAXLEN]] = [
            c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size,
            kernels.act_code(c.activation), c.max_seq_len]
        header.view(np.float64)[H_EPS] = c.norm_eps
        header[[H_TABLE, H_HEAD, H_HEAD_SCALES, H_INV_FREQ, H_SCRATCH, H_TASK, H_TEAM]] = [
            self._hold(table), self._hold(head_q), self._hold(head_s), self._hold(inv_freq),
            self._hold(scratch), self._hold(np.zeros(8, np.int64)), self.team.address]
        # Addresses travel in the header, never as Numba globals: cached machine code would keep another
        # process's values.
        header[[H_STAGE, H_RUNTIME]] = [_stage.address, RUNTIME_ADDR]
        header[H_FORMAT] = FORMATS[fmt]
        header[H_HEAD_KIND] = head_kind
        header[H_MAGIC] = MAGIC
        _HEADERS.append(header)
        self.address = int(header.ctypes.data)
        self.table = tables.register_table(self.address)  # what the calls pass (an index, see tables.TABLES)
        ffi.register(TARGET_NAME, _handler)

    def _hold(self, a: np.ndarray) -> int:
        b = np.require(a, requirements=["C_CONTIGUOUS", "ALIGNED"])
        if b is not a and a.nbytes > 1 << 20:
            raise ValueError("host decode: a stored matrix is not C-contiguous; it would be copied")
        self._keep.append(b)
        return int(b.ctypes.data)

    @property
    def nbytes(self) -> int:
        """Bytes of weights a decode step reads: every stored matrix with its scales (norms are noise)."""
        return int(sum(w.nbytes for w in [*self._quantized.values(), self._head]))

    def dequantized(self, weights: dict) -> dict:
        """The canonical float32 weights with every quantized matrix replaced by what its stored copy stands for
        (a numpy reference for tests: it materializes the whole model in float32)."""
        out = dict(weights)
        for l in range(self.config.n_layers):
            for m, slot in MATRICES.items():
                w = self._quantized[(l, slot)].float32()
                out[f"layers.{l}.{m}"] = np.ascontiguousarray(w.T) if m == "w_down_t" else w
        out[self._head_name] = self._head.float32()
        return out

    # ------------------------------------------------------------ calls from inside jit
    def layer(self, layer: int, x, pos, k_cache, v_cache):
        """Decoder layer `layer` for one token: (x [..., d] with d elements, position, float16 caches
        [1, S, KV, hd]) -> (x out, caches with position pos written). The caches are updated in place when XLA can
        donate them."""
        import jax
        import jax.numpy as jnp

        if not 0 <= int(layer) < self.config.n_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.config.n_layers})")
        if x.size != self.config.d_model:
            raise ValueError(f"x must hold one token's {self.config.d_model} features, got shape {x.shape}")
        if k_cache.dtype != jnp.float16 or v_cache.dtype != jnp.float16:
            raise ValueError(f"host decode caches must be float16, got {k_cache.dtype} and {v_cache.dtype}")
        result = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(k_cache.shape, jnp.float16),
                  jax.ShapeDtypeStruct(v_cache.shape, jnp.float16))
        call = jax.ffi.ffi_call(self.target, result, input_output_aliases={3: 1, 4: 2})
        return call(jnp.int32(layer), jnp.asarray(pos, jnp.int32), x.astype(jnp.float32), k_cache, v_cache,
                    table=np.int64(self.table))

    def head(self, hidden):
        """hidden [d] -> logits [vocab] from the output head."""
        import jax
        import jax.numpy as jnp

        if hidden.shape != (self.config.d_model,):
            raise ValueError(f"hidden must be [{self.config.d_model}], got {hidden.shape}")
        call = jax.ffi.ffi_call(self.target, jax.ShapeDtypeStruct((self.config.vocab_size,), jnp.float32))
        return call(hidden.astype(jnp.float32), table=np.int64(self.table))
