"""Numba kernels for the cold neurons, called from inside jit through an XLA FFI target.

- ``cpu_offload.kernels``: ``cold_ffn`` (Numba, one token) and numpy references.
- ``cpu_offload.bridge``: ``ColdFFN``, host-resident cold weights per layer, callable inside ``jax.jit`` through an
  XLA FFI target whose handler is a Numba ``cfunc`` (no ``pure_callback``).
- ``cpu_offload.host_decode``: ``HostDecoder``, the dense decode step with int8 weights, one FFI call per layer,
  its stages split over ``cpu_offload.team``'s spinning threads. ``cpu_offload.ffi``: the shared FFI plumbing.

Threading layer: Numba's default (OpenMP) spins for milliseconds per parallel call on 2 vCPUs; the
``workqueue`` layer does not. Importing this package therefore defaults ``NUMBA_THREADING_LAYER`` to ``workqueue``
(an explicit environment setting wins; see ``_threading.py``). The layer is chosen at Numba's first parallel launch,
so import ``cpu_offload`` before running any other parallel Numba code. Workqueue does not allow concurrent or nested
parallel launches from several threads: the bridge serialises its launches with a process-wide lock (``bridge.py``),
and ``kernels.cold_ffn`` must not be called from several Python threads at once (``bridge.cold_ffn_locked`` can).
"""
from . import _threading  # noqa: F401  (must run before numba is imported)
