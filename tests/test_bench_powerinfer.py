"""`make bench-powerinfer`'s parts without the peer binary: the writer of random PowerInfer files
(pjinfer/measure/powerinfer_files.py) on a tiny geometry (the file is PowerInfer's layout, loads in pjinfer and runs
sparse and dense), its density calibration against fresh residual vectors and against a real decode, `pjinfer
bench` on such a file, and the parser of PowerInfer's output on text captured from its sparse path."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from pjinfer.config import ConfigError
from pjinfer.load import loader, powerinfer
from pjinfer.load.gguf_file import GGUFFile
from pjinfer.measure import bench, native_peer
from pjinfer.measure import powerinfer_files as pf
from pjinfer.runtime import backends
from pjinfer.runtime.engine import Engine
from tests.support.gguf_files import write_spm_vocab
from tests.test_cli import run_cli

DATA = Path(__file__).parent / "data"
TINY = pf.Geometry(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=576)


def write_vocab(path) -> Path:
    """A GGUF holding only the tiny SentencePiece vocabulary (tests/support/gguf_files.py)."""
    w = gguf.GGUFWriter(str(path), "llama")
    write_spm_vocab(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pi")
    path = folder / "tiny.powerinfer.gguf"
    threshold = pf.write_file(path, TINY, vocab=write_vocab(folder / "vocab.gguf"), seed=4)
    return path, threshold


def test_the_file_is_powerinfers_layout(tiny_file):
    path, threshold = tiny_file
    f = GGUFFile(path)
    assert f.powerinfer and path.read_bytes()[:4] == b"PWRI"
    assert f.fields["powerinfer.sparse_threshold"] == pytest.approx(threshold)
    assert f.fields["tokenizer.ggml.model"] == "llama"
    types = {t.name: t.type for t in f.tensors}
    shapes = {t.name: t.shape for t in f.tensors}
    assert "output.weight" in types and not any(n.endswith(".ffn_down.weight") for n in types)
    for l in range(TINY.n_layers):
        for m in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down_t"):
            assert types[f"blk.{l}.{m}.weight"] == gguf.GGMLQuantizationType.Q4_0
        assert shapes[f"blk.{l}.ffn_down_t.weight"] == (TINY.d_ff, TINY.d_model)
        assert (types[f"blk.{l}.fc1.weight"], shapes[f"blk.{l}.fc1.weight"]) == (1, (TINY.rank, TINY.d_model))
        assert (types[f"blk.{l}.fc2.weight"], shapes[f"blk.{l}.fc2.weight"]) == (1, (TINY.d_ff, TINY.rank))
    # the predictors as written are the ones the writer makes from the seed (streamed: made again to write)
    fc1, fc2 = pf.predictor(TINY, 1, 4, pf.DENSITY)
    stored = {t.name: np.asarray(t.data) for t in f.tensors}
    np.testing.assert_array_equal(stored["blk.1.fc1.weight"], fc1)
    np.testing.assert_array_equal(stored["blk.1.fc2.weight"], fc2)


def test_the_file_loads_and_runs_sparse_and_dense(tiny_file):
    path, _ = tiny_file
    sparse = Engine.from_plan(backends.resolve(backends.Request(path)))
    dense = Engine.from_plan(backends.resolve(backends.Request(path, dense=True)))
    assert (sparse.backend.name, dense.backend.name) == ("powerinfer", "powerinfer-dense")
    assert sparse.config.activation == "reglu" and not sparse.config.tie_embeddings
    prompt = sparse.tokenizer.encode("hello world, the quick fox")
    out = sparse.generate(prompt, max_new_tokens=6, stop_ids=[])
    assert len(out) == 6 and all(0 <= t < sparse.config.vocab_size for t in out)
    assert len(dense.generate(prompt, max_new_tokens=6, stop_ids=[])) == 6
    assert bench.predicted_density(dense, prompt, 4) == 1.0


def test_the_threshold_gives_the_density_on_fresh_residuals_of_any_norm(tiny_file):
    path, threshold = tiny_file
    reader, config = loader.gguf_header(path)
    predictors = powerinfer.read_predictors(reader, config, path)
    assert predictors.threshold == pytest.approx(threshold)
    assert abs(threshold) < 0.05   # near 0: the density does not hang on the residual stream's norm
    rng = np.random.default_rng(99)   # not the calibration's vectors
    for norm in (1.0, 40.0):
        r = rng.standard_normal((256, TINY.d_model)).astype(np.float32)
        r *= norm / np.linalg.norm(r, axis=1, keepdims=True) * np.sqrt(TINY.d_model)
        shares = [(pf.scores(a, b, r) >= threshold).mean() for a, b in zip(predictors.fc1, predictors.fc2)]
        assert np.allclose(shares, pf.DENSITY, atol=0.02), (norm, shares)


def test_a_decode_computes_about_the_calibrated_density(tiny_file):
    path, _ = tiny_file
    engine = Engine.from_plan(backends.resolve(backends.Request(path)))
    prompt = engine.tokenizer.encode("the quick fox, hello world")
    density = bench.predicted_density(engine, prompt, 24)
    assert 0.06 < density < 0.14, density


def test_the_calibration_follows_the_target():
    for density in (0.05, 0.3):
        t = pf.calibrate(TINY, 0, density)
        fc1, fc2 = pf.predictor(TINY, 0, 0, density)
        r = np.random.default_rng(5).standard_normal((256, TINY.d_model)).astype(np.float32)
        assert (pf.scores(fc1, fc2, r) >= t).mean() == pytest.approx(density, abs=0.02)


def test_bad_geometry_density_and_vocabulary_are_refused(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.gguf")
    with pytest.raises(ConfigError, match="density must be in"):
        pf.write_file(tmp_path / "a.gguf", TINY, vocab=vocab, density=1.5)
    with pytest.raises(ConfigError, match="Q4_0 rows or whole heads"):
        pf.write_file(tmp_path / "a.gguf", pf.Geometry(100, 1, 4, 2, 256), vocab=vocab)
    with pytest.raises(ConfigError, match="unknown size"):
        pf.Geometry.named("2b")
    bpe = tmp_path / "bpe.gguf"
    w = gguf.GGUFWriter(str(bpe), "llama")
    w.add_tokenizer_model("gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(ConfigError, match="no SentencePiece"):
        pf.write_file(tmp_path / "a.gguf", TINY, vocab=bpe)
    assert not list(tmp_path.glob("a.gguf*"))


def test_bench_runs_the_files_predictors_against_the_same_file_dense(capsys, tiny_file):
    path, _ = tiny_file
    # Enough tokens and runs that decode's time (a difference of two timed calls) stands above the noise of a
    # busy machine: with 4 tokens and one run it came out <= 0 at times, which bench refuses as an impossible rate.
    code, out, err = run_cli(capsys, "bench", "--model", str(path), "--prompt-len", "8", "--new-tokens", "32",
                             "--runs", "3", "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    engines = result["engines"]
    assert set(engines) == {"sparse", "dense-gguf"}
    assert engines["dense-gguf"]["density"] == 1.0 and 0 < engines["sparse"]["density"] < 0.5
    assert result["sparse_over_dense"] == engines["sparse"]["decode_over"]["dense-gguf"]
    assert engines["sparse"]["bytes_per_token"] < engines["dense-gguf"]["bytes_per_token"]


def test_powerinfer_sparse_output_is_parsed():
    # The stderr of PowerInfer's `main -m <a random PowerInfer file of this writer, d 256, 4 layers> -n 16 -t 2 -c 48
    # -b 512 -p "Once upon a time" --temp 0 --repeat-penalty 1.0 --ignore-eos --log-disable`, its per-tensor lines
    # left out: it took the sparse path.
    got = native_peer.parse_powerinfer_timings((DATA / "powerinfer-main-sparse.stderr").read_text())
    assert got["sparse"] and got["eval_runs"] == 15 and got["prompt_tokens"] == 5
    assert got["decode_tok_s"] == pytest.approx(1000 * 15 / 1156.43)
    assert got["load_s"] == pytest.approx(0.17051)
    dense = native_peer.parse_powerinfer_timings((DATA / "powerinfer-main.stderr").read_text())
    assert not dense["sparse"] and dense["load_s"] == pytest.approx(0.11876)


def test_bench_powerinfer_refuses_an_unknown_size_in_one_line(capsys):
    from pjinfer.measure import bench_powerinfer

    assert bench_powerinfer.main(["--sizes", "0.5b,9b"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown size '9b'" in err
