"""A matrix held in a block type of ``blocks.py``'s table (``QTensor``), and memory XLA takes without a copy (numpy
only, no Numba).

A ``QTensor`` is a matrix [rows, cols] in torch's [out, in] layout, one row per output, as the arrays its block
type stores (``blocks.BlockType.dequantize`` names them): a GGUF block type's one uint8 array [rows, row bytes]
(a tensor of a GGUF file becomes one with no conversion: its bytes are the file's), or int8's rows and scales.

Its arrays may be numpy arrays (a GGUF memory map, a fresh quantization) or jax arrays: the engine moves
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


@dataclasses.dataclass(frozen=True)
class QTensor:
    """A [rows, cols] matrix in the block type of code (blocks.TYPES): arrays as that type stores them."""
    code: int
    arrays: tuple
    cols: int

    def __post_init__(self):
        t = blocks.block_type(self.code)
        if t.values is not None and tuple(self.data.shape[1:]) != (t.row_bytes(self.cols),):
            raise ConfigError(f"{t.name} data of shape {tuple(self.data.shape)} does not hold rows "
                              f"of {self.cols} weights")

    @classmethod
    def quantize(cls, code: int, w) -> "QTensor":
        """float32 [rows, cols] in the block type of code, one whose row has a quantizer (int8's is Numba:
        int8.quantize)."""
        return cls(code, blocks.TYPES[code].quantize(w), w.shape[1])

    @property
    def type(self) -> blocks.BlockType:
        return blocks.TYPES[self.code]

    @property
    def data(self):
        """The first array: the blocks, or int8's rows."""
        return self.arrays[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), self.cols)

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays))

    def float32(self) -> np.ndarray:
        return self.type.dequantize(tuple(np.asarray(a) for a in self.arrays), self.cols)

    def map(self, f) -> "QTensor":
        """The same matrix with f applied to each array (e.g. moved into XLA's memory)."""
        return QTensor(self.code, tuple(f(a) for a in self.arrays), self.cols)

    def grouped(self) -> "QTensor":
        """A Q4_1 matrix relaid as Q4_1x16 (blocks.group_rows), in a new aligned array."""
        if self.code != blocks.Q4_1:
            raise ConfigError(f"only Q4_1 relays into Q4_1x16, not {self.type.name}")
        data = np.asarray(self.data)
        return QTensor(blocks.Q4_1X16, (blocks.group_rows(data, self.cols, aligned_empty(data.shape, np.uint8)),),
                       self.cols)

    def rows(self, lo: int, hi: int, total: int | None = None) -> "QTensor":
        """Rows [lo, hi): views of these arrays, or with `total` rows a new matrix whose rows past hi - lo are
        zero (all-zero bytes are zero weights in every block type)."""
        part = tuple(np.asarray(a)[lo:hi] for a in self.arrays)
        if total is not None and total != hi - lo:
            part = tuple(_zero_padded(a, (total, a.shape[1])) for a in part)
        return QTensor(self.code, part, self.cols)

    def columns(self, lo: int, hi: int, total: int | None = None) -> "QTensor":
        """Columns [lo, hi) (on block boundaries) as a new matrix of `total` columns (default hi - lo), those past
        hi - lo zero (all of them: this matrix). Every array holds a row's blocks side by side, so each is cut at the
        same blocks."""
        block, nb = self.type.block, self.cols // self.type.block
        total = hi - lo if total is None else total
        if (lo, hi, total) == (0, self.cols, self.cols):
            return self
        if lo % block or hi % block or total % block:
            raise ConfigError(f"{self.type.name} columns split at multiples of {block}, not [{lo}, {hi}) of {total}")
        part = []
        for a in self.arrays:
            a = np.asarray(a)
            width = a.shape[1] // nb   # an array's entries per block
            cut = a[:, lo // block * width:hi // block * width]
            part.append(_zero_padded(cut, (a.shape[0], total // block * width)))
        return QTensor(self.code, tuple(part), total)


def is_quantized(w) -> bool:
    return isinstance(w, QTensor)


def _zero_padded(a: np.ndarray, shape: tuple) -> np.ndarray:
    """a copied into the leading corner of a new aligned array of `shape`, zero elsewhere."""
    out = aligned_zeros(shape, a.dtype)
    out[:a.shape[0], :a.shape[1]] = a
    return out
