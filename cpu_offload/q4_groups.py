"""The dots of Q4_1x16 (cpu_offload.blocks.group_rows: a model's Q4_1 layer matrices relaid for the dense host decode,
16 rows interleaved), 16 rows at a time, against q8_input's rounded input; q8_dot.gemv_rounded and q8_dot.gemm send
the type here.

Each dot4 takes one lane of four inputs, broadcast, against those four elements of all 16 rows, so its 16 int32
lanes are the 16 rows' products; the lane's FINE p_codes + p_residues times the lane's dx go into one float
accumulator per block, which is then scaled by the block's 16 d (one vector) and the m terms added (the 16 m times
the block's two group sums). The same x^ and the same per-lane products as a Q4_1 row's (q8_dot), summed in another
order, with fewer vector instructions a weight (no per-run scale vectors, no horizontal sums), from the same bytes.
A token's operations do not depend on how many share the pass, so the GEMM is its GEMV's bit for bit.
"""
from __future__ import annotations

from ._numba import JIT  # (first: the threading layer and the BLAS check, before numba is imported)

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import blocks, ffi, kernels, q8_input, vector_ir  # noqa: E402
from .blocks import Q4_1X16  # noqa: E402
from .contract import ConfigError  # noqa: E402
from .kernels import ahead_into_l2, prefetch_lines  # noqa: E402
from .vector_ir import F32, I32, I64, V16F, V64I8, ZERO16, dot4, i8s, ints, load, splat  # noqa: E402

ffi.purge_stale_cache("q4_groups", kernels, blocks, vector_ir, q8_input)

ROWS = blocks.TYPES[Q4_1X16].group   # rows a dot reads at once; a row range is a multiple of it
BLOCK = blocks.TYPES[Q4_1X16].block
TOKENS = 4                           # tokens a pass of gemm reads a group for
assert q8_input.FINE == 256          # _emit_group scales the codes' products by a shift of 8


def _at(b, addr, ty):
    """The 32-bit value at addr (a float32, or four int8 as an i32) in 16 lanes: one broadcast load."""
    return splat(b, load(b, addr, ty, 1))


def _emit_group(b, p, nb, inputs, outs):
    """The dots of the 16 rows of the Q4_1x16 group at address p (nb blocks; layout in blocks.py) with each input
    ((codes, residues, dx4, sums): quantize_input's arrays' addresses), the 16 floats stored at the matching address
    of outs. Per block: its 16 d and 16 m as vectors; per lane l of four inputs (a chunk's low or high nibbles: lane
    c or c + 4 of the block), FINE (w . codes) + w . residues for the 16 rows by two dot4 against the lane's inputs
    broadcast, times the lane's dx, summed over the block's 8 lanes; then acc += m sums_g (the block's two groups)
    and acc += that sum times d. Each input takes the same operations whatever the others."""
    fma = vector_ir.vector_intrinsic(b, "llvm.fma", 3)
    accs = [cgutils.alloca_once_value(b, ZERO16) for _ in inputs]
    shift = ints(8)   # FINE = 2^8
    halves = ir.VectorType(ir.HalfType(), 16)
    with cgutils.for_range(b, nb) as loop:
        bp = b.add(p, b.mul(loop.index, I64(320)))
        e0 = b.mul(loop.index, I64(32))
        d = b.fpext(load(b, bp, halves, 2), V16F)
        m = b.fpext(load(b, b.add(bp, I64(32)), halves, 2), V16F)
        parts = [ZERO16] * len(inputs)
        for c in range(4):
            raw = load(b, b.add(bp, I64(64 + 64 * c)), V64I8, 1)
            for w, lane in ((b.and_(raw, i8s(15, 64)), c), (b.lshr(raw, i8s(4, 64)), c + 4)):
                e = b.add(e0, I64(4 * lane))
                for t, (codes, residues, dx4, _) in enumerate(inputs):
                    pc = dot4(b, w, b.bitcast(_at(b, b.add(codes, e), I32), V64I8))
                    pr = dot4(b, w, b.bitcast(_at(b, b.add(residues, e), I32), V64I8), b.shl(pc, shift))
                    parts[t] = b.call(fma, [b.sitofp(pr, V16F), _at(b, b.add(dx4, e), F32), parts[t]])
        for t, (_, _, _, sums) in enumerate(inputs):
            g = b.add(sums, b.mul(loop.index, I64(8)))     # the block's two sums of 16 inputs
            acc = b.call(fma, [m, _at(b, g, F32), b.load(accs[t])])
            acc = b.call(fma, [m, _at(b, b.add(g, I64(4)), F32), acc])
            b.store(b.call(fma, [parts[t], d, acc]), accs[t])
    for acc, out in zip(accs, outs):
        b.store(b.load(acc), vector_ir.pointer(b, out, V16F), align=4)


@intrinsic
def _group_dots(typingctx, k, p, nb, codes, residues, dx4, sums, cols, y, y_stride):
    """An intrinsic: the dots of the Q4_1x16 group at address p (nb blocks) with k (1..TOKENS) inputs, token t's
    arrays at row t of quantize_into's [tokens, ...] arrays for inputs of cols elements (as q8_dot.gemm's); token t's
    16 results are stored at y + t y_stride bytes."""
    if not all(isinstance(a, types.Integer) for a in (k, p, nb, codes, residues, dx4, sums, cols, y, y_stride)):
        return None

    def codegen(context, builder, sig, args):
        k, p, nb, codes, residues, dx4, sums, cols, y, y_stride = args

        def emit(n):
            at = lambda base, t, per=1: builder.add(base, builder.mul(builder.udiv(cols, I64(per)), I64(t)))  # noqa
            inputs = [(at(codes, t), at(residues, t), at(dx4, t), at(sums, t, 4)) for t in range(n)]
            _emit_group(builder, p, nb, inputs, [builder.add(y, builder.mul(y_stride, I64(t))) for t in range(n)])
        vector_ir.by_value(builder, k, range(1, TOKENS + 1), emit)
        return context.get_dummy_value()
    return types.void(*[types.int64] * 10), codegen


@njit(**JIT)
def _check_rows(lo, hi):
    if lo % ROWS or hi % ROWS:
        raise ConfigError("Q4_1x16 rows are read in whole groups of 16")


@njit(**JIT)
def gemv(q, xr, y, lo, hi):
    """y[r] = row r of the Q4_1x16 matrix q (uint8 [rows, row bytes]) dotted with the rounded input xr
    (q8_input.quantize_input), for r in [lo, hi), multiples of ROWS (else ConfigError); a group a dot, the next
    group prefetched."""
    _check_rows(lo, hi)
    codes, residues, dx4, sums, lane_sums = xr
    cols = codes.shape[0]
    nb = cols // BLOCK
    base = q.ctypes.data
    into_l2 = ahead_into_l2(3 * cols + sums.nbytes + lane_sums.nbytes, q.shape[1], ROWS)
    for r in range(lo, min(hi, lo + ROWS)):
        prefetch_lines(q, r, into_l2)
    for r in range(lo, hi, ROWS):
        for a in range(r + ROWS, min(hi, r + 2 * ROWS)):
            prefetch_lines(q, a, into_l2)
        _group_dots(1, base + r * q.strides[0], nb, codes.ctypes.data, residues.ctypes.data, dx4.ctypes.data,
                    sums.ctypes.data, cols, y.ctypes.data + 4 * r, 0)


@njit(**JIT)
def gemm(q, codes, residues, dx4, sums, y, nt, lo, hi):
    """y[t, r] = gemv's y[r] for token t's rounded input (row t of q8_input.quantize_into's [tokens, ...] arrays),
    bit for bit, for t < nt and r in [lo, hi), multiples of ROWS (else ConfigError): each group read once for up to
    TOKENS tokens."""
    _check_rows(lo, hi)
    cols = codes.shape[1]
    nb = cols // BLOCK
    base = q.ctypes.data
    into_l2 = ahead_into_l2(min(nt, TOKENS) * 4 * cols, q.shape[1], ROWS)
    for r in range(lo, hi, ROWS):
        for a in range(r + ROWS, min(hi, r + 2 * ROWS)):
            prefetch_lines(q, a, into_l2)
        for g in range(0, nt, TOKENS):
            _group_dots(min(TOKENS, nt - g), base + r * q.strides[0], nb, codes[g].ctypes.data,
                        residues[g].ctypes.data, dx4[g].ctypes.data, sums[g].ctypes.data, cols,
                        y.ctypes.data + g * y.strides[0] + 4 * r, y.strides[0])
