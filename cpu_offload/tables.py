"""Handler tables by index. A handler's "table" attribute names an index here, not an address: the index is the
same in every process that makes its tables in the same order, so the compiled executables are too and JAX's
persistent cache serves them. (With the address as the attribute, every run compiled its prefill and decode step
again: 3-14 s, and about 250 MB of peak RSS for LLVM, default model.) Machine code reaches the array through a
symbol that each process binds to its own copy (llvmlite add_symbol), never through a baked-in address."""
from __future__ import annotations

import threading

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .ffi import NOJIT, find_table_attr, load_i64

TABLES_SIZE = 4096
TABLES = np.zeros(TABLES_SIZE, np.int64)
_TABLES_SYMBOL = "pjinfer_ffi_tables"
llvm.add_symbol(_TABLES_SYMBOL, int(TABLES.ctypes.data))
_tables_lock = threading.Lock()
_tables_used = [0]


@intrinsic
def _tables_address(typingctx):
    def codegen(context, builder, sig, args):
        table = builder.module.globals.get(_TABLES_SYMBOL)
        if table is None:
            table = ir.GlobalVariable(builder.module, ir.IntType(64), _TABLES_SYMBOL)
        return builder.ptrtoint(table, ir.IntType(64))
    return types.int64(), codegen


def register_table(address: int) -> int:
    """The index a "table" attribute passes for the table at address (kept for the life of the process)."""
    with _tables_lock:
        index = _tables_used[0]
        if index >= TABLES_SIZE:
            raise RuntimeError(f"pjinfer ffi: more than {TABLES_SIZE} tables in one process")
        TABLES[index] = address
        _tables_used[0] = index + 1
        return index


@njit(**NOJIT)
def find_table(frame):
    """The address of the table the "table" attribute's index names (register_table), or 0."""
    index = find_table_attr(frame)
    if index < 0 or index >= TABLES_SIZE:
        return 0
    return load_i64(_tables_address() + 8 * index)


