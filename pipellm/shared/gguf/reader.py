"""GGUF files: the header (metadata and tensor table) and dequantized tensors.

The layout (GGUF v2/v3, little-endian): magic `GGUF`, version u32, tensor count u64, metadata
count u64; then the metadata (key string, value type u32, value); then per tensor its name,
n_dims u32, dims u64[n_dims] (innermost first), ggml type u32 and data offset u64; then, at
the next multiple of `general.alignment` (32 by default), the tensor data.

The header is parsed here with `struct` rather than `gguf.GGUFReader`, which builds a numpy view
per string and takes ~9 s on SmolLM2's 49k-token vocabulary (every service reads the header at
start-up). The `gguf` package supplies the type tables and the dequantization.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# The tensor types we dequantize at load; what gguf.quants can read and our tests write.
SUPPORTED_TYPES = frozenset(GGMLQuantizationType[n] for n in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


class GGUFError(ValueError):
    """A GGUF file cannot be read or served; the message names the file and what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): a [out, in] matrix is (out, in)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """The metadata and tensor table of one GGUF file; tensors are read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise GGUFError(f"cannot read GGUF file {self.path}: {exc}") from None
        try:
            self.metadata, self.tensors = _Parser(self._buf).parse()
        except (struct.error, UnicodeDecodeError, ValueError, MemoryError) as exc:
            raise GGUFError(f"{self.path} is not a valid GGUF file (truncated or corrupt header: "
                            f"{exc})") from None
        end = max((t.offset + t.nbytes for t in self.tensors.values()), default=0)
        if end > len(self._buf):
            raise GGUFError(f"{self.path} is truncated: its tensors need {end} bytes, the file "
                            f"has {len(self._buf)}")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key '{key}' is missing")
        return self.metadata[key]

    def check_types(self) -> None:
        """Raise GGUFError naming the first tensor whose type we cannot dequantize."""
        for t in self.tensors.values():
            if t.qtype not in SUPPORTED_TYPES:
                names = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
                raise GGUFError(f"{self.path}: tensor '{t.name}' is {t.qtype.name}, which pipellm "
                                f"cannot dequantize (supported: {names})")

    def blocks(self, name: str) -> np.ndarray:
        """The stored bytes of tensor `name`, uint8 [*shape[:-1], bytes per row] (a view of the
        file): a quantized tensor's blocks as they are."""
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: tensor '{name}' is missing")
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return raw.reshape(*info.shape[:-1], -1)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor `name` dequantized to float32, in numpy order (`TensorInfo.shape`)."""
        rows = self.blocks(name)  # dequantize works on whole rows of blocks
        info = self.tensors[name]
        if info.qtype not in SUPPORTED_TYPES:
            self.check_types()
        out = np.asarray(dequantize(rows, info.qtype), dtype=np.float32).reshape(info.shape)
        return out if out.flags.writeable else out.copy()  # F32 is a view of the mmap


@lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file, shared within a process (tokenizer, template and config read the same
    header); a file changed on disk is parsed again."""
    st = Path(path).stat()
    return _open_cached(str(path), st.st_mtime_ns, st.st_size)


def is_gguf(path: str | Path) -> bool:
    """True when `path` is a file named *.gguf or starting with the GGUF magic (so that a
    broken .gguf file is reported as one)."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    with open(p, "rb") as f:
        return f.read(4) == MAGIC


class _Parser:
    """Reads the header from a buffer; raises struct.error / ValueError on a bad one."""

    def __init__(self, buf):
        self.buf = buf
        self.pos = 0

    def parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        if bytes(self.buf[:4]) != MAGIC:
            raise ValueError("no GGUF magic at the start")
        self.pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (supported: 2, 3)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        metadata = {}
        for _ in range(n_kv):
            key = self._string()
            metadata[key] = self._value(GGUFValueType(self._scalar("<I")))
        raw = [self._tensor_header() for _ in range(n_tensors)]
        align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        start = -(-self.pos // align) * align
        tensors = {}
        for name, shape, qtype, offset in raw:
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            if shape[-1] % block:
                raise ValueError(f"tensor '{name}': row of {shape[-1]} is not whole "
                                 f"{qtype.name} blocks")
            nbytes = int(np.prod(shape)) // block * block_bytes
            tensors[name] = TensorInfo(name, shape, qtype, start + offset, nbytes)
        return metadata, tensors

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        s = self.buf[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return s

    def _value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            item, n = GGUFValueType(self._scalar("<I")), self._scalar("<Q")
            if item in _SCALARS:  # one numpy read for numeric arrays (token types, scores)
                dt = np.dtype(_SCALARS[item])
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
                self.pos += n * dt.itemsize
                return arr.tolist()
            return [self._value(item) for _ in range(n)]
        value = self._scalar(_SCALARS[vtype])
        # float32 metadata as the decimal it was written from (1e-5, not 9.99999974e-06)
        return float(str(np.float32(value))) if vtype == GGUFValueType.FLOAT32 else value

    def _tensor_header(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        n_dims = self._scalar("<I")
        dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self.pos)
        self.pos += 8 * n_dims
        try:
            qtype = GGMLQuantizationType(self._scalar("<I"))
        except ValueError as exc:
            raise ValueError(f"tensor '{name}' has an unknown ggml type ({exc})") from None
        return name, tuple(reversed(dims)), qtype, self._scalar("<Q")
