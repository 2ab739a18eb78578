"""Tiny models shared by the foundation tests (not collected: no test_ prefix)."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F


class TiedToy(nn.Module):
    """Embedding → Linear → ReLU → Linear → scale → tied output projection (reads embed.weight again)."""

    def __init__(self, vocab: int = 16, dim: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.l1 = nn.Linear(dim, dim)
        self.l2 = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = self.l1(h).relu()
        h = self.l2(h) * self.scale
        return F.linear(h, self.embed.weight)


def toy_graph(seed: int = 0) -> tuple[fx.GraphModule, torch.Tensor]:
    torch.manual_seed(seed)
    model = TiedToy()
    return fx.symbolic_trace(model), torch.randint(0, 16, (2, 5))
