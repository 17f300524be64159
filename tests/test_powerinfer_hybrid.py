"""A PowerInfer file as PowerInfer runs it beside a GPU (pjinfer/runtime/powerinfer_hybrid.py, `--hot-backend pallas`;
here `pallas-interpret`): hot neurons' Q4 rows on the accelerator, cold ones on the host, the file's predictors and
placement. Tiny files in PowerInfer's layout (tests/support/powerinfer_files.py, Q4_0 FFN rows); the reference is the
same file on the CPU's PowerInfer path (cpu_offload.predicted_decode), decode steps and scoring."""
from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest
from flax import nnx

from pjinfer.config import ConfigError
from pjinfer.runtime.engine import Engine
from pjinfer.runtime.powerinfer_hybrid import HybridFFN
from tests.conftest import PALLAS, random_weights, stepped_logprobs, tiny_config
from tests.support.cli import assert_clean_error, run_cli
from tests.support.gguf_files import write_spm_vocab
from tests.support.powerinfer_files import powerinfer_predictors, write_powerinfer

T = gguf.GGMLQuantizationType
CONFIG = tiny_config(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=192, tie_embeddings=True,
                     activation="reglu")


def write_file(path, hot, *, ffn_type=T.Q4_0, seed=11):
    """A tiny PowerInfer file with placement `hot` (bool [layers, d_ff], or None for none); its FFN rows ffn_type,
    the rest Q8_0."""
    fc1, fc2 = powerinfer_predictors(CONFIG)
    kind = lambda name: ffn_type if name.rsplit(".", 1)[-1] in ("w_gate", "w_up", "w_down_t") else T.Q8_0
    write_powerinfer(path, CONFIG, random_weights(CONFIG, seed=seed), fc1, fc2, vocab=write_spm_vocab,
                     layer_type=kind, hot=hot)
    return path


PLACEMENTS = {"some": lambda rng: rng.random((CONFIG.n_layers, CONFIG.d_ff)) < 0.4,
              "all hot": lambda rng: np.ones((CONFIG.n_layers, CONFIG.d_ff), bool),
              "all cold": lambda rng: np.zeros((CONFIG.n_layers, CONFIG.d_ff), bool),
              "odd": lambda rng: np.arange(CONFIG.d_ff)[None].repeat(CONFIG.n_layers, 0) % 37 == 5}


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_the_hybrid_computes_what_the_cpu_path_computes(tmp_path, placement):
    """Decode steps and scoring of the hybrid equal the file's CPU path (its host kernels over every predicted
    neuron) within float32 rounding, greedy ids exactly, whatever the placement (none hot, all hot, some)."""
    hot = PLACEMENTS[placement](np.random.default_rng(0))
    path = write_file(tmp_path / "pi.gguf", hot)
    cpu, hybrid = Engine.load(path), Engine.load(path, hot_backend=PALLAS)
    assert cpu.backend.name == "powerinfer" and hybrid.backend.name == "powerinfer-hybrid"
    assert "hot neurons on the" in hybrid.path and "cold ones on the host" in hybrid.path
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, 20).astype(np.int32)
    want_logp, want_greedy, want_last = stepped_logprobs(cpu, tokens)
    logp, greedy, last = stepped_logprobs(hybrid, tokens)
    np.testing.assert_array_equal(greedy, want_greedy)
    np.testing.assert_allclose(logp, want_logp, rtol=0, atol=2.0 ** -14 * np.abs(want_logp).max())
    np.testing.assert_allclose(last, want_last, rtol=0, atol=2.0 ** -14 * np.abs(want_last).max())
    scored, want_scored = hybrid.token_logprobs(tokens[None]), cpu.token_logprobs(tokens[None])
    np.testing.assert_allclose(scored, want_scored, rtol=0, atol=2.0 ** -14 * np.abs(want_scored).max())
    ids = cpu.tokenizer.encode("Once upon a time")
    assert hybrid.generate(ids, max_new_tokens=6) == cpu.generate(ids, max_new_tokens=6)


def test_the_placement_is_honoured_in_memory(tmp_path):
    """Only the hot neurons' rows are device arrays (the three planes of each hot matrix, exactly the hot rows, the
    file's numbers); every neuron's rows stay the file's host arrays, read by the host kernels for the cold ones;
    no device array of the model holds a whole FFN matrix."""
    from pallas_kernels.q4_rows import dequantize
    from pjinfer.load import loader

    hot = PLACEMENTS["some"](np.random.default_rng(2))
    path = write_file(tmp_path / "pi.gguf", hot)
    engine = Engine.load(path, hot_backend=PALLAS)
    model = nnx.merge(engine.graphdef, engine.state)
    _, stored, _ = loader.load_gguf(path, keep="gguf", neuron_rows=True)
    device = jax.devices()[0]
    for l, block in enumerate(model.layers):
        ffn = block.ffn
        assert isinstance(ffn, HybridFFN)
        n_hot = int(hot[l].sum())
        np.testing.assert_array_equal(np.asarray(ffn.hot_ids[...]), np.flatnonzero(hot[l]))
        np.testing.assert_array_equal(np.asarray(ffn.cold_ids[...]), np.flatnonzero(~hot[l]))
        for name, rows in (("w_gate", ffn.gate), ("w_up", ffn.up), ("w_down_t", ffn.down_t)):
            planes = rows.planes()
            assert all(a.shape[0] == n_hot and a.devices() == {device} for a in planes)
            assert all(a.sharding.memory_kind == device.default_memory().kind for a in planes)
            want = stored[f"layers.{l}.{name}"].float32()[hot[l]]
            np.testing.assert_array_equal(dequantize(planes), want)
        host = ffn.cold.rows
        assert all(isinstance(a, np.ndarray) for a in (host.gate, host.up, host.down))
        assert host.gate.shape[0] == CONFIG.d_ff
    ffn_rows = {CONFIG.d_ff}
    for leaf in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)):
        if leaf.ndim == 2 and leaf.shape[0] in ffn_rows:
            assert leaf.shape[1] == 16   # only the predictors' fc2 [d_ff, rank] has a row per neuron on the device


@pytest.mark.gpu
def test_the_hot_kernel_agrees_with_the_many_token_path_where_jax_runs(tmp_path):
    """On JAX's own platform (compiled on a GPU under make gpu-check, interpret mode here): the decode steps, whose
    hot rows run in q4_hot_ffn, give the same log-probabilities as scoring the sequence at once, whose hot rows are
    dequantized in XLA, to float32 rounding."""
    path = write_file(tmp_path / "pi.gguf", PLACEMENTS["some"](np.random.default_rng(3)))
    engine = Engine.load(path, hot_backend=PALLAS)
    tokens = np.random.default_rng(4).integers(0, CONFIG.vocab_size, 16).astype(np.int32)
    logp, _, _ = stepped_logprobs(engine, tokens)
    scored = engine.token_logprobs(tokens[None])[0]
    np.testing.assert_allclose(logp, scored, rtol=0, atol=2.0 ** -12 * np.abs(scored).max())


def test_a_file_without_a_placement_is_refused_in_one_line_before_loading(tmp_path, capsys):
    path = write_file(tmp_path / "pi.gguf", None)
    assert_clean_error(run_cli(capsys, "generate", "--model", str(path), "--prompt", "x", "--hot-backend", PALLAS),
                       "has no neuron placement")


def test_hot_rows_of_another_block_type_are_refused_in_one_line(tmp_path):
    hot = PLACEMENTS["some"](np.random.default_rng(5))
    path = write_file(tmp_path / "pi.gguf", hot, ffn_type=T.Q8_0)
    with pytest.raises(ConfigError, match="go to the accelerator as Q4_0 or Q4_1 blocks; layer 0's w_gate is Q8_0"):
        Engine.load(path, hot_backend=PALLAS)


def test_hot_backends_are_for_bundles_and_powerinfer_files(capsys):
    assert_clean_error(run_cli(capsys, "generate", "--prompt", "x", "--hot-backend", "pallas-interpret"),
                       "applies to a sparse bundle (or, --hot-backend, to a PowerInfer file with its predictors)")


def test_the_gpu_index_beside_the_file_is_its_placement(tmp_path):
    """PowerInfer caches the placement it solved for a machine's GPU beside the model (FILE.generated.gpuidx); the
    hybrid reads it there, as import-powerinfer does, before the file's own gpu_idx."""
    from tests.support.powerinfer_files import write_gpu_index

    path = write_file(tmp_path / "pi.gguf", None)
    hot = PLACEMENTS["odd"](None)
    write_gpu_index(str(path) + ".generated.gpuidx", hot)
    engine = Engine.load(path, hot_backend=PALLAS)
    model = nnx.merge(engine.graphdef, engine.state)
    for l, block in enumerate(model.layers):
        np.testing.assert_array_equal(np.asarray(block.ffn.hot_ids[...]), np.flatnonzero(hot[l]))


@pytest.mark.gpu
def test_auto_runs_the_hybrid_where_jax_runs_on_a_gpu(tmp_path):
    """--hot-backend auto (the default): a PowerInfer file with its predictors and placement runs the hybrid, with
    compiled Pallas kernels, where JAX runs on a GPU, and PowerInfer's CPU path (the host decode) elsewhere; no
    other request changes: a --dense file stays on xla (the default model: the next test)."""
    from pjinfer.runtime.backends import Request, resolve

    path = write_file(tmp_path / "pi.gguf", PLACEMENTS["some"](np.random.default_rng(6)))
    gpu = jax.default_backend() == "gpu"
    plan = resolve(Request(path))
    assert (plan.backend.name, plan.hot_backend) == (("powerinfer-hybrid", "pallas") if gpu else ("powerinfer", "xla"))
    assert plan.placement is not None if gpu else plan.placement is None
    assert resolve(Request(path, dense=True)).hot_backend == "xla"


def test_hot_backend_auto_and_xla_need_no_bundle_and_another_name_is_refused():
    """auto and xla are what a request without a bundle runs; a name that is not a hot backend gets one line."""
    from pjinfer.runtime.backends import Request, resolve

    assert resolve(Request(hot_backend="xla")).backend == resolve(Request(hot_backend="auto")).backend
    assert resolve(Request()).hot_backend == "xla"
    want = "^hot backend must be one of auto, xla, pallas, pallas-interpret, got 'cuda'$"
    with pytest.raises(ConfigError, match=want):
        resolve(Request(hot_backend="cuda"))
