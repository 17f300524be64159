"""The real SmolLM2-135M against llama.cpp's figures on the same file (shared/DESIGN.md)."""
import json
import subprocess
import sys

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


def test_int8_host_decode_equals_xla_on_the_same_values():
    """--weights int8: the host's int8 decode step against XLA's float32 step on the dequantized values."""
    import copy

    from flax import nnx

    from pjinfer.engine import Engine

    int8 = Engine.load(weights="int8")
    prompt = int8.tokenizer.encode("The capital of France is", add_special=False)
    got = int8.generate(prompt, max_new_tokens=12)
    assert int8.tokenizer.decode(got).startswith(" Paris.")
    xla = copy.copy(int8)
    model = nnx.merge(int8.graphdef, int8.state)
    model.host = None
    xla.graphdef, xla.state = nnx.split(model)
    assert xla.generate(prompt, max_new_tokens=12) == got
