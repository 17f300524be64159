"""Next-token choice: greedy, or temperature with optional top-k and top-p (nucleus) filtering."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pjinfer.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0 means greedy
    top_k: int = 0             # 0 means no top-k filter
    top_p: float = 1.0         # 1 means no nucleus filter
    seed: int = 0              # any value in [0, 2**32): the PRNG key takes 32 bits

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed must be in [0, 2**32), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def params(self):
        """The traced part: changing these values does not recompile."""
        return (jnp.float32(max(self.temperature, 1e-6)), jnp.int32(self.top_k), jnp.float32(self.top_p))


def sample(logits, key, params, greedy: bool):
    """logits [V] -> token id (int32). `greedy` is static; params = Sampling.params()."""
    if greedy:
        return jnp.argmax(logits).astype(jnp.int32)
    temperature, top_k, top_p = params
    logits = logits.astype(jnp.float32) / temperature
    ordered = jnp.sort(logits)[::-1]
    # top-k: keep logits at least as large as the k-th largest.
    kth = ordered[jnp.clip(top_k - 1, 0, logits.shape[0] - 1)]
    cutoff = jnp.where(top_k > 0, kth, -jnp.inf)
    # top-p: keep the smallest prefix of the sorted tokens whose probability reaches top_p.
    probs = jax.nn.softmax(jnp.where(ordered >= cutoff, ordered, -jnp.inf))
    before = jnp.cumsum(probs) - probs                  # mass strictly before each sorted token
    last_kept = jnp.sum(before < top_p) - 1
    cutoff = jnp.maximum(cutoff, ordered[last_kept])
    return jax.random.categorical(key, jnp.where(logits >= cutoff, logits, -jnp.inf)).astype(jnp.int32)
