"""Models users train eagerly, trained through ``rpcompile.compile`` (issue 17): in-place activations (torchvision's
ResNet, timm's MobileNet), a running statistic updated under ``torch.no_grad()``, a ViT on
``nn.MultiheadAttention``, and inputs that are a batch dict or a pair of tensors. Each equals eager PyTorch: loss,
every gradient, buffers and the weights after an optimizer step, over batches of two sizes.

torchvision and timm are not installed (PyPI's torchvision for this torch is a CUDA build that does not load): the
models below are small hand-written equivalents of theirs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rpcompile.planner.plan_options import PlanOptions
import rpcompile
from rpcompile.core.batch import split_microbatches

from test_runtime import FINE_CPU, TOL, assert_grads_equal


# ------------------------------------------------------------------------------------------------------- models
class BasicBlock(nn.Module):
    """torchvision's ResNet block: conv-bn-relu(inplace), conv-bn, ``out += identity``, relu(inplace)."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    def __init__(self, c: int = 4, classes: int = 5):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(c), BasicBlock(c))
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer1(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


class InvertedResidual(nn.Module):
    """timm's MobileNetV3 block: expand, in-place hard-swish (module and functional), depthwise, project, residual."""

    def __init__(self, c: int):
        super().__init__()
        self.expand, self.bn1 = nn.Conv2d(c, 2 * c, 1, bias=False), nn.BatchNorm2d(2 * c)
        self.act = nn.Hardswish(inplace=True)
        self.dw, self.bn2 = nn.Conv2d(2 * c, 2 * c, 3, padding=1, groups=2 * c, bias=False), nn.BatchNorm2d(2 * c)
        self.project, self.bn3 = nn.Conv2d(2 * c, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn1(self.expand(x)))
        h = F.hardswish(self.bn2(self.dw(h)), inplace=True)
        return x + self.bn3(self.project(h))


class TinyMobileNet(nn.Module):
    def __init__(self, c: int = 4, classes: int = 5):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.act = nn.Hardswish(inplace=True)
        self.blocks = nn.Sequential(InvertedResidual(c), InvertedResidual(c))
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.act(self.bn(self.stem(x))))
        return self.head(x.mean((2, 3)))


class RunningCenter(nn.Module):
    """Centres its input on the batch mean and keeps a running mean of it (not BatchNorm): updated in forward under
    ``torch.no_grad()``, used in evaluation."""

    def __init__(self, d: int):
        super().__init__()
        self.register_buffer("running", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x - self.running
        mean = x.mean(0)
        with torch.no_grad():
            self.running.mul_(0.9).add_(mean, alpha=0.1)
        return x - mean


class RunningShift(RunningCenter):
    """Subtracts the running mean it has just updated: the training output reads the statistic, so a recomputation
    must start from the value this microbatch's forward found."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.running.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x - self.running


class RunningMLP(nn.Module):
    def __init__(self, d: int = 8, classes: int = 5, depth: int = 3, center: type = RunningCenter):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.centers = nn.ModuleList(center(d) for _ in range(depth))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, center in zip(self.layers, self.centers):
            x = torch.tanh(center(layer(x)))
        return self.head(x)


class EncoderBlock(nn.Module):
    """torchvision's ViT encoder block: LayerNorm, ``nn.MultiheadAttention(batch_first=True)``, LayerNorm, MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2, self.mlp = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyViT(nn.Module):
    """torchvision's VisionTransformer in small: conv patches, class token, positions, encoder, head on the token."""

    def __init__(self, d: int = 8, heads: int = 2, patch: int = 4, image: int = 8, depth: int = 2, classes: int = 5):
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d) * 0.02)
        self.blocks = nn.Sequential(*[EncoderBlock(d, heads) for _ in range(depth)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.ln(self.blocks(x))[:, 0])


class DictModel(nn.Module):
    def __init__(self, d: int = 8, classes: int = 5):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, classes)

    def forward(self, batch: dict) -> torch.Tensor:
        h = torch.relu(self.l1(batch["x"])) * batch["mask"]
        return self.l3(torch.relu(self.l2(h)))


class PairModel(nn.Module):
    def __init__(self, d: int = 8, classes: int = 5):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, classes)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = pair
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(a)) + b)))


# ------------------------------------------------------------------------------------------------------ helpers
def _images(n: int, seed: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 3, 8, 8, generator=g),), torch.randint(0, 5, (n,), generator=g)


def _vectors(n: int, seed: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 8, generator=g),), torch.randint(0, 5, (n,), generator=g)


def _batch_dict(n: int, seed: int) -> tuple[tuple[dict], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch = {"x": torch.randn(n, 8, generator=g), "mask": (torch.rand(n, 8, generator=g) > 0.3).float()}
    return (batch,), torch.randint(0, 5, (n,), generator=g)


def _pair(n: int, seed: int) -> tuple[tuple[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)),), torch.randint(0, 5, (n,), generator=g)


def _eager(ref: nn.Module, inputs: tuple, y: torch.Tensor, microbatches: int) -> torch.Tensor:
    """Eager reference: gradient accumulation over the pipeline's microbatches, each weighted by its rows (what a
    model with buffers must equal; for the others it is the whole batch's loss and gradients up to rounding)."""
    loss = torch.zeros(())
    for piece, (ys,) in zip(split_microbatches(inputs, microbatches), split_microbatches((y,), microbatches)):
        part = F.cross_entropy(ref(*piece), ys) * (ys.shape[0] / y.shape[0])
        part.backward()
        loss += part.detach()
    return loss


def _trains_like_eager(model: nn.Module, data, sizes=(6, 4), *, whole_batch: bool, **options) -> rpcompile.Pipeline:
    """Compile ``model`` on two logical CPU devices and train it on batches of ``sizes`` rows next to an eager copy:
    loss, every gradient, every buffer and the weights after an SGD step equal eager's. ``whole_batch``: compare
    with eager on the whole batch (models without buffers), else with accumulation over the same microbatches."""
    torch.manual_seed(0)
    ref = copy.deepcopy(model)
    example, _ = data(sizes[0], 0)
    options.setdefault("spec", FINE_CPU)  # analytic costs: the same plan on every run, several stages
    pipe = rpcompile.compile(model, example, loss_fn=F.cross_entropy, devices=["cpu", "cpu"], microbatches=3,
                             time_limit_s=2.0, **options)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, n in enumerate(sizes):
        inputs, y = data(n, step + 1)
        loss = pipe.forward_backward(*inputs, target=y)
        if whole_batch:
            ref_loss = F.cross_entropy(ref(*inputs), y)
            ref_loss.backward()
        else:
            ref_loss = _eager(ref, inputs, y, min(3, n))
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=lambda m: f"batch {step}: loss: {m}")
        assert_grads_equal(model, ref, what=f"batch {step}: ")
        ref_buffers = dict(ref.named_buffers())
        for name, b in model.named_buffers():
            torch.testing.assert_close(b, ref_buffers[name], **TOL, msg=lambda m: f"batch {step}: buffer {name}: {m}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p, ref_params[name], **TOL, msg=lambda m: f"batch {step}: weight {name}: {m}")
    return pipe


def _has_backward_stage(pipe: rpcompile.Pipeline) -> bool:
    return any(s.kind == "backward" for s in pipe.plan.stages)


# -------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("make", [TinyResNet, TinyMobileNet], ids=["resnet", "mobilenet"])
def test_in_place_activations_train_like_eager(make):
    """``nn.ReLU(inplace=True)``, ``out += identity``, ``nn.Hardswish(inplace=True)`` and ``F.hardswish(x,
    inplace=True)`` run out of place in the graph (a profiled node's input or a stage's input is a leaf that needs
    a gradient, which an in-place op refuses); the model's own modules stay in place."""
    model = make()
    pipe = _trains_like_eager(model, _images, whole_batch=False)
    assert _has_backward_stage(pipe)
    assert all(m.inplace for m in model.modules() if hasattr(m, "inplace"))
    in_place = [n.format_node() for n in pipe.gm.graph.nodes if n.kwargs.get("inplace") is True
                or "iadd" in str(n.target) or getattr(dict(pipe.gm.named_modules()).get(str(n.target)), "inplace", 0)]
    assert not in_place


def test_an_in_place_activation_on_a_view_stays_in_place_and_is_costed():
    """An in-place op the graph cannot make out of place (it writes through an ``nn.Identity`` into its input)
    keeps its semantics; profiling runs it on a copy of its leaf input."""
    from rpcompile.passes.graph.inplace import writes_first_arg
    from rpcompile.passes.graph.trace import trace

    class Through(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 5)
            self.same, self.relu = nn.Identity(), nn.ReLU(inplace=True)

        def forward(self, x):
            h = self.l1(x)
            self.relu(self.same(h))  # writes into h
            return self.l2(h)

    assert any(writes_first_arg(gm, n) for gm in [trace(Through(), (torch.randn(6, 8),))] for n in gm.graph.nodes)
    _trains_like_eager(Through(), _vectors, whole_batch=True)


@pytest.mark.parametrize("center", [RunningCenter, RunningShift], ids=["centred-on-batch", "reads-statistic"])
def test_a_running_statistic_updated_under_no_grad_trains_like_eager(center):
    """A buffer updated in forward under ``torch.no_grad()`` (not BatchNorm): traced by torch.export, which records
    the grad mode (fx cannot, and the update then joined the autograd graph); updated once per microbatch by the real
    forward, as eager gradient accumulation over the same microbatches does; a backward stage recomputes from the
    value the microbatch's forward found."""
    model = RunningMLP(center=center)
    pipe = _trains_like_eager(model, _vectors, whole_batch=False)
    assert pipe.gm.meta["rpcompile.trace"] == "export"
    assert _has_backward_stage(pipe)
    assert all(c.running.abs().sum() > 0 for c in model.centers)  # and equal to eager's (_trains_like_eager)


def test_vit_with_multihead_attention_trains_like_eager_with_saved_segments():
    """torchvision's ViT: saved segments capture ``nn.MultiheadAttention`` and keep its activations (no recompute)."""
    model = TinyViT()
    pipe = _trains_like_eager(model, _images, whole_batch=True)
    assert any(s.saved for s in pipe.plan.stages) and pipe.program.saved
    captured = [seg for seg in pipe.program.saved if seg.captures]
    assert any("attn" in n for seg in captured for n in seg.nodes), [seg.nodes for seg in pipe.program.saved]


def test_a_tuple_handed_between_saved_segments_is_recomputed_like_eager():
    """A segment cut between ``nn.MultiheadAttention`` and the ``[0]`` that reads its ``(output, weights)``: a capture
    takes tensors only (the tuple's tensor was a real tensor inside a fake trace), so those segments are recomputed
    and the others saved; loss and gradients equal eager."""
    from rpcompile.passes.lower import plan_from_ranges
    from rpcompile.passes.rewrite.coarsen import SEGMENT_KEY
    from rpcompile.passes.graph.util import compute_nodes
    from rpcompile.compiler import pipeline
    from rpcompile.training.options import TrainOptions
    from rpcompile.planner.planning import prepare
    from rpcompile.planner.plan_options import make_hardware
    from rpcompile.runtime.devices import make_devices

    torch.manual_seed(0)
    model = TinyViT()
    ref = copy.deepcopy(model)
    (x,), y = _images(6, 1)
    gm, m = prepare(model, (x,), PlanOptions(gpus=2, microbatches=3, progress=False, spec=FINE_CPU))
    nodes = compute_nodes(gm)
    for i, nd in enumerate(nodes):  # one segment per node: a cut after every attention
        nd.meta[SEGMENT_KEY] = i
    n = len(nodes)
    plan = plan_from_ranges(gm, forward=[(0, n // 2), (n // 2, n - 2)], fused=(n - 2, n),
                            backward=[(n // 3, n - 2), (0, n // 3)], hardware=make_hardware(2, "cpu"),
                            microbatches=m, saved=[nd.name for nd in nodes[:n - 2]])
    pipe = pipeline(model, gm, plan, make_devices(["cpu", "cpu"], None), F.cross_entropy,
                    TrainOptions(precision="fp32"))
    seg_nodes = {nd for seg in pipe.program.saved for nd in seg.nodes}
    attn = [nd.name for nd in gm.graph.nodes if nd.op == "call_module" and str(nd.target).endswith("attn")]
    assert attn and not seg_nodes & set(attn) and pipe.program.saved  # the attention is recomputed, others saved
    loss = pipe.forward_backward(x, target=y)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(model, ref)
    assert all(seg.calls["recomputed"] == 0 for seg in pipe.program.saved)


@pytest.mark.parametrize("data,make", [(_batch_dict, DictModel), (_pair, PairModel)], ids=["dict", "pair"])
def test_a_batch_dict_or_a_pair_of_tensors_trains_like_eager(data, make):
    """``forward(self, batch: dict)`` and ``forward(self, pair)``, called as the model is: the tensors inside are
    split into microbatches (they were taken for one constant value: "a batch of 1 cannot be split"), a batch
    with fewer rows than microbatches too."""
    model = make()
    pipe = _trains_like_eager(model, data, sizes=(6, 4, 2), whole_batch=True)
    assert _has_backward_stage(pipe)
    inputs, _ = data(5, 7)
    torch.testing.assert_close(pipe.forward(*inputs), model(*inputs), **TOL)
