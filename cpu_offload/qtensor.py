"""Matrices held in a quantized block form, and the float32 values they stand for (numpy only, no Numba).

Two forms, both for a matrix [rows, cols] in torch's [out, in] layout, one row per output:

- ``Q4Tensor``: the GGUF's own Q4_1 blocks, uint8 [rows, cols / 32 * 20] (``q4.py`` describes a block). A Q4_1
  tensor of a GGUF file becomes one with no conversion: its bytes are the file's.
- ``QBlocks``: any other llama.cpp block type of ``blocks.py`` (Q8_0, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), uint8
  [rows, blocks.row_bytes(kind, cols)], the file's bytes; ``kind`` is the ggml type number.
- ``Int8Tensor``: int8 [rows, cols] with a float32 scale per block of 64 inputs, [rows, cols / 64]
  (``kernels.quantize_rows``' form; the host decode's output head, and every matrix with ``--weights int8``).

Their arrays may be numpy arrays (a GGUF memory map, a fresh quantization) or jax arrays: the engine moves
each into XLA's memory once, and the host decode reads the same bytes through zero-copy numpy views
(``np.asarray`` of a CPU jax array does not copy). XLA's CPU client takes a numpy array without a copy only when
its data starts on a 64-byte boundary (``XLA_ALIGNMENT``), which malloc does not give a large array: arrays made to
be held make their memory with ``aligned_empty``, and ``aligned`` copies one that is not aligned (a tensor of a GGUF
whose data is aligned to 32) before XLA would copy it behind the caller's back. ``float32()`` materializes the
values, one matrix at a time.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .contract import ConfigError

from . import blocks

Q4_BLOCK = 32        # weights per Q4_1 block
Q4_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of nibbles
INT8_BLOCK = 64      # weights per int8 scale
XLA_ALIGNMENT = 64   # bytes: jax.device_put aliases a CPU numpy array whose data starts on such a boundary


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an XLA_ALIGNMENT boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + XLA_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % XLA_ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def aligned_zeros(shape, dtype) -> np.ndarray:
    """aligned_empty, zeroed. The host kernels' scratch: their 64-byte vector loads from rows that start off a
    cache line boundary cost a second line each (the batched Q4_1 GEMM took 1.3-1.5x as long)."""
    out = aligned_empty(shape, dtype)
    out[...] = 0
    return out


def is_aligned(a: np.ndarray) -> bool:
    """Whether XLA takes a without a copy (an empty array has no data to copy)."""
    return a.flags.c_contiguous and (a.size == 0 or a.ctypes.data % XLA_ALIGNMENT == 0)


def aligned(a) -> np.ndarray:
    """a itself where it is a C-contiguous numpy array on an XLA_ALIGNMENT boundary, else an aligned copy."""
    a = np.asarray(a)
    if is_aligned(a):
        return a
    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


def q4_row_bytes(cols: int) -> int:
    return cols // Q4_BLOCK * Q4_BLOCK_BYTES


def dequantize_q4_1(blocks, cols: int) -> np.ndarray:
    """uint8 [rows, cols / 32 * 20] Q4_1 blocks -> float32 [rows, cols] (element = d * q + m)."""
    blocks = np.asarray(blocks)
    rows = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(rows, cols // Q4_BLOCK, Q4_BLOCK_BYTES)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16).astype(np.float32)
    m = np.ascontiguousarray(b[..., 2:4]).view(np.float16).astype(np.float32)
    q = np.concatenate([b[..., 4:] & 15, b[..., 4:] >> 4], -1).astype(np.float32)
    return (q * d + m).reshape(rows, cols)


def dequantize_int8(q, scales) -> np.ndarray:
    """int8 [rows, cols] and float32 [rows, ceil(cols / 64)] scales -> float32 [rows, cols]."""
    q, scales = np.asarray(q), np.asarray(scales)
    return (q.astype(np.float32) * np.repeat(scales, INT8_BLOCK, axis=1)[:, :q.shape[1]]).astype(np.float32)


class _RowBlocks:
    """What a matrix held as a file's row blocks (data uint8 [rows, row bytes], cols weights a row) knows."""

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), self.cols)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclasses.dataclass(frozen=True)
class Q4Tensor(_RowBlocks):
    """A [rows, cols] matrix as Q4_1 blocks: data uint8 [rows, cols / 32 * 20]."""
    data: object
    cols: int

    def float32(self) -> np.ndarray:
        return dequantize_q4_1(self.data, self.cols)

    def map(self, f) -> "Q4Tensor":
        """The same matrix with f applied to its array (e.g. moved into XLA's memory)."""
        return Q4Tensor(f(self.data), self.cols)


@dataclasses.dataclass(frozen=True)
class Int8Tensor:
    """A [rows, cols] matrix as int8 with a float32 scale per 64 inputs: q int8 [rows, cols], scales [rows, cols / 64]."""
    q: object
    scales: object

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(int(n) for n in self.q.shape)

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scales.nbytes)

    def float32(self) -> np.ndarray:
        return dequantize_int8(self.q, self.scales)

    def map(self, f) -> "Int8Tensor":
        return Int8Tensor(f(self.q), f(self.scales))


@dataclasses.dataclass(frozen=True)
class QBlocks(_RowBlocks):
    """A [rows, cols] matrix as llama.cpp blocks of ggml type kind (blocks.KINDS): data uint8 [rows, row bytes]."""
    data: object
    cols: int
    kind: int

    def __post_init__(self):
        if self.kind not in blocks.KINDS:
            raise ConfigError(f"no block layout for ggml type {self.kind}")
        if tuple(self.data.shape[1:]) != (blocks.row_bytes(self.kind, self.cols),):
            raise ConfigError(f"{blocks.name(self.kind)} data of shape {tuple(self.data.shape)} does not hold rows "
                              f"of {self.cols} weights")

    def float32(self) -> np.ndarray:
        return blocks.dequantize(self.kind, np.asarray(self.data), self.cols)

    def map(self, f) -> "QBlocks":
        return QBlocks(f(self.data), self.cols, self.kind)


QUANTIZED = (Q4Tensor, Int8Tensor, QBlocks)


def is_quantized(w) -> bool:
    return isinstance(w, QUANTIZED)
