"""--offload-layers K, llama.cpp's -ngl: the first K layers run whole in XLA on the file's blocks, the rest and the
head on the host decode (pjinfer.runtime.backends' layer-split row). On the real default model, decode steps over
real text for K = 0, some and all, against the dense float32 model and against the unsplit host decode; the
refusals in one line before the model loads."""
import jax
import numpy as np
import pytest
from flax import nnx

from pjinfer.load.data import wiki_eval_text
from pjinfer.runtime.engine import Engine
from pjinfer.runtime.host import HostBlock, HostHead
from pjinfer.runtime.model import Block, Head, QMatrix
from tests.conftest import stepped_logprobs
from tests.support.cli import assert_clean_error, run_cli

N_LAYERS = 30   # the default model's
SOME = 7        # layers in XLA for the partial split: an odd number, so neither half is a multiple of the other


@pytest.fixture(scope="module")
def tokens(engine):
    return np.asarray(engine.tokenizer.encode(wiki_eval_text()[:400])[:48], np.int32)


@pytest.fixture(scope="module")
def references(engine, q4_engine, tokens):
    return {"float32": stepped_logprobs(engine, tokens), "host": stepped_logprobs(q4_engine, tokens)}


@pytest.fixture(scope="module")
def splits(tokens):
    """K -> (the engine, its stepped figures) for K = 0, SOME and all."""
    out = {}
    for k in (0, SOME, "all"):
        engine = Engine.load(offload_layers=k)
        out[k] = engine, stepped_logprobs(engine, tokens)
    return out


@pytest.mark.parametrize("k", [0, SOME, "all"])
def test_the_split_puts_the_first_layers_in_xla_and_the_rest_on_the_host(splits, k):
    engine, _ = splits[k]
    k = N_LAYERS if k == "all" else k
    assert engine.layers == (k, N_LAYERS) and engine.weights_format == "q4_1"
    model = nnx.merge(engine.graphdef, engine.state)   # the modules as the backend built them
    assert [type(b) for b in model.layers] == [Block] * k + [HostBlock] * (N_LAYERS - k)
    assert all(isinstance(b.attn.wq, QMatrix) for b in model.layers[:k])   # 4-bit blocks in XLA, not float32
    assert type(model.head) is (Head if k == N_LAYERS else HostHead)
    assert (engine.host is None) == (k == N_LAYERS)   # every layer in XLA: no host decoder is built
    assert engine.backend.name == "layer-split" and engine.backend.batched   # the server decodes requests together
    assert (f"layers 0-{k - 1} in XLA" if k else "no layer in XLA") in engine.path


@pytest.mark.parametrize("k", [0, SOME, "all"])
def test_the_split_decodes_the_dense_model(splits, references, k):
    """Every split gives the dense float32 model's greedy choices on real text and its log-probabilities within the
    4-bit weights' error (the int8 head's most of it), the unsplit host decode's on the same blocks within float32
    rounding (the host's inputs rounded to about 15 bits); K = 0 is the host decode bit for bit."""
    logp, greedy, last = splits[k][1]
    want_logp, want_greedy, want_last = references["float32"]
    host_logp, _, host_last = references["host"]
    assert np.isfinite(logp).all() and np.isfinite(last).all()
    assert (greedy != want_greedy).sum() <= 1
    np.testing.assert_allclose(logp, want_logp, rtol=0, atol=0.01 * np.abs(want_logp).max())
    np.testing.assert_allclose(last, want_last, rtol=0, atol=0.01 * np.abs(want_last).max())
    np.testing.assert_allclose(logp, host_logp, rtol=0, atol=2.0 ** -10 * np.abs(host_logp).max())
    np.testing.assert_allclose(last, host_last, rtol=0, atol=2.0 ** -10 * np.abs(host_last).max())
    if k == 0:   # every layer and the head on the host: the unsplit host decode's numbers, bit for bit
        np.testing.assert_array_equal(logp, host_logp)
        np.testing.assert_array_equal(last, host_last)


def test_each_split_computes_its_own_layers(splits, references):
    """The layers really move: the three splits and the host decode give four different sets of bits (XLA's
    float32 products round otherwise than the host's integer dot on rounded inputs)."""
    lasts = [splits[k][1][2] for k in (SOME, "all")] + [references["host"][2]]
    assert not any(np.array_equal(a, b) for i, a in enumerate(lasts) for b in lasts[i + 1:])


def test_generate_with_a_split_runs_the_cli(capsys):
    code, out, err = run_cli(capsys, "generate", "--prompt", "The capital of France is", "--max-new-tokens", "6",
                             "--offload-layers", str(SOME))
    assert code == 0, err
    assert "Paris" in out
    assert f"layers 0-{SOME - 1} in XLA on the cpu, layers {SOME}-{N_LAYERS - 1} and the head on the host decode" in err


@pytest.mark.parametrize("args,fragment", [
    (["--offload-layers", "31"], "--offload-layers 31: the model has 30 layers (give 0 to 30, or all)"),
    (["--offload-layers", "-1"], "must be >= 0"),
    (["--offload-layers", "half"], "expected a number of layers or all"),
    (["--offload-layers", "3", "--weights", "float32"], "not --weights float32, which runs every layer in XLA"),
    (["--offload-layers", "3", "--model", "NOT_GGUF"], "splits the layers of a GGUF file"),
])
def test_bad_splits_are_refused_in_one_line_before_loading(tmp_path, capsys, args, fragment):
    args = [str(tmp_path) if a == "NOT_GGUF" else a for a in args]
    assert_clean_error(run_cli(capsys, "generate", "--prompt", "x", *args), fragment)


def test_a_split_with_host_layers_is_refused_where_jax_runs_on_a_gpu(monkeypatch):
    from pjinfer.config import ConfigError
    from pjinfer.runtime import backends

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ConfigError, match="--offload-layers with 23 layers left to the host decode runs on the host"):
        backends.resolve(backends.Request(offload_layers=SOME))
    plan = backends.resolve(backends.Request(offload_layers="all"))   # every layer in XLA: no host decoder
    assert plan.backend.name == "layer-split" and plan.layers == (N_LAYERS, N_LAYERS) and plan.weights == "q4_1"


def test_a_split_is_refused_with_a_bundle_and_with_tensor_parallel():
    from pjinfer.config import ConfigError
    from pjinfer.runtime import backends

    with pytest.raises(ConfigError, match="not a sparse bundle"):
        backends.select("q4_1", backends.PREDICTORS, split=True)
    with pytest.raises(ConfigError, match="not tensor parallel"):
        backends.select("q4_1", parallel=True, split=True)


def test_a_split_of_the_files_own_block_types_decodes_the_host_decodes_model(tmp_path):
    """--weights gguf (a tiny random Llama, every matrix Q8_0): the split's decode steps give the unsplit host
    decode's greedy ids and its log-probabilities within rounding, K = 0 bit for bit."""
    from tests.conftest import random_weights, tiny_config
    from tests.support.gguf_files import write_tiny_gguf

    config = tiny_config(d_model=64, n_heads=4, head_dim=16, d_ff=128, vocab_size=262, n_layers=3)
    path = tmp_path / "q8.gguf"
    write_tiny_gguf(path, config, random_weights(config, seed=3), quantize=True)
    tokens = np.random.default_rng(0).integers(0, 262, 24).astype(np.int32)
    host = stepped_logprobs(Engine.load(path, weights="gguf"), tokens)
    for k in (0, 2, 3):
        engine = Engine.load(path, offload_layers=k)
        assert engine.weights_format == "gguf" and engine.layers == (k, 3)
        logp, greedy, last = stepped_logprobs(engine, tokens)
        np.testing.assert_array_equal(greedy, host[1])
        np.testing.assert_allclose(last, host[2], rtol=0, atol=2.0 ** -10 * np.abs(host[2]).max())
        if k == 0:
            np.testing.assert_array_equal(last, host[2])
        else:
            assert not np.array_equal(last, host[2])


@pytest.mark.gpu
def test_every_layer_in_xla_runs_where_jax_runs(tmp_path):
    """--offload-layers all on JAX's own platform (the GPU under `make gpu-check`, the CPU here): a tiny Q8_0 file's
    blocks dequantized in the step give the float32 engine's greedy ids on the same file and its log-probabilities
    within float32 rounding; no host decoder is built."""
    from tests.conftest import random_weights, tiny_config
    from tests.support.gguf_files import write_tiny_gguf

    config = tiny_config(d_model=64, n_heads=4, head_dim=16, d_ff=128, vocab_size=262, n_layers=3)
    path = tmp_path / "q8.gguf"
    write_tiny_gguf(path, config, random_weights(config, seed=4), quantize=True)
    tokens = np.random.default_rng(1).integers(0, 262, 24).astype(np.int32)
    engine = Engine.load(path, offload_layers="all")
    assert engine.host is None and engine.weights_format == "gguf"
    assert f"in XLA on the {jax.default_backend()}" in engine.path
    assert all(isinstance(b.attn.wq, QMatrix) for b in nnx.merge(engine.graphdef, engine.state).layers)
    logp, greedy, last = stepped_logprobs(engine, tokens)
    want_logp, want_greedy, want_last = stepped_logprobs(Engine.load(path, weights="float32"), tokens)
    np.testing.assert_array_equal(greedy, want_greedy)
    np.testing.assert_allclose(logp, want_logp, rtol=0, atol=2.0 ** -14 * np.abs(want_logp).max())
    np.testing.assert_allclose(last, want_last, rtol=0, atol=2.0 ** -14 * np.abs(want_last).max())
