"""Hostile sparse bundles (manifest.json and orbax stages) and PowerInfer GPU-index files: each is refused in one
line naming what is wrong, through the API and through the CLI."""
import subprocess
import sys

import gguf
import numpy as np
import pytest

from pjinfer.config import ConfigError
from pjinfer.load import powerinfer
from pjinfer.load.bundle import Bundle
from pjinfer.load.powerinfer import predictor_state
from tests.conftest import tiny_config

CONFIG = tiny_config(d_model=32, head_dim=8, d_ff=64, n_layers=2)
MODEL = {"identity": "0123456789abcdef", "name": "tiny"}


def one_line(e) -> str:
    message = str(e.value)
    assert message and "\n" not in message
    return message


def manifest_bundle(tmp_path, text: str):
    path = tmp_path / "b"
    path.mkdir()
    (path / "manifest.json").write_text(text)
    return path


@pytest.mark.parametrize("text, message", [
    ("{", "is corrupt (Expecting property name enclosed in double quotes"),
    ("\udcff", "is corrupt ("),
    ("[1, 2]", "is corrupt (a JSON list, not an object)"),
    ('{"format": 2, "model": {}, "stages": {}}', "is corrupt (format 2, this pjinfer reads 1)"),
    ('{"format": 1, "model": "x", "stages": {}}', "its model record is not an object with a string identity"),
    ('{"format": 1, "model": {"identity": 5}, "stages": {}}', "its model record is not an object"),
    ('{"format": 1, "model": {}, "stages": []}', "its stages are not an object"),
    ('{"format": 1, "model": {}}', "its stages are not an object"),
    ('{"format": 1, "model": {}, "stages": {"../../etc": {}}}', "unknown stage '../../etc'"),
    ('{"format": 1, "model": {}, "stages": {"placement": 3}}', "the placement record is not an object"),
])
def test_a_manifest_of_the_wrong_shape_is_refused_when_opened(tmp_path, text, message):
    path = manifest_bundle(tmp_path, text.encode("utf-8", "surrogateescape").decode("latin-1"))
    with pytest.raises(ConfigError) as e:
        Bundle.open(path)
    assert message in one_line(e)


@pytest.fixture
def bundle(tmp_path):
    """A bundle for CONFIG with good thresholds and placement stages."""
    b = Bundle.create(tmp_path / "bundle", model=MODEL)
    b.save_stage("thresholds", {"thresholds": np.full((2, 4), 0.1, np.float32)}, {})
    b.save_stage("placement", {"hot": np.ones((2, 64), bool)}, {})
    return Bundle.open(b.path)


def test_good_stages_read_back(bundle):
    assert bundle.thresholds(CONFIG).shape == (2, 4) and bundle.placement(CONFIG).all()


def test_a_listed_stage_that_is_missing_or_outside_the_bundle_is_refused(bundle, tmp_path):
    import shutil

    shutil.rmtree(bundle.path / "thresholds")
    with pytest.raises(ConfigError) as e:
        bundle.thresholds(CONFIG)
    assert "the manifest lists thresholds, but" in one_line(e) and "run `pjinfer calibrate" in str(e.value)
    elsewhere = Bundle.create(tmp_path / "elsewhere", model=MODEL)
    elsewhere.save_stage("thresholds", {"thresholds": np.zeros((2, 4), np.float32)}, {})
    (bundle.path / "thresholds").symlink_to(elsewhere.path / "thresholds")
    with pytest.raises(ConfigError) as e:
        bundle.thresholds(CONFIG)
    assert "thresholds points outside the bundle" in one_line(e)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_a_truncated_or_corrupt_stage_file_is_refused(bundle, damage):
    files = [f for f in (bundle.path / "placement").rglob("*") if f.is_file() and f.stat().st_size]
    assert files
    for f in files:
        raw = f.read_bytes()
        f.write_bytes({"truncate": raw[:len(raw) // 2], "garbage": bytes(255 - b for b in raw), "empty": b""}[damage])
    with pytest.raises(ConfigError) as e:
        bundle.placement(CONFIG)
    assert "cannot read placement" in one_line(e) or "placement hot is" in str(e.value)


@pytest.mark.parametrize("stage, tree, read, message", [
    ("thresholds", {"thresholds": np.zeros((3, 4), np.float32)}, "thresholds",
     "thresholds thresholds is float32 [3, 4], the model needs float32 [2, 4]"),
    ("thresholds", {"thresholds": np.full((2, 4), np.nan, np.float32)}, "thresholds",
     "thresholds thresholds holds values that are not finite"),
    ("thresholds", {"other": np.zeros((2, 4), np.float32)}, "thresholds", "thresholds has no 'thresholds'"),
    ("placement", {"hot": np.ones((2, 64), np.float32)}, "placement",
     "placement hot is float32 [2, 64], the model needs bool [2, 64]"),
    ("placement", {"hot": np.ones((2, 63), bool)}, "placement", "placement hot is bool [2, 63]"),
])
def test_stage_arrays_of_the_wrong_shape_or_type_are_refused(tmp_path, stage, tree, read, message):
    b = Bundle.create(tmp_path / "b", model=MODEL)
    b.save_stage(stage, tree, {})
    with pytest.raises(ConfigError) as e:
        getattr(Bundle.open(b.path), read)(CONFIG)
    assert message in one_line(e)


def predictor_states(rank=4, d_model=32, d_ff=64):
    rng = np.random.default_rng(0)
    return {str(l): predictor_state(rng.standard_normal((rank, d_model)).astype(np.float32),
                                    rng.standard_normal((d_ff, rank)).astype(np.float32), 0.0) for l in range(2)}


@pytest.mark.parametrize("states, record, message", [
    (predictor_states(), {"ranks": [4, 4, 4]}, "the predictors record needs 2 ranks in 1..64"),
    (predictor_states(), {"ranks": "44"}, "the predictors record needs 2 ranks"),
    (predictor_states(), {"ranks": [4, 4], "reads": "elsewhere"}, "reads in ffn_in, residual"),
    (predictor_states(d_model=16), {"ranks": [4, 4], "reads": "residual"},
     "predictor 0 down kernel is [16, 4], the model needs [32, 4]"),
    ({"0": {"x": np.zeros(2, np.float32)}, "1": {}}, {"ranks": [4, 4]}, "predictor 0 holds ['x'], not"),
])
def test_predictors_that_do_not_fit_the_model_are_refused(tmp_path, states, record, message):
    b = Bundle.create(tmp_path / "b", model=MODEL)
    b.save_stage("predictors", states, record)
    with pytest.raises(ConfigError) as e:
        Bundle.open(b.path).predictors(CONFIG)
    assert message in one_line(e)


def test_good_predictors_read_back(tmp_path):
    b = Bundle.create(tmp_path / "b", model=MODEL)
    b.save_stage("predictors", predictor_states(), {"ranks": [4, 4], "reads": "residual"})
    assert len(Bundle.open(b.path).predictors(CONFIG)) == 2


# ------------------------------------------------------------------ PowerInfer GPU index files
def write_index(path, tensors: dict) -> None:
    """A GPU index as PowerInfer lays it out (generic.gpu_index, magic PWRI) holding `tensors` as given."""
    w = gguf.GGUFWriter(str(path), "generic.gpu_index")
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.add_block_count(CONFIG.n_layers)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "r+b") as f:
        f.write(b"PWRI")


def index_tensors(layers=2, d_ff=64, dtype=np.int32) -> dict:
    hot = np.arange(d_ff) % 3 == 0
    out = {}
    for l in range(layers):
        out[f"blk.{l}.gpu_idx"] = hot.astype(dtype)
        out[f"blk.{l}.gpu_bucket"] = np.flatnonzero(hot).astype(np.int32)
    return out


@pytest.mark.parametrize("tensors, message", [
    (index_tensors(d_ff=65), "blk.0.gpu_idx must be int32 [64] of 0 and 1, got int32 [65]"),
    (index_tensors(dtype=np.float32), "blk.0.gpu_idx must be int32 [64] of 0 and 1, got float32 [64]"),
    (index_tensors(layers=3), "gpu_idx / gpu_bucket tensors cover layers 0-2 (3); the model has 2 layers"),
    (index_tensors(layers=1), "cover layers 0-0 (1); the model has 2 layers"),
    (index_tensors() | {"blk.0.gpu_idx": np.full(64, 2, np.int32)}, "blk.0.gpu_idx must be int32 [64] of 0 and 1"),
    (index_tensors() | {"blk.1.gpu_bucket": np.arange(3, dtype=np.int32)}, "blk.1.gpu_bucket does not list"),
    ({}, "has no gpu_idx tensors: not a PowerInfer GPU index"),
])
def test_a_gpu_index_of_the_wrong_shape_dtype_or_layers_is_refused(tmp_path, tensors, message):
    path = tmp_path / "m.gpuidx"
    write_index(path, tensors)
    with pytest.raises(ConfigError) as e:
        powerinfer.read_gpu_index(path, CONFIG)
    assert message in one_line(e)


def test_a_truncated_gpu_index_is_refused(tmp_path):
    path = tmp_path / "m.gpuidx"
    write_index(path, index_tensors())
    assert powerinfer.read_gpu_index(path, CONFIG).sum() == 2 * 22
    raw = path.read_bytes()
    for cut in (2, 30, len(raw) // 3, len(raw) - 40):   # the last 8 bytes are padding after the last tensor
        path.write_bytes(raw[:cut])
        with pytest.raises(ConfigError) as e:
            powerinfer.read_gpu_index(path, CONFIG)
        assert "cannot read GPU index" in one_line(e) and "truncated" in str(e.value)


# ------------------------------------------------------------------ through the CLI
def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "pjinfer.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_refuses_a_hostile_bundle_in_one_line(tmp_path):
    bad = manifest_bundle(tmp_path, '{"format": 1, "model": "x", "stages": {}}')
    run = run_cli("generate", "--prompt", "hi", "--bundle", str(bad))
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert run.stderr.startswith("pjinfer: error: bundle manifest") and "model record" in run.stderr, run.stderr


def test_cli_refuses_a_hostile_gpu_index_in_one_line(tmp_path, capsys):
    from pjinfer.cli.main import main
    from tests.conftest import random_weights
    from tests.support.powerinfer_files import powerinfer_predictors, write_powerinfer

    config = tiny_config(d_model=64, head_dim=16, d_ff=96, tie_embeddings=True, activation="reglu")
    model, index, bundle = tmp_path / "m.gguf", tmp_path / "m.gpuidx", tmp_path / "b"
    write_powerinfer(model, config, random_weights(config, seed=1), *powerinfer_predictors(config))
    write_index(index, index_tensors(d_ff=95))
    code = main(["import-powerinfer", "--model", str(model), "--bundle", str(bundle), "--gpu-index", str(index)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "blk.0.gpu_idx must be int32 [96] of 0 and 1" in err, err
    assert not bundle.exists()


def test_a_profile_stage_that_does_not_agree_with_itself_is_refused(tmp_path):
    from pjinfer.offline import stages

    b = Bundle.create(tmp_path / "b", model=MODEL)
    record = {"activation": "swiglu", "target_sparsity": 0.5, "tokens": 8}
    b.save_stage("profile", {"thresholds": np.zeros(2, np.float32), "freq": np.zeros((2, 64), np.float32),
                             "mass": np.zeros((2, 63), np.float32)}, record)
    with pytest.raises(ConfigError) as e:
        stages.load_stats(Bundle.open(b.path))
    assert "the profile's thresholds [2], freq [2, 64] and mass [2, 63] do not agree" in one_line(e)
    b.save_stage("profile", {"thresholds": np.zeros(2, np.float32)}, {"activation": "swiglu"})
    with pytest.raises(ConfigError) as e:
        stages.load_stats(Bundle.open(b.path))
    assert "the profile record lacks target_sparsity, tokens; run `pjinfer profile" in one_line(e)
