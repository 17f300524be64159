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
2. Allocate: every input of every layer at the target level (TEAL's uniform allocation across blocks), each with
   its own threshold from its own quantiles. For the ReLU family the intermediate threshold is 0 (that skip is
   exact and free), so the other three inputs carry the target.
3. The held-back loss on HELD_WINDOWS further windows is measured dense and with the thresholds, and recorded.

Why uniform: two greedy allocations were measured and both lost to it on text held out of the fit. Pricing each
layer alone on the held-back loss (30 layers x 2 groups x 3 levels; the first version) followed noise, since one
layer's change moves that loss by less than its noise; pricing each input kind raised in every layer assumed the
kinds' costs add up, and they do not. docs/performance.md ("Input sparsity") has the figures and how they were
measured.
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

STEP = 0.01
LEVELS = np.round(np.arange(0.0, 0.9 + STEP / 2, STEP), 2)   # sparsity levels a threshold can be fitted at
WINDOW = 256
FIT_WINDOWS = 4
HELD_WINDOWS = 4
MAX_TARGET = 0.9


def weight_shares(config) -> np.ndarray:
    """Weights each tensor's input gates in one layer, [4] (q/k/v, o, gate/up, down)."""
    c = config
    attn = c.n_heads * c.head_dim
    return np.array([c.d_model * (attn + 2 * c.n_kv_heads * c.head_dim), attn * c.d_model,
                     c.d_model * c.d_ff * (2 if c.gated else 1), c.d_ff * c.d_model], np.float64)


# ------------------------------------------------------------------------------------------------ fitting
def _matrix_inputs(model, tokens):
    """Per layer, ((q/k/v's, o's, gate/up's, down's input), their four thresholds) of the model as it runs on
    tokens [B, T] (scoring's path: no cache, float32 attention; thresholds applied where it has them). Each input
    is taken before its own threshold; down's input is the activations of the thresholded gate/up input."""
    x = model.embed[...][tokens]
    for block in model.layers:
        attn, ffn = block.attn, block.ffn
        h = block.attn_norm(x)
        heads, _, _ = attn.heads(h, 0, None, None)   # Block.__call__'s steps, each matrix's input kept
        x = x + attn.o(heads)
        f = block.ffn_norm(x)
        act = ffn.neurons(model_lib.sparsify_input(f, ffn.t_in))
        yield (h, heads, f, act), (attn.t_in, attn.t_o, ffn.t_in, ffn.t_down)
        x = x + ffn(f)


@partial(jax.jit, static_argnames=("graphdef",))
def _quantiles(graphdef, state, tokens, levels):
    """Per layer and tensor, the quantiles of |input| at `levels`, from a dense pass: [L, 4, len(levels)]."""
    q = lambda v: jnp.quantile(jnp.abs(v).reshape(-1), levels)
    inputs = _matrix_inputs(nnx.merge(graphdef, state), tokens)
    return jnp.stack([jnp.stack([q(v) for v in layer]) for layer, _ in inputs])


@partial(jax.jit, static_argnames=("graphdef",))
def _loss(graphdef, state, tokens):
    """Mean negative log-likelihood of tokens[:, 1:] given the ones before."""
    model = nnx.merge(graphdef, state)
    logp = jax.nn.log_softmax(model.logits(model.forward_sequence(tokens)[:, :-1]), axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


def _thresholds(quantiles, levels_per_tensor) -> np.ndarray:
    """[L, 4] thresholds for sparsity levels [L, 4] (each one of LEVELS)."""
    idx = np.rint(np.asarray(levels_per_tensor) / STEP).astype(int)
    t = np.take_along_axis(quantiles, idx[..., None], axis=-1)[..., 0].astype(np.float32)
    return np.where(idx == 0, np.float32(0), t)  # level 0 skips nothing (the 0-quantile would skip the minimum)


def uniform_levels(config, target: float, relu_family: bool) -> np.ndarray:
    """Sparsity levels [L, 4] (each one of LEVELS) whose weight-weighted mean is the target, or as near as the
    grid allows (the ReLU family at most 0.9 of the three inputs besides the intermediate, whose level is 0)."""
    if not 0.0 <= target <= MAX_TARGET:
        raise ConfigError(f"target sparsity must be in [0, {MAX_TARGET}], got {target}")
    shares = weight_shares(config)
    level = target * shares.sum() / shares[:3].sum() if relu_family else target
    level = min(np.ceil(round(level / STEP, 6)) * STEP, MAX_TARGET)
    levels = np.full((config.n_layers, 4), round(level, 2))
    if relu_family:
        levels[:, 3] = 0.0
    return levels


def calibrate(engine, ids, *, target: float, relu_family: bool, progress=None) -> dict:
    """Fit thresholds on ids (calibration token ids) for a weight-weighted target sparsity (the module docstring's
    steps); returns {"thresholds" [L, 4], "levels" [L, 4], "fit_tokens", "held_tokens", "loss_dense", "loss",
    "seconds"}. progress(done, 3) after each pass over the text."""
    levels = uniform_levels(engine.config, target, relu_family)
    need = (FIT_WINDOWS + HELD_WINDOWS) * WINDOW
    if len(ids) < need:
        raise ConfigError(f"calibration text has {len(ids)} tokens; fitting thresholds needs {need} "
                          f"({FIT_WINDOWS} + {HELD_WINDOWS} windows of {WINDOW})")
    start, tick = time.perf_counter(), progress or (lambda done, total: None)
    batch = np.asarray(ids[:need], np.int32).reshape(-1, WINDOW)
    fit, held = jnp.asarray(batch[:FIT_WINDOWS]), jnp.asarray(batch[FIT_WINDOWS:])
    model = nnx.merge(engine.graphdef, engine.state)
    model_lib.set_thresholds(model, None)
    graphdef, state = nnx.split(model)
    quantiles = np.asarray(_quantiles(graphdef, state, fit, jnp.asarray(LEVELS, jnp.float32)))
    tick(1, 3)
    loss_dense = float(_loss(graphdef, state, held))
    tick(2, 3)
    thresholds = _thresholds(quantiles, levels)
    model_lib.set_thresholds(model, thresholds)
    graphdef, state = nnx.split(model)
    loss = float(_loss(graphdef, state, held))
    tick(3, 3)
    return {"thresholds": thresholds, "levels": levels, "fit_tokens": int(fit.size), "held_tokens": int(held.size),
            "loss_dense": loss_dense, "loss": loss, "seconds": time.perf_counter() - start}


# ------------------------------------------------------------------------------------------------ measuring
def skipped_shares(engine, ids) -> np.ndarray:
    """[n_layers, 4] share of each matrix input's entries at or below its threshold over the tokens ids, on the
    engine's model as it runs (every threshold applied): what a decode step skips (bench's bytes per token)."""
    if engine.thresholds is None:
        raise ConfigError("the engine runs no input thresholds")
    return np.asarray(_skipped(engine.graphdef, engine.state, jnp.asarray([ids], jnp.int32)))


@partial(jax.jit, static_argnames=("graphdef",))
def _skipped(graphdef, state, tokens):
    share = lambda v, t: jnp.mean(jnp.abs(v) <= t[...])
    inputs = _matrix_inputs(nnx.merge(graphdef, state), tokens)
    return jnp.stack([jnp.stack([share(v, t) for v, t in zip(*layer)]) for layer in inputs])


# ------------------------------------------------------------------------------------------------ bundle stage
