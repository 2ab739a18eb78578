"""What a pipeline was compiled for, and the one-line refusal of anything else — before any stage runs.

A stage that receives an input it was not traced for fails deep inside generated code or, worse, broadcasts to a
silently wrong loss. :class:`InputSignature` records the compile example (positional inputs, keywords, specialised
constants, each tensor's dtype, shape and device) and :meth:`InputSignature.bind` checks each call against it.

dynamic dimension
    One a real batch may change: dim 0 of every tensor, dim 1 of integer tensors of two or more dimensions — the
    ones the export path traces symbolically (:func:`rpcompile.passes.graph.export_inputs.dynamic_shapes`) — and,
    in floating inputs, a dimension as long as the example's sequence (a 4-D mask, ``inputs_embeds``). It may be
    shorter than the example's, never longer (the memory plan holds up to it).
static dimension
    Every other one: it must equal the example's.

:func:`~rpcompile.training.signature.check_compile_arguments` does the same for ``rpcompile.compile``'s own
arguments, and :func:`check_call_mode` for the modes a call is made under (autocast, inference mode).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

from ..core.batch import tensor_leaves
from ..core.errors import ConfigError, InputError
from ..core.planfile import MAX_MICROBATCHES

__all__ = ["InputSignature", "LeafSpec", "PrecisionWarning", "check_call_mode", "check_compile_arguments",
           "needs_target"]


class PrecisionWarning(UserWarning):
    """The model's trainable parameters are in a 16-bit dtype: they are the masters the optimizer updates, in that
    dtype (:func:`~rpcompile.training.signature.check_compile_arguments`)."""

_IDS = {torch.int32, torch.int64}
_ARRAYS = (list, tuple)


def _is_sequence(v: Any) -> bool:
    # integer tensors of two or more dimensions: token ids, masks and labels, (batch, sequence, ...)
    return isinstance(v, torch.Tensor) and v.dim() >= 2 and not v.is_floating_point()


@dataclass(frozen=True)
class LeafSpec:
    """One tensor of the compile example: what a call's tensor in its place must match."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str
    dynamic: frozenset[int]
    """Dimensions a call may change (module docstring); dim 1 of a floating input: up to the sequence length."""

    @classmethod
    def of(cls, t: torch.Tensor, max_seq: int | None) -> "LeafSpec":
        dynamic = {0} if t.dim() else set()
        if _is_sequence(t):
            dynamic.add(1)
        if max_seq is not None and t.is_floating_point():
            dynamic |= {d for d in range(1, t.dim()) if t.shape[d] == max_seq}
        return cls(t.dtype, tuple(t.shape), t.device.type, frozenset(dynamic))

    def shape_text(self) -> str:
        dims = ["batch" if d == 0 and d in self.dynamic else f"seq≤{n}" if d in self.dynamic else str(n)
                for d, n in enumerate(self.shape)]
        return f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"


def _dtype_ok(expected: torch.dtype, actual: torch.dtype, compute: torch.dtype | None) -> bool:
    """As eager PyTorch would run it: a float64 batch for a float32 model fails in eager, so it is refused (with the
    cast to make), not cast silently. ``int32`` and ``int64`` ids are interchangeable (embeddings take either), and
    a floating input may come in the pipeline's compute precision (``bf16``)."""
    if actual == expected or (expected in _IDS and actual in _IDS):
        return True
    return expected.is_floating_point and actual == compute


def _cast(dtype: torch.dtype) -> str:
    return {torch.float32: ".float()", torch.int64: ".long()", torch.bfloat16: ".bfloat16()",
            torch.float16: ".half()", torch.bool: ".bool()"}.get(dtype, f".to({dtype})")


class InputSignature:
    """The inputs a pipeline was compiled for (module docstring). :meth:`bind` checks a call against it."""

    def __init__(self, model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any], *,
                 devices: Sequence[str] = (), compute_dtype: torch.dtype | None = None, target: Any = None):
        self.n_args = len(args)
        self.names = list(kwargs)
        # non-tensor keywords were traced as constants: a call must give the same value, or leave it out
        self.constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        # the longest sequence planned for: dim 1 of the integer inputs (token ids, masks) of the example
        self.max_seq = max((v.shape[1] for v in tensor_leaves((args, kwargs)) if _is_sequence(v)), default=None)
        try:
            self.params = list(inspect.signature(model.forward).parameters)
        # a forward whose signature Python cannot read (a builtin, a C extension): positional inputs go unnamed
        except (TypeError, ValueError):
            self.params = []
        # CPU inputs are always taken: the host splits the batch and sends each microbatch where its stage runs
        self.devices = {"cpu", *devices}
        self.compute_dtype = compute_dtype
        slots = {**{self._slot(i): a for i, a in enumerate(args)}, **kwargs}
        self.leaves = {slot: {pytree.keystr(p): LeafSpec.of(t, self.max_seq)
                              for p, t in pytree.tree_flatten_with_path(v)[0] if isinstance(t, torch.Tensor)}
                       for slot, v in slots.items()}
        self.devices |= {s.device for leaves in self.leaves.values() for s in leaves.values()}
        self.target = LeafSpec.of(target, self.max_seq) if isinstance(target, torch.Tensor) else None
        """The example target's spec (``compile(example_target=)``), if one was given."""
        self.target_follows_seq = self.target is not None and _is_sequence(target) and target.shape[1] == self.max_seq
        """The example target is one label per token: a call's target must be as long as its inputs."""

    def _slot(self, i: int) -> str:
        """Positional input ``i`` by its parameter's name (``input_ids``), else ``input i``."""
        name = self.params[i] if i < len(self.params) else ""
        return name if name and not name.startswith("*") else f"input {i}"

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` in the compiled form: keywords naming a positional parameter move into place and
        specialised constants are filled in; anything else is refused with one line (:class:`~rpcompile.InputError`)."""
        args, kwargs = list(args), dict(kwargs)
        for name in self.params[len(args):self.n_args]:
            if name in kwargs:
                args.append(kwargs.pop(name))
        if len(args) != self.n_args:
            raise InputError(f"the pipeline was compiled for {self.n_args} positional input(s), got {len(args)}; "
                             "pass the inputs as in compile(model, example_inputs, ...)")
        unknown = [k for k in kwargs if k not in self.names]
        if unknown:
            raise InputError(f"keyword input(s) {unknown} were not in the compile example (keywords: "
                             f"{self.names or 'none'}); compile with them in example_kwargs= so the graph reads them")
        for k, v in self.constants.items():
            if k in kwargs and (isinstance(kwargs[k], torch.Tensor) or kwargs[k] != v):
                given = _short(kwargs[k])
                raise InputError(f"{k}={given} but the pipeline was compiled with {k}={_short(v)} (traced as a "
                                 f"constant); compile again with {k}={given} in example_kwargs=")
        missing = [k for k in self.names if k not in kwargs and k not in self.constants]
        if missing:
            raise InputError(f"missing keyword input(s) {missing}: the pipeline was compiled with them; pass "
                             f"them as in the compile example")
        self._check_tensors({**{self._slot(i): a for i, a in enumerate(args)}, **kwargs})
        longest = max((v.shape[1] for v in tensor_leaves((args, kwargs)) if _is_sequence(v)), default=None)
        if self.max_seq is not None and longest is not None and longest > self.max_seq:
            raise InputError(f"sequence length {longest} is longer than the {self.max_seq} this pipeline was "
                             f"planned for (its memory plan holds for sequences up to {self.max_seq}); compile "
                             f"again with an example of length {longest} (rpcompile plan ... --seq-len {longest})")
        # a constant left out is filled in with the compile example's value, which the graph holds
        return tuple(args), {k: kwargs.get(k, self.constants.get(k)) for k in self.names}

    def _check_tensors(self, slots: Mapping[str, Any]) -> None:
        rows: dict[str, int] = {}
        seqs: dict[str, int] = {}
        """Integer inputs as long as the example's sequence (ids, masks, labels): one batch, one length."""
        for slot, value in slots.items():
            expected = self.leaves.get(slot, {})
            flat = pytree.tree_flatten_with_path(value)[0]
            given = {pytree.keystr(p): v for p, v in flat}
            for path, spec in expected.items():
                where = slot + path
                if path not in given or not isinstance(given[path], torch.Tensor):
                    what = type(given[path] if path in given else value).__name__
                    raise InputError(f"{where} is a {what}, not a tensor: the pipeline was compiled for a "
                                     f"{_name(spec.dtype)} tensor of shape {spec.shape_text()} there; pass a tensor "
                                     f"(torch.as_tensor(...))")
                t = given[path]
                self._check_tensor(where, t, spec)
                if t.dim():
                    rows[where] = t.shape[0]
                # only dims that followed the example's sequence length must agree with each other
                if 1 in spec.dynamic and spec.shape[1] == self.max_seq and _is_sequence(t):
                    seqs[where] = t.shape[1]
            extra = [p for p, v in given.items() if isinstance(v, torch.Tensor) and p not in expected]
            if extra:
                raise InputError(f"{slot + extra[0]} is a tensor the compile example did not have there; pass the "
                                 "inputs as in the compile example")
        if len(set(rows.values())) > 1:
            sizes = ", ".join(f"{w} has {n}" for w, n in rows.items())
            raise InputError(f"the inputs disagree on the batch size (dim 0): {sizes}; pass one batch")
        if len(set(seqs.values())) > 1:
            sizes = ", ".join(f"{w} has {n}" for w, n in seqs.items())
            raise InputError(f"the inputs disagree on the sequence length (dim 1): {sizes}; pass one batch")

    def _check_tensor(self, where: str, t: torch.Tensor, spec: LeafSpec) -> None:
        if not _dtype_ok(spec.dtype, t.dtype, self.compute_dtype):
            raise InputError(f"{where} has dtype {_name(t.dtype)} but the pipeline was compiled for "
                             f"{_name(spec.dtype)} (eager would refuse it too); cast it ({where}{_cast(spec.dtype)})")
        if t.device.type not in self.devices:
            raise InputError(f"{where} is on {t.device} but the pipeline takes inputs on "
                             f"{' or '.join(sorted(self.devices))}; move it there ({where}.to('cpu'))")
        # dim 0 may be any size; another dynamic dim up to the example's, an integer sequence any length here (bind
        # refuses one longer than planned, with the fix)
        bad = t.dim() != len(spec.shape) or any(
            t.shape[d] != n and not (d in spec.dynamic and (d == 0 or t.shape[d] <= n or _is_sequence(t)))
            for d, n in enumerate(spec.shape))
        if bad:
            raise InputError(f"{where} has shape {tuple(t.shape)} but the pipeline was compiled for "
                             f"{spec.shape_text()}; pass inputs shaped like the compile example's {spec.shape} "
                             "(other batch sizes are fine), or compile again with this shape")
        if t.dim() and t.shape[0] == 0:
            raise InputError(f"{where} is an empty batch (shape {tuple(t.shape)}); pass at least one row")

    def check_target(self, target: Any, args: Sequence[Any], kwargs: Mapping[str, Any], *, needed: bool,
                     used: bool = True, call: str = "forward_backward") -> None:
        """Refuse a missing target where the loss needs one, a target no loss reads (``used=False``: the model
        computes its own), a list or array of numbers (it would not be split into microbatches), and one whose
        batch size differs from the inputs' — for a target holding tensors (a tuple, a dict), any of them."""
        if target is not None and not used:
            raise InputError("target= is given but the pipeline has no loss_fn: with loss_fn=None the model computes "
                             "its own loss from the labels it was compiled with; pass them as labels=..., or compile "
                             "with loss_fn=")
        if target is None:
            if needed:
                raise InputError("target is missing: the loss needs it; pass the batch's target, "
                                 f"{call}(x, target=y) (a loss_fn that takes none: give its second "
                                 "parameter a default, def loss(output, target=None))")
            return
        if isinstance(target, _ARRAYS) and not tensor_leaves(target) or type(target).__module__ == "numpy":
            raise InputError(f"target is a {type(target).__name__}, not a tensor: it would not be split into "
                             "microbatches with the inputs; pass a tensor (torch.as_tensor(target))")
        if not isinstance(target, torch.Tensor):
            self._check_target_leaves(target, args, kwargs)
            return
        if self.target is not None:
            self._check_tensor("target", target, self.target)
        elif target.device.type not in self.devices:
            raise InputError(f"target is on {target.device} but the pipeline takes inputs on "
                             f"{' or '.join(sorted(self.devices))}; move it there (target.to('cpu'))")
        leaves = tensor_leaves((tuple(args), dict(kwargs)))
        rows = next((v.shape[0] for v in leaves if v.dim() > 0), None)
        if rows is not None and target.dim() > 0 and target.shape[0] != rows:
            raise InputError(f"target has batch size {target.shape[0]} but the inputs have {rows} rows (dim 0); "
                             "pass the target of this batch")
        seq = max((v.shape[1] for v in leaves if _is_sequence(v)), default=None)
        if self.target_follows_seq and seq is not None and target.dim() > 1 and target.shape[1] != seq:
            raise InputError(f"target has sequence length {target.shape[1]} but the inputs have {seq} (dim 1), and "
                             "the compile example's target had one label per token; pass the target of this batch")


    def _check_target_leaves(self, target: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """A target that holds tensors — ``(values, row weights)``, a dict — is split into microbatches as the
        inputs are (every tensor along dim 0): each of them must have the inputs' rows. A constant of the loss
        (class weights) would be split too, or refused: it belongs in ``loss_fn``."""
        rows = next((v.shape[0] for v in tensor_leaves((tuple(args), dict(kwargs))) if v.dim() > 0), None)
        for path, leaf in pytree.tree_flatten_with_path(target)[0]:
            if not isinstance(leaf, torch.Tensor):
                continue
            where = f"target{pytree.keystr(path)}"
            if leaf.device.type not in self.devices:
                raise InputError(f"{where} is on {leaf.device} but the pipeline takes inputs on "
                                 f"{' or '.join(sorted(self.devices))}; move it there ({where}.to('cpu'))")
            if rows is not None and leaf.dim() > 0 and leaf.shape[0] != rows:
                raise InputError(f"{where} has batch size {leaf.shape[0]} but the inputs have {rows} rows (dim 0): "
                                 "each tensor of a target is split into microbatches with the inputs; pass this "
                                 "batch's rows (a constant such as class weights belongs in loss_fn)")


_PRECISIONS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def check_call_mode(call: str, precision: str) -> None:
    """Refuse (:class:`~rpcompile.InputError`, one line) a ``call`` (``forward_backward``, ``forward``) made under a mode the
    stages do not run in. ``torch.autocast``: it holds on the calling thread only — the stages run there would
    compute in another dtype than the devices' worker threads, and a saved segment would capture that dtype for
    every later call — while the pipeline computes in its own ``precision`` everywhere. ``torch.inference_mode``:
    ``forward_backward`` makes gradients. (``torch.no_grad`` is harmless: the pipeline turns gradients on itself.)"""
    for kind in ("cpu", "cuda"):
        if torch.is_autocast_enabled(kind):
            dtype = torch.get_autocast_dtype(kind)
            wanted = _PRECISIONS.get(dtype)
            fix = f"; compile with precision={wanted!r} for {_name(dtype)} compute" if wanted != precision else ""
            raise InputError(
                f"{call} is called under torch.autocast({kind!r}, dtype=torch.{_name(dtype)}), but the pipeline "
                f"computes in the precision it was compiled with ({precision!r}) on every device: call it outside "
                f"autocast{fix}")
    if call == "forward_backward" and torch.is_inference_mode_enabled():
        raise InputError("forward_backward is called under torch.inference_mode(), but it makes gradients: call it "
                         "outside inference mode (pipe.forward(...) evaluates without them)")


def _short(v: Any) -> str:
    """A value for a one-line message: a tensor by its dtype and shape, anything else by a short repr."""
    if isinstance(v, torch.Tensor):
        return f"<{_name(v.dtype)} tensor {tuple(v.shape)}>"
    text = " ".join(repr(v).split())
    return text if len(text) <= 40 else text[:37] + "..."


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def needs_target(loss_fn: Callable[..., Any] | None) -> bool:
    """Whether ``loss_fn(output, target)`` needs a target: it takes a second parameter without a default."""
    if loss_fn is None:
        return False
    try:
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):
        # unknown: taken to need one, so that a call without a target is refused rather than passed None
        return True
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in params if p.kind in (*kinds, inspect.Parameter.VAR_POSITIONAL)]
    # one parameter, or *args among the first two: the target may be left out
    if len(positional) < 2 or any(p.kind not in kinds for p in positional[:2]):
        return False
    return positional[1].default is inspect.Parameter.empty


def _numbers(v: Any) -> bool:
    """A list/tuple of numbers (nested) or a numpy array: data a model wanted as a tensor."""
    # numpy found by its module's name: it need not be imported here
    if type(v).__module__ == "numpy" and hasattr(v, "shape"):
        return True
    if not isinstance(v, _ARRAYS) or not v:
        return False
    leaves = pytree.tree_leaves(list(v))
    return bool(leaves) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in leaves)


def check_compile_arguments(model: Any, example_inputs: Any, example_kwargs: Mapping[str, Any] | None, *,
                            loss_fn: Any, devices: Any, gpus: Any, microbatches: Any) -> None:
    """Refuse, in one line, a ``compile`` argument that cannot work, before tracing or planning anything."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model is a {type(model).__name__}, not a torch.nn.Module; pass the module to compile")
    if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile's OptimizedModule
        raise ConfigError(f"model is a torch.compile wrapper ({type(model).__name__}): rpcompile compiles the model "
                          "itself, into stages of its own; pass the module it wraps, model._orig_mod")
    meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type == "meta"]
    if meta:  # no values to train: a stage would fail on torch's device error at the first call
        raise ConfigError(f"model has {len(meta)} parameter(s) or buffer(s) on the meta device (e.g. {meta[0]}), "
                          "which hold no values to train; load its weights first (model.to_empty(device='cpu') then "
                          "load_state_dict(...), or from_pretrained without a meta device_map) — rpcompile.plan "
                          "plans a model on the meta device")
    _warn_16_bit_masters(model)
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"loss_fn={loss_fn!r} is not callable; pass a function loss_fn(output, target) -> scalar "
                          "(e.g. torch.nn.functional.cross_entropy), or loss_fn=None for the model's own loss")
    if isinstance(devices, (str, torch.device)):
        raise ConfigError(f"devices={str(devices)!r} is one device, not a list; pass devices=[{str(devices)!r}]")
    # bool is an int to isinstance: microbatches=True is refused
    if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                                     or microbatches < 1):
        raise ConfigError(f"microbatches={microbatches!r}; give a whole number >= 1 (or None: the planner picks)")
    if microbatches is not None and microbatches > MAX_MICROBATCHES:
        raise ConfigError(f"microbatches={microbatches}; at most {MAX_MICROBATCHES} (a plan holds no more): give "
                          "fewer, larger microbatches")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
        raise ConfigError(f"gpus={gpus!r}; give a whole number >= 1, or devices=['cpu'] * k for logical CPU devices")
    examples = dict(example_inputs) if isinstance(example_inputs, Mapping) else \
        {f"example input {i}": v for i, v in enumerate(example_inputs)} if isinstance(example_inputs, _ARRAYS) \
        else {"example_inputs": example_inputs}
    examples.update({f"example_kwargs[{k!r}]": v for k, v in (example_kwargs or {}).items()})
    for where, v in examples.items():
        if _numbers(v):
            raise ConfigError(f"{where} is a {type(v).__name__} of numbers, not a tensor; pass a tensor "
                              "(torch.as_tensor(...)) as the model's forward takes")


def _warn_16_bit_masters(model: torch.nn.Module) -> None:
    """Warn (:class:`PrecisionWarning`) when trainable parameters are bfloat16 or float16 — a model loaded with
    ``torch_dtype=torch.bfloat16`` —: they stay the masters the optimizer updates, so updates smaller than half a
    step of that dtype are lost, where rpcompile's design keeps fp32 masters on the host for the devices' 16-bit
    compute (``precision=``). A frozen 16-bit base (LoRA) is fine and not warned about."""
    low = [(n, p.dtype) for n, p in model.named_parameters() if p.requires_grad and p.dtype in (torch.bfloat16,
                                                                                                torch.float16)]
    if low:
        name, dtype = low[0]
        warnings.warn(f"{len(low)} trainable parameter(s) are {_name(dtype)} (e.g. {name}): the optimizer updates them "
                      f"in {_name(dtype)}, losing small updates; for fp32 masters with {_name(dtype)} compute load the "
                      f"model in float32 (torch_dtype=torch.float32) and compile with "
                      f"precision={_PRECISIONS[dtype]!r}", PrecisionWarning, stacklevel=4)
