"""Decoder-only transformer as Flax NNX modules, built from a flat dict of canonical weights.

Canonical weights (what every loader produces; float32 numpy, torch's [out, in] layout):
    embed [vocab, d]                      pos_embed [max_pos, d]            (OPT only)
    layers.{i}.attn_norm.scale [d]        layers.{i}.attn_norm.bias [d]     (OPT only)
    layers.{i}.wq [H*hd, d]  wk, wv [KV*hd, d]  wo [d, H*hd]               (Q/K in rotate-half RoPE layout)
    layers.{i}.bq, bk, bv, bo                                               (OPT only)
    layers.{i}.ffn_norm.scale [d]         layers.{i}.ffn_norm.bias [d]      (OPT only)
    layers.{i}.w_gate [F, d] (gated only) w_up [F, d]  w_down_t [F, d]      (down stored transposed:
    layers.{i}.b_up [F]  b_down [d]                                         (OPT only)   one row per neuron)
    final_norm.scale [d]  final_norm.bias [d] (OPT only)  lm_head [vocab, d] (untied only)

A matrix may instead be quantized (a cpu_offload.qtensor.QTensor: a GGUF's blocks, or int8): the model then holds
its blocks, not float32 (a ``QMatrix``), and dequantizes it inside the jitted function where it is used, a float32
transient. A quantized w_down_t holds the down projection untransposed, [d, F] (the file's layout: blocks run along
a row's inputs); ``QMatrix[...]`` still gives the canonical [F, d].
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpu_offload import blocks
from cpu_offload.activation import activate
from cpu_offload.qtensor import aligned, is_quantized
from pjinfer.config import ConfigError, ModelConfig


def _param(weights: dict, name: str):
    """An nnx.Param of float32 values, or a QMatrix for a quantized matrix."""
    if name not in weights:
        raise ConfigError(f"checkpoint is missing weight {name!r}")
    w = weights[name]
    if is_quantized(w):
        return QMatrix(w, transposed=name.endswith("w_down_t"))
    return nnx.Param(jnp.asarray(w, dtype=jnp.float32))


def float32_weight(name: str, w) -> np.ndarray:
    """The canonical float32 value of weights[name], whether it is stored float32 or quantized."""
    if not is_quantized(w):
        return np.asarray(w, np.float32)
    return np.ascontiguousarray(w.float32().T) if name.endswith("w_down_t") else w.float32()


class Float32View(Mapping):
    """weights[name] as canonical float32, dequantized when read: one matrix at a time, nothing kept."""

    def __init__(self, weights: dict):
        self.weights = weights

    def __getitem__(self, name):
        return float32_weight(name, self.weights[name])

    def __iter__(self):
        return iter(self.weights)

    def __len__(self):
        return len(self.weights)


def to_xla(a) -> jax.Array:
    """a in XLA's memory without a copy: on the CPU jax.device_put aliases an XLA-aligned numpy array."""
    return jax.device_put(aligned(a))


def float32_weights(weights: dict) -> dict:
    """Every weight as canonical float32 (what `--weights float32` runs), one matrix at a time."""
    return {name: float32_weight(name, w) for name, w in weights.items()}


DEQUANTIZED_BYTES = 1 << 24   # the most float32 bytes of a QMatrix that a matrix product dequantizes at once


class QMatrix(nnx.Module):
    """A quantized [out, in] matrix inside the model: a QTensor's arrays as jax arrays (``data``, and int8's
    ``scales``), dequantized where used by its block type (cpu_offload.blocks). ``[...]`` gives the float32 matrix
    (transposed back when `transposed`: a w_down_t held as [d, F]); ``rows(ids)`` dequantizes only the gathered
    rows (embedding); ``product`` multiplies by it a slice of stored rows at a time (matrix products: prefill,
    scoring)."""

    def __init__(self, w, *, transposed: bool = False):
        if not is_quantized(w):
            raise TypeError(f"not a quantized matrix: {type(w).__name__}")
        self.code = w.code   # the block type (blocks.TYPES)
        self.data = nnx.Param(jnp.asarray(w.data))
        self.scales = nnx.Param(jnp.asarray(w.arrays[1])) if len(w.arrays) > 1 else None
        self.stored_shape = w.shape
        self.transposed = transposed

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.stored_shape
        return (cols, rows) if self.transposed else (rows, cols)

    def _values(self, data, scales):
        arrays = (data,) if scales is None else (data, scales)
        return blocks.TYPES[self.code].dequantize(arrays, self.stored_shape[1], jnp)

    def __getitem__(self, key):
        if key is not Ellipsis:
            raise IndexError("a QMatrix is read whole ([...]) or by rows (rows(ids))")
        w = self._values(ordered(self.data[...]), None if self.scales is None else self.scales[...])
        return w.T if self.transposed else w

    def product(self, x, contract: int):
        """x times the matrix, over its axis `contract` of [...]'s two: x [..., out] @ [...] (0) or x [..., in] @
        [...].T (1). A matrix of more than DEQUANTIZED_BYTES of float32 is dequantized a slice of stored rows at a
        time, each slice after the previous one's product (the XLA temporaries of a large model's prefill hold one
        slice, not the matrix); the slices' outputs are joined, or, where the stored rows are the axis summed over,
        their partial sums added in order."""
        spec = "...f,fd->...d" if contract == 0 else "...i,oi->...o"
        rows, cols = self.stored_shape
        slices = -(-rows * cols * 4 // DEQUANTIZED_BYTES)
        if slices <= 1:
            return jnp.einsum(spec, x, self[...])
        summed = (contract == 0) != self.transposed     # the stored rows are the axis summed over
        step = -(-rows // slices // blocks.TYPES[self.code].group) * blocks.TYPES[self.code].group   # whole groups
        out = []
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            w = self._values(ordered(self.data[...][lo:hi]), None if self.scales is None else self.scales[...][lo:hi])
            y = jnp.einsum("...r,rc->...c", x[..., lo:hi], w) if summed else jnp.einsum("...c,rc->...r", x, w)
            out.append(y if not summed or not out else out[-1] + y)
            _order_after(y)
        return out[-1] if summed else jnp.concatenate(out, axis=-1)

    def rows(self, ids):
        """float32 rows ids [...] -> [..., cols] of the (untransposed) matrix; not of interleaved rows."""
        if blocks.TYPES[self.code].group > 1:
            raise ConfigError(f"{blocks.TYPES[self.code].name} rows are read 16 at a time, not gathered one by one")
        flat = ids.reshape(-1)
        w = self._values(self.data[...][flat], None if self.scales is None else self.scales[...][flat])
        return w.reshape(*ids.shape, w.shape[-1])


_ORDER = threading.local()  # .zero: the current layer's ordering term (see _dequantized_after), or None


@contextlib.contextmanager
def _dequantized_after(x):
    """Within it, every QMatrix read depends on x, so that XLA dequantizes a layer's matrices only when the layer
    runs. Without it XLA's CPU scheduler dequantized every layer up front: 425 MB of float32 temporaries for the
    default model's prefill (14 MB with it). An optimization barrier did not help (the CPU compiler drops it); a
    data dependence does: the stored bytes are OR-ed with (s != s) for one element s of x, which is 0 unless x
    already holds a NaN and which XLA cannot fold away before x exists. It fuses into the dequantizing."""
    s = x.reshape(-1)[0]
    previous, _ORDER.zero = getattr(_ORDER, "zero", None), s != s
    try:
        yield
    finally:
        _ORDER.zero = previous


def ordered(a):
    """A stored array, read inside _dequantized_after: its bits OR-ed with the layer's ordering term, so that XLA
    reads (dequantizes, converts) it only when the layer, or its previous matrix product, has run."""
    zero = getattr(_ORDER, "zero", None)
    if zero is None:
        return a
    if jnp.issubdtype(a.dtype, jnp.integer):
        return a | zero.astype(a.dtype)
    bits = jnp.dtype(f"uint{8 * a.dtype.itemsize}")
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a, bits) | zero.astype(bits), a.dtype)


def _order_after(y):
    """Inside _dequantized_after: the next QMatrix read also waits for y (a matrix product's output), so that
    within a layer one matrix at a time is dequantized, not all of them (0.5B model, 512-token prefill: the
    XLA temporaries went from 190 to 115 MB, most of the rest the attention scores)."""
    if getattr(_ORDER, "zero", None) is not None:
        s = y.reshape(-1)[0]
        _ORDER.zero = s != s


def embedding_rows(w, ids):
    """Rows ids of an embedding table (float32 Param or QMatrix) as float32."""
    return w.rows(ids) if isinstance(w, QMatrix) else w[...][ids]


def _optional(weights: dict, name: str) -> nnx.Param | None:
    return _param(weights, name) if name in weights else None


def down(act, w):
    """act [..., d_ff] @ w [d_ff, d] (an array, or a QMatrix): an FFN's down projection."""
    return w.product(act, 0) if isinstance(w, QMatrix) else jnp.einsum("...f,fd->...d", act, w)


def value(p):
    """An optional parameter's array, or None."""
    return None if p is None else p[...]


def neurons(activation: str, x, w_gate, w_up, b_up=None):
    """Per-neuron activations [..., rows] of FFN rows (all of a layer's, or a subset): act(gate . x, up . x)."""
    up = linear(x, w_up, b_up)
    return activate(activation, None if w_gate is None else linear(x, w_gate), up)


def matrix(p):
    """A weight as linear() and down() take it: a QMatrix itself (read a slice at a time), else its array."""
    return p if isinstance(p, QMatrix) else p[...]


def linear(x, w, b=None):
    """x [..., in] @ w.T (+ b). w is [out, in] (an array, or a QMatrix): a row per output feature, so a GEMV streams
    contiguous rows."""
    y = w.product(x, 1) if isinstance(w, QMatrix) else jnp.einsum("...i,oi->...o", x, w)
    y = y if b is None else y + b
    _order_after(y)
    return y


class Threshold(nnx.Variable):
    """A calibrated magnitude below which a matrix input counts as zero (TEAL); not a trained parameter."""


def sparsify_input(x, threshold):
    """x with the entries |x| <= threshold set to 0 (input sparsity, cpu_offload/sparse_decode.py's rule); x itself
    when the module has no threshold."""
    return x if threshold is None else jnp.where(jnp.abs(x) > threshold[...], x, 0.0)


def set_thresholds(model, thresholds) -> None:
    """Give every layer of a Transformer its four thresholds ([n_layers, 4]); None removes them."""
    for l, block in enumerate(model.layers):
        t = [None] * 4 if thresholds is None else [Threshold(jnp.float32(v)) for v in np.asarray(thresholds)[l]]
        block.attn.t_in, block.attn.t_o, block.ffn.t_in, block.ffn.t_down = (nnx.data(v) for v in t)


# ---------------------------------------------------------------- KV cache
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Static-size keys and values, one [batch, length, kv_heads, head_dim] array per layer, stored as float16
    (DTYPE: half the bytes a decode step reads; attention computes in float32 from the stored values)."""
    k: list
    v: list

    DTYPE = jnp.float16

    @classmethod
    def create(cls, config: ModelConfig, batch: int, length: int) -> "KVCache":
        shape = (batch, length, config.n_kv_heads, config.head_dim)
        zeros = lambda: [jnp.zeros(shape, cls.DTYPE) for _ in range(config.n_layers)]
        return cls(k=zeros(), v=zeros())

    @classmethod
    def nbytes(cls, config: ModelConfig, tokens: int) -> int:
        """Bytes of a cache holding `tokens` positions of one sequence."""
        return config.kv_cache_bytes(tokens, np.dtype(cls.DTYPE).itemsize)

    @property
    def length(self) -> int:
        return self.k[0].shape[1]


# ---------------------------------------------------------------- layers
class Norm(nnx.Module):
    """RMSNorm (Llama) or LayerNorm (OPT, when a bias is present)."""

    def __init__(self, weights: dict, prefix: str, eps: float):
        self.scale = _param(weights, f"{prefix}.scale")
        self.bias = _optional(weights, f"{prefix}.bias")
        self.eps = eps

    def __call__(self, x):
        if self.bias is None:
            x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
            return x * self.scale[...]
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]


def rope(x, positions, theta: float):
    """Rotary embedding in the rotate-half layout (HF's); x is [B, T, heads, hd], positions [1, T] or [B, T]."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq               # [1 or B, T, hd/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    half = hd // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, weights: dict, prefix: str):
        self.config = config
        self.wq, self.wk, self.wv, self.wo = (_param(weights, f"{prefix}.{n}") for n in ("wq", "wk", "wv", "wo"))
        self.bq, self.bk, self.bv, self.bo = (_optional(weights, f"{prefix}.{n}") for n in ("bq", "bk", "bv", "bo"))
        self.t_in = self.t_o = None  # Thresholds of the input of q/k/v and of o, when sparse (pjinfer.offline.teal)

    def __call__(self, x, start, k_cache, v_cache):
        """x [B, T, d] at positions start..start+T-1; returns the output and the updated cache arrays."""
        out, k_cache, v_cache = self.heads(x, start, k_cache, v_cache)
        return self.o(out), k_cache, v_cache

    def qkv(self, x):
        """x [B, T, d] -> q [B, T, H*hd], k and v [B, T, KV*hd]: the projections of the thresholded input (a
        swapped module, pjinfer.runtime.gathered, computes the same sums from another layout)."""
        x = sparsify_input(x, self.t_in)
        return (linear(x, matrix(self.wq), value(self.bq)), linear(x, matrix(self.wk), value(self.bk)),
                linear(x, matrix(self.wv), value(self.bv)))

    def o(self, heads):
        """The heads' output [B, T, H*hd] -> the attention's output [B, T, d], o's input thresholded."""
        return linear(sparsify_input(heads, self.t_o), matrix(self.wo), value(self.bo))

    def heads(self, x, start, k_cache, v_cache):
        """The attention heads' output [B, T, H*hd] (o's input) and the updated cache arrays."""
        q, k, v = self.qkv(x)
        return self.attend(q, k, v, start, k_cache, v_cache)

    def attend(self, q, k, v, start, k_cache, v_cache):
        """Projected q [B, T, H*hd], k and v [B, T, KV*hd] at positions start..start+T-1 -> the heads' output
        [B, T, H*hd] and the updated cache arrays. The tokens attend to the cache as stored (k and v rounded to
        float16), the way a later decode step sees them. With no cache (k_cache, v_cache None; start 0) they
        attend to their own float32 k and v: whole-sequence scoring, whose figures (perplexity) the float16 cache
        leaves as they were. start is a scalar, or [B] for one token a row (T 1), each at its own position: a
        batch of requests, where a row at -1 writes nothing to its cache (its output is not used)."""
        c = self.config
        B, T, _ = q.shape
        q = q.reshape(B, T, c.n_heads, c.head_dim)
        k = k.reshape(B, T, c.n_kv_heads, c.head_dim)
        v = v.reshape(B, T, c.n_kv_heads, c.head_dim)
        positions = jnp.reshape(start, (-1, 1)) + jnp.arange(T)                  # [1 or B, T]
        if c.uses_rope:
            q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
        if k_cache is None:
            keys, values = k, v
        else:
            k_cache, v_cache = _write(k_cache, k, start), _write(v_cache, v, start)
            keys, values = k_cache.astype(jnp.float32), v_cache.astype(jnp.float32)

        # Grouped-query attention over the whole static cache; the causal mask hides unwritten slots.
        group = c.n_heads // c.n_kv_heads
        q = q.reshape(B, T, c.n_kv_heads, group, c.head_dim) * (c.head_dim ** -0.5)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, keys)
        visible = jnp.arange(keys.shape[1]) <= jnp.maximum(positions, 0)[..., None]   # [1 or B, T, S]
        scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("bkgts,bskd->btkgd", probs, values).reshape(B, T, c.n_heads * c.head_dim), k_cache, v_cache


def _write(cache, rows, start):
    """cache [B, S, KV, hd] with rows [B, T, KV, hd] written at positions start.. (a scalar), or, for start [B]
    (T 1), each row at its own position, none where it is -1."""
    rows = rows.astype(cache.dtype)
    if jnp.ndim(start) == 0:
        return jax.lax.dynamic_update_slice(cache, rows, (0, start, 0, 0))
    at = jnp.where(start >= 0, start, cache.shape[1])          # past the end: dropped
    return cache.at[jnp.arange(cache.shape[0]), at].set(rows[:, 0], mode="drop")


class FFN(nnx.Module):
    """Neuron i is row i of w_gate / w_up and row i of w_down_t."""

    def __init__(self, config: ModelConfig, weights: dict, prefix: str):
        self.activation = config.activation
        self.w_gate = _param(weights, f"{prefix}.w_gate") if config.gated else None
        self.w_up = _param(weights, f"{prefix}.w_up")
        self.w_down_t = _param(weights, f"{prefix}.w_down_t")
        self.b_up = _optional(weights, f"{prefix}.b_up")
        self.b_down = _optional(weights, f"{prefix}.b_down")
        self.t_in = self.t_down = None  # Thresholds of the input of gate/up and of down, when sparse (pjinfer.offline.teal)

    def neurons(self, x):
        """Per-neuron activations [..., d_ff]."""
        return neurons(self.activation, x, None if self.w_gate is None else matrix(self.w_gate), matrix(self.w_up),
                       value(self.b_up))

    def __call__(self, x, residual=None):
        """x [..., d]: the FFN's input. residual (the stream before the FFN's norm) is for a sparse FFN's
        predictor (pjinfer.runtime.sparse); every neuron here is computed, so it is not read."""
        act = sparsify_input(self.neurons(sparsify_input(x, self.t_in)), self.t_down)
        out = down(act, matrix(self.w_down_t))
        return out if self.b_down is None else out + self.b_down[...]


class Block(nnx.Module):
    def __init__(self, attn_norm: Norm, attn: Attention, ffn_norm: Norm, ffn: FFN):
        self.attn_norm, self.attn, self.ffn_norm, self.ffn = attn_norm, attn, ffn_norm, ffn

    @classmethod
    def build(cls, config: ModelConfig, weights: dict, i: int, ffn=None) -> "Block":
        """Block i of `weights`; ffn(i), when given, makes its FFN instead (the FFN's matrices are then not read)."""
        p = f"layers.{i}"
        return cls(Norm(weights, f"{p}.attn_norm", config.norm_eps), Attention(config, weights, p),
                   Norm(weights, f"{p}.ffn_norm", config.norm_eps), FFN(config, weights, p) if ffn is None else ffn(i))

    def parts(self) -> tuple:
        """(attn_norm, attn, ffn_norm, ffn): what a swapped block is made of."""
        return self.attn_norm, self.attn, self.ffn_norm, self.ffn

    def __call__(self, x, start, k_cache, v_cache):
        """Returns the block's output, the FFN's inputs (what predictors see: its normalized input and the
        residual stream before the norm) and the updated cache."""
        h, k_cache, v_cache = self.attn(self.attn_norm(x), start, k_cache, v_cache)
        x = x + h
        ffn_in = self.ffn_norm(x)
        return x + self.ffn(ffn_in, residual=x), (ffn_in, x), k_cache, v_cache

    def decode(self, x, pos, k_cache, v_cache):
        """One token a row: x [B, 1, d] at position pos (a scalar, or [B]: see Attention.attend) -> (output
        [B, 1, d], updated cache arrays)."""
        x, _, k_cache, v_cache = self(x, pos, k_cache, v_cache)
        return x, k_cache, v_cache


class Head(nnx.Module):
    """The output projection: the embedding table itself when tied (one shared Param), else lm_head."""

    def __init__(self, w):
        self.w = w

    def __call__(self, hidden):
        """hidden [..., d] -> logits [..., vocab]."""
        return linear(hidden, matrix(self.w))

    def decode(self, hidden):
        """One token's hidden [d] -> logits [vocab]."""
        return self(hidden)


class Transformer(nnx.Module):
    def __init__(self, config: ModelConfig, weights: dict, *, ffn=None):
        """ffn(i), when given, makes layer i's FFN (a neuron split whose rows must not all reach the device)."""
        self.config = config
        self.embed = _param(weights, "embed")
        self.pos_embed = _param(weights, "pos_embed") if config.arch == "opt" else None
        self.layers = nnx.List([Block.build(config, weights, i, ffn) for i in range(config.n_layers)])
        self.final_norm = Norm(weights, "final_norm", config.norm_eps)
        self.head = Head(self.embed if config.tie_embeddings else _param(weights, "lm_head"))
        expected = (config.vocab_size, config.d_model)
        for name, w in (("embedding", self.embed), ("output head", self.head.w)):
            if tuple(w.shape) != expected:
                raise ConfigError(f"{name} shape {tuple(w.shape)} does not match the config's {expected}")

    def __call__(self, tokens, start, cache: KVCache | None, *, capture: bool = False):
        """tokens [B, T] at positions start..start+T-1 -> final hidden states [B, T, d], updated cache.
        cache None: a whole sequence from position 0 that keeps nothing (returns None for the cache).

        With capture=True also returns every layer's FFN inputs (FFN input, residual), each [B, T, d]."""
        x = self.inputs(tokens, start)
        ks, vs, ffn_inputs = [], [], []
        none = [None] * len(self.layers)
        for layer, k, v in zip(self.layers, none if cache is None else cache.k, none if cache is None else cache.v):
            with _dequantized_after(x):
                x, ffn_in, k, v = layer(x, start, k, v)
            ks.append(k)
            vs.append(v)
            ffn_inputs.append(ffn_in)
        out = self.final_norm(x), None if cache is None else KVCache(k=ks, v=vs)
        return (*out, ffn_inputs) if capture else out

    def inputs(self, tokens, start):
        """tokens [B, T] at positions start..start+T-1 (start a scalar, or [B] for T 1) -> the first layer's
        input [B, T, d]: their embedding rows, plus their position's row where the model has a position table."""
        x = embedding_rows(self.embed, tokens)
        if self.pos_embed is None:
            return x
        positions = jnp.reshape(start, (-1, 1)) + jnp.arange(tokens.shape[1])
        return x + self.pos_embed[...][jnp.maximum(positions, 0)]

    def decode(self, token, pos, cache: KVCache):
        """One token (a scalar id) at position pos -> (logits [vocab], updated cache): each layer's and the
        head's `decode`, which a host-backed engine swaps for its kernels (pjinfer.runtime.host). A layer whose
        weights are quantized and read in XLA (a layer split's) dequantizes them only when it runs."""
        x = self.inputs(token.reshape(1, 1), pos)
        ks, vs = [], []
        for layer, k, v in zip(self.layers, cache.k, cache.v):
            with _dequantized_after(x):
                x, k, v = layer.decode(x, pos, k, v)
            ks.append(k)
            vs.append(v)
        return self.head.decode(self.final_norm(x)[0, 0]), KVCache(k=ks, v=vs)

    def forward_sequence(self, tokens, *, capture: bool = False, residuals: bool = False):
        """A whole sequence [B, T] from position 0, no cache allocated: the final hidden states [B, T, d], and
        with capture=True also every layer's FFN input (scoring and profiling), and with residuals=True as well
        every layer's residual stream before the FFN's norm (what a PowerInfer predictor reads)."""
        hidden, _, *captured = self(tokens, 0, None, capture=capture)
        if not capture:
            return hidden
        ffn_inputs = [f for f, _ in captured[0]]
        return (hidden, ffn_inputs, [r for _, r in captured[0]]) if residuals else (hidden, ffn_inputs)

    def logits(self, hidden):
        """hidden [..., d] -> logits [..., vocab] (the sequence path: prefill, scoring)."""
        return self.head(hidden)
