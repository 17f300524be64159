"""The dense decode step's kernels on the host CPU: one XLA FFI call per layer and one for the head, the
``pjinfer_host_decode`` target. The Python side (HostDecoder, the weights it stores) is cpu_offload/decoder.py.

Why: at batch 1 a decode step reads every weight once. XLA on the CPU keeps weights in float32 (a jitted dot on
int8 weights converted to float32 measured slower, not faster) and spends a thunk on each of one token's many small ops.
Here every matrix of a Llama-family layer is stored quantized, in a block type of ``blocks.py``'s table, and one
Numba call does the whole layer: the layers' matrices as int8 (``F_INT8``: rows and their scales in the table) or
as GGUF blocks (``F_BLOCKS``: each matrix's blocks, its ggml type number in the table slot after them), the output
head in the type H_HEAD_KIND names (``blocks.FORMATS`` say which a format stores).
One layer (``_execute_layer``), under the ffi lock:
    h = rmsnorm(x) * attn_norm                            caller thread
    qkv = Wqkv h                                          team: rows split (stage QKV)
    rope(q, k); cache[pos] = k, v (float16)               caller thread
    att = softmax(q K^T / sqrt(hd)) V per head            team: positions or heads split (ATTN, attention.py)
    x += Wo att                                           team: rows split (O)
    h = rmsnorm(x) * ffn_norm                             caller thread
    a = act(Wgate h, Wup h)                               team: neurons split (GATE_UP)
    x += Wdown a                                          team: rows split (DOWN)
The team (``team.py``) is this thread plus workers that wait spinning, so a stage is cheap to hand out. The
KV cache arrays (float16, [..., S, KV, hd]) are operands aliased to results: XLA donates them and the layer writes
position ``pos`` in place.

Matrices are stored one row per output (a stored w_down_t is [d, d_ff], untransposed: pjinfer.runtime.model's rule for
quantized matrices), so every stage is a GEMV over contiguous rows (``gemv_at``, the row's type's GEMV):
``int8.gemv`` takes four rows at a time against one pass over x; ``quants.gemv`` takes one row at a time: under
F_BLOCKS the types ``q8_dot`` reads (``q8_dot.KINDS``: every GGUF type the loader keeps) multiply their codes with x
rounded to about 15 bits, in integers; under F_BLOCKS_FLOAT each block is dequantized in registers.

Supported: the Llama family (RMSNorm, RoPE, grouped-query attention, gated FFN, no biases but Qwen2's q/k/v ones)
with d_model, n_heads*head_dim and d_ff multiples of 64. Anything else is refused with a ConfigError-style ValueError.

Lifetime: like ``bridge.ColdFFN``, the header whose address compiled executables carry is never freed; the
weights live as long as the HostDecoder (a jitted function holding the model holds it).
"""
from __future__ import annotations

import numpy as np

from . import activation, attention, blocks, ffi, int8, kernels, q4, q8_dot, quants, tables, team, vector_ir
from .ffi import (BUF_DATA, BUF_DIMS, BUF_DTYPE, BUF_RANK, CF_ARGS, CF_NARGS, CF_NRETS, CF_RETS, DT_F16, DT_F32, DT_S32,
                  ERRC_INVALID_ARGUMENT, ERRC_OUT_OF_RANGE, NOJIT, buffer_numel, cstr,
                  last_dim, load_i32, load_i64, lock, make_error, ptr_f32, ptr_f64, ptr_i8, ptr_i32, ptr_u8, ptr_u16,
                  store_i64, unlock)
from .activation import act_span
from .blocks import INT8
from .kernels import QBLOCK, rmsnorm, rope
from .team import cycles
from .qtensor import aligned_zeros

from numba import carray, njit  # noqa: E402

from .cfuncs import HANDLER, STAGE, DeferredCFunc  # noqa: E402

TARGET_NAME = "pjinfer_host_decode"
MAGIC = 0x706A686F7374_0001  # "pjhost" + 1

# Header slots (int64; eps as a float64 bit pattern).
(H_MAGIC, H_NLAYERS, H_D, H_HEADS, H_KV, H_HD, H_FF, H_VOCAB, H_ACT, H_EPS, H_MAXLEN, H_TABLE, H_HEAD,
 H_HEAD_SCALES, H_INV_FREQ, H_SCRATCH, H_TASK, H_TEAM, H_STAGE, H_RUNTIME, H_FORMAT, H_HEAD_KIND, H_CLOCKS) = range(23)
H_WIDTH = 24
# H_CLOCKS: 0, or the address of int64 [CLOCKS] counters the handler adds time-stamp cycles (team.cycles) into while
# a decode is timed where it runs (HostDecoder.clocked): slots ST_* each stage on the calling thread, its share and
# then the wait for the workers'; CLK_WAIT those waits; CLK_LAYERS and CLK_HEADS the layer and head calls, whole.
CLK_WAIT, CLK_LAYERS, CLK_HEADS = 6, 7, 8
CLOCKS = 9
# H_FORMAT: how the layers' matrices are stored (int8, or GGUF blocks), and so how they are read. F_BLOCKS reads
# the types q8_dot has against rounded inputs (quants.gemv's rounded), F_BLOCKS_FLOAT against float32
# inputs (PredictedHostDecoder: its tests hold it to XLA's masked model, neuron by neuron).
F_INT8, F_BLOCKS, F_BLOCKS_FLOAT = 0, 1, 2
# Layer table slots: (int8 rows, float32 block scales) or (blocks, ggml type number) per matrix, then the two norm
# scales.
(L_Q, L_Q_S, L_K, L_K_S, L_V, L_V_S, L_O, L_O_S, L_GATE, L_GATE_S, L_UP, L_UP_S, L_DOWN, L_DOWN_S, L_ATTN_NORM,
 L_FFN_NORM, L_QKV_BIAS) = range(17)
L_WIDTH = 17   # L_QKV_BIAS: Qwen2's q, k and v biases as one float32 [(H + 2 KV) hd], or 0
# The stored matrices of a layer: canonical name -> table slot.
MATRICES = {"wq": L_Q, "wk": L_K, "wv": L_V, "wo": L_O, "w_gate": L_GATE, "w_up": L_UP, "w_down_t": L_DOWN}
# Task slots: what the current stage works on.
K_STAGE, K_LAYER, K_POS, K_KCACHE, K_VCACHE, K_OUT = range(6)
ST_QKV, ST_ATTN, ST_O, ST_GATE_UP, ST_DOWN, ST_HEAD = range(6)


# ---------------------------------------------------------------------------------------------------------------
# Views of the host memory a header describes.

@njit(**NOJIT)
def i8_view(addr, rows, cols):
    return carray(ptr_i8(addr), (rows, cols))


@njit(**NOJIT)
def f32_view(addr, n):
    return carray(ptr_f32(addr), (n,))


@njit(**NOJIT)
def f32_view_2d(addr, rows, cols):
    return carray(ptr_f32(addr), (rows, cols))


@njit(**NOJIT)
def dims(header):
    return (load_i64(header + 8 * H_D), load_i64(header + 8 * H_HEADS), load_i64(header + 8 * H_KV),
            load_i64(header + 8 * H_HD), load_i64(header + 8 * H_FF))


def new_scratch(c) -> np.ndarray:
    """Zeroed float32 memory for ``scratch``'s views of a model with config c, starting on a 64-byte line (the
    GEMMs' vector loads from a row off a line read two lines)."""
    nqkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    return aligned_zeros(3 * c.d_model + nqkv + c.n_heads * c.head_dim + 2 * c.d_ff + c.n_heads * c.max_seq_len,
                         np.float32)


@njit(**NOJIT)
def scratch(header):
    """The float32 working vectors: h [d], qkv [(H + 2 KV) hd], att [H hd], o [d], gate [F], up [F], down [d],
    scores [H, max_len]."""
    d, nh, nkv, hd, ff = dims(header)
    base = load_i64(header + 8 * H_SCRATCH)
    nqkv = (nh + 2 * nkv) * hd
    sizes = (d, nqkv, nh * hd, d, ff, ff, d)
    views = []
    off = base
    for n in sizes:
        views.append(f32_view(off, n))
        off += 4 * n
    scores = f32_view_2d(off, nh, load_i64(header + 8 * H_MAXLEN))
    return views[0], views[1], views[2], views[3], views[4], views[5], views[6], scores


@njit(**NOJIT)
def int8_matrix(header, layer, slot, rows, cols):
    table = load_i64(header + 8 * H_TABLE) + 8 * L_WIDTH * layer
    return (i8_view(load_i64(table + 8 * slot), rows, cols),
            f32_view_2d(load_i64(table + 8 * (slot + 1)), rows, cols // QBLOCK))


@njit(**NOJIT)
def rounded_input(header, x):
    """x rounded once (q8_dot.quantize_input) for every GEMV of a stage that reads it, under F_BLOCKS; for the other
    formats, which read x itself, an empty rounding."""
    if load_i64(header + 8 * H_FORMAT) == F_BLOCKS:
        return q8_dot.quantize_input(x)
    return q8_dot.quantize_input(x[:0])


@njit(**NOJIT)
def gemv_at(code, addr, scales, rows, x, xr, y, lo, hi, rounded):
    """y[lo:hi] = rows lo..hi-1 of the matrix at addr (block type code, blocks.TYPES; int8's scales at scales)
    times x: the type's host GEMV; with rounded, a type q8_dot reads takes x as rounded in xr (rounded_input)."""
    cols = x.shape[0]
    if code == INT8:
        int8.gemv(i8_view(addr, rows, cols), f32_view_2d(scales, rows, cols // QBLOCK), x, y, lo, hi)
        return
    q = carray(ptr_u8(addr), (rows, quants.row_bytes(code, cols)))
    if rounded and q8_dot.BLOCK_OF[code]:
        q8_dot.gemv_rounded(code, q, xr, y, lo, hi)
    else:
        quants.gemv(code, q, x, y, lo, hi, False)


@njit(**NOJIT)
def _matvec(header, layer, slot, rows, x, xr, y, lo, hi):
    """y[lo:hi] = rows lo..hi-1 of the layer's matrix in slot times x (xr: rounded_input(header, x))."""
    entry = load_i64(header + 8 * H_TABLE) + 8 * (L_WIDTH * layer + slot)
    fmt = load_i64(header + 8 * H_FORMAT)
    code, scales = (INT8, load_i64(entry + 8)) if fmt == F_INT8 else (load_i64(entry + 8), 0)
    gemv_at(code, load_i64(entry), scales, rows, x, xr, y, lo, hi, fmt == F_BLOCKS)


ROWS = q8_dot.GROUP_ROWS   # a thread's share of a layer matrix's rows is a multiple of this (a Q4_1x16 group)


@njit(**NOJIT)
def thread_share(rows, tid, n, step):
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
    d, nh, nkv, hd, ff = dims(header)
    h, qkv, att, o, gate, up, down, scores = scratch(header)
    attention.attend_share(qkv[:nh * hd].reshape((nh, hd)), _cache(task, K_KCACHE, pos, nkv, hd),
                           _cache(task, K_VCACHE, pos, nkv, hd), pos, tid, n, scores, att.reshape((nh, hd)))


@njit(**NOJIT)
def attend(header, pos, k_ptr, v_ptr):
    """The layer's attention after RoPE: writes k and v (from the qkv scratch) into the caches at pos as float16,
    runs the ATTN stage on the team and merges its partials into the att scratch."""
    d, nh, nkv, hd, ff = dims(header)
    h, qkv, att, o, gate, up, down, scores = scratch(header)
    task = load_i64(header + 8 * H_TASK)
    store_i64(task + 8 * K_POS, pos)
    store_i64(task + 8 * K_KCACHE, k_ptr)
    store_i64(task + 8 * K_VCACHE, v_ptr)
    kv = nkv * hd
    attention.store(qkv[nh * hd:nh * hd + kv], qkv[nh * hd + kv:nh * hd + 2 * kv],
                    _cache(task, K_KCACHE, pos, nkv, hd)[pos], _cache(task, K_VCACHE, pos, nkv, hd)[pos])
    run_stage(header, ST_ATTN)
    attention.merge(pos, load_i64(load_i64(header + 8 * H_TEAM) + 8 * team.C_SIZE), scores, att.reshape((nh, hd)))


@njit(**NOJIT)
def head_share(header, h, tid, n):
    """Thread tid's share (rows in fours) of the logits at the task's K_OUT = the output head times h [d], in the
    block type H_HEAD_KIND."""
    vocab = load_i64(header + 8 * H_VOCAB)
    logits = f32_view(load_i64(load_i64(header + 8 * H_TASK) + 8 * K_OUT), vocab)
    lo, hi = thread_share(vocab, tid, n, 4)
    gemv_at(load_i64(header + 8 * H_HEAD_KIND), load_i64(header + 8 * H_HEAD), load_i64(header + 8 * H_HEAD_SCALES),
            vocab, h, rounded_input(header, h), logits, lo, hi, load_i64(header + 8 * H_FORMAT) == F_BLOCKS)


@njit(**NOJIT)
def qkv_share(header, layer, tid, n):
    """Thread tid's share of the QKV stage: q, k and v (three matrices) = W h, each matrix's rows split, h rounded
    once. (Splitting the three as one block of rows gave one thread all of q and the other the rest of q, k and v:
    three GEMV calls against one, and the first thread waited for the second.)"""
    d, nh, nkv, hd, ff = dims(header)
    h, qkv, att, o, gate, up, down, scores = scratch(header)
    nq, nk = nh * hd, nkv * hd
    hr = rounded_input(header, h)
    for slot, r0, r1 in ((L_Q, 0, nq), (L_K, nq, nq + nk), (L_V, nq + nk, nq + 2 * nk)):
        lo, hi = thread_share(r1 - r0, tid, n, ROWS)
        _matvec(header, layer, slot, r1 - r0, h, hr, qkv[r0:r1], lo, hi)


@njit(**NOJIT)
def o_share(header, layer, tid, n):
    """Thread tid's share of the O stage: o = Wo att, rows split."""
    d = load_i64(header + 8 * H_D)
    h, qkv, att, o, gate, up, down, scores = scratch(header)
    lo, hi = thread_share(d, tid, n, ROWS)
    _matvec(header, layer, L_O, d, att, rounded_input(header, att), o, lo, hi)


def _stage_py(header, tid, n):
    task = load_i64(header + 8 * H_TASK)
    stage = load_i64(task + 8 * K_STAGE)
    layer = load_i64(task + 8 * K_LAYER)
    d, nh, nkv, hd, ff = dims(header)
    h, qkv, att, o, gate, up, down, scores = scratch(header)
    if stage == ST_QKV:
        qkv_share(header, layer, tid, n)
    elif stage == ST_ATTN:
        attend_stage(header, tid, n)
    elif stage == ST_O:
        o_share(header, layer, tid, n)
    elif stage == ST_GATE_UP:
        lo, hi = thread_share(ff, tid, n, ROWS)
        hr = rounded_input(header, h)
        _matvec(header, layer, L_GATE, ff, h, hr, gate, lo, hi)
        _matvec(header, layer, L_UP, ff, h, hr, up, lo, hi)
        act_span(gate, up, lo, hi, load_i64(header + 8 * H_ACT))
    elif stage == ST_DOWN:
        lo, hi = thread_share(d, tid, n, ROWS)
        _matvec(header, layer, L_DOWN, d, gate, rounded_input(header, gate), down, lo, hi)
    elif stage == ST_HEAD:
        head_share(header, h, tid, n)


ffi.purge_stale_cache("host_decode", attention, activation, blocks, kernels, ffi, int8, q4, q8_dot, quants, tables,
                      team, vector_ir)

# void stage(int64 header, int64 tid, int64 n): what the team runs.
stage_cfunc = DeferredCFunc(STAGE, _stage_py)


@njit(**NOJIT)
def add_i64(addr, value):
    store_i64(addr, load_i64(addr) + value)


@njit(**NOJIT)
def run_stage(header, stage):
    """Stage `stage` of the header's task on its team (the decoders' handlers share it: task slot 0 is the stage)."""
    store_i64(load_i64(header + 8 * H_TASK) + 8 * K_STAGE, stage)
    clocks = load_i64(header + 8 * H_CLOCKS)
    start = cycles()
    waited = team.run(load_i64(header + 8 * H_TEAM), load_i64(header + 8 * H_STAGE), header)
    if clocks != 0:
        add_i64(clocks + 8 * stage, cycles() - start)
        add_i64(clocks + 8 * CLK_WAIT, waited)


@njit(**NOJIT)
def add_qkv_bias(table, qkv):
    """qkv [(H + 2 KV) hd] += the layer's q/k/v biases (Qwen2; `table` the layer's row of the weight table)."""
    bias = load_i64(table + 8 * L_QKV_BIAS)
    if bias != 0:
        b = f32_view(bias, qkv.shape[0])
        for j in range(qkv.shape[0]):
            qkv[j] += b[j]


@njit(**NOJIT)
def attention_output(header, layer, pos, x, k_ptr, v_ptr):
    """The attention of a decoder layer for one token, without the residual: o (the scratch's o [d]) = Wo of the
    attention of rmsnorm(x) * attn_norm, caches [S, KV, hd] written at pos. x [d] is only read."""
    d, nh, nkv, hd, ff = dims(header)
    eps = np.float32(carray(ptr_f64(header + 8 * H_EPS), (1,))[0])
    h, qkv, att, o, gate, up, down, scores = scratch(header)
    table = load_i64(header + 8 * H_TABLE) + 8 * L_WIDTH * layer
    store_i64(load_i64(header + 8 * H_TASK) + 8 * K_LAYER, layer)
    rmsnorm(x, f32_view(load_i64(table + 8 * L_ATTN_NORM), d), eps, h)
    run_stage(header, ST_QKV)
    add_qkv_bias(table, qkv)
    inv_freq = f32_view(load_i64(header + 8 * H_INV_FREQ), hd // 2)
    rope(qkv[:nh * hd], nh, hd, inv_freq, pos)
    rope(qkv[nh * hd:(nh + nkv) * hd], nkv, hd, inv_freq, pos)
    attend(header, pos, k_ptr, v_ptr)
    run_stage(header, ST_O)
    return o


@njit(**NOJIT)
def ffn_input(header, layer, x):
    """h (the scratch's first vector) = rmsnorm(x) * ffn_norm: the FFN's input for the residual x [d]."""
    d = load_i64(header + 8 * H_D)
    eps = np.float32(carray(ptr_f64(header + 8 * H_EPS), (1,))[0])
    table = load_i64(header + 8 * H_TABLE) + 8 * L_WIDTH * layer
    rmsnorm(x, f32_view(load_i64(table + 8 * L_FFN_NORM), d), eps, scratch(header)[0])


@njit(**NOJIT)
def run_attention(header, layer, pos, x, k_ptr, v_ptr):
    """x [d] += attention_output, then ffn_input: the attention half of a layer (predicted_decode.py runs this, then
    its own FFN)."""
    o = attention_output(header, layer, pos, x, k_ptr, v_ptr)
    for j in range(x.shape[0]):
        x[j] += o[j]
    ffn_input(header, layer, x)


@njit(**NOJIT)
def ffn_output(header, layer):
    """The FFN's output (the scratch's down [d]) for its input h (ffn_input's, the scratch's first vector)."""
    store_i64(load_i64(header + 8 * H_TASK) + 8 * K_LAYER, layer)
    run_stage(header, ST_GATE_UP)
    run_stage(header, ST_DOWN)
    return scratch(header)[6]


@njit(**NOJIT)
def run_layer(header, layer, pos, x, k_ptr, v_ptr):
    """One decoder layer for one token, x [d] updated in place; caches [S, KV, hd] written at pos."""
    run_attention(header, layer, pos, x, k_ptr, v_ptr)
    down = ffn_output(header, layer)
    for j in range(x.shape[0]):
        x[j] += down[j]


@njit(**NOJIT)
def run_head(header, hidden, logits_ptr):
    d = load_i64(header + 8 * H_D)
    h = scratch(header)[0]
    for j in range(d):
        h[j] = hidden[j]
    store_i64(load_i64(header + 8 * H_TASK) + 8 * K_OUT, logits_ptr)
    run_stage(header, ST_HEAD)


# ---------------------------------------------------------------------------------------------------------------
# The handler. Two call forms, told apart by their operand count:
# - layer: (layer i32 [], pos i32 [], x f32 [d elements], k f16 [..., S, KV, hd], v like k)
#          -> (x f32 like the operand, k, v), k and v aliased to operands 3 and 4;
# - head:  (hidden f32 [d elements]) -> logits f32 [vocab elements].

@njit(**NOJIT)
def cache_rows(buf, nkv, hd):
    """S of a [..., S, KV, hd] cache buffer, or -1 when its shape does not end in (KV, hd)."""
    rank = load_i64(buf + BUF_RANK)
    if rank < 3 or last_dim(buf) != hd:
        return -1
    if load_i64(load_i64(buf + BUF_DIMS) + 8 * (rank - 2)) != nkv:
        return -1
    return buffer_numel(buf, False) // (nkv * hd)


@njit(**NOJIT)
def head_operands(api, args, rets, header):
    """The head form's buffers checked (a decode handler's, this one's or sparse_decode's): (error or 0, the
    hidden state's address, the logits' address)."""
    b_x, b_out = load_i64(args), load_i64(rets)
    if (load_i32(b_x + BUF_DTYPE) != DT_F32 or load_i32(b_out + BUF_DTYPE) != DT_F32
            or buffer_numel(b_x, False) != load_i64(header + 8 * H_D)
            or buffer_numel(b_out, False) != load_i64(header + 8 * H_VOCAB)):
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr("host decode: head form is hidden f32 [d] -> logits f32 "
                                                           "[vocab]")), 0, 0
    return 0, load_i64(b_x + BUF_DATA), load_i64(b_out + BUF_DATA)


@njit(**NOJIT)
def layer_operands(api, args, rets, header):
    """The layer form's operands checked (dtypes, shapes, aliasing, layer and position ranges) and x copied to the
    result: (error or 0, layer, pos, the result x's address, the k and v caches' addresses)."""
    d, nh, nkv, hd, ff = dims(header)
    b_layer, b_pos, b_x = load_i64(args), load_i64(args + 8), load_i64(args + 16)
    b_k, b_v = load_i64(args + 24), load_i64(args + 32)
    r_x, r_k, r_v = load_i64(rets), load_i64(rets + 8), load_i64(rets + 16)
    if (load_i32(b_layer + BUF_DTYPE) != DT_S32 or load_i32(b_pos + BUF_DTYPE) != DT_S32
            or load_i32(b_x + BUF_DTYPE) != DT_F32 or load_i32(b_k + BUF_DTYPE) != DT_F16
            or load_i32(b_v + BUF_DTYPE) != DT_F16 or load_i32(r_x + BUF_DTYPE) != DT_F32
            or buffer_numel(b_layer, False) != 1 or buffer_numel(b_pos, False) != 1
            or buffer_numel(b_x, False) != d or buffer_numel(r_x, False) != d):
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr(
            "host decode: layer form is (int32 [], int32 [], f32 [d], f16 cache, f16 cache)")), 0, 0, 0, 0, 0
    length = cache_rows(b_k, nkv, hd)
    if length < 1 or cache_rows(b_v, nkv, hd) != length or length > load_i64(header + 8 * H_MAXLEN):
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr(
            "host decode: caches must be [..., S, kv_heads, head_dim], S at most the model's context")), 0, 0, 0, 0, 0
    k_ptr, v_ptr = load_i64(b_k + BUF_DATA), load_i64(b_v + BUF_DATA)
    if load_i64(r_k + BUF_DATA) != k_ptr or load_i64(r_v + BUF_DATA) != v_ptr:
        return make_error(api, ERRC_INVALID_ARGUMENT,
                          cstr("host decode: the caches must be aliased to results 2 and 3")), 0, 0, 0, 0, 0
    layer = carray(ptr_i32(load_i64(b_layer + BUF_DATA)), (1,))[0]
    pos = carray(ptr_i32(load_i64(b_pos + BUF_DATA)), (1,))[0]
    if layer < 0 or layer >= load_i64(header + 8 * H_NLAYERS):
        return make_error(api, ERRC_OUT_OF_RANGE, cstr("host decode: layer index out of range")), 0, 0, 0, 0, 0
    if pos < 0 or pos >= length:
        return make_error(api, ERRC_OUT_OF_RANGE, cstr("host decode: position outside the cache")), 0, 0, 0, 0, 0
    x_in, x = f32_view(load_i64(b_x + BUF_DATA), d), f32_view(load_i64(r_x + BUF_DATA), d)
    for j in range(d):
        x[j] = x_in[j]
    return 0, layer, pos, load_i64(r_x + BUF_DATA), k_ptr, v_ptr


@njit(nogil=True, inline="always")
def serve(frame, magic, layer_step, not_mine, bad_form):
    """The handler cfunc body of a single-token decoder (this module's, sparse_decode's, predicted_decode's):
    ffi.prelude, the header checked by its magic, then one of the two call forms above, under the ffi lock in the
    team's floating-point environment (FTZ/DAZ, as XLA computes): the head (run_head) or one layer,
    layer_step(header, layer, pos, x, k_ptr, v_ptr) (a jitted function: run_layer here). not_mine and bad_form:
    the decoder's messages (cstr) for a table that is not its header and for a wrong operand count. Inlined, as
    ffi.serve."""
    done, result = ffi.prelude(frame)
    if done:
        return result
    start = cycles()
    api = load_i64(frame + ffi.CF_API)
    header = tables.find_table(frame)
    if header == 0 or load_i64(header + 8 * H_MAGIC) != magic:
        return make_error(api, ERRC_INVALID_ARGUMENT, not_mine)
    nargs, nrets = load_i64(frame + CF_NARGS), load_i64(frame + CF_NRETS)
    args, rets = load_i64(frame + CF_ARGS), load_i64(frame + CF_RETS)
    if nargs == 1 and nrets == 1:
        err, x_ptr, out_ptr = head_operands(api, args, rets, header)
    elif nargs == 5 and nrets == 3:
        err, layer, pos, x_ptr, k_ptr, v_ptr = layer_operands(api, args, rets, header)
    else:
        return make_error(api, ERRC_INVALID_ARGUMENT, bad_form)
    if err != 0:
        return err
    lock(load_i64(header + 8 * H_RUNTIME))
    env = team.enter()
    x = f32_view(x_ptr, load_i64(header + 8 * H_D))
    if nargs == 1:
        run_head(header, x, out_ptr)
    else:
        layer_step(header, layer, pos, x, k_ptr, v_ptr)
    team.leave(env)
    unlock(load_i64(header + 8 * H_RUNTIME))
    clocks = load_i64(header + 8 * H_CLOCKS)
    if clocks != 0:
        add_i64(clocks + 8 * (CLK_HEADS if nargs == 1 else CLK_LAYERS), cycles() - start)
    return 0


def _handler_py(frame):
    return serve(frame, MAGIC, run_layer, cstr("pjinfer_host_decode: 'table' is not a HostDecoder"),
                 cstr("pjinfer_host_decode: expected 5 operands and 3 results, or 1 and 1"))


handler_cfunc = DeferredCFunc(HANDLER, _handler_py)
