"""Token sampling against hand-checkable distributions."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.config import ConfigError
from pjinfer.sampling import Sampling, sample

LOGITS = jnp.log(jnp.array([0.05, 0.4, 0.1, 0.3, 0.15]))


def draws(s: Sampling, n=4000):
    keys = jax.random.split(jax.random.key(s.seed), n)
    return np.asarray(jax.vmap(lambda k: sample(LOGITS, k, s.params(), s.greedy))(keys))


def test_greedy_is_argmax():
    assert int(sample(LOGITS, jax.random.key(0), Sampling().params(), True)) == 1


def test_top_k_keeps_only_the_k_most_likely():
    assert set(draws(Sampling(1.0, top_k=2))) == {1, 3}
    assert set(draws(Sampling(1.0, top_k=1))) == {1}


def test_top_p_keeps_the_smallest_nucleus():
    # Sorted: 0.4, 0.3, 0.15, 0.1, 0.05. p=0.6 needs the first two; p=0.75 the first three.
    assert set(draws(Sampling(1.0, top_p=0.6))) == {1, 3}
    assert set(draws(Sampling(1.0, top_p=0.75))) == {1, 3, 4}
    assert set(draws(Sampling(1.0, top_p=0.01))) == {1}


def test_temperature_one_follows_the_distribution():
    counts = np.bincount(draws(Sampling(1.0, seed=3), 20000), minlength=5) / 20000
    np.testing.assert_allclose(counts, np.exp(np.asarray(LOGITS)), atol=0.015)


def test_low_temperature_sharpens():
    counts = np.bincount(draws(Sampling(0.2, seed=4)), minlength=5) / 4000
    assert counts[1] > 0.75


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(temperature=float("nan")),
                                    dict(temperature=float("inf")), dict(top_k=-2), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(seed=-1), dict(seed=2**32), dict(seed=10**20)])
def test_invalid_settings_are_refused(kwargs):
    with pytest.raises(ConfigError):
        Sampling(**kwargs)
