"""One dataclass that describes a decoder-only transformer, whatever checkpoint it came from, and the settings'
choices. A bottom-level module: every layer of the app may import it. The error class, the threshold inputs and the
cold rows' formats are cpu_offload.contract's, re-exported here: the kernels raise and read the same ones."""
from __future__ import annotations

import dataclasses

from cpu_offload.contract import BRIDGES, COLD_WEIGHTS, THRESHOLD_INPUTS, ConfigError  # noqa: F401  (shared with the kernels)

ARCHITECTURES = ("llama", "opt")
# Gated FFNs compute act(gate) * up (drelu: relu(gate) * relu(up)); "relu" is OPT's plain fc1 + ReLU.
ACTIVATIONS = {"llama": ("swiglu", "geglu", "reglu", "drelu"), "opt": ("relu",)}
# How a dense engine holds its weights: float32 through XLA, or quantized with one-token steps on the host
# (cpu_offload/host_decode.py): int8 with a scale per 64, the GGUF's 4-bit Q4_1 blocks (head int8), or "gguf":
# every matrix in the file's own llama.cpp block type (Q8_0, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q4_1).
WEIGHT_FORMATS = ("float32", "int8", "q4_1", "gguf")
# What users choose from: a format, or "auto", the checkpoint's own quantization where the host decode runs it
# (q4_1 for a Llama GGUF whose layers are Q4_1, gguf when they are other block types with host kernels), float32
# otherwise (pjinfer.runtime.backends.resolve).
WEIGHT_CHOICES = ("auto", *WEIGHT_FORMATS)


# A predictor bundle's engine (pjinfer.runtime.sparse): where hot neurons run; its cold rows' formats are COLD_WEIGHTS
# (cpu_offload.contract). With a bundle's thresholds on float32 weights the same choice says where one-token products
# run: xla (dense masked products) or the Pallas gather kernels (pjinfer.runtime.gathered).
HOT_BACKENDS = ("xla", "pallas", "pallas-interpret")
# What users choose from: a backend, or "auto": "pallas" for a PowerInfer file's own predictors where JAX runs on a
# GPU (the host decode that runs them elsewhere is not there), "xla" otherwise (pjinfer.runtime.backends.resolve).
HOT_CHOICES = ("auto", *HOT_BACKENDS)
# Which of a bundle's rules runs (pjinfer.runtime.backends.bundle_rule): auto (its thresholds when it has them, else
# its predictors and placement), or one of the two by name.
SPARSE_RULES = ("auto", "thresholds", "predictors")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    activation: str
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"unsupported architecture {self.arch!r} (supported: {', '.join(ARCHITECTURES)})")
        if self.activation not in ACTIVATIONS[self.arch]:
            raise ConfigError(
                f"unsupported activation {self.activation!r} for {self.arch} "
                f"(supported: {', '.join(ACTIVATIONS[self.arch])})")
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_seq_len"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"model config: {field} must be positive, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model config: {self.n_heads} heads do not group evenly over {self.n_kv_heads} KV heads")

    @property
    def gated(self) -> bool:
        return self.arch == "llama"

    @property
    def uses_rope(self) -> bool:
        return self.arch == "llama"

    @property
    def n_params(self) -> int:
        """Weights the model stands for (a quantized matrix counts rows x cols): embeddings, every layer's
        matrices, biases and norms, the final norm, and the head when it is not tied."""
        d, q, kv = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        opt = self.arch == "opt"
        layer = 2 * d * q + 2 * d * kv + (3 if self.gated else 2) * d * self.d_ff + (4 if opt else 2) * d
        if opt:
            layer += q + 2 * kv + d + self.d_ff + d
        top = self.vocab_size * d * (1 if self.tie_embeddings else 2) + (2 if opt else 1) * d
        return self.n_layers * layer + top + (self.max_seq_len * d if opt else 0)

    def kv_cache_bytes(self, tokens: int, itemsize: int) -> int:
        """Bytes of keys and values for `tokens` positions in every layer, itemsize bytes a value."""
        return 2 * self.n_layers * tokens * self.n_kv_heads * self.head_dim * itemsize

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
