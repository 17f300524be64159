"""The host decode as a module swap: an engine with quantized weights (--weights int8 / q4_1) replaces each
Block with a HostBlock and the Head with a HostHead, the way pjinfer.runtime.sparse swaps FFNs.

A swapped module keeps the original's children, so prefill and scoring (`__call__`) still run through XLA on
the same stored blocks; only `decode` (one token) changes: it calls the host decoder's FFI target
(cpu_offload.decoder.HostDecoder, or the input-sparse cpu_offload.sparse_decode.SparseHostDecoder), which
computes the whole layer, or the head, in one call on the CPU threads."""
from __future__ import annotations

from flax import nnx

from pjinfer.runtime.model import Block, Head, Transformer


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


def attach(model: Transformer, decoder) -> None:
    """Swap model's blocks and head for host-backed ones (in place)."""
    model.layers = nnx.List([HostBlock(b, decoder, i) for i, b in enumerate(model.layers)])
    model.head = HostHead(model.head, decoder)


def detach(model: Transformer) -> None:
    """Undo attach: every step through XLA again, on the same weights (a reference for tests)."""
    model.layers = nnx.List([Block(*b.parts()) for b in model.layers])
    model.head = Head(model.head.w)


def decoder_of(model: Transformer):
    """The host decoder a model's head runs on, or None for an XLA model."""
    return model.head.decoder if isinstance(model.head, HostHead) else None
