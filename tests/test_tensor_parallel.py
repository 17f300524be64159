"""Tensor parallel (pjinfer.runtime.tensor_parallel): the split's slices against numpy on random blocks, and real
runs of the default model over 1, 2 and 4 processes joined through jax.distributed (gloo over local sockets),
against the unsplit host decode. The default model's 3 KV heads split unevenly over 2 and 4 processes, so the
padded heads run too."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cpu_offload import blocks
from cpu_offload.qtensor import QTensor
from pjinfer.config import ConfigError
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(n: int) -> dict:
    """The worker's JSON from process 0 of an n-process run (n 0: one unsplit process)."""
    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, PJINFER_HOST_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), address, str(n), str(i), str(TOKENS), *PROMPTS],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(max(n, 1))]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return json.loads(outs[0][0].strip().splitlines()[-1])


@pytest.fixture(scope="module")
def unsplit(q4_engine):
    """What the worker gives with N 0, in this process: the unsplit host decode's ids and first logits."""
    import jax
    from pjinfer.runtime.model import KVCache

    e = q4_engine
    ids = [e.tokenizer.encode(p) for p in PROMPTS]
    model = e.graph.merge(e.state)
    logits = jax.jit(lambda t: model.decode(t, 0, KVCache.create(model.config, 1, 256))[0])(np.int32(ids[0][0]))
    out = [e.generate(p, max_new_tokens=TOKENS, stop_ids=[]) for p in ids]
    return {"ids": out, "logits": np.asarray(logits), "logp": e.token_logprobs(np.array([ids[0] + out[0][:24]]))[0]}


@pytest.mark.real_model
@pytest.mark.parametrize("n", [1, 2, 4])
def test_split_runs_give_the_unsplit_greedy_ids_and_logits(n, unsplit):
    got = _run(n)
    assert got["ids"] == unsplit["ids"]
    want, logits = np.array(unsplit["logits"]), np.array(got["logits"])
    if n == 1:   # the same operations in the same order
        np.testing.assert_array_equal(logits, want)
    else:        # the psums add the shards' partial sums in their own order
        assert np.abs(logits - want).max() <= 1e-4 * np.abs(want).max()
    # Scoring: host decode steps when split, XLA's sequence path unsplit (the same Q4_1 values, other float orders).
    # test_real_model bounds host against XLA logits by 2^-12 of the largest (about 20 here); a log-softmax moves
    # at most twice its logits' largest error.
    np.testing.assert_allclose(got["logp"], unsplit["logp"], rtol=0, atol=2 * 2.0 ** -12 * np.abs(want).max())
