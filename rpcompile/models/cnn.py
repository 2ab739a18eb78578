"""A small convolutional image classifier, traceable by ``torch.fx.symbolic_trace``.

Terms:

- *conv block*: ``Conv2d(3x3, padding 1) -> BatchNorm2d -> ReLU -> MaxPool2d(2)`` (the pool is optional); each
  block halves the image side when pooling.
- *head*: ``Dropout -> Linear`` over the flattened feature map of the last block.

BatchNorm makes this model's forward depend on ``train()``/``eval()`` mode and, in training mode, update its running
statistics (buffers): a useful contrast to the transformers, whose state is parameters only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rpcompile.core.errors import ConfigError

__all__ = ["CNNConfig", "ConvNet", "ConvBlock"]


@dataclass(frozen=True, kw_only=True)
class CNNConfig:
    """Shape of a :class:`ConvNet`."""

    in_channels: int = 3
    """Channels of the input images."""
    image_size: int = 16
    """Side of the (square) input images in pixels."""
    channels: tuple[int, ...] = (16, 32, 64)
    """Output channels of each conv block; one block per entry."""
    pool: bool = True
    """End each block with a 2x2 max-pool (halves the side)."""
    num_classes: int = 10
    """Number of output classes."""
    dropout: float = 0.1
    """Dropout probability before the head."""

    def __post_init__(self) -> None:
        if not self.channels:
            raise ConfigError("channels must name at least one conv block, e.g. channels=(32, 64)")
        if self.pool and self.image_size % 2 ** len(self.channels):
            raise ConfigError(f"image_size={self.image_size} must be divisible by 2**{len(self.channels)} when pooling; "
                              "change image_size or the number of blocks, or set pool=False")

    @property
    def feature_size(self) -> int:
        """Side of the last block's feature map."""
        return self.image_size // 2 ** len(self.channels) if self.pool else self.image_size


class ConvBlock(nn.Module):
    """``conv -> bn -> relu (-> pool)``."""

    def __init__(self, in_channels: int, out_channels: int, *, pool: bool) -> None:
        super().__init__()
        # no bias: the batch norm right after subtracts the mean, which would cancel it
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.pool(self.relu(self.bn(self.conv(x))))


class ConvNet(nn.Module):
    """Classifier ``images [B, C, H, W]`` (float) -> ``logits [B, num_classes]``."""

    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        self.config = cfg
        widths = (cfg.in_channels, *cfg.channels)
        self.blocks = nn.ModuleList(
            ConvBlock(c_in, c_out, pool=cfg.pool) for c_in, c_out in zip(widths[:-1], widths[1:])
        )
        self.dropout = nn.Dropout(cfg.dropout)
        self.head = nn.Linear(cfg.channels[-1] * cfg.feature_size**2, cfg.num_classes)

    def forward(self, images: Tensor) -> Tensor:
        x = images
        for block in self.blocks:
            x = block(x)
        return self.head(self.dropout(torch.flatten(x, 1)))
