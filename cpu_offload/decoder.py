"""HostDecoder: a Llama-family model's decode step on the host with quantized weights (the kernels and the FFI
target: cpu_offload/host_decode.py), and the weights it stores.

Usage::

    stored = quantize_weights(config, weights, "q4_1")  # every matrix as the host stores it (qtensor forms):
                                                        # a Q4Tensor of the file is kept as it is
    host = HostDecoder(config, stored, "q4_1")      # reads the stored arrays in place (numpy views, no copy:
                                                    # jax arrays too), and keeps them alive
    reference = host.dequantized(stored)            # canonical float32: what the stored weights stand for
    x, k, v = host.layer(l, x, pos, k_cache, v_cache)    # inside jit; x [..., d] with d elements
    logits = host.head(hidden)                     # hidden [d] -> [vocab]

Lifetime: like ``bridge.ColdFFN``, the header whose address compiled executables carry is never freed; the
weights live as long as the HostDecoder (a jitted function holding the model holds it).
"""
from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from .contract import ConfigError

from . import ffi, kernels, q4, quants, tables, team
from .ffi import RUNTIME_ADDR
from .host_decode import (FORMATS, H_ACT, H_D, H_EPS, H_FF, H_FORMAT, H_HD, H_HEAD, H_HEAD_KIND, H_HEAD_SCALES,
                          H_HEADS, H_INV_FREQ, H_KV, H_MAGIC, H_MAXLEN, H_NLAYERS, H_RUNTIME, H_SCRATCH, H_STAGE,
                          H_TABLE, H_TASK, H_TEAM, H_VOCAB, H_WIDTH, L_ATTN_NORM, L_FFN_NORM, L_QKV_BIAS, L_WIDTH,
                          MAGIC, MATRICES, TARGET_NAME, handler_cfunc, new_scratch, stage_cfunc)
from .kernels import QBLOCK
from .qtensor import Int8Tensor, Q4Tensor, QBlocks, aligned_empty, is_quantized

from numba import njit, prange  # noqa: E402  (ffi sets the threading layer first)

_F0, _ONE = np.float32(0.0), np.float32(1.0)


HEADERS: list[np.ndarray] = []  # every header ever made; never freed (executables hold their address)


@njit(parallel=True, cache=True, nogil=True)
def _quantize_rows(w, q, s):
    """kernels.quantize_rows for cols a multiple of 64, row by row on every thread, the same float32 operations
    (no fastmath: the division and the rounding must be numpy's) so the bytes are the same, in parallel."""
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
    C-contiguous (and XLA-aligned where cols is a multiple of 64: the host decode's matrices)."""
    w = np.ascontiguousarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % QBLOCK:
        q, s = kernels.quantize_rows(w)
        return np.ascontiguousarray(q), np.ascontiguousarray(s)
    q = aligned_empty(w.shape, np.int8)
    s = aligned_empty((w.shape[0], w.shape[1] // QBLOCK), np.float32)
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
    for its float32 values (the int8 GEMV takes a float32 scale per 64, not Q8_0's per-32 float16 one)."""
    if cols % QBLOCK:
        raise ConfigError(f"int8 rows need a multiple of {QBLOCK} columns, got {cols}")
    rows = blocks.shape[0]
    b = np.asarray(blocks).reshape(rows, cols // 32, Q8_0_BLOCK_BYTES)
    d = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    q = aligned_empty((rows, cols), np.int8)
    s = aligned_empty((rows, cols // QBLOCK), np.float32)
    _int8_from_q8_0(b[..., 2:].view(np.int8), d, q, s)
    return Int8Tensor(q, s)


def check_supported(config, weights: dict, fmt: str) -> None:
    """Raises ValueError (one line) unless the host decode can run this model in this format."""
    c = config
    if fmt not in FORMATS:
        raise ConfigError(f"host decode weights must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not (c.uses_rope and c.gated):
        raise ConfigError(f"host decode supports Llama-family models, not {c.arch!r}")
    biases = [k for k in weights if k.rsplit(".", 1)[-1] in ("bo", "b_up", "b_down", "bias")]
    if biases:
        raise ConfigError(f"host decode supports no biases but q/k/v ones, this one has {biases[0]!r}")
    for l in range(c.n_layers):
        have = [f"layers.{l}.{b}" in weights for b in ("bq", "bk", "bv")]
        if any(have) and not all(have):
            raise ConfigError(f"host decode needs all of layer {l}'s q/k/v biases or none")
    for name, n in (("d_model", c.d_model), ("n_heads * head_dim", c.n_heads * c.head_dim), ("d_ff", c.d_ff)):
        if n % QBLOCK:
            raise ConfigError(f"host decode needs {name} to be a multiple of {QBLOCK}, got {n}")
    if c.head_dim % 2:
        raise ConfigError(f"host decode needs an even head_dim, got {c.head_dim}")


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
    q = gguf.quants.quantize(np.ascontiguousarray(values, np.float32), gguf.GGMLQuantizationType.Q8_0)
    return QBlocks(q, values.shape[1], gguf.GGMLQuantizationType.Q8_0.value)


def quantize_weights(config, weights: dict, fmt: str, *, check: bool = True, matrices: dict = MATRICES) -> dict:
    """The weights as the host decode stores them (cpu_offload.qtensor forms), one matrix at a time: every layer
    matrix in fmt ("q4_1": a Q4Tensor is kept as it is, the file's bytes, anything else becomes one; "gguf": a
    Q4Tensor or QBlocks is kept as it is, anything else becomes Q8_0 blocks; "int8": Int8Tensor), a w_down_t
    untransposed [d, F]; the output head Int8Tensor (a QBlocks head is kept with "gguf"); everything else as
    given. weights may hold canonical float32 arrays (pjinfer.runtime.model's names) or quantized matrices. check=False
    skips this decoder's shape rules (for another decoder of the same weights that has checked its own). matrices:
    the layer matrices stored so (a decoder that stores its FFN in another form names the others)."""
    if check:
        check_supported(config, weights, fmt)
    out = dict(weights)
    names = [f"layers.{l}.{m}" for l in range(config.n_layers) for m in matrices]
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
    # What a subclass that keeps host_decode's header and layer table (and adds its own slots) changes: the layer
    # matrices stored in the table, the header's width and magic, the team's stage function and the handler.
    matrices, header_width, magic, stage, handler = MATRICES, H_WIDTH, MAGIC, stage_cfunc, handler_cfunc

    def __init__(self, config, weights: dict, fmt: str = "int8"):
        c = config
        weights = quantize_weights(config, weights, fmt, matrices=self.matrices)
        self.config = c
        self.format = fmt
        self.team = team.shared()
        self._keep = []  # every array the header points at
        table = np.zeros((c.n_layers, L_WIDTH), np.int64)
        self._quantized = {}  # (layer, slot) -> Q4Tensor or Int8Tensor, one row per output
        for l in range(c.n_layers):
            p = f"layers.{l}"
            for m, slot in self.matrices.items():
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
        header = np.zeros(self.header_width, np.int64)
        header[[H_NLAYERS, H_D, H_HEADS, H_KV, H_HD, H_FF, H_VOCAB, H_ACT, H_MAXLEN]] = [
            c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size,
            kernels.act_code(c.activation), c.max_seq_len]
        header.view(np.float64)[H_EPS] = c.norm_eps
        header[[H_TABLE, H_HEAD, H_HEAD_SCALES, H_INV_FREQ, H_SCRATCH, H_TASK, H_TEAM]] = [
            self._hold(table), self._hold(head_q), self._hold(head_s), self._hold(inv_freq),
            self._hold(new_scratch(c)), self._hold(np.zeros(8, np.int64)), self.team.address]
        # Addresses travel in the header, never as Numba globals: cached machine code would keep another
        # process's values.
        header[[H_STAGE, H_RUNTIME]] = [self.stage.address, RUNTIME_ADDR]
        header[H_FORMAT] = FORMATS[fmt]
        header[H_HEAD_KIND] = head_kind
        header[H_MAGIC] = self.magic
        HEADERS.append(header)
        self.header = header
        self.address = int(header.ctypes.data)
        self.table = tables.register_table(self.address)  # what the calls pass (an index, see tables.TABLES)
        ffi.register(self.target, self.handler)

    def _hold(self, a: np.ndarray) -> int:
        b = np.require(a, requirements=["C_CONTIGUOUS", "ALIGNED"])
        if b is not a and a.nbytes > 1 << 20:
            raise ConfigError("host decode: a stored matrix is not C-contiguous; it would be copied")
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
            for m, slot in self.matrices.items():
                w = self._quantized[(l, slot)].float32()
                out[f"layers.{l}.{m}"] = np.ascontiguousarray(w.T) if m == "w_down_t" else w
        out[self._head_name] = self._head.float32()
        return out

    # ------------------------------------------------------------ calls from inside jit
    def layer(self, layer: int, x, pos, k_cache, v_cache):
        """Decoder layer `layer` for one token: (x [..., d] with d elements, position, float16 caches
        [1, S, KV, hd]) -> (x out, caches with position pos written). The caches are updated in place when XLA can
        donate them."""
        if not 0 <= int(layer) < self.config.n_layers:
            raise ConfigError(f"layer {layer} out of range [0, {self.config.n_layers})")
        if x.size != self.config.d_model:
            raise ConfigError(f"x must hold one token's {self.config.d_model} features, got shape {x.shape}")
        if k_cache.dtype != jnp.float16 or v_cache.dtype != jnp.float16:
            raise ConfigError(f"host decode caches must be float16, got {k_cache.dtype} and {v_cache.dtype}")
        result = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(k_cache.shape, jnp.float16),
                  jax.ShapeDtypeStruct(v_cache.shape, jnp.float16))
        call = jax.ffi.ffi_call(self.target, result, input_output_aliases={3: 1, 4: 2})
        return call(jnp.int32(layer), jnp.asarray(pos, jnp.int32), x.astype(jnp.float32), k_cache, v_cache,
                    table=np.int64(self.table))

    def head(self, hidden):
        """hidden [d] -> logits [vocab] from the output head."""
        if hidden.shape != (self.config.d_model,):
            raise ConfigError(f"hidden must be [{self.config.d_model}], got {hidden.shape}")
        call = jax.ffi.ffi_call(self.target, jax.ShapeDtypeStruct((self.config.vocab_size,), jnp.float32))
        return call(hidden.astype(jnp.float32), table=np.int64(self.table))
