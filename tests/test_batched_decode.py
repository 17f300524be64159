"""cpu_offload.q4_gemm and batched_decode, pjinfer.runtime.batch: the batched host decode step against float64 numpy, and
against the single-token decoder bit for bit (a request's tokens must not depend on what else is in the batch)."""
from __future__ import annotations

import numpy as np
import pytest

from cpu_offload import batched_decode as bd
from cpu_offload import decoder, int8, kernels, q4, q4_gemm
from tests.conftest import q4_dot_tolerance, random_weights, tiny_config

jax = pytest.importorskip("jax")
jnp = jax.numpy


def _fresh_rng():
    """A new seed every run (printed by the assertion messages that use it)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return seed, np.random.default_rng(seed)


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


# ------------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("rows,cols", [(1, 32), (5, 96), (37, 576), (131, 1536)])
@pytest.mark.parametrize("nt", [1, 3, q4_gemm.GROUP, q4_gemm.GROUP + 3])
def test_q4_gemm_matches_float64_numpy_and_the_gemv_bit_for_bit(rows, cols, nt):
    seed, rng = _fresh_rng()
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.1, 3, (rows, 1)).astype(np.float32)
    blocks = q4.quantize(w)
    x = rng.standard_normal((nt, cols)).astype(np.float32)
    want = x.astype(np.float64) @ q4.dequantize(blocks, cols).astype(np.float64).T       # [nt, rows]
    xp = np.full((nt + 2, q4.prepared_size(cols) + 7), np.nan, np.float32)               # wider rows than needed
    for t in range(nt):
        q4.prepare(x[t], xp[t])
    for lo, hi in [(0, rows), (0, 0), (rows // 2, rows), (1 % rows, max(1 % rows, rows - 1))]:
        y = np.full((nt + 1, rows), np.nan, np.float32)                                  # poisoned, one row spare
        q4_gemm.gemm(blocks, xp, y, nt, lo, hi)
        err = np.abs(y[:nt, lo:hi] - want[:, lo:hi])
        assert (err <= q4_dot_tolerance(blocks, cols, x)[:, lo:hi]).all(), f"seed {seed}: max error {err.max()}"
        assert np.isnan(y[:, :lo]).all() and np.isnan(y[:, hi:]).all() and np.isnan(y[nt]).all(), seed
        for t in range(nt):
            single = np.full(rows, np.nan, np.float32)
            q4.gemv(blocks, xp[t], single, lo, hi)
            np.testing.assert_array_equal(_bits(y[t, lo:hi]), _bits(single[lo:hi]), err_msg=f"seed {seed}")


@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 192), (37, 576), (131, 576)])
@pytest.mark.parametrize("nt", [1, 4, 11])
def test_int8_gemm_matches_float64_numpy_and_the_gemv_bit_for_bit(rows, cols, nt):
    seed, rng = _fresh_rng()
    q, s = decoder.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.1, 3, (rows, 1)))
    x = rng.standard_normal((nt, cols)).astype(np.float32)
    want = x.astype(np.float64) @ kernels.dequantize_rows(q, s).astype(np.float64).T
    out_rows = rng.permutation(nt + 2)[:nt].astype(np.int64)    # token t's output goes to row out_rows[t]
    for lo, hi in [(0, rows), (0, 0), (rows // 4 * 4, rows)]:
        y = np.full((nt + 2, rows), np.nan, np.float32)
        q4_gemm.gemm_int8(q, s, x, y, out_rows, nt, lo, hi)
        got = y[out_rows]
        np.testing.assert_allclose(got[:, lo:hi], want[:, lo:hi], rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=f"seed {seed}")
        untouched = np.setdiff1d(np.arange(nt + 2), out_rows)
        assert np.isnan(got[:, :lo]).all() and np.isnan(got[:, hi:]).all() and np.isnan(y[untouched]).all(), seed
        for t in range(nt):
            single = np.full(rows, np.nan, np.float32)
            int8.gemv(q, s, x[t], single, lo, hi)
            np.testing.assert_array_equal(_bits(got[t, lo:hi]), _bits(single[lo:hi]), err_msg=f"seed {seed}")


# ------------------------------------------------------------------------------------------------ whole steps
def _single_steps(host, config, tokens_per_slot, cache_len):
    """Per request: logits [T, vocab] and final caches of HostDecoder's one-token steps (the single path)."""
    emb = np.asarray(host.dequantized(random_weights(config))["embed"])   # only for x; the same for both paths
    out = []
    for tokens in tokens_per_slot:
        k = [jnp.zeros((1, cache_len, config.n_kv_heads, config.head_dim), jnp.float16)] * config.n_layers
        v = list(k)
        logits = []
        for pos, token in enumerate(tokens):
            x = jnp.asarray(emb[token])[None, None]
            for l in range(config.n_layers):
                x, k[l], v[l] = jax.jit(host.layer, static_argnums=0)(l, x, jnp.int32(pos), k[l], v[l])
            logits.append(np.asarray(jax.jit(host.head)(x[0, 0])))
        out.append((np.stack(logits), [np.asarray(a[0]) for a in k], [np.asarray(a[0]) for a in v]))
    return emb, out


@pytest.mark.parametrize("fmt", ["q4_1", "int8"])
def test_batch_step_equals_single_steps_bit_for_bit_with_empty_slots(fmt):
    config = tiny_config(d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=192, tie_embeddings=True)
    host = decoder.HostDecoder(config, random_weights(config), fmt)
    batch = bd.BatchDecoder(host, 4)
    seed, rng = _fresh_rng()
    live = [0, 2, 3]                                   # slot 1 stays empty throughout
    steps, cache_len = 6, 16
    tokens = rng.integers(0, config.vocab_size, (len(live), steps))
    emb, single = _single_steps(host, config, tokens, cache_len)
    layer = jax.jit(batch.layer, static_argnums=0, donate_argnums=(3, 4))
    head = jax.jit(batch.head)
    shape = (4, cache_len, config.n_kv_heads, config.head_dim)
    k = [jnp.full(shape, jnp.nan, jnp.float16) for _ in range(config.n_layers)]
    v = [jnp.full(shape, jnp.nan, jnp.float16) for _ in range(config.n_layers)]
    for n in range(steps):
        pos = np.full(4, -1, np.int32)
        x = np.full((4, 1, config.d_model), 7.0, np.float32)   # an empty slot's x must come back unchanged
        for i, slot in enumerate(live):
            pos[slot] = n
            x[slot, 0] = emb[tokens[i, n]]
        x = jnp.asarray(x)
        for l in range(config.n_layers):
            x, k[l], v[l] = layer(l, x, jnp.asarray(pos), k[l], v[l])
        logits = np.asarray(head(x[:, 0], jnp.asarray(pos)))
        np.testing.assert_array_equal(np.asarray(x)[1], 7.0)
        np.testing.assert_array_equal(logits[1], 0.0)
        for i, slot in enumerate(live):
            np.testing.assert_array_equal(_bits(logits[slot]), _bits(single[i][0][n]), err_msg=f"seed {seed} step {n} slot {slot}")
    for i, slot in enumerate(live):
        for l in range(config.n_layers):
            np.testing.assert_array_equal(_bits(np.asarray(k[l])[slot, :steps]), _bits(single[i][1][l][:steps]))
            np.testing.assert_array_equal(_bits(np.asarray(v[l])[slot, :steps]), _bits(single[i][2][l][:steps]))
    assert np.isnan(np.asarray(k[0])[1]).all()        # the empty slot's cache was never written


def test_batch_refuses_positions_past_the_cache_and_bad_shapes():
    config = tiny_config(d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=128)
    batch = bd.BatchDecoder(decoder.HostDecoder(config, random_weights(config), "q4_1"), 2)
    k = jnp.zeros((2, 16, 1, 32), jnp.float16)
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(Exception, match="position outside the cache"):
        jax.block_until_ready(jax.jit(lambda x, p, k, v: batch.layer(0, x, p, k, v))(x, jnp.array([3, 16]), k, k))
    with pytest.raises(ValueError, match="x must be"):
        batch.layer(0, jnp.ones((3, 64)), jnp.zeros(3, jnp.int32), k, k)
    with pytest.raises(ValueError, match="max batch"):
        bd.BatchDecoder(batch.host, 0)


# ------------------------------------------------------------------------------------------------ real model
def test_real_model_batch_equals_engine_stream_for_every_request(q4_engine):
    """Full and partly empty batches, greedy and sampled requests: each request's tokens are Engine.stream's."""
    from pjinfer.runtime.batch import Batch
    from pjinfer.runtime.sampling import Sampling

    batch = Batch(q4_engine, 8)
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn is",
               "Water boils at", "My favourite animal is", "In 1492,", "The opposite of hot is"]
    samplings = [Sampling(), Sampling(temperature=0.8, top_k=40, seed=3), Sampling(repeat_penalty=1.3),
                 Sampling(temperature=1.0, top_p=0.9, seed=7)] * 2
    n = 10
    tok = q4_engine.tokenizer
    want = [list(q4_engine.stream(tok.encode(p), max_new_tokens=n, sampling=s, stop_ids=[]))
            for p, s in zip(prompts, samplings)]
    # All 8 slots from the start; then 3 requests in slots 6, 1, 4 with the others empty, joining at different steps.
    for slots, joins in [(list(range(8)), [0] * 8), ([6, 1, 4], [0, 2, 5])]:
        states, got = {}, {i: [] for i in range(len(slots))}
        for step in range(n + max(joins)):
            live = [i for i in states if len(got[i]) < n]          # requests that joined at an earlier step
            if live:
                batch.step([states[i] for i in live])
                for i in live:
                    got[i].append(states[i].token)
            for i, (slot, join) in enumerate(zip(slots, joins)):
                if step == join:                                     # prefill: its first token
                    states[i] = batch.start(slot, tok.encode(prompts[i]), n, samplings[i])
                    got[i].append(states[i].token)
        assert [got[i] for i in range(len(slots))] == want[:len(slots)]
    assert batch.widest == 8


def test_engines_that_cannot_batch_say_why(engine):
    from pjinfer.runtime.batch import Batch, unsupported

    assert "--weights q4_1 or int8" in unsupported(engine)
    with pytest.raises(ValueError, match="batched decode runs the dense host decode"):
        Batch(engine, 4)


def test_decode_handlers_compute_in_one_floating_point_environment():
    """team.enter sets FTZ/DAZ (what XLA's threads compute with) whatever the thread had; leave gives it back."""
    from numba import njit

    from cpu_offload import team

    @njit
    def probe():
        before = team.get_fpenv()
        saved = team.enter()
        inside = team.get_fpenv()
        team.leave(saved)
        return before, saved, inside, team.get_fpenv()

    before, saved, inside, after = probe()
    assert saved == before and inside == team.FPENV and after == before and before != team.FPENV
