"""Prefill and decode rates of the jitted generate, measured after a warm-up, median of several alternated runs."""
from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from numba import njit, prange

from cpu_offload import host_decode
from cpu_offload.team import read_cycles
from cpu_offload.predicted_decode import PredictedHostDecoder
from cpu_offload.team import usable_cores
from pjinfer.config import ConfigError
from pjinfer.load import data
from pjinfer.load.gguf_file import GGUFFile
from pjinfer.measure import machine, native_peer
from pjinfer.measure.peer import llama_cpp_runner
from pjinfer.offline import teal
from pjinfer.runtime.engine import Engine
from pjinfer.runtime.model import KVCache
from pjinfer.runtime.sampling import REPEAT_WINDOW, Sampling, push_recent, sample
from pjinfer.runtime.sparse import SparseFFN, skipped_share


def bench_prompt(engine: Engine, prompt_len: int) -> list[int]:
    """The first prompt_len tokens of real text (wiki), so prefill sees a natural prompt."""
    ids = engine.tokenizer.encode(data.wiki_eval_text(), add_special=False)
    return (ids * (prompt_len // len(ids) + 1))[:prompt_len]


def _runner(engine: Engine, prompt: list[int], new_tokens: int, sampling: Sampling):
    """(prefill, whole): prefill alone, and whole(n): the whole generate of n tokens chosen by `sampling` (one
    executable for every n: the count is an operand and the cache is sized for 1 + new_tokens)."""
    _, cache_len = engine.plan(len(prompt), 1 + new_tokens)

    def prefill():
        jax.block_until_ready(engine.prefill(prompt, cache_len=cache_len, sampling=sampling)[0])

    def whole(n):   # every new token: no stop ids
        out = engine.generate(prompt, max_new_tokens=n, sampling=sampling, stop_ids=[], cache_len=cache_len)
        assert len(out) == n
        return out

    return prefill, whole


def engine_name(weights: str, layers: tuple[int, int] | None = None) -> str:
    """The name `pjinfer bench` gives the dense engine of a weights format in its results; with a layer split
    (backends.Plan.layers), how many layers ran in XLA."""
    name = "dense" if weights == "float32" else f"dense-{weights}"
    return name if layers is None else f"{name}-xla{layers[0]}"


class BenchError(ConfigError):
    """A measurement that cannot be true (a decode rate above the memory bandwidth): reported, not printed."""


def run(engines: dict[str, Engine], *, prompt_len: int, new_tokens: int, runs: int, peer: str | None = None,
        progress=None, bandwidth: float | None = None, sampling: Sampling = Sampling()) -> dict:
    """Rates of each engine and of the peer on the first engine's GGUF with as many threads as pjinfer's host kernels
    use by default (the cores this process may use): llama-cpp (llama.cpp through llama-cpp-python, timed here as the
    engines are), or a native peer, llama-bench or powerinfer (pjinfer.measure.native_peer: a subprocess per run, timed
    by its own output). An engine's decode is timed as generate(1 + new_tokens) minus the fastest generate(1) timed
    beside it (_timed), both with the same prompt: the prefill's time and noise cancel (subtracting a separately timed
    prefill reported llama.cpp faster after 512 tokens than after 16). Runs alternate between the engines and the peer
    so a noisy machine affects all alike; each figure is the median over runs, each ratio the median of the runs'
    ratios. "machine" holds the shares of CPU time stolen and used by other work during the runs
    (pjinfer.measure.machine); "peer" says what ran as the peer. An engine's "density": the share of FFN neurons its
    PowerInfer predictors chose over an untimed decode of the same request (predicted_density), None for other engines.
    bandwidth (bytes/s, default: measured here, again if a rate exceeds the first probe, and the better of the two
    kept): a decode rate that reads more than it from memory raises BenchError, where what a step reads from memory
    is at least its bytes less the CPU's last-level cache (machine.last_level_cache_bytes), which may hold that
    many of them from step to step (a model larger than the cache keeps part of itself there). Bytes per token
    within the cache are no bound at all (the engine's "fits_in_cache"). sampling: how the engines choose each
    token (default greedy); a peer chooses its own way (llama-bench samples nothing)."""
    first = next(iter(engines.values()))
    prompt = bench_prompt(first, prompt_len)
    _, cache_len = first.plan(prompt_len, 1 + new_tokens)
    runners = {name: _timed(_runner(e, prompt, new_tokens, sampling), new_tokens) for name, e in engines.items()}
    peer_info = None
    if peer is not None:
        name, runners[name], peer_info = _peer_runner(peer, first, prompt, new_tokens)
    for measure in runners.values():  # warm-up: compile all, and a first run of a native peer (page cache)
        measure()
    density = {name: predicted_density(e, prompt, new_tokens) for name, e in engines.items()}
    times = {name: ([], []) for name in runners}
    before = machine.sample()
    for r in range(runs):
        for name, measure in runners.items():
            prefill_s, decode_s = measure()
            times[name][0].append(prefill_s)
            times[name][1].append(decode_s)
        if progress:
            progress(r + 1, runs)
    busy = machine.shares(before, machine.sample())
    probe = bandwidth is None
    bandwidth = bandwidth or read_bandwidth()
    cache = machine.last_level_cache_bytes()
    results, decode_runs = {}, {}
    for name, (prefill_s, decode_s) in times.items():
        p = statistics.median(prefill_s) if None not in prefill_s else None   # llama-bench does not time a prompt
        decode_runs[name] = [new_tokens / max(t, 1e-9) for t in decode_s]
        decode = statistics.median(decode_runs[name])
        results[name] = {"prefill_tok_s": prompt_len / p if p else None, "decode_tok_s": decode,
                         "decode_ms_per_token": 1000 / decode, "prefill_s": p, "decode_runs_tok_s": decode_runs[name]}
        if name in engines:
            results[name]["density"] = density[name]
            results[name]["bytes_per_token"] = engine_bytes_per_token(engines[name], cache_len,
                                                                      prompt_len + new_tokens // 2, density[name])
            results[name]["device_weights_mb"] = state_bytes(engines[name]) / 1e6
        else:   # PowerInfer's sparse path runs the predictors pjinfer's sparse engine runs, on the same stream
            share = peer_density(peer_info, density)
            results[name]["bytes_per_token"] = gguf_bytes_per_token(first, prompt_len + new_tokens // 2, share)
        step_bytes = results[name]["bytes_per_token"]
        results[name]["fits_in_cache"] = cache is not None and step_bytes <= cache
        if from_memory(step_bytes, cache, decode) > bandwidth and probe:   # the probe may have run beside other
            bandwidth, probe = max(bandwidth, read_bandwidth()), False          # work: the best of two probes
        refuse_above_bandwidth(name, decode, step_bytes, cache, bandwidth)
    for name in results:  # median over runs of the pair's ratio: both ran back to back in each run
        results[name]["decode_over"] = {other: statistics.median(a / b for a, b in zip(decode_runs[name],
                                                                                       decode_runs[other]))
                                        for other in results if other != name}
    if peer:
        peer_name = peer_info["name"]
        for name in engines:
            results[name]["decode_over_peer"] = results[name]["decode_over"][peer_name]
            if results[peer_name]["prefill_s"]:
                results[name]["prefill_over_peer"] = results[peer_name]["prefill_s"] / results[name]["prefill_s"]
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "runs": runs, "engines": results,
            "read_bandwidth_gb_s": bandwidth / 1e9, "last_level_cache_mb": None if cache is None else cache / 1e6,
            "machine": busy, "peer": peer_info,
            "sampling": dataclasses.asdict(sampling)}


def from_memory(step_bytes: float, cache: int | None, decode: float) -> float:
    """The fewest bytes a second a decode at `decode` tok/s reads from memory: each step's bytes less what the
    last-level cache (`cache` bytes, None where unknown) may hold of them from step to step."""
    return max(0.0, step_bytes - (cache or 0)) * decode


def refuse_above_bandwidth(name: str, decode: float, step_bytes: float, cache: int | None, bandwidth: float):
    """Raise BenchError where a decode at `decode` tok/s would read more from memory (from_memory) than `bandwidth`
    bytes a second: the timing is wrong, not the engine."""
    rate = from_memory(step_bytes, cache, decode)
    if rate > bandwidth:
        held = f" beyond the {cache / 1e6:.0f} MB the last-level cache holds" if cache else ""
        raise BenchError(f"{name} decoded at {decode:.1f} tok/s, which reads {rate / 1e9:.1f} GB/s{held}, "
                         f"above the measured bandwidth of {bandwidth / 1e9:.1f} GB/s: the timing is wrong, not "
                         "the engine")


# The peer's row name in bench's results, by --peer.
PEER_NAMES = {"llama-cpp": "llama.cpp", "llama-bench": "llama-bench", "powerinfer": "powerinfer"}


def peer_density(peer_info: dict | None, density: dict) -> float | None:
    """For the peer's bytes per token only: PowerInfer running a file sparse reads about the share of FFN rows that
    pjinfer's sparse engine measured (the same predictors and threshold); None (every row) for other peers."""
    if not (peer_info or {}).get("sparse"):
        return None
    return next((d for d in density.values() if d is not None and d < 1), None)


def _timed(runner, new_tokens: int):
    """A (prefill, whole) pair as one measurement: () -> (prefill seconds, decode seconds of new_tokens). The decode
    is whole(1 + new_tokens) less the fastest whole(1) seen so far (one before and one after it in every call):
    other work only adds time, so a slow whole(1) would make the decode read fast, a slow whole(1 + new_tokens) slow
    (a whole(1) that ran beside a busy test worker once made 8 tokens read faster than the memory allows)."""
    prefill, whole = runner
    fastest_one = math.inf

    def measure():
        nonlocal fastest_one
        t0 = time.perf_counter(); prefill(); t1 = time.perf_counter()
        whole(1); t2 = time.perf_counter(); whole(1 + new_tokens); t3 = time.perf_counter()
        whole(1); t4 = time.perf_counter()
        fastest_one = min(fastest_one, t2 - t1, t4 - t3)
        return t1 - t0, (t3 - t2) - fastest_one

    return measure


def _peer_runner(peer: str, engine: Engine, prompt: list[int], new_tokens: int):
    """(row name, measure, info) of the peer on the engine's GGUF: measure() -> (prefill seconds or None, decode
    seconds of new_tokens); info: what runs (name, binary, build, model file) for the output."""
    threads = usable_cores()   # as many as pjinfer's host kernels use by default
    name = PEER_NAMES[peer]
    if peer == "llama-cpp":
        measure = _timed(llama_cpp_runner(engine.source, prompt, new_tokens, threads=threads), new_tokens)
        import llama_cpp

        info = {"name": name, "binary": "llama-cpp-python's token loop", "model": str(engine.source),
                "build": f"llama-cpp-python {llama_cpp.__version__}"}
        return name, measure, info

    if peer == "llama-bench":
        native = native_peer.llama_bench(engine.source, prompt_len=len(prompt), new_tokens=new_tokens, threads=threads)
    else:
        native = native_peer.powerinfer(engine.source, prompt_text=engine.tokenizer.decode(prompt),
                                        prompt_len=len(prompt), new_tokens=new_tokens, threads=threads)

    def measure():
        got = native.measure()
        return got["prefill_s"], new_tokens / got["decode_tok_s"]

    native.info["name"] = name
    return name, measure, native.info


def predicted_density(engine: Engine, prompt: list[int], new_tokens: int) -> float | None:
    """The share of FFN neurons a PowerInfer file's sparse host decode computes, over every layer and every decode
    step of a greedy run of new_tokens after prompt (its decoder's counts, read after each step: one step per
    jitted call, untimed). 1.0 for the file run dense; None for an engine without that decoder."""
    if not isinstance(engine.host, PredictedHostDecoder) or new_tokens < 2:
        return None
    computed = []
    for step, _ in enumerate(engine.stream(prompt, max_new_tokens=new_tokens, stop_ids=[], chunk=1)):
        if step:   # the first token comes from the prefill, which the host decoder does not run
            computed.append(int(engine.host.counts.sum()))
    return sum(computed) / (len(computed) * engine.config.n_layers * engine.config.d_ff)


def state_bytes(engine: Engine) -> int:
    """Bytes of everything the engine keeps on the accelerator (weights, hot rows, predictors)."""
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(engine.state))


def engine_bytes_per_token(engine: Engine, cache_len: int, mean_position: int, density: float | None = None) -> float:
    """Bytes one decode step reads: every weight once (a tied embedding once, as the head), the whole
    KV cache (XLA's attention reads every slot and masks), and for a sparse engine only the predicted-active
    share of the FFN rows, the share measured on the bench prompt. A host decode reads
    its stored weights and scales, and the cache up to the run's mean position; with input thresholds, less the
    columns of the inputs at or below them (their share measured on the bench prompt, teal.skipped_shares); a
    PowerInfer file's host decode, its FFN rows times density (predicted_density) when that is given."""
    config = engine.config
    model = nnx.merge(engine.graphdef, engine.state)
    if engine.host is not None:
        read = engine.host.nbytes
        if density is not None and isinstance(engine.host, PredictedHostDecoder):   # its predicted rows only
            read -= (1 - density) * sum(data.nbytes for data, _ in engine.host.ffn_rows.values())
        if engine.thresholds is not None:   # the inputs at or below their thresholds leave their columns unread
            read -= float((teal.skipped_shares(engine, bench_prompt(engine, 256)) * engine.host.input_bytes()).sum())
        return float(read + KVCache.nbytes(config, mean_position))
    total = state_bytes(engine)
    kv = KVCache.nbytes(config, cache_len)
    if not isinstance(model.layers[0].ffn, SparseFFN):
        return float(total + kv)
    ffn_rows = sum(np.asarray(p).nbytes for layer in model.layers
                   for p in (layer.ffn.w_gate, layer.ffn.w_up, layer.ffn.w_down_t) if p is not None)
    cold = model.layers[0].ffn.cold.nbytes
    active = 1.0 - skipped_share(engine, bench_prompt(engine, 256))
    return float(total - ffn_rows + active * (ffn_rows + cold) + kv)


def gguf_bytes_per_token(engine: Engine, mean_position: int, ffn_share: float | None = None) -> float:
    """What llama.cpp reads per decode step: the GGUF's tensors as stored (quantized; the tied embedding
    once, as the output head) and an f16 KV cache up to the mean position of the run. ffn_share: the share of a
    PowerInfer file's FFN neuron rows (ffn_gate, ffn_up, ffn_down_t) its sparse operators read (all by default)."""
    tensors = GGUFFile(engine.source).tensors   # pjinfer's reader: it reads PowerInfer's magic too
    names = {t.name for t in tensors}
    share = 1.0 if ffn_share is None else ffn_share

    def read(t) -> float:
        if t.name == "token_embd.weight" and "output.weight" in names:
            return 0.0   # with a separate output head, the embedding table is only looked up (one row per token)
        return t.data.nbytes * (share if t.name.endswith(NEURON_ROWS) else 1.0)

    return float(sum(read(t) for t in tensors) + engine.config.kv_cache_bytes(mean_position, 2))


NEURON_ROWS = (".ffn_gate.weight", ".ffn_up.weight", ".ffn_down_t.weight")   # a PowerInfer file's FFN rows


def read_bandwidth(megabytes: int | None = None, repeats: int = 5) -> float:
    """Measured memory read bandwidth in bytes/s: the best of a few parallel sums over a buffer larger than the
    caches (default: 512 MB, or twice the last-level cache where that is larger), on every core (a decode step has
    all of them)."""
    if megabytes is None:
        megabytes = machine.beyond_caches(512 << 20) >> 20
    @njit(parallel=True, fastmath=True, nogil=True)
    def total(a):
        s = 0.0
        for i in prange(a.shape[0]):
            s += a[i]
        return s

    a = np.ones(megabytes * (1 << 20) // 4, np.float32)
    total(a)
    best = min(_seconds(total, a) for _ in range(repeats))
    return a.nbytes / best


def _seconds(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def breakdown(engine: Engine, step_ms: float, *, prompt_len: int = 16, new_tokens: int = 128, repeats: int = 9,
              sampling: Sampling = Sampling()) -> list[dict]:
    """Where one decode step's time goes, as rows {part, ms, mb} (ms per token, median of repeats; mb: the bytes
    it reads, None where it reads no weights), the last row the whole step. On the dense host decode (host_stages)
    every stage of the layers and the head, timed inside the generate loop of prompt_len and new_tokens, whose own
    step ends the rows; on XLA, every layer's attention, FFN and the head as jitted functions at the loop's middle
    position, against step_ms (a token's time in the generate loop as run() measured it); on both, choosing the
    token as `sampling` does (sampling_ms), taken out of the rest of the step."""
    if engine.backend.host:
        if getattr(engine, "host", None) is None or engine.host.magic != host_decode.MAGIC:
            raise ConfigError("--breakdown times the dense host decode and XLA, not this engine's "
                              f"({engine.path})")
        rows = host_stages(engine, prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats, sampling=sampling)
    else:
        rows = xla_stages(engine, step_ms, position=prompt_len + new_tokens // 2, repeats=max(repeats, 20))
    choose = sampling_ms(engine.config.vocab_size, sampling, repeats)
    what = "greedy: the repetition penalty and argmax" if sampling.greedy else "the filters and the draw"
    rows[-2]["ms"] -= choose            # the rest of the step, less the sampling now timed on its own
    return rows[:-2] + [{"part": f"choosing the token ({what})", "ms": choose, "mb": None}] + rows[-2:]


SAMPLED_STEPS = 64   # sampling_ms's loop


def sampling_ms(vocab: int, sampling: Sampling, repeats: int) -> float:
    """One token's choice over `vocab` logits as the decode loop makes it (runtime.sampling.sample, with the key
    split and the repetition window's update), ms: a jitted loop of SAMPLED_STEPS choices over fixed random
    logits, median of repeats. The settings are traced, as in the decode loop: as constants, XLA drops a penalty
    of 1, and the choice, no longer reading the window the loop updates, would be hoisted out of it."""
    @jax.jit
    def loop(logits, key, recent, params):
        def step(_, carry):
            total, key, recent = carry
            key, sub = jax.random.split(key)
            token = sample(logits, sub, params, sampling.greedy, recent)
            return total + token, key, push_recent(recent, token)
        return jax.lax.fori_loop(0, SAMPLED_STEPS, step, (jnp.int32(0), key, recent))

    logits = jnp.asarray(np.random.default_rng(0).standard_normal(vocab).astype(np.float32) * 3)
    args = (logits, jax.random.key(sampling.seed), jnp.full(REPEAT_WINDOW, -1, jnp.int32),
            tuple(jnp.asarray(p) for p in sampling.params()))
    return _median_ms(lambda: jax.block_until_ready(loop(*args)), repeats) / SAMPLED_STEPS


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def host_stages(engine: Engine, *, prompt_len: int, new_tokens: int, repeats: int,
                sampling: Sampling = Sampling()) -> list[dict]:
    """The dense host decode's step part by part, timed where it runs: the handler's time-stamp counts
    (HostDecoder.clocked) over generate(1 + new_tokens) less those over generate(1), per decode step, against the step
    as run() times it (_timed), the median of `repeats`. Rows: each team stage as the calling thread sees it (its share,
    then the wait for the workers'), the rest of the layer calls on the calling thread (norms, RoPE, residuals, the
    cache write and attention's merge, the handler's checks), the head call; the waits at the stages' ends (inside those
    rows: the hand-offs and uneven shares); the host's calls together; and the rest of the measured step (XLA's
    embedding, norm and sampling, the loop, dispatch), up to the step's own time. Timed apart, a part whose weights fit
    in the last-level cache found them there, and the rest of the step looked like XLA's (docs/performance.md)."""
    host, c = engine.host, engine.config
    _, whole = _runner(engine, bench_prompt(engine, prompt_len), new_tokens, sampling)
    whole(1 + new_tokens)   # compiled
    parts, steps, fastest_one = [], [], math.inf
    for _ in range(repeats):
        with host.clocked() as clocks:
            c0, t0 = read_cycles(), time.perf_counter()
            whole(1)
            one, t1 = clocks.copy(), time.perf_counter()
            whole(1 + new_tokens)
            both, c2, t2 = clocks.copy(), read_cycles(), time.perf_counter()
            whole(1)
            t3 = time.perf_counter()
        fastest_one = min(fastest_one, t1 - t0, t3 - t2)
        # whole(1) calls the head once, for the prompt's token, as whole(1 + new_tokens) does before its steps
        parts.append((both - 2 * one) * ((t2 - t0) / (c2 - c0) * 1000 / new_tokens))   # ms a step
        steps.append(1000 * (t2 - t1 - fastest_one) / new_tokens)
    ms = np.median(np.stack(parts), axis=0)
    step = statistics.median(steps)
    mb = {slot: sum(host._quantized[(l, slot)].nbytes for l in range(c.n_layers)) / 1e6
          for slot in host_decode.MATRICES.values()}
    mean_position = prompt_len + new_tokens // 2
    cache_mb = 2 * c.n_layers * mean_position * c.n_kv_heads * c.head_dim * 2 / 1e6
    rows = [
        {"part": "q, k, v", "ms": ms[host_decode.ST_QKV],
         "mb": mb[host_decode.L_Q] + mb[host_decode.L_K] + mb[host_decode.L_V]},
        {"part": "attention (scores, softmax, V)", "ms": ms[host_decode.ST_ATTN], "mb": cache_mb},
        {"part": "o", "ms": ms[host_decode.ST_O], "mb": mb[host_decode.L_O]},
        {"part": "gate, up, activation", "ms": ms[host_decode.ST_GATE_UP],
         "mb": mb[host_decode.L_GATE] + mb[host_decode.L_UP]},
        {"part": "down", "ms": ms[host_decode.ST_DOWN], "mb": mb[host_decode.L_DOWN]},
    ]
    layers, head = ms[host_decode.CLK_LAYERS], ms[host_decode.CLK_HEADS]
    rows += [{"part": "calling thread (norms, RoPE, residuals, cache write)", "ms": layers - sum(r["ms"] for r in rows),
              "mb": None},
             {"part": "head", "ms": head, "mb": host._head.nbytes / 1e6},
             {"part": "waiting for the other threads (in the stages above)", "ms": ms[host_decode.CLK_WAIT],
              "mb": None},
             {"part": "host step (the layers and the head)", "ms": layers + head, "mb": None},
             {"part": "outside the host's calls (XLA, dispatch, the loop)", "ms": step - layers - head, "mb": None},
             {"part": "step in the generate loop", "ms": step, "mb": host.nbytes / 1e6 + cache_mb}]
    return rows


def xla_stages(engine: Engine, step_ms: float, *, position: int, repeats: int) -> list[dict]:
    """XLA's step: every layer's attention, every layer's FFN and the output head, each timed as its own jitted
    function on a one-token input, against the generate loop's step (step_ms; the rest is embedding, norms,
    sampling and hand-overs: breakdown times the sampling on its own)."""
    graphdef, state = engine.graphdef, engine.state
    cache = KVCache.create(engine.config, 1, max(position + 1, 16))
    pos = jnp.int32(position)
    # Real inputs: each layer's FFN input for the last of 32 tokens of real text (a sparse FFN's work
    # depends on what its predictor sees).
    text = jnp.asarray(bench_prompt(engine, 32))[None]
    _, ffn_inputs, residuals = nnx.merge(graphdef, state).forward_sequence(text, capture=True, residuals=True)
    xs = [x[:, -1:] for x in ffn_inputs]
    rs = [r[:, -1:] for r in residuals]
    x = xs[0]

    @jax.jit
    def attention(state, x, cache):
        model = nnx.merge(graphdef, state)
        return [layer.attn(layer.attn_norm(x), pos, k, v)[0] for layer, k, v in zip(model.layers, cache.k, cache.v)]

    @jax.jit
    def ffn(state, xs, rs):
        # Chained through a zero-weighted dependency so the layers run one after another, as in a step
        # (independent calls could overlap, and CPU-side sparse layers would then contend for threads).
        model = nnx.merge(graphdef, state)
        y = jnp.zeros_like(xs[0])
        for layer, x, r in zip(model.layers, xs, rs):
            y = layer.ffn(x + 0.0 * y, residual=r)
        return y

    @jax.jit
    def head(state, x):
        return nnx.merge(graphdef, state).logits(x)

    def ms(fn, *args):
        return _median_ms(lambda: jax.block_until_ready(fn(*args)), repeats)

    rows = [{"part": "attention", "ms": ms(attention, state, x, cache), "mb": None},
            {"part": "ffn", "ms": ms(ffn, state, xs, rs), "mb": None},
            {"part": "head", "ms": ms(head, state, x), "mb": None}]
    rows += [{"part": "rest of the step", "ms": step_ms - sum(r["ms"] for r in rows), "mb": None},
             {"part": "step in the generate loop", "ms": step_ms, "mb": None}]
    return rows
