"""cpu_offload.q8_dot.gemm, int8.gemm and batched_decode, pjinfer.runtime.batch: the batched host decode step against
float64 numpy, and against the single-token decoder bit for bit (a request's tokens must not depend on what else is
in the batch)."""
from __future__ import annotations

import numpy as np
import pytest

from cpu_offload import batched_decode as bd
from cpu_offload import decoder, int8, q8_dot
from cpu_offload.blocks import Q4_1, Q4_1X16, TYPES, group_rows, ungroup_rows
from cpu_offload.contract import ConfigError
from tests.conftest import (int8_values, q4_1, q4_1_values, q4_dot_tolerance, q8_dot_input, random_weights,
                            tiny_config)

jax = pytest.importorskip("jax")
jnp = jax.numpy


def _fresh_rng():
    """A new seed every run (printed by the assertion messages that use it)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return seed, np.random.default_rng(seed)


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


# ------------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("kind,rows,cols", [(Q4_1, 1, 32), (Q4_1, 5, 96), (Q4_1, 37, 576), (Q4_1, 131, 1536),
                                            (Q4_1X16, 16, 32), (Q4_1X16, 32, 96), (Q4_1X16, 48, 576),
                                            (Q4_1X16, 144, 1536)], ids=str)
@pytest.mark.parametrize("nt", [1, 3, q8_dot.GROUP_TOKENS, q8_dot.GROUP_TOKENS + 3])
def test_q4_1_gemm_matches_float64_numpy_and_the_gemv_bit_for_bit(kind, rows, cols, nt):
    """Each token's row dots against float64 on its rounded input x^ (q8_dot.quantize_input), and equal to its
    single-token gemv's bit for bit, however many tokens share the pass: Q4_1 as the file stores it, and relaid 16
    rows together (Q4_1x16, its row ranges in sixteens; odd block counts included)."""
    seed, rng = _fresh_rng()
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.1, 3, (rows, 1)).astype(np.float32)
    blocks = q4_1(w)
    stored = blocks if kind == Q4_1 else group_rows(blocks, cols)
    x = rng.standard_normal((nt, cols)).astype(np.float32) * rng.uniform(0.01, 10, (nt, 1)).astype(np.float32)
    xh = np.stack([q8_dot_input(x[t]) for t in range(nt)])
    want = xh @ q4_1_values(blocks, cols).astype(np.float64).T                 # [nt, rows]
    xs = np.full((nt + 2, cols + 7), np.nan, np.float32)                                 # wider rows than needed
    xs[:nt, :cols] = x
    step = 1 if kind == Q4_1 else q8_dot.GROUP_ROWS
    spans = [(0, rows), (0, 0), (rows // 2 // step * step, rows), (step % rows, max(step % rows, rows - step))]
    for lo, hi in spans:
        y = np.full((nt + 1, rows), np.nan, np.float32)                                  # poisoned, one row spare
        q8_dot.gemm(kind, stored, xs, y, nt, lo, hi)
        err = np.abs(y[:nt, lo:hi] - want[:, lo:hi])
        assert (err <= q4_dot_tolerance(blocks, cols, xh)[:, lo:hi]).all(), f"seed {seed}: {err.max()}"
        assert np.isnan(y[:, :lo]).all() and np.isnan(y[:, hi:]).all() and np.isnan(y[nt]).all(), seed
        for t in range(nt):
            single = np.full(rows, np.nan, np.float32)
            q8_dot.gemv(kind, stored, x[t], single, lo, hi)
            np.testing.assert_array_equal(_bits(y[t, lo:hi]), _bits(single[lo:hi]), err_msg=f"seed {seed}")


def test_q4_1_relaid_16_rows_together_is_the_same_matrix():
    """group_rows keeps every number (ungroup_rows gives the file's bytes back; both dequantize, in numpy and in
    jax.numpy, to the same float32 values); its dots equal the file layout's to float32 rounding; a row range that
    would split a group is refused."""
    seed, rng = _fresh_rng()
    for rows, cols in [(16, 32), (48, 160), (64, 576)]:
        blocks = q4_1(rng.standard_normal((rows, cols)).astype(np.float32))
        grouped = group_rows(blocks, cols)
        assert grouped.shape == blocks.shape and grouped.dtype == np.uint8
        np.testing.assert_array_equal(ungroup_rows(grouped, cols), blocks)
        want = TYPES[Q4_1].dequantize((blocks,), cols)
        np.testing.assert_array_equal(TYPES[Q4_1X16].dequantize((grouped,), cols), want)
        np.testing.assert_array_equal(np.asarray(TYPES[Q4_1X16].dequantize((jnp.asarray(grouped),), cols, jnp)), want)
        x = rng.standard_normal(cols).astype(np.float32)
        a, b = np.full(rows, np.nan, np.float32), np.full(rows, np.nan, np.float32)
        q8_dot.gemv(Q4_1, blocks, x, a, 0, rows)
        q8_dot.gemv(Q4_1X16, grouped, x, b, 0, rows)
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-6 * np.abs(a).max(), err_msg=f"seed {seed}")
        with pytest.raises(ConfigError, match="whole groups of 16"):     # never half a group
            q8_dot.gemv(Q4_1X16, grouped, x, b, 0, 8)


@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 192), (37, 576), (131, 576)])
@pytest.mark.parametrize("nt", [1, 4, 11])
def test_int8_gemm_matches_float64_numpy_and_the_gemv_bit_for_bit(rows, cols, nt):
    seed, rng = _fresh_rng()
    q, s = int8.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.1, 3, (rows, 1)))
    x = rng.standard_normal((nt, cols)).astype(np.float32)
    want = x.astype(np.float64) @ int8_values(q, s).astype(np.float64).T
    out_rows = rng.permutation(nt + 2)[:nt].astype(np.int64)    # token t's output goes to row out_rows[t]
    for lo, hi in [(0, rows), (0, 0), (rows // 4 * 4, rows)]:
        y = np.full((nt + 2, rows), np.nan, np.float32)
        int8.gemm(q, s, x, y, out_rows, nt, lo, hi)
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
def _weights(config, bias: bool):
    """random_weights, with Qwen2's q, k and v biases when bias."""
    w = random_weights(config)
    if bias:
        rng = np.random.default_rng(1)
        q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        for l in range(config.n_layers):
            for name, n in (("bq", q), ("bk", kv), ("bv", kv)):
                w[f"layers.{l}.{name}"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
    return w


def _single_steps(host, weights, config, tokens_per_slot, cache_len):
    """Per request: logits [T, vocab] and final caches of HostDecoder's one-token steps (the single path)."""
    emb = np.asarray(host.dequantized(weights)["embed"])   # only for x; the same for both paths
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


@pytest.mark.parametrize("fmt,bias", [("q4_1", False), ("int8", False), ("q4_1", True)])
def test_batch_step_equals_single_steps_bit_for_bit_with_empty_slots(fmt, bias):
    config = tiny_config(d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=192, tie_embeddings=True)
    weights = _weights(config, bias)
    host = decoder.HostDecoder(config, weights, fmt)
    batch = bd.BatchDecoder(host, 4)
    seed, rng = _fresh_rng()
    live = [0, 2, 3]                                   # slot 1 stays empty throughout
    steps, cache_len = 6, 16
    tokens = rng.integers(0, config.vocab_size, (len(live), steps))
    emb, single = _single_steps(host, weights, config, tokens, cache_len)
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


@pytest.mark.parametrize("fmt,bias", [("q4_1", False), ("int8", True)])
@pytest.mark.parametrize("count", [0, 1, 5, 8])
def test_prompt_rows_equal_single_steps_bit_for_bit(fmt, bias, count):
    """The prompt form: a sequence's tokens as the rows of one call per layer give each token what the one-token
    decoder gives it (cache rows and the last token's logits); rows past count come back unchanged."""
    config = tiny_config(d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=192, tie_embeddings=True)
    weights = _weights(config, bias)
    host = decoder.HostDecoder(config, weights, fmt)
    rows = bd.BatchDecoder(host, 8, span=8)
    seed, rng = _fresh_rng()
    cache_len = 16
    tokens = rng.integers(0, config.vocab_size, (1, count))
    emb = np.asarray(host.dequantized(weights)["embed"])
    single = _single_steps(host, weights, config, tokens, cache_len)[1] if count else None
    shape = (1, cache_len, config.n_kv_heads, config.head_dim)
    k = [jnp.full(shape, jnp.nan, jnp.float16) for _ in range(config.n_layers)]
    v = [jnp.full(shape, jnp.nan, jnp.float16) for _ in range(config.n_layers)]
    x = np.full((8, config.d_model), 7.0, np.float32)
    x[:count] = emb[tokens[0]]
    x = jnp.asarray(x)
    prompt = jax.jit(rows.prompt, static_argnums=0, donate_argnums=(4, 5))
    for l in range(config.n_layers):
        x, k[l], v[l] = prompt(l, x, jnp.int32(0), jnp.int32(count), k[l], v[l])
    np.testing.assert_array_equal(np.asarray(x)[count:], 7.0)
    if count:
        logits = np.asarray(jax.jit(host.head)(x[count - 1]))
        np.testing.assert_array_equal(_bits(logits), _bits(single[0][0][-1]), err_msg=f"seed {seed}")
    for l in range(config.n_layers):
        if count:
            np.testing.assert_array_equal(_bits(np.asarray(k[l])[0, :count]), _bits(single[0][1][l][:count]))
            np.testing.assert_array_equal(_bits(np.asarray(v[l])[0, :count]), _bits(single[0][2][l][:count]))
        assert np.isnan(np.asarray(k[l])[0, count:]).all() and np.isnan(np.asarray(v[l])[0, count:]).all()


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

    class FloatInputs(decoder.HostDecoder):   # as PredictedHostDecoder: its layers read float32 inputs
        rounds_inputs = False

    with pytest.raises(ValueError, match="FloatInputs reads float32 inputs"):
        bd.BatchDecoder(FloatInputs(config, random_weights(config), "q4_1"), 2)
    rows = bd.BatchDecoder(batch.host, 2, span=2)
    prompt = jax.jit(lambda s, n, x, k, v: rows.prompt(0, x, s, n, k, v))
    for start, count in [(0, 3), (1, 2), (-1, 1), (0, -1)]:   # more rows than it has, past its span, negative
        with pytest.raises(Exception, match="position outside the cache"):
            jax.block_until_ready(prompt(jnp.int32(start), jnp.int32(count), x, k[:1], k[:1]))


def test_the_decoders_scratch_starts_on_cache_lines():
    """The GEMMs load 64 bytes of an input row at a time: a scratch row that starts off a line reads two lines per
    load (the 8-token GEMMs took 1.3-1.5x as long). Several decoders, so a lucky malloc cannot pass it."""
    import ctypes

    from cpu_offload.host_decode import H_SCRATCH

    config = tiny_config(d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=128)
    weights = random_weights(config)
    for _ in range(4):
        host = decoder.HostDecoder(config, weights, "q4_1")
        batch = bd.BatchDecoder(host, 3)
        header = np.frombuffer(ctypes.string_at(batch.address, 8 * bd.WIDTH), np.int64)
        scratch = [header[H_SCRATCH]] + list(header[bd.B_X:bd.B_SCORES + 1])
        assert [a % 64 for a in scratch] == [0] * len(scratch)


# ------------------------------------------------------------------------------------------------ real model
@pytest.mark.real_model   # its fixtures are asked for by name, which the tier's marking does not see
@pytest.mark.parametrize("weights", ["q4_1", "float32", "split"])
def test_real_model_batch_equals_engine_stream_for_every_request(weights, request):
    """Full and partly empty batches, greedy and sampled requests: each request's tokens are Engine.stream's. On
    the host (q4_1) its numbers are the single decoder's bit for bit; in XLA (float32, and a layer split's first
    layers) a product over the batch's rows rounds differently in the last bits, so only greedy requests are
    compared there (a sampled token can turn on a last bit)."""
    from pjinfer.runtime.batch import Batch
    from pjinfer.runtime.engine import Engine
    from pjinfer.runtime.sampling import Sampling

    if weights == "split":   # layers 0-6 in XLA, the rest and the head on the host decode, in one batched step
        engine = Engine.load(offload_layers=7)
    else:
        engine = request.getfixturevalue("q4_engine" if weights == "q4_1" else "engine")
    batch = Batch(engine, 8)
    assert batch.together
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn is",
               "Water boils at", "My favourite animal is", "In 1492,", "The opposite of hot is"]
    samplings = ([Sampling(), Sampling(temperature=0.8, top_k=40, seed=3), Sampling(repeat_penalty=1.3),
                  Sampling(temperature=1.0, top_p=0.9, seed=7)] if weights == "q4_1"
                 else [Sampling(), Sampling(repeat_penalty=1.3)] * 2) * 2
    n = 10
    tok = engine.tokenizer
    want = [list(engine.stream(tok.encode(p), max_new_tokens=n, sampling=s, stop_ids=[]))
            for p, s in zip(prompts, samplings)]
    # All 8 slots from the start, one step per call; then 3 requests in slots 6, 1, 4 with the others empty,
    # joining at different calls of up to 4 steps (each request stops at its own budget inside a call).
    for slots, joins, steps in [(list(range(8)), [0] * 8, 1), ([6, 1, 4], [0, 2, 5], 4)]:
        states, got = {}, {i: [] for i in range(len(slots))}
        for call in range(n + max(joins)):
            live = [i for i in states if states[i].remaining > 0]          # requests that joined at an earlier call
            if live:
                batch.step([states[i] for i in live], steps=steps)
                for i in live:
                    got[i] += states[i].new
            for i, (slot, join) in enumerate(zip(slots, joins)):
                if call == join:                                     # prefill: its first token
                    states[i] = batch.start(slot, tok.encode(prompts[i]), n, samplings[i], stop_ids=[])
                    got[i].append(states[i].token)
        assert [got[i] for i in range(len(slots))] == want[:len(slots)]
    assert batch.widest == 8


@pytest.mark.real_model
@pytest.mark.parametrize("fixture", ["q4_engine", "engine"])
def test_real_model_batch_steps_end_at_a_stop_id_a_budget_and_a_wake(fixture, request):
    """In one call of several steps: a request that samples one of its stop ids stops there (the id is its last
    token), one with a budget stops at it, and wake() ends every call after its first step until clear_wake():
    on the host decode (q4_1, the decoder's flag) and in XLA (float32, a host callback)."""
    from pjinfer.runtime.batch import Batch
    from pjinfer.runtime.sampling import Sampling

    engine = request.getfixturevalue(fixture)
    batch = Batch(engine, 4)
    assert batch.together
    ids = engine.tokenizer.encode("The capital of France is")
    free = list(engine.stream(ids, max_new_tokens=12, stop_ids=[]))
    stop = free[5]
    first = free.index(stop)
    assert first >= 1
    a = batch.start(0, ids, 12, Sampling(), stop_ids=[stop])
    b = batch.start(2, ids, 7, Sampling(), stop_ids=[])
    batch.step([a, b], steps=12)
    assert [a.token] == a.new[-1:] and a.new == free[1:first + 1] and a.remaining == 0
    assert b.new == free[1:7] and b.remaining == 0
    batch.step([a, b], steps=12)
    assert a.new == [] and b.new == []                               # nothing left to produce
    c = batch.start(3, ids, 12, Sampling(), stop_ids=[])
    batch.wake()
    batch.step([c], steps=8)
    assert c.new == free[1:2]                                        # one step, then the flag ended the call
    batch.step([c], steps=8)
    assert c.new == free[2:3]                                        # still set: one step again
    batch.clear_wake()
    batch.step([c], steps=8)
    assert c.new == free[3:11]


def test_real_model_host_prompt_matches_xla_prefill(q4_engine):
    """Prompts of at most PROMPT_ROWS tokens prefill on the host (Engine.prompt_rows): the last token's logits and
    every cache row agree with XLA's prefill of the same 4-bit values to rounding, and pick the same token."""
    from pjinfer.load import data
    from pjinfer.runtime import host

    e = q4_engine
    ids = e.tokenizer.encode(data.wiki_eval_text(), add_special=False)
    rows = e.prompt_rows(host.PROMPT_ROWS)
    assert rows is not None and e.prompt_rows(host.PROMPT_ROWS + 1) is None

    _host_prefill_matches_xla(e, rows, ids[:host.PROMPT_ROWS], (1, 5, 37, host.PROMPT_ROWS))


def _host_prefill_matches_xla(e, rows, ids, counts):
    """host.prefill through `rows` against XLA's prefill of the same values, for the first n of `ids` (n in counts):
    the last token's logits agree to 2^-10 of the largest, every cache row to rounding, and they pick the same
    token; the rest of the cache is untouched."""
    from flax import nnx

    from pjinfer.runtime import host
    from pjinfer.runtime.model import KVCache

    @jax.jit
    def both(state, tokens, n):
        model = nnx.merge(e.graphdef, state)
        got = host.prefill(model, rows, tokens, n, KVCache.create(e.config, 1, 128))
        hidden, cache = model(tokens, 0, KVCache.create(e.config, 1, 128))
        return got, (model.logits(jax.lax.dynamic_index_in_dim(hidden[0], n - 1, keepdims=False)), cache)

    tokens = jnp.asarray(np.asarray(ids, np.int32)[None])
    for n in counts:
        (got, got_cache), (want, want_cache) = both(e.state, tokens, jnp.int32(n))
        got, want = np.asarray(got), np.asarray(want)
        # Rounding (as test_real_model's host step against XLA's), carried through the layers by float16 cache
        # rows a step apart, and the host's inputs rounded to about 15 bits (cpu_offload/q8_dot.py): measured up to
        # 3e-4 of the largest logit (2^-12 with float32 inputs), and 1.2e-3 of a cache layer's largest value.
        # A real fault is far larger (an attention scale of 1/sqrt(65) for 1/sqrt(64) moves the logits ~1e-2).
        assert np.abs(got - want).max() < 2.0 ** -10 * np.abs(want).max(), n
        assert int(np.argmax(got)) == int(np.argmax(want)), n
        for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
            a, b = np.asarray(a[0], np.float32), np.asarray(b[0], np.float32)
            assert np.abs(a[:n] - b[:n]).max() <= 2.0 ** -8 * np.abs(b[:n]).max(), n
            assert not a[n:].any()                                   # the rest of the cache is untouched


@pytest.fixture(scope="module")
def gguf_engine():
    """The default model with --weights gguf: the file's blocks through quants.gemv, a host decoder that does not
    batch."""
    from pjinfer.runtime.engine import Engine

    return Engine.load(weights="gguf")


@pytest.mark.real_model
def test_real_model_stepped_prompt_matches_xla_prefill(gguf_engine):
    """On a host decoder that does not batch, prompts of at most STEPPED_PROMPT tokens prefill as one-token decode
    steps (host.STEPS): every cache row and the last token's logits agree with XLA's prefill to rounding, and pick
    the same token; the rest of the cache is untouched."""
    from pjinfer.load import data
    from pjinfer.runtime import host

    e = gguf_engine
    assert e.prompt_rows(host.STEPPED_PROMPT) == host.STEPS and e.prompt_rows(2 * host.STEPPED_PROMPT) is None
    ids = e.tokenizer.encode(data.wiki_eval_text(), add_special=False)

    _host_prefill_matches_xla(e, host.STEPS, ids[:host.STEPPED_PROMPT], (1, 5, host.STEPPED_PROMPT))


@pytest.mark.real_model
def test_engines_that_cannot_batch_take_turns_with_each_requests_own_tokens(gguf_engine):
    """A backend that does not batch (--weights gguf here: the file's blocks through quants.gemv) runs the same
    loop in turns: every request gets Engine.stream's tokens for it alone, and after a wake a step stops after the
    state it is on; the next starts where it stopped."""
    from pjinfer.runtime.batch import Batch
    from pjinfer.runtime.sampling import Sampling

    engine = gguf_engine
    batch = Batch(engine, 3)
    assert not batch.together
    prompts = [engine.tokenizer.encode(t) for t in ("The capital of France is", "Once upon a time", "1, 2, 3,")]
    samplings = [Sampling(), Sampling(temperature=0.8, seed=5), Sampling(temperature=1.0, top_k=5, seed=9)]
    states = [batch.start(i, ids, 11, s, stop_ids=[]) for i, (ids, s) in enumerate(zip(prompts, samplings))]
    got = [[s.token] for s in states]
    batch.wake()
    batch.step(states, steps=4)
    assert [len(s.new) for s in states] == [4, 0, 0]
    batch.clear_wake()
    for g, s in zip(got, states):
        g.extend(s.new)
    while any(s.remaining > 0 for s in states):
        batch.step(states, steps=4)
        for g, s in zip(got, states):
            g.extend(s.new)
    want = [list(engine.stream(ids, max_new_tokens=11, sampling=s, stop_ids=[])) for ids, s in zip(prompts, samplings)]
    assert got == want and all(len(g) == 11 for g in got)


def test_gguf_blocks_neither_batch_nor_prefill_on_the_host(tmp_path):
    """--weights gguf (other block types, read by quants.gemv) runs the host decoder too, but the batched kernels
    read Q4_1 and int8 only: no batching, and its prompts prefill as decode steps up to STEPPED_PROMPT tokens,
    in XLA past that."""

    from pjinfer.runtime import host
    from pjinfer.runtime.batch import unsupported
    from pjinfer.runtime.engine import Engine
    from tests.support.gguf_files import write_tiny_gguf

    config = tiny_config(d_model=64, n_heads=4, head_dim=16, d_ff=128, vocab_size=262)   # the writer's vocabulary
    path = tmp_path / "q8.gguf"
    write_tiny_gguf(path, config, random_weights(config), quantize=True)          # Q8_0 layers and head
    e = Engine.load(path, weights="gguf")
    assert e.host is not None and "--weights float32 or q4_1 or int8" in unsupported(e)
    assert e.prompt_rows(16) == host.STEPS and e.prompt_rows(32) is None


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
