"""Numba's process settings, made before Numba is imported (imported first by cpu_offload/__init__ and kernels):
the threading layer, and no SciPy import for a BLAS check these kernels do not need.

On 2 vCPUs the default layer here (OpenMP) spins 4-16 ms per parallel call; ``workqueue`` does not. An explicit
``NUMBA_THREADING_LAYER`` in the environment wins. The layer is fixed at Numba's first parallel launch, so if Numba
was imported earlier we set ``numba.config.THREADING_LAYER`` directly, which still works as long as nothing has
launched a parallel Numba function yet. (Both cpu_offload/__init__ and kernels.py import this module, because a
stale editable install can expose cpu_offload as a namespace package whose __init__ never runs.)
"""
import os
import sys

LAYER = os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

if "numba" in sys.modules and hasattr(sys.modules["numba"], "config"):
    sys.modules["numba"].config.THREADING_LAYER = LAYER


def _skip_blas_check() -> None:
    """numba.np.arraymath, which Numba's CPU target imports when it first compiles or loads a cached kernel, asks at
    import whether SciPy's BLAS is there by importing scipy.linalg: about 12 MB resident (a `pjinfer generate` of
    the default model peaked at 478 MB with it, 465 MB without). The answer only picks BLAS for np.correlate and
    np.convolve in nopython code; np.dot and np.linalg look for BLAS again when a kernel uses them, and these
    kernels use none of them. So the module is imported once with that import made to fail, then scipy.linalg is
    importable as before."""
    if "numba.np.arraymath" in sys.modules or "scipy.linalg.cython_blas" in sys.modules:
        return
    sys.modules["scipy.linalg.cython_blas"] = None     # an import of it raises ImportError
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        del sys.modules["scipy.linalg.cython_blas"]


_skip_blas_check()
