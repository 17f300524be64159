"""Small LLVM IR helpers for the host kernels written as vector IR (``q4.py``, ``int8.py``, ``q8_dot.py``).

Why IR with explicit flags: Numba's fastmath gives every float operation that carries no flags all the fast-math
flags, and with reassociation and contraction allowed LLVM may order a sum differently depending on the function
the kernel is inlined into (a callee loaded from Numba's cache is linked, a freshly compiled one inlined). The
single-token and the batched decode steps then came out ulps apart. Operations built through ``strict`` keep the
order the IR states in every caller, so two paths that emit the same IR compute the same bits.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, config
from numba.core.codegen import get_host_cpu_features

F32, I32, I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
I8, I16 = ir.IntType(8), ir.IntType(16)
V16F = ir.VectorType(F32, 16)
V32I8, V64I8, V8I32 = ir.VectorType(I8, 32), ir.VectorType(I8, 64), ir.VectorType(I32, 8)
V16I8 = ir.VectorType(ir.IntType(8), 16)
V16I32 = ir.VectorType(I32, 16)
ZERO16 = ir.Constant(V16F, [0.0] * 16)


def cpu_has(feature: str) -> bool:
    """Whether Numba compiles for a CPU with this LLVM feature ("avx512f", "avx512vnni", ...): the host's, or
    NUMBA_CPU_FEATURES where set (how the AVX2 code is compiled and checked on an AVX-512 machine)."""
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    return f"+{feature}" in features.split(",")


def strict(instr):
    """Mark a float instruction with flags that allow no reassociation or contraction (see the module docstring)."""
    instr.flags.extend(("nnan", "ninf"))
    return instr


def vector_intrinsic(builder, name: str, n_args: int):
    """The 16 x float32 form of an LLVM intrinsic (llvm.fma, llvm.floor, ...)."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F] * n_args), f"{name}.v16f32")


def pointer(builder, addr, ty):
    """An integer address as a pointer to ty."""
    return builder.inttoptr(addr, ty.as_pointer())


def load(builder, addr, ty, align):
    """Load a ty from an integer address."""
    return builder.load(pointer(builder, addr, ty), align=align)


def memory_fence(builder, *pointers) -> None:
    """A compiler barrier (it emits no instruction) that may read and write what `pointers` point at: values stored
    there before it are loaded from memory after it, not kept in registers. A lane of a stored vector is then
    broadcast by one load (``vbroadcastss`` from the stack) instead of shuffles on the vector ALUs."""
    types_ = [p.type for p in pointers]
    fence = ir.InlineAsm(ir.FunctionType(ir.VoidType(), types_), "", ",".join(["r"] * len(pointers) + ["~{memory}"]),
                         side_effect=True)
    builder.call(fence, list(pointers))


def half_splat(builder, addr):
    """The float16 at an integer address, as float32 in 16 lanes: broadcast as float16, then converted
    (vpbroadcastw, vcvtph2ps), so that no lane waits on an earlier value. A scalar load is put in with vpinsrw into
    whatever register LLVM picks, and that waits for the register's last writer: in a row loop, an accumulator,
    which chained every block to the previous block's FMAs."""
    h = builder.bitcast(load(builder, addr, ir.IntType(16), 1), ir.HalfType())
    one = builder.insert_element(ir.Constant(ir.VectorType(ir.HalfType(), 16), ir.Undefined), h, I32(0))
    v = builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(I32, 16), [0] * 16))
    return builder.fpext(v, V16F)


def splat(builder, value):
    """A scalar (float32, i32, ...) broadcast to 16 lanes of its type."""
    lane0 = ir.Constant(ir.VectorType(I32, 16), [0] * 16)
    undefined = ir.Constant(ir.VectorType(value.type, 16), ir.Undefined)
    one = builder.insert_element(undefined, value, I32(0))
    return builder.shuffle_vector(one, undefined, lane0)


def ints(value: int):
    """An i32 constant in 16 lanes."""
    return ir.Constant(V16I32, [value] * 16)


def by_value(builder, k, values, emit, result=None):
    """IR: emit(v) for the v in values that equals k (an i64 known at run time); another k does nothing. A kernel
    whose unrolled form depends on a size (tokens in a group, 16-lane chunks of a head) or on a block type emits one
    case per value. With result (an IR type) each emit returns a value of that type, and so does this: the case's,
    or zero for a k not in values."""
    start = builder.block
    end = builder.append_basic_block("case_end")
    switch = builder.switch(k, end)
    incoming = []
    for v in values:
        block = builder.append_basic_block(f"case_{v}")
        switch.add_case(I64(v), block)
        builder.position_at_end(block)
        incoming.append((emit(v), builder.block))
        builder.branch(end)
    builder.position_at_end(end)
    if result is None:
        return None
    phi = builder.phi(result)
    phi.add_incoming(ir.Constant(result, None), start)
    for value, block in incoming:
        phi.add_incoming(value, block)
    return phi


def hsum(builder, v):
    """The 16 lanes of v summed as a fixed tree (halves, then quarters, ...)."""
    for width in (8, 4, 2, 1):
        halves = [builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, width), list(range(k, k + width))))
                  for k in (0, width)]
        v = strict(builder.fadd(*halves))
    return builder.extract_element(v, I32(0))


# Integer dots: the 8-bit products the q8_dot kernels sum (VNNI where the CPU has it).
VNNI, AVX512BW = cpu_has("avx512vnni"), cpu_has("avx512bw")


def i8s(value: int, n: int):
    """An i8 constant in n lanes."""
    return ir.Constant(ir.VectorType(I8, n), [value] * n)


def concat(b, lo, hi):
    """Two byte vectors of n lanes as one of 2n."""
    n = lo.type.count
    return b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 2 * n), list(range(2 * n))))


def lanes(b, v, idx):
    """The lanes idx of v (a constant shuffle)."""
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, len(idx)), list(idx)))


def call(b, name, ret, args):
    """A call of the function (an LLVM intrinsic) `name` of these args' types returning ret."""
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return b.call(fn, args)


def dot4(b, w, xc, acc=None):
    """<n/4 x i32>: acc (or 0) plus, in lane l, the sum over k < 4 of w[4l + k] (unsigned) * xc[4l + k] (signed),
    both <n x i8>, n 64 or 32. Exact: with w <= 128 and |xc| <= 127 no 16-bit pair sum (the non-VNNI forms: at most
    2 128 127 = 32512) saturates."""
    n = w.type.count
    out = ir.VectorType(I32, n // 4)
    if VNNI:
        return call(b, f"llvm.x86.avx512.vpdpbusd.{8 * n}", out,
                    [ir.Constant(out, [0] * (n // 4)) if acc is None else acc, w, xc])
    p = _dot4_pairs(b, w, xc)
    return p if acc is None else b.add(acc, p)


def _dot4_pairs(b, w, xc):
    """dot4 without VNNI: vpmaddubsw (pairs to 16 bits), then vpmaddwd by ones (pairs of those to 32)."""
    n = w.type.count
    if AVX512BW and n == 64:
        pairs = call(b, "llvm.x86.avx512.pmaddubs.w.512", ir.VectorType(I16, 32), [w, xc])
        return call(b, "llvm.x86.avx512.pmaddw.d.512", V16I32, [pairs, ir.Constant(pairs.type, [1] * 32)])
    quarters = []
    for h in range(n // 32):
        half = range(32 * h, 32 * h + 32)
        pairs = call(b, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(I16, 16), [lanes(b, w, half),
                                                                                lanes(b, xc, half)])
        quarters.append(call(b, "llvm.x86.avx2.pmadd.wd", V8I32, [pairs, ir.Constant(pairs.type, [1] * 16)]))
    return quarters[0] if n == 32 else concat(b, *quarters)
