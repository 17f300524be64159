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
import math
import mmap
import struct
from pathlib import Path

import gguf  # block sizes of the quantized types
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
MAX_DIMS = 4               # ggml's GGML_MAX_DIMS
MAX_NAME = 63              # a tensor name's bytes at most (ggml's GGML_MAX_NAME less its terminating zero)
MAX_KEY = (1 << 16) - 1    # a metadata key's bytes at most (the format's limit)
DEFAULT_ALIGNMENT = 32
# The fewest bytes one metadata field (key length, type, a one-byte value) and one tensor description (name
# length, dimension count, type, offset) take: a count is refused when the rest of the file cannot hold that many.
_MIN_FIELD = 8 + 4 + 1
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8


class GGUFError(ValueError):
    """The file is not a GGUF model this reader understands (truncated, foreign, unknown types)."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    type: int            # ggml type number (gguf.GGMLQuantizationType)
    shape: tuple         # numpy order: (rows, cols) for a matrix (GGUF stores ne reversed: ne[0] is cols)
    data: np.ndarray     # a view of the memory map: plain types as their dtype, block types as uint8 rows


class _Cursor:
    """Reads the header front to back. Every count and length read from the file is checked against the bytes
    left before anything of that size is made, so a hostile header costs at most the file's own size."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, fmt: str):
        try:
            value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFError(f"the file ends inside its header (at byte {self.pos})") from None
        self.pos += struct.calcsize("<" + fmt)
        return value[0] if len(value) == 1 else value

    def count(self, what: str, min_bytes: int) -> int:
        """A uint64 count of items of at least min_bytes each, refused when the rest of the file cannot hold them."""
        at, n = self.pos, self.take("Q")
        if n * min_bytes > self.left:
            raise GGUFError(f"{what} at byte {at} claims {n} items, more than the {self.left} bytes left hold")
        return n

    def string(self) -> str:
        at, n = self.pos, self.take("Q")
        if n > self.left:
            raise GGUFError(f"a string at byte {at} claims {n} bytes, more than the {self.left} bytes left")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        # The caller's count() has checked count * 8 <= left; each length is checked before its slice.
        out, buf, pos, end = [], self.buf, self.pos, len(self.buf)
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFError(f"the file ends inside its header (at byte {pos})")
            n = unpack(buf, pos)[0]
            if n > end - pos - 8:
                raise GGUFError(f"a string at byte {pos} claims {n} bytes, more than the {end - pos - 8} bytes left")
            out.append(str(buf[pos + 8:pos + 8 + n], "utf-8", "replace"))
            pos += 8 + n
        self.pos = pos
        return out

    def array(self, dtype, count: int) -> np.ndarray:
        dtype = np.dtype(dtype).newbyteorder("<")
        end = self.pos + dtype.itemsize * count
        if end > len(self.buf):
            raise GGUFError(f"the file ends inside its header (an array of {count} {dtype.name} at byte {self.pos})")
        a = np.frombuffer(self.buf[self.pos:end], dtype).copy()
        self.pos = end
        return a

    def value(self, kind: int):
        if kind == T_STRING:
            return self.string()
        if kind == T_ARRAY:
            sub = self.take("I")
            if sub == T_STRING:
                return self.strings(self.count("a string array", 8))
            if sub in _SCALARS:
                count = self.count("an array", np.dtype(_SCALARS[sub]).itemsize)
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
        path = Path(path)
        if path.stat().st_size == 0:
            raise GGUFError("the file is empty")
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
        n_tensors = cur.count("the tensor count", _MIN_TENSOR_INFO)
        n_fields = cur.count("the metadata count", _MIN_FIELD)
        self.fields = _read_fields(cur, n_fields)
        infos = _read_tensor_infos(cur, n_tensors)
        align = _alignment(self.fields)
        start = -(-cur.pos // align) * align
        plain = _PLAIN | (_POWERINFER_PLAIN if self.powerinfer else {})
        self.tensors = [self._tensor(name, ne, kind, offset, start, align, plain)
                        for name, ne, kind, offset in infos]
        _check_no_overlap(self.tensors, self.mmap)

    def _tensor(self, name: str, ne: list, kind: int, offset: int, start: int, align: int, plain: dict) -> Tensor:
        """The tensor's view of the map, once its offset, type and size are checked against the file."""
        if offset % align:
            raise GGUFError(f"tensor {name} starts at offset {offset}, not a multiple of the alignment {align}")
        shape = tuple(int(n) for n in reversed(ne))
        if kind in plain:
            dtype, view_shape = np.dtype(plain[kind]), shape
        else:
            try:
                block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise GGUFError(f"tensor {name} has unknown type {kind}") from None
            if shape[-1] % block:
                raise GGUFError(f"tensor {name}: {shape[-1]} columns are not whole blocks of {block}")
            dtype, view_shape = np.dtype(np.uint8), (*shape[:-1], shape[-1] // block * block_bytes)
        nbytes = math.prod(view_shape) * dtype.itemsize   # Python ints: a product of huge dims cannot wrap
        lo = start + offset
        if lo + nbytes > self.mmap.size:
            raise GGUFError(f"tensor {name} {list(shape)} needs bytes {lo} to {lo + nbytes}; the file ends at "
                            f"{self.mmap.size}")
        return Tensor(name, kind, shape, self.mmap[lo:lo + nbytes].view(dtype).reshape(view_shape))

    def release(self, tensor: Tensor) -> None:
        """Drop the pages of a tensor that has been copied (re-laid, converted) from this process's resident
        memory (madvise DONTNEED on the whole pages inside it). Its data stays readable: a later read faults the
        pages in again from the page cache. Pages shared with a neighbouring tensor are kept."""
        lo = tensor.data.ctypes.data - self.mmap.ctypes.data
        start = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (lo + tensor.data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


def _read_fields(cur: _Cursor, n_fields: int) -> dict:
    fields = {}
    for _ in range(n_fields):
        key = cur.string()
        if len(key) > MAX_KEY or not key.isprintable():
            raise GGUFError(f"a metadata key of {len(key)} characters is not {MAX_KEY} printable ones at most: "
                            f"{key[:40]!r}")
        if key in fields:
            raise GGUFError(f"metadata key {key[:80]!r} appears twice")
        fields[key] = cur.value(cur.take("I"))
    return fields


def _read_tensor_infos(cur: _Cursor, n_tensors: int) -> list:
    """[(name, ne, type, offset)] as the header lists them: names unique and printable (messages quote them),
    1 to MAX_DIMS dimensions."""
    infos, names = [], set()
    for _ in range(n_tensors):
        name = cur.string()
        if len(name.encode()) > MAX_NAME or not name.isprintable():
            raise GGUFError(f"a tensor name is not {MAX_NAME} bytes of printable text at most: {name[:40]!r}")
        if name in names:
            raise GGUFError(f"tensor {name} appears twice")
        names.add(name)
        n_dims = cur.take("I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS})")
        ne = [cur.take("Q") for _ in range(n_dims)]
        infos.append((name, ne, cur.take("I"), cur.take("Q")))
    return infos


def _alignment(fields: dict) -> int:
    """general.alignment (default 32): an integer power of two, as the format requires."""
    align = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise GGUFError(f"general.alignment is {align!r}: it must be a power of two")
    return align


def _check_no_overlap(tensors: list, base: np.ndarray) -> None:
    """No two tensors share a byte of the file (each was checked to lie inside it)."""
    spans = sorted((t.data.ctypes.data - base.ctypes.data, t.data.nbytes, t.name) for t in tensors)
    for (lo, n, name), (next_lo, _, next_name) in zip(spans, spans[1:]):
        if lo + n > next_lo:
            raise GGUFError(f"tensors {name} and {next_name} overlap in the file")
