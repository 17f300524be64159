"""The real SmolLM2-135M against llama.cpp's figures on the same file (perplexity 17.18 on the wiki protocol, and
its greedy continuation of "The capital of France is")."""
import json
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pjinfer.load import data
from pjinfer.runtime import host as pjinfer_host
from pjinfer.runtime.engine import Engine
from pjinfer.runtime.model import KVCache
from pjinfer.runtime.sampling import Sampling

pytestmark = pytest.mark.real_model

LLAMA_CPP_PERPLEXITY = 17.18   # llama.cpp, wiki protocol, same GGUF


def test_perplexity_matches_llama_cpp(tmp_path, capsys):
    # Through the command line (in this process), as a user runs it: first 20,000 characters of wiki.utf8, tags
    # removed, 4 windows of 257 tokens.
    from pjinfer.cli.main import main

    text_file = tmp_path / "wiki.txt"
    text_file.write_text(data.wiki_eval_text())
    assert main(["perplexity", "--text-file", str(text_file), "--windows", "4", "--window-len", "256", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 4 * 256
    assert out["perplexity"] == pytest.approx(LLAMA_CPP_PERPLEXITY, rel=0.015)


def test_greedy_continuation_names_paris():
    # The real entry point in a subprocess, end to end: load, prefill, jitted generate, JSON out.
    result = subprocess.run([sys.executable, "-m", "pjinfer.cli.main", "generate", "--prompt", "The capital of France is",
                             "--max-new-tokens", "12", "--temperature", "0", "--json"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["text"].startswith(" Paris.")
    assert len(out["token_ids"]) == 12


def test_stream_equals_generate_on_the_real_model(engine):
    prompt = engine.tokenizer.encode("Photosynthesis is the process by which")
    whole = engine.generate(prompt, max_new_tokens=16)
    assert list(engine.stream(prompt, max_new_tokens=16)) == whole
    assert engine.tokenizer.decode(whole).strip()


def test_chat_generation_stops_at_end_of_turn(engine):
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat([{"role": "user", "content": "Say hello."}]), add_special=False)
    out = engine.generate(ids, max_new_tokens=64)
    assert 0 < len(out) < 64               # ended by <|im_end|>, which is not returned
    assert not set(out) & set(tok.eos_ids)


def test_llama_cpp_peer_runs_the_same_greedy_decode(engine):
    # Only where `make bench-peer` installed llama-cpp-python (CI does not build it).
    pytest.importorskip("llama_cpp")
    from pjinfer.measure.peer import llama_cpp_runner

    prompt = engine.tokenizer.encode("The capital of France is", add_special=False)
    prefill, whole = llama_cpp_runner(engine.source, prompt, 12, threads=1)
    tokens = whole()
    assert len(tokens) == 12 and tokens[0] == prefill()
    assert engine.tokenizer.decode(tokens).startswith(" Paris.\n\nThe United States")  # llama.cpp's greedy text


def test_bench_refuses_a_rate_above_the_bandwidth_beyond_what_the_cache_holds(q4_engine, monkeypatch):
    """A decode that reads more bytes a second from memory than the memory gives is a wrong timing (BenchError).
    What a step reads from memory is at least its bytes less the last-level cache, which may hold that many of them
    from step to step; a step whose bytes fit in it (a large L3 holds the default model's 98 MB) is no bound.
    The real runs use bounds that hold at any rate (a pytest worker beside this one can slow a run many times over);
    the bound between them is checked on the rate a run measured."""
    from pjinfer.measure import bench, machine

    step = bench.engine_bytes_per_token(q4_engine, 64, 16)
    run = lambda bandwidth: bench.run({"dense-q4_1": q4_engine}, prompt_len=16, new_tokens=4, runs=1,  # noqa: E731
                                      bandwidth=bandwidth)
    for cache, refused in ((None, True), (step // 2, True), (2 * step, False)):
        monkeypatch.setattr(machine, "last_level_cache_bytes", lambda: cache)
        if refused:
            with pytest.raises(bench.BenchError, match="above the measured bandwidth of 0.0 GB/s"):
                run(1.0)
        else:
            result = run(1.0)
            assert result["engines"]["dense-q4_1"]["fits_in_cache"]
            assert result["last_level_cache_mb"] == cache / 1e6
    rate, step = result["engines"]["dense-q4_1"]["decode_tok_s"], result["engines"]["dense-q4_1"]["bytes_per_token"]
    # A bandwidth under all of a step's bytes at this rate, but over the tenth a cache of 90% of them leaves to
    # memory: refused without the cache, taken with it.
    between = 0.3 * step * rate
    with pytest.raises(bench.BenchError, match=f"above the measured bandwidth of {between / 1e9:.1f} GB/s"):
        bench.refuse_above_bandwidth("dense-q4_1", rate, step, None, between)
    bench.refuse_above_bandwidth("dense-q4_1", rate, step, int(0.9 * step), between)
    assert bench.from_memory(step, int(0.9 * step), rate) == pytest.approx(0.1 * step * rate, rel=1e-6)


@pytest.mark.parametrize("peer", ["llama-bench", "powerinfer"])
def test_native_peer_runs_in_bench_alternated_with_pjinfer(q4_engine, peer):
    # Only where `make peers` built the peer (`make test` builds nothing).
    from pjinfer.measure import bench, native_peer

    if not native_peer.binary(peer).is_file():
        pytest.skip(f"{peer} is not built (make peers)")
    result = bench.run({"dense-q4_1": q4_engine}, prompt_len=16, new_tokens=8, runs=2, peer=peer)
    runs = result["engines"][peer]["decode_runs_tok_s"]
    assert len(runs) == 2 and min(runs) > 0
    assert result["engines"]["dense-q4_1"]["decode_over_peer"] > 0
    info = result["peer"]
    assert info["name"] == peer and info["binary"] == str(native_peer.binary(peer))
    assert info["prompt_tokens"] == 16    # PowerInfer tokenizes pjinfer's prompt text into the same 16 tokens
    assert info.get("untied_copy", False) == (peer == "powerinfer")   # the default model ties its head


def test_breakdown_times_the_host_step_stage_by_stage(q4_engine, engine):
    """bench --breakdown: the dense host decode's stages timed inside the generate loop, with the bytes each reads
    (the layers' matrices by stage, then the head: together every weight the step reads), adding up to the loop's
    step; and XLA's step by parts, adding up to the given step."""
    from pjinfer.measure import bench

    rows = bench.breakdown(q4_engine, 7.0, prompt_len=16, new_tokens=16, repeats=3)
    parts = {r["part"]: r["ms"] for r in rows}
    assert rows[0]["part"] == "q, k, v" and rows[-1]["part"] == "step in the generate loop"
    stages = [r for r in rows if r["part"] in ("q, k, v", "o", "gate, up, activation", "down", "head")]
    assert len(stages) == 5 and all(r["ms"] > 0 for r in stages)
    assert sum(r["mb"] for r in stages) == pytest.approx(q4_engine.host.nbytes / 1e6)
    assert rows[-3]["part"] == "choosing the token (greedy: the repetition penalty and argmax)" and rows[-3]["ms"] > 0
    inside = [r["ms"] for r in rows[:7]] + [parts["choosing the token (greedy: the repetition penalty and argmax)"],
                                           parts["outside the host's calls (XLA, dispatch, the loop)"]]
    assert sum(inside) == pytest.approx(rows[-1]["ms"])
    assert sum(inside[:7]) == pytest.approx(parts["host step (the layers and the head)"])
    assert 0 <= parts["waiting for the other threads (in the stages above)"] < sum(r["ms"] for r in rows[:5])
    xla = bench.breakdown(engine, 20.0, prompt_len=16, new_tokens=48, repeats=3,
                          sampling=Sampling(0.8, top_k=40, top_p=0.9))
    assert [r["part"] for r in xla] == ["attention", "ffn", "head", "choosing the token (the filters and the draw)",
                                        "rest of the step", "step in the generate loop"]
    assert all(r["ms"] > 0 for r in xla[:4])
    assert sum(r["ms"] for r in xla[:-1]) == pytest.approx(20.0)


@partial(jax.jit, static_argnames=("graphdef", "cache_len"))
def _prefill_logits(graphdef, state, tokens, cache_len):
    """tokens [T] -> (logits [T, vocab], cache of cache_len slots holding positions 0..T-1), through XLA."""
    model = nnx.merge(graphdef, state)
    hidden, cache = model(tokens[None], 0, KVCache.create(model.config, 1, cache_len))
    return model.logits(hidden[0]), cache


@partial(jax.jit, static_argnames=("graphdef",))
def _step_logits(graphdef, state, token, pos, cache):
    """One decode step (the host's kernels when the model has a HostDecoder): logits [vocab] and the cache."""
    return nnx.merge(graphdef, state).decode(token, pos, cache)


@pytest.fixture(scope="module")
def wiki_512(engine):
    return np.asarray(engine.tokenizer.encode(data.wiki_eval_text(), add_special=False)[:512], np.int32)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    """The default model re-quantized by llama.cpp itself to Q4_K_M (a Q5_0 / Q8_0 / Q4_K / Q6_K mix at this
    size, the Q8_0 head kept); skipped without llama-cpp-python (`make bench-peer` builds it)."""
    pytest.importorskip("llama_cpp")
    from pjinfer.load import loader
    from pjinfer.measure import peer

    path = tmp_path_factory.mktemp("quants") / "model.Q4_K_M.gguf"
    peer.quantize(loader.default_model_path(), path, "Q4_K_M")
    assert loader.layer_types(path) == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    return path


@pytest.mark.parametrize("fmt", ["int8", "q4_1", "gguf"])
def test_host_decode_equals_xla_at_long_positions(fmt, wiki_512, request):
    """--weights int8 / q4_1 / gguf (on llama.cpp's Q4_K_M of the model): the host's one-token step against XLA's
    float32 step on the dequantized values, at positions 0, 255, 256 and 511 of a 512-slot cache filled by a real
    512-token prefill (its position p zeroed first, so the step's own cache write is checked too)."""
    host = Engine.load(request.getfixturevalue("q4_k_m") if fmt == "gguf" else None, weights=fmt)
    model = nnx.merge(host.graphdef, host.state)
    assert host.host is not None
    pjinfer_host.detach(model)
    xla_graphdef, xla_state = nnx.split(model)   # the same values, every step through XLA
    all_logits, cache = _prefill_logits(xla_graphdef, xla_state, jnp.asarray(wiki_512), cache_len=512)
    for pos in (0, 255, 256, 511):
        start = KVCache(k=[k.at[:, pos].set(0) for k in cache.k], v=[v.at[:, pos].set(0) for v in cache.v])
        token, p = jnp.int32(wiki_512[pos]), jnp.int32(pos)
        got, got_cache = _step_logits(host.graphdef, host.state, token, p, start)
        want, want_cache = _step_logits(xla_graphdef, xla_state, token, p, start)
        got, want = np.asarray(got), np.asarray(want)
        scale = np.abs(want).max()
        # Rounding only: the host sums each 64-block of int8 (or 32-block of Q4_1) products and then scales, XLA
        # sums the dequantized products in its own order (with a float32 cache that measured at most 4.6e-6 of the
        # largest logit). Each path then writes the step's own k and v to the float16 cache, and values a hair
        # apart can round to neighbouring float16 steps: measured up to 6.4e-5 in a fresh process. The bound is
        # 2^-12; a real fault is far larger: an attention scale of 1/sqrt(65) for 1/sqrt(64) moves it ~1e-2.
        err = np.abs(got - want).max() / scale
        assert err < 2.0 ** -12, (pos, err)
        assert int(np.argmax(got)) == int(np.argmax(want))
        # XLA's step equals XLA's prefill at that position (the reference itself is consistent).
        np.testing.assert_allclose(want, np.asarray(all_logits[pos]), rtol=0, atol=2.0 ** -14 * scale)
        for name, a, b, c in (("k", got_cache.k, want_cache.k, cache.k), ("v", got_cache.v, want_cache.v, cache.v)):
            for l in range(len(a)):
                a_l, b_l = np.asarray(a[l][0]), np.asarray(b[l][0])
                # Position p holds the step's keys and values: rounding of the host's QKV GEMV (and RoPE), then to
                # float16, where a value the two compute a hair apart can land a float16 step (<= 2^-10) apart, and
                # a layer reading such a step of its own position gives the next layers' values a few steps apart.
                assert a_l.dtype == np.float16
                np.testing.assert_allclose(a_l[pos].astype(np.float32), b_l[pos].astype(np.float32), rtol=2.0 ** -8,
                                           atol=2.0 ** -12 * np.abs(b_l[pos].astype(np.float32)).max(),
                                           err_msg=f"{name} cache, layer {l}, position {pos}")
                np.testing.assert_array_equal(np.delete(a_l, pos, axis=0), np.delete(np.asarray(c[l][0]), pos, axis=0))
    if fmt != "int8":  # and the whole jitted generate (its while_loop of host steps) on the file's own model
        prompt = host.tokenizer.encode("The capital of France is", add_special=False)
        assert host.tokenizer.decode(host.generate(prompt, max_new_tokens=4)).startswith(" Paris.")


def test_q4_1_blocks_are_the_gguf_files_own():
    """Re-quantizing what the loader dequantized gives back every Q4_1 tensor's bytes: --weights q4_1 decodes
    the file's model, not a further approximation of it."""
    import gguf

    from pjinfer.load import loader
    from tests.conftest import q4_1

    path = loader.default_model_path()
    config, weights, _ = loader.load(path)
    names = {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo", "ffn_gate": "w_gate",
             "ffn_up": "w_up", "ffn_down": "w_down_t"}
    checked = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.tensor_type.name != "Q4_1":
            continue
        _, layer, kind, _ = t.name.split(".")
        w = np.asarray(weights[f"layers.{layer}.{names[kind]}"])
        rows = np.asarray(t.data).reshape(w.shape[1] if kind == "ffn_down" else w.shape[0], -1)
        if kind in ("attn_q", "attn_k"):  # the loader un-permutes these rows; blocks run along each row
            rows = loader._unpermute_rope(rows, config.n_heads if kind == "attn_q" else config.n_kv_heads)
        np.testing.assert_array_equal(q4_1(w.T if kind == "ffn_down" else w), rows, err_msg=t.name)
        checked += 1
    assert checked == 7 * config.n_layers
