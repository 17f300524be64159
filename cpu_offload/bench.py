"""Measurements for the cold-neuron path: ``python -m cpu_offload.bench [--quick]``.

(a) per-call cost of the FFI bridge inside jit with no work (count 0), against jax.pure_callback doing the same;
(b) kernel bandwidth for one SmolLM2-sized layer (d 576, C 1536, 768 active): GB/s of weight bytes touched
    (3 rows x d x 4 bytes per active neuron), 1 vs 2 threads, cache-hot (one layer repeated) and from DRAM
    (30 distinct layers in turn, 318 MB);
(c) 30 such layers through the bridge in one jitted function (fori_loop over layers): ms per token;
(d) ``--gemv`` (alone): each block type's host GEMV (quants.gemv) on one thread over rows of 1536 columns, GB/s of
    matrix bytes from cache (one 4 MB matrix again and again) and from memory (4 MB matrices in turn, twice the
    last-level cache or 64 MB), as a share of the rate one thread reads those bytes at, with the ratio to Q4_1's
    and an MD5 of the output (equal across trees when the arithmetic is). Random bytes: speed only;
(e) ``--attention`` (alone): the host decode's attention (attention.attend_share) for one token on one thread, a
    SmolLM2 layer's shape (9 query heads, 3 KV heads, head_dim 64, float16 caches of 1024 positions), at several
    cache lengths: us a layer from L2 (one layer again and again) and from the last-level cache or DRAM (30 layers in
    turn, as a decode step reads them), with the GB/s of cache bytes read. Random values: speed only.
Reports medians over repeats (the machine may be shared; the load average is printed).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import time
from types import SimpleNamespace

from . import _numba  # noqa: F401  (the threading layer and the BLAS check, before numba is imported)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numba  # noqa: E402
import numpy as np  # noqa: E402

from . import attention, blocks, bridge, cold_handler, cpu_caches, kernels, quants  # noqa: E402


def _median_time(fn, repeats: int, inner: int = 1) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        ts.append((time.perf_counter() - t) / inner)
    return float(np.median(ts))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--gemv", action="store_true", help="only (d): each block type's GEMV on one thread")
    ap.add_argument("--attention", action="store_true", help="only (e): one token's attention on one thread")
    args = ap.parse_args(argv)
    reps = 5 if args.quick else 15
    if args.gemv:
        return gemv_table(reps)
    if args.attention:
        return attention_table(reps)

    print(f"numba {numba.__version__} layer {numba.config.THREADING_LAYER} threads {numba.config.NUMBA_NUM_THREADS}"
          f" | jax {jax.__version__} | load average {os.getloadavg()}")
    rng = np.random.default_rng(0)
    d, c, active, n_layers = 576, 1536, 768, 30
    scale = np.float32(1 / np.sqrt(d))
    ws = [[(rng.standard_normal((c, d), dtype=np.float32) * scale) for _ in range(3)] for _ in range(n_layers)]
    x0 = rng.standard_normal(d, dtype=np.float32)
    ids = np.stack([rng.permutation(c)[:active] for _ in range(n_layers)]).astype(np.int32)
    cold = bridge.ColdFFN([w[1] for w in ws], [w[2] for w in ws], [w[0] for w in ws], activation="swiglu")
    nbytes = active * 3 * d * 4
    setup = SimpleNamespace(d=d, c=c, active=active, n_layers=n_layers, ws=ws, x0=x0, ids=ids, cold=cold,
                            nbytes=nbytes)
    call_overhead(setup, reps)
    kernel_bandwidth(setup, reps)
    bridge_token(setup, reps)
    print(f"load average after: {os.getloadavg()}")


def attention_table(reps: int, lengths=(16, 128, 576, 1024), layers: int = 30) -> None:
    """(e) See the module docstring."""
    rng = np.random.default_rng(0)
    heads, kv, hd, rows = 9, 3, 64, 1024
    q = rng.standard_normal((heads, hd), dtype=np.float32)
    caches = [[rng.standard_normal((rows, kv, hd)).astype(np.float16).view(np.uint16) for _ in range(2)]
              for _ in range(layers)]
    scores, out = np.empty((heads, rows), np.float32), np.empty((heads, hd), np.float32)
    print(f"(e) one thread, {heads} query heads, {kv} KV heads, head_dim {hd}; us a layer from L2 | from the "
          f"last-level cache or DRAM ({layers} layers in turn, {layers * 2 * rows * kv * hd * 2 >> 20} MB)")

    def run(layer_ids, pos):
        for l in layer_ids:
            attention.attend_share(q, caches[l][0], caches[l][1], pos, 0, 1, scores, out)
    for length in lengths:
        cache_bytes = 2 * length * kv * hd * 2
        hot = _median_time(lambda: run([0], length - 1), reps, inner=200)
        turn = _median_time(lambda: run(range(layers), length - 1), reps, inner=10) / layers
        print(f"  {length:5d} positions: {hot * 1e6:7.1f} us ({cache_bytes / hot / 1e9:5.1f} GB/s) | "
              f"{turn * 1e6:7.1f} us ({cache_bytes / turn / 1e9:5.1f} GB/s)")


def gemv_table(reps: int, cols: int = 1536, matrix_bytes: int = 4 << 20, memory_bytes: int | None = None) -> None:
    """(d) See the module docstring; `memory_bytes` (default: twice the last-level cache, at least 64 MB) the bytes
    read in turn."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(cols, dtype=np.float32)
    matrices = -(-(memory_bytes or cpu_caches.beyond_caches(64 << 20)) // matrix_bytes)
    print(f"(d) one thread, {cols} columns, {matrix_bytes >> 20} MB a matrix; GB/s from cache | from memory "
          f"({matrices} matrices in turn, {matrices * matrix_bytes >> 20} MB) | share of one thread's read rate")
    rates, source_mats, read = {}, None, None
    for t in blocks.TYPES.values():
        if t.values is None:
            continue
        if t.group > 1:   # a relaid type (Q4_1x16): its source type's matrices, relaid (no draws from rng)
            rows = source_mats[0].shape[0] // t.group * t.group
            mats = [blocks.group_rows(m[:rows], cols) for m in source_mats]
        else:
            rows = matrix_bytes // t.row_bytes(cols)
            # Bytes below 0x3c: every float16 scale is then finite and under 1 in magnitude, so the outputs are
            # finite and their MD5 compares the arithmetic (no kernel's speed depends on the values). One draw,
            # copied: distinct memory to read, the same values.
            first = rng.integers(0, 0x3C, (rows, t.row_bytes(cols)), dtype=np.uint8)
            mats = [first] + [first.copy() for _ in range(matrices - 1)]
            if t.relayout("x16"):
                source_mats = mats
        y = np.zeros(rows, np.float32)
        hot = _median_time(lambda: quants.gemv(t.code, mats[0], x, y, 0, rows), reps, 10)
        digest = hashlib.md5(y.tobytes()).hexdigest()[:10]
        dram = _median_time(lambda: [quants.gemv(t.code, m, x, y, 0, rows) for m in mats], reps) / matrices
        if read is None:
            words = [m.reshape(-1)[:m.size // 8 * 8].view(np.uint64) for m in mats]
            read = sum(w.nbytes for w in words) / _median_time(lambda: [_read_all(w) for w in words], reps) / 1e9
            print(f"    one thread reads {read:.2f} GB/s from memory (a sum of the same matrices' words)")
        rates[t.name] = (mats[0].nbytes / hot / 1e9, mats[0].nbytes / dram / 1e9, digest)
    base_hot, base_dram, _ = rates["Q4_1"]   # each row against Q4_1's
    for name, (hot, dram, digest) in rates.items():
        print(f"    {name:7} {hot:6.2f} | {dram:6.2f} GB/s | {100 * dram / read:3.0f}% | {hot / base_hot:.2f}x, "
              f"{dram / base_dram:.2f}x Q4_1's | md5 {digest}")


@numba.njit(nogil=True, cache=True)
def _read_all(words):
    total = np.uint64(0)
    for i in range(words.shape[0]):
        total += words[i]
    return total


def call_overhead(setup, reps: int) -> None:
    """(a) What one bridge call costs inside jit, against pure_callback, and whether dispatch stays async."""
    d, ws, x0, ids, cold = setup.d, setup.ws, setup.x0, setup.ids, setup.cold
    # (a) overhead per call, count 0: a fori_loop of N dependent calls, minus the same loop without the call.
    n_calls = 2000
    ids0 = jnp.asarray(ids[0])

    def loop(body):
        return jax.jit(lambda x: jax.lax.fori_loop(0, n_calls, body, x))

    def host_zero(x, ids_, count):  # what pure_callback would do: run the kernel on closed-over host weights
        out = np.empty(d, np.float32)
        kernels.cold_ffn_nt(np.asarray(x), ws[0][0], ws[0][1], ws[0][2], kernels.empty_bias(), kernels.no_scales(),
                            np.asarray(ids_), int(count), 0, out, 2)
        return out

    variants = {
        "no call (loop baseline)": lambda i, x: x * 0.5 + 1.0,
        "FFI bridge, count 0": lambda i, x: x * 0.5 + 1.0 + cold(0, x, ids0, 0),
        "pure_callback, count 0": lambda i, x: x * 0.5 + 1.0 + jax.pure_callback(
            host_zero, jax.ShapeDtypeStruct((d,), jnp.float32), x, ids0, jnp.int32(0)),
    }
    x_dev = jnp.asarray(x0)
    per = {}
    for name, body in variants.items():
        f = loop(body)
        per[name] = _median_time(lambda: f(x_dev).block_until_ready(), max(3, reps // 3)) / n_calls
    base = per["no call (loop baseline)"]
    print("(a) per call inside one jit (fori_loop of %d dependent calls):" % n_calls)
    for name, t in per.items():
        extra = "" if name.startswith("no call") else f"  -> {1e6 * (t - base):.2f} us over the baseline"
        print(f"    {name:28s} {1e6 * t:8.2f} us/iteration{extra}")
    # one call per dispatch: what a caller sees for a tiny jitted function
    f1 = jax.jit(lambda x: cold(0, x, ids0, 0))
    f0 = jax.jit(lambda x: x * 0.5 + 1.0)
    fp = jax.jit(lambda x: jax.pure_callback(host_zero, jax.ShapeDtypeStruct((d,), jnp.float32), x, ids0,
                                             jnp.int32(0)))
    for name, f in [("jit(x*0.5+1)", f0), ("jit(bridge count 0)", f1), ("jit(pure_callback count 0)", fp)]:
        t = _median_time(lambda: f(x_dev).block_until_ready(), reps, 200)
        print(f"    one dispatch + block, {name:28s} {1e6 * t:8.1f} us")
    # async dispatch: enqueue 200 calls without blocking
    for name, f in [("bridge", f1), ("pure_callback", fp)]:
        f(x_dev).block_until_ready()
        t = time.perf_counter()
        outs = [f(x_dev) for _ in range(200)]
        t_enqueue = (time.perf_counter() - t) / 200
        outs[-1].block_until_ready()
        t_all = (time.perf_counter() - t) / 200
        print(f"    async: 200 x jit({name}) enqueue {1e6 * t_enqueue:.1f} us/call, until last ready "
              f"{1e6 * t_all:.1f} us/call")


def kernel_bandwidth(setup, reps: int) -> None:
    """(b) The cold-neuron kernel called directly: GB/s cache-hot and from DRAM."""
    d, c, active, n_layers, ws, x0, ids, nbytes = (setup.d, setup.c, setup.active, setup.n_layers, setup.ws, setup.x0,
                                                   setup.ids, setup.nbytes)
    # (b) kernel bandwidth, direct calls
    out = np.empty(d, np.float32)
    empty_b, no_s = kernels.empty_bias(), kernels.no_scales()
    print(f"(b) kernel, d={d} C={c} active={active}: {nbytes / 1e6:.2f} MB of weight rows per call")
    for nt in (1, 2):
        hot = _median_time(lambda: kernels.cold_ffn_nt(x0, *ws[0], empty_b, no_s, ids[0], active, 0, out, nt), reps, 50)

        def rotate():
            for l in range(n_layers):
                kernels.cold_ffn_nt(x0, *ws[l], empty_b, no_s, ids[l], active, 0, out, nt)
        dram = _median_time(rotate, reps) / n_layers
        print(f"    {nt} thread(s): cache-hot {1e6 * hot:7.1f} us = {nbytes / hot / 1e9:5.1f} GB/s | "
              f"30 layers in turn {1e6 * dram:7.1f} us = {nbytes / dram / 1e9:5.1f} GB/s")


def bridge_token(setup, reps: int) -> None:
    """(c) A 30-layer token through the bridge in one jitted function, against callbacks and direct calls."""
    d, active, n_layers, ws, x0, ids, cold, nbytes = (setup.d, setup.active, setup.n_layers, setup.ws, setup.x0,
                                                      setup.ids, setup.cold, setup.nbytes)
    x_dev = jnp.asarray(x0)
    out = np.empty(d, np.float32)
    empty_b, no_s = kernels.empty_bias(), kernels.no_scales()
    # (c) 30 layers through the bridge in one jitted function
    ids_dev = jnp.asarray(ids)
    counts = jnp.full((n_layers,), active, jnp.int32)

    @jax.jit
    def token(x):
        def body(l, h):
            return h + 0.1 * cold(l, h, ids_dev[l], counts[l])
        return jax.lax.fori_loop(0, n_layers, body, x)

    @jax.jit
    def token_unrolled(x):
        h = x
        for l in range(n_layers):
            h = h + 0.1 * cold(l, h, ids_dev[l], counts[l])
        return h

    def host_layer(l, h, ids_, count):
        out_ = np.empty(d, np.float32)
        l = int(l)
        kernels.cold_ffn_nt(np.asarray(h), *ws[l], empty_b, no_s, np.asarray(ids_), int(count), 0, out_,
                            cold_handler.get_num_threads())
        return out_

    @jax.jit
    def token_callback(x):
        def body(l, h):
            y = jax.pure_callback(host_layer, jax.ShapeDtypeStruct((d,), jnp.float32), l, h, ids_dev[l], counts[l])
            return h + 0.1 * y
        return jax.lax.fori_loop(0, n_layers, body, x)

    def numpy_token(nt):
        h = x0.copy()
        for l in range(n_layers):
            kernels.cold_ffn_nt(h, *ws[l], empty_b, no_s, ids[l], active, 0, out, nt)
            h = h + np.float32(0.1) * out
        return h

    ref = numpy_token(2)
    got = np.asarray(token(x_dev))
    assert np.allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max()), "bridge disagrees with direct calls"
    saved_threads = cold_handler.get_num_threads()
    print(f"(c) {n_layers} layers x {active} active cold neurons per token ({n_layers * nbytes / 1e6:.0f} MB):")
    for nt in (1, 2):
        cold_handler.set_num_threads(nt)
        t_loop = _median_time(lambda: token(x_dev).block_until_ready(), reps)
        t_unr = _median_time(lambda: token_unrolled(x_dev).block_until_ready(), reps)
        t_np = _median_time(lambda: numpy_token(nt), reps)
        t_cb = _median_time(lambda: token_callback(x_dev).block_until_ready(), reps)
        print(f"    {nt} thread(s): bridge jit fori_loop {1e3 * t_loop:6.2f} ms/token "
              f"({n_layers * nbytes / t_loop / 1e9:4.1f} GB/s) | bridge jit unrolled {1e3 * t_unr:6.2f} ms | "
              f"pure_callback fori_loop {1e3 * t_cb:6.2f} ms | Python loop of direct calls {1e3 * t_np:6.2f} ms")
    cold_handler.set_num_threads(saved_threads)
    sorted_ids_and_async(setup, reps, token, counts, x_dev)


def sorted_ids_and_async(setup, reps: int, token, counts, x_dev) -> None:
    """(c, cont.) The same token with its active ids sorted, and whether async dispatch is kept."""
    ids, cold, n_layers, nbytes = setup.ids, setup.cold, setup.n_layers, setup.nbytes
    saved_threads = cold_handler.get_num_threads()
    ids_sorted = jnp.asarray(np.sort(ids, axis=1))

    @jax.jit
    def token_sorted(x):
        return jax.lax.fori_loop(0, n_layers, lambda l, h: h + 0.1 * cold(l, h, ids_sorted[l], counts[l]), x)
    t_sorted = _median_time(lambda: token_sorted(x_dev).block_until_ready(), reps)
    print(f"    default ({saved_threads} thread(s)), active ids sorted ascending (as jnp.nonzero gives them): "
          f"{1e3 * t_sorted:6.2f} ms/token ({n_layers * nbytes / t_sorted / 1e9:4.1f} GB/s)")
    token(x_dev).block_until_ready()
    t = time.perf_counter()
    y = token(x_dev)
    t_enq = time.perf_counter() - t
    y.block_until_ready()
    t_all = time.perf_counter() - t
    print(f"    async dispatch kept ({saved_threads} thread(s)): token(x) returns after {1e3 * t_enq:.2f} ms, result ready after "
          f"{1e3 * t_all:.2f} ms")
    cold_handler.set_num_threads(saved_threads)


if __name__ == "__main__":
    main()
