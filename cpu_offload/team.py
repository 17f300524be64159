"""A fixed team of host threads that split one FFI call's work: the calling thread plus workers that wait by
yielding the core in a loop (``sched_yield``), so handing them a stage costs about a microsecond. They do not spin
with ``pause``: a spinning worker held its core against XLA's own threads between the FFI calls, and the passes of
a sampled token's choice, which XLA splits over its threads, waited for it (docs/performance.md, "Sampling without
a sort").

Why not Numba's ``prange``: a parallel launch through the workqueue layer costs about as much as a whole decode
stage (and the OpenMP layer spins for milliseconds when XLA's threads compete). A decode layer has five short
stages, so a launch per stage would cost more than the second thread saves (docs/performance.md, "Measurements
behind the code's choices").

Protocol (all words int64 in one control block that is never freed):
- ``run(ctrl, fn, arg)`` (Numba, caller holds the ffi lock): stores the task (``fn``: the address of a cfunc
  ``void(int64 arg, int64 tid, int64 n)``, and ``arg``), bumps the generation word with release order, runs
  ``fn(arg, 0, n)`` itself, then waits until every worker has stored the new generation in its done word.
- worker ``w`` (1..n-1, a daemon Python thread inside a nogil Numba loop): waits for a new generation, takes the
  caller's floating-point environment (MXCSR: denormal flushing), runs ``fn(arg, w, n)``, stores the generation
  in its done word. It waits by ``sched_yield``, and after YIELDS rounds without work sleeps between looks, SLEEP_US
  at first, twice as long each time up to SLEEP_MAX_US, so back-to-back decode steps find it awake and an idle team
  costs almost nothing. Wakeups are dear under a hypervisor: with a short sleep that never grew, an idle worker
  took enough of a vCPU to slow a peer benchmarked beside an idle engine (docs/performance.md, "An idle engine
  slowed the peers").
- Tasks split their work by ``tid`` and ``n`` and write disjoint outputs; ``run`` returns once all are done.

The team size is fixed when the team starts (``PJINFER_HOST_THREADS``, default: the CPUs this process may use).
"""
from __future__ import annotations

import atexit
import ctypes
import os
import threading

import numpy as np

from .contract import ConfigError

from . import ffi
from .ffi import (NOJIT, RUNTIME, R_YIELD, call_void0, load_acquire_i64, load_i64, store_i64,
                  store_release_i64)

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

C_GEN, C_FN, C_ARG, C_SIZE, C_STOP, C_USLEEP, C_YIELD, C_FPENV = range(8)
LINE = 8  # int64 words per 64-byte cache line: each worker's done word sits on its own line
YIELDS = 20000  # sched_yield rounds before sleeping
SLEEP_US = 200  # the first sleep; each later one twice as long, up to SLEEP_MAX_US
SLEEP_MAX_US = 6400   # what the first stage after a long idle may wait for a worker to wake


@intrinsic
def cycles(typingctx):
    """The CPU's time-stamp counter (llvm.readcyclecounter: rdtsc on x86), for timing a decode's stages where they
    run; its rate is measured against a clock by whoever reads the counts."""
    def codegen(context, builder, sig, args):
        fn = builder.module.declare_intrinsic("llvm.readcyclecounter", fnty=ir.FunctionType(ir.IntType(64), []))
        return builder.call(fn, [])
    return types.int64(), codegen


@njit(**NOJIT)
def read_cycles():
    """cycles() from Python."""
    return cycles()


@intrinsic
def _pause(typingctx):
    """The x86 spin-wait hint, for a wait without sched_yield: lets the sibling hyperthread run."""
    def codegen(context, builder, sig, args):
        fn = builder.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(ir.VoidType(), []))
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


def _mxcsr_call(builder, name, slot):
    """The MXCSR instruction `name` on a 32-bit slot. The slot is allocated once in the function's entry block
    (cgutils.alloca_once): an alloca where the intrinsic is inlined, inside ``_worker``'s loop, took stack that
    is only freed on return, which a worker never does (it overflowed its stack after ~500,000 tasks)."""
    fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()]))
    builder.call(fn, [builder.bitcast(slot, ir.IntType(8).as_pointer())])


@intrinsic
def get_fpenv(typingctx):
    """This thread's x86 MXCSR (denormal flushing, rounding, exception masks)."""
    def codegen(context, builder, sig, args):
        slot = cgutils.alloca_once(builder, ir.IntType(32))  # entry block: see _mxcsr_call
        _mxcsr_call(builder, "llvm.x86.sse.stmxcsr", slot)
        return builder.zext(builder.load(slot), ir.IntType(64))
    return types.int64(), codegen


@intrinsic
def set_fpenv(typingctx, value):
    """Sets this thread's MXCSR."""
    if not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        slot = cgutils.alloca_once(builder, ir.IntType(32))  # entry block: see _mxcsr_call
        builder.store(builder.trunc(context.cast(builder, args[0], sig.args[0], types.int64), ir.IntType(32)), slot)
        _mxcsr_call(builder, "llvm.x86.sse.ldmxcsr", slot)
        return context.get_dummy_value()
    return types.void(value), codegen


# The floating-point environment the decode handlers compute in (``enter``): exceptions masked, round to nearest,
# denormals flushed (FTZ) and read as zero (DAZ), as XLA's CPU runtime computes. Without a fixed one, a result
# could depend on which thread computed it: XLA's thread and the team's workers need not share one.
FPENV = 0x9FC0


@njit(**NOJIT)
def enter():
    """Sets FPENV on this thread; returns the environment to give back to ``leave``."""
    saved = get_fpenv()
    set_fpenv(FPENV)
    return saved


@njit(**NOJIT)
def leave(saved):
    set_fpenv(saved)


@intrinsic
def _call_task(typingctx, fnaddr, arg, tid, n):
    """Call ``void f(int64, int64, int64)`` at address fnaddr."""
    if not all(isinstance(t, types.Integer) for t in (fnaddr, arg, tid, n)):
        return None

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i64, i64, i64])
        vals = [context.cast(builder, a, t, types.int64) for a, t in zip(args[1:], sig.args[1:])]
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), vals)
        return context.get_dummy_value()
    return types.void(fnaddr, arg, tid, n), codegen


@intrinsic
def _call_usleep(typingctx, fnaddr, us):
    if not (isinstance(fnaddr, types.Integer) and isinstance(us, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(i32, [i32])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [context.cast(builder, args[1], sig.args[1],
                                                                                 types.int32)])
        return context.get_dummy_value()
    return types.void(fnaddr, us), codegen


@njit(**NOJIT)
def _wait_round(rounds, yield_fn, usleep_fn):
    """One round of waiting: yield the core (pause where there is no sched_yield), then, after YIELDS rounds,
    sleep: SLEEP_US, doubled each round after, at most SLEEP_MAX_US."""
    if rounds < YIELDS or usleep_fn == 0:
        if yield_fn != 0:
            call_void0(yield_fn)
        else:
            _pause()
    else:
        _call_usleep(usleep_fn, min(SLEEP_MAX_US, SLEEP_US << min(rounds - YIELDS, 5)))


@njit(**NOJIT)
def _worker(ctrl, w):
    yield_fn = load_i64(ctrl + 8 * C_YIELD)
    usleep_fn = load_i64(ctrl + 8 * C_USLEEP)
    seen = load_acquire_i64(ctrl + 8 * LINE * w)  # the last generation this worker finished (0 at start)
    rounds = 0
    while True:
        g = load_acquire_i64(ctrl + 8 * C_GEN)
        if g == seen:
            _wait_round(rounds, yield_fn, usleep_fn)
            rounds += 1
            continue
        seen = g
        rounds = 0
        if load_i64(ctrl + 8 * C_STOP) != 0:
            store_release_i64(ctrl + 8 * LINE * w, g)
            return
        set_fpenv(load_i64(ctrl + 8 * C_FPENV))     # the caller's: a result must not depend on the thread
        _call_task(load_i64(ctrl + 8 * C_FN), load_i64(ctrl + 8 * C_ARG), w, load_i64(ctrl + 8 * C_SIZE))
        store_release_i64(ctrl + 8 * LINE * w, g)


@njit(**NOJIT)
def run(ctrl, fn, arg):
    """Run task fn(arg, tid, n) on the whole team (tid 0 on this thread); returns when every part is done, with the
    time-stamp cycles this thread then waited for the workers (cycles; 0 without workers). On a stopped team
    (Team.stop: its workers are gone) this thread runs every part itself, in tid order."""
    n = load_i64(ctrl + 8 * C_SIZE)
    if n <= 1:
        _call_task(fn, arg, 0, 1)
        return 0
    if load_i64(ctrl + 8 * C_STOP) != 0:
        for tid in range(n):
            _call_task(fn, arg, tid, n)
        return 0
    store_i64(ctrl + 8 * C_FN, fn)
    store_i64(ctrl + 8 * C_ARG, arg)
    store_i64(ctrl + 8 * C_FPENV, get_fpenv())
    g = load_i64(ctrl + 8 * C_GEN) + 1
    store_release_i64(ctrl + 8 * C_GEN, g)
    _call_task(fn, arg, 0, n)
    start = cycles()
    yield_fn = load_i64(ctrl + 8 * C_YIELD)
    for w in range(1, n):
        rounds = 0
        while load_acquire_i64(ctrl + 8 * LINE * w) != g:
            _wait_round(rounds, yield_fn, 0)  # never sleep here: the worker is due any moment
            rounds += 1
    return cycles() - start


ffi.purge_stale_cache("team", ffi)


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_size(size: int, given: str) -> int:
    """`size`, or a ConfigError quoting `given` (how the user said it) when it is above usable_cores(): more
    spinning threads than cores take turns on them, each stage waiting for the slowest. Never clamped."""
    cores = usable_cores()
    if size > cores:
        raise ConfigError(f"{given} is more than the {cores} CPU cores this process may use; "
                          f"give at most {cores}")
    return size


def default_size() -> int:
    """The team size: PJINFER_HOST_THREADS (a whole number from 1 to usable_cores()), else usable_cores()."""
    env = os.environ.get("PJINFER_HOST_THREADS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ConfigError(f"PJINFER_HOST_THREADS must be a positive integer, got {env!r}")
        return check_size(int(env), f"PJINFER_HOST_THREADS={env}")
    return usable_cores()


_TEAMS: list["Team"] = []  # every team, kept until exit: its workers read its control block until stopped


class Team:
    """The caller plus size-1 worker threads (started here, daemons, stopped at exit)."""

    def __init__(self, size: int):
        self.size = int(size)
        self.ctrl = np.zeros(LINE * max(self.size, 1), np.int64)  # line 0: control words; line w: worker w's done
        self.ctrl[C_SIZE] = self.size
        # Addresses travel in the block, never as Numba globals: cached machine code would keep another
        # process's values.
        self.ctrl[C_YIELD] = RUNTIME[R_YIELD]
        try:
            self.ctrl[C_USLEEP] = ctypes.cast(ctypes.CDLL(None).usleep, ctypes.c_void_p).value or 0
        except (OSError, AttributeError):  # pragma: no cover - no usleep: workers yield instead of sleeping
            self.ctrl[C_USLEEP] = 0
        _TEAMS.append(self)
        self.address = int(self.ctrl.ctypes.data)
        self.threads = [threading.Thread(target=_worker, args=(self.address, w), daemon=True,
                                         name=f"pjinfer-host-{w}") for w in range(1, self.size)]
        for t in self.threads:
            t.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Let the workers return (they wake within SLEEP_MAX_US even when asleep). Called for every team at exit:
        a worker still reading the control block while the interpreter frees it would crash the process.

        An XLA computation may still be running at exit (a decode that Ctrl-C interrupted while the caller waited
        for it). So the stop is made under the FFI lock every handler holds around its runs: a run in progress
        finishes with the workers first, and a run after the stop does every part on its own thread (`run`)
        instead of waiting for workers that have returned."""
        ffi.lock(ffi.RUNTIME_ADDR)
        try:
            self.ctrl[C_STOP] = 1
            self.ctrl[C_GEN] += 1  # x86 keeps stores in order: a worker that sees the new generation sees STOP
        finally:
            ffi.unlock(ffi.RUNTIME_ADDR)
        for t in self.threads:
            t.join(timeout)


@atexit.register
def _stop_all() -> None:
    for crew in _TEAMS:
        crew.stop()


_team: Team | None = None
_team_lock = threading.Lock()


def shared() -> Team:
    """The process's team (started on first use; its control block lives as long as the process)."""
    global _team
    with _team_lock:
        if _team is None:
            _team = Team(default_size())
        return _team
