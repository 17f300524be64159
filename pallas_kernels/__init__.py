"""Accelerator kernels (Pallas) for the neuron-aware operators of the hot neurons; see README.md."""
