"""``AnalyticCostModel``: predict a node's forward and backward time on a named GPU without running it.

Terms:

- **op class** (:func:`op_class`): ``matmul``, ``conv``, ``attention``, ``norm``, ``elementwise``, ``reduction``,
  ``embedding``, ``memory`` — or None: a **free op** (a view such as ``view``/``t``/``expand``/``detach``, or an
  allocation such as ``empty``), which launches no kernel and costs 0.
- **roofline** (:func:`roofline_time`, Williams et al., CACM 2009): an op's time is the longer of its FLOPs at the
  class's achieved compute rate and its bytes at the achieved memory bandwidth, plus a kernel overhead.
- **node time**: the sum of its aten ops' roofline times, forward then backward, found by running the node on the
  ``meta`` device under a dispatch mode that sees every op (:class:`AnalyticCostModel` gives the steps).

The analysis runs under :class:`~rpcompile.passes.graph.kernels.GpuKernels`, which rewrites attention and RMSNorm
(another path on ``meta`` than on a GPU) to the fused kernels a GPU runs; device moves are no-ops. Identical nodes
(same target and configuration, input shapes/dtypes/strides, non-tensor arguments, gradient requirements) are
analysed once: the 32 blocks of a transformer cost one block's analysis.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, cast

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from rpcompile.core.specs import DeviceSpec, get_spec
from .cost_model import CostModel, NodeCall, OpEstimate

from ..graph.kernels import GpuKernels
from ..graph.meta import op_dtype
from ..graph.meta import is_assert
from ..graph.meta import packet_name as _packet_name
from ..graph.meta import run_unifying_dtypes as _run_unifying_dtypes
from ..graph.meta import stay_on_meta as _stay_on_meta

__all__ = [
    "AnalyticCostModel", "OpRecord", "CacheInfo", "OP_FLOPS_PER_ELEMENT", "TENSOR_CORE_DTYPES", "op_class",
    "roofline_time",
]

aten = torch.ops.aten

#: FLOPs charged per element (:class:`AnalyticCostModel`, step 3). Ops not listed: 1 for elementwise and reductions,
#: 0 for memory and embedding.
OP_FLOPS_PER_ELEMENT: Mapping[str, int] = MappingProxyType(
    {
        # elementwise, per output element
        "sigmoid": 4, "silu": 5, "gelu": 5, "softplus": 3, "mish": 5, "native_dropout": 2,
        "sigmoid_backward": 3, "tanh_backward": 3, "silu_backward": 9, "gelu_backward": 11,
        "native_dropout_backward": 2,
        # reductions, per input element
        "_softmax": 5, "_safe_softmax": 5, "_log_softmax": 5,
        "_softmax_backward_data": 4, "_log_softmax_backward_data": 4,
        "var": 3, "std": 3, "var_mean": 3, "std_mean": 3,
        # norms, per element of the normalised input: forward = mean, variance, normalise, affine
        "native_layer_norm": 8, "native_layer_norm_backward": 13,
        "native_batch_norm": 8, "native_batch_norm_backward": 13,
        "_native_batch_norm_legit": 8, "_native_batch_norm_legit_no_training": 4,
        "_native_batch_norm_legit_functional": 8, "batch_norm_backward": 13,
        "native_group_norm": 8, "native_group_norm_backward": 13,
        "rms_norm": 4, "rms_norm_backward": 9, "_fused_rms_norm": 4, "_fused_rms_norm_backward": 9,
        # embedding: the forward is a pure gather; the backward a scatter-add of the output gradient
        "embedding": 0, "embedding_dense_backward": 1,
    }
)

#: dtypes whose matmul/conv/attention run at ``DeviceSpec.tensor_flops``.
TENSOR_CORE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2})

_TENSOR_CORE_CLASSES = ("matmul", "conv", "attention")


def _names(cls: str, names: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), cls)


# Explicit classes; the rest follow torch's op tags (see op_class). Every untagged op is "memory" anyway:
# the memory entries are those torch tags otherwise (clone is "pointwise") or that read like compute.
_CLASS_OF_NAME: dict[str, str] = {
    **_names("matmul", "mm bmm addmm baddbmm addbmm addmv mv dot vdot matmul linear _scaled_mm _int_mm addr"),
    **_names("conv", "convolution _convolution convolution_backward cudnn_convolution convolution_overrideable "
                     "_slow_conv2d_forward _slow_conv2d_backward mkldnn_convolution _conv_depthwise2d"),
    **_names("attention", " ".join(f"_scaled_dot_product_{k}_attention{s}" for s in ("", "_backward")
                                   for k in ("flash", "efficient", "cudnn"))),
    **_names("attention", "_flash_attention_forward _flash_attention_backward _efficient_attention_forward "
                          "_efficient_attention_backward _scaled_dot_product_flash_attention_for_cpu "
                          "_scaled_dot_product_flash_attention_for_cpu_backward"),
    **_names("norm", " ".join(k for k in OP_FLOPS_PER_ELEMENT if "norm" in k)),
    **_names("norm", "cudnn_batch_norm cudnn_batch_norm_backward _batch_norm_with_update _batch_norm_no_update"),
    **_names("embedding", "embedding embedding_dense_backward embedding_backward _embedding_bag "
                          "_embedding_bag_backward"),
    **_names("reduction", "_softmax _safe_softmax _log_softmax _softmax_backward_data _log_softmax_backward_data "
                          "logsumexp cumsum cumprod topk sort"),
    **_names("elementwise", "native_dropout tril triu bernoulli"),
    **_names("memory", "clone _to_copy copy_ cat stack index index_select gather scatter scatter_add index_put "
                       "index_add constant_pad_nd nll_loss_forward nll_loss_backward"),
}
_FREE_NAMES = frozenset("empty empty_like empty_strided new_empty new_empty_strided resize_ set_ _unsafe_view view "
                        "reshape size stride dim numel is_contiguous lift_fresh".split())
_GATHERS = frozenset("embedding index_select gather index _unsafe_index".split())
_WRITE_ONLY = frozenset("fill fill_ zero zero_ zeros ones full zeros_like ones_like full_like new_zeros new_ones "
                        "new_full scalar_tensor arange bernoulli_ uniform_ normal_ random_".split())


# Kernels torch's registry misses (the CPU flash attention) take the formula of their CUDA twins.
_EXTRA_FLOP_FORMULAS = {
    getattr(aten, f"_scaled_dot_product_flash_attention_for_cpu{s}"):
        flop_registry[getattr(aten, f"_scaled_dot_product_flash_attention{s}")] for s in ("", "_backward")
}


def op_class(op: torch._ops.OpOverload | torch._ops.OpOverloadPacket) -> str | None:
    """The op class of an aten op (one of :data:`rpcompile.core.specs.OP_CLASSES`), or None for a free op.

    Order: the explicit tables above, then views and metadata ops (free), then torch's own op tags
    (``pointwise`` → elementwise, ``reduction`` → reduction); anything else is ``memory``.
    """
    name = _packet_name(op)
    if name in _CLASS_OF_NAME:
        return _CLASS_OF_NAME[name]
    # a packet carries no tags: its first overload speaks for it
    overload = op if isinstance(op, torch._ops.OpOverload) else getattr(op, op.overloads()[0])
    # views, export's runtime asserts, symbolic-size queries and prim metadata ops launch no kernel
    if (name in _FREE_NAMES or overload.is_view or torch.Tag.inplace_view in overload.tags
            or name.startswith(("_assert", "sym_")) or overload.namespace == "prim"):
        return None
    if torch.Tag.pointwise in overload.tags:
        return "elementwise"
    if torch.Tag.reduction in overload.tags:
        return "reduction"
    return "memory"


@dataclass(frozen=True)
class OpRecord:
    """One aten op of a node as the analytic model sees it."""

    name: str
    """The aten overload, e.g. ``aten.addmm.default``."""
    op_class: str | None
    """See :func:`op_class`; None for free ops (views, allocations)."""
    phase: str
    """``"fwd"`` or ``"bwd"``."""
    flops: int
    bytes: int
    time_s: float


class CacheInfo(NamedTuple):
    """Analysis cache statistics: signatures found (hits), analysed (misses), stored (size)."""

    hits: int
    misses: int
    size: int


# ------------------------------------------------------------------------------------------- per-op counts
def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes of memory ``t`` covers: broadcast (stride-0) dimensions count once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        # a broadcast dimension spans one element (none when its size is 0)
        n *= size if stride != 0 else min(size, 1)
    return n * t.element_size()


def _bytes(name: str, args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes an op moves (:class:`AnalyticCostModel`, step 4). A gather reads only the rows it writes, not its whole
    source (an embedding lookup does not stream the table); ``copy_`` does not read its destination."""
    written = sum(_span_bytes(t) for t in _tensors(out))
    if name in _WRITE_ONLY:
        return written
    # the first argument is the destination (copy_) or the gathered-from source: neither is streamed whole
    skip_first = name == "copy_" or name in _GATHERS
    inputs = _tensors((args[1:], kwargs) if skip_first else (args, kwargs))
    # deduplicated by identity: `x * x` reads x once
    read = sum(_span_bytes(t) for t in {id(t): t for t in inputs}.values())
    # a gather reads as many bytes of its source as it writes: counted in place of the whole source
    return written + read + (written if name in _GATHERS else 0)


def _flops(func: torch._ops.OpOverload, cls: str | None, args: tuple, kwargs: dict, out: Any) -> int:
    formula = flop_registry.get(func._overloadpacket) or _EXTRA_FLOP_FORMULAS.get(func._overloadpacket)
    if formula is not None:
        # torch's formulas take the output as `out_val` (FlopCounterMode's calling convention)
        return int(formula(*args, **kwargs, out_val=out))
    name = _packet_name(func)
    if cls is None or (cls in ("memory", "embedding") and name not in OP_FLOPS_PER_ELEMENT):
        return 0
    if cls == "matmul":  # mv, dot, addmv (outside torch's registry): 2 per element of the matrix
        return 2 * max((t.numel() for t in _tensors(args)), default=0)
    per = OP_FLOPS_PER_ELEMENT.get(name, 1)
    # the per-element table counts elementwise ops per output element, reductions and norms per input element
    side = out if cls == "elementwise" else (args, kwargs)
    return per * max((t.numel() for t in _tensors(side)), default=0)


def _work_fraction(func: torch._ops.OpOverload, cls: str | None, args: tuple, kwargs: dict) -> float:
    """Share of the dense FLOPs a kernel really does: the unmasked part of a causal (top-left) attention."""
    if cls != "attention":
        return 1.0
    # positional arguments named by the schema, so is_causal is found however it was passed
    named = {**{a.name: v for a, v in zip(func._schema.arguments, args)}, **kwargs}
    if not named.get("is_causal", False) or "query" not in named:
        return 1.0
    s_q, s_k = named["query"].shape[-2], named["key"].shape[-2]
    # top-left causal mask: query row i sees keys 0..i; with more queries than keys, the rows past s_k see all s_k keys
    kept = s_q * (s_q + 1) // 2 if s_q <= s_k else s_k * (s_k + 1) // 2 + (s_q - s_k) * s_k
    return kept / (s_q * s_k)


def roofline_time(spec: DeviceSpec, cls: str | None, flops: float, nbytes: int, dtype: torch.dtype) -> float:
    """Roofline time of one kernel of class ``cls`` (:class:`AnalyticCostModel`, step 5); 0 for free ops."""
    if cls is None:
        return 0.0
    eff = spec.efficiency
    tensor_core = cls in _TENSOR_CORE_CLASSES
    # an fp32 matmul gets no tensor cores: torch leaves TF32 off for matmuls by default
    peak = spec.tensor_flops if tensor_core and dtype in TENSOR_CORE_DTYPES else spec.fp32_flops
    bandwidth = spec.memory_bandwidth * (eff["memory"] if tensor_core else eff[cls])
    return max(flops / (peak * eff[cls]), nbytes / bandwidth) + spec.kernel_overhead_s


class _Recorder(TorchDispatchMode):
    """Turns every aten op dispatched under it into an :class:`OpRecord` appended to ``sink``."""

    def __init__(self, spec: DeviceSpec, phase: str, sink: list[OpRecord]):
        super().__init__()
        self.spec, self.phase, self.sink = spec, phase, sink

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if is_assert(func):  # export's checks: casting to ``dtype`` would trip them
            self.sink.append(OpRecord(str(func), None, self.phase, 0, 0, 0.0))
            return None
        # a pure device move is a no-op on the one device that runs the stage: recorded as a free op
        kwargs, pure_move = _stay_on_meta(func, args, kwargs or {})
        out = _run_unifying_dtypes(func, args, kwargs)
        self.sink.append(self._record(func, None if pure_move else op_class(func), args, kwargs, out))
        return out

    def _record(self, func: Any, cls: str | None, args: tuple, kwargs: dict, out: Any) -> OpRecord:
        if cls is None:
            return OpRecord(str(func), None, self.phase, 0, 0, 0.0)
        flops = _flops(func, cls, args, kwargs, out)
        nbytes = _bytes(_packet_name(func), args, kwargs, out)
        work = flops * _work_fraction(func, cls, args, kwargs)
        time_s = roofline_time(self.spec, cls, work, nbytes, op_dtype(args, kwargs))
        return OpRecord(str(func), cls, self.phase, flops, nbytes, time_s)


# ----------------------------------------------------------------------------------------------- the cache
def _freeze(value: Any, trainable: set[int], seen: dict[int, int]) -> Any:
    """A hashable stand-in for a call argument: tensors by shape/stride/dtype/grad and by which earlier
    argument they repeat (``x * x`` reads one tensor, ``x * y`` two); containers element-wise."""
    if isinstance(value, torch.Tensor):
        # the position of the tensor's first appearance: a repeated tensor gets the same number wherever it recurs
        first = seen.setdefault(id(value), len(seen))
        # whether it needs a gradient changes what the backward computes
        return ("T", first, tuple(value.shape), value.stride(), value.dtype, id(value) in trainable)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v, trainable, seen) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _freeze(v, trainable, seen)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", value.start, value.stop, value.step)
    try:
        return (type(value).__qualname__, value, hash(value))  # the type: ``1 == 1.0 == True`` as dict keys
    except TypeError:
        return (type(value).__qualname__, repr(value))


def _module_config(mod: torch.nn.Module) -> tuple:
    """Type and public plain attributes (``in_features``, ``eps``, ``training``…) of every submodule."""
    plain = (int, float, str, bool, type(None), tuple, list, dict, torch.dtype)
    return tuple((name, type(sub), tuple(sorted((k, _freeze(v, set(), {})) for k, v in vars(sub).items()
                                                if not k.startswith("_") and isinstance(v, plain))))
                 for name, sub in mod.named_modules())


def _signature(call: NodeCall) -> tuple:
    """Everything the analysis of ``call`` depends on (the module docstring's identical nodes)."""
    node = call.node
    if node.op == "call_module":
        target: Any = ("module", _module_config(cast(torch.nn.Module, call.fn)))  # a module call's fn is the module
    elif node.op == "call_method":
        target = ("method", node.target)
    else:
        target = _freeze(node.target, set(), {})
    # one numbering over arguments and state: a tensor passed both ways is recognised as one
    seen: dict[int, int] = {}
    state = {**call.params, **call.buffers}
    return (
        target,
        _freeze((call.args, call.kwargs), call.trainable, seen),
        # sorted: the key must not depend on the order parameters were registered in
        tuple((k, _freeze(v, call.trainable, seen)) for k, v in sorted(state.items())),
    )


# ---------------------------------------------------------------------------------------------- the model
class AnalyticCostModel(CostModel):
    """Roofline cost model for the GPU described by ``spec`` (a :class:`~rpcompile.core.specs.DeviceSpec` or a
    preset name such as ``"rtx4090"``). How one node is costed:

    1. The node runs on the ``meta`` device (shapes only), forward then backward, under a ``TorchDispatchMode``
       that sees every **aten op** it dispatches, with its input and output tensors.
    2. Each op gets an **op class** (:func:`op_class`) — ``matmul``, ``conv``, ``attention``, ``norm``,
       ``elementwise``, ``reduction``, ``embedding``, ``memory`` — or None: a **free op** (a view such as
       ``view``/``t``/``expand``/``detach``, or an allocation such as ``empty``) launches no kernel and costs 0.
    3. **FLOPs**: matmul, conv and attention use torch's formulas (``torch.utils.flop_counter``'s registry, so
       they equal ``FlopCounterMode``; an ``addmm`` counts only its matmul, the bias add rides in the epilogue).
       Other classes charge :data:`OP_FLOPS_PER_ELEMENT` per element of the largest output (elementwise) or
       input (norms, reductions), counting one FLOP per arithmetic operation *and* per special-function call
       (exp, erf, tanh, rsqrt: one SFU instruction each): ``silu`` = sigmoid (neg, exp, add, reciprocal) + mul
       = 5, softmax (max, subtract, exp, sum, divide) = 5. Memory ops and the embedding gather do 0 FLOPs.
    4. **Bytes** = every distinct tensor input + every output, by the memory each spans (a broadcast, stride-0
       dimension is read once). Fills and ``*_like`` factories only write; ``copy_`` does not read its
       destination; a gather (embedding, ``index_select``…) reads the rows it writes, not its whole source.
    5. **Roofline** per op (Williams et al., CACM 2009)::

           time = max(flops / (peak · eff[class]), bytes / (memory_bandwidth · eff_mem)) + kernel_overhead_s

       ``peak`` is ``tensor_flops`` for matmul/conv/attention in fp16/bf16/fp8, else ``fp32_flops`` (torch
       leaves TF32 off for matmuls; pointwise kernels compute in fp32 even on bf16 data). ``eff_mem`` is
       ``eff["memory"]`` for those three classes (memory-bound GEMMs stream like copies) and ``eff[class]`` for
       the others, whose factor *is* their achieved share of bandwidth. A causal attention kernel skips masked
       blocks: its compute term uses the unmasked fraction (≈ half) of the FLOPs it reports (torch's dense count).
    6. Node time = Σ of its ops' times; node FLOPs = Σ over all classes.

    ``dtype`` casts floating inputs before analysis, e.g. ``torch.bfloat16`` to plan a mixed-precision run
    from an fp32 model. Works on models built on the ``meta`` device.
    """

    share_repeats = True
    """Repeated blocks (:mod:`.repeats`) take their representative's costs: a roofline of the same shapes is the
    same number, and the cost pass then runs one block's meta autograd profiles instead of every block's
    (llama-8b: 6.3–8.6 s → 2.4–3.3 s for trace, shape, cost and coarsen; every node's cost identical)."""

    def __init__(self, spec: DeviceSpec | str, *, dtype: torch.dtype | None = None):
        self.spec = get_spec(spec)
        self.dtype = dtype
        self.name = f"analytic:{self.spec.name}"
        self._cache: dict[tuple, tuple[tuple[OpRecord, ...], tuple[OpRecord, ...]]] = {}
        self._hits = self._misses = 0

    def __repr__(self) -> str:
        return f"AnalyticCostModel(spec={self.spec.name!r}, dtype={self.dtype})"

    def estimate(self, call: NodeCall) -> OpEstimate:
        """Forward/backward time and FLOPs of one call: sums over its :meth:`breakdown`."""
        fwd, bwd = self._analyse(call)
        return OpEstimate(fwd_time_s=sum((r.time_s for r in fwd), 0.0), bwd_time_s=sum((r.time_s for r in bwd), 0.0),
                          fwd_flops=sum(r.flops for r in fwd), bwd_flops=sum(r.flops for r in bwd))

    def breakdown(self, call: NodeCall) -> list[OpRecord]:
        """Every aten op of the call, forward then backward, free ops included (class None, time 0)."""
        fwd, bwd = self._analyse(call)
        return [*fwd, *bwd]

    def cache_info(self) -> CacheInfo:
        """How often a node's signature was already analysed (hits) or not (misses)."""
        return CacheInfo(self._hits, self._misses, len(self._cache))

    def _analyse(self, call: NodeCall) -> tuple[tuple[OpRecord, ...], tuple[OpRecord, ...]]:
        key = _signature(call)
        cached = self._cache.get(key)
        if cached is not None:
            self._hits += 1
            return cached
        self._misses += 1
        self._cache[key] = result = self._trace(call)
        return result

    def _trace(self, call: NodeCall) -> tuple[tuple[OpRecord, ...], tuple[OpRecord, ...]]:
        """Run the call on meta, forward then backward, recording every aten op."""
        m = call.materialize("meta", dtype=self.dtype)
        fwd: list[OpRecord] = []
        bwd: list[OpRecord] = []
        run = m.run

        def recorded_run() -> Any:
            with GpuKernels(), _Recorder(self.spec, "fwd", fwd):
                return run()

        # only the node's own forward ops are recorded, not forward_backward's ones_like output gradients
        m.run = recorded_run
        _, backward = m.forward_backward()
        if backward is not None:
            try:
                with _Recorder(self.spec, "bwd", bwd):
                    backward()
            except Exception:  # noqa: BLE001 - a backward that reads values (a custom op's .tolist()) cannot run
                # on meta: count each forward op twice, as a matmul's backward is two matmuls of its size
                bwd = [dataclasses.replace(r, phase="bwd") for r in fwd for _ in range(2)]
        if call.inplace and fwd and fwd[0].name == "aten.clone.default":
            fwd.pop(0)  # materialize() clones an in-place op's input under autograd; a real run does not
        return tuple(fwd), tuple(bwd)
