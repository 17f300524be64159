"""One tensor-parallel shard's decode step on the host: the ``pjinfer_shard_decode`` target.

A shard is a process's slice of a Llama-family model, split Megatron-style (pjinfer.runtime.tensor_parallel
makes the slices): its q, k and v rows for a set of whole key/value heads, o's columns for the same heads, gate and
up rows for a set of neurons, down's columns for the same neurons, and a range of the output head's rows. Its
partial outputs are summed across the shards between the calls, in XLA (a psum), so a layer is two calls:

    attention form: (layer i32 [], pos i32 [], x f32 [d], k f16 [..., S, KV, hd], v like k)
                     -> (o f32 [d], k, v), k and v aliased to operands 3 and 4:
                     o = this shard's Wo of its heads' attention of rmsnorm(x) * attn_norm (host_decode's
                     attention_output); x is the whole residual, the caches hold this shard's heads;
    FFN form:        (layer i32 [], x f32 [d]) -> f32 [d]: this shard's Wdown act(Wgate h, Wup h) for h =
                     rmsnorm(x) * ffn_norm, x the residual after the attention's sum;
    head form:       (hidden f32 [d]) -> logits f32 [vocab of the shard]: its rows of the head (host_decode's).

The kernels, the header, the layer table and the team are host_decode's: a ShardDecoder is a HostDecoder of the
shard's own config (its heads, neurons and vocabulary rows), with this target's handler. With one shard the forms
compute what host_decode's layer computes, in the same order: x + o, then x + the FFN's output.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import activation, attention, blocks, decoder, ffi, host_decode as hd, int8, kernels, q4, quants, tables, team
from . import vector_ir
from .ffi import (BUF_DATA, BUF_DTYPE, CF_ARGS, CF_NARGS, CF_NRETS, CF_RETS, DT_F32, DT_S32, ERRC_INVALID_ARGUMENT,
                  ERRC_OUT_OF_RANGE, NOJIT, buffer_numel, cstr, load_i32, load_i64, lock, make_error, ptr_i32, unlock)
from .host_decode import H_D, H_MAGIC, H_NLAYERS, H_RUNTIME

from numba import carray, njit  # noqa: E402

from .cfuncs import HANDLER, DeferredCFunc  # noqa: E402

TARGET_NAME = "pjinfer_shard_decode"
MAGIC = 0x706A73686172_0001  # "pjshar" + 1

ffi.purge_stale_cache("shard_decode", activation, attention, blocks, ffi, hd, int8, kernels, q4, quants, tables, team,
                      vector_ir)


@njit(**NOJIT)
def _ffn_operands(api, args, rets, header):
    """The FFN form's operands checked: (error or 0, layer, x's address, the output's address)."""
    b_layer, b_x, r_out = load_i64(args), load_i64(args + 8), load_i64(rets)
    d = load_i64(header + 8 * H_D)
    if (load_i32(b_layer + BUF_DTYPE) != DT_S32 or buffer_numel(b_layer, False) != 1
            or load_i32(b_x + BUF_DTYPE) != DT_F32 or buffer_numel(b_x, False) != d
            or load_i32(r_out + BUF_DTYPE) != DT_F32 or buffer_numel(r_out, False) != d):
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr("shard decode: FFN form is (int32 [], f32 [d]) -> "
                                                           "f32 [d]")), 0, 0, 0
    layer = carray(ptr_i32(load_i64(b_layer + BUF_DATA)), (1,))[0]
    if layer < 0 or layer >= load_i64(header + 8 * H_NLAYERS):
        return make_error(api, ERRC_OUT_OF_RANGE, cstr("shard decode: layer index out of range")), 0, 0, 0
    return 0, layer, load_i64(b_x + BUF_DATA), load_i64(r_out + BUF_DATA)


@njit(**NOJIT)
def _copy(src, dst):
    for j in range(dst.shape[0]):
        dst[j] = src[j]


@njit(**NOJIT)
def _execute(frame, api):
    header = tables.find_table(frame)
    if header == 0 or load_i64(header + 8 * H_MAGIC) != MAGIC:
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr("pjinfer_shard_decode: 'table' is not a ShardDecoder"))
    nargs, nrets = load_i64(frame + CF_NARGS), load_i64(frame + CF_NRETS)
    args, rets = load_i64(frame + CF_ARGS), load_i64(frame + CF_RETS)
    d = load_i64(header + 8 * H_D)
    layer, pos, k_ptr, v_ptr = 0, 0, 0, 0
    if nargs == 1 and nrets == 1:
        err, x_ptr, out_ptr = hd.head_operands(api, args, rets, header)
    elif nargs == 5 and nrets == 3:
        err, layer, pos, out_ptr, k_ptr, v_ptr = hd.layer_operands(api, args, rets, header)  # x copied to out
        x_ptr = out_ptr
    elif nargs == 2 and nrets == 1:
        err, layer, x_ptr, out_ptr = _ffn_operands(api, args, rets, header)
    else:
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr("pjinfer_shard_decode: expected 5 operands and 3 "
                                                           "results, 2 and 1, or 1 and 1"))
    if err != 0:
        return err
    lock(load_i64(header + 8 * H_RUNTIME))
    env = team.enter()
    x, out = hd.f32_view(x_ptr, d), hd.f32_view(out_ptr, d)
    if nargs == 1:
        hd.run_head(header, x, out_ptr)
    elif nargs == 5:
        _copy(hd.attention_output(header, layer, pos, x, k_ptr, v_ptr), out)
    else:
        hd.ffn_input(header, layer, x)
        _copy(hd.ffn_output(header, layer), out)
    team.leave(env)
    unlock(load_i64(header + 8 * H_RUNTIME))
    return 0


def _handler_py(frame):
    return ffi.serve(frame, _execute)


_handler = DeferredCFunc(HANDLER, _handler_py)


class ShardDecoder(decoder.HostDecoder):
    """A shard's decode step on the host (see the module docstring). config: the shard's own ModelConfig (its
    n_heads, n_kv_heads, d_ff and vocab_size); weights: its slices as HostDecoder takes them; fmt a host format.
    ``attention(...)``, ``ffn(...)`` and ``head(...)`` are the three forms, called inside jit."""

    target, magic, handler = TARGET_NAME, MAGIC, _handler

    def attention(self, layer: int, x, pos, k_cache, v_cache):
        """(this shard's attention output, shaped as x, the caches with position pos written): HostDecoder.layer's
        call, whose form this target answers with the attention's output instead of the updated x."""
        return self.layer(layer, x, pos, k_cache, v_cache)

    def ffn(self, layer: int, x):
        """This shard's FFN output [d] for the residual x [d]."""
        d = self.config.d_model
        call = jax.ffi.ffi_call(self.target, jax.ShapeDtypeStruct((d,), jnp.float32))
        return call(jnp.int32(layer), x.reshape(d).astype(jnp.float32), table=np.int64(self.table))
