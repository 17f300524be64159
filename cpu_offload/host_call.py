"""The callback bridge: this package's FFI targets where JAX does not run on the CPU.

The targets are registered for the CPU platform only (``ffi.register``): their Numba handlers read host buffers,
so a step compiled for a GPU has no handler to call. ``on_host(fn)`` makes a function of arrays that calls them
(ColdFFN's, HostDecoder's) callable inside ``jax.jit`` on any platform:
- its arguments leave the device through ``jax.pure_callback``;
- fn runs jitted on the CPU device, so its FFI calls are the same calls a CPU step makes and its results are the
  FFI bridge's bit for bit;
- its results go back to the device.

    y = on_host(cold)(layer, x, ids, count)        # inside jit, on any platform

Each call synchronises the device with the host and runs Python; it measured about 140 us on an H100
(docs/performance.md). fn must be a pure function of its arguments (pure_callback may run it again or drop it
when its result is unused); state it updates, such as a KV cache, has to travel as arguments and results.

BRIDGES names the two ways in: "ffi" (the targets called directly: the CPU only) and "callback" (on_host).
``bridge_for`` settles "auto" and refuses a bridge the platform cannot run.
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from .contract import BRIDGES, ConfigError


def bridge_for(asked: str, platform: str) -> str:
    """The bridge that runs: `asked` ("auto", or one of BRIDGES) on this JAX platform ("cpu", "gpu", ...). "auto" is
    "ffi" on the CPU and "callback" elsewhere; "ffi" elsewhere is a ConfigError in one line."""
    if asked == "auto":
        return "ffi" if platform == "cpu" else "callback"
    if asked not in BRIDGES:
        raise ConfigError(f"bridge must be auto or one of {', '.join(BRIDGES)}, got {asked!r}")
    if asked == "ffi" and platform != "cpu":
        raise ConfigError(f"--bridge ffi calls the host's FFI targets, registered for the CPU, and JAX here runs on "
                          f"{platform}: --bridge callback (or auto) runs there")
    return asked


def check_bridge(bridge: str) -> str:
    """bridge, when it is one of BRIDGES; else a ConfigError in one line."""
    if bridge not in BRIDGES:
        raise ConfigError(f"bridge must be one of {BRIDGES}, got {bridge!r}")
    return bridge


def through(bridge: str, fn):
    """fn as a step calls it over `bridge`: fn itself ("ffi"), or on_host(fn) ("callback")."""
    return fn if bridge == "ffi" else on_host(fn)


def on_host(fn):
    """fn (a function of arrays, returning an array or a tuple of them) made callable inside jit on any platform,
    computed on the CPU device (module docstring). The result's shapes are fn's under jax.eval_shape. Batched by
    vmap as fn itself is (its arrays keep their batch dimensions)."""
    run = jax.jit(fn)
    cpu = jax.devices("cpu")[0]

    def host(*arrays):
        out = run(*(jax.device_put(np.asarray(a), cpu) for a in arrays))
        return jax.tree_util.tree_map(np.asarray, out)

    @functools.wraps(fn)
    def call(*args):
        return jax.pure_callback(host, jax.eval_shape(fn, *args), *args, vmap_method="broadcast_all")

    return call
