"""A bundle's input thresholds on the accelerator, as a module swap: an engine with float32 weights, thresholds
(pjinfer.offline.teal) and --hot-backend pallas (compiled for a GPU) or pallas-interpret (interpret mode, any
machine: for tests) replaces each Block with a GatheredBlock (`attach`), the way pjinfer.runtime.host swaps blocks
for the host decode.

A swapped block holds its matrices input-major (W transposed, a row per input: pallas_kernels.gather's layout),
once: q/k/v as one [d, (H + 2 KV) hd] matrix (they share their input and its threshold), o as [H hd, d], gate/up
as one [d, 2F] (up alone, [d, F], without a gate), down as the model's own w_down_t [F, d]. Then:
- one token (`GatheredBlock.decode`, what `generate`'s loop runs): for each of the four inputs, the entries above
  the layer's threshold are compacted (pallas_kernels.active_inputs) and pallas_kernels.gather_matvec reads only
  their rows: y = sum over active inputs i of x[i] * W[:, i];
- many tokens (prefill, scoring: the inherited `__call__`): the same sums as dense products in XLA over the same
  arrays, each input's entries at or below its threshold zeroed (model.sparsify_input), as the unswapped model.
So the rule is the one every path applies (|x| <= t counts as zero) and perplexity measures what decode computes.

Every neuron and every weight stays on the accelerator: a bundle's placement (hot/cold split), if it has one, is
not read on this path. Thresholds on the host are the host-thresholds row (cpu_offload.sparse_decode), unchanged. The
output head has no threshold and stays a dense XLA product.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from cpu_offload.activation import activate
from pjinfer.config import ConfigError
from pjinfer.runtime.model import FFN, Attention, Block, Transformer, sparsify_input, value

PALLAS_BACKENDS = ("pallas", "pallas-interpret")


def pallas_interpret(hot_backend: str) -> bool:
    """Whether a Pallas hot backend runs its kernels in interpret mode: "pallas-interpret" does (any machine);
    "pallas" compiles them (Triton) and needs JAX on a GPU, else ConfigError in one line."""
    if hot_backend not in PALLAS_BACKENDS:
        raise ConfigError(f"{hot_backend!r} is not a Pallas backend (those are: {', '.join(PALLAS_BACKENDS)})")
    platform = jax.default_backend()
    if hot_backend == "pallas" and platform != "gpu":
        raise ConfigError(f"--hot-backend pallas compiles its kernels for a GPU and JAX here runs on {platform}; "
                          "use --hot-backend pallas-interpret (interpret mode) or xla")
    return hot_backend == "pallas-interpret"


def masked_product(x, w_t, threshold):
    """x [..., n_in] with the entries |x| <= threshold zeroed, times w_t [n_in, n_out]: [..., n_out] (XLA)."""
    return jnp.einsum("...i,io->...o", sparsify_input(x, threshold), w_t)


def gathered_product(x, w_t, threshold, interpret: bool):
    """The same sum for one token x [..., n_in] (a single row), reading only the rows of w_t whose input clears
    the threshold (every row when threshold is None): pallas_kernels.gather_matvec."""
    from pallas_kernels import active_inputs, gather_matvec   # docs/architecture.md, "Lazy imports"

    if math.prod(x.shape[:-1]) != 1:
        raise ValueError(f"a gathered product takes one token, got input shape {x.shape}")
    flat = x.reshape(-1)
    ids, count = active_inputs(flat, value(threshold))
    y = gather_matvec(flat, w_t, ids, count, interpret=interpret)
    return y.reshape(*x.shape[:-1], w_t.shape[1])


def _float32(*params):
    """The arrays of float32 parameters; ConfigError for a quantized matrix (a QMatrix) or another dtype."""
    for p in params:
        if not isinstance(p, nnx.Param) or p[...].dtype != jnp.float32:
            raise ConfigError("the Pallas threshold path runs float32 weights (--weights float32)")
    return [p[...] for p in params]


def _plus(y, bias):
    return y if bias is None else y + bias[...]


class GatheredAttention(Attention):
    """An Attention whose q/k/v and o are held input-major; `qkv` / `o` (many tokens) are dense masked products,
    `qkv_gathered` / `o_gathered` (one token) read only the active inputs' rows."""

    def __init__(self, attn: Attention, *, interpret: bool):
        wq, wk, wv, wo = _float32(attn.wq, attn.wk, attn.wv, attn.wo)
        self.config = attn.config
        self.w_qkv_t = nnx.Param(jnp.concatenate([wq, wk, wv]).T)
        self.wo_t = nnx.Param(wo.T)
        self.bq, self.bk, self.bv, self.bo = attn.bq, attn.bk, attn.bv, attn.bo
        self.t_in, self.t_o = nnx.data(attn.t_in), nnx.data(attn.t_o)
        self.interpret = interpret

    def _split(self, y):
        c = self.config
        nq, nkv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        return (_plus(y[..., :nq], self.bq), _plus(y[..., nq:nq + nkv], self.bk),
                _plus(y[..., nq + nkv:], self.bv))

    def qkv(self, x):
        return self._split(masked_product(x, self.w_qkv_t[...], self.t_in))

    def o(self, heads):
        return _plus(masked_product(heads, self.wo_t[...], self.t_o), self.bo)

    def qkv_gathered(self, x):
        """One token x [1, 1, d] -> q, k, v as `qkv` gives them."""
        return self._split(gathered_product(x, self.w_qkv_t[...], self.t_in, self.interpret))

    def o_gathered(self, heads):
        """One token's heads [1, 1, H*hd] -> the attention's output, as `o` gives it."""
        return _plus(gathered_product(heads, self.wo_t[...], self.t_o, self.interpret), self.bo)


class GatheredFFN(FFN):
    """An FFN whose gate/up are held input-major as one matrix (down already is: w_down_t); `__call__` (many
    tokens, inherited) is the dense masked FFN, `gathered` (one token) reads only the active inputs' rows."""

    def __init__(self, ffn: FFN, *, interpret: bool):
        self.gated = ffn.w_gate is not None
        w_in = _float32(*((ffn.w_gate,) if self.gated else ()), ffn.w_up)
        _float32(ffn.w_down_t)
        self.activation = ffn.activation
        self.w_in_t = nnx.Param(jnp.concatenate(w_in).T)
        self.w_down_t = ffn.w_down_t
        self.b_up, self.b_down = ffn.b_up, ffn.b_down
        self.t_in, self.t_down = nnx.data(ffn.t_in), nnx.data(ffn.t_down)
        self.interpret = interpret

    def _activations(self, y):
        """gate/up products [..., 2F] (or up [..., F]) -> the activations [..., F]."""
        f = self.w_down_t[...].shape[0]
        gate, up = (y[..., :f], y[..., f:]) if self.gated else (None, y)
        return activate(self.activation, gate, _plus(up, self.b_up))

    def neurons(self, x):
        return self._activations(jnp.einsum("...i,io->...o", x, self.w_in_t[...]))

    def gathered(self, x):
        """One token's FFN input [1, 1, d] -> the FFN's output, as `__call__` gives it."""
        act = self._activations(gathered_product(x, self.w_in_t[...], self.t_in, self.interpret))
        return _plus(gathered_product(act, self.w_down_t[...], self.t_down, self.interpret), self.b_down)


class GatheredBlock(Block):
    """A Block whose one-token step computes every matrix with the gather kernel (see the module docstring)."""

    def __init__(self, block: Block, *, interpret: bool):
        super().__init__(block.attn_norm, GatheredAttention(block.attn, interpret=interpret), block.ffn_norm,
                         GatheredFFN(block.ffn, interpret=interpret))

    def decode(self, x, pos, k_cache, v_cache):
        attn = self.attn
        q, k, v = attn.qkv_gathered(self.attn_norm(x))
        heads, k_cache, v_cache = attn.attend(q, k, v, pos, k_cache, v_cache)
        x = x + attn.o_gathered(heads)
        return x + self.ffn.gathered(self.ffn_norm(x)), k_cache, v_cache


def attach(model: Transformer, hot_backend: str) -> None:
    """Swap every block of a float32 model for a GatheredBlock (in place), keeping its thresholds (set them first:
    model.set_thresholds; a block without thresholds gathers every input). hot_backend: "pallas" or
    "pallas-interpret" (pallas_interpret)."""
    interpret = pallas_interpret(hot_backend)
    model.layers = nnx.List([GatheredBlock(b, interpret=interpret) for b in model.layers])
