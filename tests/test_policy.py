"""The placement ILP: hand-checked optima, properties on random profiles, the real model's size."""
from __future__ import annotations

import numpy as np
import pytest

from pjinfer.config import ConfigError
from pjinfer.offline.policy import Hardware, neuron_budget, parse_bytes, seconds_saved, solve, topk_baseline

# PuLP 3.x warns about every LpVariable and PULP_CBC_CMD (its 4.0 API); the policy keeps the API that
# works across the pulp>=2.8 the project allows, and the thousands of warnings would bury real ones.
pytestmark = pytest.mark.filterwarnings("ignore:.*PuLP 4.0:DeprecationWarning")


# With a 1 byte/s CPU, an infinitely fast device and 1-byte neurons, seconds_saved(mass) == mass, so
# sync_seconds is simply the activation mass a layer needs before it may use the accelerator.
def unit_hw(min_mass: float = 0.0) -> Hardware:
    return Hardware(cpu_bandwidth=1.0, device_bandwidth=np.inf, sync_seconds=min_mass)


def hot_sets(placement) -> list[set[int]]:
    return [set(np.flatnonzero(row).tolist()) for row in placement.hot]


def test_budget_forces_a_choice_between_layers():
    freq = np.array([[0.9, 0.1, 0.1, 0.0],
                     [0.5, 0.4, 0.3, 0.2]])
    p = solve(freq, 1, 4, batch=1, hardware=unit_hw())
    assert hot_sets(p) == [{0}, {0, 1, 2}]
    assert p.objective == pytest.approx(2.1) and p.status == "optimal" and p.method == "ilp"
    assert p.per_layer_counts().tolist() == [1, 3] and p.bytes_used == 4
    # The even split keeps 2 per layer and serves less.
    t = topk_baseline(freq, 1, 4)
    assert hot_sets(t) == [{0, 1}, {0, 1}] and t.objective == pytest.approx(1.9)


def test_batches_move_together_and_only_whole_batches_fit():
    # Sorted batches of 2: layer 0 -> masses 1.5, 0.2; layer 1 -> {0, 2}: 1.6, {3, 1}: 0.55.
    freq = np.array([[0.8, 0.7, 0.1, 0.1],
                     [0.9, 0.05, 0.7, 0.5]])
    p = solve(freq, 10, 39, batch=2, hardware=unit_hw())   # room for 3 neurons: one batch of 2
    assert hot_sets(p) == [set(), {0, 2}] and p.bytes_used == 20 and p.objective == pytest.approx(1.6)
    p = solve(freq, 10, 60, batch=2, hardware=unit_hw())   # three batches
    assert hot_sets(p) == [{0, 1}, {0, 1, 2, 3}] and p.objective == pytest.approx(3.65)


def test_communication_forbids_a_lukewarm_layer():
    freq = np.array([[0.9, 0.8, 0.7, 0.6],
                     [0.65, 0.1, 0.0, 0.0]])
    free = solve(freq, 1, 4, batch=1, hardware=unit_hw(0.0))
    assert hot_sets(free) == [{0, 1, 2}, {0}]
    # Layer 1's whole mass (0.75) cannot pay for a synchronisation costing 1.0.
    p = solve(freq, 1, 4, batch=1, hardware=unit_hw(1.0))
    assert hot_sets(p) == [{0, 1, 2, 3}, set()] and p.objective == pytest.approx(3.0)


def test_communication_can_demand_a_deeper_cut():
    # Layer 1 pays for its synchronisation (1.0) only with both of its warm neurons (1.1).
    freq = np.array([[0.9, 0.8, 0.7, 0.3],
                     [0.6, 0.5, 0.0, 0.0]])
    assert hot_sets(solve(freq, 1, 4, batch=1, hardware=unit_hw(0.0))) == [{0, 1, 2}, {0}]
    p = solve(freq, 1, 4, batch=1, hardware=unit_hw(1.0))
    assert hot_sets(p) == [{0, 1}, {0, 1}] and p.objective == pytest.approx(2.8)


def test_zero_budget_places_nothing():
    freq = np.random.default_rng(0).uniform(size=(3, 8))
    p = solve(freq, 100, 0, batch=2)
    assert not p.hot.any() and p.objective == 0 and p.bytes_used == 0 and p.status == "optimal"


def test_budget_holding_everything_places_everything():
    freq = np.random.default_rng(1).uniform(0.5, 1.0, size=(3, 8))
    p = solve(freq, 1, 24, batch=3, hardware=unit_hw(1.0))
    assert p.hot.all() and p.objective == pytest.approx(p.total_mass) and p.coverage == pytest.approx(1.0)


def test_bad_frequencies_are_rejected():
    with pytest.raises(ConfigError):
        solve(np.full((2, 4), 1.5), 1, 4)


def random_profile(rng, layers, neurons):
    """Per-layer power laws of different skew and sparsity, neurons shuffled within each layer."""
    skew = rng.uniform(0.3, 1.5, size=(layers, 1))
    sparsity = rng.uniform(0.01, 0.3, size=(layers, 1))
    raw = np.arange(1, neurons + 1) ** -skew
    freq = np.clip(raw * sparsity * neurons / raw.sum(axis=1, keepdims=True), 0, 1)
    return np.stack([rng.permutation(row) for row in freq])


def pays_for_sync(freq_hot_row, neuron_bytes, hw):
    return seconds_saved(freq_hot_row.sum(), neuron_bytes, hw) >= hw.sync_seconds * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_random_profiles(seed):
    rng = np.random.default_rng(seed)
    layers, neurons, batch, neuron_bytes = 6, 200, 16, 6912
    freq = random_profile(rng, layers, neurons)
    # A synchronisation worth 8 active neurons: enough to rule out the sparsest layers' tails.
    hw = Hardware(sync_seconds=float(seconds_saved(8.0, neuron_bytes, Hardware())))
    per_layer = batch * layers * neuron_bytes
    for budget in [0, per_layer, 3 * per_layer + 12345, 6 * per_layer, 9 * per_layer, layers * neurons * neuron_bytes]:
        p = solve(freq, neuron_bytes, budget, batch=batch, hardware=hw)
        assert p.status == "optimal" and p.bytes_used == p.hot.sum() * neuron_bytes <= budget
        for l in range(layers):
            hot, cold = freq[l, p.hot[l]], freq[l, ~p.hot[l]]
            if hot.size:
                assert pays_for_sync(hot, neuron_bytes, hw)
                assert cold.size == 0 or hot.min() >= cold.max()
        # Top-k's layers that pay for their synchronisation form a placement the ILP could have chosen
        # (its k is a whole number of batches at these budgets), so the optimum is at least as good.
        if budget % per_layer == 0:
            t = topk_baseline(freq, neuron_bytes, budget)
            feasible = sum(freq[l, t.hot[l]].sum() for l in range(layers) if pays_for_sync(freq[l, t.hot[l]], neuron_bytes, hw))
            assert p.objective >= feasible - 1e-9


def test_real_size_power_law():
    layers, neurons, neuron_bytes = 30, 1536, 3 * 576 * 4
    freq = random_profile(np.random.default_rng(0), layers, neurons)
    budget = layers * neurons * neuron_bytes // 3
    p = solve(freq, neuron_bytes, budget)
    t = topk_baseline(freq, neuron_bytes, budget)
    print(f"\n30x1536 ILP: {p.solve_seconds:.2f} s, {p.status}, coverage {p.coverage:.3f} "
          f"(top-k {t.coverage:.3f}), {p.bytes_used}/{budget} bytes, per layer {p.per_layer_counts().tolist()}")
    assert p.status == "optimal" and p.bytes_used <= budget
    assert p.solve_seconds < 30   # ~0.1-0.3 s here; the bound only survives a noisy shared machine
    assert p.objective > t.objective


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("123456") == 123456
    assert parse_bytes(" 4 kib ") == 4096
    for junk in ["", "abc", "2XB", "-1GB", "0", "0GiB", "1.2.3MB", "GiB"]:
        with pytest.raises(ConfigError, match="size in bytes"):
            parse_bytes(junk)


def test_neuron_budget():
    assert neuron_budget(2 * 2**30, 2**30) == 2**30
    for dense in [2**30, 3 * 2**30]:
        with pytest.raises(ConfigError, match=r"device memory 1\.0 GiB cannot hold the dense part \(.*GiB: attention"):
            neuron_budget(2**30, dense)


def exhaustive_optimum(freq, neuron_bytes, budget_bytes, hw):
    """Best activation mass over every subset of neurons (batch 1), by enumeration: no sorting, no ordering rows,
    nothing the ILP assumes. A layer with any hot neuron must save at least one synchronisation."""
    layers, neurons = freq.shape
    flat = freq.reshape(-1)
    best = 0.0
    for mask in range(1 << flat.size):
        chosen = np.array([(mask >> i) & 1 for i in range(flat.size)], bool)
        if chosen.sum() * neuron_bytes > budget_bytes:
            continue
        per_layer = chosen.reshape(layers, neurons)
        if all(not row.any() or pays_for_sync(freq[l, row], neuron_bytes, hw) for l, row in enumerate(per_layer)):
            best = max(best, float(flat[chosen].sum()))
    return best


@pytest.mark.parametrize("seed", range(16))
def test_ilp_equals_exhaustive_search(seed):
    # Up to 12 binaries: x per neuron (batch 1) plus y per layer. Budgets from none to all; synchronisation
    # costs from free to more than a layer's whole mass, so the communication rows bind in some instances.
    rng = np.random.default_rng(100 + seed)
    layers, neurons = [(1, 11), (2, 5), (3, 3), (4, 2)][seed % 4]
    freq = np.round(rng.uniform(0, 1, (layers, neurons)) ** 2, 3)
    neuron_bytes = int(rng.integers(1, 5))
    budget = int(rng.integers(0, layers * neurons + 1)) * neuron_bytes + int(rng.integers(0, neuron_bytes))
    # seconds_saved(m) = m * neuron_bytes here; a synchronisation worth 20-90% of the heaviest layer's mass
    # (none in every fourth instance) makes some optima leave a layer out that the budget alone would take.
    sync = rng.uniform(0.2, 0.9) * freq.sum(axis=1).max() if seed % 4 else 0.0
    hw = unit_hw(sync * neuron_bytes)
    p = solve(freq, neuron_bytes, budget, batch=1, hardware=hw)
    assert p.status == "optimal" and p.bytes_used == p.hot.sum() * neuron_bytes <= budget
    for l in range(layers):
        assert not p.hot[l].any() or pays_for_sync(freq[l, p.hot[l]], neuron_bytes, hw)
    assert p.objective == pytest.approx(exhaustive_optimum(freq, neuron_bytes, budget, hw), abs=1e-9)
