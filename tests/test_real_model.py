"""The real SmolLM2-135M against llama.cpp's figures on the same file (shared/DESIGN.md)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from pjinfer import data

LLAMA_CPP_PERPLEXITY = 17.18   # llama.cpp, wiki protocol, same GGUF


def test_perplexity_matches_llama_cpp(tmp_path):
    # Through the command line, as a user runs it: first 20,000 characters of wiki.utf8, tags removed,
    # 4 windows of 257 tokens.
    text_file = tmp_path / "wiki.txt"
    text_file.write_text(data.wiki_eval_text())
    result = subprocess.run([sys.executable, "-m", "pjinfer.cli", "perplexity", "--text-file", str(text_file),
                             "--windows", "4", "--window-len", "256", "--json"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["tokens"] == 4 * 256
    assert out["perplexity"] == pytest.approx(LLAMA_CPP_PERPLEXITY, rel=0.015)


def test_greedy_continuation_names_paris():
    result = subprocess.run([sys.executable, "-m", "pjinfer.cli", "generate", "--prompt", "The capital of France is",
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
    from pjinfer.peer import llama_cpp_runner

    prompt = engine.tokenizer.encode("The capital of France is", add_special=False)
    prefill, whole = llama_cpp_runner(engine.source, prompt, 12, threads=1)
    tokens = whole()
    assert len(tokens) == 12 and tokens[0] == prefill()
    assert engine.tokenizer.decode(tokens).startswith(" Paris.\n\nThe United States")  # shared/DESIGN.md


@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
def test_host_decode_equals_xla_on_the_same_values(fmt):
    """--weights int8 / q4_1: the host's quantized decode step against XLA's float32 step on the dequantized
    values."""
    import copy

    from flax import nnx

    from pjinfer.engine import Engine

    host = Engine.load(weights=fmt)
    prompt = host.tokenizer.encode("The capital of France is", add_special=False)
    got = host.generate(prompt, max_new_tokens=12)
    assert host.tokenizer.decode(got).startswith(" Paris.")
    xla = copy.copy(host)
    model = nnx.merge(host.graphdef, host.state)
    model.host = None
    xla.graphdef, xla.state = nnx.split(model)
    assert xla.generate(prompt, max_new_tokens=12) == got


def test_q4_1_blocks_are_the_gguf_files_own():
    """Re-quantizing what the loader dequantized gives back every Q4_1 tensor's bytes: --weights q4_1 decodes
    the file's model, not a further approximation of it."""
    import gguf

    from cpu_offload import q4
    from pjinfer import loader

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
        np.testing.assert_array_equal(q4.quantize(w.T if kind == "ffn_down" else w), rows, err_msg=t.name)
        checked += 1
    assert checked == 7 * config.n_layers
