"""Cold FFN neurons in host memory, computed by Numba threads, callable from inside ``jax.jit``.

    cold = ColdFFN.from_dense(w_up=[...], w_down_t=[...], w_gate=[...], cold_ids=[...], activation="swiglu")
    y = cold(layer, x, ids, count)      # inside jit: x f32 [..., d], ids int32 [..., K], count int32 [...]
    ys = cold.masked(layer, xs, mask)   # many tokens (prefill, scoring): xs [N, d], mask bool [N, n_cold]

``ids`` index the *compacted* cold rows of that layer (row j of layer l is dense neuron ``cold.cold_ids[l][j]``;
``cold.cold_position(l)`` maps dense ids to compacted ones, -1 for hot neurons). ``count`` is clipped to [0, K]
and ids outside [0, n_cold(l)) are skipped, so a layer with no cold neuron returns zeros. ``layer`` may be traced;
``jax.vmap`` works. The masked form reads each row once for all N tokens.

Each call is the XLA FFI target ``pjinfer_cold_ffn`` (``pjinfer_cold_ffn_int8`` for int8 rows; handlers:
cpu_offload/cold_handler.py), whose one attribute is the index of this object's header in cpu_offload.tables; the
weights are reached by address, never passed as operands. Keep the
ColdFFN alive until every result computed from it is ready and do not mutate its arrays meanwhile; after
``close()`` an executable that still refers to it fails with "ColdFFN was closed" instead of reading freed memory
(headers are never freed). The header, layer table and lifetime rules: cpu_offload/README.md.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import int8, kernels, tables
from .activation import ACTIVATIONS
from .cold_handler import (H_ACT, H_D, H_ID, H_INT8, H_MAGIC, H_NLAYERS, H_RUNTIME, H_TABLE, MAGIC_ALIVE, T_BIAS,
                           T_DOWN, T_GATE, T_NCOLD, T_SCALES, T_UP, T_WIDTH, cold_ffn_locked, register, retire)
from .contract import COLD_WEIGHTS, ConfigError
from .ffi import RUNTIME_ADDR as _RUNTIME_ADDR
from .host_call import check_bridge, through
from .kernels import act_code as _act_code

_HEADERS: list[np.ndarray] = []  # every header ever made; never freed (executables may hold their address)
_ids = itertools.count(1)


def _f32_rows(a, d: int, name: str, layer: int) -> np.ndarray:
    a = np.require(a, np.float32, ["C_CONTIGUOUS", "ALIGNED"])
    if a.ndim != 2 or a.shape[1] != d:
        raise ConfigError(f"layer {layer}: {name} must be [n_cold, {d}], got {a.shape}")
    return a


class ColdFFN:
    """Per-layer cold FFN rows in host memory, computed by Numba from inside jit (see the module docstring).

    Args (one entry per layer; row j of every array is cold neuron j of that layer):
      w_up: [C_l, d] float32 arrays.   w_down_t: [C_l, d] (down projection, transposed).
      w_gate: [C_l, d] arrays, or None for activation "relu" (ungated).   b_up: [C_l] arrays or None.
      activation: a name in cpu_offload.activation.ACTIVATIONS.
      cold_ids: optional per-layer int arrays: the dense neuron id of each cold row (kept for cold_position).
      weights: "float32" keeps the rows as given; "int8" stores them as int8 with a float32 scale per block of
        64 (int8.quantize): 17/64 of the bytes to read.
      bridge: "ffi" calls the FFI target from the step (JAX on the CPU); "callback" goes through
        host_call.on_host (any platform; the same results bit for bit).
    """

    def __init__(self, w_up: Sequence[np.ndarray], w_down_t: Sequence[np.ndarray],
                 w_gate: Sequence[np.ndarray] | None = None, b_up: Sequence[np.ndarray] | None = None, *,
                 activation: str = "swiglu", cold_ids: Sequence[np.ndarray] | None = None,
                 weights: str = "float32", bridge: str = "ffi"):
        if weights not in COLD_WEIGHTS:
            raise ConfigError(f"weights must be one of {COLD_WEIGHTS}, got {weights!r}")
        self.bridge = check_bridge(bridge)
        code = _act_code(activation)           # a ConfigError for an unknown name
        gated = ACTIVATIONS[activation].gated
        n_layers = len(w_up)
        if n_layers == 0 or len(w_down_t) != n_layers:
            raise ConfigError("need one w_up and one w_down_t per layer (at least one layer)")
        if gated and (w_gate is None or len(w_gate) != n_layers):
            raise ConfigError(f"activation {activation!r} needs one w_gate per layer")
        if not gated and w_gate is not None:
            raise ConfigError("activation 'relu' is ungated: pass w_gate=None")
        if b_up is not None and len(b_up) != n_layers:
            raise ConfigError("b_up needs one entry per layer")
        d = int(np.shape(w_up[0])[1])
        self.activation, self.d, self.n_layers = activation, d, n_layers
        self.w_up, self.w_down_t = [], []
        int8_rows = weights == "int8"
        self.scales = [] if int8_rows else None
        self.w_gate = [] if gated else None
        self.b_up = [] if b_up is not None else None
        table = np.zeros((n_layers, T_WIDTH), np.int64)
        for l in range(n_layers):
            up = _f32_rows(w_up[l], d, "w_up", l)
            c = up.shape[0]
            down = _f32_rows(w_down_t[l], d, "w_down_t", l)
            if down.shape[0] != c:
                raise ConfigError(f"layer {l}: w_down_t has {down.shape[0]} rows, w_up {c}")
            gate = None
            if gated:
                gate = _f32_rows(w_gate[l], d, "w_gate", l)
                if gate.shape[0] != c:
                    raise ConfigError(f"layer {l}: w_gate has {gate.shape[0]} rows, w_up {c}")
            if int8_rows:
                scales = np.ones((3, c, -(-d // kernels.QBLOCK)), np.float32)  # gate, up, down
                if gated:
                    gate, scales[0] = int8.quantize(gate)
                up, scales[1] = int8.quantize(up)
                down, scales[2] = int8.quantize(down)
                self.scales.append(scales)
                table[l, T_SCALES] = scales.ctypes.data
            self.w_up.append(up)
            self.w_down_t.append(down)
            table[l, T_NCOLD] = c
            table[l, T_UP] = up.ctypes.data
            table[l, T_DOWN] = down.ctypes.data
            if gated:
                self.w_gate.append(gate)
                table[l, T_GATE] = gate.ctypes.data
            if b_up is not None:
                bias = np.require(b_up[l], np.float32, ["C_CONTIGUOUS", "ALIGNED"])
                if bias.shape != (c,):
                    raise ConfigError(f"layer {l}: b_up must be [{c}], got {bias.shape}")
                self.b_up.append(bias)
                table[l, T_BIAS] = bias.ctypes.data
        self.n_cold = [int(c) for c in table[:, T_NCOLD]]
        self.cold_ids = None if cold_ids is None else [np.asarray(c, np.int64) for c in cold_ids]
        self._table = table
        header = np.zeros(8, np.int64)
        header[[H_NLAYERS, H_D, H_ACT, H_TABLE, H_RUNTIME, H_ID, H_INT8]] = [
            n_layers, d, code, table.ctypes.data, _RUNTIME_ADDR, next(_ids), int(int8_rows)]
        header[H_MAGIC] = MAGIC_ALIVE
        _HEADERS.append(header)
        self._header = header
        self.address = int(header.ctypes.data)
        self.table = tables.register_table(self.address)  # the value of the "table" attribute (cpu_offload.tables)
        self.closed = False
        self.target = register(int8_rows)   # the FFI target's name

    @classmethod
    def from_dense(cls, w_up, w_down_t, cold_ids, w_gate=None, b_up=None, *, activation="swiglu",
                   weights="float32", bridge="ffi") -> "ColdFFN":
        """Compact the cold rows out of dense per-layer weights: cold row j of layer l = dense row cold_ids[l][j]."""
        pick = lambda ws, l: None if ws is None else np.ascontiguousarray(np.asarray(ws[l])[cold_ids[l]], np.float32)
        n = len(w_up)
        return cls([pick(w_up, l) for l in range(n)], [pick(w_down_t, l) for l in range(n)],
                   None if w_gate is None else [pick(w_gate, l) for l in range(n)],
                   None if b_up is None else [pick(b_up, l) for l in range(n)],
                   activation=activation, cold_ids=[np.asarray(c) for c in cold_ids], weights=weights, bridge=bridge)

    def cold_position(self, layer: int, d_ff: int | None = None) -> np.ndarray:
        """int32 [d_ff]: compacted cold row of each dense neuron of a layer, -1 where the neuron is not cold."""
        if self.cold_ids is None:
            raise ConfigError("this ColdFFN was built without cold_ids")
        ids = self.cold_ids[layer]
        size = int(d_ff) if d_ff is not None else (int(ids.max()) + 1 if ids.size else 0)
        pos = np.full(size, -1, np.int32)
        pos[ids] = np.arange(ids.size, dtype=np.int32)
        return pos

    def __call__(self, layer, x, ids, count, out_init=None):
        """y f32 [..., d] = sum over the cold rows ids[..., :count] of `layer` (see module docstring).

        out_init: optional f32 array shaped like x whose buffer XLA reuses for the result (input_output_aliases).
        Its values are ignored; tests pass NaNs to check the handler overwrites rather than accumulates.
        """
        if self.closed:
            raise RuntimeError("ColdFFN is closed")
        if isinstance(layer, (int, np.integer)) and not 0 <= int(layer) < self.n_layers:
            raise ConfigError(f"layer {int(layer)} out of range [0, {self.n_layers})")
        layer = jnp.asarray(layer, jnp.int32)
        x = jnp.asarray(x, jnp.float32)
        ids = jnp.asarray(ids, jnp.int32)
        count = jnp.asarray(count, jnp.int32)
        if x.ndim < 1 or x.shape[-1] != self.d:
            raise ConfigError(f"x must be [..., {self.d}], got {x.shape}")
        batch = x.shape[:-1]
        if ids.ndim != x.ndim or ids.shape[:-1] != batch:
            raise ConfigError(f"ids must be [{', '.join(map(str, batch + ('K',)))}], got {ids.shape}")
        if count.shape != batch:
            raise ConfigError(f"count must have shape {batch}, got {count.shape}")
        if layer.shape not in ((), batch):
            raise ConfigError(f"layer must be a scalar or have shape {batch}, got {layer.shape}")
        args = (layer, x, ids, count)
        if out_init is not None:
            out_init = jnp.asarray(out_init, jnp.float32)
            if out_init.shape != x.shape:
                raise ConfigError(f"out_init must have shape {x.shape}, got {out_init.shape}")
            args += (out_init,)
        return through(self.bridge, self._call)(*args)

    def _call(self, layer, x, ids, count, out_init=None):
        """The FFI call of __call__, its arguments checked."""
        result = jax.ShapeDtypeStruct(x.shape, jnp.float32)
        if out_init is None:
            call = jax.ffi.ffi_call(self.target, result, vmap_method="broadcast_all")
            return call(layer, x, ids, count, table=np.int64(self.table))
        call = jax.ffi.ffi_call(self.target, result, vmap_method="broadcast_all", input_output_aliases={4: 0})
        return call(layer, x, ids, count, out_init, table=np.int64(self.table))

    def masked(self, layer, x, mask):
        """y f32 [N, d]: token b's sum over the cold rows n of `layer` with mask[b, n] (bool [N, n_cold(layer)])."""
        if self.closed:
            raise RuntimeError("ColdFFN is closed")
        if not isinstance(layer, (int, np.integer)) or not 0 <= int(layer) < self.n_layers:
            raise ConfigError(f"layer must be a Python int in [0, {self.n_layers}), got {layer!r}")
        x = jnp.asarray(x, jnp.float32)
        mask = jnp.asarray(mask, bool)
        if x.ndim != 2 or x.shape[1] != self.d:
            raise ConfigError(f"x must be [N, {self.d}], got {x.shape}")
        if mask.shape != (x.shape[0], self.n_cold[int(layer)]):
            raise ConfigError(f"mask must be [{x.shape[0]}, {self.n_cold[int(layer)]}], got {mask.shape}")
        layer = jnp.asarray(layer, jnp.int32)
        return through(self.bridge, self._masked)(layer, x, mask)

    def _masked(self, layer, x, mask):
        """The FFI call of masked, its arguments checked."""
        call = jax.ffi.ffi_call(self.target, jax.ShapeDtypeStruct(x.shape, jnp.float32))
        return call(layer, x, mask, table=np.int64(self.table))

    def numpy_call(self, layer: int, x, ids, count, out=None, max_threads=None) -> np.ndarray:
        """The same computation called directly from Python (under the bridge lock), for tests and tools."""
        x = np.ascontiguousarray(x, np.float32)
        out = np.empty(self.d, np.float32) if out is None else out
        bias = self.b_up[layer] if self.b_up is not None else kernels.empty_bias()
        if self.w_gate is not None:
            gate = self.w_gate[layer]
        else:  # typed like the other rows, so one compiled kernel serves the call
            gate = np.zeros((0, self.d), self.w_up[layer].dtype)
        scales = self.scales[layer] if self.scales is not None else kernels.no_scales()
        cold_ffn_locked(x, gate, self.w_up[layer], self.w_down_t[layer], bias, scales,
                        np.ascontiguousarray(ids, np.int32), int(count), _act_code(self.activation), out,
                        max_threads)
        return out

    @property
    def nbytes(self) -> int:
        arrays = self.w_up + self.w_down_t + (self.w_gate or []) + (self.b_up or []) + (self.scales or [])
        return int(sum(a.nbytes for a in arrays))

    def close(self) -> None:
        """Mark the header dead (under the bridge lock) and drop the weights; later executions raise."""
        if getattr(self, "closed", True):
            return
        retire(_RUNTIME_ADDR, self.address)
        self.closed = True
        self.w_up = self.w_down_t = self.w_gate = self.b_up = self.scales = None
        self._table = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
