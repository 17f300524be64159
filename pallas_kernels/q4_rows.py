"""The hot FFN and the dense matrix-vector product over 4-bit weights (ggml's Q4_0 and Q4_1 blocks), for one
decode token: the float32 kernels of hot_ffn.py and gather.py with the weights dequantized in registers.

A matrix W [H, d] (d a multiple of 32) is held as its file's blocks split into three planes (``Q4Planes``), so a
program's loads of a row chunk are contiguous in each:

    qs      uint8 [H, d / 2]     block b of row r (32 weights) = bytes qs[r, 16b : 16b + 16]
    scale   float16 [H, d / 32]
    minimum float16 [H, d / 32]
    W[r, 32b + j] = scale[r, b] * q + minimum[r, b],  q = qs[r, 16b + j] & 15 (j < 16), qs[r, 16b + j - 16] >> 4

That is ggml's Q4_1 block (f16 d, f16 m, 16 bytes of nibbles: element j low, element j + 16 high) exactly; a Q4_0
block (f16 d, W = d (q - 8)) has minimum = -8 d, exact in float16 for |d| <= 8188 (``planes_from_blocks`` refuses
any other). Byte column c of a row therefore holds weights 32 (c // 16) + c % 16 (low nibble) and that + 16 (high),
both under scale and minimum c // 16: the kernels take x as x_lo, x_hi [d / 2] (``split_x``) and work on byte
columns throughout.

    q4_hot_ffn:  y = sum_{k < count} act(gate[ids[k]] . x, up[ids[k]] . x) * down_t[ids[k]]     (gated activations)
    q4_matvec:   y = W x, every row (attention, the output head); impl="xla" is the same product as one XLA
                 expression (the faster of the two on an H100).

Contract (as hot_ffn's and gather_matvec's): ids [K] int32, the first ``count`` entries valid (each < H), the rest
padding of any value that never forms an address; count an int32 scalar, possibly traced, clipped to [0, K]. Only
the rows named by ids[:count] are read (their bytes, scales and minimums). Every element of a kernel's output is
written exactly once; the down projection writes partial sums [2, n_split, d / 2] (low and high nibbles' columns,
one row per program) added in a fixed order and interleaved back to [d] afterwards, so results are deterministic.
Blocks are powers of two, edges are masked loads, the grids are static and no float32 copy of the weights is made,
so the kernels stay legal for Triton's GPU lowering; ``interpret=True`` runs them on the CPU.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from cpu_offload.activation import ACTIVATIONS, GATED, activate
from cpu_offload.blocks import Q4_0, Q4_1, TYPES
from pallas_kernels.gather import drop_aliased_input, is_pow2, next_pow2, pad_ids, split_for, sum_parts

QK = TYPES[Q4_1].block          # weights per block (32, Q4_0's too)
HALF = QK // 2                  # bytes of nibbles per block: byte column c is in block c // HALF
Q4_0_MAX_SCALE = 8188.0         # the largest |d| whose -8 d is a finite float16
# Default blocks: the fastest of `python -m pallas_kernels.bench --shapes 7b --sweep-q4` on an H100 (16 slots or
# rows a program, 256 byte columns = 512 weights a chunk; docs/performance.md).
DEFAULT_BLOCK_K = DEFAULT_BLOCK_R = 16
DEFAULT_BLOCK_C = 256


class Q4Planes(NamedTuple):
    """A matrix [H, d] of 4-bit blocks as three planes (module docstring)."""
    qs: object        # uint8 [H, d // 2]
    scale: object     # float16 [H, d // 32]
    minimum: object   # float16 [H, d // 32]


# ---------------------------------------------------------------------------------------------
# Host side (numpy): from the file's blocks, and the reference values
# ---------------------------------------------------------------------------------------------

def planes_from_blocks(data: np.ndarray, code: int) -> Q4Planes:
    """uint8 [H, row_bytes] of ggml blocks of type code (Q4_0 or Q4_1) -> Q4Planes (numpy arrays)."""
    if code not in (Q4_0, Q4_1):
        raise ValueError(f"planes hold Q4_0 ({Q4_0}) or Q4_1 ({Q4_1}) blocks, not ggml type {code}")
    data = np.asarray(data)
    t = TYPES[code]
    if data.dtype != np.uint8:
        raise TypeError(f"{t.name} blocks must be uint8, got {data.dtype}")
    if data.ndim != 2 or data.shape[1] % t.nbytes:
        raise ValueError(f"{t.name} blocks must be [H, a multiple of {t.nbytes} bytes], got {data.shape}")
    H, nb = data.shape[0], data.shape[1] // t.nbytes
    b = data.reshape(H, nb, t.nbytes)
    f16 = lambda off: np.ascontiguousarray(b[..., off:off + 2]).view(np.float16)[..., 0]
    qs = np.ascontiguousarray(b[..., t.nbytes - HALF:]).reshape(H, nb * HALF)   # the nibbles end every block
    scale = f16(0)
    if code == Q4_1:
        minimum = f16(2)
    else:
        if not (np.abs(scale.astype(np.float32)) <= Q4_0_MAX_SCALE).all():
            raise ValueError(f"Q4_0 scales must be finite with |d| <= {Q4_0_MAX_SCALE:g} (so that -8 d is a "
                             f"float16), got up to {np.abs(scale.astype(np.float32)).max()}")
        minimum = (-8 * scale.astype(np.float32)).astype(np.float16)                  # exact: a power of two
    return Q4Planes(qs, scale, minimum)


def dequantize(p: Q4Planes, xp=np):
    """The values the planes stand for [H, d]: float64 with numpy (the tests' reference), float32 with jax.numpy
    (inside a jitted function: a many-token product over the rows)."""
    qs = xp.asarray(p.qs)
    H, nb = qs.shape[0], qs.shape[1] // HALF
    dtype = np.float64 if xp is np else jnp.float32
    q = qs.reshape(H, nb, HALF).astype(xp.int32)
    q = xp.concatenate([q & 15, q >> 4], axis=-1).astype(dtype)                          # [H, nb, 32]
    s, m = (xp.asarray(a).astype(dtype)[..., None] for a in (p.scale, p.minimum))
    return (s * q + m).reshape(H, nb * QK)


# ---------------------------------------------------------------------------------------------
# Kernels (Triton-style Pallas; also what runs in interpret mode on CPU)
# ---------------------------------------------------------------------------------------------

def _weights(qs_ref, scale_ref, min_ref, rows2, cols2, mask2):
    """The weights of byte columns cols2 of rows rows2 [block_k, block_c], dequantized in registers: (low nibbles',
    high nibbles'), zero where mask2 is False (nothing there is read)."""
    q = plt.load(qs_ref.at[rows2, cols2], mask=mask2, other=0).astype(jnp.int32)
    blk = lax.div(cols2, HALF)
    s = plt.load(scale_ref.at[rows2, blk], mask=mask2, other=0.0).astype(jnp.float32)
    m = plt.load(min_ref.at[rows2, blk], mask=mask2, other=0.0).astype(jnp.float32)
    return s * (q & 15).astype(jnp.float32) + m, s * (q >> 4).astype(jnp.float32) + m


def _row_dots(xlo_ref, xhi_ref, mats, rows, valid, *, n_c, block_c):
    """For each matrix of mats (a (qs, scale, minimum) triple of refs): the dots [block_k] of its rows `rows`
    (valid ones; the others give 0 and are not read) with x, over byte-column chunks of block_c."""
    block_k = rows.shape[0]
    rows2 = jnp.broadcast_to(rows[:, None], (block_k, block_c))
    valid2 = jnp.broadcast_to(valid[:, None], (block_k, block_c))

    def chunk(j, accs):
        cols = j * block_c + lax.broadcasted_iota(jnp.int32, (block_c,), 0)
        cmask = cols < n_c
        xlo = plt.load(xlo_ref.at[pl.ds(j * block_c, block_c)], mask=cmask, other=0.0)
        xhi = plt.load(xhi_ref.at[pl.ds(j * block_c, block_c)], mask=cmask, other=0.0)
        cols2 = jnp.broadcast_to(cols[None, :], (block_k, block_c))
        m2 = valid2 & (cols2 < n_c)
        out = []
        for acc, refs in zip(accs, mats):
            lo, hi = _weights(*refs, rows2, cols2, m2)
            out.append(acc + jnp.sum(lo * xlo[None, :] + hi * xhi[None, :], axis=1))
        return tuple(out)

    zeros = tuple(jnp.zeros((block_k,), jnp.float32) for _ in mats)
    return lax.fori_loop(0, pl.cdiv(n_c, block_c), chunk, zeros)


def _act_kernel(count_ref, ids_ref, xlo_ref, xhi_ref, gq, gs, gm, uq, us, um, act_ref, *, activation, n_c,
                block_k, block_c):
    """Program i: act [block_k] of slots i*block_k.. (0 past count; a block wholly past count reads nothing)."""
    count = count_ref[0]
    start = pl.program_id(0) * block_k

    @pl.when(start >= count)
    def _skip():
        act_ref[pl.ds(start, block_k)] = jnp.zeros((block_k,), jnp.float32)

    @pl.when(start < count)
    def _compute():
        valid = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0) < count
        rows = jnp.where(valid, ids_ref[pl.ds(start, block_k)], 0)    # padding never addresses
        gate, up = _row_dots(xlo_ref, xhi_ref, ((gq, gs, gm), (uq, us, um)), rows, valid, n_c=n_c,
                             block_c=block_c)
        act_ref[pl.ds(start, block_k)] = jnp.where(valid, activate(activation, gate, up), 0.0)


def _down_kernel(count_ref, ids_ref, a_ref, qs_ref, scale_ref, min_ref, part_ref, *, n_c, block_k, block_c,
                 n_split):
    """Program (t, s): byte-column tile t, slot blocks s, s + n_split, ... below count, into part_ref[0 (low
    nibbles) and 1 (high), s, tile t] (gather._rows_kernel with both nibbles of a byte)."""
    t = pl.program_id(0)
    s = pl.program_id(1)
    count = count_ref[0]
    trips = lax.div(jnp.maximum(lax.div(count + (block_k - 1), block_k) - s, 0) + (n_split - 1), n_split)
    cols = t * block_c + lax.broadcasted_iota(jnp.int32, (block_c,), 0)
    cols2 = jnp.broadcast_to(cols[None, :], (block_k, block_c))

    def block(j, acc):
        start = (s + j * n_split) * block_k
        valid = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0) < count
        rows = jnp.where(valid, ids_ref[pl.ds(start, block_k)], 0)    # padding never addresses
        a = jnp.where(valid, a_ref[pl.ds(start, block_k)], 0.0)
        rows2 = jnp.broadcast_to(rows[:, None], (block_k, block_c))
        m2 = jnp.broadcast_to(valid[:, None], (block_k, block_c)) & (cols2 < n_c)
        lo, hi = _weights(qs_ref, scale_ref, min_ref, rows2, cols2, m2)
        return acc[0] + jnp.sum(a[:, None] * lo, axis=0), acc[1] + jnp.sum(a[:, None] * hi, axis=0)

    zeros = jnp.zeros((block_c,), jnp.float32)
    lo, hi = lax.fori_loop(0, trips, block, (zeros, zeros))
    for half, value in ((0, lo), (1, hi)):   # the plane index as an int32 (interpret mode refuses a Python int)
        plt.store(part_ref.at[jnp.int32(half), s, pl.ds(t * block_c, block_c)], value, mask=cols < n_c)


def _matvec_kernel(xlo_ref, xhi_ref, qs_ref, scale_ref, min_ref, y_ref, *, H, n_c, block_r, block_c):
    """Program i: y [block_r] of rows i*block_r.. (rows past H masked)."""
    rows = pl.program_id(0) * block_r + lax.broadcasted_iota(jnp.int32, (block_r,), 0)
    valid = rows < H
    (y,) = _row_dots(xlo_ref, xhi_ref, ((qs_ref, scale_ref, min_ref),), jnp.where(valid, rows, 0), valid,
                     n_c=n_c, block_c=block_c)
    plt.store(y_ref.at[pl.ds(pl.program_id(0) * block_r, block_r)], y, mask=valid)


def _call(kernel, args, out_shape, grid, *, interpret, poison, name):
    """pallas_call with Triton's parameters; poison=True aliases a NaN-filled buffer to the output, so an element
    the kernel fails to write comes back as NaN."""
    params = None if interpret else plt.CompilerParams(num_warps=4, num_stages=2)
    aliases = {}
    if poison:
        args = args + (jnp.full(out_shape.shape, jnp.nan, out_shape.dtype),)
        aliases = {len(args) - 1: 0}
        kernel = drop_aliased_input(kernel)
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, input_output_aliases=aliases,
                          interpret=interpret, compiler_params=params, name=name)(*args)


def split_x(x):
    """x [d] -> (x_lo, x_hi) [d / 2]: the inputs of byte columns' low and high nibbles."""
    xb = x.reshape(-1, 2, HALF)
    return xb[:, 0].reshape(-1), xb[:, 1].reshape(-1)


def interleave(lo, hi):
    """The inverse of split_x: the outputs of byte columns' low and high nibbles [d / 2] -> y [d]."""
    return jnp.stack([lo.reshape(-1, HALF), hi.reshape(-1, HALF)], axis=1).reshape(-1)


def q4_hot_ffn_triton(x, gate, up, down_t, ids_p, count_1, *, activation, block_k, block_c, n_split, interpret,
                      poison=False, return_parts=False):
    """The two kernels, arguments checked and padded by q4_hot_ffn (ids_p [Kp], Kp % block_k == 0; count_1 [1]);
    return_parts=True also returns (act [Kp], partials [2, n_split, d / 2])."""
    n_c = x.shape[0] // 2
    kp = ids_p.shape[0]
    xlo, xhi = split_x(x)
    act = _call(functools.partial(_act_kernel, activation=activation, n_c=n_c, block_k=block_k, block_c=block_c),
                (count_1, ids_p, xlo, xhi, *gate, *up), jax.ShapeDtypeStruct((kp,), jnp.float32),
                (kp // block_k,), interpret=interpret, poison=poison, name="q4_hot_ffn_act")
    parts = _call(functools.partial(_down_kernel, n_c=n_c, block_k=block_k, block_c=block_c, n_split=n_split),
                  (count_1, ids_p, act, *down_t), jax.ShapeDtypeStruct((2, n_split, n_c), jnp.float32),
                  (pl.cdiv(n_c, block_c), n_split), interpret=interpret, poison=poison, name="q4_hot_ffn_down")
    y = interleave(sum_parts(parts[0]), sum_parts(parts[1]))
    return (y, act, parts) if return_parts else y


def q4_matvec_pallas(x, w, *, block_r, block_c, interpret, poison=False):
    H, n_c = w.qs.shape
    xlo, xhi = split_x(x)
    kernel = functools.partial(_matvec_kernel, H=H, n_c=n_c, block_r=block_r, block_c=block_c)
    return _call(kernel, (xlo, xhi, *w), jax.ShapeDtypeStruct((H,), jnp.float32), (pl.cdiv(H, block_r),),
                 interpret=interpret, poison=poison, name="q4_matvec")


def q4_matvec_xla(x, w):
    """W x as one XLA expression (dequantize and reduce, which XLA fuses). On an H100 it read faster than the
    kernel (docs/performance.md), so the dense products use it."""
    H, n_c = w.qs.shape
    q = w.qs.astype(jnp.int32).reshape(H, n_c // HALF, 1, HALF)
    q = jnp.concatenate([q & 15, q >> 4], axis=2).astype(jnp.float32)                 # [H, nb, 2, 16]
    s, m = (a.astype(jnp.float32)[:, :, None, None] for a in (w.scale, w.minimum))
    return jnp.sum((s * q + m) * x.reshape(1, -1, 2, HALF), axis=(1, 2, 3))


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

def check_planes(p, d: int, H: int | None = None, name: str = "w") -> Q4Planes:
    """p as Q4Planes after checking it holds a matrix [H, d] (any H when None): ValueError for a shape, TypeError
    for a dtype."""
    if not (isinstance(p, tuple) and len(p) == 3):
        raise TypeError(f"{name} must be Q4Planes(qs, scale, minimum), got {type(p).__name__}")
    p = Q4Planes(*p)
    H = p.qs.shape[0] if H is None and getattr(p.qs, "ndim", 0) >= 1 else H
    for field, dtype, shape in (("qs", jnp.uint8, (H, d // 2)), ("scale", jnp.float16, (H, d // QK)),
                                ("minimum", jnp.float16, (H, d // QK))):
        a = getattr(p, field)
        if tuple(a.shape) != shape:
            raise ValueError(f"{name}.{field} must be [H, {'d / 2' if field == 'qs' else 'd / 32'}] = {shape} for "
                             f"d = {d}, got {tuple(a.shape)}")
        if a.dtype != dtype:
            raise TypeError(f"{name}.{field} must be {jnp.dtype(dtype).name}, got {a.dtype}")
    return p


def check_x(x) -> int:
    """d of x [d] float32, d a multiple of 32."""
    if x.ndim != 1:
        raise ValueError(f"x must be [d] (one decode token), got shape {x.shape}")
    if x.shape[0] % QK or x.shape[0] == 0:
        raise ValueError(f"d must be a positive multiple of {QK} (whole 4-bit blocks), got {x.shape[0]}")
    if x.dtype != jnp.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    return x.shape[0]


def block_c_for(d: int, block_d: int | None) -> int:
    """Byte columns per chunk for block_d weights per chunk (block_d a power of two >= 2; by default
    DEFAULT_BLOCK_C, capped at the row's byte columns)."""
    if block_d is None:
        return min(DEFAULT_BLOCK_C, next_pow2(d // 2))
    if not is_pow2(block_d) or block_d < 2:
        raise ValueError(f"block_d must be a power of two >= 2, got {block_d}")
    return block_d // 2


def prepare_ffn(x, gate, up, down_t, ids, count, activation, block_k, block_d):
    """Checks q4_hot_ffn's arguments -> (gate, up, down_t as Q4Planes, ids_p, count_1, block_k, block_c)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {GATED}")
    if activation not in GATED:
        raise ValueError(f"q4_hot_ffn takes a gated activation {GATED}, not {activation!r} (it has no biases)")
    d = check_x(x)
    up = check_planes(up, d, name="up")
    H = up.qs.shape[0]
    gate, down_t = check_planes(gate, d, H, "gate"), check_planes(down_t, d, H, "down_t")
    ids_p, count_1, block_k = pad_ids(ids, count, block_k)
    return gate, up, down_t, ids_p, count_1, block_k, block_c_for(d, block_d)


@functools.partial(jax.jit, static_argnames=("activation", "block_k", "block_d", "interpret", "n_split"))
def q4_hot_ffn(x, gate, up, down_t, ids, count, *, activation: str, block_k: int = DEFAULT_BLOCK_K,
               block_d: int | None = None, interpret: bool = False, n_split: int | None = None):
    """y [d] = sum_{k < count} act(gate[ids[k]] . x, up[ids[k]] . x) * down_t[ids[k]] over 4-bit rows.

    x [d] f32 (d a multiple of 32); gate, up, down_t Q4Planes of [H, d] matrices (down_t row k: neuron k's down
    weights); ids [K] int32 and count as in the module docstring; activation one of cpu_offload.activation's
    gated ones. block_k: slots per block, block_d: weights per column chunk (powers of two); n_split: down
    programs per column tile (default gather.default_n_split). count 0 gives exact zeros."""
    gate, up, down_t, ids_p, count_1, block_k, block_c = prepare_ffn(x, gate, up, down_t, ids, count, activation,
                                                                     block_k, block_d)
    n_split = split_for(x.shape[0] // 2, ids_p.shape[0], block_k, block_c, n_split)
    return q4_hot_ffn_triton(x, gate, up, down_t, ids_p, count_1, activation=activation, block_k=block_k,
                             block_c=block_c, n_split=n_split, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret", "impl", "block_r", "block_d"))
def q4_matvec(x, w, *, interpret: bool = False, impl: str = "pallas", block_r: int = DEFAULT_BLOCK_R,
              block_d: int | None = None):
    """y [H] = W x over every row of the 4-bit matrix w (Q4Planes of [H, d]); x [d] f32. impl "pallas" (the
    kernel: block_r rows per program, block_d weights per chunk, powers of two) or "xla" (q4_matvec_xla)."""
    d = check_x(x)
    w = check_planes(w, d)
    if impl == "xla":
        return q4_matvec_xla(x, w)
    if impl != "pallas":
        raise ValueError(f"impl must be 'pallas' or 'xla', got {impl!r}")
    if not is_pow2(block_r):
        raise ValueError(f"block_r must be a power of two, got {block_r}")
    return q4_matvec_pallas(x, w, block_r=block_r, block_c=block_c_for(d, block_d), interpret=interpret)
