"""cpu_offload.activation: the Numba activations every host kernel applies."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from cpu_offload.activation import ACTIVATIONS, act, act_span, reference
from cpu_offload.kernels import act_code

ACTS = list(ACTIVATIONS)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("size, lo, hi", [(1001, 3, 998), (37, 0, 37), (16, 0, 16), (40, 5, 5), (9, 0, 9)])
def test_act_span_gives_act_bit_for_bit_in_its_range_only(activation, size, lo, hi):
    """act_span (SwiGLU 16 lanes at a time) leaves the rest of gate alone, equals act neuron by neuron (bit for
    bit where the form is exact or strict IR: all but GELU's tanh, which fastmath may contract per caller), and
    SwiGLU stays within 4 ulp of the float64 reference; extreme gates included."""
    rng = np.random.default_rng(size + lo)
    g = (rng.standard_normal(size) * 4).astype(np.float32)
    g[:min(size, 8)] = np.float32([0.0, -0.0, 100.0, -100.0, 88.5, -88.5, 1e-30, -1e-30])[:min(size, 8)]
    u = rng.standard_normal(size).astype(np.float32)
    code = act_code(activation)
    one_by_one = njit(lambda g, u, code: np.array([act(g[i], u[i], code) for i in range(g.size)], np.float32))
    want = g.copy()
    want[lo:hi] = one_by_one(g, u, code)[lo:hi]
    got = g.copy()
    act_span(got, u, lo, hi, code)
    assert np.array_equal(got[:lo], g[:lo]) and np.array_equal(got[hi:], g[hi:])
    if activation == "geglu":
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    else:
        assert np.array_equal(got.view(np.int32), want.view(np.int32))
    ref = reference(activation, g if activation != "relu" else None, u).astype(np.float32)
    if activation == "swiglu":
        normal = np.abs(g[lo:hi]) < 80
        ulps = np.abs(got[lo:hi].view(np.int32).astype(np.int64) - ref[lo:hi].view(np.int32))[normal]
        assert ulps.size == 0 or ulps.max() <= 4
    np.testing.assert_allclose(got[lo:hi], ref[lo:hi], rtol=2e-5, atol=1e-5)
