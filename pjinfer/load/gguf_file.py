"""A GGUF file's metadata and tensors, read in bulk; the tensors are views of one read-only memory map.

Why not ``gguf.GGUFReader``: it parses every element of a metadata array into its own numpy objects, 2.4 s for
the default model's 49k-token vocabulary and merges. Here numeric arrays are one ``np.frombuffer`` each and a
string array one pass over its bytes (tens of ms). Tensor data is never copied: ``Tensor.data`` is a view of
the file's memory map (uint8 [rows, row bytes] for block-quantized types, the element type otherwise), so the
pages are read when used and shared with the page cache. The format: github.com/ggml-org/ggml docs/gguf.md
(version 2 and 3: little-endian, 64-bit counts). PowerInfer's converters and its GPU-index writer overwrite the
magic with "PWRI" and leave the rest a GGUF; such a file reads the same, with `powerinfer` set.
"""
from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
POWERINFER_MAGIC = b"PWRI"   # SJTU-IPADS/PowerInfer: convert.py, powerinfer-py/powerinfer/export_split.py
# Metadata value types -> numpy dtypes (8 = string, 9 = array are handled apart).
_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
            7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
T_STRING, T_ARRAY = 8, 9
# Tensor types with a plain element type; every other one is read as raw blocks.
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}
# PowerInfer's ggml numbered its integer types 16-18 (its gguf-py: I8 = 16, I16 = 17, I32 = 18; llama.cpp later
# moved them to 24-26 and gave 16-18 to IQ types), so its GPU index stores gpu_idx as type 18: a PWRI file reads so.
_POWERINFER_PLAIN = {16: np.int8, 17: np.int16, 18: np.int32}


class GGUFError(ValueError):
    """The file is not a GGUF model this reader understands (truncated, foreign, unknown types)."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    type: int            # ggml type number (gguf.GGMLQuantizationType)
    shape: tuple         # numpy order: (rows, cols) for a matrix (GGUF stores ne reversed: ne[0] is cols)
    data: np.ndarray     # a view of the memory map: plain types as their dtype, block types as uint8 rows


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        try:
            value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFError("the file ends inside its header") from None
        self.pos += struct.calcsize("<" + fmt)
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("Q")
        raw = bytes(self.buf[self.pos:self.pos + n])
        if len(raw) != n:
            raise GGUFError("the file ends inside its header")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        out, buf, pos = [], self.buf, self.pos
        unpack = struct.Struct("<Q").unpack_from
        try:
            for _ in range(count):
                n = unpack(buf, pos)[0]
                out.append(str(buf[pos + 8:pos + 8 + n], "utf-8", "replace"))
                pos += 8 + n
        except struct.error:
            raise GGUFError("the file ends inside its header") from None
        self.pos = pos
        return out

    def array(self, dtype, count: int) -> np.ndarray:
        dtype = np.dtype(dtype).newbyteorder("<")
        end = self.pos + dtype.itemsize * count
        if end > len(self.buf):
            raise GGUFError("the file ends inside its header")
        a = np.frombuffer(self.buf[self.pos:end], dtype).copy()
        self.pos = end
        return a

    def value(self, kind: int):
        if kind == T_STRING:
            return self.string()
        if kind == T_ARRAY:
            sub, count = self.take("I"), self.take("Q")
            if sub == T_STRING:
                return self.strings(count)
            if sub in _SCALARS:
                return self.array(_SCALARS[sub], count).tolist() if count < 64 else self.array(_SCALARS[sub], count)
            raise GGUFError(f"unsupported metadata array type {sub}")
        if kind in _SCALARS:
            v = self.array(_SCALARS[kind], 1)[0]
            return bool(v) if kind == 7 else v.item()
        raise GGUFError(f"unsupported metadata type {kind}")


class GGUFFile:
    """fields: metadata key -> value (str, int, float, bool, list of str, or numpy array for long numeric
    arrays); tensors: list of Tensor in file order; powerinfer: the file carries PowerInfer's magic."""

    def __init__(self, path: str | Path):
        import gguf  # block sizes of the quantized types

        path = Path(path)
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.mmap = np.frombuffer(self._map, np.uint8)
        cur = _Cursor(memoryview(self.mmap))
        magic = bytes(self.mmap[:4])
        if magic not in (MAGIC, POWERINFER_MAGIC):
            raise GGUFError("no GGUF magic")
        self.powerinfer = magic == POWERINFER_MAGIC
        cur.pos = 4
        version = cur.take("I")
        if version not in (2, 3):
            raise GGUFError(f"unsupported GGUF version {version}")
        n_tensors, n_fields = cur.take("Q"), cur.take("Q")
        self.fields = {}
        for _ in range(n_fields):
            key = cur.string()
            self.fields[key] = cur.value(cur.take("I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            ne = [cur.take("Q") for _ in range(cur.take("I"))]
            infos.append((name, ne, cur.take("I"), cur.take("Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-cur.pos // align) * align
        self.tensors = []
        plain = _PLAIN | (_POWERINFER_PLAIN if self.powerinfer else {})
        for name, ne, kind, offset in infos:
            shape = tuple(int(n) for n in reversed(ne))
            if kind in plain:
                dtype = np.dtype(plain[kind])
                nbytes, view_shape = int(np.prod(shape)) * dtype.itemsize, shape
            else:
                try:
                    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
                except (ValueError, KeyError):
                    raise GGUFError(f"tensor {name} has unknown type {kind}") from None
                if shape[-1] % block:
                    raise GGUFError(f"tensor {name}: {shape[-1]} columns are not whole blocks of {block}")
                row = shape[-1] // block * block_bytes
                dtype, view_shape = np.dtype(np.uint8), (*shape[:-1], row)
                nbytes = int(np.prod(view_shape))
            lo = start + offset
            if lo + nbytes > self.mmap.size:
                raise GGUFError(f"the file ends inside tensor {name}")
            data = self.mmap[lo:lo + nbytes].view(dtype).reshape(view_shape)
            self.tensors.append(Tensor(name, kind, shape, data))

    def release(self, tensor: Tensor) -> None:
        """Drop the pages of a tensor that has been copied (re-laid, converted) from this process's resident
        memory (madvise DONTNEED on the whole pages inside it). Its data stays readable: a later read faults the
        pages in again from the page cache. Pages shared with a neighbouring tensor are kept."""
        lo = tensor.data.ctypes.data - self.mmap.ctypes.data
        start = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (lo + tensor.data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
