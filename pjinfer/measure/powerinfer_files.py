"""Random ReLU-Llama files in PowerInfer's layout, for `make bench-powerinfer`: speed at a chosen density.

A file holds what PowerInfer's converters write for a ReluLLaMA model (magic PWRI, pjinfer.load.powerinfer):
- every matrix Q4_0 (the embedding, an untied `output.weight`, q, k, v, o, ffn_gate, ffn_up and
  `ffn_down_t` [d_ff, d], PowerInfer's transposed down), norms float32 ones;
- per layer an F16 predictor, fc1 [rank, d] and fc2 [d_ff, rank], rank d/4 (RANK_DIVISOR);
- `powerinfer.sparse_threshold`, calibrated so that about `density` of the neurons are predicted active;
- a Llama SentencePiece vocabulary (32000 tokens) copied from a vocabulary GGUF (llama_vocab_path).

The predicted set of a layer is {i : fc2_i relu(fc1 r) >= t}, r the residual stream before the FFN's norm. A score
is homogeneous in r (relu(a r) = a relu(r) for a > 0), so a threshold near 0 gives the same density whatever the
residual stream's norm, which random weights make grow layer by layer. So fc2's entries carry a negative offset,
chosen so that a share `density` of the scores is >= 0 when fc1 r is Gaussian (the half-normal's moments); then t
is calibrated as the (1 - density) quantile of the scores of CALIBRATION_VECTORS random residual vectors over every
layer, which lands near 0. Random weights measure speed at a density, never quality: the text is noise.

Writing streams: tensor infos first, then each tensor made from its own seed and written, so a file never needs
more than one matrix in memory (the predictors are made twice: once to calibrate, once to write).

    path = cached_file("out/powerinfer", "0.5b")    # written once per geometry, seed and density
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from pjinfer.config import ConfigError
from pjinfer.measure.bench_scale import SIZES

RANK_DIVISOR = 4          # the predictor's rank is d / 4, as PowerInfer's ReluLLaMA predictors are about
DENSITY = 0.10            # the share of neurons predicted active the files are calibrated for
CALIBRATION_VECTORS = 64  # random residual vectors per layer the threshold is calibrated on
Q4_0, F16, F32 = 2, 1, 0  # gguf's type numbers
HALF_NORMAL_MEAN, HALF_NORMAL_MEAN_SQUARE = 1 / np.sqrt(2 * np.pi), 0.5   # of relu(g), g ~ N(0, 1)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A file's shapes: d_model, layers, heads, kv heads, d_ff (head_dim d / heads), the predictor's rank."""
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int

    @property
    def rank(self) -> int:
        return self.d_model // RANK_DIVISOR

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def named(cls, size: str) -> "Geometry":
        """bench_scale's sizes (0.5b, 1.5b, 3b, 7b): the same shapes as `make bench-scale`'s files."""
        if size not in SIZES:
            raise ConfigError(f"unknown size {size!r} (known: {', '.join(SIZES)})")
        return cls(*SIZES[size])


def llama_vocab_path() -> Path:
    """Llama's SentencePiece vocabulary: PowerInfer's own models/ggml-vocab-llama.gguf in the peer build
    (`make peers`), else llama.cpp's ggml-vocab-llama-spm.gguf that `make setup` extracts."""
    from pjinfer.measure.native_peer import peers_dir

    root = Path(__file__).resolve().parents[2]
    for path in (peers_dir() / "PowerInfer" / "models" / "ggml-vocab-llama.gguf",
                 root / ".venv" / "share" / "llama-vocab" / "ggml-vocab-llama-spm.gguf"):
        if path.is_file():
            return path
    raise ConfigError("no Llama vocabulary GGUF found: run `make peers` (PowerInfer's models/ggml-vocab-llama.gguf) "
                      "or `make setup` (.venv/share/llama-vocab/ggml-vocab-llama-spm.gguf)")


def cached_file(folder, size: str, *, seed: int = 0, density: float = DENSITY, vocab=None) -> Path:
    """The file of this size, seed and density in folder, written there first if it is not."""
    path = Path(folder) / f"random-relu-llama-{size}-q4_0-seed{seed}-density{density:g}.powerinfer.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, Geometry.named(size), vocab=vocab or llama_vocab_path(), seed=seed, density=density)
    return path


# --- the tensors ----------------------------------------------------------------------------------------------------

def _random_block_rows(rng, rows: int, cols: int) -> np.ndarray:
    """Random Q4_0 rows, uint8 [rows, cols / 32 * 18]: nibbles uniform, scales about 0.2 / sqrt(cols), so a row's
    product with a vector of unit entries is of order one."""
    nb = cols // 32
    out = np.empty((rows, nb, 18), np.uint8)
    d = (rng.uniform(0.5, 1.5, (rows, nb)) * 0.2 / np.sqrt(cols)).astype(np.float16)
    out[..., 0:2] = d.view(np.uint8).reshape(rows, nb, 2)
    out[..., 2:] = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
    return out.reshape(rows, nb * 18)


def predictor(g: Geometry, layer: int, seed: int, density: float) -> tuple[np.ndarray, np.ndarray]:
    """Layer's fc1 [rank, d] and fc2 [d_ff, rank], float16. fc1 ~ N(0, 1/d); fc2 ~ N(0, 1/rank) plus the offset m
    that puts a share `density` of the scores at or above 0: a score is m S1 + N(0, S2 / rank), S1 and S2 the sum
    and the sum of squares of z = relu(fc1 r), so m = -Phi^-1(1 - density) sqrt(S2 / rank) / S1 at their means."""
    from statistics import NormalDist

    rng = np.random.default_rng([seed, 1, layer])
    fc1 = (rng.standard_normal((g.rank, g.d_model), np.float32) / np.sqrt(g.d_model)).astype(np.float16)
    z_score = NormalDist().inv_cdf(1 - density)
    offset = -z_score * np.sqrt(HALF_NORMAL_MEAN_SQUARE / g.rank) / (HALF_NORMAL_MEAN * np.sqrt(g.rank))
    fc2 = (rng.standard_normal((g.d_ff, g.rank), np.float32) / np.sqrt(g.rank) + offset).astype(np.float16)
    return fc1, fc2


def scores(fc1: np.ndarray, fc2: np.ndarray, residuals: np.ndarray) -> np.ndarray:
    """The predictor's scores [n, d_ff] of residual vectors [n, d]: fc2 relu(fc1 r), in float32."""
    z = np.maximum(residuals @ fc1.astype(np.float32).T, 0)
    return z @ fc2.astype(np.float32).T


def calibrate(g: Geometry, seed: int, density: float) -> float:
    """The threshold that CALIBRATION_VECTORS random residual vectors per layer (N(0, 1) entries) clear with a share
    `density` of all their scores (every layer together: a file has one threshold)."""
    rng = np.random.default_rng([seed, 2])
    every = [scores(*predictor(g, l, seed, density), rng.standard_normal((CALIBRATION_VECTORS, g.d_model),
                                                                          np.float32)).ravel()
             for l in range(g.n_layers)]
    return float(np.quantile(np.concatenate(every), 1 - density))


def _specs(g: Geometry, vocab_size: int) -> list[tuple[str, tuple, int]]:
    """(name, shape as numpy holds it, gguf type) of every tensor, in the file's order."""
    d, hd = g.d_model, g.head_dim
    specs = [("token_embd.weight", (vocab_size, d), Q4_0), ("output_norm.weight", (d,), F32),
             ("output.weight", (vocab_size, d), Q4_0)]
    for l in range(g.n_layers):
        p = f"blk.{l}."
        specs += [(p + "attn_norm.weight", (d,), F32), (p + "attn_q.weight", (g.n_heads * hd, d), Q4_0),
                  (p + "attn_k.weight", (g.n_kv_heads * hd, d), Q4_0),
                  (p + "attn_v.weight", (g.n_kv_heads * hd, d), Q4_0),
                  (p + "attn_output.weight", (d, g.n_heads * hd), Q4_0), (p + "ffn_norm.weight", (d,), F32),
                  (p + "ffn_gate.weight", (g.d_ff, d), Q4_0), (p + "ffn_up.weight", (g.d_ff, d), Q4_0),
                  (p + "ffn_down_t.weight", (g.d_ff, d), Q4_0),
                  (p + "fc1.weight", (g.rank, d), F16), (p + "fc2.weight", (g.d_ff, g.rank), F16)]
    return specs


def _tensor(g: Geometry, index: int, name: str, shape: tuple, kind: int, seed: int, density: float) -> np.ndarray:
    if kind == F32:
        return np.ones(shape, np.float32)
    if kind == F16:
        fc1, fc2 = predictor(g, int(name.split(".")[1]), seed, density)
        return fc1 if name.endswith("fc1.weight") else fc2
    return _random_block_rows(np.random.default_rng([seed, 0, index]), *shape)


def _nbytes(shape: tuple, kind: int) -> tuple[tuple, np.dtype, int]:
    """(the shape the writer is given, its dtype, bytes) of a tensor: Q4_0 as uint8 rows of blocks."""
    if kind == Q4_0:
        raw = (shape[0], shape[1] // 32 * 18)
        return raw, np.dtype(np.uint8), raw[0] * raw[1]
    dtype = np.dtype(np.float16 if kind == F16 else np.float32)
    return shape, dtype, int(np.prod(shape)) * dtype.itemsize


def write_file(path, g: Geometry, *, vocab, seed: int = 0, density: float = DENSITY) -> float:
    """Write the random PowerInfer file of geometry g to path (through path.part, renamed when complete), its
    vocabulary the tokenizer fields of the GGUF at vocab. Returns the calibrated threshold."""
    import gguf

    from pjinfer.load.gguf_file import GGUFFile

    if not 0 < density < 1:
        raise ConfigError(f"density must be in (0, 1), got {density}")
    if g.d_model % 32 or g.d_ff % 32 or g.d_model % g.n_heads or g.n_heads % g.n_kv_heads:
        raise ConfigError(f"geometry {g} does not make Q4_0 rows or whole heads")
    src = GGUFFile(Path(vocab)).fields
    if src.get("tokenizer.ggml.model") != "llama":
        raise ConfigError(f"{vocab} holds no SentencePiece (llama) vocabulary")
    tokens = src["tokenizer.ggml.tokens"]
    threshold = calibrate(g, seed, density)
    path = Path(path)
    part = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(str(part), "llama")
    w.add_name(f"random-relu-llama-d{g.d_model}-l{g.n_layers}")
    w.add_block_count(g.n_layers)
    w.add_context_length(4096)
    w.add_embedding_length(g.d_model)
    w.add_feed_forward_length(g.d_ff)
    w.add_head_count(g.n_heads)
    w.add_head_count_kv(g.n_kv_heads)
    w.add_rope_dimension_count(g.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_float32("powerinfer.sparse_threshold", threshold)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(np.asarray(src["tokenizer.ggml.scores"], np.float32).tolist())
    w.add_token_types(np.asarray(src["tokenizer.ggml.token_type"]).tolist())
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("unknown_token_id", w.add_unk_token_id)):
        if f"tokenizer.ggml.{key}" in src:
            add(int(src[f"tokenizer.ggml.{key}"]))
    specs = _specs(g, len(tokens))
    for name, shape, kind in specs:
        raw, dtype, nbytes = _nbytes(shape, kind)
        w.add_tensor_info(name, raw, dtype, nbytes, raw_dtype=gguf.GGMLQuantizationType(kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for index, (name, shape, kind) in enumerate(specs):
        w.write_tensor_data(_tensor(g, index, name, shape, kind, seed, density))
    w.close()
    with open(part, "r+b") as f:
        f.write(b"PWRI")   # PowerInfer's magic: its runtime takes the sparse path for such a file
    os.replace(part, path)
    return threshold
