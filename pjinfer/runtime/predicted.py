"""A PowerInfer file run sparse as the file is, as PowerInfer runs it on the CPU: no bundle, its own predictors.

Two halves, one rule (a neuron of layer l is computed when fc2 relu(fc1 r) >= t, r the residual stream before the
FFN's norm; pjinfer.load.powerinfer):
- one-token decode steps run on the host, cpu_offload.predicted_decode.PredictedHostDecoder (one FFI call per
  layer: the predictor, then gate and up over the predicted rows in the file's row types, down over the same rows
  of ffn_down_t);
- prefill and scoring run in XLA, each layer's FFN swapped for a ``PredictedFFN``: every neuron computed, the ones
  outside the predicted set zeroed before down. So ``perplexity`` measures what decode computes.

``attach_powerinfer(model, config, tensors, predictors)`` does both swaps on a Transformer built from the file's
tensors as stored, ``pjinfer.load.loader.load_gguf(path, keep=cpu_offload.blocks.AS_STORED, neuron_rows=True)``:
q, k, v, o, the embedding and head the file's blocks (Q8_0 for float ones, as that format's row of blocks.FORMATS
says), the FFN matrices its rows in their own types, ffn_down_t too (w_down_t [d_ff, d], which the Transformer must
not run before this swap), F16 and F32 ones the file's arrays. It returns the host decoder.
Without predictors (``dense=True``) every neuron is computed: the same file dense, through the same kernels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pjinfer.config import ConfigError
from pjinfer.runtime import host
from pjinfer.runtime.model import FFN, QMatrix, Transformer, down, linear, matrix, ordered, to_xla


class PredictedFFN(FFN):
    """A layer's FFN whose neurons outside the predictor's set are zeroed (XLA: prefill, scoring; the host decoder
    computes the same set's rows only). fc1 [rank, d], fc2 [d_ff, rank]: the predictor as stored (float16 or
    float32 jax arrays, converted to float32 where used), or None (every neuron)."""

    def __init__(self, ffn: FFN, fc1=None, fc2=None, threshold: float = 0.0):
        self.activation = ffn.activation
        self.w_gate, self.w_up, self.w_down_t, self.b_up, self.b_down = (ffn.w_gate, ffn.w_up, ffn.w_down_t,
                                                                         ffn.b_up, ffn.b_down)
        self.t_in = self.t_down = None
        self.fc1 = None if fc1 is None else nnx.Param(fc1)
        self.fc2 = None if fc2 is None else nnx.Param(fc2)
        self.threshold = float(threshold)

    def active(self, residual):
        """residual [..., d] -> the predicted set [..., d_ff] (bool): fc2 relu(fc1 residual) >= threshold."""
        if self.fc1 is None:
            return jnp.ones((*residual.shape[:-1], self.w_up.shape[0]), bool)
        return predicted_set(residual, self.fc1[...], self.fc2[...], self.threshold)

    def __call__(self, x, residual=None):
        if residual is None:
            raise ConfigError("a PowerInfer FFN's predictor reads the residual stream, which was not given")
        act = jnp.where(self.active(residual), self.neurons(x), 0.0)
        out = down(act, matrix(self.w_down_t))
        return out if self.b_down is None else out + self.b_down[...]


def predicted_set(residual, fc1, fc2, threshold: float):
    """PowerInfer's rule: residual [..., d] -> bool [..., d_ff], fc2 relu(fc1 residual) >= threshold, the predictor's
    float16 or float32 weights read in float32."""
    z = jax.nn.relu(linear(residual, ordered(fc1).astype(jnp.float32)))
    return linear(z, ordered(fc2).astype(jnp.float32)) >= threshold


def attach_powerinfer(model: Transformer, config, tensors: dict, predictors=None, *, dense: bool = False):
    """Make `model` (a Transformer of `tensors`) run as PowerInfer runs its file: every FFN a PredictedFFN, every
    block's one-token step and the head on a PredictedHostDecoder reading `tensors` in place. predictors:
    pjinfer.load.powerinfer.Predictors (fc1, fc2, threshold); dense=True (or predictors None) computes every
    neuron. tensors: the loader's with neuron_rows (see the module docstring). Returns the decoder (its
    ``last_active()`` is the last token's predicted sets). In place; the model must not run before it."""
    from cpu_offload.predicted_decode import PredictedHostDecoder

    if not dense and predictors is None:
        raise ConfigError("a PowerInfer file runs sparse with its predictors; without them ask for dense")
    if dense:
        predictors = None
    fc1 = fc2 = [None] * config.n_layers
    if predictors is not None:   # one copy of each, which XLA and the host decoder both read
        fc1, fc2 = ([to_xla(a) for a in arrays] for arrays in (predictors.fc1, predictors.fc2))
    threshold = 0.0 if predictors is None else predictors.threshold
    decoder = PredictedHostDecoder(config, tensors, *((None, None) if predictors is None else (fc1, fc2)), threshold)
    for l, block in enumerate(model.layers):
        if isinstance(block.ffn.w_down_t, QMatrix):   # ffn_down_t's blocks: rows are neurons, canonical [d_ff, d]
            block.ffn.w_down_t.transposed = False
        block.ffn = PredictedFFN(block.ffn, fc1[l], fc2[l], threshold)
    host.attach(model, decoder)
    return decoder

