"""llama.cpp's block formats (GGUF tensor types) that the host decode reads as stored, and their float32 values.

Every type here stores a matrix row as consecutive blocks of ``block`` weights; ``KINDS`` gives each one's ggml
type number, block size and block bytes. The layouts (bytes in block order; f16 little-endian):

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

``dequantize(kind, data, cols, xp)`` computes the float32 values with the same float32 operations, in the same
order, as the gguf package's numpy dequantizer (``gguf.quants.dequantize``, the reference the tests hold it to),
written once for numpy and jax.numpy: ``xp`` is either module. Used for ``qtensor.QBlocks.float32`` (numpy) and
inside jit by ``pjinfer.runtime.model.QMatrix`` (jnp), so the XLA path and the host kernels (``quants.py``) compute one
model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .contract import ConfigError

# ggml type number -> (name, weights per block, bytes per block)
KINDS = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
         12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
BY_NAME = {name: kind for kind, (name, _, _) in KINDS.items()}
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = (BY_NAME[n] for n in
                                                  ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))


def name(kind: int) -> str:
    return KINDS[kind][0]


def row_bytes(kind: int, cols: int) -> int:
    """Bytes of a row of cols weights (cols a multiple of the block size)."""
    _, block, nbytes = KINDS[kind]
    if cols % block:
        raise ConfigError(f"{name(kind)} rows need a multiple of {block} elements, got {cols}")
    return cols // block * nbytes


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


def _small(kind, b, f16, xp):
    """Blocks of 32: [..., bytes] int32 -> float32 [..., 32]."""
    if kind == Q8_0:
        return _f16_at(b, 0, f16) * _signed(b[..., 2:34]).astype(xp.float32)
    if kind in (Q4_0, Q4_1):
        q = _nibbles(b[..., 4 if kind == Q4_1 else 2:], xp)
        if kind == Q4_0:
            return _f16_at(b, 0, f16) * (q - 8).astype(xp.float32)
        return q.astype(xp.float32) * _f16_at(b, 0, f16) + _f16_at(b, 2, f16)
    off = 4 if kind == Q5_1 else 2
    q = _nibbles(b[..., off + 4:], xp) | (_bits(b, off, xp) << 4)
    if kind == Q5_0:
        return _f16_at(b, 0, f16) * (q - 16).astype(xp.float32)
    return q.astype(xp.float32) * _f16_at(b, 0, f16) + _f16_at(b, 2, f16)


def _k(kind, b, f16, xp):
    """Blocks of 256: [..., bytes] int32 -> float32 [..., 256]."""
    lead = b.shape[:-1]
    if kind == Q6_K:
        d = _f16_at(b, 208, f16)
        scale = (d * _signed(b[..., 192:208]).astype(xp.float32))[..., None]          # [..., 16, 1]
        ql = b[..., 0:128].reshape(*lead, 2, 1, 64) >> xp.asarray([0, 4], b.dtype).reshape(2, 1)
        ql = (ql & 15).reshape(*lead, 2, 4, 32)                                        # i = 0..3 per half
        qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> xp.asarray([0, 2, 4, 6], b.dtype).reshape(4, 1)
        q = (ql | ((qh & 3) << 4)) - 32
        return (scale * q.reshape(*lead, 16, 16).astype(xp.float32)).reshape(*lead, 256)
    d, dmin = _f16_at(b, 0, f16), _f16_at(b, 2, f16)
    sc, mn = _k_scales(b[..., 4:16], xp)
    ds = (d * sc.astype(xp.float32))[..., None]                                        # [..., 8, 1]
    dm = (dmin * mn.astype(xp.float32))[..., None]
    qs = b[..., 16:144] if kind == Q4_K else b[..., 48:176]
    q = (qs.reshape(*lead, 4, 1, 32) >> xp.asarray([0, 4], b.dtype).reshape(2, 1)) & 15
    q = q.reshape(*lead, 8, 32)
    if kind == Q5_K:
        qh = (b[..., 16:48].reshape(*lead, 1, 32) >> xp.arange(8, dtype=b.dtype).reshape(8, 1)) & 1
        q = q | (qh << 4)
    return (ds * q.astype(xp.float32) - dm).reshape(*lead, 256)


def dequantize(kind: int, data, cols: int, xp=np):
    """uint8 [rows, row_bytes(kind, cols)] blocks -> float32 [rows, cols]; xp: numpy or jax.numpy."""
    if kind not in KINDS:
        raise ConfigError(f"no dequantizer for ggml type {kind}")
    _, block, nbytes = KINDS[kind]
    rows = data.shape[0]
    b = xp.asarray(data).reshape(rows, cols // block, nbytes).astype(xp.int32)
    f16 = _np_f16 if xp is np else _jnp_f16
    out = _k(kind, b, f16, xp) if block == 256 else _small(kind, b, f16, xp)
    return out.reshape(rows, cols).astype(xp.float32)
