"""The CLI's inputs, run in-process: bad input is refused in one line before the model loads; prompt sources,
stop strings and the timing fields of `generate`; `eval`'s result files (--output checked before evaluating,
--compare refuses what it cannot read)."""
import io
import json
import sys

import pytest

from pjinfer.config import ConfigError
from pjinfer.measure import evaluate
from tests.test_cli import assert_clean_error, run_cli


def run(capsys, *args):
    return run_cli(capsys, *args)


def assert_one_line_error(code, out, err, fragment):
    assert_clean_error((code, out, err), fragment)


@pytest.mark.parametrize("where,fragment", [("missing/out.json", "does not exist"), (".", "is a directory")])
def test_bad_output_is_refused_before_the_model_loads(tmp_path, capsys, where, fragment):
    target = tmp_path / where
    # A fake model path proves nothing loads: the output check comes first, so the model error never shows.
    code, out, err = run(capsys, "eval", "--tasks", "piqa", "--model", str(tmp_path / "no.gguf"),
                         "--output", str(target))
    assert_one_line_error(code, out, err, fragment)
    assert not list(tmp_path.glob("**/*.tmp")) and not list(tmp_path.glob("**/.*.tmp"))


@pytest.mark.parametrize("content", ['{"foo": 1}', "[1, 2]", '{"tasks": {"piqa": 3}}', '{"tasks": {"piqa": {}}}'])
def test_compare_refuses_files_of_the_wrong_shape(tmp_path, capsys, content):
    good = {"model": "m", "tasks": {"piqa": {"n": 10, "acc": 0.5, "acc_norm": 0.6}}}
    (tmp_path / "a.json").write_text(json.dumps(good))
    (tmp_path / "b.json").write_text(content)
    code, out, err = run(capsys, "eval", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert_one_line_error(code, out, err, "is not a pjinfer eval results file")


def test_compare_warns_when_item_counts_differ(tmp_path, capsys):
    a = {"model": "m", "tasks": {"piqa": {"n": 10, "acc": 0.5}, "copa": {"n": 5, "acc": 0.6}}}
    b = {"model": "m", "tasks": {"piqa": {"n": 20, "acc": 0.55}, "copa": {"n": 5, "acc": 0.4}}}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    code, out, err = run(capsys, "eval", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert code == 0 and "+0.0500" in out and "-0.2000" in out
    assert err.strip() == "pjinfer: warning: piqa has 10 items in A and 20 in B"


def test_write_is_atomic_and_leaves_no_temporary(tmp_path):
    from pjinfer.cli.common import write_json

    target = tmp_path / "r.json"
    target.write_text("old")
    with pytest.raises(TypeError):
        write_json(target, {"bad": object()})       # fails half-way through serialising
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    write_json(target, {"tasks": {}})
    assert json.loads(target.read_text()) == {"tasks": {}}
    assert evaluate.count_mismatches({"tasks": {}}, {"tasks": {}}) == []


@pytest.mark.parametrize("args,fragment", [
    (["--prompt", "caf\udcff\udcfe"], "not valid UTF-8"),          # what Python makes of non-UTF-8 argv bytes
    (["--prompt-file", "MISSING"], "prompt file not found"),
    (["--prompt-file", "DIR"], "is a directory"),
    (["--prompt-file", "LATIN1"], "not valid UTF-8"),
    (["--prompt-file", "BLANK"], "the prompt is empty"),
    (["--prompt", "x", "--stop", ""], "--stop needs a non-empty string"),
    (["--prompt", "x", "--seed", "100000000000000000000"], "seed must be in [0, 2**32)"),
    (["--prompt", "x", "--temperature", "inf"], "temperature must be >= 0 and finite"),
    (["--prompt", "x", "--min-p", "1.5"], "min-p must be in [0, 1]"),
    (["--prompt", "x", "--repeat-penalty", "0"], "repeat penalty must be a finite number > 0"),
])
def test_generate_refuses_bad_input_before_loading(tmp_path, capsys, args, fragment):
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "blank.txt").write_text(" \n")
    files = {"MISSING": tmp_path / "missing.txt", "DIR": tmp_path, "LATIN1": tmp_path / "latin1.txt",
             "BLANK": tmp_path / "blank.txt"}
    args = [str(files.get(a, a)) for a in args]
    # A model path that does not exist: had anything loaded, the error would name the model instead.
    code, out, err = run(capsys, "generate", "--model", str(tmp_path / "no.gguf"), *args)
    assert_one_line_error(code, out, err, fragment)


def test_stop_string_cuts_the_text_and_is_not_printed(capsys):
    code, out, err = run(capsys, "generate", "--prompt", "The capital of France is", "--max-new-tokens", "16",
                         "--stop", "\n")
    assert code == 0 and out == " Paris.\n"        # greedy goes on " Paris.\n\nThe answer ..."


def test_json_from_standard_input_reports_the_default_fast_path_and_timing(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"The capital of France is")))
    code, out, err = run(capsys, "generate", "--prompt-file", "-", "--max-new-tokens", "6", "--json",
                         "--repeat-penalty", "1.0", "--min-p", "0.0")
    result = json.loads(out)
    assert code == 0 and result["text"].startswith(" Paris.") and len(result["token_ids"]) == 6
    assert result["weights"] == "q4_1"      # --weights auto: the file's own Q4_1 blocks, on the host decode
    assert result["sparse"] is False and result["stop"] is None
    assert result["prompt_tokens"] == 5 and 0 < result["prefill_s"] < result["generate_s"]
    assert result["decode_tok_s"] > 0 and result["load_s"] > 0


def test_host_decode_where_jax_runs_on_a_gpu(tmp_path, capsys, monkeypatch):
    """The host decode's FFI targets are registered for the CPU, so where JAX runs on a GPU (`pip install
    .[cuda12]`), --weights auto runs float32 there and says so in one line, and an explicit host format is refused
    in one line before the model loads (the model path does not exist: the platform is checked first)."""
    import jax

    from pjinfer.runtime.engine import Engine, resolve_weights

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_weights("auto", None) == "float32"
    assert "running float32 weights on the gpu: the q4_1 host decode runs where JAX runs on the CPU" in \
        capsys.readouterr().err
    assert resolve_weights("q4_1", None) == "q4_1"
    with pytest.raises(ConfigError, match=r"--weights int8 \(the host decode\) runs on the host .* JAX here runs "
                                          r"on gpu: --weights float32 runs there, or run with JAX_PLATFORMS=cpu"):
        Engine.load(tmp_path / "missing.gguf", weights="int8")
    assert_clean_error(run_cli(capsys, "generate", "--prompt", "x", "--weights", "q4_1"),
                       "--weights q4_1 (the host decode) runs on the host through XLA FFI targets for the CPU")
