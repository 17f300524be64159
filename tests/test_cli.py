"""Bad input gets one clear line on stderr and exit code 2: no traceback, no output."""
import subprocess
import sys

import pytest


def pjinfer(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "pjinfer.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_clean_error(result, fragment):
    assert result.returncode == 2, result.stderr
    lines = [l for l in result.stderr.splitlines() if l.startswith("pjinfer:")]
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("args,fragment", [
    (["generate", "--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "--prompt", "x", "--top-p", "0"], "top-p must be in (0, 1]"),
    (["generate", "--prompt", "x", "--top-k", "-3"], "top-k must be >= 0"),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "must be >= 1"),
    (["generate"], "--prompt"),
    (["generate", "--prompt", "x", "--bundle", "b", "--cold-weights", "int4"], "invalid choice"),
    (["generate", "--prompt", "x", "--weights", "int4"], "invalid choice"),
    (["bench", "--weights", "float32,int4"], "expected distinct float32 / int8"),
    (["generate", "--prompt", "x", "--weights", "int8", "--bundle", "b"], "a sparse bundle takes --cold-weights int8"),
    (["perplexity", "--text-file", "/nonexistent.txt"], "text file not found"),
    (["generate", "--prompt", "x", "--model", "/nonexistent.gguf"], "model not found"),
])
def test_bad_arguments(args, fragment):
    assert_clean_error(pjinfer(*args), fragment)


def test_empty_and_binary_text_files(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    assert_clean_error(pjinfer("perplexity", "--text-file", str(tmp_path / "empty.txt")), "is empty")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00abc")
    assert_clean_error(pjinfer("perplexity", "--text-file", str(tmp_path / "bin.txt")), "not UTF-8")


def test_truncated_and_unknown_models(tmp_path):
    from tests.conftest import random_weights, tiny_config
    from tests.test_gguf_loader import write_tiny_gguf

    config = tiny_config()
    write_tiny_gguf(tmp_path / "m.gguf", config, random_weights(config))
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) - 1000])
    assert_clean_error(pjinfer("generate", "--prompt", "x", "--model", str(tmp_path / "cut.gguf")), "truncated")
    write_tiny_gguf(tmp_path / "o.gguf", config, random_weights(config), arch="qwen2")
    assert_clean_error(pjinfer("generate", "--prompt", "x", "--model", str(tmp_path / "o.gguf")),
                       "unsupported GGUF architecture 'qwen2'")


def test_prompt_longer_than_the_context(tmp_path):
    # The real model's context is 8192 tokens; each " the" is one token.
    result = pjinfer("generate", "--prompt", " the" * 8200, "--max-new-tokens", "4")
    assert_clean_error(result, "exceed the model's context of 8192 tokens")


@pytest.mark.parametrize("args,fragment", [
    (["eval", "--tasks", "piqa,nope"], "unknown task 'nope' (known: piqa, hellaswag"),
    (["eval", "--tasks", "piqa", "--limit", "0"], "--limit must be >= 1"),
    (["eval"], "give --tasks"),
    (["eval", "--compare", "/nonexistent/a.json", "/nonexistent/b.json"], "results file not found"),
])
def test_eval_bad_input(args, fragment):
    assert_clean_error(pjinfer(*args), fragment)


def test_eval_compare_prints_differences(tmp_path):
    a = {"model": "m", "bundle": None, "tasks": {"piqa": {"acc": 0.6, "acc_norm": 0.65, "n": 10, "stderr": 0.1}}}
    b = {"model": "m", "bundle": "B", "tasks": {"piqa": {"acc": 0.5, "acc_norm": 0.7, "n": 10, "stderr": 0.1}}}
    import json
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    r = pjinfer("eval", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert r.returncode == 0, r.stderr
    assert "-0.1000" in r.stdout and "+0.0500" in r.stdout


def test_bench_reports_rates_bytes_and_bandwidth():
    import json

    result = pjinfer("bench", "--prompt-len", "16", "--new-tokens", "4", "--runs", "1", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    dense = out["engines"]["dense"]
    assert dense["decode_tok_s"] > 0 and dense["prefill_tok_s"] > 0
    # float32 weights (538 MB: 134.5 M parameters, the tied embedding once) plus a 256-slot KV cache (12 MB)
    assert 545e6 < dense["bytes_per_token"] < 555e6
    assert out["read_bandwidth_gb_s"] > 0.5


def test_bench_peer_needs_llama_cpp():
    code = ("import sys; sys.modules['llama_cpp'] = None; from pjinfer.cli import main; "
            "sys.exit(main(['bench', '--peer', 'llama-cpp']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert_clean_error(result, "make bench-peer")
