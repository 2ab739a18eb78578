"""``rpcompile.compile``: the public face of the runtime.

    pipe = rpcompile.compile(model, example_inputs, loss_fn=loss_fn, devices=["cpu", "cpu"])
    optimizer = torch.optim.AdamW(model.parameters())
    for x, y in data:
        loss = pipe.forward_backward(x, target=y)   # gradients land in model's p.grad, on the CPU
        optimizer.step(); optimizer.zero_grad()

Contracts
---------
- **Loss.** ``loss_fn(output, target)`` returns the *mean* loss of the microbatch it is given. The batch is split
  along dim 0 into ``microbatches`` pieces (``torch.tensor_split``); microbatch j's loss is weighted by its share of
  the batch, so ``forward_backward`` returns — and differentiates — the batch mean, exactly what eager
  ``loss_fn(model(x), y).backward()`` computes for mean-reduced losses. With ``loss_fn=None`` the model's output
  must be the (mean) loss itself.
- **Gradients** accumulate into the original parameters' ``.grad`` (fp32, CPU) across calls, as eager PyTorch does;
  frozen parameters (``requires_grad=False``) get none and are never sent back. A parameter used by several stages
  (tied embeddings) receives the sum.
- **Weights.** The fp32 masters stay in the model on the CPU; each stage uploads a copy in the compute precision.
  The copy is made from the master at every upload, so any ``torch.optim`` optimizer that updates the masters in
  place is picked up by the next call — nothing to refresh by hand.
- **Buffers** (BatchNorm statistics) are updated once per microbatch by the real forward pass, never by
  recomputation: the pipeline equals eager training with gradient accumulation over the same microbatches.
- **Randomness** (dropout) is seeded per (iteration, node, microbatch): recomputation replays the forward's masks
  (saved segments keep them), and results do not depend on the number of devices.
- **fp16** uses loss scaling through ``torch.amp.GradScaler("cpu")`` (pass ``scaler=``): the loss is multiplied by
  the scaler's scale, master gradients arrive scaled, and ``scaler.step(optimizer)`` / ``scaler.update()`` skip the
  step and lower the scale on overflow, raising it after a run of good steps — the standard torch contract.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from .errors import RPCompileError
from .planfile import Plan

__all__ = ["compile", "Pipeline"]

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def offload_budget(plan: Plan, device: int, devices: int) -> int:
    """Saved activations that may wait on ``device`` to go down: the memory its stages leave free (the lazy
    offload policy of :func:`rpcompile.passes.problem.offload_backlog`)."""
    mine = [s.memory_bytes for k, s in enumerate(plan.stages) if k % devices == device]
    return max(0, plan.hardware.memory_bytes - max(mine, default=0))


class Pipeline:
    """A compiled model: runs training iterations of a plan on its devices (see module docstring)."""

    def __init__(self, model: torch.nn.Module, gm: fx.GraphModule, plan: Plan, devices: Sequence[Any],
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None, precision: str, scaler: Any = None,
                 loss_in_graph: bool = False):
        from rpcompile.runtime.executor import Executor
        from rpcompile.runtime.schedule import round_robin
        from rpcompile.runtime.split import split_plan

        self.model, self.gm, self.plan, self.devices = model, gm, plan, list(devices)
        self.loss_fn, self.precision, self.scaler = loss_fn, precision, scaler
        self.loss_in_graph = loss_in_graph  # the graph takes the target and returns the loss (split LM head)
        self.microbatches = plan.microbatches
        self.program = split_plan(plan, gm)
        self.schedule = round_robin([s.kind for s in plan.stages], len(self.devices), self.microbatches)
        params = {n: p for n, p in gm.named_parameters()}
        buffers = {n: b for n, b in gm.named_buffers()}
        self.executor = Executor(self.program, self.devices, params, buffers, dtype=_DTYPES[precision])
        self.iteration = 0
        for d, device in enumerate(self.devices):  # GPUs send hand-offs and saved activations down behind the compute
            if device.torch_device.type == "cuda" and device.offloader is None:
                device.enable_offload(offload_budget(plan, d, len(self.devices)))
                device.enable_async_handoff()

    @property
    def timeline(self) -> list:
        """What the last call ran where and when (:class:`rpcompile.runtime.executor.TimelineEvent`)."""
        return self.executor.timeline

    def _store(self, inputs: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, list[int]]:
        from rpcompile.passes.util import flat_inputs
        from rpcompile.planning import split_microbatches
        from rpcompile.runtime.executor import ValueStore

        flat = flat_inputs(self.gm, inputs, kwargs)
        pieces = split_microbatches(flat, self.microbatches)
        store = ValueStore()
        for j, piece in enumerate(pieces):
            for name, value in zip(self.program.placeholders, piece):
                store.put(name, j, value)
        sizes = [next((v.shape[0] for v in p if isinstance(v, torch.Tensor) and v.dim() > 0), 1) for p in pieces]
        return store, sizes

    def forward_backward(self, *inputs: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """One training iteration's forward and backward over the whole batch; returns the batch's loss: the mean
        over the batch (microbatch losses weighted by their sizes), or their sum for a loss module with
        ``reduction="sum"``."""
        from rpcompile.planning import split_microbatches

        if self.loss_in_graph:
            if not isinstance(target, torch.Tensor):
                raise RPCompileError("this pipeline computes the loss inside its graph (head_chunks > 1): "
                                     "pass the batch's target, forward_backward(x, target=y)")
            from rpcompile.passes.loss_head import TARGET
            kwargs = {**kwargs, TARGET: target}
        store, sizes = self._store(inputs, kwargs)
        total = sum(sizes)
        outside = self.loss_fn is not None and not self.loss_in_graph  # the loss runs after the last stage
        # each microbatch's target goes to the device of the stage that computes its loss (the executor uploads it)
        if not outside:
            targets = None
        elif isinstance(target, torch.Tensor):
            targets = [piece[0] for piece in split_microbatches((target,), self.microbatches)]
        else:
            targets = [target] * self.microbatches
        # a mean over the batch is the size-weighted mean of the microbatches' means; a sum is their sum
        summed = outside and getattr(self.loss_fn, "reduction", "mean") == "sum"

        def loss_of(output: Any, target_j: Any, j: int) -> torch.Tensor:
            if not outside:
                loss = output
            else:
                loss = self.loss_fn(output, target_j)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise RPCompileError(f"loss_fn returned {shape}, not a scalar: reduce it over the batch (reduction="
                                     "'mean' or 'sum')")
            return loss if summed else loss * (sizes[j] / total)

        scale = 1.0
        if self.scaler is not None and self.scaler.is_enabled():
            scale = float(self.scaler.scale(torch.ones(())))  # also starts the scaler's bookkeeping
        losses = self.executor.run(self.schedule, store, iteration=self.iteration, loss_fn=loss_of, targets=targets,
                                   grad_scale=scale)
        self.iteration += 1
        return torch.stack(losses).sum()

    @torch.no_grad()
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Evaluation: the model's output for the whole batch, stage by stage on the plan's devices."""
        from rpcompile.passes.util import flat_inputs
        from rpcompile.runtime.executor import ValueStore

        store = ValueStore()
        for name, value in zip(self.program.placeholders, flat_inputs(self.gm, inputs, kwargs)):
            store.put(name, 0, value)
        return self.executor.run_forward(store, iteration=self.iteration)

    def codegen(self, directory: str | os.PathLike) -> list[Path]:
        """Write each stage's generated Python into ``directory``; returns the files."""
        from rpcompile.runtime.codegen import write_stages

        return write_stages(self.program, self.plan, directory)


def compile(
    model: torch.nn.Module,
    example_inputs: Sequence[Any] = (),
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    gpus: int | None = None,
    devices: Sequence[str | torch.device] | None = None,
    microbatches: int | None = None,
    plan: Plan | str | os.PathLike | None = None,
    precision: str = "fp32",
    example_kwargs: Mapping[str, Any] | None = None,
    scaler: Any = None,
    spec: Any = None,
    example_target: Any = None,
    head_chunks: "int | str" = "auto",
    host_embedding: "bool | Sequence[str]" = True,
    **plan_options: Any,
) -> Pipeline:
    """Trace ``model``, plan it (or load/check ``plan``) and return a :class:`Pipeline` on its devices.

    ``devices=["cpu"] * k`` runs k logical devices on the CPU; ``gpus=k`` uses ``cuda:0..k-1``; with neither, every
    visible GPU, or one logical CPU device. Costs are measured on the first device unless ``spec`` (a
    :class:`~rpcompile.specs.DeviceSpec` or preset name) asks for analytic ones — which also makes the plan
    independent of timing noise. ``plan_options`` go to :func:`rpcompile.planning.plan_graph` (``strategy``,
    ``memory_limit``, ``time_limit_s``, ...).

    ``head_chunks=k`` (with ``example_target``, a target for ``example_inputs``) moves a mean token cross-entropy
    into the graph and splits it with the LM head into ``k`` sequence chunks (:mod:`rpcompile.passes.loss_head`):
    the full logits never exist and the head spreads over stages. ``forward_backward`` is unchanged;
    ``forward(x, target=y)`` then returns the loss. The default ``"auto"`` plans the whole head and — given
    ``example_target`` and a head that can be split — 8 chunks as well, and keeps the faster plan.
    ``host_embedding`` (default on) runs token embeddings whose tables are larger than what an iteration looks
    up on the host, next to their fp32 masters (:mod:`rpcompile.passes.host`): the first stage receives the
    looked-up rows instead of uploading the table, and the rows' gradients go into the table's ``.grad``;
    ``False`` keeps every table on the devices, and node names move exactly those lookups.
    """
    from rpcompile.runtime.devices import make_devices

    from .planning import default_spec, fastest, head_chunk_candidates, make_hardware, plan_graph, prepare
    from .tracing import trace
    from .verify import planned_graph, verify_plan

    if precision not in _DTYPES:
        raise ValueError(f"precision must be one of {sorted(_DTYPES)}, got {precision!r}")
    if devices is None and gpus is None:
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
    devs = make_devices(list(devices) if devices is not None else None, gpus)
    if plan is not None:
        if not isinstance(plan, Plan):
            plan = Plan.load(plan)
        gm = trace(model, example_inputs, example_kwargs=example_kwargs)
        head_chunks = plan.head_chunks  # the plan says which graph it was made from
        if head_chunks > 1:
            from rpcompile.passes.loss_head import split_head

            split_head(gm, loss_fn, head_chunks)
        gm = planned_graph(plan, gm)  # with its embedding lookups on the host, as the plan runs it
        verify_plan(plan, gm)
        if plan.hardware.device_count != len(devs):
            raise RPCompileError(f"the plan is for {plan.hardware.device_count} devices but {len(devs)} were given; "
                                 "re-plan for these devices or pass matching devices=")
        return Pipeline(model, gm, plan, devs, loss_fn, precision, scaler, loss_in_graph=head_chunks > 1)
    on_cpu = devs[0].torch_device.type == "cpu"
    memory_limit = plan_options.pop("memory_limit", None)
    if memory_limit is None and not on_cpu:
        memory_limit = int(torch.cuda.get_device_properties(devs[0].torch_device).total_memory * 0.9)
    hardware = make_hardware(len(devs), default_spec(spec, devs[0].torch_device, "cpu"), memory_limit)

    def attempt(k: int) -> tuple[float, Any]:
        threads = torch.get_num_threads()
        if on_cpu and len(devs) > 1:  # measure with the intra-op threads each logical device will have
            torch.set_num_threads(max(1, threads // len(devs)))
        try:
            gm, m = prepare(model, example_inputs, gpus=len(devs), spec=spec,
                            device=None if spec is not None else devs[0].torch_device, microbatches=microbatches,
                            precision=precision, example_kwargs=example_kwargs, progress=False, loss_fn=loss_fn,
                            example_target=example_target, head_chunks=k, host_embedding=host_embedding)
        finally:
            torch.set_num_threads(threads)
        # Saved segments run without recomputation (rpcompile.runtime.saved): the planner may keep activations in
        # host memory wherever that is faster than recomputing them and fits.
        made = plan_graph(gm, hardware=hardware, microbatches=m, precision=precision, **plan_options)
        return made.predicted.iteration_time_s, (made, gm)

    made, gm = fastest(head_chunk_candidates(head_chunks, loss_fn, example_target), attempt)
    return Pipeline(model, gm, made, devs, loss_fn, precision, scaler, loss_in_graph=made.head_chunks > 1)
