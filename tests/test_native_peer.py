"""The native peers of `pjinfer bench` (pjinfer.measure.native_peer): their output parsers on real output captured
from each binary built by `make peers` (tests/data/), the refusal of a peer that is not built, and the untied copy
PowerInfer runs on. Nothing here builds or runs a peer."""
import os
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pjinfer.config import ConfigError
from pjinfer.measure import native_peer
from tests.conftest import random_weights, tiny_config
from tests.test_cli import assert_clean_error, run_cli
from tests.test_gguf_loader import write_tiny_gguf

DATA = Path(__file__).parent / "data"
# The figures in those captures (a busy shared machine: they check the parsers, they are no speed results).
LLAMA_BENCH_AVG_TS = 26.833261
POWERINFER_EVAL_RUNS, POWERINFER_EVAL_MS = 63, 38005.11


def test_llama_bench_csv_gives_the_token_generation_rate():
    # Captured from `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -p 0 -n 64 -d 16 -t 2 -r 1 -o csv`.
    got = native_peer.parse_llama_bench_csv((DATA / "llama-bench.csv").read_text())
    assert (got["n_gen"], got["n_depth"], got["n_threads"]) == (64, 16, 2)
    assert got["decode_tok_s"] == pytest.approx(LLAMA_BENCH_AVG_TS)
    assert got["build"]


def test_llama_bench_output_without_a_generation_row_is_refused():
    header = (DATA / "llama-bench.csv").read_text().splitlines()[0]
    with pytest.raises(ConfigError, match="0 token-generation rows"):
        native_peer.parse_llama_bench_csv(header + "\n")


def test_powerinfer_timings_give_the_decode_rate_and_the_prompt_count():
    # The end of the stderr of PowerInfer's `main -m <untied copy> -n 64 -t 2 -c 96 -b 512 -p <16 tokens of wiki text>
    # --temp 0 --ignore-eos`: 64 new tokens, the first from the prompt's pass, 63 decode runs.
    got = native_peer.parse_powerinfer_timings((DATA / "powerinfer-main.stderr").read_text())
    assert got["eval_runs"] == POWERINFER_EVAL_RUNS
    assert got["decode_tok_s"] == pytest.approx(1000 * POWERINFER_EVAL_RUNS / POWERINFER_EVAL_MS)
    assert got["prompt_tokens"] == 16
    assert got["prefill_s"] > 0


def test_powerinfer_output_without_timings_is_refused():
    with pytest.raises(ConfigError, match="printed no eval timings"):
        native_peer.parse_powerinfer_timings("error: unable to load model\n")


@pytest.mark.parametrize("peer,name", [("llama-bench", "llama-bench"), ("powerinfer", "PowerInfer's main")])
def test_bench_refuses_a_peer_that_is_not_built_in_one_line(capsys, monkeypatch, tmp_path, peer, name):
    monkeypatch.setenv("PJINFER_PEERS_DIR", str(tmp_path))   # an empty peers folder: nothing built
    assert_clean_error(run_cli(capsys, "bench", "--peer", peer), f"{name} is not built: run `make peers`")


def test_untied_copy_has_the_embedding_as_output_head_and_the_same_logits(tmp_path):
    from pjinfer.runtime.engine import Engine

    config = tiny_config(d_model=64, head_dim=16, d_ff=96, tie_embeddings=True)
    src = tmp_path / "tied.gguf"
    write_tiny_gguf(src, config, random_weights(config, seed=7), quantize=True)   # Q8_0 matrices, embedding too
    copy = native_peer.untied_copy(src, tmp_path / "peers")
    assert copy.parent == tmp_path / "peers" and copy != src
    theirs, ours = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(copy))
    before, after = {t.name: t for t in theirs.tensors}, {t.name: t for t in ours.tensors}
    assert set(after) == set(before) | {"output.weight"}
    assert after["output.weight"].tensor_type == before["token_embd.weight"].tensor_type
    np.testing.assert_array_equal(after["output.weight"].data, before["token_embd.weight"].data)
    for name, t in before.items():
        np.testing.assert_array_equal(after[name].data, t.data, err_msg=name)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert {k: f.contents() for k, f in ours.fields.items() if not k.startswith("GGUF.")} == fields

    tied, untied = Engine.load(src, weights="float32"), Engine.load(copy, weights="float32")
    assert tied.config.tie_embeddings and not untied.config.tie_embeddings
    tokens = jnp.asarray([[5, 17, 42, 7, 99, 3]])
    a, b = nnx.merge(tied.graphdef, tied.state), nnx.merge(untied.graphdef, untied.state)
    np.testing.assert_allclose(np.asarray(b.logits(b.forward_sequence(tokens))),
                               np.asarray(a.logits(a.forward_sequence(tokens))), rtol=1e-6, atol=1e-6)


def test_untied_copy_is_written_once_per_source_and_not_for_an_untied_file(tmp_path):
    config = tiny_config(d_model=64, head_dim=16, d_ff=96, tie_embeddings=True)
    src = tmp_path / "tied.gguf"
    write_tiny_gguf(src, config, random_weights(config, seed=7))
    first = native_peer.untied_copy(src, tmp_path / "peers")
    written = first.stat().st_mtime_ns
    assert native_peer.untied_copy(src, tmp_path / "peers") == first and first.stat().st_mtime_ns == written
    write_tiny_gguf(src, config, random_weights(config, seed=8))     # the source changed: a new copy
    os.utime(src, ns=(written + 10**9, written + 10**9))            # (however coarse the clock of this file system)
    assert native_peer.untied_copy(src, tmp_path / "peers") != first
    untied = tmp_path / "untied.gguf"
    write_tiny_gguf(untied, config.replace(tie_embeddings=False), random_weights(config.replace(tie_embeddings=False)))
    assert native_peer.untied_copy(untied, tmp_path / "peers") == untied
