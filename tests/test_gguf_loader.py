"""The GGUF loader on tiny files written here with gguf's own writer (the real file is in test_real_model)."""
import gguf
import numpy as np
import pytest

from pjinfer.config import ConfigError
from pjinfer.load import loader
from tests.conftest import random_weights, tiny_config
from tests.support.gguf_files import write_tiny_gguf


@pytest.fixture
def tiny():
    config = tiny_config(d_model=64, head_dim=16, d_ff=96, tie_embeddings=False)
    return config, random_weights(config, seed=11)


def test_round_trip_restores_canonical_weights(tmp_path, tiny):
    config, weights = write_tiny_gguf(tmp_path / "m.gguf", *tiny)
    got_config, got, tok = loader.load(tmp_path / "m.gguf")
    assert got_config == config.replace(name=got_config.name, bos_id=1, eos_ids=(2,), norm_eps=got_config.norm_eps)
    assert abs(got_config.norm_eps - config.norm_eps) < 1e-9
    assert set(got) == set(weights)
    for name in weights:
        np.testing.assert_array_equal(got[name], weights[name], err_msg=name)
    # "the" has no merge "t he"; " the" merges all the way to "Ġthe".
    assert tok.encode("the the") == [tok.token_id("t"), tok.token_id("he"), tok.token_id("Ġthe")]
    assert tok.decode(tok.encode("the the 123")) == "the the 123"


def test_quantized_tensors_dequantize_close(tmp_path, tiny):
    _, weights = write_tiny_gguf(tmp_path / "q.gguf", *tiny, quantize=True)
    _, got, _ = loader.load(tmp_path / "q.gguf")
    for name in ("layers.0.wq", "layers.1.w_down_t", "embed"):
        scale = np.abs(weights[name]).max()
        np.testing.assert_allclose(got[name], weights[name], atol=scale / 100)


def test_unsupported_architecture_is_refused(tmp_path, tiny):
    write_tiny_gguf(tmp_path / "g.gguf", *tiny, arch="gpt2")
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gpt2'"):
        loader.load(tmp_path / "g.gguf")


def test_truncated_and_foreign_files_are_refused(tmp_path, tiny):
    write_tiny_gguf(tmp_path / "m.gguf", *tiny)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="truncated"):
        loader.load(tmp_path / "cut.gguf")
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(ConfigError, match="truncated or not a GGUF"):
        loader.load(tmp_path / "text.gguf")
    with pytest.raises(ConfigError, match="model not found"):
        loader.load(tmp_path / "absent.gguf")


def test_auto_weights_are_the_files_own_blocks_or_float32(tmp_path, capsys):
    """--weights auto (pjinfer.runtime.backends.resolve) runs q4_1 for a GGUF whose layers are all Q4_1, gguf for
    other block types with host kernels, float32 otherwise."""
    from pjinfer.load.loader import default_model_path, model_identity
    from pjinfer.runtime.backends import Request, resolve

    def resolve_weights(weights, model, bundle=None):
        return resolve(Request(model, weights, bundle)).weights

    config = tiny_config(d_model=64, n_heads=4, head_dim=16, d_ff=128)
    weights = random_weights(config)
    q4, q8 = tmp_path / "q4.gguf", tmp_path / "q8.gguf"
    write_tiny_gguf(q4, config, weights, layer_type=gguf.GGMLQuantizationType.Q4_1)
    write_tiny_gguf(q8, config, weights, quantize=True)
    assert loader.stored_format(q4) == "q4_1" and resolve_weights("auto", q4) == "q4_1"
    assert loader.stored_format(q8) == "gguf" and resolve_weights("auto", q8) == "gguf"   # blocks with a kernel
    assert resolve_weights("auto", None) == loader.DEFAULT_MODEL_WEIGHTS == "q4_1"  # the embedded model
    assert resolve_weights("auto", tmp_path) == "float32"                  # a directory (HF layout)
    assert resolve_weights("int8", q4) == "int8"
    # A block type without a host kernel: float32, said in one line naming the type.
    q2 = tmp_path / "q2.gguf"
    wide = tiny_config(d_model=256, n_heads=4, head_dim=64, d_ff=256)
    write_tiny_gguf(q2, wide, random_weights(wide), layer_type=gguf.GGMLQuantizationType.Q2_K)
    capsys.readouterr()
    assert loader.stored_format(q2) is None and resolve_weights("auto", q2) == "float32"
    assert capsys.readouterr().err.strip() == "pjinfer: running float32 weights: no host kernel reads type Q2_K"
    (tmp_path / "junk.gguf").write_bytes(b"not a model")
    assert resolve_weights("auto", tmp_path / "junk.gguf") == "float32"    # the loader refuses it in one line
    # With a bundle: q4_1 runs calibrated thresholds; a predictor bundle runs float32.
    import json

    for stages, want in (({"predictors": {}, "placement": {}}, "float32"), ({"thresholds": {}}, "q4_1")):
        bundle = tmp_path / f"bundle-{want}"
        bundle.mkdir()
        model = {"identity": model_identity(default_model_path())}
        (bundle / "manifest.json").write_text(json.dumps({"format": 1, "stages": stages, "model": model}))
        assert resolve_weights("auto", None, bundle) == want
