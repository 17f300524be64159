"""The XLA FFI plumbing shared by pjinfer's CPU targets (``bridge``: cold FFN neurons; ``host_decode``: the
quantized decode layer): ctypes mirrors of xla/ffi/api/c_api.h and the byte offsets taken from them, LLVM
intrinsics for raw loads and stores from Numba, the call frame's first checks, error creation, and the
process-wide spin lock every handler holds while it runs Numba code.

Handlers are Numba ``@cfunc`` (``XLA_FFI_Error* handler(XLA_FFI_CallFrame*)``, pointers as pointer-sized
integers); ``bridge.py``'s docstring explains the call protocol. The offsets follow x86-64 / LP64 and FFI API
0.3 as shipped in jaxlib 0.10.2; they were checked against the header with a C compiler and are pinned in
tests/test_cpu_offload.py.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import threading

import jax
import numpy as np

from .contract import ConfigError

from . import _numba  # (first: the threading layer and the BLAS check, before numba is imported)

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

FFI_API_VERSION = (0, 3)  # the xla/ffi/api/c_api.h version the handlers were written against

# ---------------------------------------------------------------------------------------------------------------
# ctypes mirrors of the parts of xla/ffi/api/c_api.h we touch (layout only; offsets feed the cfunc as constants).

_p = ctypes.c_void_p
_size_t = ctypes.c_size_t
_enum = ctypes.c_int  # C enums are int-sized on the platforms XLA supports


class _ExtensionBase(ctypes.Structure):
    _fields_ = [("struct_size", _size_t), ("type", _enum), ("next", _p)]


class _ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", _size_t), ("extension_start", _p), ("major_version", ctypes.c_int),
                ("minor_version", ctypes.c_int)]


class _Metadata(ctypes.Structure):
    _fields_ = [("struct_size", _size_t), ("api_version", _ApiVersion), ("traits", ctypes.c_uint32),
                ("state_type_id", ctypes.c_int64)]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", _ExtensionBase), ("metadata", _p)]


class _Args(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets share this layout
    _fields_ = [("struct_size", _size_t), ("extension_start", _p), ("size", ctypes.c_int64), ("types", _p),
                ("args", _p)]


class _Attrs(ctypes.Structure):
    _fields_ = [("struct_size", _size_t), ("extension_start", _p), ("size", ctypes.c_int64), ("types", _p),
                ("names", _p), ("attrs", _p)]


class _CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", _size_t), ("extension_start", _p), ("api", _p), ("ctx", _p), ("stage", _enum),
                ("args", _Args), ("rets", _Args), ("attrs", _Attrs), ("future", _p)]


class _Buffer(ctypes.Structure):
    _fields_ = [("struct_size", _size_t), ("extension_start", _p), ("dtype", _enum), ("data", _p),
                ("rank", ctypes.c_int64), ("dims", _p)]


class _ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", _p), ("len", _size_t)]


class _Scalar(ctypes.Structure):
    _fields_ = [("dtype", _enum), ("value", _p)]


class _Api(ctypes.Structure):  # only the head: version block, internal api, then the function table
    _fields_ = [("struct_size", _size_t), ("extension_start", _p), ("api_version", _ApiVersion),
                ("internal_api", _p), ("XLA_FFI_Error_Create", _p)]


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", _size_t), ("extension_start", _p), ("message", ctypes.c_char_p),
                ("errc", _enum)]


def _off(struct, *path) -> int:
    off = 0
    for name in path:
        field = getattr(struct, name)
        off += field.offset
        struct = dict(struct._fields_)[name]
    return off


def _struct_size(struct, last_field) -> int:
    """XLA_FFI_STRUCT_SIZE: offset of the last field plus its size (no tail padding)."""
    return getattr(struct, last_field).offset + ctypes.sizeof(dict(struct._fields_)[last_field])


CF_EXT = _off(_CallFrame, "extension_start")
CF_API = _off(_CallFrame, "api")
CF_STAGE = _off(_CallFrame, "stage")
CF_NARGS = _off(_CallFrame, "args", "size")
CF_ARGS = _off(_CallFrame, "args", "args")
CF_NRETS = _off(_CallFrame, "rets", "size")
CF_RETS = _off(_CallFrame, "rets", "args")
CF_NATTRS = _off(_CallFrame, "attrs", "size")
CF_ATTR_TYPES = _off(_CallFrame, "attrs", "types")
CF_ATTR_NAMES = _off(_CallFrame, "attrs", "names")
CF_ATTR_VALUES = _off(_CallFrame, "attrs", "attrs")
CF_STRUCT_SIZE = _struct_size(_CallFrame, "attrs")
EXT_TYPE = _off(_ExtensionBase, "type")
MDX_METADATA = _off(_MetadataExtension, "metadata")
MDX_STRUCT_SIZE = _struct_size(_MetadataExtension, "metadata")
MD_VERSION = _off(_Metadata, "api_version")
MD_VERSION_MAJOR = _off(_Metadata, "api_version", "major_version")
MD_VERSION_MINOR = _off(_Metadata, "api_version", "minor_version")
MD_TRAITS = _off(_Metadata, "traits")
MD_STRUCT_SIZE = _struct_size(_Metadata, "traits")
VERSION_STRUCT_SIZE = _struct_size(_ApiVersion, "minor_version")
BUF_DTYPE = _off(_Buffer, "dtype")
BUF_DATA = _off(_Buffer, "data")
BUF_RANK = _off(_Buffer, "rank")
BUF_DIMS = _off(_Buffer, "dims")
SPAN_LEN = _off(_ByteSpan, "len")
SCALAR_VALUE = _off(_Scalar, "value")
API_ERROR_CREATE = _off(_Api, "XLA_FFI_Error_Create")
ERR_MESSAGE = _off(_ErrorCreateArgs, "message")
ERR_ERRC = _off(_ErrorCreateArgs, "errc")
ERR_STRUCT_SIZE = _struct_size(_ErrorCreateArgs, "errc")

EXTENSION_METADATA = 1
STAGE_EXECUTE = 3
ARG_BUFFER = 1
ATTR_SCALAR = 3
DT_PRED, DT_S32, DT_S64, DT_F16, DT_F32 = 1, 4, 5, 10, 11
ERRC_INVALID_ARGUMENT, ERRC_FAILED_PRECONDITION, ERRC_OUT_OF_RANGE = 3, 9, 11

# Runtime block slots (int64 words, process-wide, see RUNTIME below).
R_LOCK, R_YIELD, R_THREADS, R_EXECUTES, R_BATCH_THREADS = range(5)

# ---------------------------------------------------------------------------------------------------------------
# LLVM intrinsics: raw loads / stores, pointer casts, a compare-and-swap, calls through function pointers, and
# C string constants (they live in the compiled code, so they outlive any call).

_i8, _i32, _i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_i8p = _i8.as_pointer()


def _int_arg(t):
    return isinstance(t, types.Integer)


@intrinsic
def load_i64(typingctx, addr):
    if not _int_arg(addr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(builder.inttoptr(args[0], _i64.as_pointer()))
    return types.int64(addr), codegen


@intrinsic
def load_i32(typingctx, addr):
    if not _int_arg(addr):
        return None

    def codegen(context, builder, sig, args):
        return builder.sext(builder.load(builder.inttoptr(args[0], _i32.as_pointer())), _i64)
    return types.int64(addr), codegen


@intrinsic
def load_u8(typingctx, addr):
    if not _int_arg(addr):
        return None

    def codegen(context, builder, sig, args):
        return builder.zext(builder.load(builder.inttoptr(args[0], _i8p)), _i64)
    return types.int64(addr), codegen


@intrinsic
def store_i64(typingctx, addr, value):
    if not (_int_arg(addr) and _int_arg(value)):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[1], sig.args[1], types.int64)
        builder.store(v, builder.inttoptr(args[0], _i64.as_pointer()))
    return types.void(addr, value), codegen


@intrinsic
def store_i32(typingctx, addr, value):
    if not (_int_arg(addr) and _int_arg(value)):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[1], sig.args[1], types.int32)
        builder.store(v, builder.inttoptr(args[0], _i32.as_pointer()))
    return types.void(addr, value), codegen


def typed_pointer(name, element):
    """An intrinsic turning a pointer-sized integer into a CPointer(element) (what carray takes)."""
    def impl(typingctx, addr):
        if not _int_arg(addr):
            return None

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(element).as_pointer())
        return types.CPointer(element)(addr), codegen
    impl.__name__ = impl.__qualname__ = name
    return intrinsic(impl)


ptr_f32 = typed_pointer("ptr_f32", types.float32)
ptr_i32 = typed_pointer("ptr_i32", types.int32)
ptr_i8 = typed_pointer("ptr_i8", types.int8)
ptr_u8 = typed_pointer("ptr_u8", types.uint8)
ptr_u16 = typed_pointer("ptr_u16", types.uint16)
ptr_f64 = typed_pointer("ptr_f64", types.float64)


@intrinsic
def cas_i64(typingctx, addr, expected, new):
    """Atomic compare-and-swap (acq_rel); returns the old value."""
    if not (_int_arg(addr) and _int_arg(expected) and _int_arg(new)):
        return None

    def codegen(context, builder, sig, args):
        ptr = builder.inttoptr(args[0], _i64.as_pointer())
        exp = context.cast(builder, args[1], sig.args[1], types.int64)
        new_ = context.cast(builder, args[2], sig.args[2], types.int64)
        pair = builder.cmpxchg(ptr, exp, new_, "acq_rel", "monotonic")
        return builder.extract_value(pair, 0)
    return types.int64(addr, expected, new), codegen


@intrinsic
def load_acquire_i64(typingctx, addr):
    if not _int_arg(addr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(builder.inttoptr(args[0], _i64.as_pointer()), "acquire", 8)
    return types.int64(addr), codegen


@intrinsic
def store_release_i64(typingctx, addr, value):
    if not (_int_arg(addr) and _int_arg(value)):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[1], sig.args[1], types.int64)
        builder.store_atomic(v, builder.inttoptr(args[0], _i64.as_pointer()), "release", 8)
    return types.void(addr, value), codegen


@intrinsic
def call_void0(typingctx, fnaddr):
    """Call ``int f(void)`` at address fnaddr (used for sched_yield); returns its int result."""
    if not _int_arg(fnaddr):
        return None

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(_i32, [])
        res = builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [])
        return builder.sext(res, _i64)
    return types.int64(fnaddr), codegen


@intrinsic(prefer_literal=True)
def cstr(typingctx, text):
    """Address of a NUL-terminated constant copy of a string literal, embedded in the compiled code."""
    if not isinstance(text, types.StringLiteral):
        return None
    value = text.literal_value

    def codegen(context, builder, sig, args):
        return builder.ptrtoint(context.insert_const_string(builder.module, value), _i64)
    return types.int64(text), codegen


@intrinsic
def make_error(typingctx, api, errc, message):
    """api->XLA_FFI_Error_Create(&{struct_size, NULL, message, errc}); returns the XLA_FFI_Error* as an int."""
    if not (_int_arg(api) and _int_arg(errc) and _int_arg(message)):
        return None

    def codegen(context, builder, sig, args):
        api_, errc_, msg_ = args
        errc_ = context.cast(builder, errc_, sig.args[1], types.int32)
        msg_ = context.cast(builder, msg_, sig.args[2], types.int64)
        buf = cgutils.alloca_once(builder, _i64, size=4)  # 32 zeroed bytes >= the 28-byte struct
        for i in range(4):
            builder.store(_i64(0), builder.gep(buf, [_i32(i)]))
        base = builder.ptrtoint(buf, _i64)

        def at(off, ty):
            return builder.inttoptr(builder.add(base, _i64(off)), ty.as_pointer())
        builder.store(_i64(ERR_STRUCT_SIZE), at(0, _i64))
        builder.store(msg_, at(ERR_MESSAGE, _i64))
        builder.store(errc_, at(ERR_ERRC, _i32))
        fn_addr = builder.load(builder.inttoptr(builder.add(api_, _i64(API_ERROR_CREATE)), _i64.as_pointer()))
        fnty = ir.FunctionType(_i8p, [_i8p])
        res = builder.call(builder.inttoptr(fn_addr, fnty.as_pointer()), [builder.inttoptr(base, _i8p)])
        return builder.ptrtoint(res, _i64)
    return types.int64(api, errc, message), codegen


# ---------------------------------------------------------------------------------------------------------------
NOJIT = dict(nogil=True, cache=True)


@njit(**NOJIT)
def lock(runtime_addr):
    lock = runtime_addr + 8 * R_LOCK
    yield_fn = load_i64(runtime_addr + 8 * R_YIELD)
    spins = 0
    while cas_i64(lock, 0, 1) != 0:
        spins += 1
        if spins > 64 and yield_fn != 0:
            call_void0(yield_fn)


@njit(**NOJIT)
def unlock(runtime_addr):
    store_release_i64(runtime_addr + 8 * R_LOCK, 0)


@njit(**NOJIT)
def buffer_numel(buf, skip_last):
    """Product of a buffer's dims (without the last one when skip_last)."""
    rank = load_i64(buf + BUF_RANK)
    dims = load_i64(buf + BUF_DIMS)
    n = 1
    for i in range(rank - (1 if skip_last else 0)):
        n *= load_i64(dims + 8 * i)
    return n


@njit(**NOJIT)
def last_dim(buf):
    rank = load_i64(buf + BUF_RANK)
    if rank < 1:
        return -1
    return load_i64(load_i64(buf + BUF_DIMS) + 8 * (rank - 1))


@njit(**NOJIT)
def find_table_attr(frame):
    """Value of the int64 scalar attribute named "table", or 0 when absent / of the wrong kind."""
    n = load_i64(frame + CF_NATTRS)
    types_ = load_i64(frame + CF_ATTR_TYPES)
    names = load_i64(frame + CF_ATTR_NAMES)
    values = load_i64(frame + CF_ATTR_VALUES)
    for i in range(n):
        span = load_i64(names + 8 * i)
        if load_i64(span + SPAN_LEN) != 5:
            continue
        s = load_i64(span)
        if not (load_u8(s) == 116 and load_u8(s + 1) == 97 and load_u8(s + 2) == 98  # t a b
                and load_u8(s + 3) == 108 and load_u8(s + 4) == 101):  # l e
            continue
        if load_i32(types_ + 4 * i) != ATTR_SCALAR:
            return 0
        scalar = load_i64(values + 8 * i)
        if load_i32(scalar) != DT_S64:
            return 0
        return load_i64(load_i64(scalar + SCALAR_VALUE))
    return 0



@njit(**NOJIT)
def fill_metadata(api, ext):
    if load_i64(ext) < MDX_STRUCT_SIZE:
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr("pjinfer ffi: metadata extension too small"))
    md = load_i64(ext + MDX_METADATA)
    if md == 0 or load_i64(md) < MD_STRUCT_SIZE:
        return make_error(api, ERRC_INVALID_ARGUMENT, cstr("pjinfer ffi: metadata struct too small"))
    store_i64(md + MD_VERSION, VERSION_STRUCT_SIZE)  # api_version.struct_size
    store_i64(md + MD_VERSION + 8, 0)  # api_version.extension_start
    store_i32(md + MD_VERSION_MAJOR, FFI_API_VERSION[0])
    store_i32(md + MD_VERSION_MINOR, FFI_API_VERSION[1])
    store_i32(md + MD_TRAITS, 0)  # not command-buffer compatible (irrelevant on CPU)
    return 0


@njit(**NOJIT)
def prelude(frame):
    """The checks every handler starts with. Returns (done, result): done is True for a metadata request
    (answered here), a stage other than execute (nothing to do) or a call frame too small (an error)."""
    api = load_i64(frame + CF_API)
    ext = load_i64(frame + CF_EXT)
    if ext != 0 and load_i32(ext + EXT_TYPE) == EXTENSION_METADATA:
        return True, fill_metadata(api, ext)
    if load_i64(frame) < CF_STRUCT_SIZE:
        return True, make_error(api, ERRC_INVALID_ARGUMENT, cstr("pjinfer ffi: XLA_FFI_CallFrame too small"))
    if load_i32(frame + CF_STAGE) != STAGE_EXECUTE:
        return True, 0  # instantiate / prepare / initialize: nothing to set up
    return False, 0


@njit(nogil=True, inline="always")
def serve(frame, execute):
    """A handler cfunc's body: prelude's checks, then at the execute stage execute(frame, api), a jitted function
    (the module's own checks and work). Inlined into each handler (Numba IR): a jitted function passed to a
    compiled call carries its object's address, and a handler holding one cannot be cached."""
    done, result = prelude(frame)
    if done:
        return result
    return execute(frame, load_i64(frame + CF_API))


# The runtime block: process-wide, never freed (compiled executables hold its address through the handlers'
# headers). The lock word serialises every handler's Numba work: Numba's workqueue layer forbids concurrent
# parallel launches, the host-decode team has one set of workers, and XLA may run independent custom calls on
# several threads.
RUNTIME = np.zeros(8, np.int64)
try:
    RUNTIME[R_YIELD] = ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value or 0
except (OSError, AttributeError):  # pragma: no cover - no sched_yield: pure spinning
    RUNTIME[R_YIELD] = 0
RUNTIME_ADDR = int(RUNTIME.ctypes.data)


_DEPENDS: dict = {}   # cpu_offload module name -> the modules it named to purge_stale_cache


def _closure(modules) -> list:
    """The modules and, through _DEPENDS, everything they depend on, each once, in a fixed order."""
    seen: dict = {}
    stack = list(modules)
    while stack:
        m = stack.pop()
        if m.__file__ not in seen:
            seen[m.__file__] = m
            stack.extend(_DEPENDS.get(m.__name__.rsplit(".", 1)[-1], ()))
    return [seen[f] for f in sorted(seen)]


def purge_stale_cache(name: str, *dependencies) -> None:
    """Numba's on-disk cache keys a function on its own file only, but a handler module's cached functions have
    the kernels and intrinsics of other files compiled into them, and the options of _numba.JIT. Drop the cache
    entries of cpu_offload module `name` when _numba, any of `dependencies` (modules), or anything they depend on in
    turn (what they named here when they were imported), changed."""
    _DEPENDS[name] = dependencies
    try:
        cache_dir = lock._cache.cache_path  # this package's cache folder
        files = _closure((_numba, *dependencies))
        digest = hashlib.sha256(b"".join(open(m.__file__, "rb").read() for m in files)).hexdigest()
        stamp = os.path.join(cache_dir, f"{name}.deps-sha256.txt")
        old = open(stamp).read().strip() if os.path.exists(stamp) else None
        if old != digest:
            for entry in os.listdir(cache_dir):
                if entry.startswith(name + ".") and entry.endswith((".nbi", ".nbc")):
                    os.remove(os.path.join(cache_dir, entry))
            with open(stamp, "w") as fh:
                fh.write(digest + "\n")
    except (OSError, AttributeError):  # read-only or unusual cache location: Numba still works, maybe stale
        pass


_registered: set = set()
_register_lock = threading.Lock()


def check_platform(platform: str, what: str, instead: str) -> None:
    """The targets here are registered for the CPU platform only (register): their Numba handlers read host
    buffers, so a step compiled for another platform (JAX on a GPU) has no handler to call. ConfigError in one
    line when `platform` (jax.default_backend()) is not the CPU: `what` cannot run, `instead` can."""
    if platform != "cpu":
        raise ConfigError(f"{what} runs on the host through XLA FFI targets for the CPU, and JAX here runs on "
                          f"{platform}: {instead}, or run with JAX_PLATFORMS=cpu")


def register(name: str, handler) -> None:
    """Register a cfunc handler as the CPU FFI target `name`, once per process."""
    with _register_lock:
        if name in _registered:
            return

        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler.address), platform="cpu")
        _registered.add(name)
