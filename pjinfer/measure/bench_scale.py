"""`make bench-scale`: memory and speed of `--weights WEIGHTS` on random Llama GGUFs of growing size, against llama.cpp.

WEIGHTS is the default model's host decode format (pjinfer.load.loader.DEFAULT_MODEL_WEIGHTS). For each size it
writes a GGUF (gguf's writer) with random layers in that format's block type (Q4_1), a random Q8_0 tied embedding
and the default model's tokenizer, then measures in one run, each in its own process:
- pjinfer: peak RSS (`/usr/bin/time -f %M`) and load time of `pjinfer generate --weights WEIGHTS --max-new-tokens 32`;
- llama.cpp (llama-cpp-python): peak RSS and load time of the same generation;
- both: prefill of 512 tokens and decode of 128 (`pjinfer bench --peer llama-cpp --prompt-len 512
  --new-tokens 128`, alternated run by run).
Random weights measure memory and speed only, never quality: the text they generate is noise.

    python -m pjinfer.measure.bench_scale [--sizes 0.5b,1.5b,3b] [--dir out/scale] [--runs 2]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np

from cpu_offload.blocks import FORMATS, Q8_0, TYPES
from cpu_offload.team import usable_cores
from pjinfer.config import ModelConfig
from pjinfer.load.gguf_file import GGUFFile
from pjinfer.load.loader import DEFAULT_MODEL_WEIGHTS, default_model_path
from pjinfer.measure.bench import engine_name

WEIGHTS = DEFAULT_MODEL_WEIGHTS
LAYERS = FORMATS[WEIGHTS].made   # the block type of the files' layers, which WEIGHTS keeps as stored

# name -> (d_model, layers, heads, kv heads, d_ff); head_dim 64 except 7b (128). Parameters include the embedding.
SIZES = {
    "0.5b": (1536, 20, 24, 4, 4096),
    "1.5b": (2048, 24, 32, 8, 7168),
    "3b": (3072, 28, 48, 8, 8192),
    "7b": (4096, 32, 32, 8, 11008),
}


def size_config(size: str, vocab: int = 49152) -> ModelConfig:
    """The model a size's file holds (tied embeddings, SwiGLU, context 4096)."""
    d, layers, heads, kv, ff = SIZES[size]
    return ModelConfig(arch="llama", vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                       head_dim=d // heads, d_ff=ff, activation="swiglu", max_seq_len=4096)


def _centred_scales(rng, rows: int, cols: int, code: int) -> np.ndarray:
    """Random (d, m) of 4-bit blocks with a stored offset (w = d q + m) of GGUF type `code`, float16
    [rows, blocks, 2]: d about 0.02/sqrt(cols/1024), m = -8 d (with uniform nibbles, values centred on 0)."""
    d = (rng.uniform(0.5, 1.5, (rows, cols // TYPES[code].block)) * 0.02 * np.sqrt(1024 / cols)).astype(np.float16)
    return np.stack([d, (-8 * d.astype(np.float32)).astype(np.float16)], axis=-1)


def _random_rows(rng, code: int, scales: np.ndarray) -> np.ndarray:
    """Rows of blocks of GGUF type `code` (cpu_offload.blocks' table): each block's float16 numbers first (scales
    [rows, blocks, k]: d, or d and m), then uniformly random bytes (its quants)."""
    rows, blocks, k = scales.shape
    out = np.empty((rows, blocks, TYPES[code].nbytes), np.uint8)
    out[..., :2 * k] = scales.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2 * k)
    out[..., 2 * k:] = rng.integers(0, 256, (rows, blocks, out.shape[-1] - 2 * k), dtype=np.uint8)
    return out.reshape(rows, -1)


def write_model(path: Path, size: str, seed: int = 0) -> None:
    """A random Llama GGUF of this size, LAYERS layers, tokenizer and chat template from the default model."""
    src = GGUFFile(default_model_path()).fields
    d, layers, heads, kv, ff = SIZES[size]
    hd = d // heads
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"random-llama-{size}")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    tokens = src["tokenizer.ggml.tokens"]
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(src["tokenizer.ggml.model"])
    w.add_tokenizer_pre(src["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_merges(src["tokenizer.ggml.merges"])
    w.add_token_types(np.asarray(src["tokenizer.ggml.token_type"]).tolist())
    w.add_eos_token_id(int(src["tokenizer.ggml.eos_token_id"]))
    w.add_bos_token_id(int(src["tokenizer.ggml.bos_token_id"]))
    w.add_add_bos_token(False)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)

    def add(name, code, scales):
        data = _random_rows(rng, code, scales)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType(code))

    add("token_embd.weight", Q8_0, np.full((len(tokens), d // TYPES[Q8_0].block, 1), 0.0005, np.float16))
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(d, np.float32))
        for name, rows, cols in (("attn_q", heads * hd, d), ("attn_k", kv * hd, d), ("attn_v", kv * hd, d),
                                 ("attn_output", d, heads * hd), ("ffn_gate", ff, d), ("ffn_up", ff, d),
                                 ("ffn_down", d, ff)):
            add(p + name + ".weight", LAYERS, _centred_scales(rng, rows, cols, LAYERS))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


LLAMA_CPP_GENERATE = r"""
import json, sys, time
t = time.perf_counter()
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]), verbose=False)
load = time.perf_counter() - t
tokens = llm.tokenize(b"The capital of France is", add_bos=False)
out = llm.generate(tokens, temp=0.0)
for _ in range(32):
    next(out)
print(json.dumps({"load_s": load}))
"""


def peak_rss(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """(the completed process, its peak RSS in GB, 1e9 bytes) of a command run under /usr/bin/time (whose %M is in
    KiB); a failure raises."""
    result = subprocess.run(["/usr/bin/time", "-f", "PEAK_KB %M", *cmd], capture_output=True, text=True,
                            stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed:\n{result.stderr[-3000:]}")
    return result, int(re.findall(r"PEAK_KB (\d+)", result.stderr)[-1]) * 1024 / 1e9


def _timed(cmd: list[str]) -> tuple[dict, float]:
    """(last JSON line of stdout, peak RSS in GB) of a command run under /usr/bin/time."""
    result, peak = peak_rss(cmd)
    return json.loads(result.stdout.strip().splitlines()[-1]), peak


def measure(path: Path, runs: int) -> dict:
    py = sys.executable
    threads = str(usable_cores())   # pjinfer's default thread count
    ours, ours_peak = _timed([py, "-m", "pjinfer.cli.main", "generate", "--model", str(path), "--weights", WEIGHTS,
                              "--prompt", "The capital of France is", "--max-new-tokens", "32", "--json"])
    peer, peer_peak = _timed([py, "-c", LLAMA_CPP_GENERATE, str(path), threads])
    bench, _ = _timed([py, "-m", "pjinfer.cli.main", "bench", "--model", str(path), "--weights", WEIGHTS, "--peer",
                       "llama-cpp", "--prompt-len", "512", "--new-tokens", "128", "--runs", str(runs), "--json"])
    return {"file_gb": path.stat().st_size / 1e9, "pjinfer_peak_gb": ours_peak, "pjinfer_load_s": ours["load_s"],
            "llama_cpp_peak_gb": peer_peak, "llama_cpp_load_s": peer["load_s"], "bench": bench}


def table(rows: list[dict]) -> str:
    """The README's table: memory and load, then bench's prefill and decode rates of both engines."""
    lines = ["| size | params | file GB | peak RSS GB: pjinfer / llama.cpp | load s: pjinfer / llama.cpp | "
             "prefill 512 tok/s: pjinfer / llama.cpp | decode 128 tok/s: pjinfer / llama.cpp |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ours, peer = r["bench"]["engines"][engine_name(WEIGHTS)], r["bench"]["engines"]["llama.cpp"]
        lines.append(
            f"| {r['size']} | {r['params_b']:.2f} B | {r['file_gb']:.2f} | {r['pjinfer_peak_gb']:.2f} / "
            f"{r['llama_cpp_peak_gb']:.2f} | {r['pjinfer_load_s']:.1f} / {r['llama_cpp_load_s']:.1f} | "
            f"{ours['prefill_tok_s']:.1f} / {peer['prefill_tok_s']:.1f} ({ours['prefill_over_peer']:.2f}x) | "
            f"{ours['decode_tok_s']:.1f} / {peer['decode_tok_s']:.1f} ({ours['decode_over_peer']:.2f}x) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pjinfer.measure.bench_scale", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="0.5b,1.5b,3b")
    p.add_argument("--dir", default="out/scale")
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args(argv)
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        print(f"unknown size {unknown[0]!r} (known: {', '.join(SIZES)})", file=sys.stderr)
        return 2
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in sizes:
        path = out / f"random-llama-{size}-{WEIGHTS}.gguf"
        if not path.exists():
            start = time.perf_counter()
            write_model(path, size)
            print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s",
                  file=sys.stderr)
        result = measure(path, args.runs)
        result["size"], result["params_b"] = size, size_config(size).n_params / 1e9
        print(json.dumps(result), flush=True)
        rows.append(result)
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
