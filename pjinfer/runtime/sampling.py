"""Next-token choice: a repetition penalty, then greedy, or temperature with optional top-k, top-p (nucleus) and
min-p filtering.

The repetition penalty (CTRL's, as llama.cpp's --repeat-penalty) looks at the last REPEAT_WINDOW tokens (prompt
included): a positive logit of such a token is divided by the penalty, a negative one multiplied. It applies to
greedy decoding too. Filters work on the distribution after temperature: top-k keeps the k most likely tokens,
top-p the smallest set whose probability reaches p, min-p the tokens at least min_p times as likely as the most
likely one; a token must pass all three."""
from __future__ import annotations

import dataclasses
import math
import secrets

import jax
import jax.numpy as jnp
import numpy as np

from pjinfer.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0 means greedy
    top_k: int = 0             # 0 means no top-k filter
    top_p: float = 1.0         # 1 means no nucleus filter
    seed: int = 0              # any value in [0, 2**32): the PRNG key takes 32 bits
    min_p: float = 0.0         # 0 means no min-p filter
    repeat_penalty: float = 1.0  # 1 means no penalty

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min-p must be in [0, 1], got {self.min_p}")
        if not (self.repeat_penalty > 0 and math.isfinite(self.repeat_penalty)):
            raise ConfigError(f"repeat penalty must be a finite number > 0, got {self.repeat_penalty}")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed must be in [0, 2**32), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def first_keys(self) -> np.ndarray:
        """jax.random.split(jax.random.key(self.seed)) as key data, uint32 [2, 2]: the request's key, then the
        subkey its first token is sampled with. One executable: outside jit each of those calls (the seed's
        conversion, the seeding, the split, the unpacking) compiles and keeps an executable of its own."""
        return np.asarray(_split_seed(np.int64(self.seed)))

    def params(self):
        """The traced part: changing these values does not recompile. numpy scalars: a jnp scalar is a device
        array, costly to make, which the batched step paid for every request on every token."""
        return (np.float32(max(self.temperature, 1e-6)), np.int32(self.top_k), np.float32(self.top_p),
                np.float32(self.min_p), np.float32(self.repeat_penalty))


@jax.jit
def _split_seed(seed):
    return jax.random.key_data(jax.random.split(jax.random.key(seed)))


SEED_RANDOM = -1     # a seed of -1 asks for a random one (llama.cpp's convention)


def choose_seed(seed: int | None, temperature: float) -> int | None:
    """The seed a run samples with: `seed` when given in [0, 2**32); a fresh random one when it is None or
    SEED_RANDOM and the run samples (temperature > 0); None for a greedy run without one (no seed is used).
    Any other value is refused (ConfigError)."""
    if seed is not None and seed != SEED_RANDOM and not 0 <= seed < 2**32:
        raise ConfigError(f"seed must be in [0, 2**32), or -1 for a random one; got {seed}")
    if seed is not None and seed != SEED_RANDOM:
        return seed
    return secrets.randbelow(2**32) if temperature > 0 else None


REPEAT_WINDOW = 64   # tokens the repetition penalty looks back over (llama.cpp's default)


def recent_window(tokens, length):
    """The last REPEAT_WINDOW ids of tokens[:length] (tokens [T], int32), -1 where the text is shorter."""
    idx = length - REPEAT_WINDOW + jnp.arange(REPEAT_WINDOW)
    return jnp.where(idx >= 0, tokens[jnp.clip(idx, 0, tokens.shape[0] - 1)], -1).astype(jnp.int32)


def recent_ids(prompt_ids) -> np.ndarray:
    """recent_window of a whole prompt, computed on the host (numpy int32 [REPEAT_WINDOW])."""
    recent = np.full(REPEAT_WINDOW, -1, np.int32)
    tail = np.asarray(prompt_ids[-REPEAT_WINDOW:], np.int32)
    recent[REPEAT_WINDOW - len(tail):] = tail
    return recent


def push_recent(recent, token):
    """The window after `token` is appended (the oldest id drops out)."""
    return jnp.concatenate([recent[1:], jnp.reshape(token, (1,)).astype(jnp.int32)])


def penalize(logits, recent, penalty):
    """CTRL's repetition penalty on the ids in `recent` (-1 entries ignored)."""
    seen = jnp.zeros(logits.shape, bool).at[jnp.where(recent >= 0, recent, logits.shape[0])].set(True, mode="drop")
    return jnp.where(seen, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)


def sample(logits, key, params, greedy: bool, recent):
    """logits [V] -> token id (int32). `greedy` is static; params = Sampling.params(); recent: the window of
    previous ids the repetition penalty sees ([REPEAT_WINDOW] int32, -1 for none).

    No sort: each filter's cutoff is found by bisection over the logits' order (_order_keys), a pass over the
    vocabulary per step, and the token is drawn by inverse CDF over rows of ROW logits. XLA's CPU sort of the
    vocabulary cost more than the decode step (docs/performance.md, "Sampling without a sort")."""
    temperature, top_k, top_p, min_p, penalty = params
    logits = penalize(logits.astype(jnp.float32), recent, penalty)
    if greedy:
        return argmax(logits)
    z = logits / temperature
    keys, top = _order_keys(z), jnp.max(z)
    lowest = jnp.int32(jnp.iinfo(jnp.int32).min)
    # top-k: keep logits at least as large as the k-th largest. The settings are traced: a cond, not a where,
    # skips a search that is off.
    cutoff = jax.lax.cond(top_k > 0, lambda: _kth_largest(keys, top_k), lambda: lowest)
    weights = jnp.where(keys >= cutoff, jnp.exp(z - top), 0.0)
    # top-p, over what top-k kept: the smallest set of the most likely tokens whose probability reaches top_p.
    cutoff = jnp.maximum(cutoff, jax.lax.cond(top_p < 1, lambda: _nucleus(keys, weights, top_p, cutoff),
                                              lambda: lowest))
    # min-p: p_i >= min_p * p_max, i.e. logit_i >= logit_max + log(min_p).
    cutoff = jnp.maximum(cutoff, _order_keys(top + jnp.log(min_p)))
    return _draw(jnp.where(keys >= cutoff, weights, 0.0), jax.random.uniform(key))


ROW = 256   # argmax and the draw work on the vocabulary as rows of this many logits


def argmax(x):
    """jnp.argmax of x [V] without NaN (the first index of the largest), as int32: the largest row, then the largest
    in it. XLA's CPU argmax is a scalar loop, ten times slower over the default model's vocabulary."""
    rows = _rows(x, -jnp.inf)
    row = jnp.argmax(jnp.max(rows, axis=1))
    return (row * ROW + jnp.argmax(rows[row])).astype(jnp.int32)


def _rows(x, fill):
    """x [V] -> [ceil(V / ROW), ROW], the tail filled with `fill`."""
    n = -(-x.shape[0] // ROW)
    return jnp.pad(x, (0, n * ROW - x.shape[0]), constant_values=fill).reshape(n, ROW)


def _order_keys(x):
    """float32 -> int32 keys in the same order (-0.0 just below 0.0): a cutoff is searched over these."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def _mid(lo, hi, up: bool):
    """(lo + hi) / 2 rounded down (or up), without overflowing int32."""
    return (lo >> 1) + (hi >> 1) + ((lo | hi if up else lo & hi) & 1)


def _kth_largest(keys, k):
    """A cutoff t that keeps what the k-th largest key keeps: {keys >= t} is {keys >= the k-th largest} (every
    key when k > V). The largest t with at least k keys >= t, or sooner, the first t found with exactly k."""
    def more(state):
        lo, hi, exact = state
        return (lo < hi) & ~exact

    def halve(state):                # the answer is in [lo, hi]
        lo, hi, _ = state
        mid = _mid(lo, hi, up=True)
        n = jnp.sum(keys >= mid)
        return jnp.where(n >= k, mid, lo), jnp.where(n >= k, hi, mid - 1), n == k
    return jax.lax.while_loop(more, halve, (jnp.min(keys), jnp.max(keys), jnp.bool_(False)))[0]


def _nucleus(keys, weights, p, floor):
    """The smallest key t whose tokens above it (keys > t) hold less than p of the weights (0 < p < 1): the
    nucleus is the tokens at or above t. floor: a key at or below the answer (top-k's cutoff: below it every
    weight is 0, so the answer is not lower), which narrows the search."""
    below = p * jnp.sum(weights)

    def halve(bounds):               # the answer is in [lo, hi]
        lo, hi = bounds
        mid = _mid(lo, hi, up=False)
        small = jnp.sum(jnp.where(keys > mid, weights, 0.0)) < below
        return jnp.where(small, lo, mid + 1), jnp.where(small, mid, hi)
    start = (jnp.maximum(floor, jnp.min(keys)), jnp.max(keys))
    return jax.lax.while_loop(lambda bounds: bounds[0] < bounds[1], halve, start)[0]


def _draw(weights, u):
    """The index i drawn with probability weights[i] / sum(weights) (weights >= 0, not all 0) for u uniform in
    [0, 1): the first index whose running sum passes u * sum, by rows then within the row. u * sum < sum in
    float32, so some row's running sum passes it; inside the row, where the row's running sum rounds below its
    sum and nothing passes, the row's last index with weight."""
    rows = _rows(weights, 0.0)
    sums = jnp.sum(rows, axis=1)
    ends = jnp.cumsum(sums)
    target = u * ends[-1]
    row = jnp.sum(ends <= target)
    inside = rows[row]
    last = jnp.max(jnp.where(inside > 0, jnp.arange(ROW), 0))
    col = jnp.minimum(jnp.sum(jnp.cumsum(inside) <= target - (ends[row] - sums[row])), last)
    return (row * ROW + col).astype(jnp.int32)
