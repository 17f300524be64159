"""cpu_offload.host_decode and q4: the quantized decode step on the host, against numpy and against XLA on the same
values."""
from __future__ import annotations

import numpy as np
import pytest

from cpu_offload import decoder, int8, q4, team
from tests.conftest import int8_values, q4_1, q4_1_values, q4_dot_tolerance, random_weights, tiny_config

jax = pytest.importorskip("jax")
jnp = jax.numpy


# ------------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("rows,cols", [(1, 64), (3, 64), (5, 192), (37, 128), (130, 576), (23, 8192)])
def test_gemv_matches_numpy_on_its_rows_only(rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols)
    q, s = int8.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.1, 3, (rows, 1)))
    x = rng.standard_normal(cols).astype(np.float32)
    want = int8_values(q, s) @ x
    for lo, hi in [(0, rows), (0, 0), (rows // 2, rows), (1 % rows, max(1 % rows, rows - 1))]:
        y = np.full(rows, np.nan, np.float32)
        int8.gemv(q, s, x, y, lo, hi)
        np.testing.assert_allclose(y[lo:hi], want[lo:hi], rtol=1e-5, atol=1e-5 * np.abs(want).max())
        assert np.isnan(y[:lo]).all() and np.isnan(y[hi:]).all()


def _q4_matrix(rng, rows, cols):
    """A random matrix with a spread of block ranges, a constant block and a block of one outlier."""
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.1, 3, (rows, 1)).astype(np.float32)
    w[0, :32] = 0.25
    if rows > 1:
        w[1, :32] = 0.0
        w[1, 5] = -7.0
    return w


@pytest.mark.parametrize("rows,cols", [(1, 32), (3, 64), (5, 96), (37, 576), (130, 1536)])
def test_q4_quantize_rounds_to_the_nearest_step_and_round_trips(rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols)
    w = _q4_matrix(rng, rows, cols)
    blocks = q4_1(w)
    assert blocks.shape == (rows, cols // 32 * 20) and blocks.dtype == np.uint8
    back = q4_1_values(blocks, cols)
    b = w.reshape(rows, -1, 32)
    step = (b.max(-1) - b.min(-1)) / 15
    # Half a step, plus float16's rounding of d (times q <= 15) and of the block minimum.
    slack = step / 2 + 15 * step * 2.0 ** -11 + np.abs(b.min(-1)) * 2.0 ** -11 + 1e-7
    assert (np.abs(back - w).reshape(rows, -1, 32).max(-1) <= slack).all()
    np.testing.assert_array_equal(back[0, :32], 0.25)  # a constant block is exact (d = 0)
    np.testing.assert_array_equal(q4_1(back), blocks)  # the values it stands for quantize to themselves
    with pytest.raises(ValueError, match="multiple of 32"):
        q4_1(np.zeros((2, 48), np.float32))


@pytest.mark.parametrize("rows,cols", [(1, 32), (3, 64), (5, 96), (37, 576), (130, 1536), (19, 7168)])
def test_q4_gemv_matches_numpy_on_its_rows_only(rows, cols):
    rng = np.random.default_rng(rows * 7 + cols)
    blocks = q4_1(_q4_matrix(rng, rows, cols))
    x = rng.standard_normal(cols).astype(np.float32)
    want = q4_1_values(blocks, cols).astype(np.float64) @ x
    for lo, hi in [(0, rows), (0, 0), (rows // 2, rows), (1 % rows, max(1 % rows, rows - 1))]:
        y = np.full(rows, np.nan, np.float32)
        q4.gemv(blocks, x, y, lo, hi)
        err = np.abs(y[lo:hi] - want[lo:hi])
        assert (err <= q4_dot_tolerance(blocks, cols, x)[0, lo:hi]).all(), err.max()
        assert np.isnan(y[:lo]).all() and np.isnan(y[hi:]).all()


def test_rows_ahead_go_to_l2_only_where_they_and_the_input_crowd_l1():
    """kernels.ahead_into_l2 for the GEMVs' shapes (input bytes, row bytes, rows ahead). The widest two cases above
    (8192 int8 columns, 7168 Q4_1 columns) take the L2 branch."""
    from cpu_offload.blocks import Q4_1, TYPES
    from cpu_offload.kernels import ahead_into_l2
    row_bytes = TYPES[Q4_1].row_bytes
    d, ff = 576, 1536                                    # the default model: every matrix and the head into L1
    assert not ahead_into_l2(4 * d, row_bytes(d), q4.PREFETCH_ROWS)
    assert not ahead_into_l2(4 * ff, row_bytes(ff), q4.PREFETCH_ROWS)
    assert not ahead_into_l2(4 * d, d, int8.PREFETCH_ROWS)
    assert not ahead_into_l2(4 * 2048, row_bytes(2048), q4.PREFETCH_ROWS)   # a 1.5B model's gate
    assert ahead_into_l2(4 * 7168, row_bytes(7168), q4.PREFETCH_ROWS)       # and its down
    assert ahead_into_l2(4 * 8192, 8192, int8.PREFETCH_ROWS)


def test_team_runs_every_share_exactly_once():
    from numba import cfunc, types

    from cpu_offload.ffi import load_i64, store_i64

    @cfunc(types.void(types.int64, types.int64, types.int64))
    def task(arg, tid, n):  # counts[tid] += 1; sizes[tid] = n
        store_i64(arg + 8 * tid, load_i64(arg + 8 * tid) + 1)
        store_i64(arg + 8 * (8 + tid), n)

    for size in (1, 2, 3):
        crew = team.Team(size)
        words = np.zeros(16, np.int64)
        for _ in range(50):
            team.run(crew.address, task.address, words.ctypes.data)
        assert words[:size].tolist() == [50] * size and not words[size:8].any()
        assert words[8:8 + size].tolist() == [size] * size


def test_an_idle_team_costs_almost_no_cpu():
    """A worker with no task sleeps longer the longer it waits (team.SLEEP_MAX_US): a benchmark of a peer beside an
    idle engine must get the cores. Its thread's CPU time over a second, once idle, is well under 3% of a core (a
    sleep that never grew took several times that on a VM)."""
    import os
    import time

    from numba import cfunc, types

    @cfunc(types.void(types.int64, types.int64, types.int64))
    def task(arg, tid, n):
        pass

    crew = team.Team(2)
    team.run(crew.address, task.address, 0)
    time.sleep(0.5)                                    # past the yields and the first, short sleeps

    def cpu_seconds(tid):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    if not os.path.exists("/proc/self/task"):
        pytest.skip("no /proc")
    tid = crew.threads[0].native_id
    before, start = cpu_seconds(tid), time.monotonic()
    time.sleep(1.0)
    assert cpu_seconds(tid) - before < 0.03 * (time.monotonic() - start)
    crew.stop()


def test_team_workers_run_any_number_of_tasks_in_a_fixed_stack():
    """A worker loops for the life of the process, so nothing it does per task may take stack that is only freed
    when it returns (an alloca in the loop: taking the caller's MXCSR took 16 bytes a task, and a server's worker
    overflowed its 8 MiB stack after about 500,000 tasks, some 3,300 decoded tokens). Here the worker gets a 256 KiB
    stack and runs 200,000 tasks, in a child process because the fault is a segfault."""
    import subprocess
    import sys

    code = """
import threading
threading.stack_size(256 * 1024)
import numpy as np
from numba import cfunc, types
from cpu_offload import team
from cpu_offload.ffi import load_i64, store_i64

@cfunc(types.void(types.int64, types.int64, types.int64))
def task(arg, tid, n):
    store_i64(arg + 8 * tid, load_i64(arg + 8 * tid) + 1)

crew = team.Team(2)
words = np.zeros(2, np.int64)
for _ in range(200_000):
    team.run(crew.address, task.address, words.ctypes.data)
assert words.tolist() == [200_000, 200_000], words
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])


def test_a_team_stopped_during_a_run_finishes_it_and_later_runs_work_alone():
    """At exit every team is stopped (atexit) while an XLA computation may still be in a handler's run: a decode
    that Ctrl-C interrupted while the caller waited. The stop waits for that run (it takes the FFI lock handlers
    hold), and runs after it do every share on the caller's thread: nothing waits for workers that are gone (it
    did: `pjinfer chat`, Ctrl-C then Ctrl-D, spun forever at exit). In a child process, because the fault is a
    hang."""
    import subprocess
    import sys

    code = """
import threading, time
import numpy as np
from numba import cfunc, types
from cpu_offload import ffi, team
from cpu_offload.ffi import load_i64, store_i64

@cfunc(types.void(types.int64, types.int64, types.int64))
def slow(arg, tid, n):   # words[8] = 1 once started; a long loop (its sum kept in words[9 + tid]); words[tid] += 1
    store_i64(arg + 64, 1)
    k = load_i64(arg + 8 * (9 + tid))
    for i in range(300_000_000):
        k = (k * 3 + i) & 0xFFFFFF
    store_i64(arg + 8 * (9 + tid), k)
    store_i64(arg + 8 * tid, load_i64(arg + 8 * tid) + 1)

crew = team.Team(2)
words = np.zeros(11, np.int64)

def handler():           # as an FFI handler does: its runs under the lock
    ffi.lock(ffi.RUNTIME_ADDR)
    team.run(crew.address, slow.address, words.ctypes.data)
    ffi.unlock(ffi.RUNTIME_ADDR)

inflight = threading.Thread(target=handler)
inflight.start()
while words[8] == 0:
    time.sleep(0.001)
crew.stop()
assert words[:2].tolist() == [1, 1], words          # the run in flight finished with its worker first
inflight.join()
team.run(crew.address, slow.address, words.ctypes.data)
assert words[:2].tolist() == [2, 2], words          # after the stop: both shares, on this thread
assert not any(t.is_alive() for t in crew.threads)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])


# ------------------------------------------------------------------------------------------------ whole model
def _models(config, seed=0, fmt="int8"):
    """(host-decode model, XLA reference on the same dequantized weights, the HostDecoder)."""
    from pjinfer.runtime import host as pjinfer_host
    from pjinfer.runtime.model import Transformer

    weights = random_weights(config, seed)
    host = decoder.HostDecoder(config, weights, fmt)
    values = host.dequantized(weights)
    model = Transformer(config, values)
    pjinfer_host.attach(model, host)
    return model, Transformer(config, values), host


def _decode(model, tokens, cache_len):
    """Logits [T, vocab] and the final caches of one-token decode steps through jit (cache donated)."""
    from flax import nnx

    from pjinfer.runtime.model import KVCache

    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, t, p, c: nnx.merge(graphdef, s).decode(t, p, c), donate_argnums=(3,))
    # Committed as the steps' outputs are: an uncommitted first cache is another signature, a second compile.
    cache = jax.device_put(KVCache.create(model.config, 1, cache_len), jax.devices()[0])
    out = []
    for pos, token in enumerate(tokens):
        logits, cache = step(state, jnp.int32(token), jnp.int32(pos), cache)
        out.append(np.asarray(logits))
    return np.stack(out), cache


@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "reglu", "drelu"])
def test_host_decode_equals_xla_on_the_same_values(activation, fmt):
    config = tiny_config(activation=activation, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=192,
                         tie_embeddings=activation != "reglu")
    model, reference, host = _models(config, fmt=fmt)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, 9)
    got, got_cache = _decode(model, tokens, 16)
    want, want_cache = _decode(reference, tokens, 16)
    # The caches are float16: a value the two paths compute a hair apart can round to neighbouring steps.
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=5e-4 * np.abs(want).max())
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):  # float16: a few steps apart
        assert a.dtype == b.dtype == jnp.float16
        b = np.asarray(b, np.float32)
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=4e-3, atol=1e-3 * np.abs(b).max())
    # The quantization is real: the original weights give other logits.
    from pjinfer.runtime.model import Transformer

    original, _ = _decode(Transformer(config, random_weights(config)), tokens, 16)
    assert np.abs(original - want).max() > 1e-3


def test_a_clocked_decoder_counts_its_stages_and_calls_only_while_clocked():
    """HostDecoder.clocked: every stage of the layers and the head, the waits at their ends and the calls
    themselves get time-stamp cycles, nested as they run and within the wall time; outside the block, nothing."""
    from cpu_offload.team import read_cycles
    from cpu_offload.host_decode import CLK_HEADS, CLK_LAYERS, CLK_WAIT, ST_DOWN, ST_HEAD

    config = tiny_config(d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=192)
    model, _, host = _models(config, fmt="q4_1")
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, 5)
    _decode(model, tokens, 8)   # compiled
    with host.clocked() as clocks:
        start = read_cycles()
        _decode(model, tokens, 8)
        wall = read_cycles() - start
    stages = clocks[:ST_HEAD + 1]
    assert (stages > 0).all(), clocks
    assert clocks[CLK_LAYERS] >= stages[:ST_DOWN + 1].sum() and clocks[CLK_HEADS] >= stages[ST_HEAD]
    assert clocks[CLK_LAYERS] + clocks[CLK_HEADS] < wall
    assert 0 <= clocks[CLK_WAIT] < stages.sum() and (clocks[CLK_WAIT] == 0) == (team.default_size() == 1)
    counted = clocks.copy()
    _decode(model, tokens, 8)
    np.testing.assert_array_equal(clocks, counted)


@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
def test_callback_bridge_decodes_as_the_ffi_bridge_bit_for_bit(fmt):
    """The host decode through host_call.on_host (forced on the CPU), against the FFI target called directly, on the
    same weights: every step's logits and the final caches are the same bits (layers and head through the bridge,
    the caches travelling to the host and back)."""
    from pjinfer.runtime import host as pjinfer_host
    from pjinfer.runtime.model import Transformer

    config = tiny_config(activation="reglu", d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=192)
    weights = random_weights(config, seed=int(np.random.default_rng().integers(1 << 30)))
    models = []
    for bridge in ("ffi", "callback"):
        host = decoder.HostDecoder(config, weights, fmt, bridge=bridge)
        model = Transformer(config, host.dequantized(weights))
        pjinfer_host.attach(model, host)
        models.append(model)
    tokens = np.random.default_rng().integers(0, config.vocab_size, 6)
    (want, want_cache), (got, got_cache) = (_decode(m, tokens, 8) for m in models)
    np.testing.assert_array_equal(got, want)
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="bridge must be one of"):
        decoder.HostDecoder(config, weights, fmt, bridge="auto")


@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
def test_last_cache_slot_and_positions_past_the_cache(fmt):
    config = tiny_config(d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=128)
    model, reference, host = _models(config, fmt=fmt)
    tokens = np.arange(16) % config.vocab_size
    got, _ = _decode(model, tokens, 16)  # the last step writes slot 15 of 16
    want, _ = _decode(reference, tokens, 16)
    # The caches are float16: a value the two paths compute a hair apart can round to neighbouring steps.
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=5e-4 * np.abs(want).max())
    from pjinfer.runtime.model import KVCache

    cache = KVCache.create(config, 1, 16)
    with pytest.raises(Exception, match="position outside the cache"):
        jax.block_until_ready(jax.jit(lambda x, k, v: host.layer(0, x, 16, k, v))(
            jnp.ones((1, 1, 64)), cache.k[0], cache.v[0]))
    with pytest.raises(ValueError, match="layer 2 out of range"):
        host.layer(2, jnp.ones((1, 1, 64)), 0, cache.k[0], cache.v[0])


@pytest.mark.parametrize("changes,fragment", [
    (dict(arch="opt", activation="relu"), "Llama-family"),
    (dict(d_model=48), "d_model to be a multiple of 64"),
    (dict(d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=72), "d_ff to be a multiple of 64"),
    (dict(d_model=64, n_heads=8, n_kv_heads=2, head_dim=8, d_ff=128), "head_dim to be a multiple of 16 up to 256"),
    (dict(d_model=320, n_heads=1, n_kv_heads=1, head_dim=320, d_ff=128), "head_dim to be a multiple of 16 up to 256"),
])
def test_unsupported_models_are_refused(changes, fragment):
    config = tiny_config(**changes)
    with pytest.raises(ValueError, match=fragment):
        decoder.HostDecoder(config, random_weights(config))


def test_unknown_formats_are_refused():
    config = tiny_config(d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=128)
    with pytest.raises(ValueError, match="one of int8, q4_1, gguf, got 'q4_0'"):
        decoder.HostDecoder(config, random_weights(config), "q4_0")


def test_calls_name_the_table_by_index_so_executables_can_be_cached_across_processes():
    """The FFI attribute is the decoder's index in tables.TABLES, not its address: an executable's HLO (JAX's
    persistent-cache key) is then the same in the next process that builds the same decoders."""
    from cpu_offload import tables

    config = tiny_config(d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=128)
    a, b = (decoder.HostDecoder(config, random_weights(config, seed), "q4_1") for seed in (0, 1))
    assert b.table == a.table + 1 and tables.TABLES[a.table] == a.address and tables.TABLES[b.table] == b.address
    texts = [jax.jit(h.head).lower(jnp.ones(64, jnp.float32)).as_text() for h in (a, b)]
    assert str(a.address) not in texts[0] and str(b.address) not in texts[1]
    assert texts[0].replace(f"table = {a.table} ", f"table = {b.table} ") == texts[1]
    np.testing.assert_allclose(np.asarray(a.head(jnp.ones(64, jnp.float32))),
                               a._head.float32() @ np.ones(64, np.float32), rtol=1e-4, atol=1e-4)


def test_a_new_process_loads_every_handler_from_numbas_cache():
    """Start-up: every FFI handler and team stage (cfuncs) comes from Numba's on-disk cache in the next process,
    none compiled again: compiling them is most of a cold start. A handler that held a jitted function's object
    address (one passed as a value to a compiled call; ffi.serve and host_decode.serve are inlined for this)
    cannot be cached. This process loaded them first (each is loaded on first use: cpu_offload/cfuncs.py), so the
    cache is written."""
    import subprocess
    import sys

    from cpu_offload import batched_decode, cold_handler, host_decode, predicted_decode, sparse_decode

    for m, names in ((host_decode, ("handler_cfunc", "stage_cfunc")), (sparse_decode, ("_handler", "_stage")),
                     (batched_decode, ("_handler", "_stage")), (predicted_decode, ("_handler", "_stage")),
                     (cold_handler, ("_handler", "_handler_int8"))):
        for name in names:
            getattr(m, name).made()
    code = """
from cpu_offload import batched_decode, cold_handler, host_decode, predicted_decode, sparse_decode
funcs = {"host_decode.handler_cfunc": host_decode.handler_cfunc, "host_decode.stage_cfunc": host_decode.stage_cfunc}
for m in (sparse_decode, batched_decode, predicted_decode, cold_handler):
    funcs.update({f"{m.__name__}.{n}": getattr(m, n) for n in ("_handler", "_handler_int8", "_stage")
                  if hasattr(m, n)})
print(sorted(name for name, f in funcs.items() if f.cache_hits != 1), len(funcs))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[-2] == "[] 10", result.stdout


def test_each_decoders_handler_refuses_another_decoders_table_and_a_wrong_call_naming_itself():
    """The single-token decoders share one handler body (host_decode.serve); each still names its own target and
    class, and a header check still stands between a call and another decoder's memory."""
    from cpu_offload.sparse_decode import SparseHostDecoder

    config = tiny_config(d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=128)
    weights = random_weights(config)
    dense = decoder.HostDecoder(config, weights, "q4_1")
    sparse = SparseHostDecoder(config, weights, np.zeros((config.n_layers, 4), np.float32))
    x = jnp.ones(64, jnp.float32)
    for target, table, operands, message in (
            ("pjinfer_sparse_decode", dense.table, (x,), "pjinfer_sparse_decode: 'table' is not a SparseHostDecoder"),
            ("pjinfer_host_decode", sparse.table, (x,), "pjinfer_host_decode: 'table' is not a HostDecoder"),
            ("pjinfer_host_decode", dense.table, (x, x), "pjinfer_host_decode: expected 5 operands and 3 results"),
            ("pjinfer_sparse_decode", sparse.table, (x, x), "pjinfer_sparse_decode: expected 5 operands and 3 results")):
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((config.vocab_size,), jnp.float32))
        with pytest.raises(Exception, match=message):
            np.asarray(call(*operands, table=np.int64(table)))
    np.testing.assert_array_equal(np.asarray(dense.head(x)), np.asarray(sparse.head(x)))   # both int8 heads of one model
