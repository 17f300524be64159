"""The model and the jitted generate on tiny random models of every architecture and activation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pjinfer.config import ConfigError
from pjinfer.runtime.compile_cache import CompileStats
from pjinfer.runtime.engine import Engine
from pjinfer.runtime.model import KVCache, Transformer
from pjinfer.runtime.sampling import Sampling
from tests.conftest import jitted, random_weights, tiny_config

FAMILIES = [("llama", "swiglu"), ("llama", "geglu"), ("llama", "reglu"), ("llama", "drelu"), ("opt", "relu")]


def _logits(model, ids, pos, cache):
    hidden, cache = model(ids, pos, cache)
    return model.logits(hidden[0]), cache


def full_logits(model, ids):
    return np.asarray(jitted(model, _logits)(jnp.asarray(ids)[None], 0, KVCache.create(model.config, 1, len(ids)))[0])


@pytest.mark.slow
@pytest.mark.parametrize("arch,activation", FAMILIES)
def test_cached_decode_matches_full_forward(arch, activation):
    # Prefill 5 tokens, then feed 6 more one at a time through the cache: each step's logits must
    # equal those of one causal forward over the whole sequence.
    config = tiny_config(arch, activation)
    model = Transformer(config, random_weights(config, seed=1))
    ids = np.random.default_rng(2).integers(0, config.vocab_size, 11)
    expected = full_logits(model, ids)
    step = jitted(model, _logits)
    logits, cache = step(jnp.asarray(ids[:5])[None], 0, KVCache.create(config, 1, 32))
    got = [np.asarray(logits)]
    for pos in range(5, 11):
        logits, cache = step(jnp.asarray(ids[pos:pos + 1])[None], jnp.int32(pos), cache)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch,activation", [("llama", "swiglu"), ("opt", "relu")])
def test_a_position_per_row_decodes_each_row_as_alone_and_minus_one_writes_nothing(arch, activation):
    """The batched XLA step (pjinfer.runtime.batch): rows at their own positions give each row's one-token decode
    (to rounding: a product over rows rounds differently from one row's), and a row at -1 leaves its cache as it
    was. OPT's position table is read per row too."""
    config = tiny_config(arch, activation)
    graphdef, state = nnx.split(Transformer(config, random_weights(config, seed=3)))
    rng = np.random.default_rng(4)
    pos = np.array([5, -1, 9, 3], np.int32)     # each row's next position (its prompt's length); row 1 not fed
    prompts = jnp.asarray(rng.integers(0, config.vocab_size, (len(pos), 9)))   # past a row's position: masked
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, len(pos)))

    @jax.jit
    def batched(state, tokens, pos):
        model = nnx.merge(graphdef, state)
        _, pool = model(prompts, 0, KVCache.create(config, len(pos), 16))
        x = model.inputs(tokens[:, None], pos)
        ks, vs = [], []
        for layer, k, v in zip(model.layers, pool.k, pool.v):
            x, k, v = layer.decode(x, pos, k, v)
            ks.append(k)
            vs.append(v)
        return model.logits(model.final_norm(x)[:, 0]), pool, KVCache(k=ks, v=vs)

    @jax.jit
    def alone(state, b, token, p):
        model = nnx.merge(graphdef, state)
        _, cache = model(jax.lax.dynamic_index_in_dim(prompts, b), 0, KVCache.create(config, 1, 16))
        return model.decode(token, p, cache)

    logits, before, after = batched(state, tokens, jnp.asarray(pos))
    for b, p in enumerate(pos):
        if p < 0:
            for got, was in zip(after.k + after.v, before.k + before.v):
                np.testing.assert_array_equal(np.asarray(got[b]), np.asarray(was[b]))
            continue
        want, cache = alone(state, b, tokens[b], jnp.int32(p))
        np.testing.assert_allclose(np.asarray(logits[b]), np.asarray(want), rtol=1e-5, atol=1e-5)
        for got, one in zip(after.k + after.v, cache.k + cache.v):
            np.testing.assert_allclose(np.asarray(got[b], np.float32), np.asarray(one[0], np.float32),
                                       rtol=1e-3, atol=1e-3)


def test_untied_head_differs_from_tied():
    config = tiny_config(tie_embeddings=False)
    weights = random_weights(config)
    ids = np.arange(7)
    untied = full_logits(Transformer(config, weights), ids)
    tied = full_logits(Transformer(config.replace(tie_embeddings=True), weights), ids)
    assert not np.allclose(untied, tied)


def test_activations_match_their_definitions():
    from cpu_offload.activation import activate

    g, u = jnp.array([-2.0, -0.5, 0.0, 0.7, 3.0]), jnp.array([1.5, -1.0, 2.0, -0.3, 0.5])
    silu = lambda x: x / (1 + np.exp(-x))
    np.testing.assert_allclose(activate("swiglu", g, u), silu(np.asarray(g)) * np.asarray(u), rtol=1e-6)
    np.testing.assert_allclose(activate("reglu", g, u), np.maximum(g, 0) * u)
    np.testing.assert_allclose(activate("drelu", g, u), np.maximum(g, 0) * np.maximum(u, 0))
    np.testing.assert_allclose(activate("relu", None, u), np.maximum(u, 0))


def test_config_rejects_unknown_architecture_and_activation():
    with pytest.raises(ConfigError, match="architecture"):
        tiny_config("gpt_neox")
    with pytest.raises(ConfigError, match="activation"):
        tiny_config("llama", "relu")
    with pytest.raises(ConfigError, match="missing weight"):
        config = tiny_config()
        weights = random_weights(config)
        del weights["layers.1.w_up"]
        Transformer(config, weights)


@pytest.fixture(scope="module")
def tiny_engine():
    config = tiny_config()
    return Engine(config, random_weights(config, seed=3), tokenizer=None)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.9, top_k=20, top_p=0.9, seed=7)])
def test_generate_equals_stream(tiny_engine, sampling):
    # generate's one while_loop and stream's chunks of it (several per call here: 20 tokens) share the decode
    # loop and the key schedule.
    prompt = [5, 17, 42, 8, 1, 60, 9]
    whole = tiny_engine.generate(prompt, max_new_tokens=20, sampling=sampling, stop_ids=[])
    streamed = list(tiny_engine.stream(prompt, max_new_tokens=20, sampling=sampling, stop_ids=[]))
    assert len(whole) == 20
    assert whole == streamed


def test_generate_stops_at_stop_id(tiny_engine):
    prompt = [5, 17, 42]
    free = tiny_engine.generate(prompt, max_new_tokens=12, stop_ids=[])
    stop = free[4]
    first = free.index(stop)
    assert tiny_engine.generate(prompt, max_new_tokens=12, stop_ids=[stop]) == free[:first]
    assert list(tiny_engine.stream(prompt, max_new_tokens=12, stop_ids=[stop])) == free[:first]


def test_sampling_seed_is_reproducible(tiny_engine):
    prompt = [5, 17, 42, 8]
    run = lambda seed: tiny_engine.generate(prompt, max_new_tokens=16, sampling=Sampling(1.0, seed=seed),
                                            stop_ids=[])
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_no_recompilation_within_buckets(tiny_engine):
    # Warm the buckets once, then vary prompt length, token budget and sampling values inside them:
    # nothing may compile again.
    greedy, hot = Sampling(), Sampling(temperature=0.7, top_k=5, top_p=0.8)
    for s in (greedy, hot):
        tiny_engine.generate([1, 2, 3], max_new_tokens=4, sampling=s, stop_ids=[])
        list(tiny_engine.stream([1, 2, 3], max_new_tokens=4, sampling=s, stop_ids=[]))
    with CompileStats() as stats:
        for n in (1, 5, 9, 16):
            for s in (greedy, hot, Sampling(temperature=1.3, top_k=0, top_p=1.0, seed=n)):
                tiny_engine.generate(list(range(1, n + 1)), max_new_tokens=3 * n, sampling=s, stop_ids=[])
                list(tiny_engine.stream(list(range(1, n + 1)), max_new_tokens=n + 1, sampling=s, stop_ids=[]))
    assert stats.executables == 0
    with CompileStats() as stats:  # a longer prompt bucket does compile: the counter sees it
        tiny_engine.generate(list(range(1, 20)), max_new_tokens=2, stop_ids=[])
    assert stats.executables >= 1


def test_plan_refuses_what_the_context_cannot_hold(tiny_engine):
    assert tiny_engine.plan(10, 20) == (16, 128)  # the cache bucket is capped at the context (128)
    with pytest.raises(ConfigError, match="exceed the model's context of 128"):
        tiny_engine.plan(100, 29)
    with pytest.raises(ConfigError, match="empty"):
        tiny_engine.plan(0, 5)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("opt", True), ("opt", False)])
def test_n_params_counts_every_weight_of_the_model(arch, tied):
    """config.n_params (the one parameter counter) equals the model's own arrays, a tied head counted once."""
    from flax import nnx

    config = tiny_config(arch, "swiglu" if arch == "llama" else "relu", tie_embeddings=tied)
    model = Transformer(config, random_weights(config))
    assert config.n_params == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert config.kv_cache_bytes(10, 2) == 2 * config.n_layers * 10 * config.n_kv_heads * config.head_dim * 2


def test_a_head_or_embedding_of_the_wrong_shape_is_refused():
    """A checkpoint whose untied head is short would make the host decode read past its end: refused at build."""
    config = tiny_config(tie_embeddings=False)
    weights = random_weights(config)
    weights["lm_head"] = weights["lm_head"][:-1]
    with pytest.raises(ConfigError, match=r"output head shape \(96, 48\) does not match the config's \(97, 48\)"):
        Transformer(config, weights)
