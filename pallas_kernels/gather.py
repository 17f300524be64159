"""Matrix-vector products over a compacted set of active inputs, for one decode token.

    y = sum_{k < count} a[k] * w_t[ids[k]]          (w_t [n_in, n_out] input-major: row i is column i of W)

``gather_matvec`` is the input-sparse product (TEAL): a[k] = x[ids[k]], so y = W @ x with every input outside
ids[:count] taken as zero, and only the rows of w_t named by ids[:count] are read. ``hot_ffn``'s down projection
is the same sum with a[k] the k-th active neuron's activation; both run ``gathered_rows``, one kernel.

Contract (both): ids [K] int32, the first ``count`` entries valid (any order, each < n_in), the rest padding of any
value that never forms an address; count an int32 scalar, possibly traced, clipped to [0, K]. The kernel writes
every element of its output exactly once (partial sums [n_split, n_out], one per program, added afterwards in a
fixed order), so results are deterministic. Blocks are powers of two, n_out is never padded in memory (the last
tile is masked) and the grid is static, so the kernel stays legal for Triton's GPU lowering; ``interpret=True``
runs it on the CPU.

``compact`` turns a mask into (ids, count) in this form; ``active_inputs`` does it for the threshold rule
|x| > t that pjinfer's models apply (pjinfer/runtime/model.py ``sparsify_input``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def default_block_d(d: int) -> int:
    """The power of two in {128, 64, 32} (capped at next_pow2(d)) that wastes the fewest masked
    lanes in the last chunk; ties go to the larger block (fewer loop trips)."""
    cands = sorted({min(b, next_pow2(d)) for b in (128, 64, 32)}, reverse=True)
    return min(cands, key=lambda b: (-(-d // b) * b, -b))


PROGRAMS = 1024   # gathered_rows' target grid size


def default_n_split(n_d_tiles: int, n_k_blocks: int) -> int:
    """Programs per output tile of gathered_rows: enough for about PROGRAMS programs in all (8 per SM of a
    132-SM H100 or H200), at most one per block of slots. One program per tile, as ~128 programs in all gave,
    leaves most of the memory bandwidth unused (`python -m pallas_kernels.bench --sweep`, docs/performance.md)."""
    return max(1, min(n_k_blocks, -(-PROGRAMS // max(1, n_d_tiles))))


def pad_ids(ids, count, block_k: int):
    """ids [K] -> (ids padded with zeros to a multiple of the block [Kp] int32, count as [1] int32 clipped to
    [0, K], the block: block_k capped at next_pow2(K), no block larger than needed)."""
    if ids.ndim != 1:
        raise ValueError(f"ids must be [K], got shape {ids.shape}")
    if not is_pow2(block_k):
        raise ValueError(f"block_k must be a power of two, got {block_k}")
    K = ids.shape[0]
    block_k = min(block_k, next_pow2(max(K, 1)))
    kp = max(1, -(-K // block_k)) * block_k
    ids_p = jnp.pad(ids.astype(jnp.int32), (0, kp - K))
    count_1 = jnp.clip(jnp.asarray(count, jnp.int32), 0, K).reshape(1)
    return ids_p, count_1, block_k


def split_for(n_out: int, kp: int, block_k: int, block_d: int, n_split: int | None) -> int:
    """The n_split gathered_rows runs with: the default (default_n_split) or the asked one, at most one program
    per block of slots."""
    n_kb = kp // block_k
    if n_split is None:
        n_split = default_n_split(pl.cdiv(n_out, block_d), n_kb)
    return max(1, min(int(n_split), n_kb))


# ---------------------------------------------------------------------------------------------
# The kernel (Triton-style Pallas; also what runs in interpret mode on CPU)
# ---------------------------------------------------------------------------------------------

def _rows_kernel(count_ref, ids_ref, a_ref, w_ref, part_ref, *, n_out, block_k, block_d, n_split):
    """Program (t, s): output tile t, slot blocks s, s + n_split, ... below count, into part_ref[s, tile t]."""
    t = pl.program_id(0)
    s = pl.program_id(1)
    count = count_ref[0]
    n_active_blocks = lax.div(count + (block_k - 1), block_k)
    # Blocks s, s + n_split, ... below n_active_blocks: a trip count known only at run time.
    trips = lax.div(jnp.maximum(n_active_blocks - s, 0) + (n_split - 1), n_split)
    cols = t * block_d + lax.broadcasted_iota(jnp.int32, (block_d,), 0)
    cols2 = jnp.broadcast_to(cols[None, :], (block_k, block_d))

    def block(j, acc):
        start = (s + j * n_split) * block_k
        slots = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        valid = slots < count
        rows = jnp.where(valid, ids_ref[pl.ds(start, block_k)], 0)    # padding never addresses
        a = jnp.where(valid, a_ref[pl.ds(start, block_k)], 0.0)
        rows2 = jnp.broadcast_to(rows[:, None], (block_k, block_d))
        m2 = jnp.broadcast_to(valid[:, None], (block_k, block_d)) & (cols2 < n_out)
        w = plt.load(w_ref.at[rows2, cols2], mask=m2, other=0.0)
        return acc + jnp.sum(a[:, None] * w, axis=0)

    acc = lax.fori_loop(0, trips, block, jnp.zeros((block_d,), jnp.float32))
    plt.store(part_ref.at[s, pl.ds(t * block_d, block_d)], acc, mask=cols < n_out)


def drop_aliased_input(kernel):
    """For poisoned runs: the aliased NaN buffer arrives as the last input ref; the kernel only uses the output."""
    def wrapped(*refs):
        *ins, _poison_in, out = refs
        return kernel(*ins, out)
    return wrapped


def gathered_rows(count_1, ids_p, a, w_t, *, block_k: int, block_d: int, n_split: int, interpret: bool,
                  poison: bool = False, name: str = "gathered_rows"):
    """Partial sums [n_split, n_out]: part[s] = sum over the slot blocks s, s + n_split, ... of a[k] * w_t[ids[k]].
    Arguments already checked and padded: count_1 [1] int32 in [0, K], ids_p and a [Kp] with Kp % block_k == 0,
    w_t [n_in, n_out] float32. poison=True hands the kernel a NaN-filled output buffer (aliased in place), so an
    element it fails to write comes back as NaN."""
    n_out = w_t.shape[1]
    grid = (pl.cdiv(n_out, block_d), n_split)
    params = None if interpret else plt.CompilerParams(num_warps=4, num_stages=2)
    args, aliases = (count_1, ids_p, a, w_t), {}
    kernel = functools.partial(_rows_kernel, n_out=n_out, block_k=block_k, block_d=block_d, n_split=n_split)
    if poison:
        args = args + (jnp.full((n_split, n_out), jnp.nan, jnp.float32),)
        aliases = {len(args) - 1: 0}
        kernel = drop_aliased_input(kernel)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n_split, n_out), jnp.float32), grid=grid,
                          input_output_aliases=aliases, interpret=interpret, compiler_params=params,
                          name=name)(*args)


def sum_parts(parts):
    """The partial sums of gathered_rows added in a fixed order."""
    return parts[0] if parts.shape[0] == 1 else jnp.sum(parts, axis=0)


def slot_values(x, ids_p, count_1):
    """a [Kp]: x[ids[k]] for the valid slots, 0 past count (padding never addresses x)."""
    valid = jnp.arange(ids_p.shape[0]) < count_1[0]
    return jnp.where(valid, x[jnp.where(valid, ids_p, 0)], 0.0)


def gather_matvec_triton(x, w_t, ids_p, count_1, *, block_k, block_d, n_split, interpret, poison=False,
                         return_parts=False):
    """Backend: gathered_rows on the slot values of x. Arguments validated and padded by gather_matvec;
    return_parts=True also returns the partial sums (tests check every element was written)."""
    parts = gathered_rows(count_1, ids_p, slot_values(x, ids_p, count_1), w_t, block_k=block_k, block_d=block_d,
                          n_split=n_split, interpret=interpret, poison=poison, name="gather_matvec")
    y = sum_parts(parts)
    return (y, parts) if return_parts else y


BACKENDS = {"triton": gather_matvec_triton}


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

def prepare(x, w_t, ids, count, block_k, block_d):
    """Checks gather_matvec's arguments -> (ids_p, count_1, block_k, block_d) as gathered_rows takes them."""
    if x.ndim != 1:
        raise ValueError(f"x must be [n_in] (one decode token), got shape {x.shape}")
    if w_t.ndim != 2 or w_t.shape[0] != x.shape[0]:
        raise ValueError(f"w_t must be [n_in, n_out] with n_in = {x.shape[0]}, got {w_t.shape}")
    for a in (x, w_t):
        if a.dtype != jnp.float32:
            raise TypeError(f"gather_matvec works in float32, got {a.dtype}")
    ids_p, count_1, block_k = pad_ids(ids, count, block_k)
    block_d = default_block_d(w_t.shape[1]) if block_d is None else block_d
    if not is_pow2(block_d):
        raise ValueError(f"block_d must be a power of two, got {block_d}")
    return ids_p, count_1, block_k, block_d


@functools.partial(jax.jit, static_argnames=("block_k", "block_d", "n_split", "interpret", "backend"))
def gather_matvec(x, w_t, ids, count, *, block_k: int = 32, block_d: int | None = None,
                  n_split: int | None = None, interpret: bool = False, backend: str = "triton"):
    """y [n_out] = sum_{k < count} x[ids[k]] * w_t[ids[k]]: W @ x over the active inputs only.

    x [n_in] f32; w_t [n_in, n_out] f32 (W transposed: a row per input); ids [K] int32 and count as in the module
    docstring (K need not equal n_in). block_k, block_d: powers of two (block_d defaults to default_block_d(n_out));
    n_split: programs per output tile (default: default_n_split). count 0 gives exact zeros."""
    ids_p, count_1, block_k, block_d = prepare(x, w_t, ids, count, block_k, block_d)
    n_split = split_for(w_t.shape[1], ids_p.shape[0], block_k, block_d, n_split)
    return BACKENDS[backend](x, w_t, ids_p, count_1, block_k=block_k, block_d=block_d, n_split=n_split,
                             interpret=interpret)


def gather_matvec_reference(x, w_t, ids, count):
    """Plain jnp, the same sum as gather_matvec: gather the rows of ids (padding slots -> row 0, masked to zero)."""
    valid = jnp.arange(ids.shape[0]) < jnp.asarray(count, jnp.int32)
    rows = jnp.where(valid, ids.astype(jnp.int32), 0)
    a = jnp.where(valid, x[rows], 0.0)
    return jnp.dot(a, w_t[rows], precision=lax.Precision.HIGHEST)


def compact(mask):
    """mask [..., K] bool -> (ids [..., K] int32: the True positions in increasing order, then zeros;
    count [...] int32: how many are True), the (ids, count) form of gather_matvec and hot_ffn."""
    flat = mask.reshape(-1, mask.shape[-1])
    ids = jax.vmap(lambda m: jnp.nonzero(m, size=m.shape[0], fill_value=0)[0])(flat)
    return ids.reshape(mask.shape).astype(jnp.int32), mask.sum(axis=-1).astype(jnp.int32)


def active_inputs(x, threshold=None):
    """compact(|x| > threshold): the inputs the threshold rule keeps (an entry with |x| <= threshold counts as
    zero); threshold None keeps every entry."""
    mask = jnp.ones(x.shape, bool) if threshold is None else jnp.abs(x) > threshold
    return compact(mask)
