"""Batched decoding for the server: up to max_batch requests advance one token each in one jitted step.

``Batch(engine, max_batch)`` holds a pool of KV caches, one slot per request ([max_batch, S, KV, hd] per layer), and
the ``cpu_offload.batched_decode.BatchDecoder`` of the engine's host decoder. A request:

    state = batch.start(slot, prompt_ids, max_new_tokens, sampling)   # its own prefill (as Engine.stream's), its
                                                                      # cache copied into the slot; state.token is
                                                                      # its first token
    batch.step([state, ...])                                          # one token for every state given (their
                                                                      # slots), state.token the next one

A slot with no state in a step is skipped by the host kernels (position -1), so requests join and leave between
steps without recompiling: one executable per (pool length, sampling mode). The pool length S is a power of two
that grows, once, to the longest cache a request has asked for (``Engine.plan``'s bucket).

Every request's tokens are Engine.stream's for it alone, bit for bit: the same prefill and key splits, the host
layers and head give each slot the single-token decoder's numbers (batched_decode), and the XLA parts around them
(embedding rows, final norm, repetition penalty, argmax or sampling) work on each row on its own.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pjinfer.runtime import generate as gen
from pjinfer.runtime.model import KVCache, embedding_rows
from pjinfer.runtime.sampling import Sampling, recent_ids, sample


def unsupported(engine) -> str | None:
    """Why `engine` cannot decode in batches (None when it can): the batched step runs the dense host decode."""
    from cpu_offload.decoder import HostDecoder

    host = engine.host
    # --weights gguf is HostDecoder too, but its blocks (and head) are other types: the batched kernels read Q4_1
    # and int8 only.
    if type(host) is not HostDecoder or engine.bundle is not None or engine.weights_format not in ("q4_1", "int8"):
        return (f"batched decode runs the dense host decode (--weights q4_1 or int8, no bundle); this engine runs "
                f"{engine.path}")
    return None


@dataclasses.dataclass
class State:
    """One request in the batch: its slot, the token it feeds next (its newest), how many it has produced, its
    key (as key data), its repetition window and its sampling."""
    slot: int
    token: int
    produced: int
    position: int           # where `token` goes in the cache
    key: np.ndarray
    recent: np.ndarray
    sampling: Sampling


@partial(jax.jit, donate_argnames=("pool",))
def _insert(pool: KVCache, cache: KVCache, slot):
    """Copy a request's prefill cache [1, L, KV, hd] into rows [slot, :L] of the pool (in place)."""
    put = lambda p, c: jax.lax.dynamic_update_slice(p, c, (slot, 0, 0, 0))  # noqa: E731
    return KVCache(k=[put(p, c) for p, c in zip(pool.k, cache.k)], v=[put(p, c) for p, c in zip(pool.v, cache.v)])


@partial(jax.jit, static_argnames=("length",))
def _grow(pool: KVCache, length):
    pad = lambda p: jnp.pad(p, ((0, 0), (0, length - p.shape[1]), (0, 0), (0, 0)))  # noqa: E731
    return KVCache(k=[pad(p) for p in pool.k], v=[pad(p) for p in pool.v])


@partial(jax.jit, static_argnames=("graph", "decoder", "mode"), donate_argnames=("pool",))
def _step(graph, state, decoder, tokens, pos, pool, keys, params, recent, greedy, *, mode):
    """tokens, pos [B] (pos -1: empty slot), keys [B, 2] key data, params: Sampling.params() stacked [B] each,
    recent [B, window], greedy [B] -> (next tokens [B], pool, keys [B, 2]). mode "greedy": every live slot is
    greedy (argmax only); "mixed": sample every slot, greedy ones take the argmax."""
    model = graph.merge(state)
    x = embedding_rows(model.embed, tokens[:, None])                       # [B, 1, d]
    ks, vs = [], []
    for l, (k, v) in enumerate(zip(pool.k, pool.v)):
        x, k, v = decoder.layer(l, x, pos, k, v)
        ks.append(k)
        vs.append(v)
    hidden = model.final_norm(x)[:, 0]
    logits = decoder.head(hidden, pos)
    split = jax.vmap(jax.random.split)(jax.random.wrap_key_data(keys))
    keys, subs = split[:, 0], split[:, 1]
    argmax = jax.vmap(lambda lg, r, p: sample(lg, None, p, True, r))(logits, recent, params)
    if mode == "greedy":
        out = argmax
    else:
        drawn = jax.vmap(lambda lg, k, r, p: sample(lg, k, p, False, r))(logits, subs, recent, params)
        out = jnp.where(greedy, argmax, drawn)
    return out, KVCache(k=ks, v=vs), jax.random.key_data(keys)


class Batch:
    def __init__(self, engine, max_batch: int):
        from cpu_offload.batched_decode import BatchDecoder

        reason = unsupported(engine)
        if reason:
            raise ValueError(reason)
        self.engine, self.max_batch = engine, max_batch
        self.decoder = BatchDecoder(engine.host, max_batch)
        self.pool = KVCache.create(engine.config, max_batch, gen.MIN_CACHE_BUCKET)
        self.widest = 0     # the most requests one step has advanced (for tests and logs)

    def start(self, slot: int, prompt_ids, max_new_tokens: int, sampling: Sampling) -> State:
        """Prefill a request (Engine.plan refuses what the context cannot hold) into `slot`."""
        e = self.engine
        _, cache_len = e.plan(len(prompt_ids), max_new_tokens)
        key, sub = jax.random.split(jax.random.key(sampling.seed))
        token, cache = e.prefill(prompt_ids, cache_len=cache_len, sampling=sampling, key=sub)
        if cache_len > self.pool.length:
            self.pool = _grow(self.pool, length=cache_len)
        self.pool = _insert(self.pool, cache, jnp.int32(slot))
        return State(slot, int(token), 0, len(prompt_ids) - 1, np.asarray(jax.random.key_data(key)),
                     recent_ids(prompt_ids), sampling)

    def step(self, states: list[State]) -> None:
        """One token for each state (state.token fed at its next position, the new one stored in state.token)."""
        b = self.max_batch
        self.widest = max(self.widest, len(states))
        tokens, pos = np.zeros(b, np.int32), np.full(b, -1, np.int32)
        keys = np.zeros((b, 2), np.uint32)
        recent = np.full((b, len(states[0].recent)), -1, np.int32)
        params = [np.zeros(b, np.asarray(p).dtype) for p in Sampling().params()]
        greedy = np.ones(b, bool)
        for s in states:
            s.position += 1
            s.recent = np.append(s.recent[1:], np.int32(s.token))
            tokens[s.slot], pos[s.slot], keys[s.slot], recent[s.slot] = s.token, s.position, s.key, s.recent
            for arr, value in zip(params, s.sampling.params()):
                arr[s.slot] = np.asarray(value)
            greedy[s.slot] = s.sampling.greedy
        mode = "greedy" if greedy.all() else "mixed"
        e = self.engine
        out, self.pool, keys = _step(e.graph, e.state, self.decoder, jnp.asarray(tokens), jnp.asarray(pos),
                                     self.pool, jnp.asarray(keys), tuple(jnp.asarray(p) for p in params),
                                     jnp.asarray(recent), jnp.asarray(greedy), mode=mode)
        out, keys = np.asarray(out), np.asarray(keys)
        for s in states:
            s.token, s.key = int(out[s.slot]), keys[s.slot]
            s.produced += 1
