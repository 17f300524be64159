"""Token sampling against hand-checkable distributions."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.config import ConfigError
from pjinfer.runtime import sampling
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


ODD_VOCABS = [1, 7, 255, 256, 257, 49157]   # below, at and past a row of sampling.ROW; the real vocabulary's size


def logits_cases(v: int, seed: int):
    """Fresh random logits of size v, with the cases a sort would settle and a search might not: ties for the
    largest, the largest in the last (partial) row, whole numbers (many ties), -inf, -0.0 beside 0.0."""
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(v) * 4).astype(np.float32)
    tied = base.copy()
    tied[rng.integers(0, v, 3)] = base.max() + 1
    last = np.full(v, -np.inf, np.float32)
    last[-1] = -3.0
    signed = np.round(base).astype(np.float32)
    signed[signed == 0] = rng.choice(np.float32([0.0, -0.0]), int((signed == 0).sum()))
    return [base, tied, last, signed]


@pytest.mark.parametrize("v", ODD_VOCABS)
def test_argmax_is_the_first_largest(v):
    for x in logits_cases(v, v):
        assert int(jax.jit(sampling.argmax)(jnp.asarray(x))) == int(np.argmax(x))


def test_order_keys_sort_like_the_floats():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(500) * 10.0 ** rng.integers(-40, 38, 500),
                        [0.0, np.inf, -np.inf, 1e-45, -1e-45, 3.4e38, -3.4e38]]).astype(np.float32)
    keys = np.asarray(sampling._order_keys(jnp.asarray(x)))
    order = np.argsort(keys, kind="stable")
    assert (np.diff(x[order]) >= 0).all() and len(set(keys.tolist())) == len(set(x.tolist()))


@pytest.mark.parametrize("v", ODD_VOCABS)
def test_kth_largest_matches_a_sort(v):
    kth = jax.jit(lambda x, k: sampling._kth_largest(sampling._order_keys(x), k))
    for x in logits_cases(v, v + 1):
        keys = np.asarray(sampling._order_keys(jnp.asarray(x)))
        ordered = np.sort(keys)[::-1]
        for k in sorted({1, 2, 40, v - 1, v, v + 5} & set(range(1, v + 6))):
            kept = keys >= ordered[min(k, v) - 1]               # more than the vocabulary: every token
            np.testing.assert_array_equal(keys >= int(kth(jnp.asarray(x), k)), kept, err_msg=f"{v} {k}")


@pytest.mark.parametrize("v", [7, 257, 49157])
def test_nucleus_matches_a_sort(v):
    """Over every token (floor: the lowest key), and over top-k's tokens (the weights 0 below the k-th largest,
    floor: its key), as sample() calls it."""
    nucleus = jax.jit(lambda x, w, p, floor: sampling._nucleus(sampling._order_keys(x), w, p, floor))
    for x in logits_cases(v, v + 2):
        keys = np.asarray(sampling._order_keys(jnp.asarray(x)))
        order = np.argsort(-x, kind="stable")
        for floor in (np.iinfo(np.int32).min, np.sort(keys)[::-1][min(5, v) - 1]):
            w = np.where(keys >= floor, np.exp(x.astype(np.float64) - x.max()), 0.0)
            before = np.cumsum(w[order]) - w[order]
            for p in (0.05, 0.5, 0.9, 0.999):
                inside = (before < p * w.sum()) & (w[order] > 0)
                if np.any(np.abs(before - p * w.sum()) < 1e-5 * w.sum()):
                    continue                                  # a boundary float rounding may settle either way
                want = x[order][inside].min()
                t = int(nucleus(jnp.asarray(x), jnp.asarray(w, jnp.float32), jnp.float32(p), np.int32(floor)))
                assert set(np.flatnonzero(keys >= t)) == set(np.flatnonzero(x >= want)), (v, p, floor)


@pytest.mark.parametrize("v", [1, 7, 257, 49157])
def test_draw_is_the_inverse_cdf(v):
    rng = np.random.default_rng(v)
    w = rng.random(v).astype(np.float32) * (rng.random(v) < 0.3)
    w[rng.integers(0, v)] = 0.5                                 # at least one token has weight
    draw = jax.jit(sampling._draw)
    total = np.cumsum(w.astype(np.float64))
    for u in [0.0, *rng.random(40), 1 - 2 ** -24]:
        got = int(draw(jnp.asarray(w), jnp.float32(u)))
        assert 0 <= got < v and w[got] > 0
        target = np.float32(u) * total[-1]
        if np.min(np.abs(total - target)) > 1e-5 * total[-1]:   # away from a boundary rounding may move
            assert got == int(np.searchsorted(total, target, side="right")), (v, u)
    w[:-1][: 2 * sampling.ROW + 3] = 0                            # whole rows without weight first
    w[-1] = 0.25
    for u, want in ((0.0, np.flatnonzero(w)[0]), (1 - 2 ** -24, np.flatnonzero(w)[-1])):
        assert int(draw(jnp.asarray(w), jnp.float32(u))) == int(want), (v, u)


def test_draw_stays_on_weight_where_a_running_sum_rounds_low():
    """One weight of 1 and many of 1e-8 in a row: its running sum stays 1.0 while the row's sum counts them."""
    w = jnp.asarray(np.r_[1.0, np.full(sampling.ROW - 1, 1e-8)].astype(np.float32))
    for u in (1 - 2 ** -24, 1 - 2 ** -23):
        assert int(jax.jit(sampling._draw)(w, jnp.float32(u))) == sampling.ROW - 1


def test_full_distribution_on_a_vocabulary_of_rows():
    """Past one row of sampling.ROW, with top-k wider than a row and the server's default filters."""
    rng = np.random.default_rng(12)
    logits = jnp.asarray(rng.standard_normal(701).astype(np.float32) * 2)
    for s in (Sampling(0.8, top_k=300, seed=6), Sampling(0.8, top_k=40, top_p=0.95, min_p=0.05, seed=7)):
        want = reference_probs(logits, s, NONE_SEEN)
        counts = np.bincount(draws(s, 40000, logits), minlength=701) / 40000
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
