"""Tensor parallel's decode rate, collective time and memory per process: `make bench-tp`.

For each N of --processes, N local processes join through jax.distributed (127.0.0.1, gloo), load the model split N
ways (pjinfer.runtime.tensor_parallel) and generate greedily; N 0 is the unsplit host decode in one process. Each
process reports its peak RSS minus its floor (the RSS once its code is imported and JAX has started, before the
model loads) and, for N > 0, the time of one step's collectives alone (2 psums a layer, the embedding's psum and
the head's all-gather, on vectors of the model's sizes). On one machine the N processes share its cores and its
memory bandwidth: this measures what the split costs, not how it scales across hosts.

Every run starts with an empty compilation cache, so every process of every N compiles its executables, as a
first run does (compiling adds to a process's peak). With --warm a first run of the same N fills the cache and the
second is measured, as every later run goes: process 0 writes the executables and every process reads them
(compile_cache.read_by_every_process).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from cpu_offload.team import usable_cores
from pjinfer.measure.bench_serve import free_port


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _collectives_ms(engine, repeats: int = 20) -> float:
    """One step's collectives alone, in ms (median)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from pjinfer.runtime.tensor_parallel import AXIS, mesh

    c, n = engine.config, jax.process_count()

    def step(x):
        x = jax.lax.psum(x, AXIS)
        for _ in range(2 * c.n_layers):
            x = x + jax.lax.psum(x * 0.5, AXIS)
        return jax.lax.all_gather(jnp.tile(x, c.vocab_size // n // c.d_model + 1)[:c.vocab_size // n], AXIS,
                                  tiled=True)

    f = jax.jit(jax.shard_map(step, mesh=mesh(), in_specs=P(), out_specs=P(), check_vma=False))
    x = np.ones(c.d_model, np.float32)
    f(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def worker(model: str, coordinator: str, n: int, index: int, tokens: int, runs: int) -> dict:
    """One process's figures (the module docstring)."""
    from pjinfer.measure.bench import bench_prompt
    from pjinfer.runtime.tensor_parallel import Processes

    if n:
        Processes(coordinator, n, index).start()
    import jax

    from pjinfer.runtime.engine import Engine

    jax.numpy.zeros(1).block_until_ready()
    floor = _rss_mb("VmRSS")   # the code imported and JAX started: what a process holds without a model
    engine = Engine.load(model, weights="auto", parallel=n > 0)   # the file's own blocks
    prompt = bench_prompt(engine, 16)
    _, cache_len = engine.plan(len(prompt), tokens)
    rates = []
    for _ in range(runs + 1):   # the first run compiles
        ends = []
        for count in (8, tokens):
            start = time.perf_counter()
            engine.generate(prompt, max_new_tokens=count, stop_ids=[], cache_len=cache_len)
            ends.append(time.perf_counter() - start)
        rates.append((tokens - 8) / (ends[1] - ends[0]))
    out = {"process": index, "decode_tok_s": float(np.median(rates[1:])), "rates": rates[1:],
           "peak_minus_floor_mb": _rss_mb("VmHWM") - floor, "floor_mb": floor}
    if n:
        out["collectives_ms"] = _collectives_ms(engine)
    return out


def run(model: str, n: int, tokens: int, runs: int, warm: bool = False) -> list[dict]:
    """Every process's figures for an N-process run (N 0: one unsplit process), from an empty compilation cache,
    or with warm, from the cache a first such run filled (the module docstring)."""
    given = ["--model", model] if model else []
    with tempfile.TemporaryDirectory(prefix="pjinfer-bench-tp-") as cache:
        env = dict(os.environ, PJINFER_HOST_THREADS=str(max(1, usable_cores() // max(n, 1))),
                   PJINFER_COMPILE_CACHE=cache)
        for _ in range(1 + warm):
            address = f"127.0.0.1:{free_port()}"
            procs = [subprocess.Popen([sys.executable, "-m", "pjinfer.measure.bench_tp", "--worker", address,
                                       str(n), str(i), *given, "--tokens", str(tokens), "--runs", str(runs)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                     for i in range(max(n, 1))]
            outs = [p.communicate() for p in procs]
            for p, (_, err) in zip(procs, outs):
                if p.returncode:
                    raise RuntimeError(f"a worker failed:\n{err[-3000:]}")
    return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pjinfer.measure.bench_tp", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a Q4_1 GGUF (default: the default model)")
    p.add_argument("--processes", default="0,1,2,4", help="comma-separated N (0: unsplit)")
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warm", action="store_true", help="measure a second run, its executables read from the cache")
    p.add_argument("--worker", nargs=3, metavar=("COORDINATOR", "N", "I"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        coordinator, n, i = args.worker
        print(json.dumps(worker(args.model, coordinator, int(n), int(i), args.tokens, args.runs)), flush=True)
        return 0
    print("| processes | decode tok/s | collectives ms a step | peak RSS minus floor, MB a process: largest (range) "
          "| of unsplit |")
    print("|---|---|---|---|---|")
    unsplit = None
    for n in (int(v) for v in args.processes.split(",")):
        rows = run(args.model, n, args.tokens, args.runs, args.warm)
        first, peaks = rows[0], [r["peak_minus_floor_mb"] for r in rows]
        peak = max(peaks)
        unsplit = peak if n == 0 else unsplit
        coll = f"{first['collectives_ms']:.2f}" if n else "-"
        rates = f"{first['decode_tok_s']:.1f} ({min(first['rates']):.1f}-{max(first['rates']):.1f})"
        share = f"{peak / unsplit:.3f}" if unsplit else "-"
        spread = f" ({min(peaks):.0f}-{peak:.0f})" if len(peaks) > 1 else ""
        print(f"| {n or '1, unsplit'} | {rates} | {coll} | {peak:.0f}{spread} | {share} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
