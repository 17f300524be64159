"""A tensor-parallel server's or chat's processes kept in step: every process must make the same jitted calls in
the same order, since each call's collectives wait for all of them.

Process 0 serves HTTP (or reads the chat's lines) and runs requests on a ``LeaderBatch``: before each call that
runs the model (a request's start, one request's chunk of decode steps, a release) it publishes the call in JAX's
distributed key-value store (the coordination service process 0 runs). The other processes run ``follow``: they read the
calls in order and make the same ones on a Batch of their own, so their states, caches and sampled tokens stay
those of process 0. The server's own decisions (which request steps next, a wake that ends a round early) are
made on process 0 alone and reach the others as the calls they led to.
"""
from __future__ import annotations

import pickle

from jax._src import distributed

from pjinfer.runtime.batch import Batch

PREFIX = "pjinfer/batch/"
KEPT = 64          # calls left in the store: a follower is never more than one call behind (each waits for all)
WAIT_MS = 60_000   # a follower's wait for the next call, again and again while the server is idle


def _client():
    return distributed.global_state.client


class LeaderBatch(Batch):
    """Process 0's Batch: each call that runs the model is published before it runs. Turns only (the split engine
    does not batch)."""

    def __init__(self, engine, max_batch: int):
        super().__init__(engine, max_batch)
        self.calls = 0

    def _publish(self, *call) -> None:
        client = _client()
        client.key_value_set_bytes(f"{PREFIX}{self.calls}", pickle.dumps(call))
        if self.calls >= KEPT:
            client.key_value_delete(f"{PREFIX}{self.calls - KEPT}")
        self.calls += 1

    def start(self, slot, prompt_ids, max_new_tokens, sampling, stop_ids=None, *, cache_len=None):
        self._publish("start", slot, list(prompt_ids), max_new_tokens, sampling, stop_ids, cache_len)
        return super().start(slot, prompt_ids, max_new_tokens, sampling, stop_ids, cache_len=cache_len)

    def _step_alone(self, s, steps: int) -> None:
        self._publish("step", s.slot, steps)
        super()._step_alone(s, steps)

    def release(self, slot: int) -> None:
        self._publish("release", slot)
        super().release(slot)

    def close(self) -> None:
        """The followers' `follow` returns."""
        self._publish("stop")


def follow(engine, max_batch: int) -> None:
    """Make process 0's calls (LeaderBatch) on this process's own Batch until it stops. A lost process 0 (its
    coordination service gone) raises JAX's error."""
    batch, states, n = Batch(engine, max_batch), {}, 0
    while True:
        try:
            call = pickle.loads(_client().blocking_key_value_get_bytes(f"{PREFIX}{n}", WAIT_MS))
        except Exception as e:   # JAX raises its runtime error; a wait that ran out says DEADLINE_EXCEEDED
            if "DEADLINE_EXCEEDED" in str(e):
                continue
            raise
        n += 1
        kind, args = call[0], call[1:]
        if kind == "stop":
            return
        if kind == "start":
            slot, prompt_ids, max_new_tokens, sampling, stop_ids, cache_len = args
            states[slot] = batch.start(slot, prompt_ids, max_new_tokens, sampling, stop_ids, cache_len=cache_len)
        elif kind == "step":
            batch._step_alone(states[args[0]], args[1])
        else:
            batch.release(args[0])
            states.pop(args[0], None)
