"""Accelerator kernels (Pallas) for the neuron-aware operators: the hot neurons' FFN (hot_ffn) and the input-sparse
matrix-vector product over active inputs (gather_matvec), one gathered-rows kernel under both; see README.md."""
from pallas_kernels.gather import active_inputs, compact, gather_matvec, gather_matvec_reference
from pallas_kernels.hot_ffn import hot_ffn, hot_ffn_reference
from pallas_kernels.q4_rows import Q4Planes, dequantize, planes_from_blocks, q4_hot_ffn, q4_matvec

__all__ = ["active_inputs", "compact", "gather_matvec", "gather_matvec_reference", "hot_ffn", "hot_ffn_reference",
           "Q4Planes", "dequantize", "planes_from_blocks", "q4_hot_ffn", "q4_matvec"]
