"""The FFN activations, in one place: each one's name, whether it is gated (act(gate) and up) and whether an inactive
neuron is exactly zero (the ReLU family, where skipping it is exact), with its JAX form (the model, the Pallas
kernels) and a float64 numpy reference (the tests). The Numba form lives with the Numba kernels
(cpu_offload.activation.act), which select it by `code`.

A bottom-level module: it imports no other pjinfer module, so the kernel packages may import it.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Activation:
    name: str
    code: int            # the Numba kernels' switch value
    gated: bool          # act(gate) * up (drelu: relu(gate) * relu(up)); else act(up) alone (OPT's fc1 + ReLU)
    exact_zero: bool     # inactive neurons are exactly zero


ACTIVATIONS = {a.name: a for a in (
    Activation("swiglu", 0, gated=True, exact_zero=False),
    Activation("geglu", 1, gated=True, exact_zero=False),     # GELU's tanh approximation
    Activation("reglu", 2, gated=True, exact_zero=True),
    Activation("drelu", 3, gated=True, exact_zero=True),
    Activation("relu", 4, gated=False, exact_zero=True),
)}
GATED = tuple(n for n, a in ACTIVATIONS.items() if a.gated)
EXACT_ZERO = tuple(n for n, a in ACTIVATIONS.items() if a.exact_zero)


def get(name: str) -> Activation:
    """The activation called `name`; a ValueError naming the known ones otherwise."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r} (known: {', '.join(ACTIVATIONS)})") from None


def activate(name: str, gate, up):
    """JAX: the per-neuron activation of an FFN (`gate` is None for an ungated one)."""
    code = get(name).code
    if code == 0:
        return jax.nn.silu(gate) * up
    if code == 1:
        return jax.nn.gelu(gate, approximate=True) * up
    if code == 2:
        return jax.nn.relu(gate) * up
    if code == 3:
        return jax.nn.relu(gate) * jax.nn.relu(up)
    return jax.nn.relu(up)


def reference(name: str, gate: np.ndarray | None, up: np.ndarray) -> np.ndarray:
    """numpy, float64: the same activation, computed plainly."""
    code = get(name).code
    g = None if gate is None else np.asarray(gate, np.float64)
    u = np.asarray(up, np.float64)
    if code == 0:
        return g / (1.0 + np.exp(-g)) * u
    if code == 1:
        return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3))) * u
    if code == 2:
        return np.maximum(g, 0.0) * u
    if code == 3:
        return np.maximum(g, 0.0) * np.maximum(u, 0.0)
    return np.maximum(u, 0.0)
