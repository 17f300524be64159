"""Numba as cpu_offload's kernel modules import it: after the threading layer is set (_threading), and with its
BLAS check answered without SciPy (skip_blas_check). Each module that imports numba imports this first; the package
itself imports only _threading, so importing cpu_offload.qtensor (the float32 engine does) does not import Numba.
``JIT`` is how the kernels are compiled: ``@njit(**JIT)``."""
import sys

from . import _threading  # noqa: F401  (sets NUMBA_THREADING_LAYER before numba is imported)

JIT = dict(fastmath=True, cache=True, nogil=True)   # float operations the IR does not mark strict may reorder


def skip_blas_check() -> None:
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


skip_blas_check()
