"""Write a safetensors file one tensor at a time.

`safetensors.torch.save_file` needs every tensor in memory at once; a 9 GB checkpoint (the `4b` synthetic preset,
the extracted Qwen3 body of the real model) must be written with a few hundred MB of RAM. The format is simple
(8-byte little-endian header length, a JSON header with dtype/shape/byte offsets, then the raw bytes in header
order), so the header is computed up front from shapes and each tensor is produced and written in turn.
Files written here are read back with the `safetensors` library in the tests.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from .outputs import atomic

# safetensors dtype tag -> bytes per element
DTYPE_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    return int(np.prod(list(shape), dtype=np.int64)) * DTYPE_SIZES[dtype]


def write_streaming(
    path: Path,
    specs: list[tuple[str, str, tuple[int, ...]]],
    produce: Callable[[str], bytes | Iterable[bytes]],
    metadata: dict[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write `specs` = [(name, dtype_tag, shape)] to `path`, asking `produce(name)` for each tensor's raw bytes
    (one bytes object, or an iterable of byte chunks so that even one tensor need not sit in memory whole).

    Tensors are written in the given order, through `outputs.atomic` (a temporary file renamed at the end), so an
    interrupted write never leaves a file that looks complete. Returns the data size in bytes.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape in specs:
        n = tensor_nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with atomic(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dtype, shape in specs:
            data = produce(name)
            written = 0
            for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
                f.write(chunk)
                written += len(chunk)
                if progress:
                    progress(len(chunk))
            if written != tensor_nbytes(dtype, shape):
                raise ValueError(f"{name}: produced {written} bytes, expected {tensor_nbytes(dtype, shape)}")
        f.flush()
        os.fsync(f.fileno())
    return offset


def read_header(path: Path) -> dict[str, dict]:
    """The JSON header of a safetensors file (without `__metadata__`); raises ValueError when it is corrupt."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n <= 0 or n > min(size - 8, 100 * 2**20):
            raise ValueError(f"{path}: corrupt safetensors header (declared length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, info in header.items():
        end = info.get("data_offsets", [0, 0])[1] if isinstance(info, dict) else None
        if end is None or end > data_len:
            raise ValueError(f"{path}: tensor {name} lies past the end of the file (truncated download?)")
    return header
