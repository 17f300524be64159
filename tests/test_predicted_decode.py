"""A PowerInfer file run sparse as the file is (pjinfer/runtime/predicted.py, cpu_offload/predicted_decode.py): a
tiny file in PowerInfer's layout (ffn_down_t, F16 predictors, magic PWRI) with a SentencePiece vocabulary, its FFN
in each row type. The host decode's predicted sets, logits and greedy ids against pjinfer's own XLA model masked by
the same predictor, step by step over the same float16 cache; the prefill's logits against the decode's."""
from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pjinfer.config import ConfigError
from pjinfer.load import loader, powerinfer
from pjinfer.runtime import generate as gen
from pjinfer.runtime import host
from pjinfer.runtime.model import KVCache, Transformer, embedding_rows
from pjinfer.runtime.predicted import PredictedFFN, attach_powerinfer
from pjinfer.runtime.sampling import Sampling, recent_ids
from tests.conftest import jitted, random_weights, tiny_config
from tests.support.gguf_files import write_spm_vocab, write_tiny_gguf
from tests.support.powerinfer_files import powerinfer_predictors, write_powerinfer

T = gguf.GGMLQuantizationType


def write_file(path, ffn_type, *, arch="llama", threshold=None, predictors=powerinfer_predictors):
    """A tiny PowerInfer file: FFN matrices of ffn_type, the rest Q8_0 (the embedding, tied, is the head);
    predictors(config) gives its (fc1, fc2)."""
    config = tiny_config(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=192, tie_embeddings=True,
                         activation="drelu" if arch == "bamboo" else "reglu")
    fc1, fc2 = predictors(config)
    kind = lambda name: ffn_type if name.rsplit(".", 1)[-1] in ("w_gate", "w_up", "w_down_t") else T.Q8_0
    write_powerinfer(path, config, random_weights(config, seed=11), fc1, fc2, arch=arch, threshold=threshold,
                     vocab=write_spm_vocab, layer_type=kind)
    return path


def load(path, *, dense=False):
    """(host-decoding model, the same model with every step through XLA, decoder, tokenizer)."""
    config, tensors, tokenizer = loader.load_gguf(path, keep="gguf", neuron_rows=True)
    predictors = powerinfer.read_predictors(loader.open_gguf(path), config, path)
    model = Transformer(config, tensors)
    decoder = attach_powerinfer(model, config, tensors, predictors, dense=dense)
    reference = nnx.merge(*nnx.split(model))
    host.detach(reference)
    return model, reference, decoder, tokenizer


def xla_step(model, token, pos, cache):
    """One token through XLA (Block.decode's path, the FFN's predicted set kept): (logits, cache, sets [L, d_ff])."""
    x = embedding_rows(model.embed, token.reshape(1, 1))
    ks, vs, sets = [], [], []
    for layer, k, v in zip(model.layers, cache.k, cache.v):
        h, k, v = layer.attn(layer.attn_norm(x), pos, k, v)
        x = x + h
        sets.append(layer.ffn.active(x)[0, 0])
        x = x + layer.ffn(layer.ffn_norm(x), residual=x)
        ks.append(k)
        vs.append(v)
    return model.logits(model.final_norm(x)[0, 0]), KVCache(k=ks, v=vs), jnp.stack(sets)


# Two cases in the unit tier (make test-fast); the others, 8-9 s each, with the slow ones (make test runs all).
CASES = [(T.Q4_0, "llama", None), (T.Q8_0, "llama", 0.05),
         *(pytest.param(*case, marks=pytest.mark.slow) for case in ((T.F16, "llama", None), (T.Q4_1, "bamboo", None),
                                                                    (T.F32, "llama", None)))]


@pytest.mark.parametrize("ffn_type,arch,threshold", CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_host_decode_is_the_xla_model_masked_by_the_same_predictor(tmp_path, ffn_type, arch, threshold):
    path = write_file(tmp_path / "m.powerinfer.gguf", ffn_type, arch=arch, threshold=threshold)
    model, reference, decoder, tokenizer = load(path)
    assert all(isinstance(layer.ffn, PredictedFFN) for layer in model.layers)
    assert {kind for _, kind in decoder.ffn_rows.values()} == {ffn_type.value}
    prompt = tokenizer.encode("hello world, the quick brown fox")
    assert tokenizer.decode(prompt).strip() == "hello world, the quick brown fox"
    n, cache_len = len(prompt), 64
    fresh = lambda: KVCache.create(model.config, 1, cache_len)

    def prompt_run(m, tokens):   # (the cache of the prompt but its last token, the whole prompt's last logits)
        hidden, _ = m(tokens, 0, fresh())
        return m(tokens[:, :-1], 0, fresh())[1], m.logits(hidden[0, -1])

    cache, prefill_logits = jitted(reference, prompt_run)(jnp.asarray([prompt]))
    prefill_logits = np.asarray(prefill_logits)
    host_cache, token, densities = cache, jnp.int32(prompt[-1]), []
    host_step = jitted(model, lambda m, t, p, c: m.decode(t, p, c))
    ref_step = jitted(reference, xla_step)
    for pos in range(n - 1, n + 11):
        got, host_cache = host_step(token, jnp.int32(pos), host_cache)
        got = np.asarray(got)
        sets = decoder.last_active()
        want, cache, want_sets = ref_step(token, jnp.int32(pos), cache)
        want = np.asarray(want)
        np.testing.assert_array_equal(sets, np.asarray(want_sets), err_msg=f"position {pos}")
        np.testing.assert_array_equal(decoder.counts, sets.sum(axis=1))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        if pos == n - 1:
            np.testing.assert_allclose(prefill_logits, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        assert int(np.argmax(got)) == int(np.argmax(want))
        densities.append(sets.mean())
        token = jnp.int32(np.argmax(got))
    assert 0.1 < np.mean(densities) < 0.9     # the predictor does skip neurons, and keeps some

    # Greedy generation through the jitted decode loop: the same ids with the host decode and without it.
    tokens = jnp.asarray([prompt + [0] * (gen.bucket(n, gen.MIN_PROMPT_BUCKET) - n)], jnp.int32)
    params, stops, ids = Sampling().params(), jnp.asarray([-1] * gen.MAX_STOP_IDS), []
    for m in (model, reference):
        graph, state = gen.split(*nnx.split(m))
        key, sub = jax.random.split(jax.random.key(0))
        first, cache = gen.prefill(graph, state, tokens, jnp.int32(n), sub, params, cache_len=cache_len, greedy=True)
        out, count, *_ = gen.decode_chunk(graph, state, first, jnp.int32(n), cache, key, params, recent_ids(prompt),
                                          stops, jnp.int32(11), chunk=16, greedy=True)
        ids.append([int(first)] + np.asarray(out)[:int(count)].tolist())
    assert ids[0] == ids[1] and len(ids[0]) == 12


def test_a_powerinfer_file_runs_sparse_by_default_and_dense_when_asked(tmp_path, capsys):
    """`pjinfer generate --model X` on a PowerInfer file: its own predictors on the host (the powerinfer backend),
    no bundle; --dense computes every neuron; the engine's greedy ids are the XLA model's masked by the same
    predictor; a llama.cpp-layout file refuses --dense in one line."""
    from pjinfer.runtime.backends import Request, resolve
    from pjinfer.runtime.engine import Engine
    from tests.support.cli import assert_clean_error, run_cli

    path = write_file(tmp_path / "m.powerinfer.gguf", T.Q4_0)
    assert resolve(Request(path)).backend.name == "powerinfer"
    assert resolve(Request(path, dense=True)).backend.name == "powerinfer-dense"
    assert resolve(Request(path, "float32")).backend.name == "xla"
    engine = Engine.load(path)
    assert engine.path == "weights gguf, sparse (the file's predictors)"
    assert Engine.load(path, dense=True).backend.name == "powerinfer-dense"
    prompt = engine.tokenizer.encode("hello world")
    _, reference, _, _ = load(path)
    graph, state = gen.split(*nnx.split(reference))
    key, sub = jax.random.split(jax.random.key(0))
    tokens = jnp.asarray([prompt + [0] * (gen.MIN_PROMPT_BUCKET - len(prompt))], jnp.int32)
    params = Sampling().params()
    first, cache = gen.prefill(graph, state, tokens, jnp.int32(len(prompt)), sub, params, cache_len=256, greedy=True)
    out, count, *_ = gen.decode_chunk(graph, state, first, jnp.int32(len(prompt)), cache, key, params,
                                      recent_ids(prompt), jnp.asarray([-1] * gen.MAX_STOP_IDS), jnp.int32(7),
                                      chunk=8, greedy=True)
    want = [int(first)] + np.asarray(out)[:int(count)].tolist()
    assert engine.generate(prompt, max_new_tokens=8, stop_ids=[]) == want
    for extra, sparse in (((), True), (("--dense",), False)):
        code, out, err = run_cli(capsys, "generate", "--model", str(path), "--prompt", "hello world",
                                 "--max-new-tokens", "6", "--json", *extra)
        assert code == 0, err
        result = __import__("json").loads(out)
        assert result["sparse"] is sparse and result["weights"] == "gguf" and len(result["token_ids"]) >= 1
    plain = tmp_path / "plain.gguf"
    config = tiny_config(d_model=64, n_heads=4, head_dim=16, d_ff=128, vocab_size=262)
    write_tiny_gguf(plain, config, random_weights(config), quantize=True)
    assert_clean_error(run_cli(capsys, "generate", "--model", str(plain), "--prompt", "x", "--dense"),
                       "--dense runs a PowerInfer file without its predictors; this model is not one")
    assert_clean_error(run_cli(capsys, "generate", "--model", str(path), "--prompt", "x", "--weights", "q4_1"),
                       "not a PowerInfer file's neuron rows")


def test_dense_computes_every_neuron_and_the_predictor_changes_the_result(tmp_path):
    path = write_file(tmp_path / "m.gguf", T.Q4_0)
    sparse, _, _, tokenizer = load(path)
    dense, dense_reference, decoder, _ = load(path, dense=True)
    assert decoder.dense
    cache = KVCache.create(dense.config, 1, 32)
    token = jnp.int32(tokenizer.encode("Hello")[-1])
    got, _ = jitted(dense, lambda m, t, p, c: m.decode(t, p, c))(token, jnp.int32(0), cache)
    assert decoder.last_active().all()
    want, _, sets = jitted(dense_reference, xla_step)(token, jnp.int32(0), cache)
    assert np.asarray(sets).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4 * np.abs(want).max())
    masked, _ = jitted(sparse, lambda m, t, p, c: m.decode(t, p, c))(token, jnp.int32(0), cache)
    assert np.abs(np.asarray(masked) - np.asarray(got)).max() > 1e-3


def test_refusals_are_one_line(tmp_path):
    path = write_file(tmp_path / "m.gguf", T.Q4_0)
    config, tensors, _ = loader.load_gguf(path, keep="gguf", neuron_rows=True)
    model = Transformer(config, tensors)
    with pytest.raises(ConfigError, match="without them ask for dense"):
        attach_powerinfer(model, config, tensors, None)
    bad = dict(tensors)
    bad["layers.1.w_down_t"] = np.zeros((config.d_ff, 32), np.float16)
    with pytest.raises(ConfigError, match=r"layers.1.w_down_t must be \[192, 64\] F16 rows, got 192 rows of 64 bytes"):
        attach_powerinfer(model, config, bad, dense=True)
    plain = tmp_path / "plain.gguf"      # llama.cpp's layout: ffn_down [d, d_ff], not neuron rows
    write_tiny_gguf(plain, config, random_weights(config), quantize=True)
    config, tensors, _ = loader.load_gguf(plain, keep="gguf", neuron_rows=True)
    with pytest.raises(ConfigError, match=r"layers.0.w_down_t must be \[192, 64\] Q8_0 rows, got 64 rows of 204 bytes"):
        attach_powerinfer(Transformer(config, tensors), config, tensors, dense=True)


def _unchained(config):
    fc1, fc2 = powerinfer_predictors(config)
    return fc1, [np.pad(w, ((0, 0), (0, 1))) for w in fc2]     # fc2 [d_ff, rank + 1] after fc1 [rank, d]


@pytest.mark.parametrize("change,fragment", [
    (dict(threshold="0.5"), "metadata powerinfer.sparse_threshold must be a finite number, got '0.5'"),
    (dict(threshold=float("nan")), "metadata powerinfer.sparse_threshold must be a finite number, got nan"),
    (dict(predictors=_unchained), "layer 0's predictor is fc1 [16, 64], fc2 [192, 17]; the model needs"),
])
def test_generate_refuses_a_bad_powerinfer_file_in_one_line(tmp_path, capsys, change, fragment):
    from tests.support.cli import assert_clean_error, run_cli

    path = write_file(tmp_path / "bad.powerinfer.gguf", T.Q4_0, **change)
    assert_clean_error(run_cli(capsys, "generate", "--model", str(path), "--prompt", "x"), fragment)


def powerinfer_engine_and_reply(tmp_path):
    """(the tiny file, its engine, the engine's greedy 6-token reply to "hello world" in the chat template)."""
    from pjinfer.runtime.engine import Engine

    path = write_file(tmp_path / "m.powerinfer.gguf", T.Q4_0)
    engine = Engine.load(path)
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat([{"role": "user", "content": "hello world"}]), add_special=False)
    return path, engine, tok.decode(engine.generate(ids, max_new_tokens=6))


def test_a_powerinfer_file_chats(tmp_path, capsys, monkeypatch):
    """`pjinfer chat` on the tiny PowerInfer file (a line on stdin): the reply is the engine's own."""
    import io

    from tests.support.cli import run_cli

    path, _, want = powerinfer_engine_and_reply(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello world\n"))
    code, out, err = run_cli(capsys, "chat", "--model", str(path), "--max-new-tokens", "6")
    assert code == 0, err
    assert want.strip() and want.strip() in out


def test_a_powerinfer_file_serves(tmp_path):
    """The tiny PowerInfer file behind the server over a real socket, asked with the openai client."""
    import threading

    import openai
    import uvicorn

    from pjinfer.measure.bench_serve import free_port, wait_healthy
    from pjinfer.serve.server import Server

    _, engine, want = powerinfer_engine_and_reply(tmp_path)
    server = Server(engine, max_active=2)
    port = free_port()
    runner = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=60)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="m.powerinfer", max_tokens=6, temperature=0,
                                               messages=[{"role": "user", "content": "hello world"}])
        assert reply.choices[0].message.content == want
    finally:
        server.scheduler.close()
        runner.should_exit = True
        thread.join(timeout=30)
