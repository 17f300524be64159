"""PowerInfer's GPU-CPU hybrid against llama.cpp's layer split, on a random Llama-2-7B-geometry model with synthetic
activations: ``python -m pjinfer.measure.bench_hybrid`` (``make gpu-check`` runs it; ``--dry-run``, or ``make
gpu-check-dry-run``: a small geometry in interpret mode on any machine, to check the command, never to time it).
Random weights and a planted trace: the figures measure speed, never accuracy.

The engines (pjinfer.measure.hybrid_engines): a ReLU-gated (ReGLU, as ReluLLaMA) Llama-2-7B geometry in random Q4_0
blocks; a trace where ``--hot-share`` of the neurons make ``--hot-mass`` of the activations (PowerInfer's measurement)
and ``--active-share`` of them fire per token on average. Per device budget (``--budgets``: shares of the FFN's bytes,
on top of what the hybrid always keeps on the device: attention, embedding, head, KV cache, predictors):
- hybrid: pjinfer.offline.policy.solve places the hot neurons, the planted probabilities as the profile and the
  host's and the device's bandwidths measured in this run;
- layer split (-ngl K): as many whole layers as the same device bytes hold;
and, once, every layer on the device (as a scan over the layers, and unrolled).
Before them: the device's copy rate, the host's read rate and what one pure_callback costs. Hybrid and layer split
alternate, ``--pairs`` pairs of ``--tokens`` tokens; the table gives the medians, ranges and pair ratios, and is
rewritten to ``--out`` after every budget (a run cut short keeps what it measured).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from pjinfer.config import ConfigError
from pjinfer.measure.hybrid_engines import (GEOMETRIES, Engine, Hybrid, LayerSplit, RandomModel, device_attention,
                                            draw, firing_probabilities, nbytes, planes)
from pjinfer.offline.policy import Hardware, solve


# ---------------------------------------------------------------------------------------------- the machine

def host_read_rate(threads: int, runs: int = 5) -> float:
    """Bytes per second that `threads` threads read summing 1 GiB (64 MiB in a dry run) of host memory (numpy
    releases the GIL in the sum); the median of `runs`."""
    a = np.ones((threads, (1 << 27) // threads), np.uint64)
    pool = concurrent.futures.ThreadPoolExecutor(threads)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        list(pool.map(lambda i: a[i].sum(), range(threads)))
        times.append(time.perf_counter() - t)
    pool.shutdown()
    return a.nbytes / float(np.median(times))


def callback_seconds(d: int, calls: int = 32, runs: int = 9) -> float:
    """What one jax.pure_callback of a [d] vector costs inside a jitted loop, over the same loop without it."""
    def timed(body):
        f = jax.jit(lambda x: jax.lax.fori_loop(0, calls, body, x))
        x = jnp.ones(d, jnp.float32)
        f(x).block_until_ready()
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            f(x).block_until_ready()
            times.append(time.perf_counter() - t)
        return float(np.median(times)) / calls
    host = lambda x: np.asarray(x) * np.float32(0.5)
    with_cb = timed(lambda i, x: jax.pure_callback(host, jax.ShapeDtypeStruct((d,), jnp.float32), x) + 1.0)
    return max(0.0, with_cb - timed(lambda i, x: x * 0.5 + 1.0))


# ---------------------------------------------------------------------------------------------- the run

def median_runs(engines: list[Engine], tokens: int, pairs: int) -> list[list[float]]:
    """tok/s of each engine, the engines alternated, `pairs` rounds (each engine compiled and run once before)."""
    for e in engines:
        e.run(tokens)
    rates = [[] for _ in engines]
    for _ in tqdm(range(pairs), desc="alternated runs", disable=None):
        for e, r in zip(engines, rates):
            t = time.perf_counter()
            e.run(tokens)
            r.append(tokens / (time.perf_counter() - t))
    return rates


def spread(values) -> str:
    return f"{np.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m pjinfer.measure.bench_hybrid", description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", choices=GEOMETRIES, default="7b")
    ap.add_argument("--dry-run", action="store_true",
                    help="the tiny geometry in interpret mode on any machine: checks the command, times nothing")
    ap.add_argument("--budgets", default="0.25,0.5,0.75", help="device budgets, shares of the FFN's bytes")
    ap.add_argument("--tokens", type=int, default=32, help="tokens each run generates")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--active-share", type=float, default=0.1, help="neurons firing per token, on average")
    ap.add_argument("--hot-share", type=float, default=0.25)
    ap.add_argument("--hot-mass", type=float, default=0.8)
    ap.add_argument("--predictor-rank", type=int, default=1024, help="0: no predictor computed")
    ap.add_argument("--threads", type=int, default=None, help="host threads (default: the CPUs)")
    ap.add_argument("--unroll", action="store_true", help="the hybrid's and the split's device layers unrolled")
    ap.add_argument("--out", type=Path, default=Path("out/gpu-check/hybrid.md"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        args.budgets = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        ap.error(f"--budgets must be comma-separated numbers, got {args.budgets!r}")
    if not all(0 < b <= 1 for b in args.budgets):
        ap.error("--budgets must be shares in (0, 1]")
    if not all(0 < v < 1 for v in (args.active_share, args.hot_share, args.hot_mass)):
        ap.error("--active-share, --hot-share and --hot-mass must be in (0, 1)")
    if args.tokens < 1 or args.pairs < 1 or args.predictor_rank < 0 or (args.threads is not None and args.threads < 1):
        ap.error("--tokens, --pairs and --threads must be at least 1, --predictor-rank at least 0")
    return args


class Report:
    """The table, printed row by row and rewritten to `path` after each (a run cut short keeps its rows)."""

    def __init__(self, path: Path, header: list[str]):
        self.path, self.lines = path, header + [
            "", "| budget (FFN share, device bytes) | engine | device MB | active neurons on the host | tok/s median "
            "(range) | hybrid / split, pair median (range) |", "|---|---|---|---|---|---|"]
        print("\n".join(self.lines), flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, *cells) -> None:
        self.lines.append("| " + " | ".join(cells) + " |")
        print(self.lines[-1], flush=True)
        self.path.write_text("\n".join(self.lines) + "\n")


def main(argv=None) -> int:
    args = parse(argv)
    interpret = args.dry_run
    g = GEOMETRIES["tiny" if args.dry_run else args.geometry]
    if not interpret and jax.default_backend() != "gpu":
        print(f"bench_hybrid: JAX runs on {jax.default_backend()}, not a GPU; --dry-run checks the command here",
              file=sys.stderr)
        return 2
    threads = args.threads or len(os.sched_getaffinity(0))
    rank = min(args.predictor_rank, 16) if args.dry_run else args.predictor_rank   # a dry run: every path taken
    from pallas_kernels.bench import copy_rate
    copy, host_rate, sync = copy_rate(20), host_read_rate(threads), callback_seconds(g.d)
    model = RandomModel.random(g, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    p = firing_probabilities(rng, g.layers, g.ff, args.active_share, args.hot_share, args.hot_mass)
    trace = draw(rng, p, args.tokens)
    attn, embed, head = device_attention(model), planes(model.embed), planes(model.head)
    report = Report(args.out, [
        f"bench_hybrid {' '.join(sys.argv[1:] if argv is None else argv)}",
        f"device: {jax.devices()[0].device_kind}; host: {threads} threads ({_cpu_name()}); random weights and a "
        f"planted trace: speed only, never accuracy" + (" (DRY RUN: interpret mode, nothing timed)" if interpret else ""),
        f"geometry {g}; activation share {args.active_share}, top {args.hot_share:.0%} of neurons hold "
        f"{args.hot_mass:.0%} of the activations; predictor rank {rank}",
        f"device copy rate {copy / 1e9:.0f} GB/s (read + written); host read rate {host_rate / 1e9:.1f} GB/s; "
        f"one pure_callback {sync * 1e6:.0f} us"])

    full = [LayerSplit(model, g.layers, args.tokens + 1, attn, embed, head, interpret, unroll) for unroll in (0, 1)]
    for e, r in zip(full, median_runs(full, args.tokens, args.pairs)):
        report.add("-", e.name, f"{e.device_bytes / 1e6:.0f}", "-", spread(r), "-")
    del full
    neuron_bytes = 3 * (g.d // 2 + 2 * 2 * (g.d // 32))          # gate, up and down_t rows as planes
    ffn_bytes = g.layers * g.ff * neuron_bytes
    kv_layer = 2 * (args.tokens + 1) * g.d * 2
    shared_bytes = nbytes((embed, head))
    dense_layer = nbytes(attn[0]) + kv_layer + neuron_bytes * g.ff      # a whole layer on the device
    hybrid_dense = shared_bytes + g.layers * (nbytes(attn[0]) + kv_layer) + g.layers * 2 * rank * (g.d + g.ff)
    # No synchronisation term: this hybrid calls the host in every layer whatever the placement (a layer's cold
    # neurons), so placing a layer's hot rows on the device costs no extra callback; the budget is the constraint.
    hardware = Hardware(cpu_bandwidth=host_rate, device_bandwidth=copy / 2, sync_seconds=0.0)
    for share in args.budgets:
        budget = hybrid_dense + share * ffn_bytes
        placement = solve(p, neuron_bytes, int(share * ffn_bytes), hardware=hardware, time_limit=20.0)
        hybrid = Hybrid(model, placement.hot, trace, args.tokens + 1, attn, embed, head, predictor_rank=rank,
                        threads=threads, interpret=interpret, unroll=args.unroll)
        k = int(min(g.layers, max(0, (budget - shared_bytes) // dense_layer)))
        split = LayerSplit(model, k, args.tokens + 1, attn, embed, head, interpret, args.unroll)
        for e in (hybrid, split):
            if e.device_bytes > budget:
                raise AssertionError(f"{e.name} holds {e.device_bytes} device bytes, over the budget {budget}")
        rates = median_runs([hybrid, split], args.tokens, args.pairs)
        ratios = [a / b for a, b in zip(*rates)]
        label = f"{share:.0%} ({budget / 1e6:.0f} MB)"
        report.add(label, f"{hybrid.name}: {placement.coverage:.0%} of the mass hot, {placement.status}",
                   f"{hybrid.device_bytes / 1e6:.0f}", f"{hybrid.cold_share:.1%}", spread(rates[0]),
                   f"{np.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
        report.add(label, split.name, f"{split.device_bytes / 1e6:.0f}", "-", spread(rates[1]), "1.00x")
        del hybrid, split
    return 0


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"bench_hybrid: {e}", file=sys.stderr)
        sys.exit(2)
