"""Numba cfuncs loaded when first used: the decoders' FFI handlers and team stages.

Numba's ``@cfunc`` loads a function's machine code from its on-disk cache (or compiles it) where the decorator runs,
at import, and keeps it for the life of the process; the first one loaded also starts Numba's CPU target. An engine
imports the module of every decoder it may build (host_decode, predicted_decode, sparse_decode, batched_decode,
cold_handler) but runs one or two of them, so each handler and stage here is a ``DeferredCFunc``, loaded when its
address is first asked for: when a decoder of its kind is built (docs/performance.md, "Handlers loaded when used").
"""
from __future__ import annotations

import threading

from . import _numba  # noqa: F401  (the threading layer and the BLAS check, before numba is imported)

from numba import cfunc, types  # noqa: E402

HANDLER = types.intp(types.intp)    # XLA_FFI_Error* handler(XLA_FFI_CallFrame*), pointers as pointer-sized integers
STAGE = types.void(types.int64, types.int64, types.int64)   # void stage(int64 header, int64 tid, int64 n): a team's


class DeferredCFunc:
    """The cfunc of `pyfunc` with `signature` (nopython, cached on disk), made on first use: ``address``,
    ``ctypes`` and ``cache_hits`` are the cfunc's."""

    def __init__(self, signature, pyfunc):
        self.signature, self.pyfunc = signature, pyfunc
        self._made = None
        self._lock = threading.Lock()

    def made(self):
        """The cfunc, loaded from Numba's cache or compiled on the first call."""
        with self._lock:
            if self._made is None:
                self._made = cfunc(self.signature, nopython=True, cache=True)(self.pyfunc)
            return self._made

    @property
    def loaded(self) -> bool:
        return self._made is not None

    @property
    def address(self) -> int:
        return self.made().address

    @property
    def ctypes(self):
        return self.made().ctypes

    @property
    def cache_hits(self) -> int:
        return self.made().cache_hits

    def __repr__(self):
        return f"<DeferredCFunc {self.pyfunc.__module__}.{self.pyfunc.__qualname__}>"
