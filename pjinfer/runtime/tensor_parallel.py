"""Tensor parallel over JAX processes: one model split Megatron-style across N processes (on one host or many), on
JAX's own multi-controller runtime (`jax.distributed`, gloo collectives on CPUs).

The split (``part``, applied by the loader to each tensor as it reads the file), for process i of N:
- attention: whole key/value heads, ceil(KV / N) a process, each with its query heads: q, k and v rows, o's
  columns, the q/k/v biases and the KV cache. A process with fewer heads (KV not a multiple of N) pads with heads
  of zero weights, whose output is zero, so every shard has one shape;
- FFN: d_ff / N neurons a process: gate and up rows, down's columns;
- the output head and the embedding (one table when tied): vocab / N rows a process;
- replicated: the norms (a few KB a layer).
Each process keeps only its slices of the file's blocks, so its weight memory is about 1/N of the model. With N > 1
every slice is a copy, and the file's pages are let go once read: a view of a slice would keep more than the slice
resident, as a fault maps the neighbouring pages of the file that are in the page cache, and the other processes
have read those. The embedding's rows alone stay a view (the decode reads the looked-up rows only).

One token (``ShardedModel.decode``, inside the jitted generate, each shard's work inside `jax.shard_map`):
    x = psum(the embedding row where this shard holds the token, else 0)
    per layer: x = x + psum(attention form)  then  x = x + psum(FFN form)      cpu_offload.shard_decode
    logits = all_gather(head form of final_norm(x))
Everything outside the shard's calls runs replicated on every process: sampling sees the whole logits with the
same key, so every process picks the same token. Prompts run as one-token steps (host.STEPS), and so does
scoring (generate.stepped_logprobs). With N = 1 the numbers are the host decode's, bit for bit; with N > 1 a psum
adds the shards' partial sums in its own order.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cpu_offload.blocks import TYPES
from cpu_offload.qtensor import QTensor, aligned_empty
from cpu_offload.shard_decode import ShardDecoder
from pjinfer.config import ConfigError
from pjinfer.runtime.compile_cache import read_by_every_process
from pjinfer.runtime.model import KVCache, Norm, to_xla

AXIS = "tp"
CACHE = P(None, None, AXIS, None)   # [batch, S, KV, hd], split by heads
ENV = ("PJINFER_COORDINATOR", "PJINFER_NUM_PROCESSES", "PJINFER_PROCESS_ID")
# JAX's own health check: a process silent this long makes the runtime abort the others with a C++ stack trace.
# It counts from the silent process's last heartbeat, which may be seconds older than the silence, so it is set
# well past the Watch (SILENT_S, then up to GRACE_S), which says the same in one line.
HEARTBEAT_S = 60
SHUTDOWN_S = 20            # how long a process ending normally waits for the others at JAX's shutdown barrier
BEAT_S, SILENT_S = 1, 10   # the Watch's beat, and how long a silent process may stay so
GRACE_S = 5                # how long a silent hook (the server's) has to end this process before the Watch does
SILENT_HOOKS: list = []    # called with the Watch's line before it ends the process (on_silent)
# What JAX's errors say when a process of the run went away: a collective's peer closed its socket (gloo), or the
# coordination service (process 0's) is gone.
LOST = ("Gloo", "UNAVAILABLE", "Socket closed", "Connection reset")


@dataclasses.dataclass(frozen=True)
class Processes:
    """Where this process sits: the coordinator's HOST:PORT (process 0 serves it), how many, and which one."""
    coordinator: str
    count: int
    index: int

    @classmethod
    def from_args(cls, coordinator=None, count=None, index=None) -> "Processes | None":
        """The flags, each defaulting to its ENV variable; None when neither names a coordinator. ConfigError in
        one line for what cannot start."""
        coordinator = coordinator or os.environ.get(ENV[0])
        if not coordinator:
            if count not in (None, 1) or index not in (None, 0):
                raise ConfigError("--num-processes and --process-id need --coordinator HOST:PORT")
            return None
        try:
            count = int(count if count is not None else os.environ.get(ENV[1], 0))
            index = int(index if index is not None else os.environ.get(ENV[2], -1))
        except ValueError:
            raise ConfigError(f"{ENV[1]} and {ENV[2]} must be integers") from None
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
        if count < 1:
            raise ConfigError("--num-processes must be at least 1 with --coordinator")
        if not 0 <= index < count:
            raise ConfigError(f"--process-id must be in [0, {count}), got {index}")
        return cls(coordinator, count, index)

    def start(self) -> None:
        """Join the others (blocks until all N have): JAX's distributed runtime, gloo collectives on CPUs. Every
        process reads process 0's executables from the persistent cache (compile_cache.read_by_every_process)."""
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(self.coordinator, num_processes=self.count, process_id=self.index,
                                   initialization_timeout=120, heartbeat_timeout_seconds=HEARTBEAT_S,
                                   shutdown_timeout_seconds=SHUTDOWN_S)
        read_by_every_process()
        if self.count > 1:
            Watch(jax._src.distributed.global_state.client, self.index, self.count).start()


class Watch:
    """Ends this process with one line when another process of the run stops answering without closing its
    sockets (stopped, hung, or its host gone), before JAX's health check would abort it with a C++ stack trace.
    (A process that exits closes its sockets: the collective fails at once, and ``lost`` names it.)

    Every BEAT_S each process counts up its key in the coordination service's store and reads the others'; a
    process whose count has not moved for SILENT_S is named, and so is the coordinator (process 0, which holds the
    store) when this process's own beat has not come back for SILENT_S. A process that ends normally writes
    "done" first (atexit), so the others stop watching it. Hooks (on_silent: the server's) get the line first."""
    PREFIX = "pjinfer/alive/"

    def __init__(self, client, index: int, count: int):
        self.client, self.index, self.count = client, index, count
        self.answered = time.monotonic()          # when this process's last beat came back
        self.ended = threading.Event()
        self.exiting = threading.Lock()           # _exit runs once, whichever thread saw the silence first
        self.beating = threading.Thread(target=self._beat, name="pjinfer-watch", daemon=True)

    def start(self) -> None:
        atexit.register(self.end)
        self.beating.start()
        threading.Thread(target=self._judge, name="pjinfer-judge", daemon=True).start()

    def end(self) -> None:
        """This process is done: the others stop watching it (called at exit). The beat's thread is let finish
        its call into the store first: a daemon thread still inside a C++ call when the interpreter finalizes is
        cancelled there, and the process aborts ("terminate called ...") after its last line."""
        if not self.ended.is_set():
            self.ended.set()
            self.beating.join(timeout=2 * BEAT_S)
            try:
                self.client.key_value_set(f"{self.PREFIX}{self.index}", "done", allow_overwrite=True)
            except Exception:  # the store is gone (process 0 ended first): nobody is left to watch
                pass

    def _beat(self) -> None:
        others = [i for i in range(self.count) if i != self.index]
        counts, moved, beat = dict.fromkeys(others), dict.fromkeys(others, time.monotonic()), 0
        while not self.ended.wait(BEAT_S):
            beat += 1
            try:
                self.client.key_value_set(f"{self.PREFIX}{self.index}", str(beat), allow_overwrite=True)
                seen = dict(self.client.key_value_dir_get(self.PREFIX))
            except Exception:   # the store is unreachable: _judge names the coordinator
                continue
            now = self.answered = time.monotonic()
            for i in others:
                key = f"{self.PREFIX}{i}"
                if seen.get(key) == "done":
                    continue
                if seen.get(key) != counts.get(i):
                    counts[i], moved[i] = seen.get(key), now
                elif now - moved[i] > SILENT_S and not self.ended.is_set():
                    self._exit(f"process {i}")

    def _judge(self) -> None:
        while not self.ended.wait(BEAT_S):
            if time.monotonic() - self.answered > SILENT_S:
                self._exit("process 0 (the coordinator)")

    def _exit(self, who: str) -> None:
        if not self.exiting.acquire(blocking=False):
            return
        line = f"tensor parallel: {who} of the {self.count} in this run stopped answering ({SILENT_S} s without a " \
               f"sign of life)"
        if SILENT_HOOKS:      # the server ends itself (503s to the requests in flight, then main's exit line)
            for hook in SILENT_HOOKS:
                hook(line)
            time.sleep(GRACE_S)
        leave(line)


def leave(line: str) -> None:
    """Ends this process at once, exit status 1, after the output so far and `line` as its one error line: not
    JAX's shutdown, which would wait for the lost process at a barrier, then abort with a stack trace."""
    sys.stdout.flush()
    print(f"pjinfer: error: {line}", file=sys.stderr, flush=True)
    os._exit(1)


def on_silent(hook) -> None:
    """hook(line) is called from the Watch's thread when a process of the run stops answering; the process must end
    within GRACE_S (by main's exit path, as for Lost), or the Watch prints the line and ends it."""
    SILENT_HOOKS.append(hook)


class Lost(Exception):
    """A process of this run went away: raised with lost's line where the error that said so was handled first
    (the server's scheduler)."""


def lost(error: BaseException) -> str | None:
    """The one line for an error that says a process of this run went away (it died or was killed: see LOST; or
    Lost), or None for any other error. Its caller ends with ``leave(line)``."""
    if isinstance(error, Lost):
        return str(error)
    state = jax._src.distributed.global_state
    text = str(error)
    if state.client is None or not any(sign in text for sign in LOST):
        return None
    who = f"process {1 - state.process_id}" if state.num_processes == 2 else "a process"
    why = text.rsplit(": ", 1)[-1].strip()
    return f"tensor parallel: {who} of the {state.num_processes} in this run stopped ({why})"


def mesh() -> Mesh:
    """The processes' devices in process order, one each: shard i is process i's."""
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    if len(jax.local_devices()) != 1:
        raise ConfigError(f"tensor parallel runs one device a process, this one has {len(jax.local_devices())}")
    return Mesh(np.array(devices), (AXIS,))


@dataclasses.dataclass(frozen=True)
class Split:
    """How a model splits over n shards: each takes `kv` KV heads (the last ones padded), `ff` neurons and
    `vocab` head rows."""
    n: int
    kv: int
    ff: int
    vocab: int

    @classmethod
    def of(cls, config, n: int) -> "Split":
        kv = -(-config.n_kv_heads // n)
        if config.d_ff % n or (config.d_ff // n) % 64:
            raise ConfigError(f"tensor parallel splits d_ff ({config.d_ff}) into {n} shards of a multiple of 64 "
                              "neurons; it does not")
        if config.vocab_size % n:
            raise ConfigError(f"tensor parallel splits the vocabulary ({config.vocab_size}) evenly; {n} does not")
        return cls(n, kv, config.d_ff // n, config.vocab_size // n)

    def shard_config(self, config):
        """The config of one shard: the model HostDecoder builds for it."""
        rep = config.n_heads // config.n_kv_heads
        return dataclasses.replace(config, n_heads=self.kv * rep, n_kv_heads=self.kv, d_ff=self.ff,
                                   vocab_size=self.vocab)

    def cache_config(self, config):
        """The config of the whole cache: n shards of kv heads (padding included), each with its query heads."""
        rep = config.n_heads // config.n_kv_heads
        return dataclasses.replace(config, n_heads=self.kv * self.n * rep, n_kv_heads=self.kv * self.n)


def part(config, name: str, t):
    """load's hook: this process's share of the file's tensor t (pjinfer.load.gguf_file.Tensor) that becomes the
    canonical weight `name`, as the module docstring splits it: with N > 1 new arrays but for the embedding's rows,
    with N = 1 the file's own. Matrices must be in a block type (QTensor slices them); norms are whole."""
    split, i = Split.of(config, jax.process_count()), jax.process_index()
    c, hd = config, config.head_dim
    rep = c.n_heads // c.n_kv_heads
    g0, g1 = min(c.n_kv_heads, i * split.kv), min(c.n_kv_heads, (i + 1) * split.kv)   # this shard's KV heads
    q_rows, kv_rows = (g0 * rep * hd, g1 * rep * hd, split.kv * rep * hd), (g0 * hd, g1 * hd, split.kv * hd)
    f_rows, v_rows = (i * split.ff, (i + 1) * split.ff), (i * split.vocab, (i + 1) * split.vocab)
    kind = name.rsplit(".", 1)[-1]
    if kind in ("bq", "bk", "bv"):
        lo, hi, total = q_rows if kind == "bq" else kv_rows
        return dataclasses.replace(t, data=np.pad(np.asarray(t.data, np.float32)[lo:hi], (0, total - (hi - lo))),
                                   shape=(total,))
    how = {"wq": ("rows", q_rows), "wk": ("rows", kv_rows), "wv": ("rows", kv_rows), "wo": ("columns", q_rows),
           "w_gate": ("rows", f_rows), "w_up": ("rows", f_rows), "w_down_t": ("columns", f_rows),
           "embed": ("rows", v_rows), "lm_head": ("rows", v_rows)}.get(kind)
    if how is None:
        return t
    if t.type not in TYPES or len(t.shape) != 2:
        raise ConfigError(f"tensor parallel slices a file's quantized blocks; {t.name} is not in a block type "
                          "the host decode runs (a file quantized by llama.cpp: --weights auto runs its own blocks)")
    try:
        shard = getattr(QTensor(t.type, (t.data,), t.shape[1]), how[0])(*how[1])
    except ConfigError:   # QTensor.columns: the cut falls inside a block
        raise ConfigError(f"tensor parallel over {split.n} processes cuts {t.name} into slices of "
                          f"{how[1][1] - how[1][0]} columns, not whole {TYPES[t.type].name} blocks of "
                          f"{TYPES[t.type].block}: run fewer processes") from None
    data = shard.data
    if split.n > 1 and kind != "embed" and np.shares_memory(data, t.data):
        data = aligned_empty(data.shape, data.dtype)
        data[...] = shard.data
    return dataclasses.replace(t, data=data, shape=shard.shape)


def _global(local: np.ndarray, spec: P, m: Mesh) -> jax.Array:
    """One array over the processes from each one's part (spec P(AXIS): rows; P(): the same on every one), the
    part in XLA's memory without a copy (to_xla)."""
    rows = local.shape[0] * (m.size if spec == P(AXIS) else 1)
    return jax.make_array_from_single_device_arrays((rows, *local.shape[1:]), NamedSharding(m, spec),
                                                    [to_xla(np.asarray(local))])


class ShardedModel(nnx.Module):
    """The model a tensor-parallel engine runs: this process's ShardDecoder, its embedding rows (one array over
    the processes) and the final norm; ``decode`` as Transformer.decode. weights: this process's share, as the
    loader gives it with `part`. `config` is the cache's (its n_kv_heads
    count every shard's heads): KVCache.create makes the whole cache, split by heads."""

    def __init__(self, config, weights: dict, fmt: str, m: Mesh):
        split = Split.of(config, m.size)
        self.config = split.cache_config(config)
        self.vocab = split.vocab
        self.mesh = m
        self.decoder = ShardDecoder(split.shard_config(config), weights, fmt)   # weights: this process's share
        embed = weights["embed"]
        self.embed_code, self.embed_cols = embed.code, embed.cols
        self.embed = nnx.List([nnx.Param(_global(a, P(AXIS), m)) for a in embed.arrays])
        self.final_norm = Norm({"final_norm.scale": _global(np.asarray(weights["final_norm.scale"], np.float32), P(),
                                                            m)}, "final_norm", config.norm_eps)

    def _map(self, f, in_specs, out_specs):
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def _embedding(self, token, *arrays):
        """The token's embedding row [d]: the shard holding it gives the row, the others zeros, summed."""
        local = token - jax.lax.axis_index(AXIS) * self.vocab
        inside = (local >= 0) & (local < self.vocab)
        at = jnp.clip(local, 0, self.vocab - 1)
        row = TYPES[self.embed_code].dequantize(tuple(a[at][None] for a in arrays), self.embed_cols, jnp)[0]
        return jax.lax.psum(jnp.where(inside, row, 0.0), AXIS)

    def _layers(self, x, pos, ks, vs):
        ks, vs = list(ks), list(vs)
        for layer in range(len(ks)):
            o, ks[layer], vs[layer] = self.decoder.attention(layer, x, pos, ks[layer], vs[layer])
            x = x + jax.lax.psum(o, AXIS)
            x = x + jax.lax.psum(self.decoder.ffn(layer, x), AXIS)
        return x, ks, vs

    def _head(self, h):
        return jax.lax.all_gather(self.decoder.head(h), AXIS, tiled=True)

    def decode(self, token, pos, cache: KVCache):
        """One token (a scalar id) at position pos -> (logits [vocab], updated cache), as Transformer.decode."""
        arrays = tuple(a[...] for a in self.embed)
        x = self._map(self._embedding, (P(), *(P(AXIS),) * len(arrays)), P())(token, *arrays)
        n = len(cache.k)
        x, ks, vs = self._map(self._layers, (P(), P(), [CACHE] * n, [CACHE] * n), (P(), [CACHE] * n, [CACHE] * n))(
            x, jnp.asarray(pos, jnp.int32), cache.k, cache.v)
        logits = self._map(self._head, P(), P())(self.final_norm(x))
        return logits, KVCache(k=ks, v=vs)

    def __call__(self, *args, **kwargs):
        raise ConfigError("a tensor-parallel engine runs one-token steps only: prompts and scoring run as steps "
                          "(generate.stepped_logprobs)")

    forward_sequence = __call__


def build(config, weights: dict, fmt: str):
    """backends.build's (model, decoder) for the tensor-parallel row: this process's shard, over every process
    `jax.distributed` joined."""
    model = ShardedModel(config, weights, fmt, mesh())
    return model, model.decoder
