"""The GPU-CPU hybrid bench (pjinfer.measure.bench_hybrid, pjinfer.measure.hybrid_engines) on its small geometry in
interpret mode: the planted trace has the asked shape, every engine computes the same model (the neuron split
against the whole model on the device and against the layer split through the host decode), and the command runs
every path and writes its table. Random weights: these check the paths, never accuracy or speed."""
from __future__ import annotations

import numpy as np
import pytest

from pjinfer.measure import bench_hybrid
from pjinfer.measure.hybrid_engines import (GEOMETRIES, Hybrid, LayerSplit, RandomModel, device_attention, draw,
                                            firing_probabilities, id_lists, planes, table_index)
from tests.conftest import INTERPRET

pytestmark = pytest.mark.gpu   # the Pallas kernels run compiled where JAX has a GPU, interpret mode elsewhere


def test_firing_probabilities_have_the_asked_mean_and_skew():
    rng = np.random.default_rng(5)
    p = firing_probabilities(rng, 3, 1000, active_share=0.1, hot_share=0.25, hot_mass=0.8)
    assert p.shape == (3, 1000) and ((p > 0) & (p <= 1)).all()
    for layer in p:
        ranked = np.sort(layer)[::-1]
        assert layer.mean() == pytest.approx(0.1, rel=1e-6)
        assert ranked[:250].sum() / ranked.sum() == pytest.approx(0.8, abs=2e-3)
        np.testing.assert_array_equal(ranked, np.sort(p[0])[::-1])      # the same law, neurons shuffled per layer
    assert not np.array_equal(p[0], p[1])
    trace = draw(rng, p, 200)
    assert trace.shape == (200, 3, 1000) and trace.mean() == pytest.approx(0.1, abs=0.01)


def test_table_index_and_id_lists_name_each_token_s_active_members():
    members = np.array([[True, False, True], [False, True, True]])
    np.testing.assert_array_equal(table_index(members), [[0, -1, 1], [-1, 2, 3]])
    active = np.array([[[True, True, True], [True, False, False]],
                       [[False, False, False], [False, True, True]]])       # [tokens 2, layers 2, ff 3]
    ids, counts = id_lists(active, table_index(members))
    np.testing.assert_array_equal(counts, [[2, 0], [0, 2]])
    np.testing.assert_array_equal(ids[0, 0, :2], [0, 1])
    np.testing.assert_array_equal(ids[1, 1, :2], [2, 3])


@pytest.fixture(scope="module")
def tiny():
    g = GEOMETRIES["tiny"]
    model = RandomModel.random(g, seed=3)
    return model, device_attention(model), planes(model.embed), planes(model.head)


def test_every_engine_computes_the_same_model(tiny):
    """Every neuron active: the hybrid at three placements (none, half, all hot) equals the whole model on the
    device and the layer split (one layer on the device, the rest on the host decode); a sparse trace: the
    hybrid's three placements compute the same neurons, on the device, on the host or split."""
    model, attn, embed, head = tiny
    g, steps, max_len = model.g, 3, 4
    rng = np.random.default_rng(9)
    placements = [np.zeros((g.layers, g.ff), bool), rng.random((g.layers, g.ff)) < 0.5,
                  np.ones((g.layers, g.ff), bool)]

    def hybrid(hot, trace):
        return Hybrid(model, hot, trace, max_len, attn, embed, head, predictor_rank=4, threads=2,
                      interpret=INTERPRET).run(steps)

    dense = LayerSplit(model, g.layers, max_len, attn, embed, head, interpret=INTERPRET).run(steps)
    split = LayerSplit(model, 1, max_len, attn, embed, head, interpret=INTERPRET).run(steps)
    scale = np.abs(dense).max()
    assert np.isfinite(dense).all() and scale > 0
    np.testing.assert_allclose(split, dense, rtol=0, atol=2e-3 * scale)
    every = np.ones((steps, g.layers, g.ff), bool)
    for hot in placements:
        np.testing.assert_allclose(hybrid(hot, every), dense, rtol=0, atol=2e-3 * scale)
    sparse = draw(rng, firing_probabilities(rng, g.layers, g.ff, 0.2, 0.25, 0.8), steps)
    got = [hybrid(hot, sparse) for hot in placements]
    for other in got[1:]:
        np.testing.assert_allclose(other, got[0], rtol=0, atol=2e-3 * np.abs(got[0]).max())
    assert np.abs(got[0] - dense).max() > 1e-2 * scale      # the sparse trace did skip neurons


def test_dry_run_writes_every_row(tmp_path, capsys):
    out = tmp_path / "hybrid.md"
    assert bench_hybrid.main(["--dry-run", "--tokens", "2", "--pairs", "1", "--budgets", "0.25,0.75",
                              "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[1].split(":")[0].split(" (")[0] for r in rows] == [
        "all on device", "all on device, layers unrolled", "hybrid", "layer split", "hybrid", "layer split"]
    assert "DRY RUN" in out.read_text() and capsys.readouterr().out.count("| hybrid (ILP)") == 2


@pytest.mark.parametrize("argv, message", [
    (["--budgets", "0.5,x"], "--budgets must be comma-separated numbers"),
    (["--budgets", "1.5"], "--budgets must be shares in (0, 1]"),
    (["--active-share", "1"], "must be in (0, 1)"),
    (["--tokens", "0"], "must be at least 1"),
])
def test_bad_arguments_get_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        bench_hybrid.main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_without_a_gpu_the_timed_run_is_refused_in_one_line(capsys):
    import jax
    if jax.default_backend() == "gpu":
        pytest.skip("JAX runs on a GPU here")
    assert bench_hybrid.main(["--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a GPU; --dry-run checks the command here" in err
