"""Process-wide JAX set-up: the persistent compilation cache, memory given back after compiling, and counting what
gets compiled."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
import sys
import time
from pathlib import Path

import jax
from jax._src import cache_key
from numba.core import event

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND = "/jax/core/compile/backend_compile_duration"   # one per executable built or read from disk
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get("PJINFER_COMPILE_CACHE", Path(base) / "pjinfer" / "jax"))


def enable_compilation_cache(path: Path | None = None) -> Path:
    """Executables are written to disk, so a second run of the same command does not compile again."""
    path = Path(path or default_cache_dir())
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # every executable, small ones too
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def read_by_every_process() -> None:
    """In a multi-process run on CPUs (tensor parallel), let every process read the executables that process 0
    writes to the persistent cache. JAX writes them from process 0 alone and means the others to read them on later
    runs, but two parts of its cache key differ from process to process on CPUs, so processes 1..N-1 never find
    them and compile on every run:
    - the devices' topology fingerprint, which on CPUs describes the process's own device, its index included. For
      device sets that are all CPUs, the key hashes the devices' kinds (JAX's own fallback for a backend without a
      topology) and this host's CPU, so a cache shared with other hosts is read only where the CPU is the same;
    - the mode of XLA's GPU caches (process 0 updates, the others read): on CPUs those caches are not kept.
    Call it once JAX's backend is up. Other device sets keep JAX's key. Where JAX's key functions are not the
    ones this replaces, it does nothing (tests/test_tensor_parallel.py then fails: the followers compile)."""
    jax_hash = getattr(cache_key, "_hash_accelerator_config", None)
    by_kinds = getattr(cache_key, "_hash_devices", None)
    if jax.default_backend() != "cpu" or jax_hash is None or by_kinds is None or hasattr(jax_hash, "by_cpu"):
        return
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")

    def by_cpu(hash_obj, devices):
        if any(d.platform != "cpu" for d in devices.flat):
            return jax_hash(hash_obj, devices)
        by_kinds(hash_obj, devices)
        hash_obj.update(_host_cpu().encode())

    by_cpu.by_cpu = True
    cache_key._hash_accelerator_config = by_cpu


@functools.cache
def _host_cpu() -> str:
    """What identifies this host's CPU for the code XLA generates: its model and instruction-set flags (Linux's
    /proc/cpuinfo), else the machine's name."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    return "\n".join(sorted({line for line in lines if line.startswith(("vendor_id", "model name", "flags"))}))


_trimming = False


def trim_after_compiles() -> None:
    """After every executable XLA builds or reads from disk, hand the heap memory it freed back to the OS
    (glibc's malloc_trim): glibc keeps it otherwise, and what each executable leaves adds up in peak RSS
    (docs/performance.md, "Memory"). Once per process; nothing to do where the C library is not glibc."""
    global _trimming
    if _trimming:
        return
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "malloc_trim"):
        return

    def trim(event: str, duration: float, **kwargs):
        if event == _BACKEND:
            libc.malloc_trim(0)
    jax.monitoring.register_event_duration_secs_listener(trim)
    _trimming = True


class CompileStats:
    """Counts executables built since creation and the seconds spent tracing, lowering and compiling."""

    _live: list["CompileStats"] = []
    _registered = False

    def __init__(self):
        self.executables = 0
        self.cache_hits = 0
        self.seconds = 0.0
        if not CompileStats._registered:
            jax.monitoring.register_event_duration_secs_listener(CompileStats._on_duration)
            jax.monitoring.register_event_listener(CompileStats._on_event)
            CompileStats._registered = True
        CompileStats._live.append(self)

    def close(self):
        CompileStats._live.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @staticmethod
    def _on_duration(event: str, duration: float, **kwargs):
        if event in (_TRACE, _LOWER, _BACKEND):
            for s in CompileStats._live:
                s.seconds += duration
                s.executables += event == _BACKEND

    @staticmethod
    def _on_event(event: str, **kwargs):
        if event == _CACHE_HIT:
            for s in CompileStats._live:
                s.cache_hits += 1


class KernelCompileNotice:
    """One line on `stream` while the host's Numba kernels compile, which happens once per machine, model shape
    and source version (a cache miss: the first run after install, another model); later runs read them from
    Numba's cache and print nothing. The line begins at the first compilation after start() and ends, at
    finish(), with the seconds spent compiling (outermost compilations summed: callees compile inside them)."""

    def __init__(self, stream=None):
        self.stream = stream
        self.seconds = 0.0
        self.compiles = 0
        self._listener = None
        self._depth = 0
        self._began = None
        self._begun = False      # the line's start was written
        self._done = False       # the line was written in full: never again in this process

    def start(self) -> None:
        """Listen for compilations (no-op while listening, or once the line was written)."""
        if self._listener is not None or self._done:
            return

        notice = self

        class Listener(event.Listener):
            def on_start(self, ev):
                notice._on_start()

            def on_end(self, ev):
                notice._on_end()

        self._listener = Listener()
        event.register("numba:compile", self._listener)

    def _on_start(self):
        if self._depth == 0:
            self._began = time.perf_counter()
            if not self._begun:
                self._begun = True
                print("compiling the CPU kernels, once (later runs read them from the cache) ...",
                      end="", file=self.stream or sys.stderr, flush=True)
        self._depth += 1

    def _on_end(self):
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._began
            self.compiles += 1

    def finish(self) -> None:
        """Stop listening; end the line if one was begun."""
        if self._listener is None:
            return

        event.unregister("numba:compile", self._listener)
        self._listener = None
        if self._begun:
            print(f" {self.seconds:.1f} s", file=self.stream or sys.stderr, flush=True)
            self._done = True


kernel_notice = KernelCompileNotice()   # the process's: the CLI starts it before loading a model
