"""How much of the machine a measurement had: the share of all CPU time that went to the hypervisor (steal) and to
everything other than this process, while it ran (Linux /proc; elsewhere nothing is reported).

A rate taken while other work held the cores is not comparable with one from a quiet machine: `bench` reports
these shares beside its figures and warns when they are large.

    before = machine.sample()
    ...                                    # the measurement
    shares = machine.shares(before, machine.sample())    # {"steal": 0.31, "others": 0.12} or None

The cache sizes a measurement must exceed to read memory (`last_level_cache_bytes`, `beyond_caches`) live in
cpu_offload.cpu_caches, where the kernels' own benchmark reads them too, and are named here for the app's.
"""
from __future__ import annotations

from cpu_offload.cpu_caches import beyond_caches, last_level_cache_bytes  # noqa: F401  (bench's, tests')

BUSY_WARNING = 0.10     # a share of steal or of other work above this makes the figures a busy machine's


def sample() -> tuple[int, int, int, int] | None:
    """(total CPU ticks, busy ticks, steal ticks, this process's ticks) since boot, or None without /proc.
    Busy is user + nice + system + irq + softirq over every CPU; this process's ticks are its threads' user and
    system time, and its waited-for children's."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()     # after the command name, which may hold spaces
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    mine = sum(int(v) for v in own[11:15])                # utime, stime, cutime, cstime (fields 14-17)
    return sum(fields), user + nice + system + irq + softirq, steal, mine


def shares(before, after) -> dict | None:
    """The shares of all CPU time between two samples that were stolen ("steal") and that went to other
    processes and the kernel's own threads ("others"); None when either sample is missing or no time passed."""
    if before is None or after is None:
        return None
    total, busy, steal, mine = (b - a for a, b in zip(before, after))
    if total <= 0:
        return None
    return {"steal": steal / total, "others": max(0, busy - mine) / total}


def describe(share: dict | None) -> str | None:
    """One line for people: what the machine's other work took during the runs, and a warning when it was much."""
    if share is None:
        return None
    line = (f"machine during the runs: {100 * share['steal']:.0f}% of CPU time stolen by the hypervisor, "
            f"{100 * share['others']:.0f}% used by other work")
    if max(share.values()) > BUSY_WARNING:
        line += f"; over {100 * BUSY_WARNING:.0f}%, so these figures are a busy machine's: compare only within this run"
    return line
