"""PowerInfer's sparse FFN for one token on the host, reading the file's own row types: the layer's predictor picks
the neurons, gate and up are computed over those rows only, and down is an AXPY over the same neurons' rows of
``ffn_down_t`` ([d_ff, d_model] as PowerInfer stores it: each neuron's down weights one contiguous row).

One layer's FFN, given h (the FFN's input, after its norm) and r (the residual stream before that norm, what
PowerInfer's predictors read), in stages that a thread team splits (``predicted_decode.py`` runs them):

    z = relu(fc1 r)                                [rank]       HIDDEN: fc1's rows split       (hidden)
    mask_i = fc2_i . z >= t                        [d_ff]       SCORE: neurons split           (predict)
    ids = the neurons with mask_i set, ascending                caller                         (compact)
    a_i = act(gate_i . h, up_i . h), i in ids                   FFN: ids split                 (neurons)
    part[tid] = sum over its ids of a_i down_t_i   [d]          each thread its own partial
    y = part[0] + part[1] + ...                    [d]          caller, in thread order        (reduce)

The predictor (fc1 [rank, d], fc2 [d_ff, rank], threshold t) is read as the file stores it, float16 (PowerInfer's)
or float32 rows (predictor_rows), each row's dot accumulated in float32, as PowerInfer's rule `score >= t` reads
(pjinfer.load.powerinfer). For the ReLU family with a gate (ReGLU, dReLU) a neuron whose gate is <= 0 has
activation 0: its up row and its down row are not read. A neuron whose activation is 0 adds nothing and its down
row is skipped too.

Row types (``KINDS``): llama.cpp's block types through quants.py's emitters (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K), and float rows: F16 (ggml type 1) and F32 (0), read as "blocks" of 32 weights. A matrix is uint8
[rows, row_bytes(kind, cols)]. ``row_dot`` is a row's dot with a float32 vector (quants.row_dot for the block
types), ``row_axpy`` adds a multiple of a row to a float32 vector, both 16 lanes at a time in LLVM vector IR, so
that a row's weights are computed as the dot product computes them.

``ffn`` runs the stages from Python with n simulated threads (the tests' entry); ``predicted_decode.py`` runs the
same functions on the team.
"""
from __future__ import annotations

import numpy as np

from ._numba import JIT  # (first: the threading layer and the BLAS check, before numba is imported)

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import activation, blocks, ffi, kernels, quants, vector_ir  # noqa: E402
from .contract import ConfigError  # noqa: E402
from .activation import act  # noqa: E402
from .kernels import prefetch_lines  # noqa: E402

ffi.purge_stale_cache("predicted_ffn", activation, blocks, kernels, quants, vector_ir)

F32, F16 = 0, 1
# ggml type number -> (name, weights per block, bytes per block): the float rows, then quants.py's block types.
KINDS = {F32: ("F32", 32, 128), F16: ("F16", 32, 64)} | {k: (t.name, t.block, t.nbytes) for k, t in
                                                           blocks.GGUF_TYPES.items()}
RELU_GATED = (2, 3)   # activation codes (cpu_offload.activation) whose activation is 0 wherever the gate is <= 0
_F0 = np.float32(0.0)
PREFETCH_AHEAD = 4   # neurons() prefetches the rows this many places ahead in its share, in each pass
KINDS_BLOCK = np.zeros(16, np.int64)   # weights per block by type number, as a table Numba code can index
for _k, (_, _b, _) in KINDS.items():
    KINDS_BLOCK[_k] = _b

_i64, _v16f = vector_ir.I64, vector_ir.V16F
_v16h = ir.VectorType(ir.HalfType(), 16)


def row_bytes(kind: int, cols: int) -> int:
    """Bytes of a row of cols weights of type kind (cols a multiple of its block)."""
    name, block, nbytes = KINDS[kind]
    if cols % block:
        raise ConfigError(f"{name} rows need a multiple of {block} weights, got {cols}")
    return cols // block * nbytes


class _AxpyRow(quants._Row):
    """quants' row emitter turned around: each group of 16 weights w becomes y[e:e + 16] += a * w, y at address ya
    (the weights are computed by the same emitters, so they are the dot product's weights)."""

    def __init__(self, builder, ya, a):
        super().__init__(builder, ya)
        self.a16 = vector_ir.splat(builder, a)

    def add(self, w, elem, slot):
        b = self.b
        at = vector_ir.pointer(b, b.add(self.xa, b.mul(elem, _i64(4))), _v16f)
        b.store(b.call(self.fma, [w, self.a16, b.load(at, align=4)]), at, align=4)


def _emit_float(row, kind, bp, x0):
    """32 weights of an F32 or F16 row at address bp, inputs from element x0."""
    b = row.b
    for half in range(2):
        if kind == F16:
            w = b.fpext(vector_ir.load(b, row.addr(bp, 32 * half), _v16h, 1), _v16f)
        else:
            w = vector_ir.load(b, row.addr(bp, 64 * half), _v16f, 1)
        row.add(w, b.add(x0, _i64(16 * half)), half)


def _emit_row(row, kind, p, nb):
    _, block, nbytes = KINDS[kind]
    with cgutils.for_range(row.b, nb) as loop:
        bp = row.b.add(p, row.b.mul(loop.index, _i64(nbytes)))
        x0 = row.b.mul(loop.index, _i64(block))
        if kind in (F32, F16):
            _emit_float(row, kind, bp, x0)
        else:
            quants.emit_block(row, kind, bp, x0)


@intrinsic
def row_dot(typingctx, kind, p, nb, xa):
    """An intrinsic (kind, p, nb, xa) -> float32: the dot of one row (nb blocks of type kind, of KINDS: each type's
    code is a case of a switch on kind) at address p with the float32 input at address xa."""
    if not all(isinstance(t, types.Integer) for t in (kind, p, nb, xa)):
        return None

    def codegen(context, builder, sig, args):
        def emit(code):
            if code not in (F32, F16):
                return quants.emit_row_dot(builder, *args[1:], code)
            row = quants._Row(builder, args[3])
            _emit_row(row, code, args[1], args[2])
            return row.total()
        kind = context.cast(builder, args[0], sig.args[0], types.int64)
        return vector_ir.by_value(builder, kind, KINDS, emit, vector_ir.F32)
    return types.float32(kind, types.int64, types.int64, types.int64), codegen


@intrinsic
def row_axpy(typingctx, kind, p, nb, ya, a):
    """An intrinsic (kind, p, nb, ya, a): y += a * the row of nb blocks of type kind (of KINDS; each type's code is
    a case of a switch on kind) at address p, y float32 at address ya."""
    if not all(isinstance(t, types.Integer) for t in (kind, p, nb, ya)):
        return None

    def codegen(context, builder, sig, args):
        emit = lambda code: _emit_row(_AxpyRow(builder, args[3], args[4]), code, args[1], args[2])  # noqa: E731
        vector_ir.by_value(builder, context.cast(builder, args[0], sig.args[0], types.int64), KINDS, emit)
        return context.get_dummy_value()
    return types.void(kind, types.int64, types.int64, types.int64, types.float32), codegen


# ---------------------------------------------------------------------------------------------------------------
# The stages. Each takes its share [lo, hi) of rows or ids; the caller picks the shares (share()).

@njit(**JIT)
def share(count, tid, n):
    """Thread tid's part [lo, hi) of count items split into n contiguous parts."""
    chunk = (count + n - 1) // n
    lo = min(count, tid * chunk)
    return lo, min(count, lo + chunk)


@njit(**JIT)
def hidden(fc1_kind, fc1, r, z, lo, hi):
    """z[k] = relu(fc1[k] . r) for k in [lo, hi): the predictor's hidden layer (fc1: uint8 rows of len(r) weights of
    row type fc1_kind, predictor_rows')."""
    nb, xa = r.shape[0] // KINDS_BLOCK[fc1_kind], r.ctypes.data
    for k in range(lo, hi):
        z[k] = max(row_dot(fc1_kind, fc1.ctypes.data + k * fc1.strides[0], nb, xa), _F0)


@njit(**JIT)
def predict(fc2_kind, fc2, z, threshold, mask, lo, hi):
    """mask[i] = 1 where fc2[i] . z >= threshold, else 0, for neurons i in [lo, hi) (fc2: uint8 rows of len(z)
    weights of row type fc2_kind, predictor_rows')."""
    nb, za = z.shape[0] // KINDS_BLOCK[fc2_kind], z.ctypes.data
    for i in range(lo, hi):
        mask[i] = 1 if row_dot(fc2_kind, fc2.ctypes.data + i * fc2.strides[0], nb, za) >= threshold else 0


@njit(**JIT)
def compact(mask, ids):
    """ids[:count] = the neurons whose mask is set, ascending; returns count."""
    count = 0
    for i in range(mask.shape[0]):
        if mask[i]:
            ids[count] = i
            count += 1
    return count


@njit(**JIT)
def neurons(gate_kind, gate, up_kind, up, down_kind, down, h, ids, lo, hi, code, part, vals):
    """part = sum over ids[lo:hi] of act(gate_i . h, up_i . h) * down_i (part float32 [d], overwritten). gate and
    up: uint8 [d_ff, row bytes] rows of d = len(h) weights; down: uint8 [d_ff, row bytes] rows of len(part).
    vals: float32 scratch of at least hi entries (vals[lo:hi] is overwritten).

    Three passes over the share, each over rows it knows in advance, so that the row PREFETCH_AHEAD places ahead is
    prefetched whole where that pass reads it (the active rows come in no order the hardware prefetcher follows):
    every gate dot; the up dots of the neurons the gate leaves (a gate <= 0 silences a ReLU-gated neuron: its up and
    down rows are not read); then the down AXPY of every neuron whose activation is not 0, in the order of ids."""
    for j in range(part.shape[0]):
        part[j] = _F0
    nb_in = h.shape[0] // KINDS_BLOCK[gate_kind]
    nb_up = h.shape[0] // KINDS_BLOCK[up_kind]
    nb_out = part.shape[0] // KINDS_BLOCK[down_kind]
    xa, ya = h.ctypes.data, part.ctypes.data
    relu_gated = code == RELU_GATED[0] or code == RELU_GATED[1]
    for k in range(lo, hi):
        if k + PREFETCH_AHEAD < hi:
            prefetch_lines(gate, ids[k + PREFETCH_AHEAD])
        vals[k] = row_dot(gate_kind, gate.ctypes.data + ids[k] * gate.strides[0], nb_in, xa)
    for k in range(lo, hi):
        n = k + PREFETCH_AHEAD
        if n < hi and (not relu_gated or vals[n] > _F0):
            prefetch_lines(up, ids[n])
        g = vals[k]
        if relu_gated and not g > _F0:
            vals[k] = _F0
            continue
        vals[k] = act(g, row_dot(up_kind, up.ctypes.data + ids[k] * up.strides[0], nb_up, xa), code)
    for k in range(lo, hi):
        n = k + PREFETCH_AHEAD
        if n < hi and vals[n] != _F0:
            prefetch_lines(down, ids[n])
        if vals[k] != _F0:
            row_axpy(down_kind, down.ctypes.data + ids[k] * down.strides[0], nb_out, ya, vals[k])


@njit(**JIT)
def reduce(parts, n, y):
    """y = parts[0] + parts[1] + ... + parts[n - 1], added in that order."""
    for j in range(y.shape[0]):
        y[j] = parts[0, j]
    for t in range(1, n):
        for j in range(y.shape[0]):
            y[j] += parts[t, j]


# ---------------------------------------------------------------------------------------------------------------

def stored_rows(w) -> tuple[np.ndarray, int]:
    """A matrix as the kernels read it: (uint8 [rows, row bytes], type number). w: a cpu_offload.qtensor QTensor
    of a GGUF block type (the file's blocks), or a float16 / float32 numpy array (F16 / F32 rows); no copy where w
    is C-contiguous."""
    from .qtensor import is_quantized

    if is_quantized(w) and w.code in blocks.GGUF_TYPES:
        return np.asarray(w.data), w.code
    w = np.asarray(w)
    kind = {np.dtype(np.float32): F32, np.dtype(np.float16): F16}.get(w.dtype)
    if kind is None or w.ndim != 2:
        raise ConfigError(f"no row kernel for a {w.dtype} array of shape {w.shape}")
    w = np.ascontiguousarray(w)
    return w.view(np.uint8), kind


def predictor_rows(fc1, fc2):
    """A PowerInfer predictor (fc1 [rank, d], fc2 [d_ff, rank], float16 or float32 arrays as the file stores them) as
    hidden() and predict() read it: ((fc1 rows, type), (fc2 rows, type), padded rank). Rows of floats come in blocks
    of 32 weights: where the rank is not a multiple of 32, fc1 gets zero rows and fc2 zero columns up to the padded
    rank (a copy; the scores are unchanged, relu(0) = 0); otherwise no copy where the arrays are C-contiguous."""
    fc1, fc2 = np.asarray(fc1), np.asarray(fc2)
    rank, d = fc1.shape
    if d % KINDS[F32][1]:
        raise ConfigError(f"a predictor reads rows of a multiple of {KINDS[F32][1]} weights, not {d}")
    padded = -(-rank // KINDS[F32][1]) * KINDS[F32][1]
    if padded != rank:
        fc1 = np.concatenate([fc1, np.zeros((padded - rank, d), fc1.dtype)])
        fc2 = np.pad(fc2, ((0, 0), (0, padded - rank)))
    return stored_rows(fc1), stored_rows(fc2), padded


def ffn(h, r, fc1, fc2, threshold, gate, up, down, code: int, n_threads: int = 1):
    """The stages run from Python, thread by thread in turn: (y float32 [d], mask uint8 [d_ff]). fc1, fc2: the
    predictor (predictor_rows' arrays); gate, up, down: (uint8 rows, type number) pairs (stored_rows); down [d_ff,
    d]. The tests' entry to the kernels."""
    h, r = np.ascontiguousarray(h, np.float32), np.ascontiguousarray(r, np.float32)
    fc1, fc2, rank = predictor_rows(fc1, fc2)
    d, d_ff = h.shape[0], fc2[0].shape[0]
    z = np.full(rank, np.nan, np.float32)
    mask = np.full(d_ff, 7, np.uint8)
    ids = np.full(d_ff, -1, np.int32)
    parts = np.full((n_threads, d), np.nan, np.float32)
    vals = np.full(d_ff, np.nan, np.float32)
    y = np.full(d, np.nan, np.float32)
    for tid in range(n_threads):
        hidden(fc1[1], fc1[0], r, z, *share(rank, tid, n_threads))
    for tid in range(n_threads):
        predict(fc2[1], fc2[0], z, np.float32(threshold), mask, *share(d_ff, tid, n_threads))
    count = compact(mask, ids)
    for tid in range(n_threads):
        lo, hi = share(count, tid, n_threads)
        neurons(gate[1], gate[0], up[1], up[0], down[1], down[0], h, ids, lo, hi, code, parts[tid], vals)
    reduce(parts, n_threads, y)
    return y, mask


def float32_rows(data: np.ndarray, kind: int, cols: int) -> np.ndarray:
    """The float32 values [rows, cols] of rows as stored_rows gives them (a numpy reference)."""
    data = np.ascontiguousarray(data)
    if kind == F32:
        return data.view(np.float32).reshape(-1, cols).copy()
    if kind == F16:
        return data.view(np.float16).reshape(-1, cols).astype(np.float32)
    return blocks.TYPES[kind].dequantize((data,), cols)
