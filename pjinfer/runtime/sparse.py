"""The hybrid sparse FFN: PowerInfer's online half.

Per token and layer:
    predictor(x)      -> active set (bool per neuron)
    active & hot      -> hot rows compacted on the accelerator, computed by pallas_kernels.hot_ffn
                         (compiled on a GPU; on a CPU-only machine XLA runs the same gather-and-reduce,
                         or the Pallas kernel in interpret mode when asked, for testing)
    active & cold     -> cold rows in host memory, computed by Numba threads (cpu_offload.ColdFFN,
                         an XLA FFI call inside the same jitted step; where JAX runs on a GPU, the same call
                         through jax.pure_callback: cpu_offload.host_call)
    merged            -> hot part + cold part (+ the down bias) on the accelerator

Every token is computed this way, prompt tokens included, so prefill, decode and scoring share one
rule and `perplexity --bundle` measures exactly what generation computes. (A dense prefill would
need every neuron on the accelerator, which is what the placement exists to avoid.)

One token (decode) gathers its own active rows. Many tokens at once (prefill, scoring) read each row
once for the whole batch instead: hot rows as one matrix product whose inactive (token, neuron)
entries are zeroed before the down projection, cold rows through the FFI's masked kernel, which
computes only the active (token, neuron) pairs. The sums are the per-token ones; only their cost changes.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpu_offload.bridge import ColdFFN
from cpu_offload.host_call import bridge_for
from pjinfer.config import HOT_BACKENDS, ConfigError
from pjinfer.runtime.gathered import PALLAS_BACKENDS, pallas_interpret
from pjinfer.runtime.model import FFN, Transformer, neurons, value



class Index(nnx.Variable):
    """Neuron indices: state that travels with the weights but is never trained."""


class SparseFFN(nnx.Module):
    """Replaces a layer's FFN. `predictor`: a train.predictor.Predictor (trained by pjinfer, reading the FFN's
    input, or imported from a PowerInfer file, reading the residual stream before the FFN's norm); None (every
    neuron active: the exactness check against dense); or the layer's dense FFN, whose exact activity is the
    oracle for the ReLU family (active = non-zero)."""

    def __init__(self, ffn: FFN, *, layer: int, hot: np.ndarray, predictor, cold: ColdFFN, hot_backend: str):
        if hot_backend not in HOT_BACKENDS:
            raise ConfigError(f"unknown hot backend {hot_backend!r} (known: {', '.join(HOT_BACKENDS)})")
        hot_ids, cold_ids = np.flatnonzero(hot), np.flatnonzero(~hot)
        rows = lambda p: None if p is None else nnx.Param(jnp.asarray(np.asarray(p[...])[hot_ids]))
        self.activation = ffn.activation
        self.layer = layer
        self.hot_backend = hot_backend
        self.predictor = predictor
        self.cold = cold
        self.hot_ids = Index(jnp.asarray(hot_ids, jnp.int32))
        self.cold_ids = Index(jnp.asarray(cold_ids, jnp.int32))
        self.w_gate, self.w_up, self.w_down_t, self.b_up = (rows(ffn.w_gate), rows(ffn.w_up), rows(ffn.w_down_t),
                                                            rows(ffn.b_up))
        self.b_down = ffn.b_down

    def active(self, x, residual=None):
        """x [N, d] (the FFN's input), residual [N, d] (the stream before its norm) -> predicted active neurons
        [N, F]."""
        if self.predictor is None:
            return jnp.ones((x.shape[0], self.hot_ids.shape[0] + self.cold_ids.shape[0]), bool)
        if isinstance(self.predictor, FFN):
            return self.predictor.neurons(x) != 0
        if self.predictor.reads == "residual":
            if residual is None:
                raise ConfigError(f"layer {self.layer}: its predictor reads the residual stream, which was not given")
            return self.predictor.active(residual)
        return self.predictor.active(x)

    def __call__(self, x, residual=None):
        from pallas_kernels import compact   # traced once per executable (docs/architecture.md, "Lazy imports")

        shape = x.shape
        x = x.reshape(-1, shape[-1])
        active = self.active(x, None if residual is None else residual.reshape(-1, shape[-1]))
        y = jnp.zeros_like(x)
        if self.hot_ids.shape[0] and x.shape[0] == 1:
            ids, count = compact(active[:, self.hot_ids[...]])
            y = y + self._hot(x[0], ids[0], count[0])[None]
        elif self.hot_ids.shape[0]:
            y = y + self._hot_batch(x, active[:, self.hot_ids[...]])
        if self.cold_ids.shape[0] and x.shape[0] == 1:
            ids, count = compact(active[:, self.cold_ids[...]])
            y = y + self.cold(self.layer, x, ids, count)
        elif self.cold_ids.shape[0]:
            y = y + self.cold.masked(self.layer, x, active[:, self.cold_ids[...]])
        if self.b_down is not None:
            y = y + self.b_down[...]
        return y.reshape(shape)

    def _hot_batch(self, x, mask):
        """Many tokens (prefill, scoring): each hot row is read once for the whole batch and each token keeps
        only its own predicted-active neurons, the same sums as the per-token gather. Hot neurons are the
        ones that fire most, so a batch's union of active sets is nearly all of them and gathering per token
        would read each row once per token instead."""
        act = neurons(self.activation, x, value(self.w_gate), self.w_up[...], value(self.b_up))
        return jnp.where(mask, act, 0.0) @ self.w_down_t[...]

    def _hot(self, x, ids, count):
        from pallas_kernels import hot_ffn, hot_ffn_reference

        args = (x, value(self.w_gate), self.w_up[...], self.w_down_t[...], ids, count)
        kw = dict(activation=self.activation, b_up=value(self.b_up))
        if self.hot_backend == "xla":
            return hot_ffn_reference(*args, **kw)
        return hot_ffn(*args, **kw, interpret=self.hot_backend == "pallas-interpret")


def sparsify(model: Transformer, hot: np.ndarray, predictors: list | None, *, hot_backend: str = "xla",
             oracle: bool = False, cold_weights: str = "float32", bridge: str = "auto") -> ColdFFN:
    """Swap every layer's FFN for a SparseFFN in place. hot: bool [L, F] placement. predictors: one per
    layer, or None for every-neuron-active; oracle=True uses each layer's exact activity instead.
    cold_weights: "float32", or "int8" (cold rows quantized per block of 64, dequantized inside the Numba kernels).
    bridge: how the step reaches the cold rows' kernels (cpu_offload.host_call.bridge_for: "auto" is the FFI target
    where JAX runs on the CPU, a callback elsewhere; "ffi" elsewhere is refused in one line).
    Returns the ColdFFN holding the cold rows in host memory (the model keeps a reference)."""
    config = model.config
    if hot_backend in PALLAS_BACKENDS:
        pallas_interpret(hot_backend)   # "pallas" needs a GPU: one clear error here, not a failed compile later
    if hot.shape != (config.n_layers, config.d_ff):
        raise ConfigError(f"placement shape {hot.shape} does not match the model ({config.n_layers}, {config.d_ff})")
    # An all-hot placement never calls the bridge: it runs on any platform whatever was asked.
    bridge = bridge_for(bridge, jax.default_backend()) if not hot.all() else "ffi"
    host = lambda p: None if p is None else np.asarray(p[...])
    ffns = [layer.ffn for layer in model.layers]
    cold = ColdFFN.from_dense(
        w_up=[host(f.w_up) for f in ffns], w_down_t=[host(f.w_down_t) for f in ffns],
        w_gate=[host(f.w_gate) for f in ffns] if config.gated else None,
        b_up=None if ffns[0].b_up is None else [host(f.b_up) for f in ffns],
        cold_ids=[np.flatnonzero(~hot[l]) for l in range(config.n_layers)], activation=config.activation,
        weights=cold_weights, bridge=bridge)
    for l, layer in enumerate(model.layers):
        predictor = layer.ffn if oracle else (None if predictors is None else predictors[l])
        layer.ffn = SparseFFN(layer.ffn, layer=l, hot=hot[l], predictor=predictor, cold=cold,
                              hot_backend=hot_backend)
    return cold


def skipped_share(engine, ids) -> float:
    """Share of FFN neurons the predictors skip, over the given tokens and every layer."""
    return 1.0 - float(jnp.mean(_predicted_density(engine.graphdef, engine.state, jnp.asarray([ids], jnp.int32))))


@partial(jax.jit, static_argnames=("graphdef",))
def _predicted_density(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    _, inputs, residuals = model.forward_sequence(tokens, capture=True, residuals=True)
    flat = lambda x: x.reshape(-1, x.shape[-1])
    return jnp.stack([layer.ffn.active(flat(x), flat(r)).mean()
                      for layer, x, r in zip(model.layers, inputs, residuals)])
