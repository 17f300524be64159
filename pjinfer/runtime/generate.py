"""Jitted prefill, chunks of decode steps and scoring over a static-size KV cache.

Shapes are bucketed so a handful of executables serve every request: the prompt is padded to a
power of two (at least 16) and the cache to a power of two (at least 256) that holds prompt plus
new tokens. Each function takes the model as `split` gives it, (graph, state): graph (a `Graph`) is static, state
the list of its arrays, so nothing recompiles when the values change.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from pjinfer.runtime import host
from pjinfer.runtime.model import KVCache
from pjinfer.runtime.sampling import argmax, push_recent, recent_window, sample

MIN_PROMPT_BUCKET = 16
MIN_CACHE_BUCKET = 256
MAX_STOP_IDS = 8
STREAM_CHUNK = 8   # decode steps per dispatch when streaming (Engine.stream; the server's scheduler too)


class Graph:
    """A model's nnx graphdef and the layout of its state's leaves, as a jit static argument, hashed once: jit
    hashes its static arguments on every call, and flax's GraphDef hashes its whole node tree each time (a large
    share of a decode step). The state travels as the flat list of its arrays (`split`): jit flattens a list in
    C++, an nnx.State through a Python callback per variable on every call."""
    __slots__ = ("graphdef", "treedef", "_hash")

    def __init__(self, graphdef, treedef):
        self.graphdef, self.treedef, self._hash = graphdef, treedef, hash((graphdef, treedef))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Graph) and self.graphdef == other.graphdef
                                 and self.treedef == other.treedef)

    def merge(self, leaves):
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.treedef, leaves))


def split(graphdef, state) -> tuple[Graph, list]:
    """(graph, leaves): the model (nnx.split's two parts) as every function here takes it."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    return Graph(graphdef, treedef), leaves


def bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


def _prefill(model, tokens, length, cache_len, rows):
    """tokens [1, Tp] (padded), length = real prompt length -> logits of the last real token, cache. rows: None
    (XLA) or how the host runs the prompt (Engine.prompt_rows, pjinfer.runtime.host.prefill)."""
    cache = KVCache.create(model.config, 1, cache_len)
    if rows is not None:
        return host.prefill(model, rows, tokens, length, cache)
    hidden, cache = model(tokens, 0, cache)
    last = jax.lax.dynamic_index_in_dim(hidden[0], length - 1, keepdims=False)
    return model.head.decode(last), cache   # one token's logits: on the host decoder where there is one


@partial(jax.jit, static_argnames=("graph", "cache_len", "greedy", "rows"))
def prefill(graph, state, tokens, length, key, params, *, cache_len, greedy, rows=None):
    """Run the prompt (on the host when `rows` is its prompt decoder) and sample the first new token."""
    logits, cache = _prefill(graph.merge(state), tokens, length, cache_len, rows)
    return sample(logits, key, params, greedy, recent_window(tokens[0], length)), cache


def _decode_loop(model, out, n, limit, start, cache, key, recent, params, stop_ids, greedy):
    """Decode steps while n < limit and no stop id came: each feeds out[n - 1] at position start + n - 1 and writes
    the token it samples to out[n]. Returns (out, n, cache, key, recent); the last token written may be a stop id.
    `recent` is the repetition penalty's window of the ids before out[n - 1]."""
    def cond(carry):
        n, _, _, _, _, done = carry
        return (n < limit) & ~done

    def body(carry):
        n, out, cache, key, recent, _ = carry
        key, sub = jax.random.split(key)
        recent = push_recent(recent, out[n - 1])
        logits, cache = model.decode(out[n - 1], start + n - 1, cache)
        token = sample(logits, sub, params, greedy, recent)
        return n + 1, out.at[n].set(token), cache, key, recent, jnp.isin(token, stop_ids)

    n, out, cache, key, recent, _ = jax.lax.while_loop(cond, body, (n, out, cache, key, recent, jnp.bool_(False)))
    return out, n, cache, key, recent


@partial(jax.jit, static_argnames=("graph", "chunk", "greedy"), donate_argnames=("cache",))
def decode_chunk(graph, state, token, pos, cache, key, params, recent, stop_ids, count, *, chunk, greedy):
    """Up to `count` (<= chunk) decode steps from `token` (fed at position `pos`, not in the cache yet), stopping
    after a stop id: (tokens [chunk], how many are new, cache, key, recent). The cache is updated in place;
    `recent` is the window of the ids before `token`. A chunk of steps is one dispatch: a Python call per token
    cost a third of a step on the host decode."""
    out = jnp.zeros((chunk + 1,), jnp.int32).at[0].set(token)
    out, n, cache, key, recent = _decode_loop(graph.merge(state), out, jnp.int32(1), count + 1, pos, cache, key,
                                              recent, params, stop_ids, greedy)
    return out[1:], n - 1, cache, key, recent


@partial(jax.jit, static_argnames=("graph", "cache_len"))
def stepped_logprobs(graph, state, tokens, steps, *, cache_len):
    """Scoring through one-token decode steps, for a model whose only path is the decode step (tensor parallel):
    tokens [1, T] (T >= 2), the first `steps` of them decoded (1 <= steps <= T <= cache_len). Returns
    token_logprobs' pair for the sequence ([1, T-1], set for the tokens 1..steps, 0 and False after) and the
    log-probabilities over the vocabulary after the last step, [1, vocab] (last_logprobs')."""
    model = graph.merge(state)
    n = tokens.shape[1] - 1

    def step(t, carry):
        cache, logp, greedy, _ = carry
        logits, cache = model.decode(tokens[0, t], t, cache)
        lp = jax.nn.log_softmax(logits.astype(jnp.float32))
        i = jnp.minimum(t, n - 1)            # t == n (the last token decoded) has no next token to score
        target, scored = tokens[0, i + 1], t < n
        logp = logp.at[i].set(jnp.where(scored, lp[target], logp[i]))
        greedy = greedy.at[i].set(jnp.where(scored, argmax(lp) == target, greedy[i]))
        return cache, logp, greedy, lp

    carry = (KVCache.create(model.config, 1, cache_len), jnp.zeros(n, jnp.float32), jnp.zeros(n, bool),
             jnp.zeros(model.config.vocab_size, jnp.float32))
    _, logp, greedy, last = jax.lax.fori_loop(0, steps, step, carry)
    return logp[None], greedy[None], last[None]


@partial(jax.jit, static_argnames=("graph",))
def token_logprobs(graph, state, tokens):
    """tokens [B, T] -> (log p(tokens[:, t] | tokens[:, :t]), whether tokens[:, t] is the argmax) for
    t = 1..T-1, both [B, T-1]."""
    model = graph.merge(state)
    hidden = model.forward_sequence(tokens)
    logp = jax.nn.log_softmax(model.logits(hidden[:, :-1]).astype(jnp.float32), axis=-1)
    target = tokens[:, 1:]
    return jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0], jnp.argmax(logp, axis=-1) == target


@partial(jax.jit, static_argnames=("graph",))
def last_logprobs(graph, state, tokens, lengths):
    """tokens [B, T], lengths [B] -> log p(next token | tokens[b, :lengths[b]]) over the vocabulary, [B, V]."""
    model = graph.merge(state)
    hidden = model.forward_sequence(tokens)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return jax.nn.log_softmax(model.logits(last).astype(jnp.float32), axis=-1)
