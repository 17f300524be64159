"""cpu_offload.attention: the host decode's attention over a float16 cache, against numpy in float64."""
from __future__ import annotations

import numpy as np
import pytest

from cpu_offload import attention as att


def _reference(q, k, v, pos):
    """q [H, hd], k/v float16 [S, KV, hd] -> [H, hd] in float64 over positions 0..pos."""
    group = q.shape[0] // k.shape[1]
    out = np.empty(q.shape, np.float64)
    for h in range(q.shape[0]):
        keys = k[:pos + 1, h // group].astype(np.float64)
        scores = keys @ q[h].astype(np.float64) / np.sqrt(q.shape[1])
        p = np.exp(scores - scores.max())
        out[h] = (p / p.sum()) @ v[:pos + 1, h // group].astype(np.float64)
    return out


def _run(q, k, v, pos, n):
    """attention.attend_share for every thread in turn, then merge, on poisoned scores and output."""
    scores = np.full((q.shape[0], k.shape[0]), np.nan, np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    for tid in range(n):
        att.attend_share(q, k.view(np.uint16), v.view(np.uint16), pos, tid, n, scores, out)
    att.merge(pos, n, scores, out)
    return out, scores


# head_dim from one 16-lane chunk to the largest (attention.MAX_CHUNKS); lengths with every remainder class of the
# scores' 16-row blocks that the positions split gives.
@pytest.mark.parametrize("heads,kv,hd", [(9, 3, 64), (4, 1, 32), (2, 2, 64), (6, 2, 48), (4, 4, 16), (8, 2, 128),
                                         (2, 1, 256)])
@pytest.mark.parametrize("length", [1, 5, 67, 301, 1031])
def test_attention_matches_numpy_at_first_middle_and_last_position(heads, kv, hd, length):
    rng = np.random.default_rng(heads * 10007 + length)
    q = rng.standard_normal((heads, hd)).astype(np.float32)
    k = (rng.standard_normal((length, kv, hd)) * rng.uniform(0.5, 4)).astype(np.float16)
    v = rng.standard_normal((length, kv, hd)).astype(np.float16)
    for pos in sorted({0, length // 2, length - 1}):
        want = _reference(q, k, v, pos)
        for n in (1, 2, 3):
            got, scores = _run(q, k, v, pos, n)
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
            assert np.isnan(scores[:, pos + 1:]).all()  # nothing past the position is read or written


def test_positions_are_split_at_long_context_and_heads_at_short():
    heads, hd = 9, 64
    for n in (1, 2, 3, 4, 16):
        for pos in (0, 5, 127, 300, 2047, 4095):
            shares = [att.share(pos, hd, t, n, heads) for t in range(n)]
            covered = np.zeros((heads, pos + 1), np.int64)
            for lo, hi, qa, qb, split in shares:
                covered[qa:qb, lo:hi] += 1
                if split and hi > lo:
                    assert hi - lo >= hd + att.PARTIAL_EXTRA  # room for the chunk's partial
            assert (covered == 1).all()
            assert len({s[4] for s in shares}) == 1
            if pos < att.MIN_CHUNK or n == 1:
                assert not shares[0][4]
            if pos == 4095 and n > 1:
                assert shares[0][4]


def test_store_rounds_like_numpy_and_conversions_round_trip():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(1000) * 10.0 ** rng.integers(-9, 6, 1000),
                        [0.0, -0.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2.0 ** -24]]).astype(np.float32)
    k = np.full((x.size, 1), 0xFFFF, np.uint16)  # NaN bits
    v = np.full((x.size, 1), 0xFFFF, np.uint16)
    for i in range(x.size):
        att.store(x[i:i + 1], -x[i:i + 1], k[i], v[i])
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(k[:, 0], x.astype(np.float16).view(np.uint16))
        np.testing.assert_array_equal(v[:, 0], (-x).astype(np.float16).view(np.uint16))
    bits = np.arange(1 << 16, dtype=np.uint16)
    halves = bits.view(np.float16)
    finite = np.isfinite(halves)
    got = np.full(bits.size, np.nan, np.float32)
    _widen(bits, got)
    np.testing.assert_array_equal(got[finite], halves[finite].astype(np.float32))
    assert np.isinf(got[np.isinf(halves)]).all() and np.isnan(got[np.isnan(halves)]).all()


from numba import njit  # noqa: E402


@njit
def _widen(bits, out):
    """out = bits widened as the attention's products widen cache rows: one row of 16 weighted by 1 (_weighted)."""
    one = np.ones(1, np.float32)
    for i in range(0, bits.shape[0], att.LANES):
        acc = np.zeros(att.LANES, np.float32)
        att._weighted(1, 1, 1, one.ctypes.data, 0, bits[i:].ctypes.data, 2 * att.LANES, acc.ctypes.data)
        out[i:i + att.LANES] = acc


def test_exp_matches_numpy_down_to_the_clamp():
    x = np.concatenate([-np.linspace(0, 100, 20001), [-1e-30, -88.5, -np.inf]]).astype(np.float32)
    got = x.copy()
    total = att.exp_shifted(got, np.float32(0))
    want = np.exp(x.astype(np.float64))
    kept = x >= -87  # below, it returns exp(-87) = 1.6e-38: noise next to the maximum's 1
    np.testing.assert_allclose(got[kept], want[kept], rtol=1e-6)
    assert (got[~kept] <= 2e-38).all() and (got[~kept] >= 0).all()
    np.testing.assert_allclose(total, want.sum(), rtol=1e-5)


def test_the_attention_benchmark_reports_each_length_from_l2_and_in_turn(capsys):
    """`python -m cpu_offload.bench --attention`'s table (docs/performance.md): a row per cache length, each with a
    time and a rate from L2 and over the layers in turn."""
    from cpu_offload import bench

    bench.attention_table(1, lengths=(16, 300), layers=2)
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["16", "300"]
    for r in rows:
        assert r.count("us (") == 2 and r.count("GB/s)") == 2, r


@pytest.mark.parametrize("heads,kv,hd", [(9, 3, 64), (14, 2, 64), (8, 2, 128), (12, 3, 32), (8, 1, 16)])
@pytest.mark.parametrize("length,n", [(13, 1), (301, 1), (301, 2), (1031, 2)])
def test_heads_that_share_a_kv_head_get_the_bits_each_gets_alone(heads, kv, hd, length, n):
    """A GQA group's heads taken together (each cache row widened once for all of them) against each head run as a
    one-head model over its own KV head: the same bits, remainder rows of the 16-row tree included."""
    rng = np.random.default_rng(heads * 1000 + length)
    q = rng.standard_normal((heads, hd)).astype(np.float32)
    k = rng.standard_normal((length + 2, kv, hd)).astype(np.float16)
    v = rng.standard_normal((length + 2, kv, hd)).astype(np.float16)
    together = att.attend(q, k, v, length - 1, n)
    group = heads // kv
    for h in range(heads):
        g = h // group
        alone = att.attend(q[h:h + 1], k[:, g:g + 1], v[:, g:g + 1], length - 1, n)
        np.testing.assert_array_equal(together[h].view(np.uint32), alone[0].view(np.uint32))
