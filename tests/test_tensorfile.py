"""The safetensors format as rpcompile writes and reads it (rpcompile/training/checkpoint/tensorfile.py): what it
writes, the ``safetensors`` package reads, and the other way round, for every dtype both know (non-contiguous,
empty and scalar tensors too); a header that lies — about its length, its JSON, a dtype, a shape, the offsets, the
data's length — is refused with one ``ValueError`` line before a byte of data is read; random damage never raises
anything else."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rpcompile.training.checkpoint.tensorfile import DTYPES, read_header, read_tensors, write_tensors

safetensors_torch = pytest.importorskip("safetensors.torch")


def tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    out = {f"t.{code}": (torch.randn(3, 5) * 50).to(dtype) for code, dtype in DTYPES.items()
           if dtype.is_floating_point or dtype.is_complex}
    out.update({f"t.{code}": torch.randint(0, 100, (4, 2)).to(dtype) for code, dtype in DTYPES.items()
                if not (dtype.is_floating_point or dtype.is_complex)})
    out["strided"] = torch.randn(6, 4).t()
    out["empty"] = torch.zeros(0, 7)
    out["scalar"] = torch.tensor(2.5)
    return out


def written(t: dict[str, torch.Tensor], metadata=None) -> bytes:
    f = io.BytesIO()
    write_tensors(f, t, metadata)
    return f.getvalue()


def read(raw: bytes) -> dict[str, torch.Tensor]:
    f = io.BytesIO(raw)
    return read_tensors(f, read_header(f, len(raw)))


def test_what_rpcompile_writes_safetensors_reads_and_the_other_way_round():
    t = tensors()
    raw = written(t, {"format": "pt"})
    theirs = safetensors_torch.load(raw)
    ours = read(safetensors_torch.save({k: v.contiguous() for k, v in t.items()}, {"format": "pt"}))
    for name, want in t.items():
        for got in (theirs[name], ours[name], read(raw)[name]):
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got.view(-1).view(torch.uint8)
                                                                                         if got.numel() else got,
                                                                                         want.reshape(-1).view(torch.uint8)
                                                                                         if want.numel() else want), name
    header = read_header(io.BytesIO(raw), len(raw))
    assert header.metadata == {"format": "pt"} and header.data_start % 8 == 0
    assert all(e.begin % e.dtype.itemsize == 0 for e in header.entries), "each tensor aligned to its element size"


def _with_header(head: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(head).encode()
    return struct.pack("<Q", len(raw)) + raw + data


LIES = {
    "shorter than 8 bytes": (b"\x01\x02", r"^2 bytes, shorter than the 8 that give the header's length$"),
    "header beyond the file": (struct.pack("<Q", 1000) + b"{}", r"^a header of 1,000 bytes in a file of 10: truncated"),
    "header beyond the bound": (struct.pack("<Q", 2**40) + b"{}", r"more than the format allows"),
    "not JSON": (struct.pack("<Q", 3) + b"{x}", r"^the header is not valid JSON \(invalid JSON at line 1"),
    "NaN": (_with_header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, float("nan")]}}),
            r"^the header is not valid JSON \(NaN is not a number a safetensors header holds\)$"),
    "a list": (_with_header([1]), r"^the header is a JSON list, not an object$"),
    "metadata not text": (_with_header({"__metadata__": {"a": 1}}), r"^__metadata__ is not an object of text values$"),
    "unknown dtype": (_with_header({"a": {"dtype": "F4", "shape": [1], "data_offsets": [0, 1]}}, b"x"),
                      r"^tensor a has dtype 'F4', which this torch does not read \(known: F64, "),
    "negative dimension": (_with_header({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"x"),
                           r"^tensor a has shape \[-1\], not a list of whole numbers$"),
    "shape against offsets": (_with_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"xxxx"),
                              r"^tensor a is F32 \(2,\): 8 bytes, but its data_offsets span 4$"),
    "offsets backwards": (_with_header({"a": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}}),
                          r"^tensor a has data_offsets \[4, 0\], not \[begin, end\]$"),
    "overlap": (_with_header({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                              "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"xyz"),
                r"^an overlap in the data at byte 2 \(tensor b starts at 1\)$"),
    "gap": (_with_header({"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}, b"xy"),
            r"^a gap in the data at byte 0 \(tensor a starts at 1\)$"),
    "truncated data": (_with_header({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"xy"),
                       r"^its tensors need 4 bytes of data but the file holds 2: truncated$"),
    "bytes after": (_with_header({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"xy"),
                    r"^1 bytes after the last tensor's data$"),
    "a name with a line break": (_with_header({"a\nb": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}),
                                 r"^a tensor name 'a\\\\nb' is empty, longer than 4096 characters or not printable$"),
    "no offsets": (_with_header({"a": {"dtype": "U8", "shape": [0]}}), r"^tensor a has no dtype, shape and data_offsets$"),
}


@pytest.mark.parametrize("raw,message", LIES.values(), ids=LIES.keys())
def test_a_header_that_lies_is_refused_in_one_line(raw, message):
    with pytest.raises(ValueError, match=message) as info:
        read_header(io.BytesIO(raw), len(raw))
    assert "\n" not in str(info.value)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_random_damage_is_a_value_error_or_reads(data):
    """Cut, flipped or overwritten anywhere, a file reads (tensors of the header's shapes) or raises ValueError."""
    raw = bytearray(written({"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int16)}))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    raw = raw[:data.draw(st.integers(0, len(raw)))]
    try:
        out = read(bytes(raw))
    except ValueError as e:
        assert "\n" not in str(e)
        return
    assert all(isinstance(t, torch.Tensor) for t in out.values())
