"""Token sampling against hand-checkable distributions."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.config import ConfigError
from pjinfer.runtime.sampling import REPEAT_WINDOW, Sampling, penalize, push_recent, recent_window, sample

LOGITS = jnp.log(jnp.array([0.05, 0.4, 0.1, 0.3, 0.15]))
NONE_SEEN = jnp.full((REPEAT_WINDOW,), -1, jnp.int32)


def draws(s: Sampling, n=4000, logits=LOGITS, recent=NONE_SEEN):
    keys = jax.random.split(jax.random.key(s.seed), n)
    return np.asarray(jax.vmap(lambda k: sample(logits, k, s.params(), s.greedy, recent))(keys))


def reference_probs(logits, s: Sampling, recent) -> np.ndarray:
    """The sampling distribution computed plainly in numpy (float64)."""
    l = np.asarray(logits, np.float64).copy()
    seen = sorted({int(i) for i in np.asarray(recent) if i >= 0})
    l[seen] = np.where(l[seen] > 0, l[seen] / s.repeat_penalty, l[seen] * s.repeat_penalty)
    p = np.exp(l / s.temperature - np.max(l / s.temperature))
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), bool)
    if s.top_k:
        keep[order[:s.top_k]] = True
    else:
        keep[:] = True
    q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()      # top-p is taken after top-k
    mass_before = np.cumsum(q[order]) - q[order]
    nucleus = np.zeros(len(p), bool)
    nucleus[order[mass_before < s.top_p]] = True
    keep &= nucleus & (p >= s.min_p * p.max())
    return np.where(keep, p, 0) / np.where(keep, p, 0).sum()


def test_greedy_is_argmax():
    assert int(sample(LOGITS, jax.random.key(0), Sampling().params(), True, NONE_SEEN)) == 1


def test_greedy_sees_the_repetition_penalty():
    seen = push_recent(NONE_SEEN, 1)    # token 1 (p 0.4) was just produced; log 0.4 < 0, so it is multiplied
    assert int(sample(LOGITS, jax.random.key(0), Sampling(repeat_penalty=1.5).params(), True, seen)) == 3
    assert int(sample(LOGITS, jax.random.key(0), Sampling(repeat_penalty=1.0).params(), True, seen)) == 1


def test_penalty_matches_numpy_on_random_logits():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal(101).astype(np.float32) * 3
    recent = rng.integers(-1, 101, REPEAT_WINDOW).astype(np.int32)
    want = logits.astype(np.float64).copy()
    for i in {int(i) for i in recent if i >= 0}:
        want[i] = want[i] / 1.3 if want[i] > 0 else want[i] * 1.3
    got = np.asarray(penalize(jnp.asarray(logits), jnp.asarray(recent), jnp.float32(1.3)))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_recent_window_is_the_tail_of_the_text():
    tokens = jnp.arange(100, 130, dtype=jnp.int32)       # 30 tokens, say a padded prompt of which 20 are real
    w = np.asarray(recent_window(tokens, 20))
    assert (w[:REPEAT_WINDOW - 20] == -1).all() and w[-20:].tolist() == list(range(100, 120))
    long = jnp.arange(200, dtype=jnp.int32)
    assert np.asarray(recent_window(long, 150)).tolist() == list(range(150 - REPEAT_WINDOW, 150))
    assert np.asarray(push_recent(recent_window(long, 150), 7))[-2:].tolist() == [149, 7]


def test_min_p_keeps_tokens_near_the_most_likely():
    # Most likely 0.4: min-p 0.5 keeps p >= 0.2, min-p 0.3 keeps p >= 0.12.
    assert set(draws(Sampling(1.0, min_p=0.5))) == {1, 3}
    assert set(draws(Sampling(1.0, min_p=0.3))) == {1, 3, 4}


def test_full_distribution_matches_the_numpy_reference():
    rng = np.random.default_rng(11)
    logits = jnp.asarray(rng.standard_normal(40).astype(np.float32) * 1.5)
    recent = jnp.asarray(np.concatenate([np.full(REPEAT_WINDOW - 5, -1), rng.integers(0, 40, 5)]).astype(np.int32))
    s = Sampling(0.8, top_k=25, top_p=0.9, min_p=0.05, repeat_penalty=1.4, seed=5)
    want = reference_probs(logits, s, recent)
    counts = np.bincount(draws(s, 40000, logits, recent), minlength=40) / 40000
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(want))
    np.testing.assert_allclose(counts, want, atol=0.012)


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
                                    dict(top_p=1.5), dict(min_p=-0.1), dict(min_p=1.5),
                                    dict(repeat_penalty=0), dict(repeat_penalty=float("inf")), dict(seed=-1), dict(seed=2**32), dict(seed=10**20)])
def test_invalid_settings_are_refused(kwargs):
    with pytest.raises(ConfigError):
        Sampling(**kwargs)


def test_generate_and_stream_apply_the_same_penalty(engine):
    """The jitted while_loop and the token-by-token stream keep the same window, on the real model."""
    ids = engine.tokenizer.encode("List: apples, apples, apples, apples, apples,")
    penalized = Sampling(repeat_penalty=1.8)
    a = engine.generate(ids, max_new_tokens=12, sampling=penalized, stop_ids=[])
    b = list(engine.stream(ids, max_new_tokens=12, sampling=penalized, stop_ids=[]))
    assert a == b
    assert a != engine.generate(ids, max_new_tokens=12, stop_ids=[])


def test_seed_choice_random_when_sampling_without_one():
    from pjinfer.runtime.sampling import SEED_RANDOM, choose_seed

    assert choose_seed(7, 0.8) == 7 and choose_seed(0, 0.8) == 0 and choose_seed(2**32 - 1, 0.8) == 2**32 - 1
    assert choose_seed(None, 0.0) is None and choose_seed(SEED_RANDOM, 0.0) is None   # greedy uses no seed
    drawn = {choose_seed(None, 0.8) for _ in range(8)} | {choose_seed(SEED_RANDOM, 0.8) for _ in range(8)}
    assert all(0 <= s < 2**32 for s in drawn) and len(drawn) > 8    # 16 draws of 32 bits: repeats are unlikely
    for bad in (-2, 2**32, -(2**40)):
        with pytest.raises(ConfigError, match=r"seed must be in \[0, 2\*\*32\), or -1 for a random one"):
            choose_seed(bad, 0.8)
