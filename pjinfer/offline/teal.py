"""Input sparsity with calibrated thresholds (TEAL, arXiv 2408.14690): fitting them (the bundle stage that
stores them is pjinfer.offline.stages.run_calibrate; the model applies them, pjinfer.runtime.model.set_thresholds).

Four thresholds per layer (config.THRESHOLD_INPUTS): the attention input (q/k/v), o's input, the FFN
input (gate/up) and the FFN intermediate (down's input). An input entry with |x| <= threshold counts as zero in
every path: XLA (pjinfer.runtime.model.sparsify_input) and the host decode (cpu_offload.sparse_decode), so perplexity and
eval with the bundle measure what decode computes.

Calibration (``calibrate``), on the calibration text only (profile.calibration_ids: wiki's evaluation slice is
left out):
1. Fit: one dense pass over FIT_WINDOWS windows gives, per layer and tensor, the quantiles of |x| at LEVELS: the
   threshold that zeroes that share of the entries.
2. Allocate (TEAL's greedy, made cheap by assuming costs add up): on HELD_WINDOWS further windows, the loss is
   measured with one layer's inputs raised to each level, for two groups per layer ("in": q/k/v, o and gate/up
   inputs at one level; "down": the intermediate). Then, starting from 0, the step that costs the least loss per
   weight byte skipped is taken until the weight-weighted sparsity reaches the target.
3. The allocation's held-back loss is measured once more, all thresholds applied together, and recorded.
For the ReLU family the intermediate threshold is 0: that skip is exact and free.
"""
from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pjinfer.config import ConfigError
from pjinfer.runtime import model as model_lib

LEVELS = np.round(np.arange(0.0, 0.91, 0.05), 2)     # sparsity levels a threshold can be fitted at
TRIAL_LEVELS = (0.3, 0.5, 0.7)                       # levels whose held-back cost is measured per layer and group
WINDOW = 256
FIT_WINDOWS = 4
HELD_WINDOWS = 2
MAX_TARGET = 0.9


def weight_shares(config) -> np.ndarray:
    """Weights each tensor's input gates in one layer, [4] (q/k/v, o, gate/up, down)."""
    c = config
    attn = c.n_heads * c.head_dim
    return np.array([c.d_model * (attn + 2 * c.n_kv_heads * c.head_dim), attn * c.d_model,
                     c.d_model * c.d_ff * (2 if c.gated else 1), c.d_ff * c.d_model], np.float64)


# ------------------------------------------------------------------------------------------------ fitting
@partial(jax.jit, static_argnames=("graphdef",))
def _quantiles(graphdef, state, tokens, levels):
    """Per layer and tensor, the quantiles of |input| at `levels`, from a dense pass: [L, 4, len(levels)]."""
    model = nnx.merge(graphdef, state)
    x = model.embed[...][tokens]
    q = lambda v: jnp.quantile(jnp.abs(v).reshape(-1), levels)
    out = []
    for block in model.layers:
        h = block.attn_norm(x)
        heads, _, _ = block.attn.heads(h, 0, None, None)  # scoring's path: no cache, float32 attention
        x = x + jnp.einsum("bti,oi->bto", heads, block.attn.wo[...])
        f = block.ffn_norm(x)
        act = block.ffn.neurons(f)
        x = x + jnp.einsum("btf,fd->btd", act, block.ffn.w_down_t[...])
        out.append(jnp.stack([q(h), q(heads), q(f), q(act)]))
    return jnp.stack(out)


@partial(jax.jit, static_argnames=("graphdef",))
def _loss(graphdef, state, tokens):
    """Mean negative log-likelihood of tokens[:, 1:] given the ones before."""
    model = nnx.merge(graphdef, state)
    logp = jax.nn.log_softmax(model.logits(model.forward_sequence(tokens)[:, :-1]), axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


def _thresholds(quantiles, levels_per_tensor) -> np.ndarray:
    """[L, 4] thresholds for sparsity levels [L, 4] (each one of LEVELS)."""
    idx = np.rint(np.asarray(levels_per_tensor) / 0.05).astype(int)
    t = np.take_along_axis(quantiles, idx[..., None], axis=-1)[..., 0].astype(np.float32)
    return np.where(idx == 0, np.float32(0), t)  # level 0 skips nothing (the 0-quantile would skip the minimum)


def calibrate(engine, ids, *, target: float, relu_family: bool, progress=None) -> dict:
    """Fit thresholds on ids (calibration token ids) for a weight-weighted target sparsity; returns
    {"thresholds" [L, 4], "levels" [L, 4], "fit_tokens", "held_tokens", "loss_dense", "loss", "seconds"}."""
    if not 0.0 <= target <= MAX_TARGET:
        raise ConfigError(f"target sparsity must be in [0, {MAX_TARGET}], got {target}")
    fit = Fit(engine, ids, relu_family=relu_family, progress=progress)
    return fit.allocate(target)


class Fit:
    """Steps 1 and 2 of the module docstring's calibration, done once; ``allocate`` then serves any target."""

    def __init__(self, engine, ids, *, relu_family: bool, progress=None):
        need = (FIT_WINDOWS + HELD_WINDOWS) * WINDOW
        if len(ids) < need:
            raise ConfigError(f"calibration text has {len(ids)} tokens; fitting thresholds needs {need} "
                              f"({FIT_WINDOWS} + {HELD_WINDOWS} windows of {WINDOW})")
        self.start = time.perf_counter()
        self.relu_family = relu_family
        batch = np.asarray(ids[:need], np.int32).reshape(-1, WINDOW)
        fit, self.held = jnp.asarray(batch[:FIT_WINDOWS]), jnp.asarray(batch[FIT_WINDOWS:])
        self.fit_tokens, self.held_tokens = int(fit.size), int(self.held.size)
        model = nnx.merge(engine.graphdef, engine.state)
        model_lib.set_thresholds(model, None)
        graphdef, state = nnx.split(model)
        self.quantiles = np.asarray(_quantiles(graphdef, state, fit, jnp.asarray(LEVELS, jnp.float32)))
        L = self.quantiles.shape[0]
        self.loss_dense = float(_loss(graphdef, state, self.held))
        model_lib.set_thresholds(model, np.zeros((L, 4), np.float32))   # thresholds as state: no recompiling per trial
        self.model, self.graphdef = model, nnx.split(model)[0]
        self.groups = [(0, 1, 2)] + ([] if relu_family else [(3,)])    # "in", "down"
        shares = weight_shares(engine.config)
        self.bytes_of = np.array([shares[list(t)].sum() for t in self.groups])
        self.total = shares.sum() * L
        trial = np.zeros((L, len(self.groups), len(TRIAL_LEVELS)))
        for l in range(L):
            for g, tensors in enumerate(self.groups):
                for k, level in enumerate(TRIAL_LEVELS):
                    levels = np.zeros((L, 4))
                    levels[l, list(tensors)] = level
                    trial[l, g, k] = self.loss_at(levels) - self.loss_dense
            if progress:
                progress(l + 1, L)
        self.trial = trial

    def loss_at(self, levels) -> float:
        """Held-back loss with the thresholds of sparsity levels [L, 4]."""
        model_lib.set_thresholds(self.model, _thresholds(self.quantiles, levels))
        return float(_loss(self.graphdef, nnx.state(self.model), self.held))

    def allocate(self, target: float) -> dict:
        """Greedy: each (layer, group) climbs 0 -> TRIAL_LEVELS; the step with the least loss per weight skipped
        is taken until the weight-weighted sparsity reaches target."""
        if not 0.0 <= target <= MAX_TARGET:
            raise ConfigError(f"target sparsity must be in [0, {MAX_TARGET}], got {target}")
        L, G = self.trial.shape[:2]
        cost = np.concatenate([np.zeros((L, G, 1)), np.maximum(self.trial, 0)], -1)
        steps = np.concatenate([[0.0], TRIAL_LEVELS])
        at = np.zeros((L, G), int)
        achieved = lambda: float((steps[at] * self.bytes_of).sum() / self.total)
        while achieved() < target - 1e-9:
            price = np.full((L, G), np.inf)
            room = at + 1 < len(steps)
            nxt = np.minimum(at + 1, len(steps) - 1)
            gain = (steps[nxt] - steps[at]) * self.bytes_of
            rise = np.take_along_axis(cost, nxt[..., None], -1)[..., 0] - np.take_along_axis(cost, at[..., None], -1)[..., 0]
            price[room] = rise[room] / gain[room]
            if not np.isfinite(price).any():
                break  # every group at the highest trial level
            at[np.unravel_index(np.argmin(price), price.shape)] += 1
        levels = np.zeros((L, 4))
        for g, tensors in enumerate(self.groups):
            levels[:, list(tensors)] = steps[at[:, g]][:, None]
        thresholds = _thresholds(self.quantiles, levels)
        if self.relu_family:
            thresholds[:, 3] = 0.0
        model_lib.set_thresholds(self.model, thresholds)
        loss = float(_loss(self.graphdef, nnx.state(self.model), self.held))
        return {"thresholds": thresholds, "levels": levels, "fit_tokens": self.fit_tokens,
                "held_tokens": self.held_tokens, "loss_dense": self.loss_dense, "loss": loss,
                "seconds": time.perf_counter() - self.start}


def uniform(engine, ids, levels4) -> np.ndarray:
    """Thresholds [L, 4] at one sparsity level per tensor (levels4: 4 values from LEVELS) in every layer, fitted
    on the first FIT_WINDOWS windows of ids."""
    batch = jnp.asarray(np.asarray(ids[:FIT_WINDOWS * WINDOW], np.int32).reshape(-1, WINDOW))
    model = nnx.merge(engine.graphdef, engine.state)
    model_lib.set_thresholds(model, None)
    graphdef, state = nnx.split(model)
    quantiles = np.asarray(_quantiles(graphdef, state, batch, jnp.asarray(LEVELS, jnp.float32)))
    return _thresholds(quantiles, np.broadcast_to(np.asarray(levels4, float), (quantiles.shape[0], 4)))


# ------------------------------------------------------------------------------------------------ bundle stage
