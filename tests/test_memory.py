"""The model held once, in its file's blocks: the GGUF reader, Q4_1 blocks kept as stored, XLA's
per-layer dequantizing, the int8 head made without a float32 copy, and no float32 copy alive on the q4_1 path."""
import mmap
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpu_offload import int8
from cpu_offload.blocks import INT8, Q4_1, Q8_0
from cpu_offload.qtensor import XLA_ALIGNMENT, QTensor, aligned, aligned_empty, is_aligned, is_quantized
from pjinfer.load import loader
from pjinfer.load.gguf_file import GGUFFile
from pjinfer.runtime import model
from tests.conftest import int8_values, q4_1, q4_1_values, random_weights, tiny_config
from tests.support.gguf_files import write_tiny_gguf


def _q4_blocks(rng, rows, cols):
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2, (rows, 1))).astype(np.float32)
    return q4_1(w)


def _int8_reference(w):
    """numpy's int8 rows and scales of w (int8.quantize's rule): the largest magnitude of each block of 64 (the
    last one shorter where cols is not a multiple) to 127, an all-zero block scale 1."""
    rows, cols = w.shape
    nblk = -(-cols // 64)
    blocks = np.zeros((rows, nblk * 64), np.float32)
    blocks[:, :cols] = w
    blocks = blocks.reshape(rows, nblk, 64)
    peak = np.abs(blocks).max(axis=2)
    scale = np.where(peak > 0, peak / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(blocks / scale[:, :, None]), -127, 127).astype(np.int8)
    return q.reshape(rows, nblk * 64)[:, :cols], scale


@pytest.mark.parametrize("rows,cols", [(7, 32), (33, 96), (5, 576)])
def test_xla_dequantizing_equals_the_numpy_reference(rows, cols):
    rng = np.random.default_rng(rows * cols)
    blocks = _q4_blocks(rng, rows, cols)
    ids = jnp.asarray([[rows - 1, 0, rows // 2]])
    w = rng.standard_normal((rows, cols + 64)).astype(np.float32)
    for t in (QTensor(Q4_1, (blocks,), cols), QTensor(INT8, int8.quantize(w), cols + 64), QTensor.quantize(Q8_0, w)):
        want = t.float32()
        np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m: m[...])(model.QMatrix(t))), want)
        np.testing.assert_array_equal(np.asarray(model.QMatrix(t).rows(ids))[0], want[[rows - 1, 0, rows // 2]])
        np.testing.assert_array_equal(np.asarray(model.QMatrix(t, transposed=True)[...]), want.T)
    np.testing.assert_array_equal(QTensor(Q4_1, (blocks,), cols).float32(), q4_1_values(blocks, cols))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("slices", [1, 2, 5])
def test_a_product_reads_the_matrix_a_slice_of_rows_at_a_time(monkeypatch, transposed, slices):
    """QMatrix.product in slices of stored rows (joined outputs, or partial sums where the stored rows are summed
    over) against float64 numpy, inside a layer's ordering and outside it; one slice is the einsum itself."""
    rng = np.random.default_rng()
    rows, cols = 37, 96
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    monkeypatch.setattr(model, "DEQUANTIZED_BYTES", -(-rows * cols * 4 // slices))
    for t in (QTensor(Q4_1, (_q4_blocks(rng, rows, cols),), cols), QTensor(INT8, int8.quantize(w), cols),
              QTensor.quantize(Q8_0, w)):
        m = model.QMatrix(t, transposed=transposed)
        full = t.float32().astype(np.float64)
        full = full.T if transposed else full                     # what m[...] stands for
        for contract in (0, 1):
            x = rng.standard_normal((2, 3, full.shape[contract])).astype(np.float32)
            want = x @ (full if contract == 0 else full.T)

            def product(m, x):
                with model._dequantized_after(x):
                    return m.product(x, contract)
            x = jnp.asarray(x)
            for got in (np.asarray(nnx.jit(product)(m, x)), np.asarray(m.product(x, contract))):
                assert got.shape == want.shape
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
            if slices == 1:
                spec = "...f,fd->...d" if contract == 0 else "...i,oi->...o"
                np.testing.assert_array_equal(np.asarray(m.product(x, contract)),
                                              np.asarray(jnp.einsum(spec, x, m[...])))


@pytest.mark.parametrize("rows,cols", [(1, 64), (37, 192), (300, 576), (5, 100), (3, 17), (0, 64), (4, 0)])
def test_int8_quantizer_gives_numpys_bytes(rows, cols):
    rng = np.random.default_rng(rows)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0, 3, (rows, 1))).astype(np.float32)
    w[:1, :64] = 0  # an all-zero block takes scale 1
    got, want = int8.quantize(w), _int8_reference(w)
    assert is_aligned(got[0]) and is_aligned(got[1])
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(int8_values(*got), (want[0] * np.repeat(want[1], 64, axis=1)[:, :cols]))


def test_reader_reads_what_ggufs_reader_reads(tmp_path):
    config = tiny_config(d_model=64, head_dim=16, d_ff=128, tie_embeddings=False)
    write_tiny_gguf(tmp_path / "m.gguf", config, random_weights(config, seed=3), layer_type=gguf.GGMLQuantizationType.Q4_1)
    ours, theirs = GGUFFile(tmp_path / "m.gguf"), gguf.GGUFReader(str(tmp_path / "m.gguf"))
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            value = ours.fields[key]
            assert (value.tolist() if isinstance(value, np.ndarray) else value) == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.type == int(b.tensor_type)
        np.testing.assert_array_equal(a.data, b.data, err_msg=a.name)


def test_q4_1_layers_stay_the_files_blocks(tmp_path):
    config = tiny_config(d_model=64, head_dim=16, d_ff=128, tie_embeddings=False)
    path = tmp_path / "q.gguf"
    write_tiny_gguf(path, config, random_weights(config, seed=4), layer_type=gguf.GGMLQuantizationType.Q4_1)
    _, dense, _ = loader.load(path)
    _, kept, _ = loader.load(path, keep="q4_1")
    assert set(kept) == set(dense)
    for name, w in kept.items():
        if name.startswith("layers.") and dense[name].ndim == 2:
            assert isinstance(w, QTensor) and w.code == Q4_1, name
            np.testing.assert_array_equal(model.float32_weight(name, w), dense[name], err_msg=name)
            if not name.endswith((".wq", ".wk")) and w.data.ctypes.data % XLA_ALIGNMENT == 0:
                base = w.data   # as stored: a view of the file's memory map, no copy
                while isinstance(base, np.ndarray):
                    base = base.base
                assert isinstance(getattr(base, "obj", base), mmap.mmap), name   # np.frombuffer's memoryview
        elif name == "lm_head":  # the untied head, Q8_0 in the file: the host decode's int8, no float32 copy
            assert isinstance(w, QTensor) and w.code == INT8
            want = int8.quantize(dense[name])
            np.testing.assert_array_equal(w.arrays[0], want[0])
            np.testing.assert_array_equal(w.arrays[1], want[1])
        else:
            np.testing.assert_array_equal(w, dense[name], err_msg=name)
    assert GGUFFile(path).mmap.size == path.stat().st_size


def test_the_dense_host_decode_loads_q4_1_layers_relaid_16_rows_together(tmp_path):
    """grouped (the host rows' Backend.grouped): every Q4_1 layer matrix becomes Q4_1x16 with the same values, in a
    new aligned array, and the file's pages are let go; a model with a layer matrix of rows not in sixteens keeps
    the file's blocks; the engine's host decode reads the relaid ones."""
    from cpu_offload.blocks import Q4_1X16
    from pjinfer.runtime.engine import Engine

    config = tiny_config(d_model=64, head_dim=16, d_ff=128, tie_embeddings=False)
    path = tmp_path / "q.gguf"
    write_tiny_gguf(path, config, random_weights(config, seed=5), layer_type=gguf.GGMLQuantizationType.Q4_1)
    _, kept, _ = loader.load(path, keep="q4_1")
    _, grouped, _ = loader.load(path, keep="q4_1", grouped=True)
    for name, w in kept.items():
        if isinstance(w, QTensor) and w.code == Q4_1:
            g = grouped[name]
            assert g.code == Q4_1X16 and g.data.shape == w.data.shape and g.data.ctypes.data % XLA_ALIGNMENT == 0
            np.testing.assert_array_equal(g.float32(), w.float32(), err_msg=name)
    engine = Engine.load(path, weights="q4_1")
    assert {w.code for w in engine.host._quantized.values()} == {Q4_1X16}   # its layer matrices
    odd = tiny_config(d_model=64, head_dim=8, n_heads=4, n_kv_heads=1, d_ff=128, tie_embeddings=False)   # k, v: 8 rows
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, odd, random_weights(odd, seed=6), layer_type=gguf.GGMLQuantizationType.Q4_1)
    _, kept, _ = loader.load(path, keep="q4_1", grouped=True)
    assert {w.code for n, w in kept.items() if n.startswith("layers.") and isinstance(w, QTensor)} == {Q4_1}


# Aliasing is the CPU client's: on an accelerator device_put copies the weights into its memory by design.
on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA aliases host arrays on the CPU only")


@on_cpu
@pytest.mark.parametrize("shape,dtype", [((7, 33), np.int8), ((5,), np.float32), ((0, 3), np.uint8),
                                         ((49152, 9), np.float32)])
def test_aligned_arrays_reach_xla_without_a_copy(shape, dtype):
    a = aligned_empty(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and is_aligned(a)
    a[...] = np.arange(a.size).reshape(shape)
    assert aligned(a) is a
    if a.size:
        assert jax.device_put(a).unsafe_buffer_pointer() == a.ctypes.data
    raw = np.zeros(a.nbytes + 2 * XLA_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % XLA_ALIGNMENT + 32   # 32 bytes past a boundary, as a GGUF's data may be
    off = raw[start:start + a.nbytes].view(dtype).reshape(shape)
    off[...] = a
    copy = aligned(off)
    assert is_aligned(copy) and (copy is not off or a.size == 0)   # an empty array has nothing to copy
    np.testing.assert_array_equal(copy, a)
    strided = a[::2]
    assert is_aligned(aligned(strided))
    np.testing.assert_array_equal(aligned(strided), strided)


@on_cpu
def test_a_q4_1_engine_holds_each_matrix_once_even_from_a_file_aligned_to_32(tmp_path):
    """GGUF aligns tensor data to 32 bytes; XLA's CPU client copies an array not on a 64-byte boundary. The
    loader gives every quantized matrix as an aligned array (the file's view where the file is aligned, else a copy
    whose file pages are released) so that the engine's XLA arrays are the very arrays the loader made."""
    from pjinfer.runtime.engine import Engine

    config = tiny_config(d_model=64, head_dim=16, d_ff=128, tie_embeddings=True)
    weights = random_weights(config, seed=6)
    for pad in range(64):   # a metadata key of another length moves every tensor by a multiple of 32 bytes
        path = tmp_path / f"pad{pad}.gguf"
        write_tiny_gguf(path, config, weights, layer_type=gguf.GGMLQuantizationType.Q4_1,
                        fields={"pad." + "x" * pad: 0.0})
        if GGUFFile(path).tensors[0].data.ctypes.data % XLA_ALIGNMENT:
            break
        path.unlink()
    assert path.exists(), "no padding put the file's tensors off a 64-byte boundary"
    config, kept, tokenizer = loader.load(path, keep="q4_1")
    arrays = [a for w in kept.values() if is_quantized(w) for a in w.arrays]
    assert len(arrays) > 3 * config.n_layers
    assert all(is_aligned(a) for a in arrays)
    engine = Engine(config, kept, tokenizer, weights_format="q4_1")
    in_xla = {a.unsafe_buffer_pointer() for a in jax.live_arrays()}
    assert [a.shape for a in arrays if a.ctypes.data not in in_xla] == []
    assert engine.host is not None


@pytest.mark.parametrize("code", [Q8_0, Q4_1])
def test_int8_from_blocks_is_the_quantizers_bytes_of_their_values(code):
    rng = np.random.default_rng(code)
    rows = int8.FROM_BLOCKS_ROWS + 3                                       # a chunk and a short one
    w = (rng.standard_normal((rows, 96)) * rng.uniform(0, 3, (rows, 1))).astype(np.float32)
    blocks = QTensor.quantize(code, w)
    got = int8.from_blocks(code, blocks.data, 96)
    assert got.code == INT8 and got.shape == (rows, 96)
    for a, b in zip(got.arrays, int8.quantize(blocks.float32())):
        np.testing.assert_array_equal(a, b)


@pytest.mark.real_model
def test_int8_head_from_the_real_q8_0_embedding():
    path = loader.default_model_path()
    t = next(t for t in GGUFFile(path).tensors if t.name == "token_embd.weight")
    got = int8.from_blocks(Q8_0, t.data, t.shape[1])
    want = int8.quantize(gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType.Q8_0))
    np.testing.assert_array_equal(got.arrays[0], want[0])
    np.testing.assert_array_equal(got.arrays[1], want[1])


def _rss_file_mb() -> float:
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["RssFile"].split()[0]) / 1024


@pytest.mark.real_model
def test_release_drops_a_copied_tensors_pages_and_keeps_its_data():
    """GGUFFile.release (what the loader calls once a tensor has been re-laid or converted): its pages leave this
    process's resident memory, and its data still reads the same."""
    file = GGUFFile(loader.default_model_path())
    t = next(t for t in file.tensors if t.name == "token_embd.weight")    # 30 MB of Q8_0 blocks
    before = int(t.data.sum(dtype=np.uint64))     # reads every page
    resident = _rss_file_mb()
    file.release(t)
    assert resident - _rss_file_mb() > 0.8 * t.data.nbytes / 2**20
    assert int(t.data.sum(dtype=np.uint64)) == before


LIVE_ARRAYS = r"""
import gc, json, sys
import jax, numpy as np
from pjinfer.load.gguf_file import GGUFFile
from pjinfer.runtime.engine import Engine

engine = Engine.load(weights="q4_1")
ids = engine.tokenizer.encode("The capital of France is")
text = engine.tokenizer.decode(engine.generate(ids, max_new_tokens=4))
logp = engine.token_logprobs(np.asarray([ids]))
gc.collect()
file = GGUFFile(engine.source)
quantized = {t.shape for t in file.tensors if len(t.shape) == 2}
quantized |= {s[::-1] for s in quantized}
del file
arrays = [("jax", a.dtype.name, a.shape, a.nbytes, True) for a in jax.live_arrays()]
seen = set()
for obj in gc.get_objects():
    for ref in [obj, *gc.get_referents(obj)]:
        if isinstance(ref, np.ndarray) and id(ref) not in seen:
            seen.add(id(ref))
            arrays.append(("numpy", ref.dtype.name, ref.shape, ref.nbytes, bool(ref.flags.owndata)))
f32 = [a for a in arrays if a[1] == "float32" and tuple(a[2]) in quantized]
print(json.dumps({"text": text, "owned": sum(a[3] for a in arrays if a[4]), "float32_copies": [str(a) for a in f32],
                  "scipy_linalg": "scipy.linalg" in sys.modules}))
"""


@pytest.mark.real_model
def test_q4_1_engine_holds_no_float32_copy_of_a_quantized_matrix():
    """Loads the default model with --weights q4_1, generates and scores, then sums the bytes of every live array
    (jax, and numpy reachable from Python objects): no float32 array shaped like a quantized matrix of the file
    may be alive, and the arrays that own their memory stay within the file's size plus a small margin (the
    layers are the file's pages; the int8 head is 0.3x the model's bytes). Numba's kernels load without the
    scipy.linalg import of its BLAS check (cpu_offload/_numba.py: about 12 MB)."""
    import json

    result = subprocess.run([sys.executable, "-c", LIVE_ARRAYS], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["text"].startswith(" Paris")
    assert out["float32_copies"] == []
    assert out["scipy_linalg"] is False
    size = loader.default_model_path().stat().st_size
    assert out["owned"] < 1.2 * size, out["owned"]


HANDLERS_LOADED = r"""
import sys
from cpu_offload import batched_decode, cold_handler, host_decode, predicted_decode, sparse_decode
from pjinfer.runtime.engine import Engine

funcs = {"host_decode.handler_cfunc": host_decode.handler_cfunc, "host_decode.stage_cfunc": host_decode.stage_cfunc}
for m in (sparse_decode, batched_decode, predicted_decode, cold_handler):
    funcs.update({f"{m.__name__}.{n}": getattr(m, n) for n in ("_handler", "_handler_int8", "_stage")
                  if hasattr(m, n)})
loaded = lambda: sorted(name for name, f in funcs.items() if f.loaded)
at_import = loaded()
engine = Engine.load(sys.argv[1], compile_cache=False)
engine.generate([1, 2, 3], max_new_tokens=2)
print(at_import, loaded(), "pallas_kernels" in sys.modules, len(funcs))
"""


def test_a_powerinfer_generate_loads_only_its_own_handlers(tmp_path):
    """Each decoder's FFI handler and team stage is a DeferredCFunc (cpu_offload/cfuncs.py): the engine imports
    every decoder's module and none is loaded then; a PowerInfer file's generate loads predicted_decode's two only,
    and does not import pallas_kernels (docs/performance.md, "Handlers loaded when used")."""
    from tests.test_predicted_decode import write_file

    path = write_file(tmp_path / "tiny.powerinfer.gguf", gguf.GGMLQuantizationType.Q4_0)
    result = subprocess.run([sys.executable, "-c", HANDLERS_LOADED, str(path)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == (
        "[] ['cpu_offload.predicted_decode._handler', 'cpu_offload.predicted_decode._stage'] False 10"), result.stdout
