"""The Pallas kernels against XLA's dense products on the same arrays: ``python -m pallas_kernels.bench``
(``make bench-pallas``). Compiled kernels need JAX on a GPU; ``--interpret`` runs the same cases in interpret mode
on any machine, to check the command, never to time it.

- gather_matvec: each matrix of a layer (input-major, float32), with a share of its inputs active (the ids a
  threshold leaves, in increasing order), against ``jnp.dot(x, w_t)`` over every row: the product the XLA
  threshold path runs (pjinfer.runtime.gathered.masked_product).
- hot_ffn: a share of the FFN's neurons active, against the dense gate, up and down products.
- q4_hot_ffn (Q4_0 planes, ReGLU) likewise against the dense products through q4_matvec; q4_matvec's Pallas kernel
  against its XLA form.

Each case first checks the kernel against a float64 reference, then runs ``--pairs`` pairs, kernel and dense
alternated, each side timed as ``--calls`` calls inside one jitted loop (no Python dispatch per call). Reported:
the median time per call of each side, the median of the pair ratios (dense time / kernel time) with their range,
and the weight bytes each side reads per second. Before the cases, the device's copy rate (bytes read and written
per second by ``a * 2``) is measured: a rate above it means the timing is wrong.

``--sweep`` times gather_matvec alone at half its inputs active over block_k, block_d and n_split (the choices
gather.default_block_d and gather.default_n_split make), for tuning those defaults.
"""
from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from cpu_offload.blocks import Q4_0
from pallas_kernels import gather, gather_matvec, hot_ffn
from pallas_kernels.q4_rows import dequantize, planes_from_blocks, q4_hot_ffn, q4_matvec

SHAPES = {  # name -> (d, d_ff, q/k/v outputs): Llama-2-7B's layer, SmolLM2-135M's
    "7b": (4096, 11008, 3 * 4096),
    "smollm2": (576, 1536, 576 + 2 * 192),
}
MATVEC_SHARES = (1.0, 0.7, 0.5, 0.3, 0.1)
FFN_SHARES = (1.0, 0.5, 0.2, 0.1)


def copy_rate(calls: int) -> float:
    """Bytes read plus written per second by a jitted ``a * 2`` over 1 GiB of float32 (64 MiB in interpret runs)."""
    n = (1 << 28) if jax.default_backend() == "gpu" else (1 << 24)
    a = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a * 2.0)
    f(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(calls):
        out = f(a)
    out.block_until_ready()
    return 2 * 4 * n * calls / (time.perf_counter() - t)


def looped(fn, calls: int):
    """jit(x, *rest): `calls` applications of fn(x, *rest) in one lax.fori_loop, so that no call pays Python's
    dispatch; each call's x moves by its last output (times 1e-30), so XLA cannot hoist the call out of the loop."""
    def run(x, *rest):
        return jax.lax.fori_loop(0, calls, lambda _, x: x + 1e-30 * fn(x, *rest)[0], x)
    return jax.jit(run)


def timed(fn, args, calls: int) -> float:
    """Seconds per call of `fn` = looped(...) over `calls` calls."""
    t = time.perf_counter()
    fn(*args).block_until_ready()
    return (time.perf_counter() - t) / calls


def pairs(kernel, dense, kernel_args, dense_args, n_pairs: int, calls: int):
    """(median kernel s/call, median dense s/call, pair ratios dense/kernel), the two sides alternated."""
    kernel, dense = looped(kernel, calls), looped(dense, calls)
    kernel(*kernel_args).block_until_ready()
    dense(*dense_args).block_until_ready()
    ks, ds = [], []
    for i in range(n_pairs):
        order = ((kernel, kernel_args, ks), (dense, dense_args, ds))
        for fn, args, out in (order if i % 2 == 0 else order[::-1]):
            out.append(timed(fn, args, calls))
    ratios = np.asarray(ds) / np.asarray(ks)
    return float(np.median(ks)), float(np.median(ds)), ratios


def active_ids(rng, n: int, share: float):
    """ids [n] int32: a random `share` of 0..n-1 in increasing order, then zero padding; and their count."""
    on = np.flatnonzero(rng.random(n) < share) if share < 1 else np.arange(n)
    return np.concatenate([on, np.zeros(n - len(on), np.int64)]).astype(np.int32), len(on)


def check(got, want_f64, bound, what: str) -> None:
    """The kernel's output within `bound` (elementwise) of the float64 reference, else one line and exit 1."""
    err = np.abs(np.asarray(got, np.float64) - want_f64)
    if not (err <= bound + 1e-30).all():
        raise SystemExit(f"pallas_kernels.bench: {what} disagrees with float64 by {err.max():.3g}")


def row(name: str, share: float, read_k: float, read_d: float, tk: float, td: float, ratios) -> str:
    return (f"{name:8s} {share:5.0%} {1e6 * tk:9.1f} {1e6 * td:9.1f}   {np.median(ratios):5.2f}x "
            f"({ratios.min():.2f}-{ratios.max():.2f})  {read_k / tk / 1e9:8.1f} {read_d / td / 1e9:8.1f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="7b", help="whose layer (default: 7b)")
    ap.add_argument("--pairs", type=int, default=7, help="kernel/dense pairs per case (default: 7)")
    ap.add_argument("--calls", type=int, default=50, help="back-to-back calls per timing (default: 50)")
    ap.add_argument("--interpret", action="store_true", help="interpret mode (any machine; checks, not timings)")
    ap.add_argument("--sweep", action="store_true", help="gather_matvec's block sizes and splits, then the cases")
    ap.add_argument("--sweep-q4", action="store_true", help="only q4_hot_ffn's and q4_matvec's block sizes")
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.calls < 1:
        ap.error("--pairs and --calls must be at least 1")

    if not args.interpret and jax.default_backend() != "gpu":
        raise SystemExit(f"pallas_kernels.bench: compiled kernels need a GPU and JAX here runs on "
                         f"{jax.default_backend()}; --interpret checks the command in interpret mode")
    d, f, n_qkv = SHAPES[args.shapes]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.shapes} layer (d {d}, d_ff {f}); "
          f"{args.pairs} pairs x {args.calls} calls{'; interpret mode: not timings' if args.interpret else ''}")
    print(f"copy rate (a * 2, read + written): {copy_rate(args.calls) / 1e9:.0f} GB/s")
    rng = np.random.default_rng(0)
    matrices = {"qkv": (d, n_qkv), "o": (d, d), "gate+up": (d, 2 * f), "down": (f, d)}
    if args.sweep_q4:
        return sweep_q4(d, f, rng, args)
    if args.sweep:
        sweep(matrices, rng, args)
    with tqdm(total=len(matrices) * len(MATVEC_SHARES) + 2 * len(FFN_SHARES) + 1, desc="cases", unit="case") as bar:
        lines = matvec_cases(matrices, rng, args, bar) + ffn_cases(d, f, rng, args, bar) + \
            q4_cases(d, f, rng, args, bar)
    print("matrix  active kernel us  dense us   dense/kernel (range)  kernel GB/s  dense GB/s")
    print("\n".join(lines))


def matvec_cases(matrices, rng, args, bar) -> list[str]:
    """gather_matvec against jnp.dot on each matrix at each of MATVEC_SHARES: a row each."""
    kernel = jax.jit(lambda x, w, ids, c: gather_matvec(x, w, ids, c, interpret=args.interpret))
    dense = jax.jit(jnp.dot)
    lines = []
    for name, (n_in, n_out) in matrices.items():
        w = rng.standard_normal((n_in, n_out), dtype=np.float32) / np.float32(np.sqrt(n_in))
        x = rng.standard_normal(n_in, dtype=np.float32)
        w_d, x_d = jnp.asarray(w), jnp.asarray(x)
        for share in MATVEC_SHARES:
            ids, count = active_ids(rng, n_in, share)
            ids_d, c_d = jnp.asarray(ids), jnp.int32(count)
            rows = ids[:count]
            terms = x[rows, None].astype(np.float64) * w[rows]
            check(kernel(x_d, w_d, ids_d, c_d), terms.sum(0), 2.0 ** -20 * np.abs(terms).sum(0),
                  f"gather_matvec {name}")
            tk, td, ratios = pairs(kernel, dense, (x_d, w_d, ids_d, c_d), (x_d, w_d), args.pairs, args.calls)
            lines.append(row(name, share, 4 * count * n_out, 4 * n_in * n_out, tk, td, ratios))
            bar.update()
    return lines


def ffn_cases(d, f, rng, args, bar) -> list[str]:
    """hot_ffn (SwiGLU) against the dense gate, up and down products at each of FFN_SHARES: a row each."""
    kernel = jax.jit(lambda x, g, u, dn, ids, c: hot_ffn(x, g, u, dn, ids, c, activation="swiglu",
                                                         interpret=args.interpret))
    dense = jax.jit(lambda x, g, u, dn: jnp.dot(jax.nn.silu(g @ x) * (u @ x), dn))
    ws = [rng.standard_normal((f, d), dtype=np.float32) / np.float32(np.sqrt(d)) for _ in range(3)]
    x = rng.standard_normal(d, dtype=np.float32)
    ws_d, x_d = [jnp.asarray(w) for w in ws], jnp.asarray(x)
    lines = []
    for share in FFN_SHARES:
        ids, count = active_ids(rng, f, share)
        ids_d, c_d = jnp.asarray(ids), jnp.int32(count)
        rows = ids[:count]
        g64, u64, dn64 = (np.asarray(w, np.float64)[rows] for w in ws)
        gate, up = g64 @ x, u64 @ x
        want = (gate / (1 + np.exp(-gate)) * up) @ dn64
        # The activations carry the gate/up sums' rounding: a bound relative to the output.
        check(kernel(x_d, *ws_d, ids_d, c_d), want, 1e-4 * np.abs(want).max(), "hot_ffn")
        tk, td, ratios = pairs(kernel, dense, (x_d, *ws_d, ids_d, c_d), (x_d, *ws_d), args.pairs, args.calls)
        lines.append(row("ffn", share, 3 * 4 * count * d, 3 * 4 * f * d, tk, td, ratios))
        bar.update()
    return lines


def q4_planes(rng, rows: int, cols: int):
    """Random Q4_0 weights as q4_rows' planes (uniform nibbles, scales about 1/sqrt(cols)): (device planes, float64)."""
    blocks = np.frombuffer(rng.bytes(rows * cols // 32 * 18), np.uint8).reshape(rows, cols // 32, 18).copy()
    blocks[..., :2] = (rng.uniform(0.5, 1.5, (rows, cols // 32, 1)) / 8 / np.sqrt(cols)).astype(np.float16).view(
        np.uint8)
    p = planes_from_blocks(blocks.reshape(rows, -1), Q4_0)
    return jax.device_put(p), dequantize(p)


def q4_cases(d, f, rng, args, bar) -> list[str]:
    """Q4_0 planes: q4_hot_ffn (ReGLU) at each of FFN_SHARES against the dense gate, up and down through q4_matvec
    (XLA's); then q4_matvec's Pallas kernel against XLA's on the gate's rows. Weight bytes: 0.625 a weight."""
    kernel = jax.jit(lambda x, g, u, dn, ids, c: q4_hot_ffn(x, g, u, dn, ids, c, activation="reglu",
                                                            interpret=args.interpret))
    xla = lambda x, w: q4_matvec(x, w, impl="xla", interpret=args.interpret)
    dense = jax.jit(lambda x, g, u, dn: xla(jax.nn.relu(xla(x, g)) * xla(x, u), dn))
    (g, g64), (u, u64), (dn_t, dn_t64) = (q4_planes(rng, f, d) for _ in range(3))
    dn, _ = q4_planes(rng, d, f)
    x = rng.standard_normal(d, dtype=np.float32)
    x_d = jnp.asarray(x)
    row_bytes = d // 2 + 4 * (d // 32)
    lines = []
    for share in FFN_SHARES:
        ids, count = active_ids(rng, f, share)
        ids_d, c_d = jnp.asarray(ids), jnp.int32(count)
        rows = ids[:count]
        gate, up = g64[rows] @ x, u64[rows] @ x
        want = (np.maximum(gate, 0) * up) @ dn_t64[rows]
        check(kernel(x_d, g, u, dn_t, ids_d, c_d), want, 1e-4 * np.abs(want).max(), "q4_hot_ffn")
        tk, td, ratios = pairs(kernel, dense, (x_d, g, u, dn_t, ids_d, c_d), (x_d, g, u, dn), args.pairs, args.calls)
        lines.append(row("q4 ffn", share, 3 * count * row_bytes, 3 * f * row_bytes, tk, td, ratios))
        bar.update()
    pallas = jax.jit(lambda x, w: q4_matvec(x, w, impl="pallas", interpret=args.interpret))
    check(pallas(x_d, g), g64 @ x, 1e-4 * np.abs(g64 @ x).max(), "q4_matvec")
    tk, td, ratios = pairs(pallas, jax.jit(xla), (x_d, g), (x_d, g), args.pairs, args.calls)
    lines.append(row("q4 gemv", 1.0, f * row_bytes, f * row_bytes, tk, td, ratios) + "  (kernel: Pallas, dense: XLA)")
    bar.update()
    return lines


SWEEP = {"block_k": (16, 32, 64), "block_d": (128, 256), "n_split": (1, 4, 16, 64)}


def sweep(matrices, rng, args) -> None:
    """gather_matvec at half the inputs active, every combination of SWEEP per matrix: us per call (median of
    three looped timings), then each matrix's fastest and the defaults' time."""
    combos = list(itertools.product(*SWEEP.values()))
    print(f"sweep: gather_matvec, 50% active, us per call for block_k x block_d x n_split in {SWEEP}")
    for name, (n_in, n_out) in matrices.items():
        w = jnp.asarray(rng.standard_normal((n_in, n_out), dtype=np.float32))
        x = jnp.asarray(rng.standard_normal(n_in, dtype=np.float32))
        ids, count = active_ids(rng, n_in, 0.5)
        ids, count = jnp.asarray(ids), jnp.int32(count)
        times = {}
        for bk, bd, ns in tqdm([(None, None, None)] + combos, desc=name, unit="config", leave=False):
            kw = {} if bk is None else {"block_k": bk, "block_d": bd, "n_split": ns}
            fn = looped(lambda x, w, ids, c, kw=kw: gather_matvec(x, w, ids, c, interpret=args.interpret, **kw),
                        args.calls)
            fn(x, w, ids, count).block_until_ready()
            times[(bk, bd, ns)] = np.median([timed(fn, (x, w, ids, count), args.calls) for _ in range(3)])
        default = times.pop((None, None, None))
        best = min(times, key=times.get)
        bd0 = gather.default_block_d(n_out)
        ns0 = gather.split_for(n_out, n_in, 32, bd0, None)
        print(f"{name:8s} default (32, {bd0}, {ns0}) {1e6 * default:7.1f} us; fastest {best} "
              f"{1e6 * times[best]:7.1f} us = {4 * int(count) * n_out / times[best] / 1e9:.0f} GB/s")
        print("    " + "  ".join(f"{k}:{1e6 * t:.0f}" for k, t in sorted(times.items())))


SWEEP_Q4 = {"block_k": (16, 32, 64), "block_d": (128, 256, 512), "n_split": (None, 16, 64)}
SWEEP_Q4_GEMV = {"block_r": (16, 32, 64), "block_d": (128, 256, 512)}


def sweep_q4(d, f, rng, args) -> None:
    """q4_hot_ffn (ReGLU, half the neurons active) over SWEEP_Q4, and q4_matvec's Pallas kernel on the gate's rows
    over SWEEP_Q4_GEMV: us per call (median of three looped timings) and the weight bytes read per second."""
    (g, _), (u, _), (dn_t, _) = (q4_planes(rng, f, d) for _ in range(3))
    x = jnp.asarray(rng.standard_normal(d, dtype=np.float32))
    ids, count = active_ids(rng, f, 0.5)
    ids, count = jnp.asarray(ids), jnp.int32(count)
    row_bytes = d // 2 + 4 * (d // 32)
    cases = [("q4_hot_ffn 50%", SWEEP_Q4, 3 * int(count) * row_bytes,
              lambda kw: looped(lambda x, *a: q4_hot_ffn(x, *a, activation="reglu", interpret=args.interpret, **kw),
                                args.calls), (x, g, u, dn_t, ids, count)),
             ("q4_matvec", SWEEP_Q4_GEMV, f * row_bytes,
              lambda kw: looped(lambda x, w: q4_matvec(x, w, interpret=args.interpret, **kw), args.calls), (x, g))]
    for name, grid, nbytes, make, fargs in cases:
        times = {}
        for combo in tqdm(list(itertools.product(*grid.values())), desc=name, unit="config", leave=False):
            kw = {k: v for k, v in zip(grid, combo) if v is not None}
            fn = make(kw)
            fn(*fargs).block_until_ready()
            times[combo] = np.median([timed(fn, fargs, args.calls) for _ in range(3)])
        best = min(times, key=times.get)
        print(f"{name}: {dict(zip(grid, best))} fastest, {1e6 * times[best]:.1f} us = "
              f"{nbytes / times[best] / 1e9:.0f} GB/s")
        print("    " + "  ".join(f"{k}:{1e6 * t:.0f}" for k, t in sorted(times.items(), key=lambda kv: kv[1])))


if __name__ == "__main__":
    main()
