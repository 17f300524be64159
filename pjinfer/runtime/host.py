"""The host decode as a module swap: an engine on a host row of pjinfer.runtime.backends.BACKENDS replaces each
Block with a HostBlock and the Head with a HostHead, the way pjinfer.runtime.sparse swaps FFNs.

A swapped module keeps the original's children, so scoring and long prompts (`__call__`) still run through XLA
on the same stored blocks; `decode` (one token) changes: it calls the host decoder's FFI target
(cpu_offload.decoder.HostDecoder, or the input-sparse cpu_offload.sparse_decode.SparseHostDecoder), which
computes the whole layer, or the head, in one call on the CPU threads.

`prefill` runs a prompt of at most PROMPT_ROWS tokens on the dense host decoder too, as the rows of one batched
step per layer (cpu_offload.batched_decode's prompt form): every token gets the numbers the one-token decoder
would give it. On a host decoder without that form (other block types, input thresholds, a PowerInfer file's
predictors) a prompt of at most STEPPED_PROMPT tokens runs as that many one-token decode steps (STEPS). XLA's
prefill dequantizes every matrix to float32 first, a cost paid whatever the prompt's length, and its executable
and temporaries stay in memory; the host reads the blocks as they are (docs/performance.md, "Short prompts")."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pjinfer.runtime.model import Block, Head, KVCache, Transformer, embedding_rows

PROMPT_ROWS = 64   # prompts up to this many tokens prefill on the host (XLA is slower below it)
STEPPED_PROMPT = 16   # on a host decoder that does not batch, prompts up to this many tokens run as decode steps
STEPS = "steps"   # prefill's `rows` for those: the prompt's tokens one at a time through the model's `decode`


class HostBlock(Block):
    """Block `index` whose one-token step runs on the host decoder."""

    def __init__(self, block: Block, decoder, index: int):
        super().__init__(*block.parts())
        self.decoder = decoder
        self.index = index

    def decode(self, x, pos, k_cache, v_cache):
        return self.decoder.layer(self.index, x, pos, k_cache, v_cache)


class HostHead(Head):
    """The output head whose one-token logits come from the host decoder."""

    def __init__(self, head: Head, decoder):
        super().__init__(head.w)
        self.decoder = decoder

    def decode(self, hidden):
        return self.decoder.head(hidden)


def attach(model: Transformer, decoder, first: int = 0) -> None:
    """Swap model's blocks from `first` on, and its head, for host-backed ones (in place); the blocks before
    `first` keep their XLA decode (a layer split, pjinfer.runtime.backends' layer-split row)."""
    model.layers = nnx.List([HostBlock(b, decoder, i) if i >= first else b for i, b in enumerate(model.layers)])
    model.head = HostHead(model.head, decoder)


def detach(model: Transformer) -> None:
    """Undo attach: every step through XLA again, on the same weights (a reference for tests)."""
    model.layers = nnx.List([Block(*b.parts()) for b in model.layers])
    model.head = Head(model.head.w)


def prefill(model: Transformer, rows, tokens, length, cache: KVCache):
    """The prompt tokens [1, T] (the first `length` real, T <= rows.max_batch) from position 0 through `rows` (a
    cpu_offload.batched_decode.BatchDecoder of the model's host decoder, or STEPS: one-token decode steps) ->
    (logits of the last real token [vocab], the cache with positions 0..length-1 written)."""
    if rows == STEPS:
        logits = jnp.zeros(model.config.vocab_size, jnp.float32)
        return jax.lax.fori_loop(0, length, lambda i, c: model.decode(tokens[0, i], i, c[1]), (logits, cache))
    x = embedding_rows(model.embed, tokens)[0]                                  # [T, d]
    x = jnp.pad(x, ((0, rows.max_batch - x.shape[0]), (0, 0)))
    ks, vs = [], []
    for i, (k, v) in enumerate(zip(cache.k, cache.v)):
        x, k, v = rows.prompt(i, x, 0, length, k, v)
        ks.append(k)
        vs.append(v)
    last = jax.lax.dynamic_index_in_dim(x, length - 1, keepdims=False)
    return model.head.decode(model.final_norm(last)), KVCache(k=ks, v=vs)
