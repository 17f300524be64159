"""The FFN activations, in one place: each one's name, its code (the Numba kernels' switch value), whether it is
gated (act(gate) and up) and whether an inactive neuron is exactly zero (the ReLU family, where skipping it is exact),
with every form of it: JAX (``activate``: the model, the Pallas kernels), a float64 numpy reference (``reference``:
the tests), and Numba for every host kernel: ``act(g, u, code)`` for one neuron and ``act_span(gate, up, lo, hi,
code)`` for a range of them in place.

SwiGLU's exp is written as LLVM IR (``emit_swiglu``), once for a float and once for 16 lanes with the same operations
lane by lane, so act_span computes 16 neurons per pass and every path (the dense and batched decode, the sparse
decode, the cold-neuron kernels) gets the same bits for a neuron whichever form computed it. libm's expf through
Numba, one neuron at a time, was most of the SwiGLU stage's time in the batched decode step.
"""
from __future__ import annotations

import dataclasses
import math

from ._numba import JIT  # (first: the threading layer and the BLAS check, before numba is imported)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import ffi, vector_ir  # noqa: E402
from .contract import ConfigError  # noqa: E402
from .vector_ir import strict  # noqa: E402

ffi.purge_stale_cache("activation", vector_ir)  # strict's flags are compiled into this module's cached functions


@dataclasses.dataclass(frozen=True)
class Activation:
    name: str
    code: int            # the Numba kernels' switch value
    gated: bool          # act(gate) * up (drelu: relu(gate) * relu(up)); else act(up) alone (OPT's fc1 + ReLU)
    exact_zero: bool     # inactive neurons are exactly zero


ACTIVATIONS = {a.name: a for a in (
    Activation("swiglu", 0, gated=True, exact_zero=False),
    Activation("geglu", 1, gated=True, exact_zero=False),     # GELU's tanh approximation
    Activation("reglu", 2, gated=True, exact_zero=True),
    Activation("drelu", 3, gated=True, exact_zero=True),
    Activation("relu", 4, gated=False, exact_zero=True),
)}
GATED = tuple(n for n, a in ACTIVATIONS.items() if a.gated)
EXACT_ZERO = tuple(n for n, a in ACTIVATIONS.items() if a.exact_zero)


def get(name: str) -> Activation:
    """The activation called `name`; a ConfigError naming the known ones otherwise."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ConfigError(f"unknown activation {name!r} (known: {', '.join(ACTIVATIONS)})") from None


def activate(name: str, gate, up):
    """JAX: the per-neuron activation of an FFN (`gate` is None for an ungated one)."""
    code = get(name).code
    if code == 0:
        return jax.nn.silu(gate) * up
    if code == 1:
        return jax.nn.gelu(gate, approximate=True) * up
    if code == 2:
        return jax.nn.relu(gate) * up
    if code == 3:
        return jax.nn.relu(gate) * jax.nn.relu(up)
    return jax.nn.relu(up)


def reference(name: str, gate: np.ndarray | None, up: np.ndarray) -> np.ndarray:
    """numpy, float64: the same activation, computed plainly."""
    code = get(name).code
    g = None if gate is None else np.asarray(gate, np.float64)
    u = np.asarray(up, np.float64)
    if code == 0:
        return g / (1.0 + np.exp(-g)) * u
    if code == 1:
        return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3))) * u
    if code == 2:
        return np.maximum(g, 0.0) * u
    if code == 3:
        return np.maximum(g, 0.0) * np.maximum(u, 0.0)
    return np.maximum(u, 0.0)


_F0 = np.float32(0.0)
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_GELU_C = np.float32(math.sqrt(2.0 / math.pi))
_GELU_A = np.float32(0.044715)

# SwiGLU's exp, as Cephes' expf: n = rint(x log2 e), r = x - n ln 2 (in two parts), exp(r) = 1 + r + r^2 p(r) with p
# of degree 5, times 2^n. x is clamped to [_EXP_LO, _EXP_HI], so 2^n stays a normal float. SwiGLU comes out within
# 3 ulp of a float64 reference for |g| < 80 (tests/test_activation.py allows 4).
_EXP_LO, _EXP_HI = -87.0, 88.0
_LOG2E, _LN2_HI, _LN2_LO = 1.44269504088896341, 0.693359375, -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def emit_swiglu(builder, g, u):
    """IR: g / (1 + exp(-g)) * u, for float32 or <16 x float32> values, lane by lane the same operations (strict
    flags, explicit fma): the scalar form (``act``) and the vector form (``act_span``) give the same bits."""
    ty = g.type
    lanes = ty.count if isinstance(ty, ir.VectorType) else 0
    ity = ir.VectorType(ir.IntType(32), lanes) if lanes else ir.IntType(32)
    suffix = f"v{lanes}f32" if lanes else "f32"

    def const(value, t=ty):
        return ir.Constant(t, [value] * lanes) if lanes else ir.Constant(t, value)

    def call(name, *args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty] * len(args)),
                                            f"llvm.{name}.{suffix}")
        return builder.call(fn, list(args))

    x = call("maxnum", call("minnum", strict(builder.fneg(g)), const(_EXP_HI)), const(_EXP_LO))
    n = call("rint", strict(builder.fmul(x, const(_LOG2E))))
    r = call("fma", n, const(-_LN2_HI), x)
    r = call("fma", n, const(-_LN2_LO), r)
    p = const(_EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        p = call("fma", p, r, const(c))
    e = call("fma", p, strict(builder.fmul(r, r)), strict(builder.fadd(r, const(1.0))))
    scale = builder.shl(builder.add(builder.fptosi(n, ity), const(127, ity)), const(23, ity))
    e = strict(builder.fmul(e, builder.bitcast(scale, ty)))
    return strict(builder.fmul(strict(builder.fdiv(g, strict(builder.fadd(e, const(1.0))))), u))


@intrinsic
def _swiglu(typingctx, g, u):
    """float32 g / (1 + exp(-g)) * u (emit_swiglu)."""
    if not (g == types.float32 and u == types.float32):
        return None

    def codegen(context, builder, sig, args):
        return emit_swiglu(builder, *args)
    return types.float32(types.float32, types.float32), codegen


@intrinsic
def _swiglu16(typingctx, gate, up):
    """The 16 floats at address gate become emit_swiglu of themselves and the 16 at address up (integer
    addresses, no bounds checks)."""
    if not (isinstance(gate, types.Integer) and isinstance(up, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = ir.VectorType(ir.FloatType(), 16).as_pointer()
        at = builder.inttoptr(args[0], ptr)
        g = builder.load(at, align=4)
        u = builder.load(builder.inttoptr(args[1], ptr), align=4)
        builder.store(emit_swiglu(builder, g, u), at, align=4)
        return context.get_dummy_value()
    return types.void(gate, up), codegen


@njit(inline="always", **JIT)
def act(g, u, code):
    """The activation with this `code` (ACTIVATIONS), in Numba (float32)."""
    if code == 0:  # swiglu
        return _swiglu(np.float32(g), np.float32(u))
    if code == 1:  # geglu (tanh approximation)
        return _HALF * g * (_ONE + np.tanh(_GELU_C * (g + _GELU_A * g * g * g))) * u
    if code == 2:  # reglu
        return max(g, _F0) * u
    if code == 3:  # drelu
        return max(g, _F0) * max(u, _F0)
    return max(u, _F0)  # relu (no gate)


@njit(**JIT)
def act_span(gate, up, lo, hi, code):
    """gate[i] = act(gate[i], up[i], code) for i in [lo, hi) (float32, contiguous): SwiGLU 16 at a time, with the
    same bits as act."""
    i = lo
    if code == 0:
        while i + 16 <= hi:
            _swiglu16(gate.ctypes.data + 4 * i, up.ctypes.data + 4 * i)
            i += 16
    while i < hi:
        gate[i] = act(gate[i], up[i], code)
        i += 1
