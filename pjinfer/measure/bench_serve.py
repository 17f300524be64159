"""A bounded load test of `pjinfer serve` on loopback (`make bench-serve`).

Starts the server as a child process on a free 127.0.0.1 port, then measures `pairs` alternated pairs: one stream
alone (SINGLE_REQUESTS requests, one after another), then `requests` streaming completions from `clients` concurrent
clients. Every request asks for `tokens` tokens (greedy, or with `--sampled` the server's default sampling; no
end-of-text stop: a fixed amount of work). Reports, per
pair, the aggregate completion rate against that pair's single stream, and their median and range (the rate on a
shared machine drifts, so each concurrent phase is compared with the single stream measured next to it); the time
to the first token (p50, p99, over every concurrent request) and the requests lost (an error, a wrong token count,
or no [DONE]). Then stops the server.

`--no-http` measures the engine's part of the same load in this process instead: the requests go straight to
the scheduler's batched decode (`pjinfer.runtime.batch`, prefill and up to `scheduler.STEPS` steps per call),
`clients` at a time against one at a time, in alternated pairs. The ratio it reports is the most batching
can give the server; the HTTP layer and the clients (on the same cores) take their share of both phases.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
from tqdm import tqdm

from pjinfer.arguments import positive_int
from pjinfer.load.loader import DEFAULT_MODEL_WEIGHTS
from pjinfer.runtime.batch import Batch
from pjinfer.runtime.engine import Engine
from pjinfer.runtime.sampling import Sampling
from pjinfer.serve.bodies import DEFAULT_SAMPLING
from pjinfer.serve.scheduler import STEPS

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn is",
           "Water boils at", "My favourite animal is", "In 1492,", "The opposite of hot is"]


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen | None = None, timeout: float = 300) -> None:
    """Returns once GET base/health answers 200; fails if `proc` (the server) exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the server at {base} did not come up in {timeout:.0f} s")


def _one(base: str, prompt: str, tokens: int, sampled: bool = False) -> dict:
    """One streaming request, greedy or (sampled) with no sampling field (the server's defaults): seconds to the
    first token, total seconds, tokens received, whether it completed."""
    start, first, pieces, done = time.perf_counter(), None, 0, False
    body = {"prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}} | ({} if sampled else {"temperature": 0})
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                return {"ok": False}
            usage = None
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    elif chunk["choices"] and chunk["choices"][0]["text"]:
                        first = first or time.perf_counter()
                        pieces += 1
    except httpx.HTTPError:
        return {"ok": False}
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    return {"ok": done and n == tokens, "ttft": (first or end) - start, "seconds": end - start, "tokens": n}


SINGLE_REQUESTS = 2


def _span(values) -> list:
    """[min, max] of rates, to 0.1."""
    return [round(min(values), 1), round(max(values), 1)]


def _concurrent(base: str, *, requests: int, clients: int, tokens: int, sampled: bool, bar) -> tuple[list[dict], float]:
    """`requests` requests from `clients` threads: their results and the phase's wall seconds."""
    results, lock, next_index = [], threading.Lock(), iter(range(requests))

    def client():
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            r = _one(base, PROMPTS[i % len(PROMPTS)], tokens, sampled)
            with lock:
                results.append(r)
                bar.update()

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def run(base: str, *, requests: int, clients: int, tokens: int, pairs: int = 3, sampled: bool = False) -> dict:
    _one(base, PROMPTS[0], 4, sampled)                      # compile outside the measurement
    bar = tqdm(total=pairs * (requests + SINGLE_REQUESTS), desc="requests", disable=None)
    singles, aggregates, ratios, ttfts, lost = [], [], [], [], 0
    for _ in range(pairs):
        alone = []
        for _ in range(SINGLE_REQUESTS):
            alone.append(_one(base, PROMPTS[0], tokens, sampled))
            bar.update()
        alone = [r for r in alone if r["ok"]]
        lost += SINGLE_REQUESTS - len(alone)
        if not alone:   # nothing to compare the phase with: said, not a division by zero
            raise RuntimeError("every single-stream request of a pair failed")
        single = sum(r["tokens"] for r in alone) / sum(r["seconds"] for r in alone)
        results, wall = _concurrent(base, requests=requests, clients=clients, tokens=tokens, sampled=sampled,
                                    bar=bar)
        ok = [r for r in results if r["ok"]]
        lost += requests - len(ok)
        ttfts += [r["ttft"] for r in ok]
        aggregate = sum(r["tokens"] for r in ok) / wall
        singles.append(single)
        aggregates.append(aggregate)
        ratios.append(aggregate / single)
    bar.close()
    ttfts.sort()
    return {"requests": requests, "clients": clients, "tokens": tokens, "pairs": pairs, "sampled": sampled,
            "single_stream_tok_s": _span(singles), "aggregate_tok_s": _span(aggregates),
            "aggregate_over_single": round(statistics.median(ratios), 2),
            "ratios": [round(r, 2) for r in ratios],
            "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
            "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3) if ttfts else None,
            "lost": lost}


def run_direct(engine, *, requests: int, clients: int, tokens: int, pairs: int = 3, sampled: bool = False) -> dict:
    """The --no-http measurement: tokens per second of `requests` requests decoded `clients` at a time (each
    wave prefilled, then stepped until every request has its `tokens`) against two requests one at a time."""
    batch = Batch(engine, clients)
    sampling = Sampling(**DEFAULT_SAMPLING, seed=1) if sampled else Sampling()
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]

    def rate(count: int, at_once: int) -> float:
        start, made = time.perf_counter(), 0
        for first in range(0, count, at_once):
            states = [batch.start(slot, prompts[(first + slot) % len(prompts)], tokens, sampling, stop_ids=[])
                      for slot in range(min(at_once, count - first))]
            made += len(states)
            while any(s.remaining for s in states):
                batch.step([s for s in states if s.remaining], steps=STEPS)
                made += sum(len(s.new) for s in states)
        return made / (time.perf_counter() - start)

    rate(1, 1), rate(clients, clients)                            # compile outside the measurement
    singles, aggregates = [], []
    for _ in tqdm(range(pairs), desc="pairs", disable=None):
        singles.append(rate(SINGLE_REQUESTS, 1))
        aggregates.append(rate(requests, clients))
    ratios = [a / s for a, s in zip(aggregates, singles)]
    return {"requests": requests, "clients": clients, "tokens": tokens, "pairs": pairs, "http": False,
            "sampled": sampled,
            "single_stream_tok_s": _span(singles), "aggregate_tok_s": _span(aggregates),
            "aggregate_over_single": round(statistics.median(ratios), 2), "ratios": [round(r, 2) for r in ratios]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pjinfer.measure.bench_serve", description=__doc__)
    p.add_argument("--requests", type=positive_int, default=64)
    p.add_argument("--clients", type=positive_int, default=8)
    p.add_argument("--tokens", type=positive_int, default=64)
    p.add_argument("--pairs", type=positive_int, default=3, help="alternated (one stream, concurrent) pairs")
    p.add_argument("--weights", default=DEFAULT_MODEL_WEIGHTS)
    p.add_argument("--model")
    p.add_argument("--no-http", action="store_true", help="the engine's part only: batched decode in this process")
    p.add_argument("--sampled", action="store_true", help="requests sample with the server's defaults (temperature "
                   "0.8, top-k 40, top-p 0.95, min-p 0.05), as a client that sends no sampling fields; default greedy")
    args = p.parse_args(argv)
    if args.no_http:
        try:
            engine = Engine.load(args.model, weights=args.weights)
            result = run_direct(engine, requests=args.requests, clients=args.clients, tokens=args.tokens,
                                pairs=args.pairs, sampled=args.sampled)
        except ValueError as e:               # a model or weights the batched decode cannot run: one line
            print(f"pjinfer: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(result))
        return 0
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pjinfer.cli.main", "serve", "--port", str(port), "--weights", args.weights,
           "--max-batch", str(args.clients)] + (["--model", args.model] if args.model else [])
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, env=os.environ.copy())
    try:
        wait_healthy(base, proc)
        result = run(base, requests=args.requests, clients=args.clients, tokens=args.tokens, pairs=args.pairs,
                     sampled=args.sampled)
        died = proc.poll()        # a server that crashed loses requests; say why, not only how many
    except RuntimeError as e:
        print(f"pjinfer: error: {e}", file=sys.stderr)
        return 2
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(json.dumps(result))
    if died is not None:
        print(f"pjinfer: error: the server exited with code {died} during the run", file=sys.stderr)
    return 1 if result["lost"] or died is not None else 0


if __name__ == "__main__":
    sys.exit(main())
