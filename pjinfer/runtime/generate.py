"""Jitted prefill, decode step and whole-sequence generate over a static-size KV cache.

Shapes are bucketed so a handful of executables serve every request: the prompt is padded to a
power of two (at least 16) and the cache to a power of two (at least 256) that holds prompt plus
new tokens. Each function takes the model split into (graphdef, state): graphdef is static, state
is a pytree of weights, so nothing recompiles when the values change.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from pjinfer.runtime.model import KVCache
from pjinfer.runtime.sampling import push_recent, recent_window, sample

MIN_PROMPT_BUCKET = 16
MIN_CACHE_BUCKET = 256
MAX_STOP_IDS = 8


def bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


def _prefill(model, tokens, length, cache_len):
    """tokens [1, Tp] (padded), length = real prompt length -> logits of the last real token, cache."""
    cache = KVCache.create(model.config, 1, cache_len)
    hidden, cache = model(tokens, 0, cache)
    last = jax.lax.dynamic_index_in_dim(hidden[0], length - 1, keepdims=False)
    return model.logits(last), cache


@partial(jax.jit, static_argnames=("graphdef", "cache_len", "greedy"))
def prefill(graphdef, state, tokens, length, key, params, *, cache_len, greedy):
    """Run the prompt and sample the first new token."""
    logits, cache = _prefill(nnx.merge(graphdef, state), tokens, length, cache_len)
    return sample(logits, key, params, greedy, recent_window(tokens[0], length)), cache


@partial(jax.jit, static_argnames=("graphdef", "greedy"), donate_argnames=("cache",))
def decode_step(graphdef, state, token, pos, cache, key, params, recent, *, greedy):
    """Feed `token` at position `pos`, sample the next one; the cache is updated in place. `recent` is the
    repetition penalty's window of the ids before the next one (sampling.recent_window, `token` included)."""
    logits, cache = nnx.merge(graphdef, state).decode(token, pos, cache)
    return sample(logits, key, params, greedy, recent), cache


@partial(jax.jit, static_argnames=("graphdef", "cache_len", "greedy"))
def generate_tokens(graphdef, state, tokens, length, key, params, max_new, stop_ids, *, cache_len, greedy):
    """Prefill, then a lax.while_loop of decode steps until max_new tokens or a stop id.

    Returns (ids [cache_len], count): the first `count` ids are the generated ones (a final stop id
    included).
    """
    model = nnx.merge(graphdef, state)
    key, sub = jax.random.split(key)
    logits, cache = _prefill(model, tokens, length, cache_len)
    recent = recent_window(tokens[0], length)
    first = sample(logits, sub, params, greedy, recent)
    out = jnp.zeros((cache_len,), jnp.int32).at[0].set(first)

    def cond(carry):
        n, _, _, _, _, done = carry
        return (n < max_new) & ~done

    def body(carry):
        n, out, cache, key, recent, _ = carry
        key, sub = jax.random.split(key)
        recent = push_recent(recent, out[n - 1])
        logits, cache = model.decode(out[n - 1], length + n - 1, cache)
        token = sample(logits, sub, params, greedy, recent)
        return n + 1, out.at[n].set(token), cache, key, recent, jnp.isin(token, stop_ids)

    carry = (jnp.int32(1), out, cache, key, recent, jnp.isin(first, stop_ids))
    n, out, *_ = jax.lax.while_loop(cond, body, carry)
    return out, n


@partial(jax.jit, static_argnames=("graphdef",))
def token_logprobs(graphdef, state, tokens):
    """tokens [B, T] -> (log p(tokens[:, t] | tokens[:, :t]), whether tokens[:, t] is the argmax) for
    t = 1..T-1, both [B, T-1]."""
    model = nnx.merge(graphdef, state)
    hidden = model.forward_sequence(tokens)
    logp = jax.nn.log_softmax(model.logits(hidden[:, :-1]).astype(jnp.float32), axis=-1)
    target = tokens[:, 1:]
    return jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0], jnp.argmax(logp, axis=-1) == target
