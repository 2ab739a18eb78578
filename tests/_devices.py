"""Logical test devices that make the CPU behave like a foreign device (not collected: no test_ prefix).

Each stands for a way a GPU differs from the CPU that the CPU devices never exercise:

- :class:`MetaDevice` computes on ``meta``: the worker's default device is then not the CPU (as under
  ``torch.device("cuda:0")``), so an allocation that forgets ``device=``, a host value handed to a stage without
  being uploaded (a target) or a device the trace baked into the graph fails here as it does on a GPU. Values are
  shapes only: downloads come back as zeros.
- :class:`CopyingDevice` computes on the CPU but is not a logical CPU device: like a GPU, its downloads are
  copies, and a pipeline on one of them keeps its hand-offs on the device as it does on one GPU (the hand-offs
  still sent home are counted in :attr:`CopyingDevice.handed_off`).
- :class:`StridedDevice` computes on the CPU but every upload and download returns a copy laid out in reverse
  dimension order (column-major), as a GPU kernel or a hand-off may lay a tensor out otherwise than the CPU's
  kernels did at trace time. Values are exact, so the pipeline must still equal eager.
"""

from __future__ import annotations

import torch

from rpcompile.runtime.devices import CpuDevice, Device


class MetaDevice(Device):
    """A device whose computation runs on ``meta`` (see module docstring)."""

    def __init__(self, index: int = 0):
        super().__init__(torch.device("meta"), index)

    def upload(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return t.to(device="meta", dtype=cast)

    def download(self, t: torch.Tensor) -> torch.Tensor:
        assert t.device.type == "meta", f"download of a {t.device} tensor from the meta device"
        return torch.zeros(t.shape, dtype=t.dtype, device="cpu")


def scrambled(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with the same values, laid out in reverse dimension order."""
    if t.dim() < 2:
        return t.clone()
    rev = list(range(t.dim()))[::-1]
    return t.permute(rev).contiguous().permute(rev)


class StridedDevice(CpuDevice):
    """A logical CPU device whose copies change the memory layout (see module docstring)."""

    def __init__(self, index: int = 0):
        super().__init__(torch.device("cpu"), index)

    def upload(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return scrambled(super().upload(t, dtype))

    def download(self, t: torch.Tensor) -> torch.Tensor:
        return scrambled(t)


class CopyingDevice(Device):
    """A device on the CPU that is not a logical CPU device (see module docstring)."""

    def __init__(self, index: int = 0):
        super().__init__(torch.device("cpu"), index)
        self.handed_off = 0

    def download(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def handoff(self, t: torch.Tensor) -> torch.Tensor:
        self.handed_off += 1
        return super().handoff(t)
