"""``rpcompile.compile``: a model traced, planned (or its plan loaded and checked) and made a :class:`~rpcompile.Pipeline`.

    pipe = rpcompile.compile(model, example_inputs, loss_fn=loss_fn, devices=["cpu", "cpu"])

:func:`compile` is :func:`rpcompile.planner.planning.compile_plan`'s plan plus a
:class:`~rpcompile.training.pipeline.Pipeline` that runs it. Arguments, precision, ``loss_weight``, devices and
inputs are each checked, and refused in one line, before anything costly runs.

a plan given
    A :class:`~rpcompile.core.plan.Plan` or its file: not solved again; the graph it was made from is rebuilt
    (:func:`~rpcompile.planner.planning.graph_as_planned`) and the plan verified against it
    (:func:`~rpcompile.planner.invariants.verify_plan`).
planned
    Otherwise: within the GPUs' usable memory (:func:`~rpcompile.training.gpu_memory.gpu_memory_limit`), and
    solved again without saved activations when the host could not hold them
    (:func:`~rpcompile.training.host_memory.fit_host_memory`).
data-parallel
    Under a default ``torch.distributed`` group of several ranks: every rank compiles rank 0's plan (or the one
    given) and all check they run the same one (:func:`_join`, :mod:`rpcompile.training.distributed`).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

import torch
import torch.fx as fx

from rpcompile.core.precision import PRECISION_BYTES
from rpcompile.passes.graph.trace import training_inputs
from rpcompile.passes.rewrite.codegen import write_stages
from rpcompile.passes.rewrite.split import split_plan
from rpcompile.runtime.devices import make_devices

from .core.errors import ConfigError, PlanVerificationError, RPCompileError, one_line
from .core.plan import Plan
from .core.precision import COMPUTE_DTYPES
from .core.program import Program
from .planner.invariants import plan_violations
from .planner.plan_options import PLAN_DEFAULTS, PlanOptions, options_or_keywords
from .planner.planning import compile_plan, graph_as_planned, replanned
from .training.distributed import DataParallel, DistributedError, data_parallel_group, plan_digest
from .training.gpu_memory import gpu_memory_limit
from .training.host_memory import fit_host_memory, within_host_memory
from .training.options import TrainOptions
from .training.pipeline import Pipeline
from .training.signature import InputSignature, check_compile_arguments

__all__ = ["compile", "pipeline", "PlanLowering"]

log = logging.getLogger(__name__)


def compile(
    model: torch.nn.Module,
    example_inputs: Sequence[Any] = (),
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    gpus: int | None = None,
    devices: Sequence[str | torch.device] | None = None,
    microbatches: int | None = None,
    plan: Plan | str | os.PathLike | None = None,
    precision: str | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    scaler: Any = None,
    spec: Any = None,
    example_target: Any = None,
    head_chunks: "int | str" = "auto",
    host_embedding: "bool | Sequence[str]" = True,
    loss_weight: "str | Callable[[Any], float]" = "auto",
    frozen_masters: bool = False,
    data_parallel: bool | None = None,
    options: PlanOptions | None = None,
    **plan_options: Any,
) -> Pipeline:
    """Trace ``model``, plan it (or load/check ``plan``) and return a :class:`~rpcompile.Pipeline` on its devices.

    ``devices=["cpu"] * k`` runs k logical devices on the CPU; ``gpus=k`` uses ``cuda:0..k-1``; with neither, every
    visible GPU, or one logical CPU device. Costs are measured on the first device unless ``spec`` (a
    :class:`~rpcompile.core.specs.DeviceSpec` or preset name) asks for analytic ones — which also makes the plan
    independent of timing noise. On GPUs a plan may use 90% of their memory — with ``spec``, no more than the spec's
    usable memory (:func:`~rpcompile.training.gpu_memory.gpu_memory_limit`) — unless ``memory_limit`` says otherwise. ``plan_options`` are the
    other fields of :class:`~rpcompile.planner.plan_options.PlanOptions` (``strategy``, ``memory_limit``,
    ``time_limit_s``, ...), made into one object with these keywords and passed whole to
    :func:`rpcompile.planner.planning.compile_plan`: ``compile`` is that plan plus a :class:`~rpcompile.Pipeline` that runs it. Building it checks the host memory it needs first
    (:mod:`rpcompile.training.host_memory`). ``options``: a :class:`~rpcompile.PlanOptions` holding the planner's
    options at once instead of those keywords (``gpus``, ``microbatches``, ``precision``, ``spec``,
    ``head_chunks``, ``host_embedding`` and ``plan_options``; a keyword given beside it is refused); compile
    chooses where costs are measured, so its ``device`` and ``threads`` stay None. Its ``allow_save`` left True
    lets compile re-plan without saved activations when the host cannot hold them, as the keyword left out does.

    ``head_chunks=k`` (with ``example_target``, a target for ``example_inputs``) moves a mean token cross-entropy
    into the graph and splits it with the LM head into ``k`` sequence chunks
    (:mod:`rpcompile.passes.rewrite.loss_head`):
    the full logits never exist and the head spreads over stages. ``forward_backward`` is unchanged;
    ``forward(x, target=y)`` then returns the loss. The default ``"auto"`` plans the whole head and — given
    ``example_target`` and a head that can be split — 8 chunks as well, and keeps the faster plan.
    ``host_embedding`` (default on) runs token embeddings whose tables are larger than what an iteration looks
    up on the host, next to their fp32 masters (:mod:`rpcompile.passes.rewrite.host`): the first stage receives the
    looked-up rows instead of uploading the table, and the rows' gradients go into the table's ``.grad``;
    ``False`` keeps every table on the devices, and node names move exactly those lookups.

    ``loss_weight`` says what each microbatch's mean loss averages over
    (:func:`~rpcompile.training.loss_weighting.loss_weights`): by default real tokens for an integer target (entries that
    are not -100, so padded batches give eager's whole-batch loss and gradients), rows otherwise;
    :func:`~rpcompile.training.loss_weighting.shifted_tokens` for a loss that shifts the labels itself (HF causal LMs).
    Inputs are bound to the compile example's signature (:class:`~rpcompile.training.signature.InputSignature`); an HF model is traced with
    ``use_cache=False`` unless ``example_kwargs`` says otherwise, and ``forward_backward(**batch)`` takes an HF
    batch dict, its ``labels`` as the target.

    ``progress`` (default: when stderr is a terminal) shows on stderr what compile is doing and, later, a call's
    saved-segment captures (:mod:`rpcompile.training.capture_progress`); ``False`` is silent.

    Frozen parameters (``requires_grad=False``) are then kept only in the compute precision — their ``.data``
    becomes the pipeline's (pinned) copy, so a bf16 LoRA base costs 2 bytes a parameter of host memory —
    unless ``frozen_masters=True`` keeps their fp32 masters too.

    Under ``torch.distributed`` (a default process group of several ranks, e.g. ``torchrun``) every rank runs
    this plan on its own shard of the batch and gradients are summed across the ranks
    (:mod:`rpcompile.training.distributed`): rank 0 plans (unless ``plan`` is given) and every rank checks it runs the
    same plan. ``data_parallel=False`` keeps this process on its own; ``True`` requires a process group.
    """
    if options is not None:  # the planner's options in one object: the planner keywords are left out
        if plan is not None:
            raise ConfigError("options= plans the model and plan= runs a plan made already: give one of them")
        if options.device is not None or options.threads is not None:
            raise ConfigError("compile measures costs on its first device with that device's share of the cores: "
                              "leave options.device and options.threads None (or plan with rpcompile.plan(options=...) "
                              "and compile(plan=...))")
        # with devices= the count comes from them (checked against options.gpus below): gpus is not passed, so it
        # does not clash with options.gpus
        keywords = dict(gpus=gpus if devices is None else None, microbatches=microbatches, spec=spec,
                        head_chunks=head_chunks, host_embedding=host_embedding, **plan_options)
        if precision is not None and precision != options.precision:
            keywords["precision"] = precision  # (compile's own default: the plan's or fp32)
        given = options_or_keywords(options, keywords, where="compile")
        if devices is not None and len(devices) != options.gpus:
            raise ConfigError(f"options.gpus is {options.gpus} but {len(devices)} devices were given; make them agree")
        gpus = options.gpus if devices is None else None
        microbatches, spec, head_chunks, host_embedding, precision = (
            given.pop(k) for k in ("microbatches", "spec", "head_chunks", "host_embedding", "precision"))
        # only the fields off their defaults come back as keywords: allow_save left True then reads as the keyword left
        # out, and re-planning without saves stays allowed below; device and threads are compile's own to choose
        plan_options = {k: v for k, v in given.items()
                        if k not in ("gpus", "device", "threads") and v != PLAN_DEFAULTS[k]}
    # checked in this order, each refused in one line before anything costly: the arguments, the precision,
    # data-parallel or not, loss_weight (TrainOptions), then the devices and the inputs (the example's signature)
    check_compile_arguments(model, example_inputs, example_kwargs, loss_fn=loss_fn, devices=devices, gpus=gpus,
                            microbatches=microbatches)
    # named before Plan.load replaces the path, so errors about the plan name its file
    source = "the plan" if isinstance(plan, Plan) else str(plan)
    if plan is not None and not isinstance(plan, Plan):
        plan = Plan.load(plan)
    precision = _precision(plan, precision)
    if precision not in COMPUTE_DTYPES:
        raise ConfigError(f"precision must be one of {sorted(COMPUTE_DTYPES)}, got {precision!r}")
    dp = data_parallel_group(data_parallel)
    if dp is not None:  # one pipeline per rank, on one plan (rank 0's unless given), checked alike everywhere
        # data_parallel=False below: each rank's own compile must not join the group again
        local = functools.partial(
            compile, model, example_inputs, loss_fn=loss_fn, gpus=gpus, devices=devices, microbatches=microbatches,
            precision=precision, example_kwargs=example_kwargs, scaler=scaler, spec=spec,
            example_target=example_target, head_chunks=head_chunks, host_embedding=host_embedding,
            loss_weight=loss_weight, frozen_masters=frozen_masters, data_parallel=False, **plan_options)
        return _join(dp, local, plan, precision)
    train = TrainOptions(precision=precision, scaler=scaler, loss_weight=loss_weight,  # checked before any planning
                         frozen_masters=frozen_masters)
    progress = plan_options.pop("progress", None)  # what compile does, on stderr: on a terminal unless False
    show = sys.stderr.isatty() if progress is None else bool(progress)
    if devices is None and gpus is None:
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
    devs = make_devices(list(devices) if devices is not None else None, gpus)
    args, kwargs = training_inputs(model, example_inputs, example_kwargs)
    example_inputs, example_kwargs = args, kwargs
    signature = InputSignature(model, args, kwargs, devices=[d.torch_device.type for d in devs],
                               compute_dtype=COMPUTE_DTYPES[precision], target=example_target)
    if loss_fn is None and "labels" in signature.params and "labels" not in kwargs:
        raise RPCompileError("loss_fn=None uses the model's own loss, which it computes from labels: compile with "
                             "them in the example (example_kwargs={'input_ids': ids, 'labels': labels}) or give loss_fn=")
    with within_host_memory("compile"):  # the allocator's raw error as one line (rpcompile.training.host_memory)
        if plan is not None:
            # the graph the plan was made from: its LM head split, its embedding lookups on the host
            gm = graph_as_planned(plan, model, example_inputs, loss_fn=loss_fn, example_kwargs=example_kwargs,
                                  precision=precision)
            head_chunks = plan.head_chunks
            problems = plan_violations(plan, gm)
            if problems:
                raise PlanVerificationError(problems, source=source)
            if plan.hardware.device_count != len(devs):
                raise RPCompileError(f"the plan is for {plan.hardware.device_count} devices but {len(devs)} were "
                                     "given; re-plan for these devices or pass matching devices=")
            pipe = pipeline(model, gm, plan, devs, loss_fn, train, loss_in_graph=head_chunks > 1, signature=signature)
            pipe.progress = show  # the first calls' captures (rpcompile.training.capture_progress)
            return pipe
        on_cpu = devs[0].torch_device.type == "cpu"
        memory_limit = plan_options.pop("memory_limit", None)
        # on the CPU the limit stays the spec's usable memory (make_hardware's default); a GPU's is 90% of the card,
        # capped by any spec's
        if memory_limit is None and not on_cpu:
            memory_limit = gpu_memory_limit(devs[0].torch_device, spec)
        # costs measured with the intra-op threads each logical CPU device will have
        threads = max(1, torch.get_num_threads() // len(devs)) if on_cpu and len(devs) > 1 else None
        # spec= and device= exclude each other: analytic costs for the spec, else measured on the first device
        options = PlanOptions(  # the planner's options, made and checked once, passed down whole
            gpus=len(devs), spec=spec, device=None if spec is not None else devs[0].torch_device,
            memory_limit=memory_limit, microbatches=microbatches, precision=precision, progress=show,
            head_chunks=head_chunks, host_embedding=host_embedding, threads=threads, **plan_options)
        made = compile_plan(model, example_inputs, options, example_kwargs=example_kwargs, loss_fn=loss_fn,
                            example_target=example_target)
        if "allow_save" not in plan_options:  # saved activations the host may not hold: recomputed instead
            # the same graph solved again (one solve, the whole time limit): it is not traced or costed again
            limit = float(options.time_limit_s)
            saving = made
            t0 = time.perf_counter()
            made = fit_host_memory(saving, lambda: replanned(saving, allow_save=False, time_limit_s=limit),
                                   dtype=COMPUTE_DTYPES[precision], pin=not on_cpu, frozen_masters=frozen_masters)
            # dotted: a part of compile that contains its re-plan's passes, each logged on its own (not to add up)
            log.info("%s: %.2f s", "compile.host memory fit", time.perf_counter() - t0)
        assert made.plan is not None
        t0 = time.perf_counter()
        pipe = pipeline(model, made.graph, made.plan, devs, loss_fn, train, loss_in_graph=made.plan.head_chunks > 1,
                        signature=signature)
        log.info("%s: %.2f s", "pipeline", time.perf_counter() - t0)  # stage code, host weight copies (pinned for GPUs)
        pipe.progress = show
        return pipe


@dataclass(frozen=True)
class PlanLowering:
    """A plan lowered over the graph it was made from (a :class:`~rpcompile.core.program.Lowering`): its stage
    programs (:func:`~rpcompile.passes.rewrite.split.split_plan`) and their code written out
    (:func:`~rpcompile.passes.rewrite.codegen.write_stages`). The compiler lowers; the training session receives the
    programs."""

    plan: Plan
    gm: fx.GraphModule

    def program(self, input_grads: Collection[str] = ()) -> Program:
        return split_plan(self.plan, self.gm, input_grads=input_grads)

    def write(self, program: Program, directory: str | os.PathLike) -> list[Path]:
        return write_stages(program, self.plan, directory)


def pipeline(model: torch.nn.Module, gm: fx.GraphModule, plan: Plan, devices: Sequence[Any],
             loss_fn: Callable[[Any, Any], torch.Tensor] | None, options: TrainOptions, *,
             loss_in_graph: bool = False, signature: InputSignature | None = None) -> Pipeline:
    """A :class:`~rpcompile.training.pipeline.Pipeline` running ``plan`` over ``gm`` (the graph it was made from) with ``options``: the plan
    lowered into stage programs here (:class:`PlanLowering`) and handed to the training session as data.
    ``loss_in_graph``: the graph takes the target and returns the loss (a split LM head); ``signature``: the inputs
    compiled for (:class:`~rpcompile.training.signature.InputSignature`)."""
    lowering = PlanLowering(plan, gm)
    t0 = time.perf_counter()
    program = lowering.program()
    log.info("%s: %.2f s", "pipeline.lower", time.perf_counter() - t0)  # the stages' programs (split_plan)
    return Pipeline(model, gm, plan, devices, loss_fn, options, program=program, lowering=lowering,
                    loss_in_graph=loss_in_graph, signature=signature)


def _precision(plan: Plan | None, precision: str | None) -> str:
    """The precision to run in: the plan's own (its memory and times assume it) unless ``precision`` says
    otherwise, and fp32 without a plan. A run wider than its plan (fp32 for a bf16 plan: twice the memory the
    plan budgeted) is refused in one line; a narrower one fits what the plan counted. (An exported graph records
    its casts for one precision: that path refuses any other, ``graph_as_planned``.)"""
    if plan is None or precision is None:
        return plan.precision if plan is not None else precision or "fp32"
    if PRECISION_BYTES.get(precision, 0) > PRECISION_BYTES.get(plan.precision, 0):
        raise ConfigError(f"precision={precision!r} but the plan was made for {plan.precision!r} (its memory and "
                          f"times assume it): compile with precision={plan.precision!r} or none, or re-plan for "
                          f"{precision!r}")
    return precision


def _join(dp: DataParallel, local: Callable[..., Pipeline], plan: "Plan | str | os.PathLike | None",
          precision: str) -> Pipeline:
    """This rank's pipeline of data-parallel training: rank 0 plans when no ``plan`` is given and sends it to the
    others; each compiles it locally; all compare what they run (:meth:`DataParallel.agree <rpcompile.training.distributed.DataParallel.agree>`) and then join."""
    pipe: Pipeline | None = None
    failure: Exception | None = None
    if plan is None:
        pipe, plan = dp.shared_plan(local)
    try:
        # when rank 0 planned, it compiled its pipeline then; the other ranks (every rank, when plan= was given)
        # compile the plan here
        pipe = pipe or local(plan=plan)
        digest, error = plan_digest(pipe.plan, devices=len(pipe.devices), precision=precision), ""
    except Exception as e:  # noqa: BLE001 - every rank learns which one failed, then this one raises its own
        digest, error, failure = None, one_line(e), e
    try:
        # every rank reaches this collective, failed or not: one that skipped it would leave the others waiting forever
        dp.agree(digest, error)
    except DistributedError:
        # a rank that failed raises its own error, not the summary naming every rank that failed
        if failure is not None:
            raise failure from None
        raise
    assert pipe is not None
    pipe.join(dp)
    return pipe
