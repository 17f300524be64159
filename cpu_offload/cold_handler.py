"""The FFI handlers behind cpu_offload.bridge.ColdFFN: the XLA FFI targets ``pjinfer_cold_ffn`` (float32 rows) and
``pjinfer_cold_ffn_int8`` (int8 rows), Numba cfuncs. Each is compiled with its own row type's kernels only and
loaded when the first ColdFFN of that type is built (``register``), so a process compiles what it runs.

Operands: layer int32 [] or [...], x float32 [..., d], ids int32 [..., K], count int32 [...], and optionally the
result's storage aliased to it; or (the masked form) layer int32 [], x float32 [N, d], mask bool [N, n_cold]. One
float32 result shaped like x. One attribute, ``table``: the address of a ColdFFN header (int64[8]: magic,
n_layers, d, activation code, layer table address, runtime block address, instance id, 1 for int8 rows else 0);
the layer table holds, per layer, the cold row count and the addresses of w_gate, w_up, w_down_t, b_up and the
int8 scales (0 where absent). Every violation (counts, dtypes, shapes, layer range, a closed or foreign header, a
header of the other row type) returns an XLA_FFI_Error naming it. Executions hold the process-wide lock of
cpu_offload.ffi.
"""
from __future__ import annotations

import os

from .contract import ConfigError

from . import activation, ffi, kernels, tables, vector_ir
from .ffi import (BUF_DATA, BUF_DTYPE, CF_ARGS, CF_NARGS, CF_NRETS, CF_RETS, DT_F32, DT_PRED, DT_S32,
                  ERRC_FAILED_PRECONDITION, ERRC_INVALID_ARGUMENT, ERRC_OUT_OF_RANGE, NOJIT, R_BATCH_THREADS,
                  R_EXECUTES, R_THREADS, RUNTIME as _RUNTIME, RUNTIME_ADDR as _RUNTIME_ADDR, buffer_numel, cstr,
                  last_dim, load_i32, load_i64, lock, make_error, ptr_f32, ptr_i8, ptr_i32, ptr_u8,
                  store_i64, unlock)

import numba  # noqa: E402  (kernels set the threading layer first)
from numba import carray, njit  # noqa: E402

from .cfuncs import HANDLER, DeferredCFunc  # noqa: E402

# Header and layer table slots (int64 words).
MAGIC_ALIVE = 0x706A636F6C64_0001  # "pjcold" + 1
MAGIC_DEAD = 0x706A636F6C64_DEAD
H_MAGIC, H_NLAYERS, H_D, H_ACT, H_TABLE, H_RUNTIME, H_ID, H_INT8 = range(8)
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


# `int8` is None in the float32 rows' handler and 1 in the int8 rows' one. Numba drops a branch on `int8 is None`
# before it types a function, so each handler compiles its own row type's kernels only (a branch on a value would
# compile both).

@njit(**NOJIT)
def _layer(header, layer, d, int8):
    """(w_gate, w_up, w_down_t, b_up, scales, activation code) of a layer as the kernels take them: w_gate [0, d],
    b_up [0] and scales [0, c, blocks] where absent (a non-null pointer stands in for the empty arrays)."""
    c, gate_p, up_p, down_p, bias_p, scales_p = _layer_table(header, layer)
    b_up = carray(ptr_f32(bias_p if bias_p != 0 else up_p), (c if bias_p != 0 else 0,))
    scales = carray(ptr_f32(scales_p if scales_p != 0 else up_p),
                    (3 if scales_p != 0 else 0, c, (d + kernels.QBLOCK - 1) // kernels.QBLOCK))
    gate_p, n_gate = (gate_p, c) if gate_p != 0 else (up_p, 0)
    code = load_i64(header + 8 * H_ACT)
    if int8 is None:
        return (carray(ptr_f32(gate_p), (n_gate, d)), carray(ptr_f32(up_p), (c, d)), carray(ptr_f32(down_p), (c, d)),
                b_up, scales, code)
    return (carray(ptr_i8(gate_p), (n_gate, d)), carray(ptr_i8(up_p), (c, d)), carray(ptr_i8(down_p), (c, d)),
            b_up, scales, code)


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
def _rows_error(api, header, int8):
    """An XLA_FFI_Error* when the ColdFFN's rows are not this handler's type, else 0."""
    if int8 is None:
        if load_i64(header + 8 * H_INT8) != 0:
            return make_error(api, ERRC_INVALID_ARGUMENT,
                               cstr("pjinfer_cold_ffn: this ColdFFN's rows are int8: call pjinfer_cold_ffn_int8"))
    elif load_i64(header + 8 * H_INT8) != 1:
        return make_error(api, ERRC_INVALID_ARGUMENT,
                           cstr("pjinfer_cold_ffn_int8: this ColdFFN's rows are float32: call pjinfer_cold_ffn"))
    return 0


@njit(**NOJIT)
def _execute(frame, api, int8):
    # Two call forms, one result f32 [..., d]:
    # - lists: layer i32 [] or [...], x f32 [..., d], ids i32 [..., K], count i32 [...], and optionally a 5th
    #   operand, the result's storage (input_output_aliases, see ColdFFN.__call__'s out_init; its content is
    #   ignored: the result is always overwritten);
    # - masks: layer i32 [], x f32 [N, d], mask pred [N, n_cold(layer)] (ColdFFN.masked).
    nargs = load_i64(frame + CF_NARGS)
    if (nargs != 3 and nargs != 4 and nargs != 5) or load_i64(frame + CF_NRETS) != 1:
        return make_error(api, ERRC_INVALID_ARGUMENT,
                           cstr("pjinfer_cold_ffn: expected 3, 4 or 5 operands and 1 result"))
    header = tables.find_table(frame)
    err = _header_error(api, header)
    if err == 0:
        err = _rows_error(api, header, int8)
    if err != 0:
        return err
    if nargs == 3:
        return _execute_masked(frame, api, header, int8)
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
        w_gate, w_up, w_down_t, b_up, scales, code = _layer(header, layer, d, int8)
        kernels.cold_ffn_nt(xs[b], w_gate, w_up, w_down_t, b_up, scales, idss[b], counts[b], code, outs[b], nt)
    store_i64(runtime + 8 * R_EXECUTES, load_i64(runtime + 8 * R_EXECUTES) + 1)
    unlock(runtime)
    return 0


@njit(**NOJIT)
def _execute_masked(frame, api, header, int8):
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
    w_gate, w_up, w_down_t, b_up, scales, code = _layer(header, layer, d, int8)
    kernels.cold_ffn_masked_nt(xs, w_gate, w_up, w_down_t, b_up, scales, mask, code, outs,
                               load_i64(runtime + 8 * R_BATCH_THREADS))
    store_i64(runtime + 8 * R_EXECUTES, load_i64(runtime + 8 * R_EXECUTES) + 1)
    unlock(runtime)
    return 0




def _default_threads() -> int:
    """PJINFER_COLD_THREADS if set, else 1 on machines with <= 2 Numba threads, else all of them.

    On 2-vCPU machines (workqueue layer) 2 threads were *slower* than 1 through the bridge: waking the second
    worker costs more per launch than it saves, and XLA's own idle threads compete for the second core
    (docs/performance.md, "Measurements behind the code's choices"), so one thread is the default there."""
    n = numba.config.NUMBA_NUM_THREADS
    env = os.environ.get("PJINFER_COLD_THREADS")
    if env:
        return max(1, min(int(env), n))
    return 1 if n <= 2 else n


_RUNTIME[R_THREADS] = _default_threads()
# A many-token call carries milliseconds of work, so waking every Numba thread pays for itself there.
_RUNTIME[R_BATCH_THREADS] = (_default_threads() if os.environ.get("PJINFER_COLD_THREADS")
                             else numba.config.NUMBA_NUM_THREADS)


@njit(**NOJIT)
def _execute_f32(frame, api):
    return _execute(frame, api, None)


@njit(**NOJIT)
def _execute_int8(frame, api):
    return _execute(frame, api, 1)


def _handler_py(frame):
    return ffi.serve(frame, _execute_f32)


def _handler_int8_py(frame):
    return ffi.serve(frame, _execute_int8)


ffi.purge_stale_cache("cold_handler", activation, kernels, ffi, tables, vector_ir)

# XLA_FFI_Error* handler(XLA_FFI_CallFrame*): pointers travel as pointer-sized integers (same registers on LP64).
_handler = DeferredCFunc(HANDLER, _handler_py)
_handler_int8 = DeferredCFunc(HANDLER, _handler_int8_py)
_TARGETS = {False: ("pjinfer_cold_ffn", _handler), True: ("pjinfer_cold_ffn_int8", _handler_int8)}   # by int8 rows


def register(int8_rows: bool) -> str:
    """Register the FFI target of float32 or int8 rows with XLA (CPU platform) once per process, its handler
    loaded or compiled then; returns the target's name. Called by ColdFFN."""
    name, handler = _TARGETS[bool(int8_rows)]
    ffi.register(name, handler)
    return name


def set_num_threads(n: int) -> None:
    """Cap the Numba threads the FFI handler uses (1 = serial); at most numba.config.NUMBA_NUM_THREADS.

    Process-wide; the default comes from ``_default_threads`` (env PJINFER_COLD_THREADS)."""
    n = int(n)
    if not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise ConfigError(f"threads must be in [1, {numba.config.NUMBA_NUM_THREADS}], got {n}")
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
def retire(runtime_addr, header_addr):
    """Mark a ColdFFN header dead, under the lock: executions that still refer to it then fail cleanly."""
    lock(runtime_addr)
    store_i64(header_addr + 8 * H_MAGIC, MAGIC_DEAD)
    unlock(runtime_addr)


