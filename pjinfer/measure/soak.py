"""A bounded soak test of `pjinfer serve` on loopback (`make soak`): many kinds of clients at once for a fixed time.

Starts the server as a child process on a free 127.0.0.1 port (`--max-batch`, `--max-queue`), asks it for each
prompt's greedy text alone (one request at a time: the reference, and the compile out of the way), then runs
`--clients` client threads for `--seconds` (default: $SOAK_SECONDS, else 600):

- normal clients: greedy requests (temperature 0, `--tokens` tokens, end-of-text ignored), streamed or not at
  random; now and then one disconnects on purpose (a stream after its first chunk, a non-streaming request a
  moment after it was sent); a 429 is waited out (Retry-After) and counted as refused;
- one slow client (slowloris): sends a request's headers a byte at a time, in alternating windows of
  SLOW_WINDOW_S seconds (on, off, on, ...), so the normal clients' latency can be compared with and without it;
- one client sending bodies over the server's limit (with a Content-Length past it, or chunked), every
  OVERSIZE_EVERY_S seconds: each must get 413;
- one burst client: in the middle of every slow-client window (so windows with and without the slow client get
  the same bursts), max_batch + max_queue + BURST_EXTRA non-streaming requests at once: each must get its full
  answer or 429.

The warm-up (the reference texts, then one request given up on) compiles what the run uses and grows the server's
KV pool to the longest request the run makes (DISCONNECT_TOKENS), so the RSS after the first minute is the
baseline of the growth.

Every request ends as one of: completed (a full answer: a stream with its finish_reason and [DONE], or a JSON
completion, with the token count asked for); refused (an error status, counted by status); disconnected (by the
client itself, on purpose); or lost (anything else: a reset, a timeout, a stream cut short, a wrong token count).
A completed greedy text that differs from the same prompt's text alone is garbled.

Reports (one JSON object on stdout) those counts, the normal clients' request latency p50/p99 with and without the
slow client running (requests that began and ended inside one window), the server's RSS after RSS_AT_S seconds and
at the end, and the tracebacks in the server's log. Exits 1 when any request was lost or garbled, the server
wrote a traceback or died; 2 when the server did not come up.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
from tqdm import tqdm

from pjinfer.arguments import positive_int
from pjinfer.measure.bench_serve import PROMPTS, free_port, wait_healthy
from pjinfer.serve.server import MAX_BODY_BYTES

SLOW_WINDOW_S = 60       # the slow client runs in windows this long, alternating with windows without it
SLOW_BYTE_S = 0.02       # the slow client's pause between header bytes
BURST_EXTRA = 4          # a burst's requests past what the batch and the queue hold
OVERSIZE_EVERY_S = 2.0   # the pause between the oversize client's bodies
DISCONNECT_TOKENS = 1000  # what a request given up on asks for
DISCONNECT_CHANCE = 0.1  # a normal client's chance of giving up on a request on purpose
RSS_AT_S = 60            # the first RSS sample (the baseline of the growth)
TIMEOUT_S = 300          # a request that takes longer is lost


class Tally:
    """Thread-safe counts and samples of the run."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts = collections.Counter()
        self.refused = collections.Counter()
        self.latency = {True: [], False: []}      # slow client running: seconds of normal requests
        self.notes = []                            # the first few lost/garbled requests, said

    def add(self, outcome: str, note: str | None = None) -> None:
        with self.lock:
            self.counts[outcome] += 1
            if note and len(self.notes) < 10:
                self.notes.append(f"{outcome}: {note}")

    def refuse(self, status: int) -> None:
        with self.lock:
            self.counts["refused"] += 1
            self.refused[str(status)] += 1


class SlowWindows:
    """Whether the slow client runs at a moment: on in the even windows of SLOW_WINDOW_S from `start`."""

    def __init__(self, start: float):
        self.start = start

    def window(self, at: float) -> int:
        return int((at - self.start) // SLOW_WINDOW_S)

    def on(self, at: float) -> bool:
        return self.window(at) % 2 == 0

    def to_next_middle(self, at: float) -> float:
        """Seconds from `at` to the middle of the next window (or of this one, if not past it yet)."""
        return self.start + (math.floor((at - self.start) / SLOW_WINDOW_S - 0.5) + 1.5) * SLOW_WINDOW_S - at


# ---------------------------------------------------------------- raw HTTP (the misbehaving clients)
def raw_request(path: str, body: bytes, host: str, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def read_response(conn: socket.socket) -> tuple[int, bytes]:
    """Status and body of the response on `conn` (Connection: close: read to the end)."""
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


# ---------------------------------------------------------------- one request of each kind
def body_of(prompt: str, tokens: int, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}


def normal(http: httpx.Client, base: str, prompt: str, tokens: int, stream: bool) -> tuple[str, str | int]:
    """One greedy request: ("completed", text), ("refused", status) or ("lost", why)."""
    try:
        if not stream:
            r = http.post(f"{base}/v1/completions", json=body_of(prompt, tokens, False))
            if r.status_code != 200:
                return "refused", r.status_code
            out = r.json()
            if out["usage"]["completion_tokens"] != tokens or out["choices"][0]["finish_reason"] != "length":
                return "lost", f"usage {out['usage']}, finish {out['choices'][0]['finish_reason']}"
            return "completed", out["choices"][0]["text"]
        with http.stream("POST", f"{base}/v1/completions", json=body_of(prompt, tokens, True)) as r:
            if r.status_code != 200:
                r.read()
                return "refused", r.status_code
            text, finish, usage, done = [], None, None, False
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return "lost", f"error in stream: {chunk['error']['message']}"
                    usage = chunk.get("usage") or usage
                    for choice in chunk["choices"]:
                        text.append(choice["text"])
                        finish = choice["finish_reason"] or finish
        if not done or finish != "length" or not usage or usage["completion_tokens"] != tokens:
            return "lost", f"stream ended: done {done}, finish {finish}, usage {usage}"
        return "completed", "".join(text)
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return "lost", f"{type(e).__name__}: {e}"


def disconnect(http: httpx.Client, base: str, prompt: str, rng: random.Random) -> None:
    """A request the client gives up on: a stream after its first chunk, or a non-streaming one after a moment."""
    if rng.random() < 0.5:
        with http.stream("POST", f"{base}/v1/completions", json=body_of(prompt, DISCONNECT_TOKENS, True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        return
    host, port = base[len("http://"):].split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as conn:
        conn.sendall(raw_request("/v1/completions", json.dumps(body_of(prompt, DISCONNECT_TOKENS, False)).encode(),
                                 host))
        time.sleep(rng.uniform(0.1, 1.0))


def slow(base: str, prompt: str, tokens: int) -> tuple[str, str | int]:
    """The slowloris: headers a byte at a time, then the body; its answer is checked like a normal one's."""
    host, port = base[len("http://"):].split(":")
    data = raw_request("/v1/completions", json.dumps(body_of(prompt, tokens, False)).encode(), host)
    head, _, rest = data.partition(b"\r\n\r\n")
    try:
        with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as conn:
            for i in range(len(head)):
                conn.sendall(head[i:i + 1])
                time.sleep(SLOW_BYTE_S)
            conn.sendall(b"\r\n\r\n" + rest)
            status, body = read_response(conn)
    except OSError as e:
        return "lost", f"slow client: {type(e).__name__}: {e}"
    if status != 200:
        return "refused", status
    try:
        return "completed", json.loads(body)["choices"][0]["text"]
    except (ValueError, KeyError) as e:
        return "lost", f"slow client: {type(e).__name__}: {e}"


def oversize(base: str, chunked: bool) -> tuple[str, str | int]:
    """A whole body one byte over the limit, announced by its Content-Length or chunked. It must get 413."""
    host, port = base[len("http://"):].split(":")
    body = b"x" * (MAX_BODY_BYTES + 1)
    if chunked:
        piece = 65536
        data = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
        for i in range(0, len(body), piece):
            part = body[i:i + piece]
            data += f"{len(part):x}\r\n".encode() + part + b"\r\n"
        data += b"0\r\n\r\n"
    else:
        data = raw_request("/v1/completions", body, host)
    try:
        with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as conn:
            conn.sendall(data)
            status, _ = read_response(conn)
    except OSError as e:
        return "lost", f"oversize body: {type(e).__name__}: {e}"
    return ("refused", status) if status == 413 else ("lost", f"oversize body: status {status}")


# ---------------------------------------------------------------- the run
class Soak:
    def __init__(self, base: str, *, seconds: float, clients: int, tokens: int, max_batch: int, max_queue: int,
                 solo: dict[str, str], seed: int = 0):
        self.base, self.seconds, self.clients, self.tokens = base, seconds, clients, tokens
        self.max_batch, self.max_queue, self.solo, self.seed = max_batch, max_queue, solo, seed
        self.tally = Tally()
        self.stop = threading.Event()
        self.start = time.monotonic()
        self.windows = SlowWindows(self.start)

    def check(self, prompt: str, outcome: str, value) -> None:
        """Counts one request's outcome; a completed greedy text must equal the prompt's text alone."""
        if outcome == "refused":
            self.tally.refuse(value)
        elif outcome == "lost":
            self.tally.add("lost", value)
        elif value != self.solo[prompt]:
            self.tally.add("garbled", f"{prompt!r}: {value!r} against {self.solo[prompt]!r}")
        else:
            self.tally.add("completed")

    def normal_client(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        with httpx.Client(timeout=TIMEOUT_S) as http:
            while not self.stop.is_set():
                prompt = rng.choice(PROMPTS)
                if rng.random() < DISCONNECT_CHANCE:
                    try:
                        disconnect(http, self.base, prompt, rng)
                        self.tally.add("disconnected")
                    except (httpx.HTTPError, OSError) as e:
                        self.tally.add("lost", f"disconnecting client: {type(e).__name__}: {e}")
                    continue
                began = time.monotonic()
                outcome, value = normal(http, self.base, prompt, self.tokens, rng.random() < 0.5)
                ended = time.monotonic()
                self.check(prompt, outcome, value)
                if outcome == "completed" and self.windows.window(began) == self.windows.window(ended):
                    with self.tally.lock:
                        self.tally.latency[self.windows.on(began)].append(ended - began)
                if outcome == "refused":
                    self.stop.wait(1.0)             # the Retry-After

    def slow_client(self) -> None:
        rng = random.Random(self.seed)
        while not self.stop.is_set():
            if not self.windows.on(time.monotonic()):
                self.stop.wait(0.2)
                continue
            prompt = rng.choice(PROMPTS)
            self.check(prompt, *slow(self.base, prompt, self.tokens))

    def oversize_client(self) -> None:
        chunked = False
        while not self.stop.wait(OVERSIZE_EVERY_S):
            outcome, value = oversize(self.base, chunked)
            if outcome == "refused":
                self.tally.refuse(value)
            else:
                self.tally.add(outcome, value)
            chunked = not chunked

    def burst_client(self) -> None:
        rng = random.Random(self.seed + 7)
        size = self.max_batch + self.max_queue + BURST_EXTRA
        while not self.stop.wait(self.windows.to_next_middle(time.monotonic())):
            threads = [threading.Thread(target=self.burst_request, args=(rng.choice(PROMPTS),)) for _ in range(size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    def burst_request(self, prompt: str) -> None:
        with httpx.Client(timeout=TIMEOUT_S) as http:
            self.check(prompt, *normal(http, self.base, prompt, self.tokens, False))

    def run(self, rss) -> dict:
        """Runs every client until `seconds` have passed (each finishes the request it is in), sampling `rss()`
        after RSS_AT_S seconds and at the end."""
        workers = [threading.Thread(target=self.normal_client, args=(i,)) for i in range(self.clients - 3)]
        workers += [threading.Thread(target=f) for f in (self.slow_client, self.oversize_client, self.burst_client)]
        for w in workers:
            w.start()
        rss_early = None
        with tqdm(total=int(self.seconds), desc="soak", unit="s", disable=None) as bar:
            while (elapsed := time.monotonic() - self.start) < self.seconds:
                time.sleep(1.0)
                bar.update(1)
                if rss_early is None and elapsed >= min(RSS_AT_S, self.seconds / 2):
                    rss_early = rss()
                with self.tally.lock:
                    bar.set_postfix(self.tally.counts)
        self.stop.set()
        for w in workers:
            w.join(timeout=TIMEOUT_S + 30)
        return self.report(rss_early, rss())

    def report(self, rss_early: int | None, rss_end: int | None) -> dict:
        t = self.tally

        def pct(values, q):
            values = sorted(values)
            return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None

        with_slow, without = t.latency[True], t.latency[False]
        return {
            "seconds": round(time.monotonic() - self.start, 1), "clients": self.clients, "tokens": self.tokens,
            "max_batch": self.max_batch, "max_queue": self.max_queue,
            "completed": t.counts["completed"], "refused": t.counts["refused"], "refused_by_status": dict(t.refused),
            "disconnected_by_client": t.counts["disconnected"], "lost": t.counts["lost"],
            "garbled": t.counts["garbled"], "notes": t.notes,
            "latency_s": {"without_slow_client": {"n": len(without), "p50": pct(without, 0.5),
                                                  "p99": pct(without, 0.99)},
                          "with_slow_client": {"n": len(with_slow), "p50": pct(with_slow, 0.5),
                                               "p99": pct(with_slow, 0.99)}},
            "p99_with_over_without": (round(pct(with_slow, 0.99) / pct(without, 0.99), 3)
                                      if with_slow and without else None),
            "rss_mib": {"early": rss_early and round(rss_early / 2**20, 1),
                        "end": rss_end and round(rss_end / 2**20, 1)},
            "rss_growth": round(rss_end / rss_early - 1, 4) if rss_early and rss_end else None,
        }


def warm_up(base: str, tokens: int) -> dict[str, str]:
    """Each prompt's greedy text, asked for alone (one request at a time); then a request given up on."""
    out = {}
    with httpx.Client(timeout=TIMEOUT_S) as http:
        for prompt in PROMPTS:
            outcome, value = normal(http, base, prompt, tokens, False)
            if outcome != "completed":
                raise RuntimeError(f"the reference request for {prompt!r} failed: {value}")
            out[prompt] = value
        disconnect(http, base, PROMPTS[0], random.Random(0))
    return out


def rss_of(pid: int) -> int | None:
    """Resident set size of process `pid` in bytes (Linux /proc), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pjinfer.measure.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=positive_int, default=int(os.environ.get("SOAK_SECONDS", 600)))
    p.add_argument("--clients", type=positive_int, default=16, help="client threads (3 of them misbehave), >= 4")
    p.add_argument("--tokens", type=positive_int, default=16, help="tokens of each normal request")
    p.add_argument("--max-batch", type=positive_int, default=8)
    p.add_argument("--max-queue", type=positive_int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.clients < 4:
        p.error(f"argument --clients: must be >= 4 (3 misbehaving clients and a normal one), got {args.clients}")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pjinfer.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue)]
    log = open(f"/tmp/pjinfer-soak-{port}.log", "w+")
    proc = subprocess.Popen(cmd, stderr=log, env=os.environ.copy())
    try:
        wait_healthy(base, proc)
        solo = warm_up(base, args.tokens)
        soak = Soak(base, seconds=args.seconds, clients=args.clients, tokens=args.tokens,
                    max_batch=args.max_batch, max_queue=args.max_queue, solo=solo, seed=args.seed)
        result = soak.run(lambda: rss_of(proc.pid))
        died = proc.poll()
    except RuntimeError as e:
        print(f"pjinfer: error: {e}", file=sys.stderr)
        return 2
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.seek(0)
    server_log = log.read()
    result["server_tracebacks"] = server_log.count("Traceback")
    result["server_log"] = log.name
    result["server_exit"] = proc.returncode if died is None else died
    print(json.dumps(result, indent=1))
    bad = result["lost"] or result["garbled"] or result["server_tracebacks"] or died is not None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
