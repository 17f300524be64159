"""Numba kernels for the cold neurons, called from inside jit through an XLA FFI target; see README.md."""
