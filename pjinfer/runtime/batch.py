"""The one decode loop: requests in slots, advanced together. `pjinfer generate`, `chat`, `eval` and the server's
scheduler all run it; a single request is a batch of one.

``Batch(engine, max_batch)`` holds up to max_batch requests, one per slot:

    prefix = batch.prefill(prompt_ids, max_new_tokens, sampling)      # the prompt run (Engine.prefill): its first
                                                                      # token and its cache, in no slot yet
    state = batch.insert(prefix, slot)                                # the request takes `slot`
    (batch.start(slot, prompt_ids, ...) does both; state.token is the request's first token)
    batch.step([state, ...], steps=8)                                 # up to 8 tokens for every state given, in
                                                                      # state.new
    batch.wake()                                                      # from any thread: step() returns after its
    batch.clear_wake()                                                # current decode step, until cleared

How a step runs depends on the engine's backend (pjinfer.runtime.backends: its `batched` column):
- together, where the backend batches and max_batch > 1: a pool of KV caches ([max_batch, S, KV, hd] per
  layer), every decode step reading the weights once for all slots, several steps per jitted call. The layers
  are the ``cpu_offload.batched_decode.BatchDecoder`` of the engine's host decoder, or, in XLA, the model's own
  layers with a position per row. A slot with no state in a step is skipped (position -1: the host kernels skip
  it, XLA writes nothing to its cache), so requests join and leave between calls without recompiling: one
  executable per (pool length, sampling mode, steps), and in XLA per width (Batch._rows). The pool length S is a
  power of two that grows, once, to the longest cache a request has asked for (``Engine.plan``'s bucket). wake()
  makes the running call return after its current step, so a joining request does not wait for the rest of it.
- in turns otherwise (and for a batch of one): each slot keeps its own cache, and a step gives each state up to
  `steps` tokens from one jitted loop of one-token decode steps (``generate.decode_chunk``), one state after
  another; after wake() the states not reached yet wait for the next call, which starts where this one stopped.

On the host, every request's tokens are the same, bit for bit, whatever else runs beside it: the same prefill
and key splits, the host layers and head give each slot the single-token decoder's numbers (batched_decode), and
the XLA parts around them (embedding rows, final norm, repetition penalty, argmax or sampling) work on each row on
its own. In XLA a step's matrix products take every slot's row at once, and a product of several rows rounds
differently from one row's (in the last bits): a request's logits agree with its single run to rounding, not
bit for bit; so do a layer split's, whose host layers read what its XLA layers computed.
"""
from __future__ import annotations

import dataclasses
import threading
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from cpu_offload.batched_decode import BatchDecoder
from pjinfer.runtime import generate as gen
from pjinfer.runtime.backends import BACKENDS
from pjinfer.runtime.host import HostBlock, HostHead
from pjinfer.runtime.model import KVCache
from pjinfer.runtime.sampling import Sampling, recent_ids, sample


def unsupported(engine) -> str | None:
    """Why `engine` cannot decode in batches (None when it can): its backend's row in
    pjinfer.runtime.backends.BACKENDS says whether it batches."""
    if engine.backend.parallel:
        return f"a tensor-parallel engine ({engine.path}) decodes one request at a time"
    if not engine.backend.batched:
        weights = " or ".join(w for b in BACKENDS if b.batched and not b.split for w in b.weights)
        return f"batched decode runs dense weights (--weights {weights}, no bundle); this engine runs {engine.path}"
    return None


class _Wake:
    """The wake flag of a batch whose layers run in XLA (no host decoder to hold it): woken() reads it inside
    jit, through a host callback once a step."""

    def __init__(self):
        self._set = threading.Event()

    def woken(self):
        return io_callback(lambda: np.int32(self._set.is_set()), jax.ShapeDtypeStruct((), jnp.int32))

    def wake(self) -> None:
        self._set.set()

    def clear_wake(self) -> None:
        self._set.clear()


@dataclasses.dataclass
class State:
    """One request in the batch: its slot, the token it feeds next (its newest), how many more it may produce,
    its position (where `token` goes in the cache is position + 1), its key (as key data), its repetition window
    (the ids before `token`), its stop ids (int32 [MAX_STOP_IDS], -1 padded), its sampling, and the tokens the
    last `Batch.step` gave it (`new`)."""
    slot: int
    token: int
    remaining: int
    position: int
    key: np.ndarray
    recent: np.ndarray
    stops: np.ndarray
    sampling: Sampling
    new: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Prefix:
    """A prefilled request not in a slot yet (Batch.prefill): its state (slot -1) and its cache [1, L, KV, hd]."""
    state: State
    cache: KVCache


@partial(jax.jit, donate_argnames=("pool",))
def _insert(pool: KVCache, cache: KVCache, slot):
    """Copy a request's prefill cache [1, L, KV, hd] into rows [slot, :L] of the pool (in place)."""
    put = lambda p, c: jax.lax.dynamic_update_slice(p, c, (slot, 0, 0, 0))  # noqa: E731
    return KVCache(k=[put(p, c) for p, c in zip(pool.k, cache.k)], v=[put(p, c) for p, c in zip(pool.v, cache.v)])


@partial(jax.jit, static_argnames=("length",))
def _grow(pool: KVCache, length):
    pad = lambda p: jnp.pad(p, ((0, 0), (0, length - p.shape[1]), (0, 0), (0, 0)))  # noqa: E731
    return KVCache(k=[pad(p) for p in pool.k], v=[pad(p) for p in pool.v])


@partial(jax.jit, static_argnames=("graph", "decoder", "waker", "mode", "steps"), donate_argnames=("pool",))
def _steps(graph, state, decoder, waker, rows, tokens, pos, remaining, stops, pool, keys, params, recent, greedy, *,
           mode, steps):
    """Up to `steps` decode steps of every live slot (pos >= 0, the position its token goes to): each step feeds
    every live slot's token and samples its next one. decoder: the host's BatchDecoder, or None for the model's
    own layers and head in XLA (a layer split: the model's layers before its HostBlocks, and its head when it is not a
    HostHead). rows: None (the pool's slots in order), or the pool's slots that tokens [B] and the
    other per-slot arguments stand for. A slot leaves the loop after its `remaining` tokens or a stop id (stops
    [B, MAX_STOP_IDS]); the loop ends when no slot is live, after `steps`, or after the step during which the host
    called waker.wake(). keys [B, 2] key data, params: Sampling.params() stacked [B] each, recent [B, window] the
    ids before each token, greedy [B]. mode "greedy": every live slot is greedy (argmax only); "mixed": each live
    slot samples as its request asks, the greedy ones by argmax. Returns (out [steps, B], count [B]: the tokens
    each slot produced, in out[:count[b], b]; pool, keys, recent)."""
    model = graph.merge(state)
    whole = pool
    if rows is not None:       # the slots this call steps, gathered from the pool and written back at the end
        pool = KVCache(k=[p[rows] for p in whole.k], v=[p[rows] for p in whole.v])
    def layer(l, x, pos, k, v):
        on_host = decoder is not None and isinstance(model.layers[l], HostBlock)
        return decoder.layer(l, x, pos, k, v) if on_host else model.layers[l].decode(x, pos, k, v)

    def head(hidden, pos):
        return decoder.head(hidden, pos) if isinstance(model.head, HostHead) else model.head(hidden)

    def step(carry):
        n, out, count, tokens, pos, remaining, pool, keys, recent, _ = carry
        live = pos >= 0
        recent = jnp.where(live[:, None], jnp.concatenate([recent[:, 1:], tokens[:, None]], axis=1), recent)
        x = model.inputs(tokens[:, None], pos)                                 # [B, 1, d]
        ks, vs = [], []
        for l, (k, v) in enumerate(zip(pool.k, pool.v)):
            x, k, v = layer(l, x, pos, k, v)
            ks.append(k)
            vs.append(v)
        hidden = model.final_norm(x)[:, 0]
        logits = head(hidden, pos)
        split = jax.vmap(jax.random.split)(jax.random.wrap_key_data(keys))
        next_keys, subs = split[:, 0], split[:, 1]
        if mode == "greedy":
            new = jax.vmap(lambda lg, r, p: sample(lg, None, p, True, r))(logits, recent, params)
        else:   # row by row, so a greedy or empty slot skips the filters and the draw (a vmap would run them)
            def choose(row):
                lg, k, r, p, g, on = row
                return jax.lax.cond(on & ~g, lambda: sample(lg, k, p, False, r), lambda: sample(lg, k, p, True, r))
            new = jax.lax.map(choose, (logits, subs, recent, params, greedy, live))
        out = out.at[n].set(jnp.where(live, new, -1))
        remaining = remaining - live
        done = ~live | (remaining <= 0) | jnp.any(new[:, None] == stops, axis=1)
        keys = jnp.where(live[:, None], jax.random.key_data(next_keys), keys)
        return (n + 1, out, count + live, jnp.where(live, new, tokens), jnp.where(done, -1, pos + 1), remaining,
                KVCache(k=ks, v=vs), keys, recent, waker.woken() != 0)

    def more(carry):
        n, pos, woken = carry[0], carry[4], carry[9]
        return (n < steps) & jnp.any(pos >= 0) & ~woken

    b = tokens.shape[0]
    carry = (jnp.int32(0), jnp.full((steps, b), -1, jnp.int32), jnp.zeros(b, jnp.int32), tokens, pos, remaining,
             pool, keys, recent, jnp.bool_(False))
    _, out, count, _, _, _, pool, keys, recent, _ = jax.lax.while_loop(more, step, carry)
    if rows is not None:
        pool = KVCache(k=[w.at[rows].set(p) for w, p in zip(whole.k, pool.k)],
                       v=[w.at[rows].set(p) for w, p in zip(whole.v, pool.v)])
    return out, count, pool, keys, recent


class Batch:
    def __init__(self, engine, max_batch: int):
        self.engine, self.max_batch = engine, max_batch
        self.together = engine.backend.batched and max_batch > 1
        if self.together:
            self.decoder = None if engine.host is None else BatchDecoder(engine.host, max_batch)
            self.waker = _Wake() if self.decoder is None else self.decoder
            self.pool = KVCache.create(engine.config, max_batch, gen.MIN_CACHE_BUCKET)
        self.caches = {}      # in turns: slot -> its own cache
        self._woken = threading.Event()
        self._next = 0        # in turns: the state a step starts with (after a wake, the first one not reached)
        self.widest = 0       # the most requests one step has advanced (for tests and logs)

    def start(self, slot: int, prompt_ids, max_new_tokens: int, sampling: Sampling, stop_ids=None, *,
              cache_len: int | None = None) -> State:
        """prefill, then insert into `slot`."""
        return self.insert(self.prefill(prompt_ids, max_new_tokens, sampling, stop_ids, cache_len=cache_len), slot)

    def prefill(self, prompt_ids, max_new_tokens: int, sampling: Sampling, stop_ids=None, *,
                cache_len: int | None = None) -> Prefix:
        """Run a request's prompt (Engine.plan refuses what the context cannot hold): its first token and its cache,
        in no slot yet. stop_ids: None for the tokenizer's end ids, [] for none. cache_len: at least what
        Engine.plan gives (one executable for several max_new_tokens)."""
        e = self.engine
        _, planned = e.plan(len(prompt_ids), max_new_tokens)
        cache_len = planned if cache_len is None else max(cache_len, planned)
        key, sub = sampling.first_keys()
        token, cache = e.prefill(prompt_ids, cache_len=cache_len, sampling=sampling,
                                 key=jax.random.wrap_key_data(jax.device_put(sub)))
        return Prefix(State(-1, int(token), max_new_tokens - 1, len(prompt_ids) - 1, key,
                            np.asarray(recent_ids(prompt_ids)), e.stop_tokens(stop_ids), sampling), cache)

    def insert(self, prefix: Prefix, slot: int) -> State:
        """A prefilled request takes `slot` (free: its previous request released or finished); its state, whose
        token is the request's first."""
        cache = prefix.cache
        if not self.together:
            self.caches[slot] = cache
        else:
            if cache.length > self.pool.length:
                self.pool = _grow(self.pool, length=cache.length)
            self.pool = _insert(self.pool, cache, np.int32(slot))
        return dataclasses.replace(prefix.state, slot=slot)

    def wake(self) -> None:
        """From any thread: a `step` running now, or the next one, returns after its current decode step (until
        clear_wake)."""
        self._woken.set()
        if self.together:
            self.waker.wake()

    def clear_wake(self) -> None:
        """Steps run their whole count again. The caller clears before it looks at what may wake it (the
        scheduler: before it reads its queue), so a wake in between is not lost."""
        self._woken.clear()
        if self.together:
            self.waker.clear_wake()

    def step(self, states: list[State], steps: int = 1) -> None:
        """Up to `steps` tokens for each state: each state's new tokens in state.new (fewer when it used up its
        max_new_tokens, sampled a stop id, or wake() was called), its newest in state.token. A state that has
        nothing left to produce (remaining 0: its budget is spent, or its newest token is a stop id) gets none."""
        self.widest = max(self.widest, len(states))
        for s in states:
            s.new = []
        if self.together:
            self._step_together(states, steps)
            return
        start = self._next % len(states) if states else 0
        for i, s in enumerate(states[start:] + states[:start]):
            if self._woken.is_set() and i:
                self._next = start + i
                return
            if s.remaining > 0:
                self._step_alone(s, steps)
        self._next = 0

    def release(self, slot: int) -> None:
        """The slot's request is done: its own cache (in turns) is freed."""
        self.caches.pop(slot, None)

    def close(self) -> None:
        """No more calls (a LeaderBatch tells its followers, pjinfer.runtime.followers)."""

    def _step_alone(self, s: State, steps: int) -> None:
        e = self.engine
        count = min(steps, s.remaining)
        out, n, self.caches[s.slot], key, recent = gen.decode_chunk(
            *e.model_args, np.int32(s.token), np.int32(s.position + 1), self.caches[s.slot],
            jax.random.wrap_key_data(jax.device_put(s.key)), s.sampling.params(), s.recent, s.stops,
            np.int32(count), chunk=steps, greedy=s.sampling.greedy)
        self._took(s, np.asarray(out)[:int(n)].tolist(), np.asarray(jax.random.key_data(key)), np.asarray(recent))

    @staticmethod
    def _took(s: State, new: list, key, recent) -> None:
        s.new = new
        if new:
            s.token, s.key, s.recent = new[-1], key, recent
            s.position += len(new)
            s.remaining = 0 if s.token in s.stops else s.remaining - len(new)

    def _step_together(self, states: list[State], steps: int) -> None:
        live = [s for s in states if s.remaining > 0]
        if not live:
            return
        rows = self._rows(live)
        at = {slot: i for i, slot in enumerate(range(self.max_batch) if rows is None else rows)}
        b = len(at)
        tokens, pos, remaining = np.zeros(b, np.int32), np.full(b, -1, np.int32), np.zeros(b, np.int32)
        stops = np.full((b, gen.MAX_STOP_IDS), -1, np.int32)
        keys = np.zeros((b, 2), np.uint32)
        recent = np.full((b, len(states[0].recent)), -1, np.int32)
        params = [np.zeros(b, np.asarray(p).dtype) for p in Sampling().params()]
        greedy = np.ones(b, bool)
        for s in live:
            i = at[s.slot]
            tokens[i], keys[i], recent[i], stops[i] = s.token, s.key, s.recent, s.stops
            pos[i], remaining[i] = s.position + 1, s.remaining
            for arr, value in zip(params, s.sampling.params()):
                arr[i] = np.asarray(value)
            greedy[i] = s.sampling.greedy
        mode = "greedy" if greedy.all() else "mixed"
        e = self.engine
        out, count, self.pool, keys, recent = _steps(
            *e.model_args, self.decoder, self.waker, None if rows is None else jnp.asarray(rows, jnp.int32),
            jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(remaining), jnp.asarray(stops), self.pool,
            jnp.asarray(keys), tuple(jnp.asarray(p) for p in params), jnp.asarray(recent), jnp.asarray(greedy),
            mode=mode, steps=steps)
        out, count, keys, recent = np.asarray(out), np.asarray(count), np.asarray(keys), np.asarray(recent)
        for s in live:
            i = at[s.slot]
            self._took(s, out[:int(count[i]), i].tolist(), keys[i], recent[i])

    def _rows(self, live: list[State]) -> list[int] | None:
        """The slots a call steps: None for every slot (the host kernels skip a slot at position -1 at no cost);
        in XLA, which computes every row it is given, the live slots and as many others as make their count a
        power of two (one executable per width, the others' rows untouched at position -1)."""
        if self.decoder is not None:
            return None
        taken = {s.slot for s in live}
        width = min(self.max_batch, gen.bucket(len(live), 1))
        return sorted(taken) + [i for i in range(self.max_batch) if i not in taken][:width - len(live)]
