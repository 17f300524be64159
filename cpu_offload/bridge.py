"""Cold FFN neurons in host memory, computed by Numba threads, callable from inside ``jax.jit``.

Usage::

    cold = ColdFFN.from_dense(w_up=[...], w_down_t=[...], w_gate=[...], cold_ids=[...], activation="swiglu")
    @jax.jit
    def step(x, ids, count):            # x f32 [d], ids int32 [K], count int32 []
        y = cold(3, x, ids, count)      # f32 [d]; layer may be a Python int or a traced int32 (fori_loop)
        return y + ...

``ids`` index the *compacted* cold rows of that layer (row j of layer l is dense neuron ``cold.cold_ids[l][j]``;
``cold.cold_position(l)`` maps dense ids to compacted ones, -1 for hot neurons). ``count`` is clipped to
[0, K], ids outside [0, n_cold(l)) are skipped, so a layer with no cold neuron returns zeros. Leading batch
dimensions are accepted (x [..., d], ids [..., K], count [...], layer [] or [...]); ``jax.vmap`` works
(``vmap_method="broadcast_all"``). The batch is looped over inside one handler call.

Many tokens of one layer (prefill, scoring) take ``masked(layer, x [N, d], mask [N, n_cold])`` instead: token b
computes cold row n iff ``mask[b, n]``, and ``kernels.cold_ffn_masked_nt`` reads each row once for all N tokens,
on every Numba thread (a per-token loop would read it N times).

How the call reaches Numba
--------------------------
``__call__`` emits ``jax.ffi.ffi_call("pjinfer_cold_ffn")`` with operands (layer i32, x f32, ids i32, count i32
[, out_init f32 aliased to the result]), one f32 result shaped like x, and one attribute ``table`` (int64 scalar):
the address of this object's *header*. The FFI target is registered once per process (``register()``) with a
Numba ``@cfunc`` as its only (execute) handler; XLA calls it with a pointer to an ``XLA_FFI_CallFrame`` and it
returns ``XLA_FFI_Error*`` (NULL = ok). The handler (``_handler``) reads the frame at byte offsets taken from
ctypes mirrors of xla/ffi/api/c_api.h (``ffi._CallFrame`` etc.; x86-64 / LP64 layout, FFI API 0.3 as shipped in
jaxlib 0.10.2; the offsets were checked against the header with a C compiler and are pinned in the tests):

- ``extension_start`` non-NULL with type ``XLA_FFI_Extension_Metadata``: XLA asks for the handler's metadata
  (at registration). We fill ``XLA_FFI_Metadata``: api_version {struct_size, NULL, 0, 3}, traits 0, and return.
- stage != EXECUTE (instantiate / prepare / initialize): nothing to do, return NULL.
- EXECUTE: checks struct sizes, argument / result counts and dtypes, finds the ``table`` attribute by name
  (``XLA_FFI_Attrs``: names are ``XLA_FFI_ByteSpan*``, values ``XLA_FFI_Scalar*``), checks the header's magic,
  layer range and d, takes the process-wide lock, runs ``kernels.cold_ffn_nt`` per token (or
  ``kernels.cold_ffn_masked_nt`` for the masked form) on the buffers' data pointers
  (``XLA_FFI_Buffer.data`` / ``dims``) and the weight pointers from the header's layer table, releases the lock.
  Any violation returns an ``XLA_FFI_Error`` made with ``api->XLA_FFI_Error_Create`` (surfaces as a JAX runtime
  error naming the problem), never a crash.

Weights are never XLA operands: the handler reaches them through raw host pointers.

Host memory layout and lifetime rules
-------------------------------------
- Header (int64[8], one per ColdFFN, *never freed*): magic, n_layers, d, act_code, address of the layer table,
  runtime-block address, instance id. The address of this header is baked into every compiled executable that
  traced a call, as the ``table`` attribute.
- Layer table (int64[n_layers, 8], owned by the ColdFFN): per layer n_cold and the addresses of w_gate (0 when
  ungated), w_up, w_down_t, b_up (0 when no bias) and the [3, n_cold, blocks] int8 block scales (0 for
  float32 rows; non-zero means the three weight arrays are int8). The weight arrays are C-contiguous numpy arrays
  held by the ColdFFN (``self.w_up`` etc.); treat them as read-only while the object is in use.
- Runtime block (int64[8], process-wide, never freed): the spin lock word, the ``sched_yield`` address, the thread
  caps the handler uses for one-token and for masked many-token calls (``set_num_threads`` sets both), and an
  execution counter.
- Rules: (1) keep the ColdFFN alive until every result computed from it is ready; a jitted function that closes
  over it keeps it alive, but an executable can outlive the Python object (e.g. results still being computed
  asynchronously after ``del``). (2) ``close()`` (also run by ``__del__``) takes the lock, marks the header dead
  and drops the weights; any later execution of an executable that references it fails with "ColdFFN was closed"
  instead of reading freed memory, because the header itself is never freed (so header addresses are never
  reused within a process, and an executable can never silently reach another ColdFFN). (3) Don't mutate the
  weight arrays in place while computations that use them may be in flight.

Concurrency: Numba's workqueue layer forbids concurrent parallel launches, and XLA may run independent custom calls
on several threads, so every handler execution holds a process-wide spin lock (yielding with ``sched_yield``).
``cold_ffn_locked`` lets Python code call the kernel under the same lock.
"""
from __future__ import annotations

import itertools
import os
from typing import Sequence

import numpy as np

from pjinfer import activations

from . import ffi, kernels
from .ffi import (BUF_DATA, BUF_DTYPE, CF_ARGS, CF_NARGS, CF_NRETS, CF_RETS, DT_F32, DT_PRED, DT_S32,
                  ERRC_FAILED_PRECONDITION, ERRC_INVALID_ARGUMENT, ERRC_OUT_OF_RANGE, NOJIT, R_BATCH_THREADS,
                  R_EXECUTES, R_THREADS, RUNTIME as _RUNTIME, RUNTIME_ADDR as _RUNTIME_ADDR, buffer_numel, cstr,
                  last_dim, load_i32, load_i64, lock, make_error, ptr_f32, ptr_i8, ptr_i32, ptr_u8,
                  store_i64, unlock)
from .kernels import act_code as _act_code

import numba  # noqa: E402  (kernels set the threading layer first)
from numba import carray, cfunc, njit, types  # noqa: E402

TARGET_NAME = "pjinfer_cold_ffn"
WEIGHT_TYPES = ("float32", "int8")


# Header and layer table slots (int64 words).
MAGIC_ALIVE = 0x706A636F6C64_0001  # "pjcold" + 1
MAGIC_DEAD = 0x706A636F6C64_DEAD
H_MAGIC, H_NLAYERS, H_D, H_ACT, H_TABLE, H_RUNTIME, H_ID = range(7)
T_NCOLD, T_GATE, T_UP, T_DOWN, T_BIAS, T_SCALES = range(6)
T_WIDTH = 8

# ---------------------------------------------------------------------------------------------------------------
# The handler.

@njit(**NOJIT)
def _layer_table(header, layer):
    """(n_cold, gate, up, down, bias, scales addresses) of a layer; gate, bias and scales are 0 when absent."""
    table = load_i64(header + 8 * H_TABLE) + 8 * T_WIDTH * layer
    return (load_i64(table + 8 * T_NCOLD), load_i64(table + 8 * T_GATE), load_i64(table + 8 * T_UP),
            load_i64(table + 8 * T_DOWN), load_i64(table + 8 * T_BIAS), load_i64(table + 8 * T_SCALES))


@njit(**NOJIT)
def _extras(c, d, up_p, bias_p, scales_p):
    """b_up [c] or [0], scales [3, c, blocks] or [0, c, blocks] (a non-null pointer stands in for the empty
    arrays)."""
    b_up = carray(ptr_f32(bias_p if bias_p != 0 else up_p), (c if bias_p != 0 else 0,))
    scales = carray(ptr_f32(scales_p if scales_p != 0 else up_p),
                    (3 if scales_p != 0 else 0, c, (d + kernels.QBLOCK - 1) // kernels.QBLOCK))
    return b_up, scales


@njit(**NOJIT)
def _rows_f32(c, d, gate_p, up_p, down_p):
    return (carray(ptr_f32(gate_p if gate_p != 0 else up_p), (c if gate_p != 0 else 0, d)),
            carray(ptr_f32(up_p), (c, d)), carray(ptr_f32(down_p), (c, d)))


@njit(**NOJIT)
def _rows_i8(c, d, gate_p, up_p, down_p):
    return (carray(ptr_i8(gate_p if gate_p != 0 else up_p), (c if gate_p != 0 else 0, d)),
            carray(ptr_i8(up_p), (c, d)), carray(ptr_i8(down_p), (c, d)))


@njit(**NOJIT)
def _run_layer(header, layer, x, ids, count, out, nt):
    c, gate_p, up_p, down_p, bias_p, scales_p = _layer_table(header, layer)
    d = x.shape[0]
    b_up, scales = _extras(c, d, up_p, bias_p, scales_p)
    code = load_i64(header + 8 * H_ACT)
    if scales_p != 0:  # int8 rows
        w_gate, w_up, w_down_t = _rows_i8(c, d, gate_p, up_p, down_p)
        kernels.cold_ffn_nt(x, w_gate, w_up, w_down_t, b_up, scales, ids, count, code, out, nt)
    else:
        w_gate, w_up, w_down_t = _rows_f32(c, d, gate_p, up_p, down_p)
        kernels.cold_ffn_nt(x, w_gate, w_up, w_down_t, b_up, scales, ids, count, code, out, nt)


@njit(**NOJIT)
def _run_layer_masked(header, layer, xs, mask, outs, nt):
    c, gate_p, up_p, down_p, bias_p, scales_p = _layer_table(header, layer)
    d = xs.shape[1]
    b_up, scales = _extras(c, d, up_p, bias_p, scales_p)
    code = load_i64(header + 8 * H_ACT)
    if scales_p != 0:  # int8 rows
        w_gate, w_up, w_down_t = _rows_i8(c, d, gate_p, up_p, down_p)
        kernels.cold_ffn_masked_nt(xs, w_gate, w_up, w_down_t, b_up, scales, mask, code, outs, nt)
    else:
        w_gate, w_up, w_down_t = _rows_f32(c, d, gate_p, up_p, down_p)
        kernels.cold_ffn_masked_nt(xs, w_gate, w_up, w_down_t, b_up, scales, mask, code, outs, nt)


@njit(**NOJIT)
def _header_error(api, header):
    """An XLA_FFI_Error* when `header` is not a live ColdFFN header, else 0."""
    if header == 0:
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr("pjinfer_cold_ffn: missing int64 attribute 'table'"))
    magic = load_i64(header + 8 * H_MAGIC)
    if magic == MAGIC_DEAD:
        return make_error(api, ERRC_FAILED_PRECONDITION,
                           cstr("pjinfer_cold_ffn: the ColdFFN this executable refers to was closed"))
    if magic != MAGIC_ALIVE:
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr("pjinfer_cold_ffn: 'table' is not a ColdFFN header"))
    return 0


@njit(**NOJIT)
def _execute(frame, api):
    # Two call forms, one result f32 [..., d]:
    # - lists: layer i32 [] or [...], x f32 [..., d], ids i32 [..., K], count i32 [...], and optionally a 5th
    #   operand, the result's storage (input_output_aliases, see ColdFFN.__call__'s out_init; its content is
    #   ignored: the result is always overwritten);
    # - masks: layer i32 [], x f32 [N, d], mask pred [N, n_cold(layer)] (ColdFFN.masked).
    nargs = load_i64(frame + CF_NARGS)
    if (nargs != 3 and nargs != 4 and nargs != 5) or load_i64(frame + CF_NRETS) != 1:
        return make_error(api, ERRC_INVALID_ARGUMENT,
                           cstr("pjinfer_cold_ffn: expected 3, 4 or 5 operands and 1 result"))
    header = ffi.find_table(frame)
    err = _header_error(api, header)
    if err != 0:
        return err
    if nargs == 3:
        return _execute_masked(frame, api, header)
    args = load_i64(frame + CF_ARGS)
    b_layer = load_i64(args)
    b_x = load_i64(args + 8)
    b_ids = load_i64(args + 16)
    b_count = load_i64(args + 24)
    b_out = load_i64(load_i64(frame + CF_RETS))
    if (load_i32(b_layer + BUF_DTYPE) != DT_S32 or load_i32(b_x + BUF_DTYPE) != DT_F32
            or load_i32(b_ids + BUF_DTYPE) != DT_S32 or load_i32(b_count + BUF_DTYPE) != DT_S32
            or load_i32(b_out + BUF_DTYPE) != DT_F32):
        return make_error(api, ERRC_INVALID_ARGUMENT,
                           cstr("pjinfer_cold_ffn: dtypes must be (int32, float32, int32, int32) -> float32"))
    if nargs == 5 and load_i64(load_i64(args + 32) + BUF_DATA) != load_i64(b_out + BUF_DATA):
        return make_error(api, ERRC_INVALID_ARGUMENT,
                           cstr("pjinfer_cold_ffn: operand 5 must be aliased to the result"))
    d = load_i64(header + 8 * H_D)
    nb = buffer_numel(b_x, True)
    n_layer = buffer_numel(b_layer, False)
    k = last_dim(b_ids)
    if (last_dim(b_x) != d or last_dim(b_out) != d or buffer_numel(b_out, True) != nb or k < 0
            or buffer_numel(b_ids, True) != nb or buffer_numel(b_count, False) != nb
            or (n_layer != 1 and n_layer != nb)):
        return make_error(api, ERRC_INVALID_ARGUMENT,
                           cstr("pjinfer_cold_ffn: shapes must be x [..., d], ids [..., K], count [...], layer "
                                 "[] or [...], with d equal to the ColdFFN's d_model"))
    n_layers = load_i64(header + 8 * H_NLAYERS)
    layers = carray(ptr_i32(load_i64(b_layer + BUF_DATA)), (n_layer,))
    for b in range(n_layer):
        if layers[b] < 0 or layers[b] >= n_layers:
            return make_error(api, ERRC_OUT_OF_RANGE, cstr("pjinfer_cold_ffn: layer index out of range"))
    xs = carray(ptr_f32(load_i64(b_x + BUF_DATA)), (nb, d))
    outs = carray(ptr_f32(load_i64(b_out + BUF_DATA)), (nb, d))
    idss = carray(ptr_i32(load_i64(b_ids + BUF_DATA)), (nb, k))
    counts = carray(ptr_i32(load_i64(b_count + BUF_DATA)), (nb,))
    runtime = load_i64(header + 8 * H_RUNTIME)
    lock(runtime)
    # Re-check under the lock: close() marks the header dead while holding it.
    if load_i64(header + 8 * H_MAGIC) != MAGIC_ALIVE:
        unlock(runtime)
        return _header_error(api, header)
    nt = load_i64(runtime + 8 * R_THREADS)
    for b in range(nb):
        layer = layers[b] if n_layer == nb else layers[0]
        _run_layer(header, layer, xs[b], idss[b], counts[b], outs[b], nt)
    store_i64(runtime + 8 * R_EXECUTES, load_i64(runtime + 8 * R_EXECUTES) + 1)
    unlock(runtime)
    return 0


@njit(**NOJIT)
def _execute_masked(frame, api, header):
    args = load_i64(frame + CF_ARGS)
    b_layer = load_i64(args)
    b_x = load_i64(args + 8)
    b_mask = load_i64(args + 16)
    b_out = load_i64(load_i64(frame + CF_RETS))
    if (load_i32(b_layer + BUF_DTYPE) != DT_S32 or load_i32(b_x + BUF_DTYPE) != DT_F32
            or load_i32(b_mask + BUF_DTYPE) != DT_PRED or load_i32(b_out + BUF_DTYPE) != DT_F32):
        return make_error(api, ERRC_INVALID_ARGUMENT,
                           cstr("pjinfer_cold_ffn: masked form dtypes must be (int32, float32, bool) -> float32"))
    d = load_i64(header + 8 * H_D)
    nb = buffer_numel(b_x, True)
    if (buffer_numel(b_layer, False) != 1 or last_dim(b_x) != d or last_dim(b_out) != d
            or buffer_numel(b_out, True) != nb or buffer_numel(b_mask, True) != nb):
        return make_error(api, ERRC_INVALID_ARGUMENT,
                           cstr("pjinfer_cold_ffn: masked form shapes must be layer [], x [N, d], mask [N, n_cold]"))
    layer = carray(ptr_i32(load_i64(b_layer + BUF_DATA)), (1,))[0]
    if layer < 0 or layer >= load_i64(header + 8 * H_NLAYERS):
        return make_error(api, ERRC_OUT_OF_RANGE, cstr("pjinfer_cold_ffn: layer index out of range"))
    c = load_i64(load_i64(header + 8 * H_TABLE) + 8 * (T_WIDTH * layer + T_NCOLD))
    if last_dim(b_mask) != c:
        return make_error(api, ERRC_INVALID_ARGUMENT,
                           cstr("pjinfer_cold_ffn: the mask's last dimension must be the layer's cold count"))
    xs = carray(ptr_f32(load_i64(b_x + BUF_DATA)), (nb, d))
    outs = carray(ptr_f32(load_i64(b_out + BUF_DATA)), (nb, d))
    mask = carray(ptr_u8(load_i64(b_mask + BUF_DATA)), (nb, c))
    runtime = load_i64(header + 8 * H_RUNTIME)
    lock(runtime)
    if load_i64(header + 8 * H_MAGIC) != MAGIC_ALIVE:
        unlock(runtime)
        return _header_error(api, header)
    _run_layer_masked(header, layer, xs, mask, outs, load_i64(runtime + 8 * R_BATCH_THREADS))
    store_i64(runtime + 8 * R_EXECUTES, load_i64(runtime + 8 * R_EXECUTES) + 1)
    unlock(runtime)
    return 0




def _default_threads() -> int:
    """PJINFER_COLD_THREADS if set, else 1 on machines with <= 2 Numba threads, else all of them.

    Measured on the 2-vCPU VMs of this project (workqueue layer): through the bridge, 2 threads were 15-40% *slower*
    than 1 for a 30-layer token (waking the second worker costs ~30-100 us per launch here, and XLA's own idle
    threads compete for the second core), so one thread is the default there."""
    n = numba.config.NUMBA_NUM_THREADS
    env = os.environ.get("PJINFER_COLD_THREADS")
    if env:
        return max(1, min(int(env), n))
    return 1 if n <= 2 else n


_RUNTIME[R_THREADS] = _default_threads()
# A many-token call carries milliseconds of work, so waking every Numba thread pays for itself there.
_RUNTIME[R_BATCH_THREADS] = (_default_threads() if os.environ.get("PJINFER_COLD_THREADS")
                             else numba.config.NUMBA_NUM_THREADS)


def _handler_py(frame):
    done, result = ffi.prelude(frame)
    if done:
        return result
    return _execute(frame, load_i64(frame + ffi.CF_API))


ffi.purge_stale_cache("bridge", kernels, ffi)

# XLA_FFI_Error* handler(XLA_FFI_CallFrame*): pointers travel as pointer-sized integers (same registers on LP64).
_handler = cfunc(types.intp(types.intp), nopython=True, cache=True)(_handler_py)


def register() -> None:
    """Register the FFI target with XLA (CPU platform) once per process; called by ColdFFN."""
    ffi.register(TARGET_NAME, _handler)


def set_num_threads(n: int) -> None:
    """Cap the Numba threads the FFI handler uses (1 = serial); at most numba.config.NUMBA_NUM_THREADS.

    Process-wide; the default comes from ``_default_threads`` (env PJINFER_COLD_THREADS)."""
    n = int(n)
    if not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"threads must be in [1, {numba.config.NUMBA_NUM_THREADS}], got {n}")
    _RUNTIME[R_THREADS] = n
    _RUNTIME[R_BATCH_THREADS] = n


def get_num_threads() -> int:
    return int(_RUNTIME[R_THREADS])


def executions() -> int:
    """How many times the handler executed successfully in this process (counted under the lock)."""
    return int(_RUNTIME[R_EXECUTES])


@njit(**NOJIT)
def _locked_call(runtime_addr, x, w_gate, w_up, w_down_t, b_up, scales, ids, count, act_code, out, nt):
    lock(runtime_addr)
    kernels.cold_ffn_nt(x, w_gate, w_up, w_down_t, b_up, scales, ids, count, act_code, out, nt)
    unlock(runtime_addr)


def cold_ffn_locked(x, w_gate, w_up, w_down_t, b_up, scales, ids, count, act_code, out, max_threads=None) -> None:
    """kernels.cold_ffn_nt under the bridge's process-wide lock (safe while jitted code runs the bridge)."""
    nt = get_num_threads() if max_threads is None else int(max_threads)
    _locked_call(_RUNTIME_ADDR, x, w_gate, w_up, w_down_t, b_up, scales, ids, count, act_code, out, nt)


@njit(**NOJIT)
def _retire(runtime_addr, header_addr):
    lock(runtime_addr)
    store_i64(header_addr + 8 * H_MAGIC, MAGIC_DEAD)
    unlock(runtime_addr)


# ---------------------------------------------------------------------------------------------------------------

_HEADERS: list[np.ndarray] = []  # every header ever made; never freed (executables may hold their address)
_ids = itertools.count(1)


def _f32_rows(a, d: int, name: str, layer: int) -> np.ndarray:
    a = np.require(a, np.float32, ["C_CONTIGUOUS", "ALIGNED"])
    if a.ndim != 2 or a.shape[1] != d:
        raise ValueError(f"layer {layer}: {name} must be [n_cold, {d}], got {a.shape}")
    return a


class ColdFFN:
    """Per-layer cold FFN rows in host memory, computed by Numba from inside jit (see the module docstring).

    Args (one entry per layer; row j of every array is cold neuron j of that layer):
      w_up: [C_l, d] float32 arrays.   w_down_t: [C_l, d] (down projection, transposed).
      w_gate: [C_l, d] arrays, or None for activation "relu" (ungated).   b_up: [C_l] arrays or None.
      activation: a name in pjinfer.activations.ACTIVATIONS.
      cold_ids: optional per-layer int arrays: the dense neuron id of each cold row (kept for cold_position).
      weights: "float32" keeps the rows as given; "int8" stores them as int8 with a float32 scale per block of
        64 (kernels.quantize_rows): 17/64 of the bytes to read.
    """

    def __init__(self, w_up: Sequence[np.ndarray], w_down_t: Sequence[np.ndarray],
                 w_gate: Sequence[np.ndarray] | None = None, b_up: Sequence[np.ndarray] | None = None, *,
                 activation: str = "swiglu", cold_ids: Sequence[np.ndarray] | None = None,
                 weights: str = "float32"):
        if weights not in WEIGHT_TYPES:
            raise ValueError(f"weights must be one of {WEIGHT_TYPES}, got {weights!r}")
        code = _act_code(activation)
        gated = activations.get(activation).gated
        n_layers = len(w_up)
        if n_layers == 0 or len(w_down_t) != n_layers:
            raise ValueError("need one w_up and one w_down_t per layer (at least one layer)")
        if gated and (w_gate is None or len(w_gate) != n_layers):
            raise ValueError(f"activation {activation!r} needs one w_gate per layer")
        if not gated and w_gate is not None:
            raise ValueError("activation 'relu' is ungated: pass w_gate=None")
        if b_up is not None and len(b_up) != n_layers:
            raise ValueError("b_up needs one entry per layer")
        d = int(np.shape(w_up[0])[1])
        self.activation, self.d, self.n_layers = activation, d, n_layers
        self.w_up, self.w_down_t = [], []
        self.scales = [] if weights == "int8" else None
        self.w_gate = [] if gated else None
        self.b_up = [] if b_up is not None else None
        table = np.zeros((n_layers, T_WIDTH), np.int64)
        for l in range(n_layers):
            up = _f32_rows(w_up[l], d, "w_up", l)
            c = up.shape[0]
            down = _f32_rows(w_down_t[l], d, "w_down_t", l)
            if down.shape[0] != c:
                raise ValueError(f"layer {l}: w_down_t has {down.shape[0]} rows, w_up {c}")
            gate = None
            if gated:
                gate = _f32_rows(w_gate[l], d, "w_gate", l)
                if gate.shape[0] != c:
                    raise ValueError(f"layer {l}: w_gate has {gate.shape[0]} rows, w_up {c}")
            if weights == "int8":
                scales = np.ones((3, c, -(-d // kernels.QBLOCK)), np.float32)  # gate, up, down
                if gated:
                    gate, scales[0] = kernels.quantize_rows(gate)
                up, scales[1] = kernels.quantize_rows(up)
                down, scales[2] = kernels.quantize_rows(down)
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
                    raise ValueError(f"layer {l}: b_up must be [{c}], got {bias.shape}")
                self.b_up.append(bias)
                table[l, T_BIAS] = bias.ctypes.data
        self.n_cold = [int(c) for c in table[:, T_NCOLD]]
        self.cold_ids = None if cold_ids is None else [np.asarray(c, np.int64) for c in cold_ids]
        self._table = table
        header = np.zeros(8, np.int64)
        header[[H_NLAYERS, H_D, H_ACT, H_TABLE, H_RUNTIME, H_ID]] = [
            n_layers, d, code, table.ctypes.data, _RUNTIME_ADDR, next(_ids)]
        header[H_MAGIC] = MAGIC_ALIVE
        _HEADERS.append(header)
        self._header = header
        self.address = int(header.ctypes.data)
        self.table = ffi.register_table(self.address)  # the value of the 'table' attribute (ffi.TABLES)
        self.closed = False
        register()

    @classmethod
    def from_dense(cls, w_up, w_down_t, cold_ids, w_gate=None, b_up=None, *, activation="swiglu",
                   weights="float32") -> "ColdFFN":
        """Compact the cold rows out of dense per-layer weights: cold row j of layer l = dense row cold_ids[l][j]."""
        pick = lambda ws, l: None if ws is None else np.ascontiguousarray(np.asarray(ws[l])[cold_ids[l]], np.float32)
        n = len(w_up)
        return cls([pick(w_up, l) for l in range(n)], [pick(w_down_t, l) for l in range(n)],
                   None if w_gate is None else [pick(w_gate, l) for l in range(n)],
                   None if b_up is None else [pick(b_up, l) for l in range(n)],
                   activation=activation, cold_ids=[np.asarray(c) for c in cold_ids], weights=weights)

    def cold_position(self, layer: int, d_ff: int | None = None) -> np.ndarray:
        """int32 [d_ff]: compacted cold row of each dense neuron of a layer, -1 where the neuron is not cold."""
        if self.cold_ids is None:
            raise ValueError("this ColdFFN was built without cold_ids")
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
        import jax
        import jax.numpy as jnp

        if self.closed:
            raise RuntimeError("ColdFFN is closed")
        if isinstance(layer, (int, np.integer)) and not 0 <= int(layer) < self.n_layers:
            raise ValueError(f"layer {int(layer)} out of range [0, {self.n_layers})")
        layer = jnp.asarray(layer, jnp.int32)
        x = jnp.asarray(x, jnp.float32)
        ids = jnp.asarray(ids, jnp.int32)
        count = jnp.asarray(count, jnp.int32)
        if x.ndim < 1 or x.shape[-1] != self.d:
            raise ValueError(f"x must be [..., {self.d}], got {x.shape}")
        batch = x.shape[:-1]
        if ids.ndim != x.ndim or ids.shape[:-1] != batch:
            raise ValueError(f"ids must be [{', '.join(map(str, batch + ('K',)))}], got {ids.shape}")
        if count.shape != batch:
            raise ValueError(f"count must have shape {batch}, got {count.shape}")
        if layer.shape not in ((), batch):
            raise ValueError(f"layer must be a scalar or have shape {batch}, got {layer.shape}")
        result = jax.ShapeDtypeStruct(x.shape, jnp.float32)
        if out_init is None:
            call = jax.ffi.ffi_call(TARGET_NAME, result, vmap_method="broadcast_all")
            return call(layer, x, ids, count, table=np.int64(self.table))
        out_init = jnp.asarray(out_init, jnp.float32)
        if out_init.shape != x.shape:
            raise ValueError(f"out_init must have shape {x.shape}, got {out_init.shape}")
        call = jax.ffi.ffi_call(TARGET_NAME, result, vmap_method="broadcast_all", input_output_aliases={4: 0})
        return call(layer, x, ids, count, out_init, table=np.int64(self.table))

    def masked(self, layer, x, mask):
        """y f32 [N, d]: token b's sum over the cold rows n of `layer` with mask[b, n] (bool [N, n_cold(layer)])."""
        import jax
        import jax.numpy as jnp

        if self.closed:
            raise RuntimeError("ColdFFN is closed")
        if not isinstance(layer, (int, np.integer)) or not 0 <= int(layer) < self.n_layers:
            raise ValueError(f"layer must be a Python int in [0, {self.n_layers}), got {layer!r}")
        x = jnp.asarray(x, jnp.float32)
        mask = jnp.asarray(mask, bool)
        if x.ndim != 2 or x.shape[1] != self.d:
            raise ValueError(f"x must be [N, {self.d}], got {x.shape}")
        if mask.shape != (x.shape[0], self.n_cold[int(layer)]):
            raise ValueError(f"mask must be [{x.shape[0]}, {self.n_cold[int(layer)]}], got {mask.shape}")
        call = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct(x.shape, jnp.float32))
        return call(jnp.asarray(layer, jnp.int32), x, mask, table=np.int64(self.table))

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
        _retire(_RUNTIME_ADDR, self.address)
        self.closed = True
        self.w_up = self.w_down_t = self.w_gate = self.b_up = self.scales = None
        self._table = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
