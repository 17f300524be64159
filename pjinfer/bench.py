"""Prefill and decode rates of the jitted generate, measured after a warm-up, median of several runs."""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pjinfer import data
from pjinfer import generate as gen
from pjinfer.engine import Engine
from pjinfer.sampling import Sampling


def bench_prompt(engine: Engine, prompt_len: int) -> list[int]:
    """The first prompt_len tokens of real text (wiki), so prefill sees a natural prompt."""
    ids = engine.tokenizer.encode(data.wiki_eval_text(), add_special=False)
    return (ids * (prompt_len // len(ids) + 1))[:prompt_len]


def run(engine: Engine, *, prompt_len: int, new_tokens: int, runs: int, progress=None) -> dict:
    prompt = bench_prompt(engine, prompt_len)
    padded, cache_len = engine.plan(prompt_len, new_tokens)
    greedy = Sampling()
    tokens = engine.pad_prompt(prompt, padded)
    length = jnp.int32(prompt_len)
    key = jax.random.key(0)
    no_stop = jnp.full((gen.MAX_STOP_IDS,), -1, jnp.int32)   # always run all new tokens

    def prefill():
        token, cache = gen.prefill(engine.graphdef, engine.state, tokens, length, key, greedy.params(),
                                   cache_len=cache_len, greedy=True)
        jax.block_until_ready(token)

    def whole():
        out, n = gen.generate_tokens(engine.graphdef, engine.state, tokens, length, key, greedy.params(),
                                     jnp.int32(new_tokens), no_stop, cache_len=cache_len, greedy=True)
        assert int(n) == new_tokens
        return out

    prefill(), whole()  # warm-up: compile both
    prefill_s, total_s = [], []
    for r in range(runs):
        t0 = time.perf_counter(); prefill(); t1 = time.perf_counter(); whole(); t2 = time.perf_counter()
        prefill_s.append(t1 - t0)
        total_s.append(t2 - t1)
        if progress:
            progress(r + 1, runs)
    p = statistics.median(prefill_s)
    # generate = prefill + (new_tokens - 1) decode steps; the decode rate is what remains after prefill.
    decode = [(new_tokens - 1) / max(t - p, 1e-9) for t in total_s]
    return {
        "prompt_len": prompt_len, "new_tokens": new_tokens, "runs": runs,
        "prefill_tok_s": prompt_len / p, "decode_tok_s": statistics.median(decode),
        "decode_ms_per_token": 1000 / statistics.median(decode),
        "generate_s": statistics.median(total_s), "prefill_s": p,
        "weights_mb": sum(np.asarray(x).nbytes for x in jax.tree.leaves(engine.state)) / 1e6,
    }


def breakdown(engine: Engine, *, cache_len: int = 256, repeats: int = 20) -> dict:
    """Where one decode step's time goes: every layer's attention, every layer's FFN and the output
    head, each timed as its own jitted function on a one-token input (median ms), against the whole step."""
    from flax import nnx

    from pjinfer.model import KVCache

    graphdef, state = engine.graphdef, engine.state
    x = jnp.ones((1, 1, engine.config.d_model), jnp.float32) * 0.1
    cache = KVCache.create(engine.config, 1, cache_len)
    pos = jnp.int32(cache_len // 2)

    @jax.jit
    def attention(state, x, cache):
        model = nnx.merge(graphdef, state)
        return [layer.attn(layer.attn_norm(x), pos, k, v)[0] for layer, k, v in zip(model.layers, cache.k, cache.v)]

    @jax.jit
    def ffn(state, x):
        model = nnx.merge(graphdef, state)
        return [layer.ffn(layer.ffn_norm(x)) for layer in model.layers]

    @jax.jit
    def head(state, x):
        return nnx.merge(graphdef, state).logits(x)

    @jax.jit
    def step(state, token, cache):
        return gen._step(nnx.merge(graphdef, state), token, pos, cache)

    def ms(fn, *args):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t)
        return 1000 * statistics.median(times)

    parts = {"attention_ms": ms(attention, state, x, cache), "ffn_ms": ms(ffn, state, x),
             "head_ms": ms(head, state, x), "step_ms": ms(step, state, jnp.int32(7), cache)}
    parts["other_ms"] = parts["step_ms"] - parts["attention_ms"] - parts["ffn_ms"] - parts["head_ms"]
    return parts
