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
