"""The FFN of a set of neurons on the host, called from Python (jax.pure_callback): PowerInfer's cold half.

``NeuronRows`` holds a layer's rows as a file stores them (gate, up and ffn_down_t, a row per neuron, in any of
predicted_ffn's row types) and computes, for one token, y = sum over the given neurons of
act(gate_i . h, up_i . h) down_t_i with predicted_ffn.neurons (a Numba kernel that releases the GIL), on Python
threads that split the neurons, their partial sums added in thread order (predicted_ffn.reduce): the same sums
for the same neurons whatever the thread count, as the kernel's row order within a share is the ids' order.

    rows = NeuronRows(gate, up, down_t, activation="reglu", threads=2)
    y = rows(h, ids, count)                  # one token: the neurons ids[:count]
    y = rows.masked(h, mask, neuron_ids)     # tokens [N, d]: row t over neuron_ids[mask[t]]

The rows are the file's arrays (memory-mapped pages stay the file's); nothing here touches JAX, so the same object
serves a step compiled for any platform.
"""
from __future__ import annotations

import concurrent.futures

import numpy as np

from . import predicted_ffn
from .activation import get as activation_named
from .contract import ConfigError


_POOLS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}   # threads -> the one pool every NeuronRows of
                                                                 # that size shares (a model has one a layer)


def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    if threads not in _POOLS:
        _POOLS[threads] = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="neuron-rows")
    return _POOLS[threads]


class NeuronRows:
    """gate, up, down_t: cpu_offload.qtensor QTensors of GGUF block types, or float16 / float32 arrays
    (predicted_ffn.stored_rows), [d_ff, d] each (down_t: neuron i's down weights in row i). activation: a name of
    cpu_offload.activation. threads: the most threads one call uses; a share is at least min_share neurons."""

    def __init__(self, gate, up, down_t, *, activation: str, threads: int = 1, min_share: int = 64):
        (self.gate, self.gate_kind), (self.up, self.up_kind), (self.down, self.down_kind) = (
            predicted_ffn.stored_rows(w) for w in (gate, up, down_t))
        if not self.gate.shape[0] == self.up.shape[0] == self.down.shape[0]:
            raise ConfigError(f"neuron rows disagree on the neuron count: gate {self.gate.shape[0]}, up "
                              f"{self.up.shape[0]}, down_t {self.down.shape[0]}")
        self.code = activation_named(activation).code
        _, block, nbytes = predicted_ffn.KINDS[self.down_kind]
        self.d = self.down.shape[1] // nbytes * block
        self.threads, self.min_share = max(1, threads), min_share
        self.pool = _pool(self.threads) if self.threads > 1 else None
        self.parts = np.zeros((self.threads, self.d), np.float32)
        self.vals = np.zeros(max(1, self.gate.shape[0]), np.float32)

    def __call__(self, h, ids, count) -> np.ndarray:
        """h [d] (the FFN's input), ids int32 (the first `count` are the neurons, each < d_ff) -> y float32 [d]."""
        h = np.ascontiguousarray(h, np.float32)
        ids, count = np.ascontiguousarray(ids, np.int32), int(count)
        if not 0 <= count <= ids.shape[0] or (count and not 0 <= ids[:count].min() <= ids[:count].max()
                                              < self.gate.shape[0]):
            raise ConfigError(f"neuron ids out of range: {count} of {ids.shape[0]} for {self.gate.shape[0]} neurons")
        n = max(1, min(self.threads, count // self.min_share))

        def share(tid):
            lo, hi = predicted_ffn.share(count, tid, n)
            predicted_ffn.neurons(self.gate_kind, self.gate, self.up_kind, self.up, self.down_kind, self.down, h, ids,
                                  lo, hi, self.code, self.parts[tid], self.vals)

        if n == 1:
            share(0)                # a few ids: no thread handoff
        else:
            list(self.pool.map(share, range(n)))
        y = np.empty(self.d, np.float32)
        predicted_ffn.reduce(self.parts, n, y)
        return y

    def masked(self, h, mask, neuron_ids) -> np.ndarray:
        """h [N, d], mask bool [N, C], neuron_ids int32 [C] -> y float32 [N, d]: row t sums the neurons
        neuron_ids[mask[t]] (in ascending position), zeros where it has none."""
        h, mask, neuron_ids = np.asarray(h, np.float32), np.asarray(mask, bool), np.asarray(neuron_ids, np.int32)
        y = np.zeros(h.shape, np.float32)
        for t in range(h.shape[0]):
            ids = neuron_ids[mask[t]]
            if ids.size:
                y[t] = self(h[t], ids, ids.size)
        return y
