"""The 4-bit host decode step with input sparsity (TEAL, arXiv 2408.14690): every matrix reads only the weight
columns whose input clears a fixed, calibrated threshold. One XLA FFI call per layer and one for the head.

decoder.HostDecoder reads every weight (GEMV over rows). Here every matrix keeps the GGUF's own Q4_1 numbers
laid out by input column (``q4_sparse.relayout``: the same model as HostDecoder's Q4_1 layers, the same bytes) and is
computed from the active inputs' columns only (``q4_sparse.matvec``), with four thresholds per layer, fixed at
load time (no per-token sort):

    T_ATTN  the attention input (q, k and v share it)       T_O     the input of o (the attention output)
    T_FFN   the FFN input (gate and up share it)            T_DOWN  the FFN intermediate (down's input)

An input i is active when |x_i| > threshold; a threshold of 0 skips exact zeros only (dense for SwiGLU, exact
neuron skipping for the ReLU family). pjinfer.runtime.model applies the same rule in XLA (``sparsify_input``), so
prefill and scoring compute the model the decode computes, on ``dequantized(weights)``.

One layer, under the ffi lock (host_decode's helpers for norms, RoPE, attention and the head):
    h = rmsnorm(x) * attn_norm; active(h, T_ATTN)            caller thread (active inputs and their blocks)
    qkv = sum_active h_i Wqkv[:, i]                         team: row tiles split (stage QKV)
    rope, cache write (float16); attention                  as host_decode (ATTN: attention.py)
    active(att, T_O); o = sum_active att_i Wo[:, i]         team: row tiles split (O); caller: x += o
    h = rmsnorm(x) * ffn_norm; active(h, T_FFN)
    gate | up = sum_active h_i Wgu[:, i]                    team: row tiles split (GATE_UP)
    a = act(gate, up)                                       team: neurons split (ACT)
    active(a, T_DOWN); down = sum_active a_i Wdown[:, i]    team: row tiles split (DOWN); caller: x += down
Each thread computes whole rows (q4_sparse.tile_share), so there are no partial sums to add.

The header keeps host_decode's slots (so its ``dims``, ``scratch``, ``run_stage``, ``run_head`` and ``head_share`` work
on it; the head is int8, H_HEAD_KIND blocks.INT8) and adds
the thresholds and the active-index scratch (q4_sparse.active's idx, then q4_sparse.segments' seg). Lifetime:
like HostDecoder, the header is never freed.
"""
from __future__ import annotations

import numpy as np

from . import (activation, attention, decoder, ffi, host_decode as hd, int8, kernels, q4, q4_sparse, tables, team,
               vector_ir)
from .ffi import NOJIT, RUNTIME_ADDR, cstr, load_i64, ptr_f32, ptr_f64, ptr_i32, ptr_u8, ptr_u16, store_i64
from .host_decode import (H_EPS, H_INV_FREQ, H_MAGIC, H_MAXLEN, H_NLAYERS, H_RUNTIME, H_TABLE, H_TASK, H_VOCAB,
                          K_LAYER, K_STAGE, ST_ATTN, ST_DOWN, ST_GATE_UP, ST_HEAD, ST_O, ST_QKV)
from .activation import act_span
from .blocks import INT8, Q4_1
from .q4 import BLOCK
from .qtensor import QTensor
from .contract import THRESHOLD_INPUTS, ConfigError

from numba import carray, njit  # noqa: E402

from .cfuncs import HANDLER, STAGE, DeferredCFunc  # noqa: E402

TARGET_NAME = "pjinfer_sparse_decode"
MAGIC = 0x706A7370_0001  # "pjsp" + 1
# float32 [layers, 4] thresholds; int32 active-index scratch [widest + widest / 32 + 1], widest = max(d, H hd, F):
# idx, then seg (q4_sparse.active, q4_sparse.segments). Slots below hd.H_WIDTH are host_decode's.
H_THRESH, H_IDX = hd.H_WIDTH, hd.H_WIDTH + 1
HEADER_WIDTH = 32
T_ATTN, T_O, T_FFN, T_DOWN = range(4)
# Layer table slots: per matrix three (q4_sparse.relayout's nib, d, m), then the norm scales.
L_QKV, L_O, L_GATE_UP, L_DOWN = 0, 3, 6, 9
L_ATTN_NORM, L_FFN_NORM = 12, 13
L_WIDTH = 14
K_COUNT, K_THREADS = 6, 7  # task slots: how many blocks with an active input the current stage reads; team size
ST_ACT = 6  # stage: the activation, neurons split


@njit(**NOJIT)
def _matvec(header, layer, slot, cols, x, nseg, y, tid, n):
    """Thread tid's share (row tiles) of y = W x over the active inputs (the index scratch's idx and its first
    nseg + 1 seg entries) for the layer's matrix in slot; W [len(y), cols] in q4_sparse.relayout's arrays."""
    table = load_i64(header + 8 * H_TABLE) + 8 * (L_WIDTH * layer + slot)
    out = y.shape[0]
    nib = carray(ptr_u8(load_i64(table)), (cols * out // 2,))
    d = carray(ptr_u16(load_i64(table + 8)), (cols // BLOCK, out))
    m = carray(ptr_u16(load_i64(table + 16)), (cols // BLOCK, out))
    t0, t1 = q4_sparse.tile_share(out, tid, n)
    q4_sparse.matvec(nib, d, m, _idx(header, cols), _seg(header, cols), nseg, x, y, t0, t1)


@njit(**NOJIT)
def _idx(header, n):
    return carray(ptr_i32(load_i64(header + 8 * H_IDX)), (n,))


@njit(**NOJIT)
def _seg(header, cols):
    """q4_sparse.segments' scratch for an input of cols: after the idx part of the index scratch."""
    d, nh, nkv, hd_, ff = hd.dims(header)
    return carray(ptr_i32(load_i64(header + 8 * H_IDX) + 4 * max(d, nh * hd_, ff)), (cols // BLOCK + 1,))


@njit(**NOJIT)
def _threshold(header, layer, k):
    return carray(ptr_f32(load_i64(header + 8 * H_THRESH) + 16 * layer), (4,))[k]


@njit(**NOJIT)
def _add(x, y):
    """x += y."""
    for j in range(x.shape[0]):
        x[j] += y[j]


def _stage_py(header, tid, n):
    task = load_i64(header + 8 * H_TASK)
    stage = load_i64(task + 8 * K_STAGE)
    layer = load_i64(task + 8 * K_LAYER)
    count = load_i64(task + 8 * K_COUNT)
    d, nh, nkv, hd_, ff = hd.dims(header)
    h, qkv, att, o, gate, up, down, scores = hd.scratch(header)
    # The matrix stages split the row tiles: each thread writes its own rows of the output.
    if stage == ST_QKV:
        _matvec(header, layer, L_QKV, d, h, count, qkv, tid, n)
    elif stage == ST_ATTN:
        hd.attend_stage(header, tid, n)
    elif stage == ST_O:
        _matvec(header, layer, L_O, nh * hd_, att, count, o, tid, n)
    elif stage == ST_GATE_UP:   # gate and up are adjacent in the scratch: one matrix [2 F, d]
        _matvec(header, layer, L_GATE_UP, d, h, count, hd.f32_view(gate.ctypes.data, 2 * ff), tid, n)
    elif stage == ST_ACT:
        code = load_i64(header + 8 * hd.H_ACT)
        lo, hi = hd.thread_share(ff, tid, n, 16)
        act_span(gate, up, lo, hi, code)
    elif stage == ST_DOWN:
        _matvec(header, layer, L_DOWN, ff, gate, count, down, tid, n)
    elif stage == ST_HEAD:
        hd.head_share(header, h, tid, n)


ffi.purge_stale_cache("sparse_decode", attention, activation, kernels, ffi, int8, q4, q4_sparse, tables, team, hd,
                      vector_ir)

_stage = DeferredCFunc(STAGE, _stage_py)


@njit(**NOJIT)
def _sparse_run(header, stage, x, layer, k):
    """Find x's active inputs and their blocks for threshold k of the layer, then run the stage on the team."""
    idx = _idx(header, x.shape[0])
    n = q4_sparse.active(x, _threshold(header, layer, k), idx)
    store_i64(load_i64(header + 8 * H_TASK) + 8 * K_COUNT, q4_sparse.segments(idx, n, _seg(header, x.shape[0])))
    hd.run_stage(header, stage)


@njit(**NOJIT)
def _layer(header, layer, pos, x, k_ptr, v_ptr):
    """One decoder layer for one token, x [d] updated in place; caches [S, KV, hd] written at pos."""
    d, nh, nkv, hd_, ff = hd.dims(header)
    eps = np.float32(carray(ptr_f64(header + 8 * H_EPS), (1,))[0])
    h, qkv, att, o, gate, up, down, scores = hd.scratch(header)
    table = load_i64(header + 8 * H_TABLE) + 8 * L_WIDTH * layer
    task = load_i64(header + 8 * H_TASK)
    store_i64(task + 8 * K_LAYER, layer)

    hd.rmsnorm(x, hd.f32_view(load_i64(table + 8 * L_ATTN_NORM), d), eps, h)
    _sparse_run(header, ST_QKV, h, layer, T_ATTN)
    inv_freq = hd.f32_view(load_i64(header + 8 * H_INV_FREQ), hd_ // 2)
    hd.rope(qkv[:nh * hd_], nh, hd_, inv_freq, pos)
    hd.rope(qkv[nh * hd_:(nh + nkv) * hd_], nkv, hd_, inv_freq, pos)
    hd.attend(header, pos, k_ptr, v_ptr)
    _sparse_run(header, ST_O, att, layer, T_O)
    _add(x, o)
    hd.rmsnorm(x, hd.f32_view(load_i64(table + 8 * L_FFN_NORM), d), eps, h)
    _sparse_run(header, ST_GATE_UP, h, layer, T_FFN)
    hd.run_stage(header, ST_ACT)
    _sparse_run(header, ST_DOWN, gate, layer, T_DOWN)
    _add(x, down)


def _handler_py(frame):
    return hd.serve(frame, MAGIC, _layer, cstr("pjinfer_sparse_decode: 'table' is not a SparseHostDecoder"),
                    cstr("pjinfer_sparse_decode: expected 5 operands and 3 results, or 1 and 1"))


_handler = DeferredCFunc(HANDLER, _handler_py)


# ---------------------------------------------------------------------------------------------------------------

class SparseHostDecoder(decoder.HostDecoder):
    """A Llama-family model's decode step on the host, the Q4_1 numbers laid out by input column, reading only the
    inputs above fixed thresholds (see the module docstring).

    config: pjinfer.runtime.model's ModelConfig. weights: the canonical float32 weights; each stored matrix is built from
    its own float32 matrix, one at a time. thresholds: float32 [n_layers, 4] in THRESHOLD_INPUTS' order, each >= 0.
    The output head is int8, as in HostDecoder."""

    target = TARGET_NAME

    def __init__(self, config, weights: dict, thresholds):
        c = config
        thresholds = np.ascontiguousarray(thresholds, np.float32)
        if thresholds.shape != (c.n_layers, len(THRESHOLD_INPUTS)):
            raise ConfigError(f"thresholds must be [{c.n_layers}, {len(THRESHOLD_INPUTS)}] (layers x {', '.join(THRESHOLD_INPUTS)}), "
                              f"got {list(thresholds.shape)}")
        if not (np.isfinite(thresholds).all() and (thresholds >= 0).all()):
            raise ConfigError("thresholds must be finite and >= 0")
        if not (c.uses_rope and c.gated):
            raise ConfigError(f"sparse host decode supports Llama-family models, not {c.arch!r}")
        biases = [k for k in weights if k.rsplit(".", 1)[-1] in ("bq", "bk", "bv", "bo", "b_up", "b_down", "bias")]
        if biases:
            raise ConfigError(f"sparse host decode supports models without biases, this one has {biases[0]!r}")
        if c.d_model % kernels.QBLOCK or c.head_dim % 2:
            raise ConfigError(f"sparse host decode needs d_model a multiple of {kernels.QBLOCK} (the int8 head) and "
                              f"an even head_dim, got {c.d_model} and {c.head_dim}")
        for name, n in (("d_model", c.d_model), ("n_heads * head_dim", c.n_heads * c.head_dim),
                        ("(n_heads + 2 n_kv_heads) * head_dim",
                                                  (c.n_heads + 2 * c.n_kv_heads) * c.head_dim), ("d_ff", c.d_ff)):
            if n % BLOCK:
                raise ConfigError(f"sparse host decode needs {name} to be a multiple of {BLOCK}, got {n}")
        self.config = c
        self.thresholds = thresholds
        self.team = team.shared()
        self._keep = []
        table = np.zeros((c.n_layers, L_WIDTH), np.int64)
        self._quantized = {}  # (layer, slot) -> (nib, d, m), the file's Q4_1 numbers by input column
        for l in range(c.n_layers):
            p = f"layers.{l}"
            mats = {  # W [out, in], one matrix at a time, as host_decode stores them
                L_QKV: lambda: np.concatenate([weights[f"{p}.wq"], weights[f"{p}.wk"], weights[f"{p}.wv"]]),
                L_O: lambda: weights[f"{p}.wo"],
                L_GATE_UP: lambda: np.concatenate([weights[f"{p}.w_gate"], weights[f"{p}.w_up"]]),
                L_DOWN: lambda: np.asarray(weights[f"{p}.w_down_t"]).T,
            }
            for slot, make in mats.items():
                w = np.asarray(make(), np.float32)
                arrays = q4_sparse.relayout(QTensor.quantize(Q4_1, w).data, *w.shape)
                del w
                table[l, slot:slot + 3] = [self._hold(a) for a in arrays]
                self._quantized[(l, slot)] = arrays
            table[l, L_ATTN_NORM] = self._hold(np.asarray(weights[f"{p}.attn_norm.scale"], np.float32))
            table[l, L_FFN_NORM] = self._hold(np.asarray(weights[f"{p}.ffn_norm.scale"], np.float32))
        head_name = "embed" if c.tie_embeddings else "lm_head"
        self._head_name = head_name
        self._head = QTensor(INT8, int8.quantize(weights[head_name]), c.d_model)
        inv_freq = (1.0 / (np.float32(c.rope_theta) ** (np.arange(0, c.head_dim, 2, dtype=np.float32)
                                                        / np.float32(c.head_dim)))).astype(np.float32)
        widest = max(c.d_model, c.n_heads * c.head_dim, c.d_ff)
        task = np.zeros(8, np.int64)
        task[K_THREADS] = self.team.size
        header = np.zeros(HEADER_WIDTH, np.int64)
        header[[H_NLAYERS, hd.H_D, hd.H_HEADS, hd.H_KV, hd.H_HD, hd.H_FF, H_VOCAB, hd.H_ACT, H_MAXLEN]] = [
            c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size,
            kernels.act_code(c.activation), c.max_seq_len]
        header.view(np.float64)[H_EPS] = c.norm_eps
        header[[H_TABLE, hd.H_HEAD, hd.H_HEAD_SCALES, H_INV_FREQ, hd.H_SCRATCH, H_TASK, hd.H_TEAM]] = [
            self._hold(table), self._hold(self._head.data), self._hold(self._head.arrays[1]), self._hold(inv_freq),
            self._hold(hd.new_scratch(c)), self._hold(task), self.team.address]
        header[[H_THRESH, H_IDX]] = [self._hold(thresholds),
                                     self._hold(np.zeros(widest + widest // BLOCK + 1, np.int32))]
        header[[hd.H_STAGE, H_RUNTIME]] = [_stage.address, RUNTIME_ADDR]
        header[[hd.H_FORMAT, hd.H_HEAD_KIND]] = [hd.F_BLOCKS, INT8]
        header[H_MAGIC] = MAGIC
        decoder.HEADERS.append(header)
        self.address = int(header.ctypes.data)
        self.table = tables.register_table(self.address)  # what the calls pass (an index, see tables.TABLES)
        ffi.register(TARGET_NAME, _handler)

    def dequantized(self, weights: dict) -> dict:
        """The canonical float32 weights with every stored matrix replaced by what its blocks stand for."""
        out = dict(weights)
        c = self.config
        attn, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        for l in range(c.n_layers):
            p = f"layers.{l}"
            deq = lambda slot: q4_sparse.dequantize(*self._quantized[(l, slot)])
            qkv = deq(L_QKV)
            out[f"{p}.wq"], out[f"{p}.wk"], out[f"{p}.wv"] = np.split(qkv, [attn, attn + kv_rows])
            out[f"{p}.wo"] = deq(L_O)
            out[f"{p}.w_gate"], out[f"{p}.w_up"] = np.split(deq(L_GATE_UP), 2)
            out[f"{p}.w_down_t"] = np.ascontiguousarray(deq(L_DOWN).T)
        out[self._head_name] = self._head.float32()
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of every stored matrix (the most a decode step reads; it reads the active inputs' share)."""
        return int(sum(a.nbytes for arrays in self._quantized.values() for a in arrays) + self._head.nbytes)

    def input_bytes(self) -> np.ndarray:
        """[n_layers, 4] nibble bytes of each layer's q/k/v, o, gate/up and down matrices (the thresholds' order):
        a decode step leaves a matrix's skipped-input share of these unread. The scales of a block of 32 inputs
        are read while any input in it is active, so they count as read."""
        return np.array([[self._quantized[(l, slot)][0].nbytes for slot in (L_QKV, L_O, L_GATE_UP, L_DOWN)]
                         for l in range(self.config.n_layers)], np.float64)
