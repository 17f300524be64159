"""PowerInfer's own GGUF files (ReluLLaMA, ProSparse, Bamboo): tiny files written here in its layout with gguf's
writer (magic PWRI, ffn_down_t, F16 predictors blk.N.fc1 / fc2, int32 gpu_idx / gpu_bucket, a separate
MODEL.generated.gpuidx), loaded as a dense model, imported as a bundle and run through the sparse engine."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pjinfer.cli.main import main
from pjinfer.config import ConfigError
from pjinfer.load import loader
from pjinfer.load.bundle import Bundle
from pjinfer.load.gguf_file import GGUFFile
from pjinfer.offline.powerinfer import run_import
from tests.conftest import jitted_logits, random_weights, tiny_config
from tests.support.gguf_files import write_tiny_gguf
from tests.support.powerinfer_files import RANK, placement_tensors, powerinfer_predictors, write_gpu_index, write_powerinfer


def reference_active(fc1, fc2, h, threshold=0.0):
    """PowerInfer's decision in float64: score = fc2 relu(fc1 h) >= threshold, h the residual stream."""
    score = np.maximum(np.asarray(h, np.float64) @ fc1.astype(np.float64).T, 0) @ fc2.astype(np.float64).T
    return score >= threshold, score


@pytest.fixture
def tiny():
    config = tiny_config(d_model=64, head_dim=16, d_ff=96, tie_embeddings=True, activation="reglu")
    return config, random_weights(config, seed=11), *powerinfer_predictors(config)


def test_file_loads_as_the_dense_relu_model(tmp_path, tiny):
    config, weights, fc1, fc2 = tiny
    written, weights = write_powerinfer(tmp_path / "m.powerinfer.gguf", config, weights, fc1, fc2)
    got_config, got, _ = loader.load(tmp_path / "m.powerinfer.gguf")
    assert got_config.activation == "reglu"   # PowerInfer runs a llama file with predictors as relu(gate) * up
    assert (got_config.d_ff, got_config.n_layers, got_config.n_kv_heads) == (config.d_ff, 2, config.n_kv_heads)
    assert set(got) == set(weights)           # the predictor tensors are not model weights
    for name in weights:                      # ffn_down_t as canonical w_down_t, q/k rows unpermuted
        np.testing.assert_array_equal(got[name], weights[name], err_msg=name)
    write_powerinfer(tmp_path / "b.gguf", config, weights, fc1, fc2, arch="bamboo")
    assert loader.load(tmp_path / "b.gguf")[0].activation == "drelu"   # Bamboo: relu(gate) * relu(up)
    assert loader.stored_format(tmp_path / "m.powerinfer.gguf") is None
    with pytest.raises(ConfigError, match="transposed ffn_down_t"):
        loader.load(tmp_path / "m.powerinfer.gguf", keep="q4_1")


def test_file_computes_what_transformers_relu_llama_computes(tmp_path):
    """The dense reference: transformers' LlamaForCausalLM with hidden_act relu (down(relu(gate x) * up x)), written
    in PowerInfer's layout (plus predictors it does not use) and run by pjinfer."""
    from tests.test_hf_loader import ATOL, _hf_model, _torch_logits, forward_logits, random_ids, write_tokenizer

    model = _hf_model("llama", seed=17, hidden_act="relu", vocab_size=262)   # write_tiny_gguf's vocabulary
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    write_tokenizer(tmp_path / "hf")
    config, weights, _ = loader.load(tmp_path / "hf")
    write_powerinfer(tmp_path / "m.gguf", config, weights, *powerinfer_predictors(config))
    config, weights, _ = loader.load(tmp_path / "m.gguf")
    assert config.activation == "reglu"
    ids = random_ids(18)
    np.testing.assert_allclose(forward_logits(config, weights, ids), _torch_logits(model, ids), atol=ATOL)


def test_imported_predictors_decide_as_powerinfer(tmp_path, tiny):
    config, weights, fc1, fc2 = tiny
    for threshold in (None, 0.05):     # absent: PowerInfer's default 0; ProSparse-style files set one
        path = tmp_path / f"m{threshold}.gguf"
        write_powerinfer(path, config, weights, fc1, fc2, threshold=threshold)
        bundle = run_import(path, tmp_path / f"bundle{threshold}", out=lambda *_: None)
        predictors = bundle.predictors(loader.load(path)[0])
        assert [p.reads for p in predictors] == ["residual"] * 2 and [p.rank for p in predictors] == [RANK] * 2
        h = np.random.default_rng(0).standard_normal((64, config.d_model)).astype(np.float32) * 2
        h[0] = 0.0   # every score exactly 0: active when the threshold is 0 (>=, not >)
        t = threshold or 0.0
        for l, p in enumerate(predictors):
            want, score = reference_active(fc1[l], fc2[l], h, t)
            assert np.abs(score[1:] - t).min() > 1e-5          # beyond float32 rounding (~1e-6 here)
            np.testing.assert_array_equal(np.asarray(p.active(jnp.asarray(h))), want, err_msg=f"layer {l}")
            assert 0.2 < want[1:].mean() < 0.8
        assert np.asarray(predictors[0].active(jnp.zeros((1, config.d_model)))).all() == (t == 0.0)


def test_a_score_equal_to_the_threshold_is_active(tmp_path, tiny):
    """PowerInfer keeps score >= t: with fc1 picking h[0] and fc2 summing it, score = relu(h[0]) exactly."""
    config, weights, _, _ = tiny
    fc1 = [np.eye(RANK, config.d_model, dtype=np.float16)] * 2
    fc2 = [np.tile(np.eye(1, RANK, dtype=np.float16), (config.d_ff, 1))] * 2   # every neuron's score: relu(h[0])
    t = np.float32(0.05)
    write_powerinfer(tmp_path / "m.gguf", config, weights, fc1, fc2, threshold=float(t))
    predictor = run_import(tmp_path / "m.gguf", tmp_path / "b", out=lambda *_: None).predictors(config)[0]
    h = np.zeros((3, config.d_model), np.float32)
    h[:, 0] = t, np.nextafter(t, np.float32(0)), 0.0
    assert np.asarray(predictor.active(jnp.asarray(h))).all(axis=1).tolist() == [True, False, False]


def masked_reference(model, fc1, fc2, tokens, threshold):
    """The dense model with each layer's FFN neurons outside PowerInfer's predicted set zeroed: its logits, and
    the share of neurons predicted active."""
    x, density = model.embed[...][tokens], []
    for l, layer in enumerate(model.layers):
        h = x + layer.attn(layer.attn_norm(x), 0, None, None)[0]
        act = layer.ffn.neurons(layer.ffn_norm(h))
        mask, _ = reference_active(fc1[l], fc2[l], np.asarray(h).reshape(-1, h.shape[-1]), threshold)
        x = h + (act * mask.reshape(act.shape)) @ layer.ffn.w_down_t[...]
        density.append(mask.mean())
    return model.logits(model.final_norm(x)), float(np.mean(density))


@pytest.mark.slow
def test_bundle_runs_the_sparse_engine_as_the_masked_dense_model(tmp_path, tiny):
    from pjinfer.runtime.engine import Engine
    from pjinfer.runtime.sparse import SparseFFN, skipped_share

    config, weights, fc1, fc2 = tiny
    hot = np.random.default_rng(1).random((config.n_layers, config.d_ff)) < 0.5
    path = tmp_path / "m.powerinfer.gguf"
    write_powerinfer(path, config, weights, fc1, fc2, hot=hot)
    run_import(path, tmp_path / "bundle", out=lambda *_: None)
    np.testing.assert_array_equal(Bundle.open(tmp_path / "bundle").load_stage("placement")["hot"], hot)
    dense = Engine.load(path, weights="float32")
    sparse = Engine.load(path, weights="float32", bundle=tmp_path / "bundle")
    model, reference = nnx.merge(sparse.graphdef, sparse.state), nnx.merge(dense.graphdef, dense.state)
    assert all(isinstance(layer.ffn, SparseFFN) for layer in model.layers)
    f1, f2 = [w.astype(np.float32) for w in fc1], [w.astype(np.float32) for w in fc2]
    sparse_forward, dense_forward = jitted_logits(model), jitted_logits(reference)
    for tokens in (jnp.asarray([[64]]), jnp.asarray([[5, 17, 42, 7, 99, 3]])):   # one token, and many
        got = sparse_forward(tokens)
        want, density = masked_reference(reference, f1, f2, tokens, 0.0)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        full = dense_forward(tokens)
        assert np.abs(np.asarray(full) - np.asarray(want)).max() > 1e-3   # the mask does change the result
        assert 0.1 < density < 0.9
    # What the bench and perplexity report as skipped: the same predictions, from the residual stream.
    assert skipped_share(sparse, tokens[0].tolist()) == pytest.approx(1 - density, abs=1e-6)


def test_placement_comes_from_powerinfers_gpu_index(tmp_path, tiny):
    config, weights, fc1, fc2 = tiny
    path = tmp_path / "m.powerinfer.gguf"
    in_file = np.zeros((config.n_layers, config.d_ff), bool)
    write_powerinfer(path, config, weights, fc1, fc2, hot=in_file)
    hot = np.random.default_rng(2).random((config.n_layers, config.d_ff)) < 0.3
    write_gpu_index(tmp_path / "m.powerinfer.gguf.generated.gpuidx", hot)     # PowerInfer's cache beside the file
    assert {t.type for t in GGUFFile(tmp_path / "m.powerinfer.gguf.generated.gpuidx").tensors} == {18}
    bundle = run_import(path, tmp_path / "b1", out=lambda *_: None)
    np.testing.assert_array_equal(bundle.load_stage("placement")["hot"], hot)
    write_gpu_index(tmp_path / "modern.gpuidx", ~hot, powerinfer_int32=False)  # int32 as today's gguf numbers it
    bundle = run_import(path, tmp_path / "b2", gpu_index=tmp_path / "modern.gpuidx", out=lambda *_: None)
    np.testing.assert_array_equal(bundle.load_stage("placement")["hot"], ~hot)


def run_cli(argv, capsys):
    code = main(argv)
    return code, capsys.readouterr()


def test_command_imports_and_refuses_bad_files_in_one_line(tmp_path, tiny, capsys):
    config, weights, fc1, fc2 = tiny
    good = tmp_path / "good.gguf"
    write_powerinfer(good, config, weights, fc1, fc2, hot=np.ones((2, config.d_ff), bool))
    code, out = run_cli(["import-powerinfer", "--model", str(good), "--bundle", str(tmp_path / "ok")], capsys)
    assert code == 0 and "imported 2 PowerInfer predictors" in out.out and "100.0% of the FFN neurons hot" in out.out
    bad = {
        "plain": (dict(fc1=[], fc2=[]), "has no PowerInfer predictor tensors"),
        "shape": (dict(fc1=[w[:, :32] for w in fc1]), "layer 0's predictor is fc1 [16, 32]"),
        "layers": (dict(fc1=fc1[:1], fc2=fc2[:1]), "its predictors cover layers 0-0 (1); the model has 2 layers"),
        "extra": (dict(fc1=fc1 * 2, fc2=fc2 * 2), "cover layers 0-3 (4); the model has 2 layers"),
        "arch": (dict(arch="falcon"), "unsupported GGUF architecture 'falcon'"),
        "qwen2": (dict(arch="qwen2"), "is a qwen2 model (swiglu): PowerInfer's predictors go with"),
        "bucket": (dict(hot="bucket"), "blk.0.gpu_bucket does not list the neurons"),
    }
    for name, (change, message) in bad.items():
        path = tmp_path / f"{name}.gguf"
        args = dict(fc1=fc1, fc2=fc2) | change
        if args.pop("hot", None):
            extra = placement_tensors(np.ones((2, config.d_ff), bool), bucket=False)
            extra |= {f"blk.{l}.gpu_bucket": np.arange(5, dtype=np.int32) for l in range(2)}
            extra |= {f"blk.{l}.{n}.weight": w for l in range(2) for n, w in (("fc1", fc1[l]), ("fc2", fc2[l]))}
            write_tiny_gguf(path, config, weights, down_t=True, extra=extra, magic=b"PWRI")
        else:
            layers = {f"blk.{l}.{n}.weight": w for l, (a, b) in enumerate(zip(args["fc1"], args["fc2"]))
                      for n, w in (("fc1", a), ("fc2", b))}
            write_tiny_gguf(path, config, weights, arch=args.get("arch", "llama"), down_t=True, extra=layers,
                            magic=b"PWRI")
        code, out = run_cli(["import-powerinfer", "--model", str(path), "--bundle", str(tmp_path / name)], capsys)
        assert code == 2, name
        assert out.err.count("\n") == 1 and message in out.err, (name, out.err)
        assert not (tmp_path / name).exists(), name       # checked before anything was written
    code, out = run_cli(["import-powerinfer", "--model", str(good), "--bundle", str(tmp_path / "x"),
                         "--gpu-index", str(tmp_path / "absent.gpuidx")], capsys)
    assert code == 2 and "GPU index not found" in out.err and not (tmp_path / "x").exists()
