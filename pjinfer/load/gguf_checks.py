"""Checks of a GGUF's metadata and tensor table against what the loader reads, made before any weight or the
tokenizer is built: typed metadata fields, the tokenizer's fields, and every tensor the model reads with the shape
the metadata implies. Each failure is a ConfigError of one line naming the field or tensor."""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from pjinfer.config import ConfigError, ModelConfig

REQUIRED = object()


def int_field(reader, key: str, path: Path, default=REQUIRED) -> int | None:
    """Metadata `key` as an int: absent gives `default` (refused when there is none), any other type is refused."""
    value = reader.fields.get(key, default)
    if value is REQUIRED:
        raise ConfigError(f"{path.name} lacks the metadata {key}")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{path.name}: metadata {key} must be an integer, got {shown(value)}")
    return value


def float_field(reader, key: str, path: Path, default=REQUIRED) -> float:
    """Metadata `key` as a finite float (an int is taken too); absent gives `default`, else refused."""
    value = reader.fields.get(key, default)
    if value is REQUIRED:
        raise ConfigError(f"{path.name} lacks the metadata {key}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{path.name}: metadata {key} must be a finite number, got {shown(value)}")
    return float(value)


def shown(value) -> str:
    """A metadata value in an error message, cut short."""
    if isinstance(value, (list, np.ndarray)):
        return f"an array of {len(value)}"
    return repr(value)[:60]


def check_tokenizer_fields(reader, path: Path) -> None:
    """The tokenizer metadata has the types the tokenizer reads: strings where a string goes, one token type per
    token, and merges "a b" of two tokens whose concatenation is a token too (the BPE builder aborts the process
    on a merge that yields no token)."""
    fields = reader.fields
    tokens = fields["tokenizer.ggml.tokens"]   # an array of strings: _gguf_config checked it
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        if key in fields and not isinstance(fields[key], str):
            raise ConfigError(f"{path.name}: metadata {key} must be a string, got {shown(fields[key])}")
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix"):
        if key in fields and not isinstance(fields[key], bool):
            raise ConfigError(f"{path.name}: metadata {key} must be a bool, got {shown(fields[key])}")
    if fields.get("tokenizer.ggml.model") == "gpt2":   # byte-level BPE reads both
        for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
            if key not in fields:
                raise ConfigError(f"{path.name} lacks the metadata {key} (its tokenizer is gpt2 byte-level BPE)")
    types = fields.get("tokenizer.ggml.token_type")
    if types is not None and not _integers(types, len(tokens)):
        raise ConfigError(f"{path.name}: metadata tokenizer.ggml.token_type must be {len(tokens)} integers, one per "
                          f"token, got {shown(types)}")
    scores = fields.get("tokenizer.ggml.scores")   # SentencePiece merges by them (pjinfer.load.spm)
    if scores is not None and not _numbers(scores, len(tokens)):
        raise ConfigError(f"{path.name}: metadata tokenizer.ggml.scores must be {len(tokens)} finite numbers, one per "
                          f"token, got {shown(scores)}")
    merges = fields.get("tokenizer.ggml.merges")
    if merges is None:
        return
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise ConfigError(f"{path.name}: metadata tokenizer.ggml.merges must be an array of strings, got {shown(merges)}")
    vocab = set(tokens)
    for n, merge in enumerate(merges):
        a, space, b = merge.partition(" ")
        if not space or a not in vocab or b not in vocab or a + b not in vocab:
            raise ConfigError(f"{path.name}: tokenizer merge {n} ({merge[:40]!r}) is not two tokens whose "
                              "concatenation is a token")


def _integers(value, n: int) -> bool:
    """Whether a metadata value is an array of n integers (a list when short, a numpy array when long)."""
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "iu" and value.shape == (n,)
    return isinstance(value, list) and len(value) == n and all(type(v) is int for v in value)


def _numbers(value, n: int) -> bool:
    """Whether a metadata value is an array of n finite numbers."""
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "iuf" and value.shape == (n,) and bool(np.isfinite(value).all())
    return (isinstance(value, list) and len(value) == n
            and all(type(v) in (int, float) and np.isfinite(v) for v in value))


LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


def _shapes(config: ModelConfig, arch: str) -> tuple[dict, set]:
    """({GGUF tensor name: numpy shape} of every tensor the model reads, names of those that may be absent).
    Layer N's down matrix is ffn_down [d, d_ff] or PowerInfer's ffn_down_t [d_ff, d]; both are listed and
    check_tensors requires exactly one."""
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    shapes = {"token_embd.weight": (v, d), "output_norm.weight": (d,), "output.weight": (v, d)}
    optional = {"output.weight"}
    layer = {"attn_norm.weight": (d,), "ffn_norm.weight": (d,), "attn_q.weight": (q, d), "attn_k.weight": (kv, d),
             "attn_v.weight": (kv, d), "attn_output.weight": (d, q), "ffn_gate.weight": (f, d),
             "ffn_up.weight": (f, d), "ffn_down.weight": (d, f), "ffn_down_t.weight": (f, d)}
    layer_optional = {"ffn_down.weight", "ffn_down_t.weight"}
    if arch == "qwen2":   # q/k/v biases: checked where present
        layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
        layer_optional |= {"attn_q.bias", "attn_k.bias", "attn_v.bias"}
    for i in range(config.n_layers):
        shapes |= {f"blk.{i}.{k}": shape for k, shape in layer.items()}
        optional |= {f"blk.{i}.{k}" for k in layer_optional}
    return shapes, optional


def check_tensors(reader, config: ModelConfig, arch: str, path: Path, *, beside: tuple = ()) -> None:
    """Before any weight is read: every tensor the model reads is present with the shape the metadata implies,
    each layer has one down matrix, and no blk.N tensor lies outside the model's layers or is unknown (but for
    the per-layer names in `beside`, which others read)."""
    if config.n_layers > len(reader.tensors):
        raise ConfigError(f"{path.name}: {arch}.block_count is {config.n_layers}, but the file holds only "
                          f"{len(reader.tensors)} tensors")
    shapes, optional = _shapes(config, arch)
    found = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        m = LAYER_TENSOR.fullmatch(t.name)
        if t.name.startswith("blk.") and not (m and m.group(2) in beside):
            if t.name not in shapes:
                raise ConfigError(f"unexpected tensor {t.name} in {path.name} (the model has {config.n_layers} "
                                  "layers)")
    for name, shape in shapes.items():
        t = found.get(name)
        if t is None:
            if name not in optional:
                raise ConfigError(f"{path.name} lacks tensor {name}")
        elif tuple(t.shape) != shape:
            raise ConfigError(f"{path.name}: tensor {name} is {list(t.shape)}; the metadata implies {list(shape)}")
    for i in range(config.n_layers):
        downs = [n for n in (f"blk.{i}.ffn_down.weight", f"blk.{i}.ffn_down_t.weight") if n in found]
        if len(downs) != 1:
            raise ConfigError(f"{path.name}: layer {i} needs one of ffn_down.weight and ffn_down_t.weight, "
                              f"has {len(downs)}")
