"""The host decode step for a batch of tokens: one token per live request, each at its own position with its own KV
cache rows, every weight matrix read once per step for all of them (``q8_dot.gemm``, ``int8.gemm``).

Usage::

    host = HostDecoder(config, stored, fmt)             # the single-token decoder (host_decode.py), its layers of
                                                        # types with a batched GEMM (blocks.TYPES' gemm)
    batch = BatchDecoder(host, max_batch=8)             # reads host's weights, team and lock; its own scratch
    x, k, v = batch.layer(l, x, pos, k, v)              # inside jit: x [B, ..., d], pos int32 [B] (-1: empty slot),
                                                        # caches f16 [B, S, KV, hd] aliased to the results
    logits = batch.head(hidden, pos)                    # hidden [B, d] -> [B, vocab] (zeros for empty slots)
    batch.woken()                                       # inside jit: int32 [], nonzero after batch.wake() (any
                                                        # thread) until batch.clear_wake(): ends a loop of steps

B is the fixed slot count (max_batch): a request joins by taking a free slot and leaves by freeing it, so one
executable serves every mix of live requests. Empty slots (pos < 0) cost nothing: the handler gathers the live
slots into a compact batch of nt tokens, runs the layer on them and scatters x back.

One layer, under the ffi lock, stages as in host_decode (the team splits rows, or (token, head) pairs for ATTN):
every per-token operation (RMSNorm, RoPE, the cache write, attention, the activation, the residual adds) is
host_decode's own function applied to that token, and the GEMMs give each token the
single-token GEMV's result bit for bit (q8_dot, int8). A token's output therefore does not depend on what else is in
the batch, and equals HostDecoder's (tests/test_batched_decode.py checks both on the real model).

Lifetime: as host_decode's, the header is never freed; the BatchDecoder keeps its HostDecoder (and so the weights)
alive.
"""
from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
from numba import carray, njit, types

from .contract import ConfigError

from . import activation, attention, ffi, host_decode, int8, kernels, q4, q8_dot, tables, team, vector_ir
from .ffi import (BUF_DATA, BUF_DTYPE, CF_ARGS, CF_NARGS, CF_NRETS, CF_RETS, DT_F16, DT_F32, DT_S32,
                  ERRC_INVALID_ARGUMENT, ERRC_OUT_OF_RANGE, NOJIT, buffer_numel, cstr, load_i32,
                  load_i64, lock, make_error, ptr_f32, ptr_f64, ptr_i32, ptr_u8, ptr_u16, store_i64, unlock)
from .host_decode import (F_BLOCKS, H_EPS, H_FORMAT, H_HEAD, H_HEAD_SCALES, H_INV_FREQ, H_MAGIC, H_MAXLEN, H_NLAYERS,
                          H_RUNTIME, H_STAGE, H_TABLE, H_TASK, H_TEAM, H_VOCAB, H_WIDTH, L_ATTN_NORM, L_DOWN,
                          L_FFN_NORM, L_GATE, L_K, L_O, L_Q, L_UP, L_V, L_WIDTH, ST_ATTN, ST_DOWN, ST_GATE_UP, ST_HEAD,
                          ROWS, ST_O, ST_QKV, add_qkv_bias, cache_rows, dims, f32_view, int8_matrix, thread_share)
from .activation import act_span
from .blocks import INT8, TYPES
from .cfuncs import HANDLER, STAGE, DeferredCFunc
from .kernels import rmsnorm, rope
from .qtensor import aligned_zeros


TARGET_NAME = "pjinfer_host_decode_batch"
MAGIC = 0x706A626174_0001  # "pjbat" + 1

# Slots after host_decode's header (a copy of the HostDecoder's, with its own task, scratch, stage and magic).
(B_MB, B_X, B_H, B_QKV, B_ATT, B_O, B_GATE, B_UP, B_DOWN, B_SCORES, B_SLOTS, B_POS, B_IDENT, B_SEQS,
 B_SPAN, B_WAKE) = range(H_WIDTH, H_WIDTH + 16)
WIDTH = H_WIDTH + 16
# Per compact token t: B_SLOTS its row of x (and of the logits), B_POS its position, B_SEQS its sequence in the
# cache ([B, S, KV, hd] caches: the row itself; the prompt form: 0). B_SPAN: the positions the scores scratch holds.
# B_WAKE: the address of an int64 the host sets when it wants a loop of steps to end (BatchDecoder.wake).
# Task slots.
K_STAGE, K_LAYER, K_NT, K_KCACHE, K_VCACHE, K_S, K_OUT = range(7)

_ptr_i64 = ffi.typed_pointer("ptr_i64", types.int64)


# ---------------------------------------------------------------------------------------------------------------
# Views of the batch scratch (rows: compact token index 0..nt-1).

@njit(**NOJIT)
def _rows(header, slot, cols):
    return carray(ptr_f32(load_i64(header + 8 * slot)), (load_i64(header + 8 * B_MB), cols))


@njit(**NOJIT)
def _i64s(header, slot):
    return carray(_ptr_i64(load_i64(header + 8 * slot)), (load_i64(header + 8 * B_MB),))


@njit(**NOJIT)
def _bscratch(header):
    """x [MB, d], h [MB, d], qkv [MB, (H + 2 KV) hd], att [MB, H hd], o [MB, d], gate, up [MB, F], down [MB, d]."""
    d, nh, nkv, hd, ff = dims(header)
    return (_rows(header, B_X, d), _rows(header, B_H, d), _rows(header, B_QKV, (nh + 2 * nkv) * hd),
            _rows(header, B_ATT, nh * hd), _rows(header, B_O, d), _rows(header, B_GATE, ff),
            _rows(header, B_UP, ff), _rows(header, B_DOWN, d))


@njit(**NOJIT)
def _matmul(header, layer, slot, rows, x, y, nt, lo, hi):
    """y[t, lo:hi] = rows lo..hi-1 of the layer's matrix in slot times x[t], t < nt (blocks: Q4_1 or Q4_1x16, the
    block types with a batched GEMM, checked by BatchDecoder)."""
    cols = x.shape[1]
    if load_i64(header + 8 * H_FORMAT) == F_BLOCKS:
        entry = load_i64(header + 8 * H_TABLE) + 8 * (L_WIDTH * layer + slot)
        blocks = carray(ptr_u8(load_i64(entry)), (rows, cols // q4.BLOCK * q4.BLOCK_BYTES))
        q8_dot.gemm(load_i64(entry + 8), blocks, x, y, nt, lo, hi)
    else:
        w, s = int8_matrix(header, layer, slot, rows, cols)
        int8.gemm(w, s, x, y, _i64s(header, B_IDENT), nt, lo, hi)


def _stage_py(header, tid, n):
    task = load_i64(header + 8 * H_TASK)
    stage = load_i64(task + 8 * K_STAGE)
    layer = load_i64(task + 8 * K_LAYER)
    nt = load_i64(task + 8 * K_NT)
    d, nh, nkv, hd, ff = dims(header)
    x, h, qkv, att, o, gate, up, down = _bscratch(header)
    if stage == ST_QKV:
        lo, hi = thread_share(qkv.shape[1], tid, n, ROWS)
        nq, nk = nh * hd, nkv * hd
        for slot, r0, r1 in ((L_Q, 0, nq), (L_K, nq, nq + nk), (L_V, nq + nk, nq + 2 * nk)):
            a, b = max(lo, r0), min(hi, r1)
            if a < b:
                _matmul(header, layer, slot, r1 - r0, h, qkv[:, r0:r1], nt, a - r0, b - r0)
    elif stage == ST_ATTN:
        # A token's attention is the single decoder's: every share of its team (attention.share) in turn, then
        # their merge, so the float operations are the same whatever the batch; the team splits the tokens.
        s_len = load_i64(task + 8 * K_S)
        seqs, poss = _i64s(header, B_SEQS), _i64s(header, B_POS)
        scores = carray(ptr_f32(load_i64(header + 8 * B_SCORES)),
                        (load_i64(header + 8 * B_MB) * nh, load_i64(header + 8 * B_SPAN)))
        shares = load_i64(load_i64(header + 8 * H_TEAM) + 8 * team.C_SIZE)
        lo, hi = thread_share(nt, tid, n, 1)
        for i in range(lo, hi):
            pos = poss[i]
            base = 2 * seqs[i] * s_len * nkv * hd
            kc = carray(ptr_u16(load_i64(task + 8 * K_KCACHE) + base), (pos + 1, nkv, hd))
            vc = carray(ptr_u16(load_i64(task + 8 * K_VCACHE) + base), (pos + 1, nkv, hd))
            q, out, sc = qkv[i, :nh * hd].reshape((nh, hd)), att[i].reshape((nh, hd)), scores[i * nh:(i + 1) * nh]
            for share in range(shares):
                attention.attend_share(q, kc, vc, pos, share, shares, sc, out)
            attention.merge(pos, shares, sc, out)
    elif stage == ST_O:
        lo, hi = thread_share(d, tid, n, ROWS)
        _matmul(header, layer, L_O, d, att, o, nt, lo, hi)
    elif stage == ST_GATE_UP:
        lo, hi = thread_share(ff, tid, n, ROWS)
        _matmul(header, layer, L_GATE, ff, h, gate, nt, lo, hi)
        _matmul(header, layer, L_UP, ff, h, up, nt, lo, hi)
        code = load_i64(header + 8 * host_decode.H_ACT)
        for t in range(nt):
            act_span(gate[t], up[t], lo, hi, code)
    elif stage == ST_DOWN:
        lo, hi = thread_share(d, tid, n, ROWS)
        _matmul(header, layer, L_DOWN, d, gate, down, nt, lo, hi)
    elif stage == ST_HEAD:
        vocab = load_i64(header + 8 * H_VOCAB)
        w = host_decode.i8_view(load_i64(header + 8 * H_HEAD), vocab, d)
        s = host_decode.f32_view_2d(load_i64(header + 8 * H_HEAD_SCALES), vocab, d // kernels.QBLOCK)
        out = carray(ptr_f32(load_i64(task + 8 * K_OUT)), (load_i64(header + 8 * B_MB), vocab))
        lo, hi = thread_share(vocab, tid, n, 4)
        int8.gemm(w, s, h, out, _i64s(header, B_SLOTS), nt, lo, hi)


ffi.purge_stale_cache("batched_decode", attention, activation, kernels, ffi, int8, q4, q8_dot, host_decode, tables,
                      team, vector_ir)

_stage = DeferredCFunc(STAGE, _stage_py)


@njit(**NOJIT)
def _layer(header, layer, nt, k_ptr, v_ptr, s_len):
    """One decoder layer for the nt compact tokens in x (updated in place); caches [MB, S, KV, hd] written at each
    token's slot and position. Each token's operations are host_decode.run_layer's, in its order."""
    d, nh, nkv, hd, ff = dims(header)
    eps = np.float32(carray(ptr_f64(header + 8 * H_EPS), (1,))[0])
    x, h, qkv, att, o, gate, up, down = _bscratch(header)
    seqs, poss = _i64s(header, B_SEQS), _i64s(header, B_POS)
    table = load_i64(header + 8 * H_TABLE) + 8 * L_WIDTH * layer
    task = load_i64(header + 8 * H_TASK)
    store_i64(task + 8 * K_LAYER, layer)
    store_i64(task + 8 * K_NT, nt)
    store_i64(task + 8 * K_KCACHE, k_ptr)
    store_i64(task + 8 * K_VCACHE, v_ptr)
    store_i64(task + 8 * K_S, s_len)
    attn_norm = f32_view(load_i64(table + 8 * L_ATTN_NORM), d)
    ffn_norm = f32_view(load_i64(table + 8 * L_FFN_NORM), d)
    for t in range(nt):
        rmsnorm(x[t], attn_norm, eps, h[t])
    host_decode.run_stage(header, ST_QKV)
    inv_freq = f32_view(load_i64(header + 8 * H_INV_FREQ), hd // 2)
    kv = nkv * hd
    for t in range(nt):
        add_qkv_bias(table, qkv[t])
        pos = poss[t]
        rope(qkv[t, :nh * hd], nh, hd, inv_freq, pos)
        rope(qkv[t, nh * hd:(nh + nkv) * hd], nkv, hd, inv_freq, pos)
        row = 2 * (seqs[t] * s_len + pos) * kv
        attention.store(qkv[t, nh * hd:nh * hd + kv], qkv[t, nh * hd + kv:nh * hd + 2 * kv],
                        carray(ptr_u16(k_ptr + row), (nkv, hd)), carray(ptr_u16(v_ptr + row), (nkv, hd)))
    host_decode.run_stage(header, ST_ATTN)
    host_decode.run_stage(header, ST_O)
    for t in range(nt):
        xt, ot = x[t], o[t]
        for j in range(d):
            xt[j] += ot[j]
        rmsnorm(xt, ffn_norm, eps, h[t])
    host_decode.run_stage(header, ST_GATE_UP)
    host_decode.run_stage(header, ST_DOWN)
    for t in range(nt):
        xt, dt = x[t], down[t]
        for j in range(d):
            xt[j] += dt[j]


# ---------------------------------------------------------------------------------------------------------------
# The handler. Three call forms, told apart by their operand count:
# - layer: (layer i32 [], pos i32 [MB], x f32 [MB * d elements], k f16 [MB, S, KV, hd], v like k)
#          -> (x f32 like the operand, k, v), k and v aliased to operands 3 and 4;
# - prompt: (layer i32 [], start i32 [], count i32 [], x f32 [MB * d elements], k f16 [S, KV, hd] (any leading 1s),
#           v like k) -> (x, k, v), k and v aliased to operands 4 and 5: rows 0..count-1 of x are one sequence's
#           tokens at positions start..start+count-1 (count <= MB), the other rows are passed through;
# - head:  (hidden f32 [MB * d elements], pos i32 [MB]) -> logits f32 [MB * vocab elements].
# A slot with pos < 0 is empty: its x is passed through, its logits are zeros.

@njit(**NOJIT)
def _gather(header, b_pos, mb, limit):
    """Stores the live slots and their positions (compact); returns their count, or -1 when a position >= limit."""
    pos = carray(ptr_i32(load_i64(b_pos + BUF_DATA)), (mb,))
    slots, poss, seqs = _i64s(header, B_SLOTS), _i64s(header, B_POS), _i64s(header, B_SEQS)
    nt = 0
    for b in range(mb):
        if pos[b] >= 0:
            if pos[b] >= limit:
                return -1
            slots[nt], poss[nt], seqs[nt] = b, pos[b], b
            nt += 1
    return nt


@njit(**NOJIT)
def _execute_head(header, api, args, rets, mb, d):
    b_x, b_pos, b_out = load_i64(args), load_i64(args + 8), load_i64(rets)
    vocab = load_i64(header + 8 * H_VOCAB)
    if (load_i32(b_x + BUF_DTYPE) != DT_F32 or load_i32(b_pos + BUF_DTYPE) != DT_S32
            or load_i32(b_out + BUF_DTYPE) != DT_F32 or buffer_numel(b_x, False) != mb * d
            or buffer_numel(b_pos, False) != mb or buffer_numel(b_out, False) != mb * vocab):
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr(
            "pjinfer_host_decode_batch: head form is (hidden f32 [B, d], pos i32 [B]) -> logits f32 [B, vocab]"))
    lock(load_i64(header + 8 * H_RUNTIME))
    nt = _gather(header, b_pos, mb, load_i64(header + 8 * H_MAXLEN))
    hidden = carray(ptr_f32(load_i64(b_x + BUF_DATA)), (mb, d))
    out = carray(ptr_f32(load_i64(b_out + BUF_DATA)), (mb, vocab))
    h = _bscratch(header)[1]
    slots = _i64s(header, B_SLOTS)
    out[:, :] = 0
    for t in range(max(nt, 0)):
        h[t, :] = hidden[slots[t]]
    store_i64(load_i64(header + 8 * H_TASK) + 8 * K_NT, max(nt, 0))
    store_i64(load_i64(header + 8 * H_TASK) + 8 * K_OUT, out.ctypes.data)
    env = team.enter()
    host_decode.run_stage(header, ST_HEAD)
    team.leave(env)
    unlock(load_i64(header + 8 * H_RUNTIME))
    return 0


@njit(**NOJIT)
def _run(header, nt, layer, x_in, x_out, k_ptr, v_ptr, s_len):
    """The layer for the nt rows gathered in B_SLOTS / B_POS (x_in row slots[t] is token t), under the lock."""
    x, slots = _bscratch(header)[0], _i64s(header, B_SLOTS)
    x_out[:, :] = x_in
    for t in range(nt):
        x[t, :] = x_out[slots[t]]
    env = team.enter()
    _layer(header, layer, nt, k_ptr, v_ptr, s_len)
    team.leave(env)
    for t in range(nt):
        x_out[slots[t], :] = x[t]


@njit(**NOJIT)
def _execute(frame, api):
    header = tables.find_table(frame)
    if header == 0 or load_i64(header + 8 * H_MAGIC) != MAGIC:
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr("pjinfer_host_decode_batch: 'table' is not a BatchDecoder"))
    nargs, nrets = load_i64(frame + CF_NARGS), load_i64(frame + CF_NRETS)
    args, rets = load_i64(frame + CF_ARGS), load_i64(frame + CF_RETS)
    d, nh, nkv, hd, ff = dims(header)
    mb = load_i64(header + 8 * B_MB)
    if nargs == 2 and nrets == 1:
        return _execute_head(header, api, args, rets, mb, d)
    if nargs == 0 and nrets == 1:
        r_wake = load_i64(rets)
        if load_i32(r_wake + BUF_DTYPE) != DT_S32 or buffer_numel(r_wake, False) != 1:
            return make_error(api, ERRC_INVALID_ARGUMENT,
                              cstr("pjinfer_host_decode_batch: the wake form is () -> int32 []"))
        carray(ptr_i32(load_i64(r_wake + BUF_DATA)), (1,))[0] = load_i64(load_i64(header + 8 * B_WAKE)) != 0
        return 0
    if not (nargs == 5 or nargs == 6) or nrets != 3:
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr(
            "pjinfer_host_decode_batch: expected 5 or 6 operands and 3 results, 2 and 1, or none and 1"))
    prompt = nargs == 6
    b_layer, b_x = load_i64(args), load_i64(args + 8 * (nargs - 3))
    b_k, b_v = load_i64(args + 8 * (nargs - 2)), load_i64(args + 8 * (nargs - 1))
    r_x, r_k, r_v = load_i64(rets), load_i64(rets + 8), load_i64(rets + 16)
    ok = True
    for i in range(1, nargs - 3):
        ok = ok and load_i32(load_i64(args + 8 * i) + BUF_DTYPE) == DT_S32
        ok = ok and buffer_numel(load_i64(args + 8 * i), False) == (1 if prompt else mb)
    if (not ok or load_i32(b_layer + BUF_DTYPE) != DT_S32 or load_i32(b_x + BUF_DTYPE) != DT_F32
            or load_i32(b_k + BUF_DTYPE) != DT_F16 or load_i32(b_v + BUF_DTYPE) != DT_F16
            or load_i32(r_x + BUF_DTYPE) != DT_F32 or buffer_numel(b_layer, False) != 1
            or buffer_numel(b_x, False) != mb * d or buffer_numel(r_x, False) != mb * d):
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr(
            "pjinfer_host_decode_batch: layer form is (int32 [], int32 [B], f32 [B, d], f16 cache, f16 cache), "
            "prompt form (int32 [], int32 [], int32 [], f32 [B, d], f16 cache, f16 cache)"))
    rows = cache_rows(b_k, nkv, hd)
    s_len = rows if prompt else rows // mb
    if (rows < mb or (not prompt and rows % mb) or cache_rows(b_v, nkv, hd) != rows
            or s_len > load_i64(header + 8 * H_MAXLEN)):
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr(
            "pjinfer_host_decode_batch: caches must be [B, S, kv_heads, head_dim] ([S, ...] for a prompt), S at "
            "most the model's context"))
    k_ptr, v_ptr = load_i64(b_k + BUF_DATA), load_i64(b_v + BUF_DATA)
    if load_i64(r_k + BUF_DATA) != k_ptr or load_i64(r_v + BUF_DATA) != v_ptr:
        return make_error(api, ERRC_INVALID_ARGUMENT,
                          cstr("pjinfer_host_decode_batch: the caches must be aliased to the results"))
    layer = carray(ptr_i32(load_i64(b_layer + BUF_DATA)), (1,))[0]
    if layer < 0 or layer >= load_i64(header + 8 * H_NLAYERS):
        return make_error(api, ERRC_OUT_OF_RANGE, cstr("pjinfer_host_decode_batch: layer index out of range"))
    x_in = carray(ptr_f32(load_i64(b_x + BUF_DATA)), (mb, d))
    x_out = carray(ptr_f32(load_i64(r_x + BUF_DATA)), (mb, d))
    lock(load_i64(header + 8 * H_RUNTIME))
    if prompt:
        start = carray(ptr_i32(load_i64(load_i64(args + 8) + BUF_DATA)), (1,))[0]
        nt = carray(ptr_i32(load_i64(load_i64(args + 16) + BUF_DATA)), (1,))[0]
        if start < 0 or nt < 0 or nt > mb or start + nt > min(s_len, load_i64(header + 8 * B_SPAN)):
            nt = -1
        slots, poss, seqs = _i64s(header, B_SLOTS), _i64s(header, B_POS), _i64s(header, B_SEQS)
        for t in range(max(nt, 0)):
            slots[t], poss[t], seqs[t] = t, start + t, 0
    else:
        nt = _gather(header, load_i64(args + 8), mb, min(s_len, load_i64(header + 8 * B_SPAN)))
    if nt < 0:
        unlock(load_i64(header + 8 * H_RUNTIME))
        return make_error(api, ERRC_OUT_OF_RANGE, cstr("pjinfer_host_decode_batch: a position outside the cache"))
    _run(header, nt, layer, x_in, x_out, k_ptr, v_ptr, s_len)
    unlock(load_i64(header + 8 * H_RUNTIME))
    return 0


def _handler_py(frame):
    return ffi.serve(frame, _execute)


_handler = DeferredCFunc(HANDLER, _handler_py)


# ---------------------------------------------------------------------------------------------------------------

_HEADERS: list[np.ndarray] = []  # every header ever made; never freed (executables hold their address)


class BatchDecoder:
    """A HostDecoder's model stepped for up to max_batch tokens at once (see the module docstring)."""

    def __init__(self, host, max_batch: int, *, span: int | None = None):
        """span: the positions it attends over (default the model's context; the scores scratch is max_batch x
        heads x span floats): a decoder for prompts of at most max_batch tokens from position 0 needs max_batch."""
        if max_batch < 1:
            raise ConfigError(f"max batch must be >= 1, got {max_batch}")
        unread = {w.type.name for w in host._quantized.values() if w.type.gemm is None}
        if unread or host._head.code != INT8:
            batched = [t.name for t in TYPES.values() if t.gemm]
            raise ConfigError(f"batched decode reads layers of {' or '.join(batched)} and an int8 head, not "
                              f"{', '.join(sorted(unread | {host._head.type.name}))}")
        if not host.rounds_inputs:   # q8_dot.gemm rounds each token's input as the single-token decode does
            raise ConfigError(f"batched decode rounds its inputs as HostDecoder does; {type(host).__name__} reads "
                              "float32 inputs")
        c = host.config
        self.host, self.config, self.max_batch = host, c, int(max_batch)
        self.span = c.max_seq_len if span is None else min(int(span), c.max_seq_len)
        header = np.zeros(WIDTH, np.int64)
        header[:H_WIDTH] = np.frombuffer(ctypes.string_at(host.address, 8 * H_WIDTH), np.int64)
        nqkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        mb = self.max_batch
        f32 = lambda cols: aligned_zeros((mb, cols), np.float32)  # noqa: E731  (rows on 64-byte lines: cols % 16 == 0)
        self._keep = [f32(c.d_model), f32(c.d_model), f32(nqkv), f32(c.n_heads * c.head_dim), f32(c.d_model),
                      f32(c.d_ff), f32(c.d_ff), f32(c.d_model),
                      aligned_zeros((mb * c.n_heads, self.span), np.float32),
                      np.zeros(mb, np.int64), np.zeros(mb, np.int64), np.arange(mb, dtype=np.int64),
                      np.zeros(mb, np.int64)]
        header[B_X:B_SEQS + 1] = [a.ctypes.data for a in self._keep]
        header[[B_MB, B_SPAN]] = [mb, self.span]
        self._task = np.zeros(8, np.int64)
        self._wake = np.zeros(1, np.int64)
        header[[H_TASK, H_STAGE, B_WAKE]] = [self._task.ctypes.data, _stage.address, self._wake.ctypes.data]
        header[H_MAGIC] = MAGIC
        _HEADERS.append(header)
        self.address = int(header.ctypes.data)
        self.table = tables.register_table(self.address)  # what the calls pass (an index, see tables.TABLES)
        ffi.register(TARGET_NAME, _handler)

    # ------------------------------------------------------------ calls from inside jit
    def layer(self, layer: int, x, pos, k_cache, v_cache):
        """Layer `layer` for the batch: x [B, ..., d] (B * d elements), pos int32 [B] (-1: empty slot), caches
        [B, S, KV, hd] -> (x out, caches with each live slot's position written, in place when XLA donates)."""
        if pos.shape != (self.max_batch,):
            raise ConfigError(f"x must be [{self.max_batch}, {self.config.d_model}] and pos [{self.max_batch}], got "
                              f"{x.shape} and {pos.shape}")
        return self._layer_call(layer, (pos.astype(jnp.int32),), x, k_cache, v_cache)

    def prompt(self, layer: int, x, start, count, k_cache, v_cache):
        """Layer `layer` for one sequence's tokens: rows 0..count-1 of x [B, ..., d] at positions
        start..start+count-1 (count <= B, start + count <= span), caches [S, KV, hd] (leading 1s allowed) ->
        (x out, caches with those positions written). Each token attends to the positions before it, the prompt's
        own included, and gets the single-token decoder's numbers."""
        return self._layer_call(layer, (jnp.asarray(start, jnp.int32), jnp.asarray(count, jnp.int32)), x, k_cache,
                                v_cache)

    def _layer_call(self, layer: int, ints, x, k_cache, v_cache):
        """The handler's layer or prompt form (told apart by its operand count): (layer, *ints, x, k, v) -> (x
        out, k, v), the caches aliased to the last two operands."""
        c = self.config
        if not 0 <= int(layer) < c.n_layers:
            raise ConfigError(f"layer {layer} out of range [0, {c.n_layers})")
        if x.size != self.max_batch * c.d_model:
            raise ConfigError(f"x must be [{self.max_batch}, {c.d_model}], got {x.shape}")
        result = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                  jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
        k_at = 2 + len(ints)
        call = jax.ffi.ffi_call(TARGET_NAME, result, input_output_aliases={k_at: 1, k_at + 1: 2})
        return call(jnp.int32(layer), *ints, x.astype(jnp.float32), k_cache, v_cache, table=np.int64(self.table))

    def woken(self):
        """Inside jit: int32 [], nonzero once wake() was called (since the last clear_wake()). Side-effecting, so
        XLA reads it where it stands, every time (in a loop of steps: after each)."""
        call = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True)
        return call(table=np.int64(self.table))

    def wake(self) -> None:
        """From any thread: a running loop of steps ends after its current step (woken() turns nonzero)."""
        self._wake[0] = 1

    def clear_wake(self) -> None:
        self._wake[0] = 0

    def head(self, hidden, pos):
        """hidden [B, d] -> logits [B, vocab] (int8 head; zeros where pos < 0)."""
        c = self.config
        if hidden.shape != (self.max_batch, c.d_model):
            raise ConfigError(f"hidden must be [{self.max_batch}, {c.d_model}], got {hidden.shape}")
        call = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct((self.max_batch, c.vocab_size), jnp.float32))
        return call(hidden.astype(jnp.float32), pos.astype(jnp.int32), table=np.int64(self.table))

