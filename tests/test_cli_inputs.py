"""The CLI's inputs, run in-process: bad input is refused in one line before the model loads; prompt sources,
stop strings and the timing fields of `generate`; `eval`'s result files (--output checked before evaluating,
--compare refuses what it cannot read)."""
import io
import json
import sys
import time

import pytest

from pjinfer.config import ConfigError
from pjinfer.measure import evaluate
from tests.support.cli import assert_clean_error, run_cli


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


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["chat"], ["serve"], ["eval", "--tasks", "piqa"],
                                     ["perplexity", "--text-file", "TEXT"]])
def test_every_split_command_refuses_a_bad_coordinator_before_loading(tmp_path, capsys, command):
    (tmp_path / "text.txt").write_text("Some text to score.")
    command = [str(tmp_path / "text.txt") if a == "TEXT" else a for a in command]
    code, out, err = run(capsys, *command, "--model", str(tmp_path / "no.gguf"), "--coordinator", "nohost")
    assert_one_line_error(code, out, err, "--coordinator must be HOST:PORT, got 'nohost'")


@pytest.mark.real_model
def test_stop_string_cuts_the_text_and_is_not_printed(capsys):
    code, out, err = run(capsys, "generate", "--prompt", "The capital of France is", "--max-new-tokens", "16",
                         "--stop", "\n")
    assert code == 0 and out == " Paris.\n"        # greedy goes on " Paris.\n\nThe answer ..."


@pytest.mark.real_model
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

    from pjinfer.runtime.backends import Request, resolve
    from pjinfer.runtime.engine import Engine

    def resolve_weights(weights, model):
        return resolve(Request(model, weights)).weights

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_weights("auto", None) == "float32"
    assert "running float32 weights on the gpu: the q4_1 host decode runs where JAX runs on the CPU" in \
        capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"--weights q4_1 \(the host decode\) runs on the host"):
        resolve_weights("q4_1", None)
    with pytest.raises(ConfigError, match=r"--weights int8 \(the host decode\) runs on the host .* JAX here runs "
                                          r"on gpu: --weights float32 runs there, or run with JAX_PLATFORMS=cpu"):
        Engine.load(tmp_path / "missing.gguf", weights="int8")
    assert_clean_error(run_cli(capsys, "generate", "--prompt", "x", "--weights", "q4_1"),
                       "--weights q4_1 (the host decode) runs on the host through XLA FFI targets for the CPU")


def refuse_loading(monkeypatch):
    """Reading a checkpoint from here on fails the test."""
    from pjinfer.load import loader

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(loader, "load_gguf", no_load)
    monkeypatch.setattr(loader, "load_hf", no_load)


def test_more_threads_than_usable_cores_are_refused_before_loading(capsys, monkeypatch):
    import os

    from cpu_offload import team

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("PJINFER_HOST_THREADS", raising=False)
    assert team.default_size() == cores                    # the default: every usable core
    refuse_loading(monkeypatch)
    start = time.perf_counter()
    result = run(capsys, "generate", "--prompt", "x", "--threads", str(cores + 1))
    assert_one_line_error(*result, f"--threads {cores + 1} is more than the {cores} CPU cores this process may use")
    monkeypatch.setenv("PJINFER_HOST_THREADS", "1000")
    assert_one_line_error(*run(capsys, "generate", "--prompt", "x"), "PJINFER_HOST_THREADS=1000 is more than")
    assert_one_line_error(*run(capsys, "perplexity", "--text-file", __file__), "PJINFER_HOST_THREADS=1000 is more")
    assert time.perf_counter() - start < 5
    monkeypatch.setenv("PJINFER_HOST_THREADS", str(cores))
    assert team.default_size() == cores


def test_decode_rate_counts_only_the_timed_decode_steps():
    from pjinfer.cli.run import decode_rate

    # A slow clock: the prefill's token at 10 s, then decode chunks of two tokens each arriving together.
    marks = [0.0, 10.0, 12.0, 12.0, 14.0, 14.0]
    assert decode_rate(marks) == pytest.approx(4 / 4.0)    # 4 tokens after the first, over 4 s since it came
    assert decode_rate([0.0, 10.0, 11.0, 12.5]) == pytest.approx(2 / 2.5)
    assert decode_rate([0.0, 10.0, 11.0]) is None          # one decode step: nothing to time
    assert decode_rate([0.0, 10.0]) is None and decode_rate([0.0]) is None
    assert decode_rate([0.0, 10.0, 10.0, 10.0]) is None    # no time passed: no rate rather than infinity
    # Less the compilation after the first token (the decode loop's executable, during the first chunk).
    assert decode_rate(marks, 2.0) == pytest.approx(4 / 2.0)
    assert decode_rate(marks, 4.0) is None


def test_bench_decode_is_not_made_fast_by_a_slow_one_token_run():
    """bench's decode = whole(1 + n) less the fastest whole(1) beside it: a whole(1) slowed by other work (here a
    sleep on the first timed one) must not make the decode read faster than it is."""
    from pjinfer.measure.bench import _timed

    calls = []

    def whole(n):   # 20 ms of prompt, 10 ms a token; the warm-up's and the first run's first whole(1) are slow
        calls.append(n)
        time.sleep(0.02 + 0.01 * n + (0.2 if len(calls) in (1, 4) else 0.0))

    measure = _timed((lambda: None, whole), new_tokens=4)
    for _ in range(3):
        prefill_s, decode_s = measure()
        assert decode_s > 0.03, decode_s   # 40 ms of tokens (a sleep may overrun); a slow whole(1) read: < 0
    assert calls == [1, 5, 1] * 3


@pytest.mark.parametrize("seed", ["-2", str(2**32)])
def test_seeds_outside_the_range_are_refused(capsys, monkeypatch, seed):
    refuse_loading(monkeypatch)
    result = run(capsys, "generate", "--prompt", "x", "--temperature", "0.8", "--seed", seed)
    assert_one_line_error(*result, "seed must be in [0, 2**32), or -1 for a random one")


def generate_json(capsys, *args):
    code, out, err = run(capsys, "generate", *args, "--json")
    assert code == 0, err
    return json.loads(out), err


@pytest.mark.real_model
def test_sampling_without_a_seed_draws_one_and_reports_it(capsys):
    args = ("--prompt", "Once upon a time", "--max-new-tokens", "4", "--temperature", "1.5")
    first, _ = generate_json(capsys, *args)
    assert 0 <= first["seed"] < 2**32
    again, _ = generate_json(capsys, *args, "--seed", str(first["seed"]))   # the printed seed replays the run
    assert again["token_ids"] == first["token_ids"] and again["seed"] == first["seed"]
    code, out, err = run(capsys, "generate", *args, "--seed", "-1")           # -1: random, as without --seed
    seed = int(err.splitlines()[-1].split(", seed ")[1].split()[0])
    assert code == 0 and 0 <= seed < 2**32 and seed != first["seed"]


def test_finish_reason_and_token_ids_agree_with_the_text(capsys, engine):
    prompt = ("--prompt", "The capital of France is")
    # Greedy goes on " Paris.\n\nThe answer ...": the stop string is seen once " answer" has come.
    stopped, _ = generate_json(capsys, *prompt, "--max-new-tokens", "16", "--stop", "The answer")
    assert stopped["finish_reason"] == "stop" and stopped["stop"] == "The answer"
    text, ids, decode = stopped["text"], stopped["token_ids"], engine.tokenizer.decode
    assert text == " Paris.\n\n"
    # Cut after the token in which the stop string begins: with it the text reaches the stop, without it not.
    assert decode(ids).startswith(text + "T") and len(decode(ids[:-1])) <= len(text)
    assert stopped["new_tokens"] > len(ids)       # the ids after that one are not reported
    full, _ = generate_json(capsys, *prompt, "--max-new-tokens", "5")
    assert full["finish_reason"] == "length" and full["stop"] is None and len(full["token_ids"]) == 5
    assert full["seed"] is None                    # greedy: no seed used
    assert decode(full["token_ids"]) == full["text"]
    eos, _ = generate_json(capsys, "--prompt", "Say hi.", "--chat", "--max-new-tokens", "64")
    assert eos["finish_reason"] == "stop" and eos["stop"] is None and len(eos["token_ids"]) < 64


@pytest.mark.real_model
def test_ctrl_c_reports_interrupted(capsys, monkeypatch):
    import signal

    from pjinfer.load.tokenizer import StreamDecoder

    push = StreamDecoder.push

    def push_then_ctrl_c(self, token):   # a real SIGINT, as Ctrl-C sends, once three tokens have come
        piece = push(self, token)
        if len(self.ids) == 3:
            signal.raise_signal(signal.SIGINT)
        return piece

    monkeypatch.setattr(StreamDecoder, "push", push_then_ctrl_c)
    # Python's own handler, even where this run ignores SIGINT (a background job of a non-interactive shell does).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, out, err = run(capsys, "generate", "--prompt", "Once upon a time", "--max-new-tokens", "40", "--json")
    finally:
        signal.signal(signal.SIGINT, previous)
    result = json.loads(out)
    assert code == 130 and err.strip().endswith("pjinfer: interrupted")
    assert result["finish_reason"] == "interrupted" and result["interrupted"] is True
    assert 3 <= len(result["token_ids"]) < 40


def test_results_file_honours_the_umask(tmp_path):
    import os

    from pjinfer.cli.common import write_json

    for umask, mode in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664)):
        old = os.umask(umask)
        try:
            write_json(tmp_path / f"r{umask:o}.json", {"tasks": {}})
        finally:
            os.umask(old)
        assert (tmp_path / f"r{umask:o}.json").stat().st_mode & 0o777 == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r2.json", "r22.json", "r77.json"]


def test_version_help_defaults_and_json_only_where_it_does_something(capsys):
    from importlib.metadata import version

    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"pjinfer {version('pjinfer')}"
    code, out, _ = run(capsys, "generate", "--help")
    flat = " ".join(out.split())
    assert code == 0 and "--max-new-tokens MAX_NEW_TOKENS the most tokens generated (default: 64)" in flat
    assert "add up to this (1 keeps every token) (default: 1.0)" in flat
    assert "0 is greedy (default) --top-k" in flat        # a help that names its default is left as it was
    assert "(default: None)" not in flat and "(default: False)" not in flat
    for command in ("chat", "serve"):
        assert_one_line_error(*run(capsys, command, "--json"), "unrecognized arguments: --json")


def test_kernel_compilation_is_announced_in_one_line():
    from numba import njit

    from pjinfer.runtime.compile_cache import KernelCompileNotice

    quiet = io.StringIO()
    notice = KernelCompileNotice(stream=quiet)
    notice.start()
    notice.finish()
    assert quiet.getvalue() == ""                          # nothing compiled: nothing said

    @njit(cache=False)
    def outer(x):
        return inner(x) + 1

    @njit(cache=False)
    def inner(x):
        return x * 2

    said = io.StringIO()
    notice = KernelCompileNotice(stream=said)
    notice.start()
    assert outer(3) == 7                                   # compiles outer, and inner inside it
    notice.finish()
    line = said.getvalue()
    assert line.startswith("compiling the CPU kernels, once") and line.endswith(" s\n") and line.count("\n") == 1
    assert notice.compiles == 1 and 0 < notice.seconds < 60
    notice.start()                                         # said once: a later compilation is not announced
    assert njit(cache=False)(lambda x: x - 1)(3) == 2
    notice.finish()
    assert said.getvalue() == line
