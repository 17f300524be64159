"""One dataclass that describes a decoder-only transformer, whatever checkpoint it came from."""
from __future__ import annotations

import dataclasses

ARCHITECTURES = ("llama", "opt")
# Gated FFNs compute act(gate) * up (drelu: relu(gate) * relu(up)); "relu" is OPT's plain fc1 + ReLU.
ACTIVATIONS = {"llama": ("swiglu", "geglu", "reglu", "drelu"), "opt": ("relu",)}
# How a dense engine holds its weights: float32 through XLA, or quantized with one-token steps on the host
# (cpu_offload/host_decode.py): int8 with a scale per 64, the GGUF's 4-bit Q4_1 blocks (head int8), or "gguf":
# every matrix in the file's own llama.cpp block type (Q8_0, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q4_1).
WEIGHT_FORMATS = ("float32", "int8", "q4_1", "gguf")
# What users choose from: a format, or "auto", the checkpoint's own quantization where the host decode runs it
# (q4_1 for a Llama GGUF whose layers are Q4_1, gguf when they are other block types with host kernels), float32
# otherwise (pjinfer.engine.resolve_weights).
WEIGHT_CHOICES = ("auto", *WEIGHT_FORMATS)


class ConfigError(ValueError):
    """A model or setting that pjinfer cannot run; the message is one line for the user."""


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

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
