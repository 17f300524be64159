"""The block-type table: one row per way a matrix row is stored in blocks, as ggml's type_traits.

A row (``BlockType``) says what a type is and who reads it: its code (the ggml type number; the FFI headers
carry it), weights and bytes per block, its dequantizer (written once for numpy and jax.numpy), its quantizer,
the host GEMV and the batched GEMM that read it, and the other layouts it is relaid into. ``TYPES`` holds every
row by code; code elsewhere looks a type up here instead of testing its name.

The llama.cpp block types (GGUF tensor types) store a row as consecutive blocks of ``block`` weights, their bytes
in block order (f16 little-endian):

    Q4_0  (32, 18)   d; 16 bytes: low nibbles are elements 0..15, high nibbles 16..31      w = d (q - 8)
    Q4_1  (32, 20)   d, m; nibbles as Q4_0                                                  w = d q + m
    Q5_0  (32, 22)   d; uint32 qh (bit j = 5th bit of element j); nibbles as Q4_0          w = d (q - 16)
    Q5_1  (32, 24)   d, m; qh; nibbles                                                      w = d q + m
    Q8_0  (32, 34)   d; 32 int8                                                             w = d q
    Q4_K (256, 144)  d, dmin; 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32; 128 bytes of nibbles:
                     bytes 32c..32c+31 hold sub-block 2c (low nibbles) and 2c+1 (high)      w = d sc q - dmin m
    Q5_K (256, 176)  as Q4_K, then 32 bytes qh before the nibbles: bit 2c / 2c+1 of qh[l] is the 5th bit of
                     element l of sub-block 2c / 2c+1
    Q6_K (256, 210)  128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16), d. In each half n (128 elements):
                     element 32i + l (i = 0..3, l < 32) has low 4 bits from ql[64n + l + 32 (i % 2)] (shift 4 for
                     i >= 2) and high 2 bits (qh[32n + l] >> 2i) & 3; w = d sc[8n + 2i + l // 16] (q - 32)

A matrix of these is one uint8 array [rows, row_bytes(cols)]. ``Q4_1x16`` is Q4_1 relaid for the dense host
decode (``group_rows``): rows in groups of 16, each group's bytes (its 16 rows' worth, in the same array shape)
block by block: the 16 rows' d (f16 x 16), their m (f16 x 16), then 256 bytes in four chunks c of 64, byte 4 r + t
of chunk c holding row r's code of element 4 c + t (low nibble) and of element 16 + 4 c + t (high nibble). A
dot of 16 rows with an input then takes four inputs at a time for all 16 rows (``q4_groups``), and their scales
are one vector. The same numbers in the same bytes, one matrix in memory.

pjinfer's own int8 (code -1, no ggml type) is two arrays: int8 [rows, cols] and a float32 scale per block of 64
inputs [rows, cols / 64] (``int8.quantize``; every matrix with ``--weights int8``, and the host decode's output
head).

``BlockType.dequantize(arrays, cols, xp)`` computes the float32 values from a matrix's arrays; for the GGUF types
with the same float32 operations, in the same order, as the gguf package's numpy dequantizer
(``gguf.quants.dequantize``, the reference the tests hold it to). ``xp`` is numpy (``qtensor.QTensor.float32``)
or jax.numpy (inside jit, ``pjinfer.runtime.model.QMatrix``), so the XLA path and the host kernels compute one
model. This module imports no Numba: a row names its kernels as ``module.function`` of cpu_offload.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from .contract import ConfigError


@dataclasses.dataclass(frozen=True)
class BlockType:
    """One row of the table (see the module docstring). values: float32 [..., block] of the blocks b (int32
    [..., nbytes] byte values) given the f16 decoder and xp; None where the matrix is not one byte array (int8).
    quantize: float32 [rows, cols] -> the matrix's arrays (None for int8: its quantizer is Numba, int8.quantize).
    gemv: the host GEMV (cpu_offload module.function).
    gemm: the batched decode's GEMM, None where it reads no such matrix. relayouts: (layout, what relays a matrix
    of this type into it) pairs. group: rows whose blocks are interleaved (Q4_1x16: 16; a matrix of such a type
    has a multiple of group rows, and is split only at multiples of it); its values are those of the blocks
    ungroup_rows gives back."""
    name: str
    code: int
    block: int
    nbytes: int
    values: Callable | None = dataclasses.field(repr=False)
    quantize: Callable | None = dataclasses.field(repr=False)
    gemv: str
    gemm: str | None = None
    relayouts: tuple = ()
    group: int = 1

    def row_bytes(self, cols: int) -> int:
        """Bytes of a row of cols weights (cols a multiple of the block size)."""
        if cols % self.block:
            raise ConfigError(f"{self.name} rows need a multiple of {self.block} elements, got {cols}")
        return cols // self.block * self.nbytes

    def relayout(self, into: str) -> str | None:
        """What relays a matrix of this type into the layout `into` ("int8", "columns"), or None."""
        return dict(self.relayouts).get(into)

    def dequantize(self, arrays, cols: int, xp=np):
        """A matrix's arrays (GGUF types: (uint8 [rows, row_bytes(cols)],); int8: (q, scales)) -> float32
        [rows, cols]; xp: numpy or jax.numpy."""
        if self.values is None:
            q, scales = (xp.asarray(a) for a in arrays)
            return (q.astype(xp.float32) * xp.repeat(scales, self.block, axis=-1)[..., :cols]).astype(xp.float32)
        (data,) = arrays
        rows = data.shape[0]
        if self.group > 1:
            data = ungroup_rows(data, cols, xp)
        b = xp.asarray(data).reshape(rows, cols // self.block, self.nbytes).astype(xp.int32)
        f16 = _np_f16 if xp is np else _jnp_f16
        return self.values(b, f16, xp).reshape(rows, cols).astype(xp.float32)


def _np_f16(lo, hi):
    return (lo.astype(np.uint16) | (hi.astype(np.uint16) << 8)).view(np.float16).astype(np.float32)


def _jnp_f16(lo, hi):
    bits = lo.astype(jnp.uint16) | (hi.astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _signed(b):
    """int32 values of bytes read as int8 (b holds 0..255 in an integer type)."""
    return b - ((b & 128) << 1)


def _f16_at(b, off, f16):
    return f16(b[..., off], b[..., off + 1])[..., None]


def _nibbles(qs, xp):
    """[..., 16] bytes -> [..., 32]: the low nibbles, then the high ones."""
    return xp.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits(b, off, xp):
    """[..., 4] little-endian bytes at off -> [..., 32] bits of that uint32, bit j at j."""
    word = b[..., off:off + 4]
    byte = xp.repeat(word, 8, axis=-1)           # byte j // 8 at j
    return (byte >> (xp.arange(32, dtype=b.dtype) % 8)) & 1


def _k_scales(s, xp):
    """[..., 12] packed 6-bit scales and mins of a Q4_K / Q5_K block -> (sc, m), each [..., 8]."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = xp.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = xp.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


# ---------------------------------------------------------------------------------------------------------------
# Each type's values, block by block: b int32 [..., nbytes] -> float32 [..., block].

def _q4_0(b, f16, xp):
    return _f16_at(b, 0, f16) * (_nibbles(b[..., 2:], xp) - 8).astype(xp.float32)


def _q4_1(b, f16, xp):
    return _nibbles(b[..., 4:], xp).astype(xp.float32) * _f16_at(b, 0, f16) + _f16_at(b, 2, f16)


def _q5(b, off, xp):
    """The 5-bit codes of a Q5_0 / Q5_1 block whose qh starts at byte off."""
    return _nibbles(b[..., off + 4:], xp) | (_bits(b, off, xp) << 4)


def _q5_0(b, f16, xp):
    return _f16_at(b, 0, f16) * (_q5(b, 2, xp) - 16).astype(xp.float32)


def _q5_1(b, f16, xp):
    return _q5(b, 4, xp).astype(xp.float32) * _f16_at(b, 0, f16) + _f16_at(b, 2, f16)


def _q8_0(b, f16, xp):
    return _f16_at(b, 0, f16) * _signed(b[..., 2:34]).astype(xp.float32)


def _k45(b, f16, xp, qs, qh):
    """A Q4_K (qh None) or Q5_K block, its nibbles at qs.."""
    lead = b.shape[:-1]
    d, dmin = _f16_at(b, 0, f16), _f16_at(b, 2, f16)
    sc, mn = _k_scales(b[..., 4:16], xp)
    ds = (d * sc.astype(xp.float32))[..., None]                                        # [..., 8, 1]
    dm = (dmin * mn.astype(xp.float32))[..., None]
    q = (b[..., qs:qs + 128].reshape(*lead, 4, 1, 32) >> xp.asarray([0, 4], b.dtype).reshape(2, 1)) & 15
    q = q.reshape(*lead, 8, 32)
    if qh is not None:
        q = q | (((b[..., qh:qh + 32].reshape(*lead, 1, 32) >> xp.arange(8, dtype=b.dtype).reshape(8, 1)) & 1) << 4)
    return (ds * q.astype(xp.float32) - dm).reshape(*lead, 256)


def _q4_k(b, f16, xp):
    return _k45(b, f16, xp, 16, None)


def _q5_k(b, f16, xp):
    return _k45(b, f16, xp, 48, 16)


def _q6_k(b, f16, xp):
    lead = b.shape[:-1]
    d = _f16_at(b, 208, f16)
    scale = (d * _signed(b[..., 192:208]).astype(xp.float32))[..., None]              # [..., 16, 1]
    ql = b[..., 0:128].reshape(*lead, 2, 1, 64) >> xp.asarray([0, 4], b.dtype).reshape(2, 1)
    ql = (ql & 15).reshape(*lead, 2, 4, 32)                                            # i = 0..3 per half
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> xp.asarray([0, 2, 4, 6], b.dtype).reshape(4, 1)
    q = (ql | ((qh & 3) << 4)) - 32
    return (scale * q.reshape(*lead, 16, 16).astype(xp.float32)).reshape(*lead, 256)


# ---------------------------------------------------------------------------------------------------------------
# Quantizers: float32 [rows, cols] -> the matrix's arrays.

def _quantize_q4_1(w):
    """llama.cpp's Q4_1 rule: m = the block's min, d = (max - min) / 15, q rounded. Every block therefore holds a q
    of 0 and a q of 15, and re-quantizing the values a Q4_1 tensor stands for gives back its bytes
    (tests/test_real_model.py checks it on the default model)."""
    w = np.ascontiguousarray(w, np.float32)
    rows, cols = w.shape
    b = w.reshape(rows, TYPES[Q4_1].row_bytes(cols) // 20, 32)
    lo, hi = b.min(-1), b.max(-1)
    d = ((hi - lo) / 15).astype(np.float16)
    m = lo.astype(np.float16)
    step = d.astype(np.float32)
    inv = np.divide(1, step, out=np.zeros_like(step), where=step != 0)
    q = np.clip(np.rint((b - m.astype(np.float32)[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    out = np.empty((rows, cols // 32, 20), np.uint8)
    out[..., 0:2] = d.view(np.uint8).reshape(rows, -1, 2)
    out[..., 2:4] = m.view(np.uint8).reshape(rows, -1, 2)
    out[..., 4:] = q[..., :16] | (q[..., 16:] << 4)
    return (out.reshape(rows, -1),)


def _quantize_q8_0(w):
    """gguf's quantizer (llama.cpp's rule)."""
    return (gguf.quants.quantize(np.ascontiguousarray(w, np.float32), gguf.GGMLQuantizationType.Q8_0),)


def group_rows(data: np.ndarray, cols: int, out: np.ndarray | None = None) -> np.ndarray:
    """Q4_1 blocks (uint8 [rows, row bytes], rows a multiple of 16) -> the same numbers as Q4_1x16 (layout in the
    module docstring), written into `out` (an array of data's shape and dtype; default a new one) and returned."""
    rows, nb = data.shape[0], cols // 32
    t = np.asarray(data).reshape(rows // 16, 16, nb, 20).transpose(0, 2, 1, 3)      # [group, block, row, byte]
    out = np.empty(data.shape, np.uint8) if out is None else out
    o = out.reshape(rows // 16, nb, 320)
    o[..., 0:32] = t[..., 0:2].reshape(rows // 16, nb, 32)
    o[..., 32:64] = t[..., 2:4].reshape(rows // 16, nb, 32)
    qs = t[..., 4:20]                                   # byte i: element i (low nibble), element 16 + i (high)
    low = (qs & 15).reshape(rows // 16, nb, 16, 4, 4).transpose(0, 1, 3, 2, 4)      # [g, b, chunk, row, t]
    high = (qs >> 4).reshape(rows // 16, nb, 16, 4, 4).transpose(0, 1, 3, 2, 4)
    o[..., 64:] = (low | (high << 4)).reshape(rows // 16, nb, 256)
    return out


def ungroup_rows(data, cols: int, xp=np):
    """Q4_1x16 bytes -> the Q4_1 blocks they came from (group_rows undone), numpy or jax.numpy."""
    rows, nb = data.shape[0], cols // 32
    g = xp.asarray(data).reshape(rows // 16, nb, 320)
    d = g[..., 0:32].reshape(rows // 16, nb, 16, 2)
    m = g[..., 32:64].reshape(rows // 16, nb, 16, 2)
    packed = g[..., 64:].reshape(rows // 16, nb, 4, 16, 4).transpose(0, 1, 3, 2, 4).reshape(rows // 16, nb, 16, 16)
    low, high = packed & 15, packed >> 4             # elements 4c + t and 16 + 4c + t, as a block's byte 4c + t
    qs = low | (high << 4)
    b = xp.concatenate([d, m, qs], axis=-1)                                         # [g, block, row, 20]
    return b.transpose(0, 2, 1, 3).reshape(rows, nb * 20)


INT8 = -1   # pjinfer's own int8: no ggml type number
_GEMV = "quants.gemv"   # every GGUF type's host GEMV
TYPES = {t.code: t for t in (
    BlockType("Q4_0", 2, 32, 18, _q4_0, None, _GEMV),
    BlockType("Q4_1", 3, 32, 20, _q4_1, _quantize_q4_1, _GEMV, gemm="q8_dot.gemm",
              relayouts=(("columns", "q4_sparse.relayout: by input column, sparse_decode's layers"),
                         ("x16", "blocks.group_rows: 16 rows interleaved, the dense host decode's layers"))),
    BlockType("Q4_1x16", 16, 32, 20, _q4_1, None, _GEMV, gemm="q8_dot.gemm", group=16),
    BlockType("Q5_0", 6, 32, 22, _q5_0, None, _GEMV),
    BlockType("Q5_1", 7, 32, 24, _q5_1, None, _GEMV),
    BlockType("Q8_0", 8, 32, 34, _q8_0, _quantize_q8_0, _GEMV,
              relayouts=(("int8", "int8.from_blocks: the int8 output head without a float32 copy"),)),
    BlockType("Q4_K", 12, 256, 144, _q4_k, None, _GEMV),
    BlockType("Q5_K", 13, 256, 176, _q5_k, None, _GEMV),
    BlockType("Q6_K", 14, 256, 210, _q6_k, None, _GEMV),
    BlockType("int8", INT8, 64, 68, None, None, "int8.gemv", gemm="int8.gemm"))}
GGUF_TYPES = {code: t for code, t in TYPES.items() if t.values is not None and t.group == 1}   # by ggml number
BY_NAME = {t.name: code for code, t in GGUF_TYPES.items()}
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = (BY_NAME[n] for n in
                                                  ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))
Q4_1X16 = 16   # Q4_1 relaid (group_rows): a code past ggml's, so no file's tensor type names it
KIND_CODES = 32   # the codes Numba tables indexed by type hold: ggml's (0..15) and Q4_1X16


@dataclasses.dataclass(frozen=True)
class Format:
    """How a host decode format stores a model's matrices: the block types a layer matrix is kept in as given
    (its file's blocks), the type any other layer matrix is quantized to, and the types the output head is kept
    in (any other: int8)."""
    layers: frozenset
    made: int
    head: frozenset


AS_STORED = "gguf"   # the format that keeps every matrix in its file's own block type (PowerInfer files run in it)
FORMATS = {"int8": Format(frozenset({INT8}), INT8, frozenset({INT8})),
           "q4_1": Format(frozenset({Q4_1, Q4_1X16}), Q4_1, frozenset({INT8})),
           AS_STORED: Format(frozenset({*GGUF_TYPES, Q4_1X16}), Q8_0, frozenset({INT8, *GGUF_TYPES}))}


def block_type(code: int) -> BlockType:
    """The row of code; a ConfigError for a type without one."""
    if code not in TYPES:
        raise ConfigError(f"no block layout for ggml type {code}")
    return TYPES[code]
