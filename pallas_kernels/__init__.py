"""Accelerator kernels (Pallas) for the neuron-aware operators of the hot neurons; see README.md."""
from pallas_kernels.hot_ffn import hot_ffn, hot_ffn_reference

__all__ = ["hot_ffn", "hot_ffn_reference"]
