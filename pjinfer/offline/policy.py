"""Neuron placement policy: which FFN neurons live on the accelerator ("hot") and which stay on the CPU.

PowerInfer (arXiv 2312.12456, section 6) casts placement as an integer linear program over the
profiled activation frequencies: put as much activation mass as the device's memory allows on the
accelerator, but never so few neurons in a layer that the accelerator's share does not pay for the
host<->device synchronisation it costs. `solve` is that program (pulp + CBC); `topk_baseline` is the
naive split it is compared against.
"""
from __future__ import annotations

import dataclasses
import re
import time

import numpy as np
import pulp

from pjinfer.config import ConfigError


@dataclasses.dataclass
class Hardware:
    cpu_bandwidth: float = 12e9      # bytes/s: what the Numba row-gather GEMV reaches (docs/performance.md)
    device_bandwidth: float = 2e12   # bytes/s of the accelerator (H100-class HBM ~ 2-3 TB/s)
    sync_seconds: float = 20e-6      # one host<->device synchronisation per layer


@dataclasses.dataclass
class Placement:
    hot: np.ndarray          # bool [L, F]: neuron i of layer l lives on the accelerator
    objective: float         # activation mass served by the accelerator (sum of freq of hot neurons)
    total_mass: float        # sum of all freq
    bytes_used: int          # bytes of hot neurons
    budget_bytes: int        # neuron budget (after the dense part)
    solve_seconds: float
    method: str              # "ilp" or "topk"
    status: str              # "optimal"; "time limit" (best found, not proven optimal); "heuristic" for topk

    def per_layer_counts(self) -> np.ndarray:
        return self.hot.sum(axis=1)

    @property
    def coverage(self) -> float:
        """Fraction of all activations that the accelerator serves."""
        return self.objective / self.total_mass if self.total_mass else 0.0


def seconds_saved(mass, neuron_bytes: int, hardware: Hardware):
    """Per-token time saved by reading neurons of total activation mass `mass` on the accelerator
    instead of the CPU: a neuron of frequency f touches f * neuron_bytes bytes per token on average."""
    return mass * neuron_bytes * (1 / hardware.cpu_bandwidth - 1 / hardware.device_bandwidth)


def solve(freq: np.ndarray, neuron_bytes: int, budget_bytes: int, *, batch: int = 64,
          hardware: Hardware = Hardware(), time_limit: float = 60.0) -> Placement:
    """Most activation mass on the accelerator within `budget_bytes`, as PowerInfer's ILP.

    Within each layer the neurons are sorted by frequency and cut into batches of `batch` (the last
    may be smaller); binary x[l,b] puts batch b of layer l on the accelerator, binary y[l] says layer l
    has any accelerator neurons at all.

        maximise   sum_{l,b} mass[l,b] * x[l,b]                          mass = sum of the batch's freq
        subject to sum_{l,b} size[l,b] * neuron_bytes * x[l,b] <= budget_bytes           (memory)
                   x[l,b] <= y[l]
                   sum_b mass[l,b] * neuron_bytes * (1/cpu_bw - 1/dev_bw) * x[l,b]
                       >= sync_seconds * y[l]                                     (communication)
                   x[l,b+1] <= x[l,b]                                           (hottest first)

    The communication row says a layer that uses the accelerator must move enough expected bytes there
    that the time saved over the CPU covers its one synchronisation per token; otherwise the layer
    stays wholly on the CPU. The ordering row is optimal anyway (a hotter batch of the same size is
    never worse) and prunes the search. An all-CPU placement is always feasible, so CBC can only fall
    short of optimal by hitting `time_limit`; the Placement's `status` says so.
    """
    freq = np.asarray(freq, dtype=np.float64)
    if freq.ndim != 2 or not np.all((freq >= 0) & (freq <= 1)):
        raise ConfigError("neuron frequencies must be an [layers, neurons] array of values in [0, 1]")
    if neuron_bytes <= 0 or budget_bytes < 0 or batch < 1:
        raise ConfigError(f"placement needs neuron_bytes > 0, budget >= 0 and batch >= 1 "
                          f"(got {neuron_bytes}, {budget_bytes}, {batch})")
    start = time.perf_counter()
    n_layers, n_neurons = freq.shape
    order = np.argsort(-freq, axis=1, kind="stable")
    n_batches = -(-n_neurons // batch)
    padded = np.zeros((n_layers, n_batches * batch))
    padded[:, :n_neurons] = np.take_along_axis(freq, order, axis=1)
    mass = padded.reshape(n_layers, n_batches, batch).sum(axis=2)
    sizes = np.minimum(batch, n_neurons - batch * np.arange(n_batches))

    prob = pulp.LpProblem("placement", pulp.LpMaximize)
    x = [[pulp.LpVariable(f"x_{l}_{b}", cat="Binary") for b in range(n_batches)] for l in range(n_layers)]
    y = [pulp.LpVariable(f"y_{l}", cat="Binary") for l in range(n_layers)]
    prob += pulp.lpSum(float(mass[l, b]) * x[l][b] for l in range(n_layers) for b in range(n_batches))
    # Rows are kept near unit scale: raw seconds (~1e-7 per batch) sit at CBC's feasibility tolerance.
    # Memory in whole neurons (exact integers), communication in units of one synchronisation.
    prob += pulp.lpSum(int(sizes[b]) * x[l][b] for l in range(n_layers) for b in range(n_batches)) \
        <= budget_bytes // neuron_bytes
    saved = seconds_saved(mass, neuron_bytes, hardware)
    for l in range(n_layers):
        for b in range(n_batches):
            prob += x[l][b] <= y[l]
            if b + 1 < n_batches:
                prob += x[l][b + 1] <= x[l][b]
        if hardware.sync_seconds > 0:
            prob += pulp.lpSum(float(saved[l, b] / hardware.sync_seconds) * x[l][b]
                               for b in range(n_batches)) >= y[l]
    prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit))
    if prob.sol_status == pulp.LpSolutionOptimal:
        status = "optimal"
    elif prob.sol_status == pulp.LpSolutionIntegerFeasible:
        status = "time limit"
    else:
        raise ConfigError(f"placement solver found no solution within {time_limit:g} s "
                          f"(CBC status: {pulp.LpStatus[prob.status]})")

    chosen = np.array([[(v.value() or 0) > 0.5 for v in row] for row in x])
    hot = np.zeros_like(freq, dtype=bool)
    np.put_along_axis(hot, order, np.repeat(chosen, batch, axis=1)[:, :n_neurons], axis=1)
    return _placement(hot, freq, neuron_bytes, budget_bytes, time.perf_counter() - start, "ilp", status)


def topk_baseline(freq: np.ndarray, neuron_bytes: int, budget_bytes: int) -> Placement:
    """The same budget spread evenly: every layer keeps its k most frequent neurons on the accelerator."""
    start = time.perf_counter()
    freq = np.asarray(freq, dtype=np.float64)
    n_layers, n_neurons = freq.shape
    k = min(n_neurons, budget_bytes // (neuron_bytes * n_layers))
    hot = np.zeros_like(freq, dtype=bool)
    np.put_along_axis(hot, np.argsort(-freq, axis=1, kind="stable")[:, :k], True, axis=1)
    return _placement(hot, freq, neuron_bytes, budget_bytes, time.perf_counter() - start, "topk", "heuristic")


def _placement(hot, freq, neuron_bytes, budget_bytes, seconds, method, status) -> Placement:
    bytes_used = int(hot.sum()) * neuron_bytes
    # Both solvers count whole neurons against budget_bytes // neuron_bytes, so this cannot fail.
    assert bytes_used <= budget_bytes, (bytes_used, budget_bytes)
    return Placement(hot=hot, objective=float(freq[hot].sum()), total_mass=float(freq.sum()),
                     bytes_used=bytes_used, budget_bytes=int(budget_bytes), solve_seconds=seconds,
                     method=method, status=status)


def neuron_budget(device_memory_bytes: int, dense_bytes: int) -> int:
    """Bytes left for FFN neurons once the dense part (everything that always runs on the
    accelerator) is resident."""
    budget = device_memory_bytes - dense_bytes
    if budget <= 0:
        raise ConfigError(f"device memory {format_bytes(device_memory_bytes)} cannot hold the dense part "
                          f"({format_bytes(dense_bytes)}: attention, embeddings, head, predictors, KV cache)")
    return budget


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """A size as users write it: "2GiB", "512MiB", "1.5GB" (decimal), "123456" (bytes)."""
    match = _SIZE.fullmatch(str(text))
    unit = match and _UNITS.get(match.group(2).lower())
    size = round(float(match.group(1)) * unit) if unit else 0
    if size <= 0:
        raise ConfigError(f"cannot read {text!r} as a positive size in bytes (e.g. 2GiB, 512MiB, 1.5GB, 123456)")
    return size


def format_bytes(n: int) -> str:
    """n bytes in the largest binary unit that keeps the number at least 1, e.g. "1.5 GiB"."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit.lower()]
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
