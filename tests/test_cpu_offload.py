"""cpu_offload: Numba cold-neuron kernels and the XLA FFI bridge that calls them from inside jax.jit."""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from cpu_offload import bridge, cold_handler, ffi, int8, kernels
from tests.conftest import int8_values

jax = pytest.importorskip("jax")
jnp = jax.numpy

ACTS = ["swiglu", "geglu", "reglu", "drelu", "relu"]


def make_layer(rng, d, c, activation, scale=1.0):
    """Random weights of one layer's cold rows: (w_gate or None, w_up, w_down_t, b_up or None)."""
    w = lambda: (rng.standard_normal((c, d)) * scale / np.sqrt(d)).astype(np.float32)
    gate = None if activation == "relu" else w()
    up, down = w(), w()
    bias = (0.3 * rng.standard_normal(c)).astype(np.float32) if activation == "relu" else None
    return gate, up, down, bias


def assert_close(got, want, rtol=3e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.all(np.isfinite(got))
    tol = rtol * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=tol)


def call_kernel(layer, x, ids, count, activation, max_threads):
    gate, up, down, bias = layer
    d = x.shape[0]
    out = np.full(d, np.nan, np.float32)  # poisoned: the kernel must overwrite, not accumulate
    kernels.cold_ffn_nt(x, kernels.empty_gate(d) if gate is None else gate, up, down,
                        kernels.empty_bias() if bias is None else bias, kernels.no_scales(), ids, count,
                        kernels.act_code(activation), out, max_threads)
    return out


# ------------------------------------------------------------------------------------------------------------
# the kernel, called directly

@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("d,c", [(576, 1536), (33, 7), (33, 1), (33, 0), (576, 1)])
def test_kernel_matches_reference(activation, d, c):
    rng = np.random.default_rng([ACTS.index(activation), d, c])
    layer = make_layer(rng, d, c, activation)
    gate, up, down, bias = layer
    x = rng.standard_normal(d).astype(np.float32)
    cases = {"empty": (rng.permutation(c).astype(np.int32), 0),
             "full": (rng.permutation(c).astype(np.int32), c)}
    if c > 1:
        k = int(rng.integers(1, c))
        cases["subset"] = (rng.choice(c, size=k, replace=False).astype(np.int32), k)
        cases["prefix of longer list"] = (rng.permutation(c).astype(np.int32), int(rng.integers(1, c)))
    for name, (ids, count) in cases.items():
        want = kernels.cold_ffn_ref(x, gate, up, down, bias, ids, count, activation)
        for nt in (1, 2):
            got = call_kernel(layer, x, ids, count, activation, nt)
            if count == 0:
                assert np.array_equal(got, np.zeros(d, np.float32)), name
            else:
                assert_close(got, want)
        if name == "full" and c:
            assert_close(got, kernels.dense_ffn_ref(x, gate, up, down, bias, activation))
    # the public entry point (numba.get_num_threads threads) and the convenience wrapper agree
    ids, count = cases["full"]
    out = np.full(d, np.nan, np.float32)
    kernels.cold_ffn(x, kernels.empty_gate(d) if gate is None else gate, up, down,
                     kernels.empty_bias() if bias is None else bias, kernels.no_scales(), ids, count,
                     kernels.act_code(activation), out)
    assert_close(out, kernels.cold_ffn_ref(x, gate, up, down, bias, ids, count, activation))
    assert_close(kernels.cold_ffn_call(x, gate, up, down, bias, ids, count, activation), out)


def masked_reference(layer, xs, mask, activation):
    """Each token through the one-token numpy reference, with its mask row as the active list."""
    gate, up, down, bias = layer
    return np.stack([kernels.cold_ffn_ref(x, gate, up, down, bias, np.flatnonzero(m), m.sum(), activation)
                     for x, m in zip(xs, mask)])


def random_mask(rng, n, c):
    mask = rng.random((n, c)) < 0.6
    mask[0] = False          # a token with nothing active
    if n > 1:
        mask[1] = True       # a token with every neuron active
    return mask


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("n,d,c", [(37, 33, 50), (37, 100, 300), (1, 576, 7), (6, 33, 0), (2, 33, 1)])
def test_masked_kernel_matches_reference(activation, n, d, c):
    # (37, 100, 300) is above SERIAL_FLOATS, so two threads split the tokens 18 / 19; odd n leaves a remainder
    # after the four-token groups.
    rng = np.random.default_rng([ACTS.index(activation), n, d, c])
    layer = make_layer(rng, d, c, activation)
    gate, up, down, bias = layer
    xs = rng.standard_normal((n, d)).astype(np.float32)
    mask = random_mask(rng, n, c)
    want = masked_reference(layer, xs, mask, activation)
    for nt in (1, 2):
        outs = np.full((n, d), np.nan, np.float32)  # poisoned: overwritten, never accumulated into
        kernels.cold_ffn_masked_nt(xs, kernels.empty_gate(d) if gate is None else gate, up, down,
                                   kernels.empty_bias() if bias is None else bias, kernels.no_scales(), mask,
                                   kernels.act_code(activation), outs, nt)
        assert np.array_equal(outs[0], np.zeros(d, np.float32))
        assert_close(outs, want)
        if n > 1 and c:
            assert_close(outs[1], kernels.dense_ffn_ref(xs[1], gate, up, down, bias, activation))


def quantized(layer):
    """int8 rows with their [3, C, blocks] scales, and the float32 weights they stand for (the reference's input)."""
    gate, up, down, bias = layer
    c, d = up.shape
    scales = np.ones((3, c, -(-d // kernels.QBLOCK)), np.float32)
    q_gate = np.zeros((0, d), np.int8)
    deq_gate = None
    if gate is not None:
        q_gate, scales[0] = int8.quantize(gate)
        deq_gate = int8_values(q_gate, scales[0])
    q_up, scales[1] = int8.quantize(up)
    q_down, scales[2] = int8.quantize(down)
    return (q_gate, q_up, q_down, scales), (deq_gate, int8_values(q_up, scales[1]),
                                            int8_values(q_down, scales[2]), bias)


def test_int8_quantize_round_trip():
    rng = np.random.default_rng(81)
    b = kernels.QBLOCK
    d = 2 * b + 6                                         # two whole blocks and a tail of 6
    w = rng.standard_normal((9, d)).astype(np.float32) * rng.uniform(0.01, 10, (9, 1)).astype(np.float32)
    w[3] = 0.0                                            # an all-zero row keeps scale 1 and codes 0
    w[5, b:2 * b] *= 1e-3                                 # a quiet block gets its own fine scale
    q, scale = int8.quantize(w)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and q.shape == w.shape and scale.shape == (9, 3)
    step = np.repeat(scale, kernels.QBLOCK, axis=1)[:, :d]
    assert np.all(np.abs(int8_values(q, scale) - w) <= step / 2 + 1e-7)
    assert np.all(scale[3] == 1.0) and not q[3].any()
    assert np.abs(q[5, b:2 * b]).max() == 127 and scale[5, 1] < 1e-2 * scale[5, 0]


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("d,c", [(576, 1536), (33, 7), (33, 0)])
def test_int8_kernels_match_reference_on_dequantized_weights(activation, d, c):
    rng = np.random.default_rng([91, ACTS.index(activation), d, c])
    layer = make_layer(rng, d, c, activation)
    (q_gate, q_up, q_down, scales), deq = quantized(layer)
    bias = kernels.empty_bias() if layer[3] is None else layer[3]
    code = kernels.act_code(activation)
    x = rng.standard_normal(d).astype(np.float32)
    ids = rng.permutation(c).astype(np.int32)
    for count in sorted({0, c // 3, c}):
        want = kernels.cold_ffn_ref(x, deq[0], deq[1], deq[2], deq[3], ids, count, activation)
        for nt in (1, 2):
            out = np.full(d, np.nan, np.float32)
            kernels.cold_ffn_nt(x, q_gate, q_up, q_down, bias, scales, ids, count, code, out, nt)
            assert_close(out, want, rtol=1e-4)
    n = 9
    xs = rng.standard_normal((n, d)).astype(np.float32)
    mask = random_mask(rng, n, c)
    want = masked_reference(deq, xs, mask, activation)
    for nt in (1, 2):
        outs = np.full((n, d), np.nan, np.float32)
        kernels.cold_ffn_masked_nt(xs, q_gate, q_up, q_down, bias, scales, mask, code, outs, nt)
        assert_close(outs, want, rtol=1e-4)


def test_kernel_parallel_split_and_edge_rules():
    rng = np.random.default_rng(7)
    d, c = 576, 1536
    layer = make_layer(rng, d, c, "swiglu")
    gate, up, down, _ = layer
    x = rng.standard_normal(d).astype(np.float32)
    # sizes around the serial/parallel threshold and uneven splits between 2 threads
    for count in (1, 7, 8, 16, 37, 38, 39, 101, 767, 1535):
        ids = rng.choice(c, size=count, replace=False).astype(np.int32)
        want = kernels.cold_ffn_ref(x, gate, up, down, None, ids, count, "swiglu")
        assert_close(call_kernel(layer, x, ids, count, "swiglu", 2), want)
        assert_close(call_kernel(layer, x, ids, count, "swiglu", 1), want)
    # count beyond len(ids) is clipped, negative count means none
    ids = rng.permutation(c)[:100].astype(np.int32)
    assert_close(call_kernel(layer, x, ids, 10_000, "swiglu", 2),
                 kernels.cold_ffn_ref(x, gate, up, down, None, ids, 100, "swiglu"))
    assert np.array_equal(call_kernel(layer, x, ids, -5, "swiglu", 2), np.zeros(d, np.float32))
    # ids outside [0, C) are skipped; duplicates count twice
    bad = np.array([3, -1, c, 5, 3, 2**31 - 1], np.int32)
    want = kernels.cold_ffn_ref(x, gate, up, down, None, np.array([3, 5, 3]), 3, "swiglu")
    assert_close(call_kernel(layer, x, bad, bad.size, "swiglu", 1), want)
    assert_close(call_kernel(layer, x, np.tile(bad, 20), 120, "swiglu", 2), 20 * want, rtol=1e-4)


def test_relu_family_zero_activations_are_exact():
    """ReLU-family neurons with act == 0 contribute exactly nothing (their down rows are skipped)."""
    rng = np.random.default_rng(3)
    d, c = 33, 64
    gate, up, down, bias = make_layer(rng, d, c, "relu")
    bias[:] = -1e6  # every neuron is dead
    down[:] = np.nan  # and would poison the result if read
    x = rng.standard_normal(d).astype(np.float32)
    ids = np.arange(c, dtype=np.int32)
    for nt in (1, 2):
        assert np.array_equal(call_kernel((gate, up, down, bias), x, ids, c, "relu", nt), np.zeros(d, np.float32))


# ------------------------------------------------------------------------------------------------------------
# the FFI handler, poked directly through ctypes (no XLA involved)

def test_struct_layout_matches_c_api():
    """Offsets used by the handler (x86-64 / LP64 layout of xla/ffi/api/c_api.h, checked against the header)."""
    assert ctypes.sizeof(ctypes.c_void_p) == 8
    assert (ffi.CF_EXT, ffi.CF_API, ffi.CF_STAGE) == (8, 16, 32)
    assert (ffi.CF_NARGS, ffi.CF_ARGS, ffi.CF_NRETS, ffi.CF_RETS) == (56, 72, 96, 112)
    assert (ffi.CF_NATTRS, ffi.CF_ATTR_TYPES, ffi.CF_ATTR_NAMES, ffi.CF_ATTR_VALUES) == (136, 144, 152, 160)
    assert ffi.CF_STRUCT_SIZE == 168
    assert (ffi.BUF_DTYPE, ffi.BUF_DATA, ffi.BUF_RANK, ffi.BUF_DIMS) == (16, 24, 32, 40)
    assert (ffi.SCALAR_VALUE, ffi.SPAN_LEN, ffi.EXT_TYPE, ffi.MDX_METADATA) == (8, 8, 8, 24)
    assert (ffi.MD_VERSION, ffi.MD_VERSION_MAJOR, ffi.MD_VERSION_MINOR, ffi.MD_TRAITS) == (8, 24, 28, 32)
    assert (ffi.MD_STRUCT_SIZE, ffi.MDX_STRUCT_SIZE, ffi.VERSION_STRUCT_SIZE) == (36, 32, 24)
    assert (ffi.API_ERROR_CREATE, ffi.ERR_MESSAGE, ffi.ERR_ERRC, ffi.ERR_STRUCT_SIZE) == (48, 16, 24, 28)


def test_handler_answers_metadata_query_and_ignores_other_stages():
    md = ffi._Metadata(struct_size=ffi.MD_STRUCT_SIZE)
    md.api_version.major_version = md.api_version.minor_version = -1
    md.traits = 0xFFFF
    ext = ffi._MetadataExtension()
    ext.extension_base.struct_size = ffi.MDX_STRUCT_SIZE
    ext.extension_base.type = ffi.EXTENSION_METADATA
    ext.metadata = ctypes.addressof(md)
    frame = ffi._CallFrame(struct_size=ffi.CF_STRUCT_SIZE, extension_start=ctypes.addressof(ext))
    assert cold_handler._handler.ctypes(ctypes.addressof(frame)) == 0
    assert (md.api_version.major_version, md.api_version.minor_version) == ffi.FFI_API_VERSION
    assert md.api_version.struct_size == ffi.VERSION_STRUCT_SIZE and md.traits == 0
    # instantiate / prepare / initialize stages: nothing to do, no error, arguments not touched (all NULL here)
    for stage in (0, 1, 2):
        frame = ffi._CallFrame(struct_size=ffi.CF_STRUCT_SIZE, stage=stage)
        assert cold_handler._handler.ctypes(ctypes.addressof(frame)) == 0


# ------------------------------------------------------------------------------------------------------------
# through the bridge, inside jax.jit

def make_cold(rng, d, sizes, activation, scale=1.0):
    layers = [make_layer(rng, d, c, activation, scale) for c in sizes]
    cold = bridge.ColdFFN([l[1] for l in layers], [l[2] for l in layers],
                          None if activation == "relu" else [l[0] for l in layers],
                          [l[3] for l in layers] if activation == "relu" else None, activation=activation)
    return cold, layers


@pytest.mark.parametrize("activation", ACTS)
def test_bridge_in_jit_matches_reference(activation):
    rng = np.random.default_rng(11 + ACTS.index(activation))
    d, sizes, k = 33, [7, 0, 1, 40], 16
    cold, layers = make_cold(rng, d, sizes, activation)
    f = jax.jit(lambda layer, x, ids, count: cold(layer, x, ids, count,
                                                  out_init=jnp.full(x.shape, jnp.nan, jnp.float32)))
    g = jax.jit(cold.__call__, static_argnums=0)  # layer as a compile-time constant, no out_init
    for l, c in enumerate(sizes):
        gate, up, down, bias = layers[l]
        x = rng.standard_normal(d).astype(np.float32)
        ids = np.concatenate([rng.permutation(c), rng.integers(-3, c + 3, size=k)])[:k].astype(np.int32)
        ids = np.pad(ids, (0, k - ids.size))
        for count in {0, min(c, k), int(rng.integers(0, k + 1)), k + 5}:
            want = kernels.cold_ffn_ref(x, gate, up, down, bias, ids, count, activation)
            got = np.asarray(f(l, x, ids, count))
            if min(count, k) == 0 or c == 0:
                assert np.array_equal(got, np.zeros(d, np.float32))
            assert_close(got, want)
            assert_close(g(l, x, ids, count), want)
        if c:  # every row once == the dense FFN of the layer
            full = rng.permutation(c).astype(np.int32)
            assert_close(f(l, x, full, c), kernels.dense_ffn_ref(x, gate, up, down, bias, activation))


def test_bridge_big_layer_threads_and_numpy_call():
    rng = np.random.default_rng(5)
    d, c = 576, 1536
    cold, layers = make_cold(rng, d, [c], "swiglu")
    gate, up, down, _ = layers[0]
    x = rng.standard_normal(d).astype(np.float32)
    ids = rng.permutation(c).astype(np.int32)
    f = jax.jit(lambda x, ids, n: cold(0, x, ids, n, out_init=jnp.full(x.shape, jnp.nan, jnp.float32)))
    before = cold_handler.executions()
    saved = cold_handler.get_num_threads()
    try:
        for nt in (1, 2):
            cold_handler.set_num_threads(nt)
            for count in (0, 768, c):
                want = kernels.cold_ffn_ref(x, gate, up, down, None, ids, count, "swiglu")
                assert_close(f(x, ids, count), want)
                assert_close(cold.numpy_call(0, x, ids, count), want)
    finally:
        cold_handler.set_num_threads(saved)
    assert cold_handler.executions() - before == 6
    assert_close(f(x, ids, c), kernels.dense_ffn_ref(x, gate, up, down, None, "swiglu"))


@pytest.mark.parametrize("loop", ["fori_loop", "while_loop"])
def test_bridge_in_loop_over_layers_merged_with_jnp(loop):
    """A toy decoder: per layer, a dense 'hot' part in jnp plus the cold part from the bridge."""
    rng = np.random.default_rng(21)
    d, sizes, k, activation = 576, [96, 0, 1, 7, 200], 64, "swiglu"
    n_layers = len(sizes)
    cold, layers = make_cold(rng, d, sizes, activation, scale=0.5)
    hot = (rng.standard_normal((n_layers, d, d)) * 0.3 / np.sqrt(d)).astype(np.float32)
    ids = np.zeros((n_layers, k), np.int32)
    counts = np.zeros(n_layers, np.int32)
    for l, c in enumerate(sizes):
        n = min(c, k)
        ids[l, :n] = rng.choice(c, size=n, replace=False) if c else []
        ids[l, n:] = rng.integers(0, max(c, 1), size=k - n)  # junk past count
        counts[l] = int(rng.integers(0, n + 1)) if l % 2 else n
    x = rng.standard_normal(d).astype(np.float32)

    def layer_step(l, h):
        y = cold(l, h, ids_d[l], counts_d[l])
        return h + jnp.tanh(hot_d[l] @ h) + y * 0.5

    ids_d, counts_d, hot_d = jnp.asarray(ids), jnp.asarray(counts), jnp.asarray(hot)
    if loop == "fori_loop":
        f = jax.jit(lambda x: jax.lax.fori_loop(0, n_layers, layer_step, x))
    else:
        f = jax.jit(lambda x: jax.lax.while_loop(lambda s: s[0] < n_layers,
                                                 lambda s: (s[0] + 1, layer_step(s[0], s[1])), (0, x))[1])
    h = x.astype(np.float64)
    for l in range(n_layers):
        gate, up, down, bias = layers[l]
        y = kernels.cold_ffn_ref(h.astype(np.float32), gate, up, down, bias, ids[l], counts[l], activation)
        h = h + np.tanh(hot[l].astype(np.float64) @ h) + 0.5 * y
    assert_close(f(x), h.astype(np.float32), rtol=2e-4)
    assert_close(f(x), f(x), rtol=0)  # deterministic


def test_two_instances_and_vmap():
    rng = np.random.default_rng(31)
    d = 33
    a, la = make_cold(rng, d, [7, 12], "reglu")
    b, lb = make_cold(rng, d, [12, 5, 1], "relu")
    x = rng.standard_normal(d).astype(np.float32)
    ids = np.array([4, 0, 6, 2, 1], np.int32)

    @jax.jit
    def both(x):
        return a(1, x, ids, 5), b(0, x, ids, 5), a(1, x, ids, 5) - b(0, x, ids, 5)

    ya, yb, diff = both(x)
    want_a = kernels.cold_ffn_ref(x, la[1][0], la[1][1], la[1][2], None, ids, 5, "reglu")
    want_b = kernels.cold_ffn_ref(x, None, lb[0][1], lb[0][2], lb[0][3], ids, 5, "relu")
    assert_close(ya, want_a)
    assert_close(yb, want_b)
    assert_close(diff, want_a - want_b)
    assert not np.allclose(np.asarray(ya), np.asarray(yb))

    # vmap over a batch of tokens (and layers): the handler loops over the batch
    xs = rng.standard_normal((3, d)).astype(np.float32)
    idss = np.stack([rng.permutation(12)[:6] for _ in range(3)]).astype(np.int32)
    cnts = np.array([6, 0, 3], np.int32)
    layers = np.array([0, 1, 0], np.int32)
    got = jax.jit(jax.vmap(b))(layers, xs, idss, cnts)
    for i in range(3):
        gate, up, down, bias = lb[layers[i]]
        assert_close(got[i], kernels.cold_ffn_ref(xs[i], gate, up, down, bias, idss[i], cnts[i], "relu"))
    got = jax.jit(jax.vmap(lambda x, i, n: a(1, x, i, n)))(xs, idss, cnts)  # layer broadcast
    for i in range(3):
        assert_close(got[i], kernels.cold_ffn_ref(xs[i], *la[1][:3], None, idss[i], cnts[i], "reglu"))


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_masked_bridge_matches_reference_and_per_token_calls(activation):
    rng = np.random.default_rng(71 + ACTS.index(activation))
    d, sizes, n = 33, [40, 0, 7, 300], 37   # the 300-row layer is above SERIAL_FLOATS: every thread joins
    cold, layers = make_cold(rng, d, sizes, activation)
    xs = rng.standard_normal((n, d)).astype(np.float32)
    for layer, c in enumerate(sizes):
        mask = random_mask(rng, n, c)
        got = jax.jit(cold.masked, static_argnums=0)(layer, xs, mask)
        assert_close(got, masked_reference(layers[layer], xs, mask, activation))
        for b in (0, 1, n - 1):  # the one-token form on the same active set (none, all, some active)
            ids = np.concatenate([np.flatnonzero(mask[b]), np.zeros(c - mask[b].sum(), int)]).astype(np.int32)
            assert_close(got[b], cold(layer, xs[b], ids, int(mask[b].sum())))
    with pytest.raises(ValueError, match="mask must be"):
        cold.masked(0, xs, np.ones((n, 7), bool))
    with pytest.raises(ValueError, match="layer must be"):
        jax.jit(cold.masked)(0, xs, np.ones((n, 40), bool))  # a traced layer: the mask's width depends on it
    cold.close()
    with pytest.raises(RuntimeError):
        cold.masked(0, xs, np.ones((n, 40), bool))


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_int8_cold_ffn_through_the_bridge(activation):
    rng = np.random.default_rng(101 + ACTS.index(activation))
    d, sizes, n = 33, [40, 0, 300], 37
    layers = [make_layer(rng, d, c, activation) for c in sizes]
    args = ([l[1] for l in layers], [l[2] for l in layers], None if activation == "relu" else [l[0] for l in layers],
            [l[3] for l in layers] if activation == "relu" else None)
    f32 = bridge.ColdFFN(*args, activation=activation)
    q8 = bridge.ColdFFN(*args, activation=activation, weights="int8")
    rows, blocks = (2 if activation == "relu" else 3), -(-d // kernels.QBLOCK)
    extra = 4 * sum(sizes) if activation == "relu" else 0       # the float32 bias
    assert f32.nbytes == 4 * rows * d * sum(sizes) + extra
    assert q8.nbytes == rows * d * sum(sizes) + 4 * 3 * blocks * sum(sizes) + extra   # int8 rows + block scales
    xs = rng.standard_normal((n, d)).astype(np.float32)
    for layer, c in enumerate(sizes):
        deq = quantized(layers[layer])[1]
        mask = random_mask(rng, n, c)
        assert_close(jax.jit(q8.masked, static_argnums=0)(layer, xs, mask),
                     masked_reference(deq, xs, mask, activation), rtol=1e-4)
        ids = rng.permutation(c).astype(np.int32)
        want = kernels.cold_ffn_ref(xs[0], deq[0], deq[1], deq[2], deq[3], ids, c // 2, activation)
        assert_close(jax.jit(q8.__call__, static_argnums=0)(layer, xs[0], ids, c // 2), want, rtol=1e-4)
        assert_close(q8.numpy_call(layer, xs[0], ids, c // 2), want, rtol=1e-4)
        # and close to the float32 rows it quantized: per-row int8 keeps about 2-3 significant digits
        got, exact = np.asarray(q8(layer, xs[0], ids, c)), np.asarray(f32(layer, xs[0], ids, c))
        assert np.abs(got - exact).max() <= 0.02 * max(1.0, np.abs(exact).max())
    with pytest.raises(ValueError, match="weights must be one of"):
        bridge.ColdFFN(*args, activation=activation, weights="int4")
    assert (f32.target, q8.target) == ("pjinfer_cold_ffn", "pjinfer_cold_ffn_int8")   # each refuses the other's table
    for cold, other, rows in ((f32, q8, "float32"), (q8, f32, "int8")):
        call = jax.ffi.ffi_call(other.target, jax.ShapeDtypeStruct((d,), np.float32))
        with pytest.raises(Exception, match=f"{other.target}: this ColdFFN's rows are {rows}: call {cold.target}\\b"):
            np.asarray(call(np.int32(0), xs[0], np.arange(4, dtype=np.int32), np.int32(4), table=np.int64(cold.table)))


def test_from_dense_compaction():
    rng = np.random.default_rng(41)
    d, f, activation = 33, 50, "geglu"
    dense = [make_layer(rng, d, f, activation) for _ in range(2)]
    cold_ids = [np.sort(rng.choice(f, size=20, replace=False)), np.array([], np.int64)]
    cold = bridge.ColdFFN.from_dense([l[1] for l in dense], [l[2] for l in dense], cold_ids,
                                     w_gate=[l[0] for l in dense], activation=activation)
    assert cold.n_cold == [20, 0]
    pos = cold.cold_position(0, f)
    assert pos.shape == (f,) and (pos >= 0).sum() == 20 and np.all(pos[cold_ids[0]] == np.arange(20))
    active_dense = rng.choice(cold_ids[0], size=8, replace=False)  # dense ids of active cold neurons
    x = rng.standard_normal(d).astype(np.float32)
    got = jax.jit(cold.__call__, static_argnums=0)(0, x, pos[active_dense], 8)
    gate, up, down, _ = dense[0]
    assert_close(got, kernels.cold_ffn_ref(x, gate, up, down, None, active_dense, 8, activation))
    assert np.array_equal(np.asarray(cold(1, x, np.arange(4, dtype=np.int32), 4)), np.zeros(d, np.float32))


def test_errors_are_reported_not_crashes():
    rng = np.random.default_rng(51)
    cold, _ = make_cold(rng, 33, [7, 3], "swiglu")
    x = rng.standard_normal(33).astype(np.float32)
    ids = np.arange(3, dtype=np.int32)
    with pytest.raises(ValueError):
        cold(2, x, ids, 3)  # static layer out of range
    with pytest.raises(ValueError):
        cold(0, np.zeros(32, np.float32), ids, 3)  # wrong d
    f = jax.jit(lambda l, x: cold(l, x, ids, 3))
    with pytest.raises(Exception, match="layer index out of range"):
        np.asarray(f(5, x))  # traced layer out of range: an XLA runtime error from the handler
    g = jax.jit(lambda x: cold(1, x, ids, 3))
    assert np.all(np.isfinite(np.asarray(g(x))))
    cold.close()
    with pytest.raises(Exception, match="was closed"):
        np.asarray(g(x + 1))  # compiled executable outlived the weights: error, not a read of freed memory
    with pytest.raises(RuntimeError):
        cold(0, x, ids, 3)


def test_concurrent_calls_from_threads():
    """Several Python threads running jitted bridge calls and direct locked calls at once (workqueue-safe)."""
    rng = np.random.default_rng(61)
    d, c = 576, 1536
    cold, layers = make_cold(rng, d, [c], "drelu")
    gate, up, down, _ = layers[0]
    f = jax.jit(lambda x, ids: cold(0, x, ids, 512))
    xs = rng.standard_normal((4, d)).astype(np.float32)
    idss = np.stack([rng.permutation(c) for _ in range(4)]).astype(np.int32)
    wants = [kernels.cold_ffn_ref(xs[i], gate, up, down, None, idss[i], 512, "drelu") for i in range(4)]
    f(xs[0], idss[0]).block_until_ready()
    errors = []

    def work(i):
        try:
            for _ in range(10):
                assert_close(f(xs[i], idss[i]), wants[i])
                assert_close(cold.numpy_call(0, xs[i], idss[i], 512), wants[i])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
