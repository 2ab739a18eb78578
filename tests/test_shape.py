"""shape_pass: dtype, shape and new bytes of every node; views allocate nothing; meta works; no side effects."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from rpcompile.passes.graph.shape import SHAPE_KEY, ShapeInfo, TensorInfo, shape_pass


class Views(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        h = self.bn(self.lin(x))           # 4x6 fp32 -> 96 bytes
        t = h.transpose(0, 1)              # view
        a, b = torch.chunk(h, 2, dim=1)    # chunk returns views
        c = (a + b).to(torch.float16)      # 4x3 fp16 -> 24 bytes
        return t.reshape(-1), c, torch.cat([a, b], dim=1)


def infos(gm):
    return {n.name: n.meta[SHAPE_KEY] for n in gm.graph.nodes}


def test_shapes_dtypes_and_bytes():
    gm = fx.symbolic_trace(Views())
    shape_pass(gm, (torch.randn(4, 6),))
    m = infos(gm)
    assert m["lin"] == ShapeInfo((TensorInfo((4, 6), "float32", 96, False),))
    assert m["transpose"].tensors[0].shape == (6, 4) and m["transpose"].nbytes == 0
    assert m["chunk"].nbytes == 0 and [t.shape for t in m["chunk"].tensors] == [(4, 3), (4, 3)]
    assert m["getitem"].nbytes == 0
    assert m["to"] == ShapeInfo((TensorInfo((4, 3), "float16", 24, False),))
    assert m["cat"].nbytes == 96
    assert m["reshape"].nbytes == 96  # reshape of a transposed (non-contiguous) view must copy
    assert m["output"].nbytes == 0 and m["x"].nbytes == 0


def test_reshape_that_copies_counts_bytes():
    class M(nn.Module):
        def forward(self, x):
            return x.transpose(0, 1).reshape(-1) + 0

    gm = fx.symbolic_trace(M())
    shape_pass(gm, (torch.randn(3, 5),))
    m = infos(gm)
    assert m["reshape"].nbytes == 60  # non-contiguous: reshape had to copy
    assert m["transpose"].nbytes == 0


def test_meta_device_and_no_side_effects():
    model = Views()
    gm = fx.symbolic_trace(model)
    before = model.bn.running_mean.clone(), int(model.bn.num_batches_tracked)
    shape_pass(gm, (torch.randn(4, 6),))
    assert torch.equal(model.bn.running_mean, before[0]) and int(model.bn.num_batches_tracked) == before[1]
    with torch.device("meta"):
        meta = Views()
    gm = fx.symbolic_trace(meta)
    shape_pass(gm, (torch.empty(4, 6, device="meta"),))
    assert infos(gm)["lin"].nbytes == 96
