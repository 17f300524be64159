"""Activation profiler: how often and how strongly each FFN neuron fires on general text.

"Active" (docs/architecture.md): for the ReLU family a neuron is active when its activation is non-zero,
so skipping inactive ones is exact. For smooth gated FFNs (SwiGLU, GeGLU) nothing is exactly zero:
a neuron is active when its contribution |act(gate) * up| clears a per-layer threshold, set at the
`sparsity` quantile of that layer's contributions on the first calibration tokens.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpu_offload.activation import EXACT_ZERO
from pjinfer.config import ConfigError
from pjinfer.load import data
from pjinfer.runtime.engine import Engine

WINDOW = 256                                     # tokens per profiled sequence
BATCH = 4                                        # sequences per jitted call
THRESHOLD_TOKENS = 2048                          # tokens whose contributions set the thresholds


@partial(jax.jit, static_argnames=("graphdef",))
def layer_activity(graphdef, state, tokens):
    """tokens [B, T] -> (FFN inputs [L, B*T, d], per-neuron contributions |neuron(x)| [L, B*T, F])."""
    model = nnx.merge(graphdef, state)
    _, ffn_inputs = model.forward_sequence(tokens, capture=True)
    inputs = jnp.stack([x.reshape(-1, x.shape[-1]) for x in ffn_inputs])
    contrib = jnp.stack([jnp.abs(layer.ffn.neurons(x)) for layer, x in zip(model.layers, inputs)])
    return inputs, contrib


def calibration_ids(engine: Engine, text_file=None) -> list[int]:
    """Token ids of the profiling text: the given file, or the exllamav2 calibration set with wiki's
    evaluation slice (its first 20,000 characters) left out, interleaved so any prefix mixes all kinds."""
    tok = engine.tokenizer
    if text_file is not None:
        return tok.encode(data.read_text(text_file), add_special=False)
    streams = []
    for name in data.CALIBRATION_FILES:
        text = data.read_text(data.calibration_file(name))
        if name == "wiki":
            text = text[data.WIKI_EVAL_CHARS:]
        ids = tok.encode(data.strip_tags(text), add_special=False)
        streams.append([ids[i:i + WINDOW] for i in range(0, len(ids) - WINDOW + 1, WINDOW)])
    mixed = [w for group in zip(*streams) for w in group]
    return [t for w in mixed for t in w]


@dataclasses.dataclass
class ActivationStats:
    """Per layer l and neuron i, over the profiled tokens."""
    activation: str
    target_sparsity: float | None   # None for the ReLU family (active = non-zero)
    thresholds: np.ndarray          # [L] contribution above which a neuron counts as active
    freq: np.ndarray                # [L, F] fraction of tokens in which the neuron is active
    mass: np.ndarray                # [L, F] mean contribution |act(gate) * up|
    tokens: int

    def sparsity(self) -> np.ndarray:
        """[L] fraction of neurons inactive on an average token."""
        return 1.0 - self.freq.mean(axis=1)

    def locality(self, share: float = 0.8) -> np.ndarray:
        """[L] smallest fraction of a layer's neurons that together make `share` of its activations
        (PowerInfer reports 26% for OPT-30B at share 0.8)."""
        ordered = -np.sort(-self.freq, axis=1)
        cumulative = np.cumsum(ordered, axis=1) / np.maximum(ordered.sum(axis=1, keepdims=True), 1e-12)
        return (np.argmax(cumulative >= share, axis=1) + 1) / self.freq.shape[1]


@dataclasses.dataclass
class TrainingData:
    """A subsample of profiled tokens for predictor training: layer inputs and activity labels."""
    inputs: np.ndarray   # [L, N, d] float16 (halves the memory; training computes in float32)
    labels: np.ndarray   # [L, N, ceil(F/8)] uint8: np.packbits of the bool activity along neurons
    n_ff: int

    def layer(self, l: int) -> tuple[np.ndarray, np.ndarray]:
        labels = np.unpackbits(self.labels[l], axis=-1, count=self.n_ff).astype(bool)
        return self.inputs[l].astype(np.float32), labels


def profile(engine: Engine, ids: list[int], *, tokens: int, sparsity: float | None, train_tokens: int,
            seed: int = 0, progress=None) -> tuple[ActivationStats, TrainingData]:
    """Run the model over `tokens` calibration tokens (whole windows of 256) and count activity."""
    config = engine.config
    exact = config.activation in EXACT_ZERO
    if not exact and (sparsity is None or not 0 < sparsity < 1):
        raise ConfigError(f"{config.activation} never outputs exact zeros: give a target --sparsity in (0, 1)")
    per_call = WINDOW * BATCH
    calls = min(tokens, len(ids)) // per_call
    if calls < 1:
        raise ConfigError(f"profiling needs at least {per_call} tokens; the text has {len(ids)}, --tokens is {tokens}")
    run = lambda c: layer_activity(engine.graphdef, engine.state,
                                   jnp.asarray(np.asarray(ids[c * per_call:(c + 1) * per_call]).reshape(BATCH, WINDOW)))

    # Thresholds first, from the first THRESHOLD_TOKENS tokens, so every later count uses the same rule.
    if exact:
        thresholds = np.zeros(config.n_layers, np.float32)
    else:
        first = [np.asarray(run(c)[1]) for c in range(min(calls, THRESHOLD_TOKENS // per_call))]
        sample = np.concatenate(first, axis=1).reshape(config.n_layers, -1)
        thresholds = np.quantile(sample, sparsity, axis=1).astype(np.float32)
        del first, sample

    rng = np.random.default_rng(seed)
    keep = min(per_call, -(-train_tokens // calls))     # training tokens kept from each call
    counts = np.zeros((config.n_layers, config.d_ff), np.int64)
    mass = np.zeros((config.n_layers, config.d_ff), np.float64)
    inputs, labels = [], []
    if progress:
        progress(0, calls * per_call)
    for c in range(calls):
        x, contrib = (np.asarray(a) for a in run(c))
        active = contrib > thresholds[:, None, None]
        counts += active.sum(axis=1)
        mass += contrib.sum(axis=1)
        rows = np.sort(rng.choice(per_call, keep, replace=False))
        inputs.append(x[:, rows].astype(np.float16))
        labels.append(np.packbits(active[:, rows], axis=-1))
        if progress:
            progress((c + 1) * per_call, calls * per_call)
    n = calls * per_call
    stats = ActivationStats(config.activation, None if exact else sparsity, thresholds,
                            (counts / n).astype(np.float32), (mass / n).astype(np.float32), n)
    training = TrainingData(np.concatenate(inputs, axis=1)[:, :train_tokens],
                         np.concatenate(labels, axis=1)[:, :train_tokens], config.d_ff)
    return stats, training


def plot(stats: ActivationStats, path) -> None:
    """The power-law figure: each layer's neurons by activation frequency, and how few make 80%."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, F = stats.freq.shape
    ordered = -np.sort(-stats.freq, axis=1)
    rank = np.arange(1, F + 1)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = plt.cm.viridis(np.linspace(0, 1, L))
    for l in range(L):
        a.plot(rank, ordered[l], color=colours[l], lw=0.8)
        b.plot(rank / F, np.cumsum(ordered[l]) / max(ordered[l].sum(), 1e-12), color=colours[l], lw=0.8)
    a.set(xscale="log", yscale="log", xlabel="neuron rank (by frequency)", ylabel="activation frequency",
          title="Activation frequency per neuron (colour: layer 0 to %d)" % (L - 1))
    b.axhline(0.8, color="grey", ls="--", lw=0.8)
    b.set(xlabel="fraction of neurons (hottest first)", ylabel="share of activations",
          title="Locality: %.0f%% of neurons make 80%% (mean over layers)" % (100 * stats.locality().mean()))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
