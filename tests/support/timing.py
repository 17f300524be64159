"""A pytest plugin: where each test's time goes (`make test-profile`).

For every test it records the wall time, the JAX executables built and the seconds spent tracing, lowering and
compiling them (pjinfer.runtime.compile_cache.CompileStats), and the seconds Numba spent compiling host kernels
(KernelCompileNotice, its line written to nowhere). Time in subprocesses (the CLI and tensor-parallel tests) shows
as wall time only. At the end it prints the files and tests that took longest, and writes every row to the JSON
file named by PJINFER_TEST_TIMES (default: test-times.json)."""
from __future__ import annotations

import io
import json
import os
import time
from collections import defaultdict

import pytest

from pjinfer.runtime.compile_cache import CompileStats, KernelCompileNotice

_rows: list[dict] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown together: a session fixture's compiles count for the test that first asks."""
    xla, numba = CompileStats(), KernelCompileNotice(io.StringIO())
    numba.start()
    start = time.perf_counter()
    try:
        yield
    finally:
        numba.finish()
        xla.close()
        _rows.append(dict(test=item.nodeid, seconds=time.perf_counter() - start, executables=xla.executables,
                          jax_seconds=xla.seconds, numba_seconds=numba.seconds))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _rows:
        return
    write = terminalreporter.write_line
    total = {k: sum(r[k] for r in _rows) for k in ("seconds", "jax_seconds", "numba_seconds", "executables")}
    write(f"\ntest time: {total['seconds']:.0f} s, of it compiling {total['executables']} JAX executables "
          f"{total['jax_seconds']:.0f} s (trace, lower, compile) and Numba kernels {total['numba_seconds']:.0f} s")
    files = defaultdict(lambda: defaultdict(float))
    for r in _rows:
        for k in ("seconds", "jax_seconds", "numba_seconds", "executables"):
            files[r["test"].split("::")[0]][k] += r[k]
    head = f"{'seconds':>8} {'jax s':>7} {'numba s':>8} {'execs':>6}  "
    row = lambda r, name: (f"{r['seconds']:8.1f} {r['jax_seconds']:7.1f} {r['numba_seconds']:8.1f} "  # noqa: E731
                           f"{int(r['executables']):6d}  {name}")
    write(head + "file")
    for name, r in sorted(files.items(), key=lambda kv: -kv[1]["seconds"])[:15]:
        write(row(r, name))
    write(head + "test")
    for r in sorted(_rows, key=lambda r: -r["seconds"])[:30]:
        write(row(r, r["test"]))
    path = os.environ.get("PJINFER_TEST_TIMES", "test-times.json")
    with open(path, "w") as f:
        json.dump(_rows, f, indent=0)
    write(f"every test's row: {path}")
