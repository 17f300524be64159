"""What a PowerInfer GGUF carries beside its model: per-layer activation predictors and the neuron placement.

The layout, as SJTU-IPADS/PowerInfer writes and reads it (convert.py, convert-hf-to-powerinfer-gguf.py,
powerinfer-py/powerinfer/export_split.py; llama.cpp's llm_load_sparse_model_tensors, llm_build_ffn_sparse,
llama_gpu_split_loader; ggml.c's sparse mul_mat):

- the predictor of layer N is blk.N.fc1.weight [rank, d_model] and blk.N.fc2.weight [d_ff, rank] (numpy order; F16
  or F32, no biases). Neuron i is predicted active when score_i >= t, score = fc2 relu(fc1 h), where h is the
  layer's residual stream before the FFN's RMSNorm (llama.cpp passes `ffn_inp`) and t the file's
  `powerinfer.sparse_threshold` (0 when absent);
- the placement of layer N is blk.N.gpu_idx, int32 [d_ff], 1 for a neuron held on the GPU, and blk.N.gpu_bucket,
  int32, the sorted indices of those neurons. PowerInfer writes them into a separate GGUF beside the model,
  FILE.generated.gpuidx (architecture "generic.gpu_index", both tensors for every layer, `split.vram_capacity`);
  the same tensors inside the model file are read as well.

Every check here reads headers and memory-mapped tensors only; nothing loads the model's weights.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import gguf
import numpy as np

from cpu_offload.qtensor import aligned
from pjinfer.config import ConfigError, ModelConfig
from pjinfer.load.gguf_checks import float_field
from pjinfer.load.loader import PLACEMENT_TENSORS, PREDICTOR_TENSORS, default_model_path, open_gguf

SPARSE_THRESHOLD = "powerinfer.sparse_threshold"
GPU_INDEX_SUFFIX = ".generated.gpuidx"      # where PowerInfer caches the placement it solved for a model file
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


@dataclasses.dataclass(frozen=True)
class Predictors:
    """PowerInfer's predictors as stored: fc1[l] [rank_l, d_model], fc2[l] [d_ff, rank_l], float16 or float32 arrays
    (the file's own, other types decoded to float32); a neuron is active when its score is >= threshold (a float32;
    a subnormal one reads as 0, as XLA on the CPU flushes it)."""
    fc1: list
    fc2: list
    threshold: float

    @property
    def ranks(self) -> list[int]:
        return [int(w.shape[0]) for w in self.fc1]


def _by_layer(reader, names: tuple) -> dict:
    """{(layer, name): Tensor} of the per-layer tensors called one of `names`."""
    out = {}
    for t in reader.tensors:
        m = _LAYER_TENSOR.fullmatch(t.name)
        if m and m.group(2) in names:
            out[int(m.group(1)), m.group(2)] = t
    return out


def _stored(reader, t, path: Path) -> np.ndarray:
    """Tensor t's values: an F16 or F32 one as stored, in place where XLA takes it without a copy (else an aligned
    copy, and the file's pages of it released); another type decoded to float32."""
    if t.type in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32):
        a = aligned(t.data)
    else:
        try:
            a = np.asarray(gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.type)), np.float32)
        except Exception as e:
            raise ConfigError(f"cannot decode tensor {t.name} in {path.name}: {e}") from None
    if not np.may_share_memory(a, t.data):
        reader.release(t)
    return a


def _layers(found: dict, what: str, config: ModelConfig, path: Path) -> None:
    """Every layer 0..n_layers-1 has its tensors and no other layer does."""
    layers = sorted({l for l, _ in found})
    if layers != list(range(config.n_layers)):
        raise ConfigError(f"{path.name}: {what} cover layers {_span(layers)}; the model has {config.n_layers} "
                          f"layers (0-{config.n_layers - 1})")


def _span(layers: list[int]) -> str:
    return "none" if not layers else f"{layers[0]}-{layers[-1]} ({len(layers)})"


def predictor_state(fc1: np.ndarray, fc2: np.ndarray, threshold: float) -> dict:
    """One PowerInfer predictor (fc1 [rank, d], fc2 [d_ff, rank]) as a train.predictor.Predictor's pure state."""
    cutoff = np.nextafter(np.float32(threshold), np.float32(-np.inf))
    if abs(cutoff) < np.finfo(np.float32).tiny:   # subnormal, which XLA on the CPU flushes to zero
        cutoff = np.float32(-np.finfo(np.float32).tiny if threshold <= 0 else 0.0)
    return {"down": {"kernel": np.ascontiguousarray(fc1.T, np.float32)},
            "up": {"kernel": np.ascontiguousarray(fc2.T, np.float32), "bias": np.zeros(fc2.shape[0], np.float32)},
            "threshold": np.asarray(cutoff, np.float32)}


def read_predictors(reader, config: ModelConfig, path: Path) -> Predictors:
    """The file's predictors, checked against the model: one fc1 and one fc2 per layer, shapes that chain
    d_model -> rank -> d_ff. A file without them, or with any mismatch, is refused in one line."""
    found = _by_layer(reader, PREDICTOR_TENSORS)
    if not found:
        raise ConfigError(f"{path.name} has no PowerInfer predictor tensors (blk.N.fc1.weight, blk.N.fc2.weight)")
    _layers(found, "its predictors", config, path)
    fc1, fc2 = [], []
    for l in range(config.n_layers):
        for name in PREDICTOR_TENSORS:
            if (l, name) not in found:
                raise ConfigError(f"{path.name}: layer {l} has no predictor tensor blk.{l}.{name}")
        a, b = found[l, "fc1.weight"], found[l, "fc2.weight"]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != config.d_model or b.shape[0] != config.d_ff \
                or b.shape[1] != a.shape[0]:
            raise ConfigError(f"{path.name}: layer {l}'s predictor is fc1 {list(a.shape)}, fc2 {list(b.shape)}; "
                              f"the model needs fc1 [rank, {config.d_model}] and fc2 [{config.d_ff}, rank]")
        fc1.append(_stored(reader, a, path))
        fc2.append(_stored(reader, b, path))
    threshold = np.float32(float_field(reader, SPARSE_THRESHOLD, path, 0.0))
    if abs(threshold) < np.finfo(np.float32).tiny:
        threshold = np.float32(0.0)
    return Predictors(fc1, fc2, float(threshold))


def read_placement(reader, config: ModelConfig, path: Path) -> np.ndarray | None:
    """The neuron placement bool [n_layers, d_ff] (True: hot, on the accelerator) from the gpu_idx tensors of
    `reader` (the model file or its GPU index), or None when it has none. gpu_bucket, where present, must list
    exactly the hot neurons in order."""
    found = _by_layer(reader, PLACEMENT_TENSORS)
    if not found:
        return None
    _layers(found, "its gpu_idx / gpu_bucket tensors", config, path)
    hot = np.zeros((config.n_layers, config.d_ff), bool)
    for l in range(config.n_layers):
        t = found.get((l, "gpu_idx"))
        if t is None:
            raise ConfigError(f"{path.name}: layer {l} has no blk.{l}.gpu_idx")
        idx = np.asarray(t.data)
        if idx.dtype != np.int32 or idx.shape != (config.d_ff,) or not np.isin(idx, (0, 1)).all():
            raise ConfigError(f"{path.name}: blk.{l}.gpu_idx must be int32 [{config.d_ff}] of 0 and 1, got "
                              f"{idx.dtype} {list(idx.shape)}")
        hot[l] = idx == 1
        bucket = found.get((l, "gpu_bucket"))
        if bucket is not None and not np.array_equal(np.asarray(bucket.data), np.flatnonzero(hot[l])):
            raise ConfigError(f"{path.name}: blk.{l}.gpu_bucket does not list the neurons blk.{l}.gpu_idx marks")
    return hot


def gpu_index_path(model: Path, given: str | Path | None = None) -> Path | None:
    """The GPU index to read: the one given, else PowerInfer's cache beside the model file if it exists."""
    if given is not None:
        return Path(given)
    cached = Path(str(model) + GPU_INDEX_SUFFIX)
    return cached if cached.is_file() else None


def read_gpu_index(path: Path, config: ModelConfig) -> np.ndarray:
    """The placement in a PowerInfer GPU index file (FILE.generated.gpuidx)."""
    hot = read_placement(open_gguf(path, "GPU index"), config, path)
    if hot is None:
        raise ConfigError(f"{path.name} has no gpu_idx tensors: not a PowerInfer GPU index")
    return hot


def file_placement(model: Path, config: ModelConfig) -> np.ndarray:
    """A PowerInfer file's placement, bool [n_layers, d_ff], as `import-powerinfer` finds it without --gpu-index: the
    GPU index PowerInfer caches beside the file (solved for this machine's GPU), else the file's own gpu_idx
    tensors; ConfigError in one line when there is neither."""
    index = gpu_index_path(model)
    if index is not None:
        return read_gpu_index(index, config)
    hot = read_placement(open_gguf(model), config, model)
    if hot is None:
        raise ConfigError(f"{model.name} has no neuron placement (gpu_idx tensors, or PowerInfer's GPU index "
                          f"{Path(str(model) + GPU_INDEX_SUFFIX).name} beside it) for its hot neurons")
    return hot


def file_layout(path) -> tuple[bool, bool]:
    """(whether the GGUF at `path` stores PowerInfer's neuron rows, ffn_down_t; whether it holds predictor tensors)
    from its header; (False, False) for any other file, an HF directory, or a file the loader will refuse."""
    path = Path(path) if path else default_model_path()
    if not path.is_file():
        return False, False
    try:
        reader = open_gguf(path)
    except ConfigError:
        return False, False
    names = {m.group(2) for t in reader.tensors if (m := _LAYER_TENSOR.fullmatch(t.name))}
    return "ffn_down_t.weight" in names, "fc1.weight" in names
