"""The safetensors format, written and read as data (no pickle, every field bounded and checked).

safetensors file
    The format ``safetensors.torch.load_file`` and HF ``from_pretrained`` read
    (https://github.com/huggingface/safetensors): the header's length, the **header** (JSON: each tensor's dtype,
    shape and data offsets, and ``"__metadata__"``), then the **data**, which the tensors tile exactly
    (:func:`read_header`).

rpcompile writes the format itself (:func:`write_tensors`) rather than through the ``safetensors`` package, and
reads it (:func:`read_header`, :func:`read_tensors`) checking every header entry before a byte of data is read.
Each problem is a :class:`ValueError` of one line; the caller names the file and the fix.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterable, Mapping

import torch

from ...core.files import parse_json
from ...core.text import printable

__all__ = ["DTYPES", "MAX_HEADER_BYTES", "Entry", "Header", "write_tensors", "read_header", "read_tensors",
           "read_file", "tensor_bytes"]

MAX_HEADER_BYTES = 100_000_000
"""The longest header read (the ``safetensors`` package's own bound)."""
_MAX_NAME, _MAX_DIMS = 4096, 64
_CHUNK = 1 << 26  # 64 MiB: each write a slice of the tensor's own bytes

DTYPES: dict[str, torch.dtype] = {code: getattr(torch, name) for code, name in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
    ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"), ("U16", "uint16"),
    ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ("C64", "complex64")) if hasattr(torch, name)}
"""The format's dtype codes that this torch has."""
_CODES = {dtype: code for code, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its name, dtype and shape, and its bytes ``[begin, end)`` from the data's start."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A checked header: the tensors in the order of their data, the metadata, where the data starts."""

    entries: tuple[Entry, ...]
    metadata: dict[str, str]
    data_start: int

    def names(self) -> list[str]:
        return [e.name for e in self.entries]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor as the format stores them (row-major, little-endian), without a copy when it is
    contiguous."""
    flat = t.detach().as_subclass(torch.Tensor).cpu().contiguous().reshape(-1)
    if flat.dtype not in _CODES:
        raise ValueError(f"dtype {flat.dtype} has no safetensors code")
    # as raw bytes, whatever the dtype (numpy has no bfloat16)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def _layout(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> tuple[bytes, list[str]]:
    """The padded header for ``tensors`` and the order their data goes in (largest element size first)."""
    # by element size, largest first: each tensor starts at a multiple of its own (what readers that map the file want)
    order = sorted(tensors, key=lambda n: -tensors[n].element_size())
    head: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _CODES:
            raise ValueError(f"{printable(name, limit=80)} is {t.dtype}, which safetensors does not store")
        size = t.numel() * t.element_size()
        head[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    # spaces to a multiple of 8: with the data ordered by element size, every tensor starts aligned
    return raw + b" " * (-len(raw) % 8), order


def write_tensors(f: IO[bytes], tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
                  ) -> None:
    """Write ``tensors`` (names unique) in the safetensors format to the open binary file ``f``.

    rpcompile writes the format itself (:func:`write_tensors`) rather than through the ``safetensors`` package: the
    bytes stream from the tensors into a file that :func:`rpcompile.core.files.write_atomic` opened (exclusive,
    unpredictable, never through a link; the package's ``save_file`` opens a path of its own), hashed on the way for the
    checkpoint's manifest, with no copy of the whole file in memory (``safetensors.torch.save`` returns one).
    """
    if sys.byteorder != "little":
        raise ValueError("safetensors stores little-endian data; this machine is big-endian")
    header, order = _layout(tensors, metadata or {})
    for piece in _pieces(header, order, tensors):
        f.write(piece)


def _pieces(header: bytes, order: list[str], tensors: Mapping[str, torch.Tensor]) -> Iterable[memoryview | bytes]:
    # the header's length: 8 bytes, little-endian, unsigned
    yield struct.pack("<Q", len(header))
    yield header
    for name in order:
        data = tensor_bytes(tensors[name])
        for start in range(0, len(data), _CHUNK):
            yield data[start:start + _CHUNK]


def read_header(f: IO[bytes], size: int) -> Header:
    """The checked header of the open safetensors file ``f`` of ``size`` bytes; ValueError (one line) naming the
    first problem. The layout:

    - 8 bytes: the header's length ``N``, an unsigned little-endian integer;
    - ``N`` bytes: the **header**, a JSON object — for each tensor
      ``name: {"dtype": "F32", "shape": [4, 8], "data_offsets": [begin, end]}``, and ``"__metadata__"``: text keys to
      text values (HF writes ``{"format": "pt"}``) — padded with spaces to a multiple of 8 bytes;
    - the **data**: each tensor's elements, row-major and little-endian, at ``[begin, end)`` from the data's start. The
      tensors tile the data exactly: no gap, no overlap, no byte beyond.

    Reading parses the header as strict bounded JSON (at most :data:`MAX_HEADER_BYTES`, as the ``safetensors`` package
    allows) and checks every entry — a dtype this torch has, a shape of whole numbers whose bytes are its offsets' span,
    the tiling, the file's length — before a byte of data is read. Each problem is a :class:`ValueError` of one line;
    the caller names the file and the fix.
    """
    head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"{size} bytes, shorter than the 8 that give the header's length")
    (n,) = struct.unpack("<Q", head)
    # bounded before a byte of it is read: a corrupt length must not allocate gigabytes
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise ValueError(f"a header of {n:,} bytes in a file of {size:,}" + (" (more than the format allows)"
                                                                             if n > MAX_HEADER_BYTES else
                                                                             ": truncated, or not safetensors"))
    raw = f.read(n)
    if len(raw) < n:
        raise ValueError(f"the header ends after {len(raw):,} of its {n:,} bytes: truncated")
    try:
        # the padding is spaces after the JSON
        obj = parse_json(raw.rstrip(b" "), max_depth=3, what="a safetensors header")
    except ValueError as e:
        raise ValueError(f"the header is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"the header is a JSON {type(obj).__name__}, not an object")
    metadata = obj.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise ValueError("__metadata__ is not an object of text values")
    # the header's JSON lists the tensors in any order: sorted by offset, the tiling is a single walk
    entries = sorted((_entry(name, value) for name, value in obj.items()), key=lambda e: (e.begin, e.end))
    _check_tiling(entries, size - 8 - n)
    return Header(entries=tuple(entries), metadata=metadata, data_start=8 + n)


def _entry(name: str, value: Any) -> Entry:
    shown = printable(name, limit=80)
    if not name or len(name) > _MAX_NAME or not name.isprintable():
        raise ValueError(f"a tensor name {shown!r} is empty, longer than {_MAX_NAME} characters or not printable")
    if not isinstance(value, dict) or not {"dtype", "shape", "data_offsets"} <= value.keys():
        raise ValueError(f"tensor {shown} has no dtype, shape and data_offsets")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if dtype not in DTYPES:
        raise ValueError(f"tensor {shown} has dtype {printable(dtype, limit=20)!r}, which this torch does not "
                         f"read (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(_whole(d) for d in shape):
        raise ValueError(f"tensor {shown} has shape {printable(shape, limit=60)}, not a list of whole numbers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_whole(o) for o in offsets) \
            or offsets[0] > offsets[1]:
        raise ValueError(f"tensor {shown} has data_offsets {printable(offsets, limit=60)}, not [begin, end]")
    # an empty shape is a scalar: one element
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if nbytes != offsets[1] - offsets[0]:
        raise ValueError(f"tensor {shown} is {dtype} {tuple(shape)}: {nbytes:,} bytes, but its data_offsets span "
                         f"{offsets[1] - offsets[0]:,}")
    return Entry(name, DTYPES[dtype], tuple(shape), offsets[0], offsets[1])


def _whole(v: Any) -> bool:
    # type(), not isinstance: a JSON true is not a dimension
    return type(v) is int and v >= 0


def _check_tiling(entries: list[Entry], data: int) -> None:
    """The entries (sorted by offset) cover ``[0, data)`` exactly."""
    at = 0
    for e in entries:
        if e.begin != at:
            what = "a gap" if e.begin > at else "an overlap"
            raise ValueError(f"{what} in the data at byte {at:,} (tensor {printable(e.name, limit=80)} starts at "
                             f"{e.begin:,})")
        at = e.end
    if at != data:
        if at > data:
            raise ValueError(f"its tensors need {at:,} bytes of data but the file holds {data:,}: truncated")
        raise ValueError(f"{data - at:,} bytes after the last tensor's data")


def read_file(path: Path) -> tuple[Header, dict[str, torch.Tensor]]:
    """The checked header and every tensor of the safetensors file ``path`` (opened without following a link);
    ValueError (one line, starting with the file's name)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise ValueError(f"{path.name} cannot be read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        try:
            # the size of the file opened, not of whatever the path names by then
            header = read_header(f, os.fstat(f.fileno()).st_size)
            return header, read_tensors(f, header)
        except ValueError as e:
            raise ValueError(f"{path.name}: {e}") from None


def read_tensors(f: IO[bytes], header: Header, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of ``header`` (those named, else all) read from the open file ``f`` into fresh CPU tensors."""
    wanted = None if names is None else set(names)
    out: dict[str, torch.Tensor] = {}
    for e in header.entries:
        if wanted is not None and e.name not in wanted:
            continue
        # fresh memory, not a mapping of the file: the tensor outlives the file (a checkpoint removed by keep=)
        t = torch.empty(e.shape, dtype=e.dtype)
        if e.end > e.begin:
            f.seek(header.data_start + e.begin)
            view = t.reshape(-1).view(torch.uint8).numpy().data
            got = 0
            # readinto may fill less than asked: read until the tensor is whole
            while got < len(view):
                n = f.readinto(view[got:])  # type: ignore[attr-defined]  # a binary file
                if not n:
                    raise ValueError(f"the data of tensor {printable(e.name, limit=80)} ends early: truncated")
                got += n
        out[e.name] = t
    return out
