"""A PowerInfer file run as PowerInfer runs it beside a GPU (backends' powerinfer-hybrid row: a PowerInfer file with
its predictors and placement, `--hot-backend pallas`, or `pallas-interpret` to check it on the CPU).

Per layer and token, in one jitted step:
    attention, norms, embedding, head  XLA on the file's blocks (model.QMatrix, dequantized where used)
    the file's predictor               fc2 relu(fc1 r) >= t on the accelerator (predicted.predicted_set), r the
                                       residual stream before the FFN's norm
    active & hot                       pallas_kernels.q4_rows.q4_hot_ffn over the hot neurons' rows, held on the
                                       accelerator as Q4 planes of the file's own Q4_0 / Q4_1 numbers
    active & cold                      cpu_offload.neuron_rows.NeuronRows on the host, over the file's rows as stored
                                       (memory-mapped: never on the accelerator), through jax.pure_callback
    the two partial sums added on the accelerator.
Many tokens at once (prefill, scoring) compute the same sums: each hot row dequantized and multiplied once for all
tokens, every token keeping only its own predicted neurons; the cold ones token by token on the host.

The placement is the file's (PowerInfer's gpu_idx tensors, in the file or in its GPU index beside it:
pjinfer.load.powerinfer.file_placement). Only the hot rows, the predictors and the dense part reach the accelerator:
the FFN's rows are never made into device arrays whole (``build`` hands the Transformer its FFNs ready made).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpu_offload.activation import activate
from cpu_offload.blocks import Q4_0, Q4_1, TYPES
from cpu_offload.neuron_rows import NeuronRows
from cpu_offload.qtensor import is_quantized
from cpu_offload.team import default_size
from pallas_kernels import compact
from pallas_kernels.q4_rows import Q4Planes, dequantize, planes_from_blocks, q4_hot_ffn
from pjinfer.config import ConfigError
from pjinfer.runtime.model import Transformer, to_xla
from pjinfer.runtime.predicted import predicted_set
from pjinfer.runtime.sparse import Index

MATRICES = ("w_gate", "w_up", "w_down_t")   # a neuron's rows: gate, up, and down (PowerInfer's ffn_down_t)


class HotRows(nnx.Module):
    """Some neurons' rows of one matrix on the accelerator, as the three planes of their 4-bit blocks."""

    def __init__(self, planes: Q4Planes):
        self.qs, self.scale, self.minimum = (nnx.Param(jnp.asarray(a)) for a in planes)

    def planes(self) -> Q4Planes:
        return Q4Planes(self.qs[...], self.scale[...], self.minimum[...])


class HybridFFN(nnx.Module):
    """Layer `layer`'s FFN split by `hot` (bool [d_ff]): hot rows on the accelerator, the rest through `cold` (the
    layer's NeuronRows over every neuron's rows; only the cold ones are asked of it). planes: hot_rows' (None when
    no neuron is hot). fc1 [rank, d], fc2 [d_ff, rank]:
    the file's predictor; interpret: run the Pallas kernel in interpret mode (the CPU)."""

    def __init__(self, activation: str, layer: int, planes: dict | None, hot: np.ndarray, fc1, fc2, threshold: float,
                 cold: NeuronRows, *, interpret: bool):
        self.activation, self.layer, self.interpret, self.threshold = activation, layer, interpret, float(threshold)
        self.hot_ids = Index(jnp.asarray(np.flatnonzero(hot), jnp.int32))
        self.cold_ids = Index(jnp.asarray(np.flatnonzero(~hot), jnp.int32))
        self.fc1, self.fc2 = nnx.Param(to_xla(fc1)), nnx.Param(to_xla(fc2))
        self.gate, self.up, self.down_t = (None if planes is None else HotRows(planes[m]) for m in MATRICES)
        self.cold = ColdCall(cold, np.flatnonzero(~hot))

    def __call__(self, x, residual=None):
        if residual is None:
            raise ConfigError("a PowerInfer FFN's predictor reads the residual stream, which was not given")
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        active = predicted_set(residual.reshape(x.shape), self.fc1[...], self.fc2[...], self.threshold)
        y = jnp.zeros_like(x)
        if self.gate is not None:
            mask = active[:, self.hot_ids[...]]
            gate, up, down_t = self.gate.planes(), self.up.planes(), self.down_t.planes()
            if x.shape[0] == 1:
                ids, count = compact(mask)
                y = y + q4_hot_ffn(x[0], gate, up, down_t, ids[0], count[0], activation=self.activation,
                                   interpret=self.interpret)[None]
            else:
                act = activate(self.activation, x @ dequantize(gate, jnp).T, x @ dequantize(up, jnp).T)
                y = y + jnp.where(mask, act, 0.0) @ dequantize(down_t, jnp)
        if self.cold.ids.size:
            y = y + jax.pure_callback(self.cold, jax.ShapeDtypeStruct(x.shape, jnp.float32), x,
                                      active[:, self.cold_ids[...]], vmap_method="sequential")
        return y.reshape(shape)


class ColdCall:
    """What the step's callback calls: (x [N, d], mask [N, C] over the cold neurons) -> their sums [N, d] on the
    host. A plain object, so that the module keeps it (and its host arrays) out of the model's state."""

    def __init__(self, rows: NeuronRows, ids: np.ndarray):
        self.rows, self.ids = rows, ids.astype(np.int32)

    def __call__(self, x, mask):
        return self.rows.masked(x, mask, self.ids)


def hot_rows(tensors: dict, layer: int, hot: np.ndarray) -> dict:
    """{matrix: Q4Planes of the hot neurons' rows} of layer `layer`, the file's numbers; a matrix that is not Q4_0
    or Q4_1 blocks is refused in one line."""
    out = {}
    for m in MATRICES:
        w = tensors[f"layers.{layer}.{m}"]
        if not is_quantized(w) or w.code not in (Q4_0, Q4_1):
            kind = TYPES[w.code].name if is_quantized(w) else np.asarray(w).dtype.name
            raise ConfigError(f"the hot neurons' rows go to the accelerator as Q4_0 or Q4_1 blocks; layer {layer}'s "
                              f"{m} is {kind} (this file runs on the CPU: leave --hot-backend out)")
        out[m] = jax.device_put(planes_from_blocks(np.asarray(w.data)[np.flatnonzero(hot)], w.code))
    return out


def build(config, tensors: dict, predictors, hot: np.ndarray, hot_backend: str) -> Transformer:
    """The Transformer of a PowerInfer file's `tensors` (the loader's, with neuron_rows) with every FFN a HybridFFN:
    predictors (pjinfer.load.powerinfer.Predictors), hot bool [n_layers, d_ff] (its placement). The dense part goes
    to the accelerator (to_xla); the FFN's rows stay the host's, but for the hot rows' planes."""
    if hot.shape != (config.n_layers, config.d_ff):
        raise ConfigError(f"placement shape {hot.shape} does not match the model ({config.n_layers}, {config.d_ff})")
    threads = default_size()
    dense = {k: (v.map(to_xla) if is_quantized(v) else v) for k, v in tensors.items()
             if k.rsplit(".", 1)[-1] not in MATRICES}

    def ffn(l):
        p = f"layers.{l}"
        cold = NeuronRows(*(tensors[f"{p}.{m}"] for m in MATRICES), activation=config.activation, threads=threads)
        return HybridFFN(config.activation, l, hot_rows(tensors, l, hot[l]) if hot[l].any() else None, hot[l],
                         predictors.fc1[l], predictors.fc2[l], predictors.threshold, cold,
                         interpret=hot_backend == "pallas-interpret")

    return Transformer(config, dense, ffn=ffn)
