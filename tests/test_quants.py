"""llama.cpp's block types in the host decode (cpu_offload/blocks.py, cpu_offload/quants.py, --weights gguf):
each GEMV against float64 numpy on gguf's own dequantized values, the jnp dequantizer against gguf's, our K-type
quantizer against gguf's dequantizer, and a real decode step from a GGUF file in every type and in a mix."""
from __future__ import annotations

import re

import gguf
import numpy as np
import pytest

from cpu_offload import blocks, q8_dot, quants
from tests.conftest import jitted_logits, q8_dot_input, random_weights, tiny_config
from tests.support.gguf_files import write_tiny_gguf

jax = pytest.importorskip("jax")
jnp = jax.numpy

TYPES = [gguf.GGMLQuantizationType[name] for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                                                      "Q6_K")]
# Where each type keeps its float16 scales within a block (random bytes there would make inf / NaN values).
_F16_AT = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
           "Q6_K": (208,)}


def random_blocks(rng, kind, rows, n_blocks):
    """Fresh random blocks: every byte random (all codes, scales, bits), the f16 scales finite and small."""
    nbytes = blocks.TYPES[kind].nbytes
    data = rng.integers(0, 256, (rows, n_blocks, nbytes), dtype=np.uint8)
    for off in _F16_AT[blocks.TYPES[kind].name]:
        d = (rng.standard_normal((rows, n_blocks)) * 0.02).astype(np.float16)
        data[..., off:off + 2] = d.view(np.uint8).reshape(rows, n_blocks, 2)
    return data.reshape(rows, -1)


def rounded_input(kind, x):
    """The input a GEMV of kind multiplies, in float64: x itself, or for q8_dot's types x^, x rounded in lanes of 4
    to a code and a residue (q8_dot.quantize_input, checked by
    test_q8_dot_inputs_round_to_about_15_bits_in_lanes_of_4)."""
    if kind not in q8_dot.KINDS:
        return x.astype(np.float64)
    return q8_dot_input(x)


def test_q8_dot_inputs_round_to_about_15_bits_in_lanes_of_4():
    """Each lane of 4: unit dx = max|x| / (127 FINE), x^ = dx (FINE codes + residues) with codes round(127 x / max|x|)
    (so the largest is +-127) and residues in [-127, 127], every x^ within dx of x (dx / 2 but where a residue
    is clipped to +-127); the lane's sum of FINE codes + residues; each group of 16 the sum of its x^; a lane
    of zeros has dx 0 and codes 0."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((12, 4)) * rng.uniform(1e-3, 50, (12, 1))).astype(np.float32).ravel()  # lanes' spans vary
    x[4:8] = 0                                      # a lane of zeros
    x[40] = 1e4                                     # an outlier: lane 10's step is coarse, lane 11's is its own
    codes, residues, dx4, sums, lane_sums = q8_dot.quantize_input(x)
    lanes = x.reshape(-1, 4)
    dx = (np.abs(lanes).max(1) / np.float32(127 * q8_dot.FINE)).astype(np.float32)
    np.testing.assert_allclose(dx4, dx, rtol=2.0 ** -22)   # fastmath: amax times 1/127 may differ in the last bit
    c, r = codes.reshape(-1, 4).astype(np.int64), residues.reshape(-1, 4).astype(np.int64)
    assert (np.abs(c).max(1)[dx > 0] == 127).all() and not c[1].any() and not r[1].any() and dx4[1] == 0
    assert np.abs(r).max() <= 127
    fine = q8_dot.FINE * c + r
    xh = fine * dx4[:, None].astype(np.float64)
    assert (np.abs(xh - lanes) <= dx4[:, None] * (1 + 1e-5)).all()
    np.testing.assert_array_equal(lane_sums, fine.sum(1))
    np.testing.assert_allclose(sums, xh.reshape(-1, 16).sum(1), rtol=1e-5, atol=1e-6 * np.abs(x).max())


def test_every_type_the_loader_keeps_has_a_kernel_and_gguf_sizes():
    assert {gguf.GGMLQuantizationType(kind) for kind in blocks.GGUF_TYPES} == set(TYPES)
    for kind, t in blocks.GGUF_TYPES.items():
        assert gguf.GGMLQuantizationType(kind).name == t.name and blocks.BY_NAME[t.name] == kind
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)] == (t.block, t.nbytes)
        assert quants.row_bytes(kind, 3 * t.block) == 3 * t.nbytes == t.row_bytes(3 * t.block)
    with pytest.raises(ValueError, match="Q4_K rows need a multiple of 256"):
        blocks.TYPES[blocks.Q4_K].row_bytes(320)
    with pytest.raises(ValueError, match="no block layout for ggml type 1"):
        blocks.block_type(1)   # F16


def test_the_table_names_kernels_that_exist():
    """Every row's GEMV, batched GEMM and relayouts name a cpu_offload function; int8 is the one row that is not a
    GGUF type."""
    import importlib

    def function(name):
        module, attr = name.split(":")[0].split(".")
        return getattr(importlib.import_module(f"cpu_offload.{module}"), attr)

    assert set(blocks.TYPES) - set(blocks.GGUF_TYPES) == {blocks.INT8, blocks.Q4_1X16}
    for t in blocks.TYPES.values():
        assert callable(function(t.gemv)) and (t.gemm is None or callable(function(t.gemm))), t.name
        for into, by in t.relayouts:
            assert t.relayout(into) == by and callable(function(by.split(":")[0])), t.name
    assert [t.name for t in blocks.TYPES.values() if t.gemm] == ["Q4_1", "Q4_1x16", "int8"]


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
@pytest.mark.parametrize("rows,n_blocks", [(1, 1), (7, 3), (37, 2)])
def test_dequantize_equals_gguf_in_numpy_and_jnp(kind, rows, n_blocks):
    data = random_blocks(np.random.default_rng(rows * 100 + kind), kind, rows, n_blocks)
    cols = n_blocks * blocks.TYPES[kind].block
    want = gguf.quants.dequantize(data, kind)
    np.testing.assert_array_equal(blocks.TYPES[kind].dequantize((data,), cols), want)
    got = jax.jit(lambda d: blocks.TYPES[kind].dequantize((d,), cols, jnp))(jnp.asarray(data))
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
@pytest.mark.parametrize("rows,n_blocks,lo,hi", [(1, 1, 0, 1), (7, 3, 0, 7), (37, 2, 5, 30), (13, 5, 12, 13),
                                                 (9, 2, 4, 4)])
def test_gemv_matches_float64_on_gguf_values_and_writes_its_rows_only(kind, rows, n_blocks, lo, hi):
    rng = np.random.default_rng(1000 * kind + rows + lo)
    data = random_blocks(rng, kind, rows, n_blocks)
    cols = n_blocks * blocks.TYPES[kind].block
    x = rng.standard_normal(cols).astype(np.float32)
    y = np.full(rows, np.nan, np.float32)
    quants.gemv(kind.value, data, x, y, lo, hi)
    x = rounded_input(kind, x)
    want = gguf.quants.dequantize(data, kind).astype(np.float64) @ x
    scale = np.abs(gguf.quants.dequantize(data, kind)).max() * np.abs(x).sum()  # bound on float32 rounding
    np.testing.assert_allclose(y[lo:hi], want[lo:hi], rtol=0, atol=1e-6 * scale)
    assert np.isnan(y[:lo]).all() and np.isnan(y[hi:]).all()


@pytest.mark.parametrize("kind", [t for t in TYPES if q8_dot.BLOCK_OF[t.value]], ids=lambda k: k.name)
def test_an_input_rounded_once_serves_several_matrices_as_each_gemv_rounds_it(kind):
    """q8_dot.gemv_rounded (a stage rounds its input once for q, k and v, or gate and up): each matrix's rows, and
    only those asked for, bit for bit what gemv gives, which rounds x itself."""
    rng = np.random.default_rng()
    n_blocks = int(rng.integers(1, 6))
    cols = n_blocks * blocks.TYPES[kind].block
    x = rng.standard_normal(cols).astype(np.float32)
    xr = q8_dot.quantize_input(x)
    for rows, lo, hi in ((int(rng.integers(1, 40)), 0, None), (11, 3, 9), (5, 2, 2)):
        data = random_blocks(rng, kind, rows, n_blocks)
        hi = rows if hi is None else hi
        want, got = np.full(rows, np.nan, np.float32), np.full(rows, np.nan, np.float32)
        q8_dot.gemv(kind.value, data, x, want, lo, hi)
        q8_dot.gemv_rounded(kind.value, data, xr, got, lo, hi)
        np.testing.assert_array_equal(got, want)
        assert np.isnan(got[:lo]).all() and np.isnan(got[hi:]).all() and not np.isnan(got[lo:hi]).any()


def test_gemv_reads_a_row_through_its_stride():
    """A matrix whose rows are a slice of wider rows (as a memory map's views can be) reads each row's own bytes."""
    kind = blocks.Q6_K
    rng = np.random.default_rng(3)
    wide = random_blocks(rng, kind, 5, 3)
    view = wide[:, :blocks.TYPES[kind].row_bytes(512)]
    x = rng.standard_normal(512).astype(np.float32)
    y = np.full(5, np.nan, np.float32)
    quants.gemv(kind, view, x, y, 0, 5)
    want = gguf.quants.dequantize(np.ascontiguousarray(view), kind).astype(np.float64) @ rounded_input(kind, x)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_our_k_quantizer_round_trips_through_gguf(name):
    from tests.support import kquants

    rng = np.random.default_rng(7)
    w = (rng.standard_normal((9, 512)) * rng.uniform(0.01, 2, (9, 1))).astype(np.float32)
    w[0] = np.abs(w[0])            # a row without negative values (the min is 0)
    w[1, :256] = 0                 # an all-zero block
    q = kquants.quantize(w, name)
    kind = gguf.GGMLQuantizationType[name]
    assert q.shape == (9, blocks.TYPES[kind].row_bytes(512)) and q.dtype == np.uint8
    back = gguf.quants.dequantize(q, kind)
    np.testing.assert_array_equal(back[1, :256], 0)
    bits = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}[name]
    span = w.max(1, keepdims=True) - np.minimum(w.min(1, keepdims=True), 0)
    # Half a step of the sub-block's range, plus the 6-bit scale's own rounding: a few steps at most.
    assert (np.abs(back - w) <= 3 * span / (2 ** bits - 1)).all()
    rms = np.sqrt(((back - w) ** 2).mean()) / np.sqrt((w ** 2).mean())
    assert rms < {"Q4_K": 0.12, "Q5_K": 0.06, "Q6_K": 0.03}[name]


# ------------------------------------------------------------------------------------------ a real decode step
def _config():
    # d_model, H * hd and d_ff multiples of 256: every K type holds whole blocks.
    return tiny_config(d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512, n_layers=2,
                       tie_embeddings=False)


def _mix(name):
    """A Q4_K_M-like file: attention and gate/up Q5_0 (v Q8_0 in layer 0), down Q6_K / Q4_K, head Q6_K, the
    embedding Q4_K."""
    t = gguf.GGMLQuantizationType
    if name == "embed":
        return t.Q4_K
    if name == "lm_head":
        return t.Q6_K
    layer, m = int(name.split(".")[1]), name.rsplit(".", 1)[-1]
    if m == "w_down_t":
        return t.Q6_K if layer == 0 else t.Q4_K
    return t.Q8_0 if (m == "wv" and layer == 0) else t.Q5_0


@pytest.mark.slow
@pytest.mark.parametrize("kinds", [*TYPES, "mix", "qwen2"], ids=lambda k: getattr(k, "name", k))
def test_decode_step_in_the_files_own_blocks_equals_float32_on_gguf_values(tmp_path, kinds):
    """kinds: every matrix in one type, a Q4_K_M-like mix, or that mix as a Qwen2 file (q/k/v biases, not
    permuted)."""
    from cpu_offload.decoder import HostDecoder, quantize_weights
    from cpu_offload.qtensor import QTensor
    from pjinfer.load import loader
    from pjinfer.runtime.host import attach
    from pjinfer.runtime.model import Transformer
    from tests.test_host_decode import _decode

    config = _config().replace(vocab_size=262)  # write_tiny_gguf's vocabulary: the untied head has as many rows
    path = tmp_path / "model.gguf"
    pick = _mix if kinds in ("mix", "qwen2") else (lambda name: kinds)
    weights = random_weights(config, seed=4)
    if kinds == "qwen2":
        rng = np.random.default_rng(9)
        for l in range(config.n_layers):
            for b, n in (("bq", config.n_heads), ("bk", config.n_kv_heads), ("bv", config.n_kv_heads)):
                weights[f"layers.{l}.{b}"] = rng.standard_normal(n * config.head_dim).astype(np.float32)
    arch = "qwen2" if kinds == "qwen2" else "llama"
    config, _ = write_tiny_gguf(path, config, weights, layer_type=pick, arch=arch)
    _, stored, _ = loader.load(path, keep="gguf")
    _, values, _ = loader.load(path)            # float32: gguf's dequantizer
    assert ("layers.1.bv" in values) == (kinds == "qwen2")
    for name in ("layers.0.wq", "layers.1.w_down_t", "lm_head", "embed"):
        want = pick(name)
        assert isinstance(stored[name], QTensor) and stored[name].code == want
    stored = quantize_weights(config, stored, "gguf")
    assert stored["lm_head"].code == pick("lm_head")          # the head in its own type, not int8
    host = HostDecoder(config, stored, "gguf")
    model = Transformer(config, stored)
    attach(model, host)
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, 7)
    got, got_cache = _decode(model, tokens, 8)
    want, want_cache = _decode(Transformer(config, values), tokens, 8)
    # The caches are float16 (test_host_decode's tolerances): a value the two paths compute a hair apart can
    # round to neighbouring steps. Where q8_dot reads a matrix, its input is rounded to about 15 bits: on these
    # weights the logits moved by up to 2.2e-4 of the largest and the cache by up to 5.6e-4 (7.5e-6 and 6.1e-5 with
    # float32 inputs, Q5_1); a fault in a block's decode (a scale on the wrong sub-block) moves them by tens of
    # percent.
    rounded = kinds in ("mix", "qwen2") or kinds in q8_dot.KINDS
    logits_tol, cache_tol = (1e-3, 2e-3) if rounded else (5e-4, 1e-3)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=logits_tol * np.abs(want).max())
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
        b = np.asarray(b, np.float32)
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=4e-3, atol=cache_tol * np.abs(b).max())
    # The XLA path (prefill, scoring) dequantizes the same blocks: its logits are the float32 model's.
    ids = jnp.asarray(tokens[None])

    def score(m):
        return np.asarray(jitted_logits(m)(ids))[0]

    np.testing.assert_allclose(score(Transformer(config, stored)), score(Transformer(config, values)),
                               rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(score(Transformer(config, values)), want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


def test_the_gemv_benchmark_reports_every_block_type_from_cache_and_from_memory(capsys):
    """`python -m cpu_offload.bench --gemv`'s table (docs/performance.md): the matrices read in turn span the bytes
    asked for, and each block type with values has a row with both rates, their share of one thread's read rate,
    and its output's MD5."""
    from cpu_offload import bench

    bench.gemv_table(1, cols=256, matrix_bytes=64 << 10, memory_bytes=200 << 10)
    lines = capsys.readouterr().out.splitlines()
    assert "(4 matrices in turn" in lines[0] and "one thread reads" in lines[1]
    names = [t.name for t in blocks.TYPES.values() if t.values is not None]
    assert [r.split()[0] for r in lines[2:]] == names and "Q4_1x16" in names
    for r in lines[2:]:
        assert re.search(r"[\d.]+ \| +[\d.]+ GB/s \| +\d+% \| [\d.]+x, [\d.]+x Q4_1's \| md5 [0-9a-f]{10}$", r), r
