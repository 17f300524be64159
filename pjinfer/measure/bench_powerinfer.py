"""`make bench-powerinfer`: pjinfer's sparse decode of PowerInfer files against PowerInfer itself.

For each size a random ReLU-Llama file in PowerInfer's layout (pjinfer.measure.powerinfer_files: Q4_0, ffn_down_t,
F16 predictors of rank d/4, a threshold for about 10% active neurons), written once into --dir, then in one run:
- memory and load: peak RSS (`/usr/bin/time -f %M`) and load time of a 32-token generate, each engine in its own
  process: pjinfer sparse (the file's predictors), pjinfer dense (`--dense`), PowerInfer's `main` (its sparse CPU
  operators, `make peers`; its load time is its own `load time` line);
- speed: `pjinfer bench --model FILE --peer powerinfer --prompt-len P --new-tokens 128` for each prompt length: the
  three engines alternated run by run on the cores' count of threads, each rate a median, each ratio the median of
  the runs' pair ratios, with the density each pjinfer engine computed (PowerInfer prints none) and the share of
  the CPU that other work took meanwhile.
Then the default model against PowerInfer's dense mode on the same Q4_1 weights (`pjinfer bench --peer powerinfer
--weights` the default model's format, pjinfer.load.loader.DEFAULT_MODEL_WEIGHTS). Random weights measure speed at a
density, never quality: the text they generate is noise.

    python -m pjinfer.measure.bench_powerinfer [--sizes 0.5b,1.5b] [--dir out/powerinfer] [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from cpu_offload.blocks import AS_STORED
from cpu_offload.team import usable_cores
from pjinfer.config import ConfigError
from pjinfer.load.loader import DEFAULT_MODEL_WEIGHTS
from pjinfer.measure import native_peer
from pjinfer.measure.bench import engine_name
from pjinfer.measure.bench_scale import peak_rss
from pjinfer.measure.powerinfer_files import Geometry, cached_file

PROMPT_LENS = (16, 512)
NEW_TOKENS = 128
MEMORY_PROMPT, MEMORY_TOKENS = "The capital of France is", 32
# The gates of the issue: sparse decode over PowerInfer's on the same file, sparse over dense, and peak RSS.
GATE_OVER_POWERINFER, GATE_OVER_DENSE = 1.25, 1.8
GATE_RSS_BASE_GB, GATE_RSS_FILE_TIMES = 0.3, 1.2
DENSE = engine_name(AS_STORED)   # a PowerInfer file's dense engine in bench's results: its blocks as stored


def _pjinfer(*args: str) -> list[str]:
    return [sys.executable, "-m", "pjinfer.cli.main", *args]


def memory(path: Path) -> dict:
    """Peak RSS (GB) and load time (s) of a short generate by each engine, each in its own process."""
    out = {}
    for name, extra in (("sparse", []), ("dense", ["--dense"])):
        done, peak = peak_rss(_pjinfer("generate", "--model", str(path), "--prompt", MEMORY_PROMPT,
                                       "--max-new-tokens", str(MEMORY_TOKENS), "--json", *extra))
        out[name] = {"peak_gb": peak, "load_s": json.loads(done.stdout.strip().splitlines()[-1])["load_s"]}
    peer = native_peer.powerinfer(path, prompt_text=MEMORY_PROMPT, prompt_len=16, new_tokens=MEMORY_TOKENS,
                                  threads=usable_cores())
    done, peak = peak_rss(peer.command)
    got = native_peer.parse_powerinfer_timings(done.stderr)
    if not got["sparse"]:
        raise ConfigError(f"PowerInfer did not take its sparse path on {path.name} (no "
                          f"{native_peer.POWERINFER_SPARSE_LINE!r} in its output)")
    out["powerinfer"] = {"peak_gb": peak, "load_s": got["load_s"]}
    return out


def bench(model: Path | None, prompt_len: int, runs: int, *extra: str) -> dict:
    """`pjinfer bench --peer powerinfer` on model (None: the default model) as one JSON result."""
    args = ["bench", "--peer", "powerinfer", "--prompt-len", str(prompt_len), "--new-tokens", str(NEW_TOKENS),
            "--runs", str(runs), "--json", *extra] + (["--model", str(model)] if model else [])
    done = subprocess.run(_pjinfer(*args), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"pjinfer {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def speed_row(name: str, result: dict) -> str:
    e, busy = result["engines"], result.get("machine") or {}
    peer = e["powerinfer"]["decode_tok_s"]
    if "sparse" in e:
        s, d = e["sparse"], e[DENSE]
        rates = f"{s['decode_tok_s']:.1f} / {d['decode_tok_s']:.1f} / {peer:.1f}"
        ratios = f"{s['decode_over']['powerinfer']:.2f}x | {s['decode_over'][DENSE]:.2f}x"
        density = f"{100 * s['density']:.1f}%"
    else:   # the default model: pjinfer dense on its Q4_1 blocks, PowerInfer in its dense mode
        d = e[engine_name(DEFAULT_MODEL_WEIGHTS)]
        rates, density = f"- / {d['decode_tok_s']:.1f} / {peer:.1f}", "dense"
        ratios = f"dense {d['decode_over']['powerinfer']:.2f}x | -"
    others = f"{100 * busy.get('others', 0):.0f}% / {100 * busy.get('steal', 0):.0f}%"
    return f"| {name} | {result['prompt_len']} | {density} | {rates} | {ratios} | {others} |"


SPEED_HEADER = ("| file | prompt tokens | density, pjinfer sparse | decode tok/s: pjinfer sparse / dense / PowerInfer | "
                "sparse / PowerInfer | sparse / dense | CPU: others / stolen |\n|---|---|---|---|---|---|---|")
MEMORY_HEADER = ("| file | GB | peak RSS GB: pjinfer sparse / dense / PowerInfer | limit 0.3 + 1.2 x file | "
                 "load s: pjinfer sparse / dense / PowerInfer |\n|---|---|---|---|---|")


def memory_row(name: str, file_gb: float, m: dict) -> str:
    peaks, loads = (" / ".join(f"{m[e][key]:.2f}" for e in ("sparse", "dense", "powerinfer"))
                    for key in ("peak_gb", "load_s"))
    return f"| {name} | {file_gb:.2f} | {peaks} | {rss_limit(file_gb):.2f} | {loads} |"


def rss_limit(file_gb: float) -> float:
    return GATE_RSS_BASE_GB + GATE_RSS_FILE_TIMES * file_gb


def gates(rows: list[dict]) -> list[str]:
    """One line per gate and file: the figure, the bar and whether it holds."""
    lines = []
    for r in rows:
        for result in r["speed"]:
            s = result["engines"]["sparse"]
            for other, bar in (("powerinfer", GATE_OVER_POWERINFER), (DENSE, GATE_OVER_DENSE)):
                got = s["decode_over"][other]
                lines.append(f"{r['size']} after {result['prompt_len']}: sparse / {other} {got:.2f}x, gate "
                             f">= {bar}x: {'holds' if got >= bar else 'fails'}")
        limit = rss_limit(r["file_gb"])
        for engine in ("sparse", "dense"):
            peak = r["memory"][engine]["peak_gb"]
            lines.append(f"{r['size']} peak RSS pjinfer {engine} {peak:.2f} GB, gate <= {limit:.2f} GB: "
                         f"{'holds' if peak <= limit else 'fails'}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pjinfer.measure.bench_powerinfer", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="0.5b,1.5b", help="comma-separated: 0.5b, 1.5b, 3b, 7b (bench_scale's shapes)")
    p.add_argument("--dir", default="out/powerinfer", help="where the files are written once and kept")
    p.add_argument("--runs", type=int, default=3, help="timed runs of each engine per prompt length")
    p.add_argument("--no-default-model", action="store_true", help="leave out the default model's dense row")
    args = p.parse_args(argv)
    try:
        sizes = args.sizes.split(",")
        geometries = {size: Geometry.named(size) for size in sizes}   # refuses an unknown size before any work
        native_peer.check_native("powerinfer", "x.gguf")
        rows = []
        for size in sizes:
            start = time.perf_counter()
            path = cached_file(args.dir, size)
            g = geometries[size]
            print(f"{path} ({path.stat().st_size / 1e9:.2f} GB; d {g.d_model}, {g.n_layers} layers, {g.n_heads} "
                  f"heads, {g.n_kv_heads} kv heads, d_ff {g.d_ff}, predictor rank {g.rank}) ready in "
                  f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
            row = {"size": size, "file": str(path), "file_gb": path.stat().st_size / 1e9, "memory": memory(path),
                   "speed": [bench(path, n, args.runs) for n in PROMPT_LENS]}
            print(json.dumps(row), flush=True)
            rows.append(row)
        default = [] if args.no_default_model else [
            bench(None, n, args.runs, "--weights", DEFAULT_MODEL_WEIGHTS) for n in PROMPT_LENS]
        for result in default:
            print(json.dumps(result), flush=True)
    except ConfigError as e:
        print(f"bench-powerinfer: {e}", file=sys.stderr)
        return 2
    print()
    print(SPEED_HEADER)
    for r in rows:
        for result in r["speed"]:
            print(speed_row(f"random ReLU-Llama {r['size']}", result))
    for result in default:
        print(speed_row("default model, Q4_1 (PowerInfer dense mode)", result))
    print()
    print(MEMORY_HEADER)
    for r in rows:
        print(memory_row(f"random ReLU-Llama {r['size']}", r["file_gb"], r["memory"]))
    print()
    print("\n".join(gates(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
