"""Activation predictors (PowerInfer, arXiv 2312.12456, section 5.1): per-layer low-rank MLPs that
tell, from a layer's FFN input, which FFN neurons will be active, so only those are computed.

`train_predictor` fits one predictor at a fixed rank and calibrates its decision threshold to a
recall target; `fit_layer` searches for the smallest rank that is good enough for a layer.
"""
from __future__ import annotations

import math
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

RANK_STEP = 16            # ranks are multiples of 16: full vector lanes and GPU-friendly tiles
BLOCK = 256               # tokens per split block: one profiled window, so held-back blocks are unseen text
SPLIT_CYCLE = 10          # of every 10 blocks: 8 train, 1 validation, 1 test
RECALL_MARGIN = 0.005     # calibrate a little above the target so held-back recall clears it too
# What a predictor reads: the FFN's input (after the layer's FFN norm; what pjinfer's profiler records and trains
# on), or the residual stream before that norm (PowerInfer's predictors, imported from its GGUF files).
INPUTS = ("ffn_in", "residual")


class Threshold(nnx.Variable):
    """The logit cutoff of `Predictor.active`: a Variable, so it saves and loads with the weights,
    but not a Param, so training leaves it alone."""


class Predictor(nnx.Module):
    """logits = up(relu(down(x))): d_model -> rank -> n_ff. A neuron is predicted active when its
    logit exceeds the calibrated threshold. `reads` (one of INPUTS, not a weight) says which input x is."""

    def __init__(self, d_model: int, n_ff: int, rank: int, *, rngs: nnx.Rngs, reads: str = "ffn_in"):
        if reads not in INPUTS:
            raise ValueError(f"unknown predictor input {reads!r} (known: {', '.join(INPUTS)})")
        self.down = nnx.Linear(d_model, rank, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(rank, n_ff, rngs=rngs)
        self.threshold = Threshold(jnp.zeros((), jnp.float32))
        self.reads = reads

    @property
    def rank(self) -> int:
        return self.down.out_features

    def __call__(self, x):
        return self.up(jax.nn.relu(self.down(x)))

    def active(self, x):
        return self(x) > self.threshold[...]


def n_params(predictor: Predictor) -> int:
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(predictor, nnx.Param)))


# ---------------------------------------------------------------- data
def split_indices(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deterministic train / validation / test token indices, 80/10/10 by blocks of consecutive
    tokens. Whole blocks keep neighbouring tokens of one text out of different splits; cycling
    through the blocks spreads every split over the whole calibration set (which mixes text kinds)."""
    block = max(1, min(BLOCK, n // (2 * SPLIT_CYCLE)))
    part = (np.arange(n) // block) % SPLIT_CYCLE
    return np.flatnonzero(part < 8), np.flatnonzero(part == 8), np.flatnonzero(part == 9)


def _input_scale(x: np.ndarray) -> np.ndarray:
    """Per-feature 1/std. Residual-stream features differ in scale by over 1000x; training on scaled
    inputs lets Adam treat them alike, and the scale folds exactly into `down` afterwards."""
    return (1.0 / np.maximum(x.std(axis=0), 1e-6)).astype(np.float32)


# ---------------------------------------------------------------- loss and training
def weighted_bce(logits, y, pos_weight):
    """Binary cross-entropy with the active class weighted by `pos_weight` (> 1).

    The two errors cost differently: a missed active neuron changes the layer's output (accuracy),
    a wrongly predicted one is only computed in vain (time). Weighting the active class tells the
    model to spend its capacity on never scoring an active neuron low, which is the region the
    recall-calibrated threshold lands in. No focal term: it emphasises hard examples of both
    classes alike, and on the real layers pos_weight 1 / 2 / 4 / 8 moved the sparsity reached at
    95% recall by under one point, so a second knob would buy nothing."""
    y = y.astype(logits.dtype)
    return jnp.mean(pos_weight * y * jax.nn.softplus(-logits) + (1 - y) * jax.nn.softplus(logits))


_ADAM = optax.scale_by_adam()   # the learning rate is applied per step from a precomputed schedule


def _loss(params, graphdef, rest, x, y, pos_weight):
    return weighted_bce(nnx.merge(graphdef, params, rest)(x), y, pos_weight)


@partial(jax.jit, static_argnames="graphdef")
def _epoch(graphdef, params, rest, opt_state, x, y, order, lrs, pos_weight):
    """One epoch as a lax.scan over minibatches (order [steps, batch] token indices, lrs [steps]):
    Python stays out of the inner loop, and the compiled epoch is reused by every predictor of the
    same shapes (schedule and pos_weight are arguments, not constants)."""

    def step(carry, batch):
        params, opt_state = carry
        idx, lr = batch
        loss, grads = jax.value_and_grad(_loss)(params, graphdef, rest, x[idx], y[idx], pos_weight)
        updates, opt_state = _ADAM.update(grads, opt_state)
        return (jax.tree.map(lambda p, u: p - lr * u, params, updates), opt_state), loss

    (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), (order, lrs))
    return params, opt_state, jnp.mean(losses)


@jax.jit
def _logits(model, x):
    return model(x)


def _predict(model: Predictor, x: np.ndarray, chunk: int = 4096) -> np.ndarray:
    return np.concatenate([np.asarray(_logits(model, x[i:i + chunk])) for i in range(0, len(x), chunk)])


# ---------------------------------------------------------------- threshold and metrics
def calibrate_threshold(logits: np.ndarray, y: np.ndarray, recall: float) -> float:
    """The highest cutoff t whose recall (the fraction of active entries with logit > t) is >= recall.

    At least k = ceil(recall * P) of the P active entries must clear t, so t must lie below the
    k-th largest active logit; the highest such float32 is the next one down from it (any t at or
    above it loses the k-th, and with it the target)."""
    pos = np.asarray(logits, np.float32)[np.asarray(y, bool)]
    k = min(len(pos), max(1, math.ceil(recall * len(pos) - 1e-9)))   # the epsilon absorbs float error in recall*P
    kth = np.partition(pos, len(pos) - k)[len(pos) - k]
    return float(np.nextafter(kth, np.float32(-np.inf)))


def evaluate(logits: np.ndarray, y: np.ndarray, threshold: float) -> dict:
    """Recall, precision and sparsity of the decisions logits > threshold against labels y [T, F].
    Sparsities are fractions of neurons (predicted) inactive, averaged over tokens."""
    pred = logits > threshold
    tp, active, predicted = (int(np.count_nonzero(a)) for a in (pred & y, y, pred))
    return {"recall": tp / max(1, active), "precision": tp / max(1, predicted),
            "predicted_sparsity": float(1.0 - pred.mean()), "true_sparsity": float(1.0 - y.mean())}


def train_predictor(x, y, *, rank: int, recall_target: float = 0.95, epochs: int = 12, batch_size: int = 128,
                    learning_rate: float = 3e-3, pos_weight: float = 2.0, seed: int = 0,
                    progress=None) -> tuple[Predictor, dict]:
    """Train a rank-`rank` predictor on FFN inputs x [T, d] and activity labels y [T, F] (bool).

    The tokens are split 80/10/10 (`split_indices`). The model trains on the first part with Adam
    and a cosine-decayed learning rate on `weighted_bce`. Its threshold is the highest logit cutoff
    whose validation recall is >= recall_target + RECALL_MARGIN. The metrics are measured on the
    held-back test part (see `evaluate`), plus rank, threshold, train_loss (first and last epoch's
    mean), params and seconds. progress(done, total), if given, is called after each epoch.

    Defaults (chosen on SmolLM2-135M layers, docs/performance.md): 12 epochs of 128-token batches.
    Twice as many steps gained little predicted sparsity; the same steps with larger batches gained
    nothing, fewer steps lost some."""
    start = time.perf_counter()
    x, y = np.asarray(x, np.float32), np.asarray(y, bool)
    train, val, test = split_indices(len(x))
    scale = _input_scale(x[train])
    model = Predictor(x.shape[1], y.shape[1], rank, rngs=nnx.Rngs(seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    batch_size = min(batch_size, len(train))
    steps = len(train) // batch_size
    lrs = np.asarray(optax.cosine_decay_schedule(learning_rate, epochs * steps)(np.arange(epochs * steps)))
    opt_state = _ADAM.init(params)
    x_train, y_train = jnp.asarray(x[train] * scale), jnp.asarray(y[train])
    rng = np.random.default_rng(seed)
    losses = []
    for e in range(epochs):
        order = rng.permutation(len(train))[:steps * batch_size].reshape(steps, batch_size)
        params, opt_state, loss = _epoch(graphdef, params, rest, opt_state, x_train, y_train, order,
                                         lrs[e * steps:(e + 1) * steps], jnp.float32(pos_weight))
        losses.append(float(loss))
        if progress is not None:
            progress(e + 1, epochs)

    nnx.update(model, params)
    model.down.kernel[...] = model.down.kernel[...] * scale[:, None]   # x * scale @ W == x @ (scale * W)
    threshold = calibrate_threshold(_predict(model, x[val]), y[val], min(1.0, recall_target + RECALL_MARGIN))
    model.threshold[...] = jnp.float32(threshold)
    metrics = evaluate(_predict(model, x[test]), y[test], threshold)
    metrics.update(rank=rank, threshold=threshold, train_loss=(losses[0], losses[-1]), params=n_params(model),
                   seconds=time.perf_counter() - start)
    return model, metrics


# ---------------------------------------------------------------- adaptive rank
def initial_rank(true_sparsity: float, min_rank: int, max_rank: int) -> int:
    """max_rank * density (1 - sparsity), a multiple of 16 within [min_rank, max_rank]: denser layers
    have more active neurons to tell apart, so their search starts higher."""
    rank = max(RANK_STEP, round(max_rank * (1.0 - true_sparsity) / RANK_STEP) * RANK_STEP)
    return min(max(rank, min_rank), max_rank)


def fit_layer(x, y, *, recall_target: float = 0.95, start_rank: int | None = None, min_rank: int = 16,
              max_rank: int = 256, sparsity_fraction: float = 0.85, tolerance: float = 0.01,
              **train_kwargs) -> tuple[Predictor, dict]:
    """The smallest rank (a multiple of 16 in [min_rank, max_rank]) whose predictor holds, found by
    halving from the start rank while it holds and doubling while it does not.

    Every rank reaches the recall target on validation, because the threshold is calibrated to it;
    what a larger rank buys is a sharper predictor, which lets more neurons be skipped at that
    recall. So a rank *holds* when its held-back recall is >= recall_target and it skips enough:
    either predicted_sparsity >= sparsity_fraction * true_sparsity (it finds most of what can be
    skipped), or doubling the rank would raise predicted_sparsity by less than `tolerance` (a
    fraction of all neurons; the layer's predictability has saturated, so more rank costs time for
    nothing). The held-back split thus also picks the rank; its figures are those of a split the
    weights and threshold never saw, not of one no decision saw.

    The start rank, unless given, is `initial_rank` of the layer's true sparsity. If the search
    reaches max_rank without holding, the tried rank with the highest predicted sparsity is returned
    and metrics["capped"] is True. metrics: the chosen predictor's `train_predictor` metrics, plus
    capped, seconds (the whole search) and tried {rank: {recall, precision, predicted_sparsity,
    seconds}}. train_kwargs (epochs, batch_size, learning_rate, pos_weight, seed, progress) go to
    every training, so progress restarts once per rank tried."""
    start = time.perf_counter()
    y = np.asarray(y, bool)
    fits = {}

    def fit(rank):
        if rank not in fits:
            fits[rank] = train_predictor(x, y, rank=rank, recall_target=recall_target, **train_kwargs)
        return fits[rank][1]

    def holds(rank):
        m = fit(rank)
        if m["recall"] < recall_target:
            return False
        if m["predicted_sparsity"] >= sparsity_fraction * m["true_sparsity"]:
            return True
        bigger = min(2 * rank, max_rank)
        return bigger > rank and fit(bigger)["predicted_sparsity"] - m["predicted_sparsity"] < tolerance

    def halve(rank):
        return max(min_rank, rank // (2 * RANK_STEP) * RANK_STEP)

    if start_rank:
        rank = min(max(start_rank, min_rank), max_rank)
    else:
        rank = initial_rank(1.0 - y.mean(), min_rank, max_rank)
    if holds(rank):
        while rank > min_rank and holds(halve(rank)):
            rank = halve(rank)
    else:
        while rank < max_rank:
            rank = min(2 * rank, max_rank)
            if holds(rank):
                break
    capped = not holds(rank)
    if capped:
        rank = max(fits, key=lambda r: (fits[r][1]["predicted_sparsity"], -r))

    model, metrics = fits[rank]
    keep = ("recall", "precision", "predicted_sparsity", "seconds")
    tried = {r: {k: m[k] for k in keep} for r, (_, m) in sorted(fits.items())}
    return model, {**metrics, "capped": capped, "tried": tried, "seconds": time.perf_counter() - start}
