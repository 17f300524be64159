"""Tiny files in PowerInfer's layout: predictors, placement tensors, the model file and its GPU index."""
import gguf
import numpy as np

from tests.support.gguf_files import write_tiny_gguf

RANK = 16


def powerinfer_predictors(config, seed=3):
    """fc1 [rank, d], fc2 [d_ff, rank] per layer, as float16 (PowerInfer's converters write 2-D weights in F16)."""
    rng = np.random.default_rng(seed)
    fc1 = [(rng.standard_normal((RANK, config.d_model)) / 8).astype(np.float16) for _ in range(config.n_layers)]
    fc2 = [(rng.standard_normal((config.d_ff, RANK)) / 4 - 0.05).astype(np.float16) for _ in range(config.n_layers)]
    return fc1, fc2


def placement_tensors(hot, *, bucket=True):
    out = {}
    for l, row in enumerate(hot):
        out[f"blk.{l}.gpu_idx"] = row.astype(np.int32)
        if bucket:
            out[f"blk.{l}.gpu_bucket"] = np.flatnonzero(row).astype(np.int32)
    return out


def write_powerinfer(path, config, weights, fc1, fc2, *, arch="llama", threshold=None, hot=None, magic=b"PWRI",
                     **options):
    """The model in PowerInfer's layout with its predictors (and placement); options go to write_tiny_gguf (the
    vocabulary, the matrices' types)."""
    extra = {f"blk.{l}.{n}.weight": w for l in range(len(fc1)) for n, w in (("fc1", fc1[l]), ("fc2", fc2[l]))}
    extra |= {} if hot is None else placement_tensors(hot)
    fields = {} if threshold is None else {"powerinfer.sparse_threshold": threshold}
    return write_tiny_gguf(path, config, weights, arch=arch, down_t=True, extra=extra, fields=fields, magic=magic,
                           **options)


def write_gpu_index(path, hot, *, powerinfer_int32=True):
    """PowerInfer's GPU index file (powerinfer-py export_split.py): gpu_idx, gpu_bucket per layer, block count,
    split.vram_capacity, magic PWRI; with powerinfer_int32 the tensors carry its ggml's int32 type number, 18."""
    w = gguf.GGUFWriter(str(path), "generic.gpu_index")
    for name, value in placement_tensors(hot).items():
        w.add_tensor(name, value)
    w.add_block_count(len(hot))
    w.add_uint64("split.vram_capacity", 1 << 20)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if powerinfer_int32:
        reader = gguf.GGUFReader(str(path), "r+")
        for t in reader.tensors:
            t.field.parts[-2][0] = 18   # (name length, name, n_dims, dims, type, offset)
    with open(path, "r+b") as f:
        f.write(b"PWRI")
