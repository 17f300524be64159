"""Tensor parallel (pjinfer.runtime.tensor_parallel): the split's slices against numpy on random blocks, and real
runs of the default model over 1, 2 and 4 processes joined through jax.distributed (gloo over local sockets),
against the unsplit host decode. The default model's 3 KV heads split unevenly over 2 and 4 processes, so the
padded heads run too."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from cpu_offload import blocks
from cpu_offload.qtensor import QTensor
from pjinfer.config import ConfigError
from pjinfer.measure.bench_serve import free_port, wait_healthy
from pjinfer.runtime.tensor_parallel import Processes, Split
from tests.conftest import tiny_config

WORKER = Path(__file__).with_name("tp_worker.py")
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn is",
           "Water boils at"]
TOKENS = 64


@pytest.mark.parametrize("code", [blocks.Q4_1, blocks.Q8_0, blocks.INT8])
def test_rows_and_columns_are_numpy_slices_with_zero_padding(code):
    rng = np.random.default_rng(code + 10)
    w = rng.standard_normal((7, 320)).astype(np.float32)
    q = QTensor(blocks.INT8, _int8(w), 320) if code == blocks.INT8 else QTensor.quantize(code, w)
    full = q.float32()
    np.testing.assert_array_equal(q.rows(2, 5).float32(), full[2:5])
    assert np.shares_memory(q.rows(2, 5).data, q.data)           # a row slice is a view
    padded = q.rows(5, 7, total=4).float32()
    np.testing.assert_array_equal(padded[:2], full[5:7])
    assert not padded[2:].any()
    cols = q.columns(64, 192, total=192).float32()
    np.testing.assert_array_equal(cols[:, :128], full[:, 64:192])
    assert not cols[:, 128:].any()
    with pytest.raises(ConfigError, match="split at multiples of"):
        q.columns(16, 64)


def _int8(w):
    from cpu_offload import int8
    return int8.quantize(w)


def test_split_pads_heads_and_refuses_what_does_not_divide():
    c = tiny_config(n_heads=6, n_kv_heads=3, d_ff=256, vocab_size=98)
    s = Split.of(c, 2)
    assert (s.kv, s.ff, s.vocab) == (2, 128, c.vocab_size // 2)
    assert (s.shard_config(c).n_heads, s.cache_config(c).n_kv_heads) == (4, 4)
    with pytest.raises(ConfigError, match="d_ff"):
        Split.of(c, 3)


@pytest.mark.parametrize("flags, message", [
    (("127.0.0.1", 2, 0), "HOST:PORT"),
    (("127.0.0.1:1234", 2, 2), r"--process-id must be in \[0, 2\)"),
    ((None, 2, None), "need --coordinator"),
])
def test_bad_process_flags_get_one_line(flags, message):
    with pytest.raises(ConfigError, match=message):
        Processes.from_args(*flags)


def test_the_split_runs_the_file_s_blocks_and_refuses_other_weights_in_one_line():
    from pjinfer.load.bundle import THRESHOLDS
    from pjinfer.runtime import backends

    assert {backends.select(w, parallel=True).name for w in ("q4_1", "gguf")} == {"tensor-parallel"}
    for weights, rule, what in (("int8", None, "not int8"), ("float32", None, "not float32"),
                                ("q4_1", THRESHOLDS, "not a bundle")):
        with pytest.raises(ConfigError, match=f"tensor parallel runs the dense host decode of q4_1, gguf weights "
                                              f"\\(a file of those blocks\\), {what}"):
            backends.select(weights, rule, parallel=True)


def _processes(n: int, tokens: int = TOKENS, prompts=PROMPTS, model=()) -> list:
    """The worker's (return code, stdout, stderr) of every process of an n-process run (n 0: one unsplit process);
    model: its --model and --weights flags (default: the default model in Q4_1)."""
    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, PJINFER_HOST_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), address, str(n), str(i), str(tokens), *model, *prompts],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(max(n, 1))]
    outs = [p.communicate(timeout=900) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def _cli(n: int, *args, **popen) -> list:
    """`pjinfer ARGS` started as each of the n processes of one split run (Popen objects, process 0 first; output
    piped, one host thread each, unless popen says otherwise)."""
    address = f"127.0.0.1:{free_port()}"
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 env=dict(os.environ, PJINFER_HOST_THREADS="1")) | popen
    return [subprocess.Popen([sys.executable, "-m", "pjinfer.cli.main", *args, "--coordinator", address,
                              "--num-processes", str(n), "--process-id", str(i)], **popen) for i in range(n)]


def _run(n: int, **kwargs) -> dict:
    """The worker's JSON from process 0 of an n-process run (_processes)."""
    outs = _processes(n, **kwargs)
    for rc, _, err in outs:
        assert rc == 0, err[-3000:]
    return json.loads(outs[0][1].strip().splitlines()[-1])


@pytest.fixture(scope="module")
def unsplit(q4_engine):
    """What the worker gives with N 0, in this process: the unsplit host decode's ids and first logits."""
    import jax
    from pjinfer.runtime.model import KVCache

    e = q4_engine
    ids = [e.tokenizer.encode(p) for p in PROMPTS]
    model = e.model_args[0].merge(e.model_args[1])
    logits = jax.jit(lambda t: model.decode(t, 0, KVCache.create(model.config, 1, 256))[0])(np.int32(ids[0][0]))
    out = [e.generate(p, max_new_tokens=TOKENS, stop_ids=[]) for p in ids]
    return {"ids": out, "logits": np.asarray(logits), "logp": e.token_logprobs(np.array([ids[0] + out[0][:24]]))[0],
            "last": e.last_logprobs(np.array([ids[0]]), [len(ids[0])])[0]}


@pytest.mark.real_model
@pytest.mark.parametrize("n, prompts, tokens", [(1, 5, TOKENS), (2, 5, TOKENS), (4, 2, 24)])
def test_split_runs_give_the_unsplit_greedy_ids_and_logits(n, prompts, tokens, unsplit):
    """Four processes on a CI machine's two cores decode at a few tokens a second, so that run is shorter: its
    greedy ids are the unsplit run's first `tokens` for the first `prompts` (24 tokens: what the worker scores)."""
    got = _run(n, tokens=tokens, prompts=PROMPTS[:prompts])
    assert got["ids"] == [ids[:tokens] for ids in unsplit["ids"][:prompts]]
    want, logits = np.array(unsplit["logits"]), np.array(got["logits"])
    if n == 1:   # the same operations in the same order
        np.testing.assert_array_equal(logits, want)
    else:        # the psums add the shards' partial sums in their own order
        assert np.abs(logits - want).max() <= 1e-4 * np.abs(want).max()
    # Scoring: host decode steps when split, XLA's sequence path unsplit (the same Q4_1 values, other float orders).
    # test_real_model bounds host against XLA logits by 2^-12 of the largest (about 20 here); a log-softmax moves
    # at most twice its logits' largest error.
    np.testing.assert_allclose(got["logp"], unsplit["logp"], rtol=0, atol=2 * 2.0 ** -12 * np.abs(want).max())
    # The distribution after the prompt (one-token choices: eval's shared contexts), from a padded row; the
    # padding row beside it is skipped, not scored.
    last = np.array(got["last"])
    np.testing.assert_allclose(last[0], unsplit["last"], rtol=0, atol=2 * 2.0 ** -12 * np.abs(want).max())
    assert not last[1].any()


@pytest.mark.real_model
def test_eval_over_two_processes_scores_as_one_and_process_0_writes_the_results(q4_engine, tmp_path):
    from pjinfer.measure import evaluate

    want = evaluate.evaluate(q4_engine, ["piqa"], limit=1)["tasks"]["piqa"]
    output = tmp_path / "results.json"
    procs = _cli(2, "eval", "--tasks", "piqa", "--limit", "1", "--weights", "q4_1", "--json", "--output", str(output))
    (out0, err0), (out1, err1) = (p.communicate(timeout=600) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], err0[-2000:] + err1[-2000:]
    got = json.loads(out0)["tasks"]["piqa"]
    assert {k: got[k] for k in ("acc", "acc_norm", "n")} == {k: want[k] for k in ("acc", "acc_norm", "n")}
    assert json.loads(output.read_text())["tasks"]["piqa"] == got and out1 == ""


@pytest.mark.real_model
def test_chat_over_two_processes_replies_as_one_process_does(q4_engine):
    """Process 0 reads the lines and writes the replies; process 1 makes its calls (runtime.followers) and writes
    nothing; the conversation's second turn carries the first."""
    from pjinfer.cli.chat import Conversation

    lines = ["What is the capital of France?", "And of Italy?"]
    talk = Conversation(q4_engine, max_new_tokens=16)
    want = ["".join(talk.reply(line)).strip() for line in lines]
    procs = _cli(2, "chat", "--weights", "q4_1", "--max-new-tokens", "16", stdin=subprocess.PIPE)
    (out0, err0), (out1, err1) = (p.communicate("\n".join(lines) + "\n" if i == 0 else "", timeout=600)
                                  for i, p in enumerate(procs))
    assert [p.returncode for p in procs] == [0, 0], err0[-2000:] + err1[-2000:]
    replies = [line.removeprefix("> ").strip() for line in out0.splitlines()[1:]]
    assert replies[:2] == want and out1 == ""


@pytest.mark.real_model
def test_a_second_run_s_processes_all_read_process_0_s_executables(tmp_path):
    """JAX writes a split run's executables from process 0 alone; from the second run on, process 1 reads them from
    the persistent cache too (compile_cache.read_by_every_process) and gives the same text. Only the seed's split,
    which runs on each process's own device, stays its own."""
    def run() -> tuple[str, list]:
        procs = _cli(2, "generate", "--prompt", PROMPTS[0], "--max-new-tokens", "8",
                     env=dict(os.environ, PJINFER_HOST_THREADS="1", XDG_CACHE_HOME=str(tmp_path)))
        outs = [p.communicate(timeout=300) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
        counts = [re.search(r"\((\d+) executables, (\d+) from the disk cache\)", err) for _, err in outs]
        return outs[0][0], [(int(c[1]), int(c[2])) for c in counts]

    text, ((_, read0), _) = run()
    assert read0 == 0   # a fresh cache (process 1 may already find one that process 0 wrote moments before)
    again, ((built0, read0), (built1, read1)) = run()
    assert again == text
    assert read0 == built0 and built1 - read1 <= 1


# pexpect forks this (JAX-threaded) process and execs at once in the child, which is safe; the warning is not.
@pytest.mark.real_model
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called")
def test_ctrl_c_stops_a_split_chat_s_reply_and_the_processes_stay_in_step():
    """Ctrl-C at process 0's terminal during a reply: the reply stops, the stream's release reaches the follower,
    and the next question is answered by both processes together; /exit ends both with status 0."""
    import pexpect

    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, COLUMNS="100", LINES="24", PJINFER_HOST_THREADS="1")
    flags = ["chat", "--weights", "q4_1", "--max-new-tokens", "200", "--coordinator", address, "--num-processes", "2"]
    follower = subprocess.Popen([sys.executable, "-m", "pjinfer.cli.main", *flags, "--process-id", "1"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)
    # Ctrl-C reaches the chat as a terminal's would even where this run ignores SIGINT (test_chat says why).
    child = pexpect.spawn(sys.executable, ["-m", "pjinfer.cli.main", *flags, "--process-id", "0"], env=env,
                          encoding="utf-8", timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        child.expect_exact("> ")
        child.sendline("Write a very long story about a dragon who learns to bake bread.")
        child.expect_exact("bread.\r\n")
        child.expect(r"\w+ \w+ \w+ \w+")
        child.sendcontrol("c")
        child.expect_exact("[stopped]")
        child.expect_exact("> ")
        child.sendline("What is the capital of France?")
        child.expect("Paris")
        child.expect_exact("\r\n> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
        out, err = follower.communicate(timeout=120)
    assert (child.exitstatus, follower.returncode, out) == (0, 0, ""), err[-2000:]


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory):
    """The default model re-quantized to a K-quant mix as llama.cpp's Q4_K_M makes it at this width: Q4_K down
    (1536 columns: whole blocks of 256), Q5_0 and Q8_0 for the 576-column matrices, a Q8_0 embedding."""
    import gguf

    from tests.support.gguf_files import write_requantized_default_model

    kinds = gguf.GGMLQuantizationType
    path = tmp_path_factory.mktemp("tp") / "model.k-quants.gguf"
    write_requantized_default_model(path, lambda name: kinds.Q8_0 if not name.startswith("layers.") or
                                    name.endswith(".wv") else kinds.Q4_K if name.endswith(".w_down_t") else kinds.Q5_0)
    return path


@pytest.mark.real_model
def test_a_k_quant_file_splits_as_it_runs_unsplit_and_what_does_not_cut_into_blocks_is_refused(k_quant_file):
    """--weights gguf: each process keeps its slices in the file's own block types (K-quant down cut by columns at
    whole blocks of 256); greedy ids equal the unsplit host decode's and the first logits agree within 1e-4 of the
    largest. Over 4 processes down's 1536 columns would be cut into 384: every process says so in one line.

    The split sums o's and down's partial products in another order, and these block types read their inputs
    rounded (cpu_offload/q8_dot.py), so a later input a rounding apart can round to the neighbouring step: measured
    1.2e-5 of the largest logit (1.6e-5 with every input in float32, before q8_dot; 0.33% with 8-bit codes alone)."""
    model = ("--model", str(k_quant_file), "--weights", "gguf")
    want, got = (_run(n, tokens=24, prompts=PROMPTS[:2], model=model) for n in (0, 2))
    assert got["ids"] == want["ids"]
    logits = np.array(want["logits"])
    assert np.abs(np.array(got["logits"]) - logits).max() <= 1e-4 * np.abs(logits).max()

    for p in _cli(4, "generate", *model, "--prompt", PROMPTS[0]):
        out, err = p.communicate(timeout=300)
        lines = [line for line in err.splitlines() if not line.startswith("[Gloo]")]
        assert p.returncode != 0 and out == ""
        assert lines == ["pjinfer: error: tensor parallel over 4 processes cuts blk.0.ffn_down.weight into slices of "
                         "384 columns, not whole Q4_K blocks of 256: run fewer processes"], err[-2000:]


@pytest.mark.real_model
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_split_server_answers_as_one_process_and_ends_on_a_lost_process(q4_engine, how):
    """`pjinfer serve` over two processes, driven over a real socket: its greedy completion is the unsplit engine's;
    then process 1 is killed (its sockets close) or stopped (it stops answering: tensor_parallel.Watch) under load,
    and every request in flight gets a 503 error object and process 0 exits non-zero within 60 s with one line
    naming process 1."""
    port = free_port()
    procs = _cli(2, "serve", "--port", str(port), stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, procs[0])
        body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
        got = httpx.post(f"{base}/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
        tok = q4_engine.tokenizer
        assert got == tok.decode(q4_engine.generate(tok.encode(PROMPTS[0]), max_new_tokens=16, stop_ids=[]))

        answers = []
        def ask():
            long = {"prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0}
            answers.append(httpx.post(f"{base}/v1/completions", json=long, timeout=120))
        clients = [threading.Thread(target=ask) for _ in range(2)]
        for c in clients:
            c.start()
        time.sleep(3)    # both admitted, one decoding
        procs[1].send_signal(how)
        killed = time.monotonic()
        for c in clients:
            c.join(timeout=120)
        assert [a.status_code for a in answers] == [503, 503]
        messages = [a.json()["error"]["message"] for a in answers]
        assert all("process 1 of the 2 in this run stopped" in m for m in messages), messages
        err = procs[0].communicate(timeout=60)[1]
        assert time.monotonic() - killed < 60 and procs[0].returncode == 1, err
        assert err.strip().splitlines()[-1].startswith("pjinfer: error: tensor parallel: process 1 of the 2")
        assert "Traceback" not in err and "stack trace" not in err
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.real_model
@pytest.mark.parametrize("stopped,named", [(1, "process 1 of the 2"), (0, "process 0 (the coordinator) of the 2")])
def test_a_process_that_stops_answering_ends_the_other_in_one_line(stopped, named):
    """A process that hangs without closing its sockets (SIGSTOP: its collectives and its coordination-service
    heartbeats simply stop): the other exits 1 with one line naming it, within tensor_parallel.SILENT_S and a few
    beats, before JAX's own health check would abort it with a C++ stack trace."""
    from pjinfer.runtime.tensor_parallel import SILENT_S

    # Greedy counting goes on past what the survivor's wait needs (it ends in no end-of-text token first).
    procs = _cli(2, "generate", "--prompt", "1, 2, 3, 4,", "--max-new-tokens", "4000")
    survivor = procs[1 - stopped]
    try:
        assert procs[0].stdout.read(1), procs[0].stderr.read()     # decoding: the first text has come
        procs[stopped].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        err = survivor.communicate(timeout=SILENT_S + 60)[1]
        took = time.monotonic() - stopped_at
        assert survivor.returncode == 1, err
        assert took < SILENT_S + 5, (took, err)
        lines = [l for l in err.splitlines() if l.startswith("pjinfer:")]
        assert len(lines) == 1 and f"tensor parallel: {named} in this run stopped answering" in lines[0], err
        assert "Traceback" not in err and "stack trace" not in err
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()
