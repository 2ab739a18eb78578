"""Argument types of the command line: each parses one option's text or raises ``ArgumentTypeError`` with a
one-line message and examples (argparse prints it as ``rpcompile plan: error: ...; see rpcompile plan --help``)."""

from __future__ import annotations

import argparse
import re

from rpcompile.core.planfile import MAX_MICROBATCHES
from rpcompile.core.specs import SPECS

__all__ = ["SPEC_NAMES", "spec", "device", "positive_int", "microbatch_count",
           "positive_float", "head_chunks", "parse_bytes",
           "parse_rate", "parse_percent", "network_rate", "network_rates", "node_counts"]

SPEC_NAMES = ", ".join(SPECS)

_BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def spec(text: str) -> str:
    if text not in SPECS:
        raise argparse.ArgumentTypeError(f"unknown GPU spec {text!r}; choose one of {SPEC_NAMES}")
    return text


def device(text: str) -> str:
    """A device this machine has: ``cpu``, ``meta``, ``cuda:K`` with K < the CUDA devices here."""
    # Lazy: importing torch takes 2.6-3.3 s on the 2-core reference machine and `rpcompile --help` 0.15-0.2 s
    # (this module is imported to build the parser); only a --device or --model-device value needs torch here.
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (examples: cpu, cuda:0, meta)") from None
    # a bare "cuda" means cuda:0
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s); for a GPU you do not have, use "
            "--spec NAME (analytic costs) instead")
    if dev.type not in ("cpu", "cuda", "meta"):
        raise argparse.ArgumentTypeError(f"{text}: rpcompile runs on cpu, cuda:K or meta")
    return text


def positive_int(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        # not a number: refused below with the same message as a number below 1
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return k


def microbatch_count(text: str) -> int:
    """``--microbatches``: a positive integer, at most :data:`~rpcompile.core.planfile.MAX_MICROBATCHES`."""
    k = positive_int(text)
    if k > MAX_MICROBATCHES:
        raise argparse.ArgumentTypeError(f"at most {MAX_MICROBATCHES} (a plan holds no more), got {k}")
    return k


def positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = 0.0
    # written as "not x > 0" so that NaN is refused too
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return x


def head_chunks(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {text!r}") from None


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 20GiB, 24GB, 1073741824)")
    # KB, MB, ... are powers of 10 and KiB, MiB, ... powers of 2; the unit is matched without regard to case
    return int(float(m.group(1)) * _BYTE_UNITS[(m.group(2) or "B").upper()])


def parse_rate(text: str) -> float:
    # a rate is a size per second: "/s" or "ps" off, then the size parser (GB/s, GBps)
    base = text.strip().removesuffix("/s").removesuffix("ps")
    try:
        return float(parse_bytes(base))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"not a bandwidth: {text!r} (examples: 100GB/s, 50GiB/s)") from None


def parse_percent(text: str) -> float:
    try:
        # "2%" is 0.02; a bare number is taken as the fraction itself
        return float(text.strip().removesuffix("%")) / 100 if text.strip().endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a percentage: {text!r} (examples: 2%, 0.02)") from None


# case matters here (b bits, B bytes): no IGNORECASE
_NETWORK = re.compile(r"\s*([0-9.]+)\s*([kKMGT]?)(bit|b|B)?(?:/s|ps)?\s*")
_PREFIX = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def network_rate(text: str) -> float:
    """A network bandwidth in bytes/s: ``25Gb/s``, ``25Gbit/s`` and ``100Gbps`` are bits (the way links are
    sold), ``3GB/s`` bytes."""
    m = _NETWORK.fullmatch(text)
    # the unit is required: a bare number could be bits or bytes, a factor of 8 apart
    if not m or not m.group(3) or not float(m.group(1) or 0) > 0:
        raise argparse.ArgumentTypeError(f"not a network bandwidth: {text!r} (examples: 25Gb/s, 100Gbit/s, 3GB/s)")
    value = float(m.group(1)) * _PREFIX[m.group(2)]
    return value if m.group(3) == "B" else value / 8


def network_rates(text: str) -> list[float]:
    """One or more network bandwidths, comma-separated (``25Gb/s,100Gb/s``)."""
    return [network_rate(t) for t in text.split(",")]


def node_counts(text: str) -> list[int]:
    """One or more machine counts, comma-separated (``1,2,4,8``)."""
    try:
        return [positive_int(t) for t in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected positive node counts, e.g. 4 or 1,2,4,8, got {text!r}") from None
