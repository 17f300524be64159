"""Activation predictors (PowerInfer, arXiv 2312.12456, section 5.1): per-layer low-rank MLPs that
tell, from a layer's FFN input, which FFN neurons will be active, so only those are computed.

`train_predictor` fits one predictor at a fixed rank and calibrates its decision threshold to a
recall target; `fit_layer` searches for the smallest rank that is good enough for a layer.
"""
from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

RANK_STEP = 16            # ranks are multiples of 16: full vector lanes and GPU-friendly tiles
BLOCK = 256               # tokens per split block: one profiled window, so a held-back block is unseen text
SPLIT_CYCLE = 10          # of every 10 blocks: 8 train, 1 validation, 1 test
RECALL_MARGIN = 0.005     # calibrate above the target so held-back recall clears it too


class Threshold(nnx.Variable):
    """The logit cutoff of `Predictor.active`: a Variable so it saves and loads with the weights,
    but not a Param, so training leaves it alone."""


class Predictor(nnx.Module):
    """logits = up(relu(down(x))): d_model -> rank -> n_ff. A neuron is predicted active when its
    logit exceeds the calibrated threshold."""

    def __init__(self, d_model: int, n_ff: int, rank: int, *, rngs: nnx.Rngs):
        self.down = nnx.Linear(d_model, rank, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(rank, n_ff, rngs=rngs)
        self.threshold = Threshold(jnp.zeros((), jnp.float32))

    @property
    def rank(self) -> int:
        return self.down.out_features

    def __call__(self, x):
        return self.up(jax.nn.relu(self.down(x)))

    def active(self, x):
        return self(x) > self.threshold[...]


def n_params(predictor: Predictor) -> int:
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(predictor, nnx.Param)))


# ---------------------------------------------------------------- data splits
def split_indices(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deterministic train / validation / test token indices (80/10/10 by blocks of consecutive
    tokens). Whole blocks keep neighbouring tokens of one text out of different splits, and cycling
    through the blocks spreads every split over the whole calibration set (which mixes text kinds)."""
    block = max(1, min(BLOCK, n // (2 * SPLIT_CYCLE)))
    part = (np.arange(n) // block) % SPLIT_CYCLE
    return np.flatnonzero(part < 8), np.flatnonzero(part == 8), np.flatnonzero(part == 9)


# ---------------------------------------------------------------- loss and training
def weighted_bce(logits, y, pos_weight):
    """Binary cross-entropy with the active class weighted by `pos_weight`.

    Why weighted: the two errors cost differently. A missed active neuron changes the layer's
    output (accuracy); a wrongly predicted one is only computed in vain (time). Weighting positives
    pushes the model to spend its capacity on never scoring an active neuron low, which is the
    region the recall-calibrated threshold ends up in. A focal term was not used: it down-weights
    the easy examples, but at a 95% recall operating point the hard positives are exactly the ones
    the weighted BCE already emphasises, and it adds a second knob."""
    y = y.astype(logits.dtype)
    return jnp.mean(pos_weight * y * jax.nn.softplus(-logits) + (1 - y) * jax.nn.softplus(logits))


def _input_scale(x: np.ndarray) -> np.ndarray:
    """Per-feature 1/std of the inputs. Residual-stream features differ in scale by 1000x; training
    on scaled inputs lets Adam treat them alike, and the scale folds exactly into `down` after."""
    return (1.0 / np.maximum(x.std(axis=0), 1e-6)).astype(np.float32)


def _epoch_fn(graphdef, rest, tx, pos_weight):
    """One jitted epoch: a lax.scan over minibatches, so Python is out of the inner loop."""

    def loss_fn(params, xb, yb):
        return weighted_bce(nnx.merge(graphdef, params, rest)(xb), yb, pos_weight)

    def step(carry, idx, x, y):
        params, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, x[idx], y[idx])
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    @jax.jit
    def epoch(params, opt_state, x, y, order):
        (params, opt_state), losses = jax.lax.scan(lambda c, i: step(c, i, x, y), (params, opt_state), order)
        return params, opt_state, jnp.mean(losses)

    return epoch


@jax.jit
def _logits(model, x):
    return model(x)


def _predict(model: Predictor, x: np.ndarray, chunk: int = 4096) -> np.ndarray:
    return np.concatenate([np.asarray(_logits(model, x[i:i + chunk])) for i in range(0, len(x), chunk)])


def calibrate_threshold(logits: np.ndarray, y: np.ndarray, recall: float) -> float:
    """The highest cutoff t whose recall (fraction of active entries with logit > t) is >= `recall`.

    With the active entries' logits sorted in descending order, at least k = ceil(recall * P) of
    them must clear t, so t must lie below the k-th largest; the highest such float32 is the next
    one down from it (anything at or above it loses the k-th)."""
    pos = np.asarray(logits, np.float32)[np.asarray(y, bool)]
    k = min(len(pos), max(1, math.ceil(recall * len(pos) - 1e-9)))
    kth = np.partition(pos, len(pos) - k)[len(pos) - k]
    return float(np.nextafter(np.float32(kth), np.float32(-np.inf)))


def evaluate(logits: np.ndarray, y: np.ndarray, threshold: float) -> dict:
    """Recall, precision and sparsity of the decisions logits > threshold against labels y [T, F]."""
    pred = logits > threshold
    tp = np.count_nonzero(pred & y)
    return {"recall": tp / max(1, np.count_nonzero(y)), "precision": tp / max(1, np.count_nonzero(pred)),
            "predicted_sparsity": 1.0 - pred.mean(), "true_sparsity": 1.0 - y.mean()}


def train_predictor(x, y, *, rank: int, recall_target: float = 0.95, epochs: int = 8, batch_size: int = 256,
                    learning_rate: float = 3e-3, pos_weight: float = 2.0, seed: int = 0,
                    progress=None) -> tuple[Predictor, dict]:
    """Train a rank-`rank` predictor on FFN inputs x [T, d] and activity labels y [T, F] (bool).

    The tokens are split 80/10/10 (`split_indices`); the model trains on the first part with
    Adam (cosine-decayed learning rate) on `weighted_bce`; its threshold is the highest logit cutoff
    whose validation recall is >= recall_target + RECALL_MARGIN; the metrics are measured on the
    held-back test part: recall, precision, predicted_sparsity (fraction of neurons predicted
    inactive), true_sparsity, plus loss (first and last epoch's mean train loss), params, seconds.
    progress(done, total), if given, is called after each epoch."""
    start = time.perf_counter()
    x, y = np.asarray(x, np.float32), np.asarray(y, bool)
    train, val, test = split_indices(len(x))
    scale = _input_scale(x[train])
    model = Predictor(x.shape[1], y.shape[1], rank, rngs=nnx.Rngs(seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    steps = max(1, len(train) // batch_size)
    tx = optax.adam(optax.cosine_decay_schedule(learning_rate, epochs * steps))
    opt_state = tx.init(params)
    epoch = _epoch_fn(graphdef, rest, tx, pos_weight)
    x_train, y_train = jnp.asarray(x[train] * scale), jnp.asarray(y[train])
    rng = np.random.default_rng(seed)
    losses = []
    for e in range(epochs):
        order = rng.permutation(len(train))[:steps * batch_size].reshape(steps, batch_size)
        params, opt_state, loss = epoch(params, opt_state, x_train, y_train, jnp.asarray(order))
        losses.append(float(loss))
        if progress is not None:
            progress(e + 1, epochs)

    nnx.update(model, params)
    model.down.kernel[...] = model.down.kernel[...] * scale[:, None]   # fold the input scale back in
    threshold = calibrate_threshold(_predict(model, x[val]), y[val], min(1.0, recall_target + RECALL_MARGIN))
    model.threshold[...] = jnp.float32(threshold)
    metrics = evaluate(_predict(model, x[test]), y[test], threshold)
    metrics.update(rank=rank, threshold=threshold, loss=(losses[0], losses[-1]), params=n_params(model),
                   seconds=time.perf_counter() - start)
    return model, metrics
