"""HostDecoder: a Llama-family model's decode step on the host with quantized weights (the kernels and the FFI
target: cpu_offload/host_decode.py), and the weights it stores.

Usage::

    stored = quantize_weights(config, weights, fmt)  # every matrix as the host stores it (qtensor.QTensor):
                                                     # the file's blocks kept as they are where fmt reads them
    host = HostDecoder(config, stored, fmt)         # reads the stored arrays in place (numpy views, no copy:
                                                    # jax arrays too), and keeps them alive
    reference = host.dequantized(stored)            # canonical float32: what the stored weights stand for
    x, k, v = host.layer(l, x, pos, k_cache, v_cache)    # inside jit; x [..., d] with d elements
    logits = host.head(hidden)                     # hidden [d] -> [vocab]

Lifetime: like ``bridge.ColdFFN``, the header whose address compiled executables carry is never freed; the
weights live as long as the HostDecoder (a jitted function holding the model holds it).
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from .contract import ConfigError

from . import ffi, int8, kernels, tables, team
from .blocks import FORMATS, INT8
from .ffi import RUNTIME_ADDR
from .host_call import check_bridge, through
from .host_decode import (CLOCKS, F_BLOCKS, F_BLOCKS_FLOAT, F_INT8, H_ACT, H_CLOCKS, H_D, H_EPS, H_FF, H_FORMAT, H_HD,
                          H_HEAD, H_HEAD_KIND, H_HEAD_SCALES, H_HEADS, H_INV_FREQ, H_KV, H_MAGIC, H_MAXLEN, H_NLAYERS,
                          H_RUNTIME, H_SCRATCH, H_STAGE, H_TABLE, H_TASK, H_TEAM, H_VOCAB, H_WIDTH, L_ATTN_NORM,
                          L_FFN_NORM, L_QKV_BIAS, L_WIDTH, MAGIC, MATRICES, TARGET_NAME, handler_cfunc, new_scratch,
                          stage_cfunc)
from .attention import LANES, MAX_CHUNKS
from .kernels import QBLOCK
from .qtensor import QTensor, is_quantized

HEADERS: list[np.ndarray] = []  # every header ever made; never freed (executables hold their address)


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
    if c.head_dim % LANES or c.head_dim > LANES * MAX_CHUNKS:
        raise ConfigError(f"host decode needs head_dim to be a multiple of {LANES} up to {LANES * MAX_CHUNKS}, "
                          f"got {c.head_dim}")


def _head_name(config) -> str:
    return "embed" if config.tie_embeddings else "lm_head"


def _stored_float32(name: str, w) -> np.ndarray:
    """A matrix's values in the stored orientation (a w_down_t as [d, F])."""
    if is_quantized(w):
        return w.float32()
    w = np.asarray(w, np.float32)
    return w.T if name.endswith("w_down_t") else w


def quantize_weights(config, weights: dict, fmt: str, *, check: bool = True, matrices: dict = MATRICES) -> dict:
    """The weights as the host decode stores them (qtensor.QTensor), one matrix at a time, by blocks.FORMATS[fmt]: a
    layer matrix kept as given where its type is one the format keeps, else quantized to the format's type from
    its float32 values (a w_down_t untransposed [d, F]); the output head likewise, else int8; everything else as
    given. weights may hold canonical float32 arrays (pjinfer.runtime.model's names) or quantized matrices.
    check=False skips this decoder's shape rules (for another decoder of the same weights that has checked its
    own). matrices: the layer matrices stored so (a decoder that stores its FFN in another form names the
    others)."""
    if check:
        check_supported(config, weights, fmt)
    f = FORMATS[fmt]
    out = dict(weights)
    names = [f"layers.{l}.{m}" for l in range(config.n_layers) for m in matrices]
    for name, keep, made in [*((n, f.layers, f.made) for n in names), (_head_name(config), f.head, INT8)]:
        w = weights[name]
        if not (is_quantized(w) and w.code in keep):
            values = _stored_float32(name, w)
            out[name] = QTensor(INT8, int8.quantize(values), values.shape[1]) if made == INT8 else \
                QTensor.quantize(made, values)
    return out


class HostDecoder:
    """A Llama-family model's decode step on the host with quantized weights (see the module docstring).

    config: pjinfer.runtime.model's ModelConfig. weights: canonical float32 weights, or what quantize_weights returns
    (the matrices then read in place: numpy arrays, or jax CPU arrays through zero-copy views, kept alive here).
    fmt: how the weights are stored, a key of blocks.FORMATS: its row names the block types the layer matrices
    and the output head are kept in (any other head: int8, as the GGUF keeps it at 8 bits too, Q8_0).
    bridge: "ffi" calls the FFI target from the step (JAX on the CPU); "callback" goes through host_call.on_host
    (any platform, the same results bit for bit; layer()'s caches then travel to the host and back each call)."""

    target = TARGET_NAME    # the FFI target layer() and head() call (a subclass with its own handler names its own)
    # What a subclass that keeps host_decode's header and layer table (and adds its own slots) changes: the layer
    # matrices stored in the table, the header's width and magic, the team's stage function and the handler.
    matrices, header_width, magic, stage, handler = MATRICES, H_WIDTH, MAGIC, stage_cfunc, handler_cfunc
    bridge = "ffi"   # a subclass with its own constructor calls the target directly
    rounds_inputs = True   # the file's blocks of q8_dot's types read against rounded inputs (F_BLOCKS)

    def __init__(self, config, weights: dict, fmt: str = "int8", bridge: str = "ffi"):
        self.bridge = check_bridge(bridge)
        c = config
        weights = quantize_weights(config, weights, fmt, matrices=self.matrices)
        self.config = c
        self.team = team.shared()
        self._keep = []  # every array the header points at
        table = np.zeros((c.n_layers, L_WIDTH), np.int64)
        self._quantized = {}  # (layer, slot) -> QTensor, one row per output
        for l in range(c.n_layers):
            p = f"layers.{l}"
            for m, slot in self.matrices.items():
                w = weights[f"{p}.{m}"]   # (int8 rows, their scales) or (blocks, their type): host_decode's slots
                table[l, slot] = self._hold(np.asarray(w.data))
                table[l, slot + 1] = self._hold(np.asarray(w.arrays[1])) if w.code == INT8 else w.code
                self._quantized[(l, slot)] = w
            table[l, L_ATTN_NORM] = self._hold(np.asarray(weights[f"{p}.attn_norm.scale"], np.float32))
            table[l, L_FFN_NORM] = self._hold(np.asarray(weights[f"{p}.ffn_norm.scale"], np.float32))
            if f"{p}.bq" in weights:
                table[l, L_QKV_BIAS] = self._hold(np.concatenate(
                    [np.asarray(weights[f"{p}.{b}"], np.float32) for b in ("bq", "bk", "bv")]))
        self._head_name = _head_name(c)
        self._head = weights[self._head_name]
        head = np.asarray(self._head.data)
        head_s = np.asarray(self._head.arrays[1]) if self._head.code == INT8 else np.zeros(1, np.float32)
        inv_freq = (1.0 / (np.float32(c.rope_theta) ** (np.arange(0, c.head_dim, 2, dtype=np.float32)
                                                        / np.float32(c.head_dim)))).astype(np.float32)
        header = np.zeros(self.header_width, np.int64)
        header[[H_NLAYERS, H_D, H_HEADS, H_KV, H_HD, H_FF, H_VOCAB, H_ACT, H_MAXLEN]] = [
            c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size,
            kernels.act_code(c.activation), c.max_seq_len]
        header.view(np.float64)[H_EPS] = c.norm_eps
        header[[H_TABLE, H_HEAD, H_HEAD_SCALES, H_INV_FREQ, H_SCRATCH, H_TASK, H_TEAM]] = [
            self._hold(table), self._hold(head), self._hold(head_s), self._hold(inv_freq),
            self._hold(new_scratch(c)), self._hold(np.zeros(8, np.int64)), self.team.address]
        # Addresses travel in the header, never as Numba globals: cached machine code would keep another
        # process's values.
        header[[H_STAGE, H_RUNTIME]] = [self.stage.address, RUNTIME_ADDR]
        header[H_FORMAT] = F_INT8 if FORMATS[fmt].made == INT8 else F_BLOCKS if self.rounds_inputs else F_BLOCKS_FLOAT
        header[H_HEAD_KIND] = self._head.code
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

    @contextlib.contextmanager
    def clocked(self):
        """Within: this decoder's handler adds the time-stamp cycles (team.cycles) of its calls and of their team
        stages into a fresh int64 [host_decode.CLOCKS] array, which it yields (slots host_decode.ST_* and CLK_*);
        the counting stops on leaving. For timing a decode where it runs (pjinfer.measure.bench.host_stages)."""
        clocks = np.zeros(CLOCKS, np.int64)
        self.header[H_CLOCKS] = clocks.ctypes.data
        try:
            yield clocks
        finally:
            self.header[H_CLOCKS] = 0

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
        args = (jnp.int32(layer), jnp.asarray(pos, jnp.int32), x.astype(jnp.float32), k_cache, v_cache)
        return through(self.bridge, self._layer_call)(*args)

    def _layer_call(self, layer, pos, x, k_cache, v_cache):
        """The FFI call of layer(), its arguments checked."""
        result = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(k_cache.shape, jnp.float16),
                  jax.ShapeDtypeStruct(v_cache.shape, jnp.float16))
        call = jax.ffi.ffi_call(self.target, result, input_output_aliases={3: 1, 4: 2})
        return call(layer, pos, x, k_cache, v_cache, table=np.int64(self.table))

    def head(self, hidden):
        """hidden [d] -> logits [vocab] from the output head."""
        if hidden.shape != (self.config.d_model,):
            raise ConfigError(f"hidden must be [{self.config.d_model}], got {hidden.shape}")
        return through(self.bridge, self._head_call)(hidden.astype(jnp.float32))

    def _head_call(self, hidden):
        """The FFI call of head(), its argument checked."""
        call = jax.ffi.ffi_call(self.target, jax.ShapeDtypeStruct((self.config.vocab_size,), jnp.float32))
        return call(hidden, table=np.int64(self.table))
