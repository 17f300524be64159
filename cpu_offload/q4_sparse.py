"""The GGUF's own Q4_1 blocks, re-laid by input column in row tiles, and the kernel that reads only the active
inputs' nibbles.

A Q4_1 matrix W [out, in] (q4.py: blocks of 32 inputs per row, W[r, i] = d[r, b] q[r, i] + m[r, b], b = i // 32)
is kept with the same numbers (``relayout``), its rows in tiles of TILE_GROUPS groups of 32 (128 rows; the last
tile holds the remaining groups when out is not a multiple of 128):

    nib  uint8 [in * out / 2], 64-byte aligned: tile after tile; tile t (its G groups, rows 128 t ..) at byte
         64 t in, holding per input column 16 G contiguous bytes, per group 16 (low nibbles rows 0..15, high
         nibbles rows 16..31). A full tile's column is one cache line.
    d, m uint16 [in / 32, out]: the blocks' float16 scales and minimums (their bits: Numba has no float16 on the
         CPU), one row per block of 32 inputs

Then, with a_b = sum over active i in block b of x_i q[:, i] and s_b = sum over active i in b of x_i,

    y = sum over blocks b with an active input of d[b] * a_b + m[b] * s_b

which reads the nibbles of the active inputs only, plus the scales of the blocks that have one: the exact
model of the file (no second quantization), in the same 0.625 bytes a weight.

The kernel (``matvec``; ``_tile1`` .. ``_tile4`` are its LLVM vector IR, one per group count): for one row tile,
the tile's outputs stay in registers over all blocks; per block with an active input, two accumulators per 16
rows (low and high nibbles) stay in registers over the block's active inputs, and the block's scales are applied
once at its end. Per input and 32 rows: the 16 bytes widened to 32-bit lanes once, the high nibbles a shift and
a conversion, the low nibbles one vpermps of the floats 0..15 (AVX-512; else a mask and a conversion: the same
values), two FMAs. The nibbles are exact small integers, so the sums are those of the file's numbers (no
cancellation, unlike summing x_i c and subtracting 16 times the high sums). Float operations keep the order the
IR states (``vector_ir.strict``). Threads split the row tiles (``tile_share``): no partial sums. The tile's column
of the input PREFETCH_AHEAD active inputs ahead is prefetched.
"""
from __future__ import annotations

import numpy as np

from .contract import ConfigError

from ._numba import JIT  # (first: the threading layer and the BLAS check, before numba is imported)

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import ffi, q4, vector_ir  # noqa: E402
from .q4 import BLOCK, BLOCK_BYTES  # noqa: E402
from .qtensor import aligned_empty  # noqa: E402
from .vector_ir import F32, I32, I64, V16F, ZERO16, load, splat, strict, vector_intrinsic  # noqa: E402

ffi.purge_stale_cache("q4_sparse", q4, vector_ir)

TILE_GROUPS = 4                   # groups of 32 rows per tile: 8 output and 8 block accumulators of 16 floats
TILE_ROWS = TILE_GROUPS * BLOCK   # 128
PREFETCH_AHEAD = 8                # active inputs ahead whose column of the tile is prefetched
LINE = 64                         # bytes of a full tile's column
_V16H = ir.VectorType(ir.HalfType(), 16)


def relayout(blocks: np.ndarray, out: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The Q4_1 blocks of W [out, cols] -> (nib uint8 [cols * out / 2], d [cols / 32, out], m [cols / 32, out]:
    float16 bits as uint16), the same numbers in row tiles by input column (module docstring). out and cols
    multiples of 32."""
    if out % BLOCK or cols % BLOCK:
        raise ConfigError(f"Q4_1 columns need rows and columns in multiples of {BLOCK}, got {out} x {cols}")
    b = np.ascontiguousarray(blocks).reshape(out, cols // BLOCK, BLOCK_BYTES)
    d = np.ascontiguousarray(np.ascontiguousarray(b[..., 0:2]).view(np.uint16)[..., 0].T)
    m = np.ascontiguousarray(np.ascontiguousarray(b[..., 2:4]).view(np.uint16)[..., 0].T)
    q = np.concatenate([b[..., 4:] & 15, b[..., 4:] >> 4], -1).reshape(out, cols)   # [out, cols] nibbles
    qt = q.T.reshape(cols, out // BLOCK, BLOCK)                                       # column, row group, row
    groups = (qt[..., :16] | (qt[..., 16:] << 4)).astype(np.uint8)                   # [cols, out / 32, 16]
    nib = aligned_empty(cols * out // 2, np.uint8)
    nib[:] = np.concatenate([groups[:, g:g + TILE_GROUPS].reshape(-1)
                             for g in range(0, out // BLOCK, TILE_GROUPS)])
    return nib, d, m


def dequantize(nib: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """What relayout's arrays stand for, as W [out, cols] float32."""
    cols, out = d.shape[0] * BLOCK, d.shape[1]
    tiles = []
    for g in range(0, out // BLOCK, TILE_GROUPS):
        n = min(TILE_GROUPS, out // BLOCK - g)
        tiles.append(nib[g * 16 * cols:(g + n) * 16 * cols].reshape(cols, n, 16))
    grp = np.concatenate(tiles, 1)                                                    # [cols, out / 32, 16]
    q = np.concatenate([grp & 15, grp >> 4], -1).reshape(cols, out).astype(np.float32)
    blk = np.arange(cols) // BLOCK
    f32 = lambda a: a.view(np.float16).astype(np.float32)
    return np.ascontiguousarray((q * f32(d)[blk] + f32(m)[blk]).T)


def _emit_prefetch(builder, col, stride, idx, k, last):
    """IR: prefetch the tile's column of active input idx[min(k, last)] (its first line)."""
    k = builder.select(builder.icmp_signed("<", k, last), k, last)
    i = builder.sext(load(builder, builder.add(idx, builder.mul(k, I64(4))), I32, 4), I64)
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]),
                                        "llvm.prefetch.p0")
    builder.call(fn, [builder.inttoptr(builder.add(col, builder.mul(i, stride)), i8p), I32(0), I32(3), I32(1)])


def _emit_block_inputs(builder, col, stride, idx, k0, k1, x, acc_lo, acc_hi, sx, last, permute):
    """IR: for the active inputs idx[k0:k1] (one block), acc_lo[g] += x_i q_lo and acc_hi[g] += x_i q_hi over the
    tile's groups (the column's nibbles, ``q4.emit_nibbles``), sx += x_i; returns the block's index."""
    fma = vector_intrinsic(builder, "llvm.fma", 3)
    for a in (*acc_lo, *acc_hi):
        builder.store(ZERO16, a)
    builder.store(ir.Constant(F32, 0.0), sx)
    with cgutils.for_range(builder, builder.sub(k1, k0)) as loop:
        i = builder.sext(load(builder, builder.add(idx, builder.mul(builder.add(k0, loop.index), I64(4))), I32, 4),
                         I64)
        xi = load(builder, builder.add(x, builder.mul(i, I64(4))), F32, 4)
        builder.store(strict(builder.fadd(builder.load(sx), xi)), sx)
        xv = splat(builder, xi)
        p = builder.add(col, builder.mul(i, stride))
        if PREFETCH_AHEAD:
            ahead = builder.add(k0, builder.add(loop.index, I64(PREFETCH_AHEAD)))
            _emit_prefetch(builder, col, stride, idx, ahead, last)
        for g in range(len(acc_lo)):
            q_lo, q_hi = q4.emit_nibbles(builder, builder.add(p, I64(16 * g)), permute)
            builder.store(builder.call(fma, [q_lo, xv, builder.load(acc_lo[g])]), acc_lo[g])
            builder.store(builder.call(fma, [q_hi, xv, builder.load(acc_hi[g])]), acc_hi[g])
    first = load(builder, builder.add(idx, builder.mul(k0, I64(4))), I32, 4)
    return builder.sext(builder.ashr(first, I32(5)), I64)


def _emit_tile(builder, groups, permute, col, idx, seg, nseg, x, d, m, d_stride, y):
    """IR for one row tile of ``groups`` groups: y[:32 groups] = the tile's rows of W x over the blocks of
    seg[:nseg + 1] (see ``segments``); col the tile's first column, d and m its first scales."""
    fma = vector_intrinsic(builder, "llvm.fma", 3)
    ys = [cgutils.alloca_once_value(builder, ZERO16) for _ in range(2 * groups)]
    acc_lo = [cgutils.alloca_once(builder, V16F) for _ in range(groups)]
    acc_hi = [cgutils.alloca_once(builder, V16F) for _ in range(groups)]
    sx = cgutils.alloca_once(builder, F32)
    last = builder.sub(builder.sext(load(builder, builder.add(seg, builder.mul(nseg, I64(4))), I32, 4), I64), I64(1))
    with cgutils.for_range(builder, nseg) as loop:
        s = builder.add(seg, builder.mul(loop.index, I64(4)))
        k0 = builder.sext(load(builder, s, I32, 4), I64)
        k1 = builder.sext(load(builder, builder.add(s, I64(4)), I32, 4), I64)
        b = _emit_block_inputs(builder, col, I64(16 * groups), idx, k0, k1, x, acc_lo, acc_hi, sx, last, permute)
        sv = splat(builder, builder.load(sx))
        db, mb = (builder.add(a, builder.mul(b, d_stride)) for a in (d, m))
        for g in range(groups):
            for h, a in enumerate((builder.load(acc_lo[g]), builder.load(acc_hi[g]))):
                off = I64(64 * g + 32 * h)   # 16 float16 scales of the group's half
                dv = builder.fpext(load(builder, builder.add(db, off), _V16H, 2), V16F)
                mv = builder.fpext(load(builder, builder.add(mb, off), _V16H, 2), V16F)
                t = builder.call(fma, [mv, sv, builder.load(ys[2 * g + h])])
                builder.store(builder.call(fma, [dv, a, t]), ys[2 * g + h])
    for j, acc in enumerate(ys):
        builder.store(builder.load(acc), builder.inttoptr(builder.add(y, I64(64 * j)), V16F.as_pointer()), align=4)


def _make_tile(groups: int, permute: bool):
    """The intrinsic of one row tile of ``groups`` groups (``_emit_tile``; ``permute``: AVX-512's vpermps for the low
    nibbles, else a mask and a conversion: the same bits). Integer addresses, no bounds checks: the caller owns
    the shapes."""

    @intrinsic
    def tile(typingctx, col, idx, seg, nseg, x, d, m, d_stride, y):
        if not all(isinstance(a, types.Integer) for a in (col, idx, seg, nseg, x, d, m, d_stride, y)):
            return None

        def codegen(context, builder, sig, args):
            _emit_tile(builder, groups, permute, *args)
            return context.get_dummy_value()
        return types.void(*[types.int64] * 9), codegen
    return tile


_tile1, _tile2, _tile3, _tile4 = (_make_tile(g, q4.PERMUTE) for g in range(1, TILE_GROUPS + 1))


@njit(**JIT)
def active(x, threshold, idx):
    """idx[:n] <- the i with |x[i]| > threshold, in increasing order; returns n. A threshold of 0 keeps every
    non-zero."""
    n = 0
    for i in range(x.shape[0]):
        if abs(x[i]) > threshold:
            idx[n] = i
            n += 1
    return n


@njit(**JIT)
def segments(idx, n, seg):
    """Split idx[:n] (increasing, from ``active``) by block of 32 inputs: seg[s] is the first k of the s-th block
    with an active input, seg[nseg] = n; returns nseg. seg needs room for in / 32 + 1 entries."""
    nseg = 0
    k = 0
    while k < n:
        seg[nseg] = k
        nseg += 1
        end = (idx[k] // BLOCK + 1) * BLOCK
        while k < n and idx[k] < end:
            k += 1
    seg[nseg] = n
    return nseg


@njit(**JIT)
def tile_share(out, tid, n):
    """Thread tid's row tiles [t0, t1) of n shares of W's out rows, cut at the tile boundaries nearest equal
    numbers of groups."""
    groups = out // BLOCK
    tiles = (groups + TILE_GROUPS - 1) // TILE_GROUPS
    t0 = min(tiles, (groups * tid + 2 * n) // (TILE_GROUPS * n))
    t1 = tiles if tid == n - 1 else min(tiles, (groups * (tid + 1) + 2 * n) // (TILE_GROUPS * n))
    return t0, t1


@njit(**JIT)
def matvec(nib, d, m, idx, seg, nseg, x, y, t0, t1):
    """y[rows of tiles t0..t1) = those rows of W x over the active inputs: idx (from ``active``) and seg[:nseg + 1]
    (from ``segments``) select them; W is relayout's (nib, d, m [cols / 32, out]). Writes every row of those
    tiles, reads the nibbles of active inputs and the scales of blocks with one only. idx entries must lie in
    [0, cols); they are not checked."""
    cols, out = d.shape[0] * BLOCK, d.shape[1]
    groups = out // BLOCK
    ia, sa, xa = idx.ctypes.data, seg.ctypes.data, x.ctypes.data
    for t in range(t0, t1):
        g = min(TILE_GROUPS, groups - TILE_GROUPS * t)
        col = nib.ctypes.data + t * LINE * cols
        r0 = TILE_ROWS * t
        da, ma, ya = d.ctypes.data + 2 * r0, m.ctypes.data + 2 * r0, y.ctypes.data + 4 * r0
        if g == 4:
            _tile4(col, ia, sa, nseg, xa, da, ma, d.strides[0], ya)
        elif g == 3:
            _tile3(col, ia, sa, nseg, xa, da, ma, d.strides[0], ya)
        elif g == 2:
            _tile2(col, ia, sa, nseg, xa, da, ma, d.strides[0], ya)
        else:
            _tile1(col, ia, sa, nseg, xa, da, ma, d.strides[0], ya)
