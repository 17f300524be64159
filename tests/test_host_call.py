"""The callback bridge (cpu_offload.host_call): the host kernels' FFI targets reached through jax.pure_callback, what a
step compiled for a GPU calls. Forced on the CPU, it must give the FFI bridge's numbers bit for bit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_offload import bridge
from tests.test_cpu_offload import make_layer, random_mask

@pytest.mark.parametrize("weights", ["float32", "int8"])
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_callback_bridge_equals_the_ffi_bridge_bit_for_bit(activation, weights):
    """ColdFFN(bridge="callback") forced on the CPU: one token, a vmapped batch and the masked form give the FFI
    bridge's numbers exactly, on fresh inputs, empty, partial and full active sets, out_init poisoned with NaN."""
    from cpu_offload.host_call import BRIDGES

    rng = np.random.default_rng()
    d, sizes, k, n = 33, [40, 0, 9], 16, 5
    layers = [make_layer(rng, d, c, activation) for c in sizes]
    args = ([l[1] for l in layers], [l[2] for l in layers], None if activation == "relu" else [l[0] for l in layers],
            [l[3] for l in layers] if activation == "relu" else None)
    ffi_cold, cb_cold = (bridge.ColdFFN(*args, activation=activation, weights=weights, bridge=b) for b in BRIDGES)
    assert cb_cold.bridge == "callback"
    one = {c: jax.jit(lambda l, x, ids, count, c=c: c(l, x, ids, count,
                                                        out_init=jnp.full(x.shape, jnp.nan, jnp.float32)))
           for c in (ffi_cold, cb_cold)}
    batch = {c: jax.jit(jax.vmap(lambda x, ids, count, c=c: c(0, x, ids, count))) for c in (ffi_cold, cb_cold)}
    masked = {c: jax.jit(c.masked, static_argnums=0) for c in (ffi_cold, cb_cold)}
    for layer, c in enumerate(sizes):
        x = rng.standard_normal(d).astype(np.float32)
        ids = np.pad(rng.permutation(c), (0, k))[:k].astype(np.int32)
        for count in (0, min(c, k) // 2, min(c, k)):
            want = np.asarray(one[ffi_cold](layer, x, ids, count))
            np.testing.assert_array_equal(np.asarray(one[cb_cold](layer, x, ids, count)), want)
        xs = rng.standard_normal((n, d)).astype(np.float32)
        mask = random_mask(rng, n, c)
        np.testing.assert_array_equal(np.asarray(masked[cb_cold](layer, xs, mask)),
                                      np.asarray(masked[ffi_cold](layer, xs, mask)))
    ids = np.stack([rng.permutation(sizes[0])[:k] for _ in range(n)]).astype(np.int32)
    counts = rng.integers(0, k + 1, n).astype(np.int32)
    xs = rng.standard_normal((n, d)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(batch[cb_cold](xs, ids, counts)),
                                  np.asarray(batch[ffi_cold](xs, ids, counts)))
    with pytest.raises(ValueError, match="bridge must be one of"):
        bridge.ColdFFN(*args, activation=activation, bridge="cuda")


def test_bridge_for_settles_auto_and_refuses_ffi_off_the_cpu():
    from cpu_offload.host_call import bridge_for

    assert bridge_for("auto", "cpu") == "ffi" and bridge_for("auto", "gpu") == "callback"
    assert bridge_for("callback", "cpu") == "callback" and bridge_for("ffi", "cpu") == "ffi"
    with pytest.raises(ValueError, match="--bridge ffi calls the host's FFI targets.*runs on gpu: --bridge callback"):
        bridge_for("ffi", "gpu")
    with pytest.raises(ValueError, match="bridge must be auto or one of ffi, callback, got 'x'"):
        bridge_for("x", "cpu")
