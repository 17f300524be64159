"""What the host kernels and their callers agree on, in a module that imports nothing, so that the app's
bottom-level module (pjinfer.config) re-exports it without loading Numba: the error every refusal of bad input
raises, the order of a layer's input thresholds, and the formats cold rows may be stored in.

The kernel packages import nothing from pjinfer; the app raises and catches this same ConfigError (pjinfer.config
re-exports it), so the command line and the server report a kernel's refusal in one line like any other bad input.
"""


class ConfigError(ValueError):
    """A model, setting or input that pjinfer cannot run; the message is one line for the user."""


# The matrix inputs a calibrated threshold gates, per layer (pjinfer.offline.teal fits them, cpu_offload.sparse_decode
# applies them): q/k/v's input, o's input, gate/up's input, down's input.
THRESHOLD_INPUTS = ("attn_in", "o_in", "ffn_in", "down_in")

# How a predictor bundle's cold rows are stored in host memory (cpu_offload.bridge).
COLD_WEIGHTS = ("float32", "int8")

# How a jitted step reaches the host kernels (cpu_offload.host_call): XLA FFI targets called directly (JAX on the
# CPU), or the same targets through jax.pure_callback (any platform).
BRIDGES = ("ffi", "callback")
