"""Neuron-aware FFN over the hot (accelerator-resident) neurons of one layer, for one decode token.

    y = sum_{k < count} act(w_gate[ids[k]] . x, w_up[ids[k]] . x (+ b_up[ids[k]])) * w_down_t[ids[k]]

Contract: only the rows named by the first ``count`` entries of ``ids`` are read; entries past ``count`` are
padding and never form an address. Every output element is written exactly once, in a fixed order, so the result
is deterministic. ``hot_ffn`` validates, pads ``ids`` to a multiple of the block, picks power-of-two block sizes
and dispatches to ``BACKENDS[backend]`` (Triton-style Pallas today; a Mosaic GPU implementation can register
there with the same arguments). ``interpret=True`` runs on the CPU. Two kernels, not one fused kernel, and the
padding and masking rules that keep them GPU-legal: docs/architecture.md. The second kernel, the down projection,
is pallas_kernels.gather's ``gathered_rows``, the one kernel for "a sum of gathered rows, each scaled".
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from cpu_offload.activation import ACTIVATIONS, GATED, activate  # the activations' one home, shared with the model
from pallas_kernels.gather import (default_block_d, drop_aliased_input, gathered_rows, is_pow2, pad_ids,
                                          split_for, sum_parts)


# ---------------------------------------------------------------------------------------------
# Triton-style backend (also the one that runs in interpret mode on CPU)
# ---------------------------------------------------------------------------------------------

def _act_kernel(count_ref, ids_ref, x_ref, *refs, activation, d, block_k, block_d):
    gated = activation in GATED
    has_bias = activation == "relu"
    if gated:
        wg_ref, wu_ref, act_ref = refs
    elif has_bias:
        wu_ref, bup_ref, act_ref = refs
    else:  # pragma: no cover - "relu" always has a bias (zeros when the caller passes none)
        raise AssertionError(activation)
    count = count_ref[0]
    start = pl.program_id(0) * block_k

    @pl.when(start >= count)
    def _skip():                                   # block entirely past count: no weight traffic
        act_ref[pl.ds(start, block_k)] = jnp.zeros((block_k,), jnp.float32)

    @pl.when(start < count)
    def _compute():
        slots = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        valid = slots < count
        rows = jnp.where(valid, ids_ref[pl.ds(start, block_k)], 0)    # padding never addresses
        rows2 = jnp.broadcast_to(rows[:, None], (block_k, block_d))
        valid2 = jnp.broadcast_to(valid[:, None], (block_k, block_d))

        def chunk(j, carry):
            cols = j * block_d + lax.broadcasted_iota(jnp.int32, (block_d,), 0)
            cmask = cols < d
            xv = plt.load(x_ref.at[pl.ds(j * block_d, block_d)], mask=cmask, other=0.0)
            cols2 = jnp.broadcast_to(cols[None, :], (block_k, block_d))
            m2 = valid2 & (cols2 < d)
            up = carry[0] + jnp.sum(plt.load(wu_ref.at[rows2, cols2], mask=m2, other=0.0)
                                    * xv[None, :], axis=1)
            if not gated:
                return (up,)
            gate = carry[1] + jnp.sum(plt.load(wg_ref.at[rows2, cols2], mask=m2, other=0.0)
                                      * xv[None, :], axis=1)
            return (up, gate)

        zeros = jnp.zeros((block_k,), jnp.float32)
        n_chunks = pl.cdiv(d, block_d)
        carry = lax.fori_loop(0, n_chunks, chunk, (zeros, zeros) if gated else (zeros,))
        up = carry[0]
        gate = carry[1] if gated else None
        if has_bias:
            up = up + plt.load(bup_ref.at[rows], mask=valid, other=0.0)
        act = jnp.where(valid, activate(activation, gate, up), 0.0)
        act_ref[pl.ds(start, block_k)] = act


def hot_ffn_triton(x, w_gate, w_up, w_down_t, ids_p, count_1, b_up, *, activation, block_k,
                   block_d, n_split, interpret, poison=False, return_parts=False):
    """Backend: the two Triton-style kernels. Arguments already validated and padded by hot_ffn:
    ids_p [Kp] int32 with Kp % block_k == 0, count_1 [1] int32 in [0, K], b_up [H] or None.
    poison=True hands both kernels NaN-filled output buffers (aliased in place), so any element a
    kernel fails to write shows up as NaN; return_parts=True also returns (act, partials)."""
    d = x.shape[0]
    kp = ids_p.shape[0]
    n_kb = kp // block_k
    gated = activation in GATED
    params = None if interpret else plt.CompilerParams(num_warps=4, num_stages=2)

    act_shape = jax.ShapeDtypeStruct((kp,), jnp.float32)
    if gated:
        weights = (w_gate, w_up)
    else:
        weights = (w_up, b_up if b_up is not None else jnp.zeros((w_up.shape[0],), jnp.float32))
    act_args = (count_1, ids_p, x, *weights)
    aliases = {}
    if poison:
        act_args = act_args + (jnp.full((kp,), jnp.nan, jnp.float32),)
        aliases = {len(act_args) - 1: 0}
    act_kernel = functools.partial(_act_kernel, activation=activation, d=d, block_k=block_k,
                                   block_d=block_d)
    if poison:
        act_kernel = drop_aliased_input(act_kernel)
    act = pl.pallas_call(act_kernel, out_shape=act_shape, grid=(n_kb,),
                         input_output_aliases=aliases, interpret=interpret,
                         compiler_params=params, name="hot_ffn_act")(*act_args)

    parts = gathered_rows(count_1, ids_p, act, w_down_t, block_k=block_k, block_d=block_d, n_split=n_split,
                          interpret=interpret, poison=poison, name="hot_ffn_down")
    y = sum_parts(parts)
    return (y, act, parts) if return_parts else y


BACKENDS = {"triton": hot_ffn_triton}


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

def _prepare(x, w_gate, w_up, w_down_t, ids, count, activation, b_up, block_k, block_d):
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {tuple(ACTIVATIONS)}")
    if x.ndim != 1:
        raise ValueError(f"x must be [d] (one decode token), got shape {x.shape}")
    d = x.shape[0]
    H = w_up.shape[0]
    mats = (w_up, w_down_t) + ((w_gate,) if activation in GATED else ())
    for w in mats:
        if w.shape != (H, d):
            raise ValueError(f"weights must be [H, d] = {(H, d)}, got {w.shape}")
    for a in (x,) + mats + ((b_up,) if b_up is not None else ()):
        if a.dtype != jnp.float32:
            raise TypeError(f"hot_ffn works in float32, got {a.dtype}")
    if b_up is not None and b_up.shape != (H,):
        raise ValueError(f"b_up must be [H] = {(H,)}, got {b_up.shape}")
    ids_p, count_1, block_k = pad_ids(ids, count, block_k)
    block_d = default_block_d(d) if block_d is None else block_d
    if not is_pow2(block_d):
        raise ValueError(f"block_d must be a power of two, got {block_d}")
    return ids_p, count_1, block_k, block_d


@functools.partial(jax.jit, static_argnames=("activation", "block_k", "block_d", "interpret",
                                             "n_split", "backend"))
def hot_ffn(x, w_gate, w_up, w_down_t, ids, count, *, activation: str, b_up=None,
            block_k: int = 32, block_d: int | None = None, interpret: bool = False,
            n_split: int | None = None, backend: str = "triton"):
    """y [d] = sum_{k < count} act_k * w_down_t[ids[k]] over the predicted-active hot neurons.

    x [d] f32; w_gate / w_up / w_down_t [H, d] f32 (w_gate unused and may be None for "relu");
    ids [K] int32, first ``count`` entries valid, the rest ignored (any value); count int32 scalar
    (may be traced), 0 <= count <= K. b_up [H] only for "relu" (zeros if None). block_k, block_d:
    powers of two (block_d defaults to a d-dependent choice, see default_block_d). n_split:
    down-projection programs per column tile (default: gather.default_n_split).
    """
    ids_p, count_1, block_k, block_d = _prepare(x, w_gate, w_up, w_down_t, ids, count, activation,
                                                b_up, block_k, block_d)
    n_split = split_for(x.shape[0], ids_p.shape[0], block_k, block_d, n_split)
    return BACKENDS[backend](x, w_gate, w_up, w_down_t, ids_p, count_1,
                             b_up if activation == "relu" else None, activation=activation,
                             block_k=block_k, block_d=block_d, n_split=n_split,
                             interpret=interpret)


def hot_ffn_reference(x, w_gate, w_up, w_down_t, ids, count, *, activation: str, b_up=None,
                      block_k: int = 32, block_d: int | None = None, interpret: bool = False,
                      n_split: int | None = None, backend: str = "triton"):
    """Plain jnp: gather the rows of ids (padding slots -> row 0, masked to zero), same result as
    hot_ffn. The block/backend arguments are accepted and ignored so the two are interchangeable."""
    del block_k, block_d, interpret, n_split, backend
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {tuple(ACTIVATIONS)}")
    K = ids.shape[0]
    valid = jnp.arange(K) < jnp.asarray(count, jnp.int32)
    rows = jnp.where(valid, ids.astype(jnp.int32), 0)
    hp = lax.Precision.HIGHEST
    up = jnp.dot(w_up[rows], x, precision=hp)
    if activation == "relu" and b_up is not None:
        up = up + b_up[rows]
    gate = jnp.dot(w_gate[rows], x, precision=hp) if activation in GATED else None
    act = jnp.where(valid, activate(activation, gate, up), 0.0)
    return jnp.dot(act, w_down_t[rows], precision=hp)
