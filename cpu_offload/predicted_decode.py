"""The host decode step of a PowerInfer file, sparse as PowerInfer runs it on the CPU: per layer, its predictor
picks the FFN neurons and only their rows are read (predicted_ffn.py). One XLA FFI call per layer and one for the
head, the ``pjinfer_predicted_decode`` target.

One layer, under the ffi lock:
    attention, x += its output; h = rmsnorm(x) * ffn_norm      host_decode.run_attention (its stages, its team)
    z = relu(fc1 x)                                            team: fc1's rows split (HIDDEN)
    mask = fc2 z >= t                                          team: neurons split (SCORE); the mask row of the layer
    ids = the masked neurons                                   caller
    part[tid] = sum over its ids of act(gate_i h, up_i h) down_t_i    team: ids split (FFN)
    x += part[0] + part[1] + ...                               caller
The predictor reads x, the residual stream before the FFN's norm, as PowerInfer's do. Without predictors (dense)
every neuron is in the set: the same file's dense decode through the same kernels.

The header keeps host_decode's slots (its attention, norms and head read them: the layer table holds q, k, v and o
as HostDecoder stores them in blocks.AS_STORED, the file's blocks or Q8_0) and adds the FFN table, the thresholds and
the scratch below. The FFN rows stay in the file's row types (predicted_ffn.KINDS): gate and up [d_ff, d] and
PowerInfer's ffn_down_t [d_ff, d]. Lifetime: like HostDecoder, the header is never freed.
"""
from __future__ import annotations

import numpy as np

from . import (activation, attention, blocks, decoder, ffi, host_decode as hd, int8, kernels, predicted_ffn as pf, q4,
               quants, tables, team, vector_ir)
from .ffi import NOJIT, cstr, load_i64, ptr_f32, ptr_i32, ptr_u8, store_i64
from .qtensor import aligned_zeros
from .host_decode import H_D, H_FF, H_TASK, H_TEAM, K_LAYER, K_STAGE, ST_ATTN, ST_HEAD, ST_O, ST_QKV
from .contract import ConfigError

from numba import carray, njit  # noqa: E402

from .cfuncs import HANDLER, STAGE, DeferredCFunc  # noqa: E402

TARGET_NAME = "pjinfer_predicted_decode"
MAGIC = 0x706A70726564_0001  # "pjpred" + 1
# Header slots after host_decode's: the FFN table (int64 [layers, F_WIDTH]); float32 thresholds [layers]; int32
# ids [d_ff]; uint8 masks [layers, d_ff] (each layer's predicted set for the last token it ran); int32 counts
# [layers] (their sizes); float32 partial sums [team size, d]; float32 z [largest rank]; float32 scratch [d_ff]
# (each active neuron's gate, then activation: predicted_ffn.neurons).
H_FFN, H_THRESH, H_IDS, H_MASKS, H_COUNTS, H_PARTS, H_Z, H_VALS = range(hd.H_WIDTH, hd.H_WIDTH + 8)
HEADER_WIDTH = hd.H_WIDTH + 8
# FFN table slots: (address, row type, row bytes) of gate, up, down_t, and of the predictor's fc1 and fc2 (fc1's
# address 0: dense); the predictor's rank as its rows are padded (predicted_ffn.predictor_rows).
(F_GATE, F_GATE_KIND, F_GATE_BYTES, F_UP, F_UP_KIND, F_UP_BYTES, F_DOWN, F_DOWN_KIND, F_DOWN_BYTES, F_FC1, F_FC1_KIND,
 F_FC1_BYTES, F_FC2, F_FC2_KIND, F_FC2_BYTES, F_RANK) = range(16)
F_WIDTH = 16
K_COUNT, K_X = 6, 7    # task slots: the active neurons' count; the address of x (the residual stream)
ST_HIDDEN, ST_SCORE, ST_FFN = 6, 7, 8
ATTENTION = {m: slot for m, slot in hd.MATRICES.items() if m in ("wq", "wk", "wv", "wo")}
FFN = ("w_gate", "w_up", "w_down_t")


@njit(**NOJIT)
def _ffn_entry(header, layer):
    return load_i64(header + 8 * H_FFN) + 8 * F_WIDTH * layer


@njit(**NOJIT)
def _rows(entry, slot, rows):
    """The uint8 [rows, row bytes] matrix whose (address, type, row bytes) start at the entry's slot."""
    return carray(ptr_u8(load_i64(entry + 8 * slot)), (rows, load_i64(entry + 8 * (slot + 2))))


@njit(**NOJIT)
def _mask(header, layer, ff):
    return carray(ptr_u8(load_i64(header + 8 * H_MASKS) + ff * layer), (ff,))


@njit(**NOJIT)
def _parts(header, n):
    d = load_i64(header + 8 * H_D)
    return carray(ptr_f32(load_i64(header + 8 * H_PARTS)), (n, d))


def _stage_py(header, tid, n):
    task = load_i64(header + 8 * H_TASK)
    stage = load_i64(task + 8 * K_STAGE)
    layer = load_i64(task + 8 * K_LAYER)
    d, nh, nkv, hd_, ff = hd.dims(header)
    h = hd.scratch(header)[0]
    if stage == ST_QKV:
        hd.qkv_share(header, layer, tid, n)
    elif stage == ST_ATTN:
        hd.attend_stage(header, tid, n)
    elif stage == ST_O:
        hd.o_share(header, layer, tid, n)
    elif stage == ST_HEAD:
        hd.head_share(header, h, tid, n)
    else:
        entry = _ffn_entry(header, layer)
        rank = load_i64(entry + 8 * F_RANK)
        z = hd.f32_view(load_i64(header + 8 * H_Z), rank)
        if stage == ST_HIDDEN:
            lo, hi = pf.share(rank, tid, n)
            pf.hidden(load_i64(entry + 8 * F_FC1_KIND), _rows(entry, F_FC1, rank),
                      hd.f32_view(load_i64(task + 8 * K_X), d), z, lo, hi)
        elif stage == ST_SCORE:
            lo, hi = pf.share(ff, tid, n)
            threshold = hd.f32_view(load_i64(header + 8 * H_THRESH), layer + 1)[layer]
            pf.predict(load_i64(entry + 8 * F_FC2_KIND), _rows(entry, F_FC2, ff), z, threshold,
                       _mask(header, layer, ff), lo, hi)
        elif stage == ST_FFN:
            lo, hi = pf.share(load_i64(task + 8 * K_COUNT), tid, n)
            pf.neurons(load_i64(entry + 8 * F_GATE_KIND), _rows(entry, F_GATE, ff),
                       load_i64(entry + 8 * F_UP_KIND), _rows(entry, F_UP, ff),
                       load_i64(entry + 8 * F_DOWN_KIND), _rows(entry, F_DOWN, ff), h,
                       carray(ptr_i32(load_i64(header + 8 * H_IDS)), (ff,)), lo, hi, load_i64(header + 8 * hd.H_ACT),
                       _parts(header, n)[tid], hd.f32_view(load_i64(header + 8 * H_VALS), ff))


ffi.purge_stale_cache("predicted_decode", activation, attention, blocks, ffi, hd, int8, kernels, pf, q4, quants, tables,
                      team, vector_ir)

_stage = DeferredCFunc(STAGE, _stage_py)


@njit(**NOJIT)
def _layer(header, layer, pos, x, k_ptr, v_ptr):
    """One decoder layer for one token, x [d] updated in place; caches [S, KV, hd] written at pos."""
    d, ff = load_i64(header + 8 * H_D), load_i64(header + 8 * H_FF)
    task = load_i64(header + 8 * H_TASK)
    hd.run_attention(header, layer, pos, x, k_ptr, v_ptr)
    store_i64(task + 8 * K_X, x.ctypes.data)
    mask = _mask(header, layer, ff)
    if load_i64(_ffn_entry(header, layer) + 8 * F_FC1) != 0:
        hd.run_stage(header, ST_HIDDEN)
        hd.run_stage(header, ST_SCORE)
    else:
        mask[:] = 1
    ids = carray(ptr_i32(load_i64(header + 8 * H_IDS)), (ff,))
    count = pf.compact(mask, ids)
    store_i64(task + 8 * K_COUNT, count)
    carray(ptr_i32(load_i64(header + 8 * H_COUNTS)), (layer + 1,))[layer] = count
    hd.run_stage(header, ST_FFN)
    n = load_i64(load_i64(header + 8 * H_TEAM) + 8 * team.C_SIZE)
    down = hd.scratch(header)[6]
    pf.reduce(_parts(header, n), n, down)
    for j in range(d):
        x[j] += down[j]


def _handler_py(frame):
    return hd.serve(frame, MAGIC, _layer, cstr("pjinfer_predicted_decode: 'table' is not a PredictedHostDecoder"),
                    cstr("pjinfer_predicted_decode: expected 5 operands and 3 results, or 1 and 1"))


_handler = DeferredCFunc(HANDLER, _handler_py)


# ---------------------------------------------------------------------------------------------------------------

class PredictedHostDecoder(decoder.HostDecoder):
    """A PowerInfer file's decode step on the host, each layer's FFN computed over its predicted neurons only (see
    the module docstring); ``layer(...)`` and ``head(...)`` as HostDecoder's.

    config: pjinfer.runtime.model's ModelConfig (a gated FFN). weights: canonical weights whose w_gate, w_up and
    w_down_t are the file's rows ([d_ff, d] each, w_down_t PowerInfer's ffn_down_t), each a qtensor QTensor of a
    GGUF block type, or a float16 / float32 array (F16 / F32 rows: predicted_ffn.stored_rows); q, k, v, o and the
    head as HostDecoder's format blocks.AS_STORED takes them. fc1 [rank_l, d] and fc2 [d_ff, rank_l] per layer,
    float16 or float32 as the file stores them (read in place where the rank is a multiple of 32:
    predicted_ffn.predictor_rows), and threshold: PowerInfer's predictors (pjinfer.load.powerinfer.Predictors'
    fields); fc1 None: every neuron computed (dense)."""

    target = TARGET_NAME
    matrices, header_width, magic, stage, handler = ATTENTION, HEADER_WIDTH, MAGIC, _stage, _handler
    # Attention and the head read float32 inputs: the predictor decides each neuron against a threshold, and its
    # tests hold every decision to XLA's masked model, which a rounding of the attention's inputs would move.
    rounds_inputs = False

    def __init__(self, config, weights: dict, fc1=None, fc2=None, threshold: float = 0.0):
        c = config
        if not c.gated:
            raise ConfigError(f"the predicted host decode runs gated FFNs, not {c.activation!r}")
        if (fc1 is None) != (fc2 is None) or fc1 is not None and not len(fc1) == len(fc2) == c.n_layers:
            raise ConfigError(f"predictors need fc1 and fc2 for each of the {c.n_layers} layers")
        super().__init__(config, weights, blocks.AS_STORED)
        self.ffn_rows = {}   # (layer, name) -> (uint8 rows, row type), as stored
        self.predictors = None if fc1 is None else [self._predictor(l, a, b) for l, (a, b) in enumerate(zip(fc1, fc2))]
        table = np.zeros((c.n_layers, F_WIDTH), np.int64)
        for l in range(c.n_layers):
            for name, slot in zip(FFN, (F_GATE, F_UP, F_DOWN)):
                data, kind = self._ffn_matrix(weights, l, name)
                table[l, slot:slot + 3] = self._hold(data), kind, data.shape[1]
            if self.predictors is not None:
                (a, a_kind), (b, b_kind), rank = self.predictors[l]
                table[l, F_FC1:F_FC1 + 3] = self._hold(a), a_kind, a.shape[1]
                table[l, F_FC2:F_FC2 + 3] = self._hold(b), b_kind, b.shape[1]
                table[l, F_RANK] = rank
        rank = max([1] + [rank for _, _, rank in self.predictors or []])
        self.threshold = np.float32(threshold)
        self.masks = np.zeros((c.n_layers, c.d_ff), np.uint8)    # the last token's predicted sets, as run
        self.counts = np.zeros(c.n_layers, np.int32)
        h = self.header
        h[[H_FFN, H_THRESH, H_IDS, H_MASKS, H_COUNTS, H_PARTS, H_Z, H_VALS]] = [
            self._hold(table), self._hold(np.full(c.n_layers, self.threshold, np.float32)),
            self._hold(np.zeros(c.d_ff, np.int32)), self._hold(self.masks), self._hold(self.counts),
            self._hold(aligned_zeros((self.team.size, c.d_model), np.float32)),
            self._hold(np.zeros(rank, np.float32)), self._hold(np.zeros(c.d_ff, np.float32))]

    def _ffn_matrix(self, weights: dict, layer: int, name: str) -> tuple[np.ndarray, int]:
        c = self.config
        try:
            data, kind = pf.stored_rows(weights[f"layers.{layer}.{name}"])
            want = (c.d_ff, pf.row_bytes(kind, c.d_model))
        except (KeyError, ValueError) as e:
            raise ConfigError(f"layers.{layer}.{name}: {e}") from None
        if data.shape != want:
            raise ConfigError(f"layers.{layer}.{name} must be [{c.d_ff}, {c.d_model}] {pf.KINDS[kind][0]} rows, "
                              f"got {data.shape[0]} rows of {data.shape[1]} bytes")
        self.ffn_rows[(layer, name)] = (data, kind)
        return data, kind

    def _predictor(self, layer: int, fc1, fc2):
        """Layer's predictor as the kernels read it (predicted_ffn.predictor_rows), its shapes checked."""
        c = self.config
        a, b = np.asarray(fc1), np.asarray(fc2)
        if a.ndim != 2 or a.shape[1] != c.d_model or b.shape != (c.d_ff, a.shape[0]):
            raise ConfigError(f"layer {layer}'s predictor is fc1 {list(a.shape)}, fc2 {list(b.shape)}; the model "
                              f"needs fc1 [rank, {c.d_model}] and fc2 [{c.d_ff}, rank]")
        return pf.predictor_rows(a, b)

    @property
    def dense(self) -> bool:
        return self.predictors is None

    @property
    def nbytes(self) -> int:
        """Bytes of every stored matrix (a dense step reads them all; a sparse one its predicted rows of the FFN)
        and of the predictors."""
        predictors = 0 if self.dense else sum(a.nbytes + b.nbytes for (a, _), (b, _), _ in self.predictors)
        return super().nbytes + sum(data.nbytes for data, _ in self.ffn_rows.values()) + predictors

    def dequantized(self, weights: dict) -> dict:
        """The canonical float32 weights with every stored matrix replaced by what it stands for."""
        out = super().dequantized(weights)
        for (l, name), (data, kind) in self.ffn_rows.items():
            out[f"layers.{l}.{name}"] = pf.float32_rows(data, kind, self.config.d_model)
        return out

    def last_active(self) -> np.ndarray:
        """bool [layers, d_ff]: each layer's predicted set for the last token it decoded (a copy; read it once the
        step's results are ready)."""
        return self.masks.astype(bool)
