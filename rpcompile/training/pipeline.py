"""``Pipeline``: the public face of the runtime — what :func:`rpcompile.compile` (:mod:`rpcompile.compiler`) returns::

    pipe = rpcompile.compile(model, example_inputs, loss_fn=loss_fn, devices=["cpu", "cpu"])
    optimizer = torch.optim.AdamW(model.parameters())
    for x, y in data:
        loss = pipe.forward_backward(x, target=y)   # gradients land in model's p.grad, on the CPU
        optimizer.step(); optimizer.zero_grad()

What a call's batch becomes — microbatches, their targets and the weighted loss each fused stage computes — is
:mod:`rpcompile.training.batches`; a data-parallel rank's calls are :class:`rpcompile.training.distributed.RankCalls`.
The pipeline's contracts with its caller (loss, gradients, weights, optimizer step, buffers, randomness, fp16,
callers, checkpoints) are :class:`Pipeline`'s docstring.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NoReturn, Sequence

import torch
import torch.fx as fx

from rpcompile.runtime.bind import bind
from rpcompile.runtime.executor import Executor
from rpcompile.runtime.failures import PipelineError
from rpcompile.runtime.values import ValueStore

from .callers import OneCaller, one_call
from .capture_progress import CaptureProgress
from .batches import (call_batch, checked_accumulation, microbatch_store, microbatch_weights, microbatches_of,
                      output_classes)
from .checkpoint.state import CheckpointError, check_pipeline_state, pipeline_state
from .compiled_model import CompiledModel
from ..core.batch import TARGET, joined, split_microbatches
from ..core.errors import ConfigError, LossFnError, RPCompileError
from ..core.files import write_atomic
from ..core.plan import Plan
from ..core.precision import compute_dtype
from ..core.program import HEAD_CLASSES_META, Lowering, Program
from ..core.schedule import round_robin
from .distributed import DataParallel, RankCalls
from .gpu_memory import offload_budget
from .host_memory import check_host_memory
from .loss_weighting import BatchLoss, shifts_labels, shifted_tokens
from .options import TrainOptions
from .oom import out_of_memory
from .interrupts import deferred
from .metrics import StepRecord, batch_tokens, chrome_trace, step_record
from .overlap import Overlap, optimizers_of, schedulers_of, step_now, wait_for_steps, watch_model
from .signature import InputSignature, check_call_mode

__all__ = ["Pipeline"]

log = logging.getLogger(__name__)



class Pipeline:
    """A compiled model: runs training iterations of a plan on its devices.

    Contracts with the caller:

    - **Loss.** ``loss_fn(output, target)`` returns the *mean* loss of the microbatch it is given. The batch is split
      along dim 0 into ``microbatches`` pieces (``torch.tensor_split``); microbatch j's loss is weighted by its share of
      what the batch's mean averages over — real tokens of an integer target (entries that are not -100: padding),
      rows otherwise (``loss_weight=``) — so ``forward_backward`` returns — and differentiates — the batch mean,
      exactly what eager ``loss_fn(model(x), y).backward()`` computes for mean-reduced losses, padded batches
      included. With ``loss_fn=None`` the model computes its own (mean) loss — its output, or the output's ``loss``
      (HF models given ``labels=``), each microbatch weighted by its labels (shifted ones for a causal LM).
    - **Gradients** accumulate into the original parameters' ``.grad`` (fp32, CPU) across calls, as eager PyTorch does;
      frozen parameters (``requires_grad=False``) get none and are never sent back. A parameter used by several stages
      (tied embeddings) receives the sum. An input that requires grad gets eager's gradient: the stages run a program
      split with it among the values that carry gradients (made once per set of such inputs), its microbatches'
      gradients come home and go on through the caller's autograd graph (``x.grad`` of a leaf, a soft prompt's
      parameter); data-parallel, each rank's inputs get their own.
    - **Weights.** The fp32 masters stay in the model on the CPU; the devices upload copies in the compute precision
      (pinned for GPUs), made once per optimizer step (:mod:`rpcompile.runtime.weights`): any ``torch.optim``
      optimizer's ``step()`` marks its parameters' copies stale (a global step hook), as does an in-place change of a
      master seen by its version counter (``load_state_dict``, ``with torch.no_grad(): p.add_(...)``). Edits through
      ``p.data`` are invisible: call :meth:`Pipeline.refresh_weights` after them. Frozen parameters are kept only in
      the compute precision (their ``.data`` becomes the copy) unless ``frozen_masters=True``.
    - **Optimizer step.** ``optimizer.step(); optimizer.zero_grad()`` as in eager PyTorch, or
      :meth:`Pipeline.step` — which with ``overlap=True`` runs the step beside the next ``forward_backward``: that
      iteration then computes with the weights from before the step (one step stale, as RoundPipe's
      ``is_async=True``; ``zero_grad()`` in the loop stays safe), see :meth:`Pipeline.step` and :mod:`.overlap`.
    - **Buffers** a forward writes (BatchNorm statistics, a counter or running mean updated under ``torch.no_grad()``)
      are updated once per microbatch by the real forward pass — of ``forward_backward``, ``evaluate`` and
      ``forward`` alike — never by recomputation: the pipeline equals eager over the same microbatches one after the
      other (gradient accumulation), so a counter of forward calls counts microbatches. Compiling writes none
      (:func:`rpcompile.trace` puts back what fx ran on them), and a buffer no forward writes keeps its own bits.
    - **Randomness** (dropout) is seeded per (iteration, node, microbatch): recomputation replays the forward's masks
      (saved segments keep them), and results do not depend on the number of devices.
    - **fp16** uses loss scaling through ``torch.amp.GradScaler("cpu")`` (pass ``scaler=``): the loss is multiplied by
      the scaler's scale, master gradients arrive scaled, and ``scaler.step(optimizer)`` / ``scaler.update()`` skip the
      step and lower the scale on overflow, raising it after a run of good steps — the standard torch contract.
    - **Callers.** One call at a time: a call from a second thread while another thread's runs is refused in one line
      (:class:`~rpcompile.core.errors.ConcurrentCallError`, :mod:`rpcompile.training.callers`); an overlapped step
      in flight is waited for by whatever reads or writes what it writes (the model's and the optimizer's
      ``state_dict`` and ``load_state_dict``, another pipeline's runs over the same parameters;
      :mod:`rpcompile.training.overlap`); a Ctrl-C never leaves a step half done (:mod:`rpcompile.training.interrupts`).
    - **Checkpoints.** :meth:`Pipeline.state_dict` holds what the pipeline adds to the model's and the optimizer's
      state — the iteration that seeds dropout, the scaler's state, an overlapped step's stale copies — so a run
      resumed from all three (:func:`rpcompile.save_checkpoint` / :func:`rpcompile.load_checkpoint`, atomic and
      checksummed) equals the uninterrupted one bit for bit, given the same plan
      (:mod:`rpcompile.training.checkpoint`).
    """

    def __init__(self, model: torch.nn.Module, gm: fx.GraphModule, plan: Plan, devices: Sequence[Any],
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None, options: TrainOptions, *, program: Program,
                 lowering: Lowering, loss_in_graph: bool = False, signature: InputSignature | None = None):
        """``options``: the pipeline's own (precision, scaler, loss weighting, frozen masters; checked when made).
        ``program``: ``plan`` lowered over ``gm`` into the stages' programs (data); ``lowering``: what lowered it,
        asked again only for the programs of inputs that require grad and for the stage code written out
        (:meth:`codegen`). The compiler makes both (:func:`rpcompile.compiler.pipeline`)."""
        precision, loss_weight, frozen_masters = options.precision, options.loss_weight, options.frozen_masters
        self.options = options
        self.data_parallel: DataParallel | None = None
        """Set by :meth:`join`: this pipeline is one rank of data-parallel training (:mod:`rpcompile.training.distributed`)."""
        self._rank: RankCalls | None = None  # a data-parallel call's collectives and held gradients (join)
        self.model, self.gm, self.plan, self.devices = model, gm, plan, list(devices)
        self.loss_fn, self.precision, self.scaler = loss_fn, precision, options.scaler
        self.loss_in_graph = loss_in_graph  # the graph takes the target and returns the loss (split LM head)
        self.signature = signature
        self.loss_weight = loss_weight
        self.classes = output_classes(model) or gm.meta.get(HEAD_CLASSES_META)
        """The classes the model's output scores (an HF model's output embeddings, a split head's weight), which
        the labels of a loss inside the stages are checked against on the host; None where unknown."""
        if loss_fn is None and loss_weight == "auto" and shifts_labels(model):
            self.loss_weight = shifted_tokens  # the model's own causal LM loss averages over labels[:, 1:]
        self.compiled = CompiledModel(model, gm)
        """The model's parameters and modes as compiled: :meth:`check_model` compares every call's with them."""
        self.microbatches = plan.microbatches
        self.lowering = lowering
        self.program = bind(program)  # runnable: the executor runs bound programs (this one and _program_for's)
        self._input_grad_programs: dict[frozenset[str], Program] = {}  # by the inputs whose gradients they send home
        self.schedule = round_robin([s.kind for s in plan.stages], len(self.devices), self.microbatches)
        # by (microbatches, device of the first stage): a batch with fewer rows runs fewer microbatches, and an
        # overlapped iteration starts where the iteration before left the round-robin pointer (_schedule)
        self._schedules: dict[tuple[int, int], list] = {(self.microbatches, 0): self.schedule}
        params = {n: p for n, p in gm.named_parameters()}
        buffers = {n: b for n, b in gm.named_buffers()}
        # refused in one line before anything is allocated, not killed by the OS mid-step
        t0 = time.perf_counter()
        self.host_bytes = check_host_memory(
            params, plan, dtype=compute_dtype(precision), pin=any(d.torch_device.type == "cuda" for d in self.devices),
            uploaded=[n for prog in self.program.stages for n in prog.params.values()],
            host_only=[h.weight for h in self.program.host], frozen_masters=frozen_masters)
        """Host bytes building and running this pipeline allocates beyond what existed (:mod:`.host_memory`)."""
        t1 = time.perf_counter()
        log.info("%s: %.2f s", "pipeline.host memory check", t1 - t0)
        self.executor = Executor(self.program, self.devices, params, buffers, dtype=compute_dtype(precision),
                                 frozen_masters=frozen_masters)
        # the weight store (host copies: pinned for GPUs) and the gradient sink
        log.info("%s: %.2f s", "pipeline.executor", time.perf_counter() - t1)
        self.iteration = 0
        self.executor.seed = torch.initial_seed()  # dropout masks follow torch.manual_seed, as eager's do
        self._overlap = Overlap(self.executor.weights, self.executor.grads)
        """The overlapped optimizer step in flight and the overlap it began (:meth:`step`, :mod:`.overlap`)."""
        self._overlap.iterations = plan.predicted.overlap_iterations  # the devices go on into the next iteration
        # executor.start shares the intra-op threads out among CPU devices while iterations overlap; back when it ends
        self._overlap.ended = self.executor.restore_threads  # type: ignore[method-assign]
        watch_model(model, self._overlap, self.synchronize)  # model.state_dict / load_state_dict wait for it
        self._no_sync = False  # inside no_sync(): gradient-accumulation calls keep summed gradients on the devices
        self.last_step: StepRecord | None = None
        """The last ``forward_backward`` call, measured (:mod:`rpcompile.training.metrics`)."""
        self.on_step: Callable[[StepRecord], None] | None = None
        """Called with each ``forward_backward`` call's :class:`~rpcompile.training.metrics.StepRecord` (a logger's
        hook); None: nobody listens."""
        self.progress = sys.stderr.isatty()
        """Show a call's saved-segment captures on stderr (:mod:`.capture_progress`); ``compile(progress=)`` sets it."""
        self.callers = OneCaller()
        """Which thread is inside a call now: a second thread's call meanwhile is refused (:mod:`.callers`)."""
        self._masters = list(params.values())  # what another pipeline's overlapped step may be writing
        for d, device in enumerate(self.devices):  # GPUs send hand-offs and saved activations down behind the compute
            if device.torch_device.type == "cuda" and device.offloader is None:
                budget = offload_budget(plan, d, len(self.devices))
                if self.executor.resident_handoffs:  # one GPU: hand-offs kept there share what the plan leaves free
                    self.executor.resident_budget = budget // 2
                    budget -= budget // 2
                device.enable_offload(budget)
                device.enable_async_handoff()

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        raise RPCompileError("a Pipeline is not called like the model: pipe.forward_backward(x, target=y) trains "
                             "(the forward and the backward in one call: no loss.backward()); pipe.evaluate(x, "
                             "target=y) gives the loss without gradients, pipe.forward(x) the model's output")

    def join(self, dp: DataParallel) -> None:
        """Run as one rank of data-parallel training: gradients summed across the ranks (``compile`` does this)."""
        self.data_parallel = dp
        dp.attach(self.executor.program, dict(self.gm.named_parameters()), self.executor.grads)
        self._rank = RankCalls(dp, self.executor.grads, lambda: self._overlap_optimizer is not None)

    @property
    def host_traffic(self) -> dict[str, int]:
        """Bytes the host has read and written in parameter-sized work since the pipeline was made, by kind:
        weight copies, upload casts, gradients (:class:`rpcompile.runtime.weights.HostTraffic`; DMA not counted)."""
        return dict(self.executor.traffic.bytes)

    @one_call
    def refresh_weights(self) -> None:
        """Remake the devices' copies of every weight from the masters — needed only after edits through
        ``p.data``, which no version counter sees (class docstring, **Weights**)."""
        # an overlapped step in flight is still writing the masters: copies made now could be half stepped
        self.synchronize()
        self.executor.weights.refresh()

    @one_call
    def step(self, optimizer: Any, *, overlap: bool = False, scheduler: Any = None) -> None:
        """``optimizer.step()`` then ``optimizer.zero_grad()`` — through the pipeline's ``GradScaler`` when it has
        one (``scaler.step(optimizer); scaler.update()``) — then ``scheduler.step()`` when one is given (an lr
        scheduler), or, with ``overlap=True``, all of it on a thread of its own beside the next
        :meth:`forward_backward`, which returns once both are done (:mod:`rpcompile.training.overlap`).

        **Several optimizers** (a list or tuple: one for LoRA adapters and one for the head, Muon and AdamW):
        ``pipe.step([o1, o2])`` is ``o1.step(); o2.step()`` — ``scaler.step(o)`` for each, then one
        ``scaler.update()`` — then their ``zero_grad()``, then the schedulers (``scheduler=`` one or a list);
        overlapped, all of it on the one thread. A second ``step(..., overlap=True)`` before the next
        :meth:`forward_backward` is refused (a :class:`~rpcompile.ConfigError`): step them together.

        **zero_grad during an overlapped step.** The step reads ``.grad`` on its thread, then zeroes it; the next
        iteration's gradients are held aside and land in ``.grad`` when it ends. ``optimizer.zero_grad()`` and
        ``pipe.model.zero_grad()`` in the loop — before ``forward_backward`` or after ``pipe.step``, as in the
        PyTorch tutorial — would race with that: until the step is collected (the end of the next
        :meth:`forward_backward`, or :meth:`synchronize`) they are recorded instead (an instance attribute
        shadows the method) and run once the step is done, before the held gradients land — exactly "clear the
        gradients before the next backward". Afterwards the attribute is gone.

        **The optimizer's settings during an overlapped step.** The step reads them (``lr``, ``weight_decay``, ...)
        on its thread: a change made before the next :meth:`forward_backward` returns — ``scheduler.step()`` after
        ``pipe.step(optimizer, overlap=True)``, as in a plain loop — races with it, so the step may use either
        value. Such a change is refused there (a :class:`~rpcompile.runtime.failures.PipelineError`, as a failed step): pass the scheduler
        as ``scheduler=``, which steps it right after the optimizer, on the same thread.

        **What overlap computes.** The iteration that runs beside step t reads the weights from *before* step t
        (the device copies are double-buffered: the step writes the other buffer), so its gradients are one step
        stale: with w₀ the initial weights, w_{t+1} = step(w_t, ∇L_t(w_{t-1})), w_{-1} = w₀ — RoundPipe's
        ``is_async=True``. Loss curves differ slightly from synchronous training; with ``overlap=False`` the
        result equals ``optimizer.step(); optimizer.zero_grad()`` bitwise. Between an overlapped step and the next
        iteration's end the masters are being written: read them (save a checkpoint, evaluate on the masters)
        after :meth:`synchronize`. A ``GradScaler`` is refused with overlap (its scale would change mid-iteration).
        A step that raises surfaces at the end of the next :meth:`forward_backward` as a :class:`~rpcompile.runtime.failures.PipelineError`;
        that iteration's gradients are dropped (and the ``zero_grad`` calls recorded meanwhile) and the pipeline
        is back to synchronous steps, its copies remade from the masters as the failed step left them.

        **Overlapped iterations** (:attr:`overlap_iterations`: a plan made for them): the next
        :meth:`forward_backward` also returns before its last stages have drained, once its loss is known, and
        the devices go on into the iteration after it; the step takes their gradients into ``.grad`` on its
        thread. Still exactly one step stale; see :mod:`rpcompile.training.overlap`.
        """
        optimizers, schedulers = optimizers_of(optimizer), schedulers_of(scheduler)
        self._overlap.check_drains()  # an overlapped iteration that failed while draining: named here
        if overlap:
            self._overlap.check_idle()  # a second overlapped step before the next iteration: one line
        # the step in flight (t-1) collected before step t is submitted: the iteration beside step t computes with
        # step t-1's weights
        self._finish_step()
        self.sync_gradients()  # gradients summed on the devices under no_sync: home before the step reads them
        if not overlap:
            # a synchronous step ends any overlap first: the held gradients in .grad, no step thread writing the
            # masters
            self.synchronize()
            step_now(optimizers, schedulers, self.scaler)
            return
        if self.scaler is not None and self.scaler.is_enabled():
            raise ConfigError("step(optimizer, overlap=True) does not take a GradScaler (its scale would change "
                              "while the next iteration runs): use precision='bf16', or overlap=False")
        if self._overlap.iterations and self._rank is not None:
            raise ConfigError("overlapped iterations do not run data-parallel: compile without overlap=True (the "
                              "step alone then overlaps the next iteration)")
        self._overlap.start(optimizers, schedulers, self.model)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation with the gradients left on the devices: calls of :meth:`forward_backward` inside
        keep the gradients of the stages that sum them on their devices (``Stage.accumulates``, chosen by the
        planner where memory allows; ``rpcompile show`` lists them) and send nothing of those home; the next call
        outside ``no_sync`` sends each sum home once, with its own gradient added — DDP's ``no_sync`` contract::

            for i, batch in enumerate(batches):
                with pipe.no_sync() if (i + 1) % steps else contextlib.nullcontext():
                    pipe.forward_backward(batch["input_ids"], target=batch["labels"], num_items=n)
                if (i + 1) % steps == 0:
                    pipe.step(optimizer)

        Until then those parameters' ``.grad`` hold what they held before (zeros if nothing) — read them after
        the call outside ``no_sync``, or after :meth:`sync_gradients`; ``optimizer.step()`` over them before that
        is refused in one line, and :meth:`step` sends them home first. ``optimizer.zero_grad()`` meanwhile drops
        them, as it drops ``.grad``. With no stage summing on its device, calls inside are ordinary ones. Not with
        an overlapped step or data-parallel ranks (refused in one line)."""
        # restored, not cleared, on exit: a no_sync() nested in another leaves the outer one in force
        before, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = before

    @one_call
    def sync_gradients(self) -> None:
        """Send the gradients summed on the devices under :meth:`no_sync` home into ``.grad`` now (nothing when
        there are none): before reading or clipping ``.grad`` when the last accumulation call ran inside it."""
        self.executor.sums.flush(self.executor.grads)

    @one_call
    def synchronize(self) -> None:
        """Wait for an overlapped optimizer step (:meth:`step`) and go back to synchronous steps: afterwards the
        masters, ``.grad`` and the device copies all agree."""
        self._overlap.end()

    def _finish_step(self) -> None:
        """Wait for the overlapped step in flight, if any; its weights become the ones the devices upload."""
        self._overlap.collect()

    @property
    def _step(self) -> Future | None:
        """The overlapped step in flight, if any (:class:`rpcompile.training.overlap.Overlap`)."""
        return self._overlap.future

    @property
    def _overlap_optimizer(self) -> list[Any] | None:
        """The optimizers stepped overlapped since the overlap began; None: synchronous steps."""
        return self._overlap.optimizers or None

    @one_call
    def state_dict(self) -> dict[str, Any]:
        """The pipeline's own training state — the iteration that seeds dropout, the GradScaler's state, the
        weights an overlapped step left for the next iteration — which, with the model's and the optimizer's
        ``state_dict``, continues training bit for bit (:mod:`rpcompile.training.checkpoint`; ``save_checkpoint`` writes
        all three). An overlapped step in flight is waited for first; saving does not change what training
        computes."""
        return pipeline_state(self, self._overlap.stale_copies())

    def check_state_dict(self, state: Any, *, optimizer: Any = None, exact: bool = True) -> None:
        """Raise a one-line :class:`~rpcompile.training.checkpoint.state.CheckpointError` unless :meth:`load_state_dict` can
        continue ``state`` here — bit for bit where ``exact``: the same graph fingerprint, microbatches,
        precision, plan cuts and scaler."""
        weights = self.executor.weights  # an overlapped step keeps copies of the trainable weights, as uploaded
        copies = {n: (weights.source(n).dtype, tuple(e.master.shape)) for n, e in weights.entries.items()
                  if e.master.requires_grad}
        check_pipeline_state(self, state, copies, exact=exact)
        if exact and state["stale_weights"] and optimizer is None:
            raise CheckpointError("this pipeline state was saved right after step(optimizer, overlap=True): pass "
                                  "load_state_dict(state, optimizer=optimizer), its state loaded first")

    @one_call
    def load_state_dict(self, state: Mapping[str, Any], *, optimizer: Any = None, exact: bool = True) -> None:
        """Continue from :meth:`state_dict`, after the model's and the optimizer's ``load_state_dict``. A state
        saved right after ``step(optimizer, overlap=True)`` needs that ``optimizer`` (a list of them after
        ``step([o1, o2], overlap=True)``): the next iteration then runs beside the (already done) step with the
        weights from before it, as it would have. ``exact=False`` loads into a pipeline compiled otherwise (another
        plan, devices, precision): the iteration, the dropout seed and the scaler's state carry over, the next
        iteration runs on the latest weights, and results differ in the last bits."""
        self.check_state_dict(state, optimizer=optimizer, exact=exact)
        stale = state["stale_weights"] if exact else {}
        # any overlap ended first (its step collected, its iterations drained): nothing in flight changes what
        # loads below
        self.synchronize()
        with deferred():  # all of it or, with a Ctrl-C before it began, none
            self.iteration = int(state["iteration"])
            self.dropout_seed = state.get("dropout_seed")  # None: a version-1 state, drawn without one
            # a state saved without a scaler, or loaded (exact=False) into a pipeline without one, leaves the
            # scaler alone
            if state["scaler"] is not None and self.scaler is not None and self.scaler.is_enabled():
                self.scaler.load_state_dict(state["scaler"])
            if stale:
                self._overlap.resume(optimizers_of(optimizer), stale)

    @property
    def dropout_seed(self) -> int | None:
        """The seed every dropout mask is drawn from, with the iteration, the node and the microbatch
        (:mod:`rpcompile.runtime.rng`): ``torch.initial_seed()`` when the pipeline was made — what the last
        ``torch.manual_seed`` set — so runs with different seeds draw different masks and runs with the same seed
        the same ones. Saved and restored with :meth:`state_dict`."""
        return self.executor.seed

    @dropout_seed.setter
    def dropout_seed(self, seed: int | None) -> None:
        self.executor.seed = None if seed is None else int(seed)

    @property
    def timeline(self) -> list:
        """What the last call ran where and when (:class:`rpcompile.runtime.values.TimelineEvent`)."""
        return self.executor.timeline

    def export_trace(self, path: str | os.PathLike) -> Path:
        """The last call's :attr:`timeline` as a Chrome/Perfetto trace (JSON, written atomically): open it in
        ui.perfetto.dev or chrome://tracing (:func:`rpcompile.training.metrics.chrome_trace`)."""
        return write_atomic(path, chrome_trace(self.executor.timeline, devices=len(self.devices)))

    def _schedule(self, m: int, offset: int = 0) -> list:
        """The round-robin schedule for ``m`` microbatches (the plan's, or fewer for a batch with fewer rows), its
        first stage on device ``offset``."""
        if (m, offset) not in self._schedules:
            self._schedules[(m, offset)] = round_robin([s.kind for s in self.plan.stages], len(self.devices), m,
                                                       offset=offset)
        return self._schedules[(m, offset)]

    @property
    def overlap_iterations(self) -> bool:
        """Whether ``pipe.step(optimizer, overlap=True)`` also overlaps iterations: each ``forward_backward``
        returns once its loss is known and every device goes on into the next iteration while the last stages
        of this one drain (:mod:`.overlap`). True for a plan made for it (``compile(..., overlap=True)``, which
        also plans for it); settable, outside an overlap, to run any plan so."""
        return self._overlap.iterations

    @overlap_iterations.setter
    def overlap_iterations(self, on: bool) -> None:
        if bool(on) != self._overlap.iterations and self._overlap.optimizers:
            raise ConfigError("overlap_iterations cannot change while an overlapped step is in flight: call "
                              "pipe.synchronize() first")
        self._overlap.iterations = bool(on)

    @property
    def _iterations_overlap(self) -> bool:
        """This call overlaps the iteration before (a plan made for it, inside ``step(optimizer, overlap=True)``)."""
        return self._overlap.iterations and bool(self._overlap.optimizers)

    @one_call
    def forward_backward(self, *inputs: Any, target: Any = None, loss_scale: float = 1.0,
                         num_items: float | None = None, **kwargs: Any) -> torch.Tensor:
        """One training iteration's forward and backward over the whole batch; returns the batch's loss: the mean
        over the batch (microbatch losses weighted by their sizes), or their sum for a loss module with
        ``reduction="sum"``. Its gradients are added into ``.grad``: the loss returned is for logging.

        **Gradient accumulation** over several calls before one optimizer step — the eager
        ``(loss / steps).backward()``, which cannot be written here as the backward runs inside the call:
        ``loss_scale=1 / steps`` scales the loss and its gradients. ``num_items=N`` makes the mean's denominator
        N — what the loss averages over in *all* the batches accumulated (their real tokens for an integer
        target, their rows otherwise; every rank's, data-parallel) — instead of this batch's own count, so the
        accumulated gradients are those of the mean over all of them, padding weighted as in one big batch (HF
        Trainer's ``num_items_in_batch``); a summed loss (``reduction="sum"``) takes ``loss_scale`` only. The
        loss returned is the one whose gradients were added (scaled, or over ``N``).

        Data-parallel (:mod:`rpcompile.training.distributed`): the batch is this rank's shard; the loss returned and the
        gradients added into ``.grad`` are those of the whole batch, every rank's shard concatenated. A failure on
        any rank raises on every rank (one line naming it); that call's gradients are dropped."""
        accumulation = checked_accumulation(loss_scale, num_items)
        call = functools.partial(self._forward_backward, inputs, target, kwargs, accumulation)
        # the signal handler sets this flag on a Ctrl-C and nothing clears it: left from an earlier call, it would stop
        # this one at its first action
        self.executor.interrupted = False
        start = time.perf_counter()
        # a Ctrl-C stops the workers at their next action and is raised once the call is settled, never in the
        # middle of its bookkeeping (rpcompile.training.interrupts)
        with deferred(stop=self._interrupt):
            loss = (call() if self._rank is None else self._rank.run(call)).as_subclass(BatchLoss)
        self.last_step = step_record(iteration=self.iteration, loss=loss, wall_s=time.perf_counter() - start,
                                     tokens=batch_tokens(inputs, kwargs), timeline=self.executor.timeline,
                                     devices=len(self.devices), host_traffic=self.host_traffic,
                                     no_sync=self.executor.sums.deferring)
        if self.on_step is not None:
            self.on_step(self.last_step)
        return loss

    def _interrupt(self) -> None:
        """A Ctrl-C during :meth:`forward_backward` (from the signal handler: a flag, no lock)."""
        self.executor.interrupted = True

    def check_model(self) -> bool:
        """Refuse (:class:`~rpcompile.ModelChangedError`, one line) a model whose parameters are no longer the ones compiled
        or whose mode the stages cannot run; returns the mode they run in (:mod:`rpcompile.training.compiled_model`: a
        model traced in train mode and then put in eval mode runs its dropouts switched off). Calls check first."""
        training = self.compiled.check()
        for program in (self.executor.program, *self._input_grad_programs.values()):
            # the stages' modules, and those of the saved segments they call
            self.compiled.follow([prog.gm for prog in program.stages] + [seg.gm for seg in program.saved])
        return training

    def _program_for(self, inputs: frozenset[str]) -> Program:
        """The plan split again so that the gradients of these inputs (placeholders) come home too — made, and
        bound, the first time a call's inputs require grad."""
        if inputs not in self._input_grad_programs:
            program = bind(self.lowering.program(inputs))
            self.compiled.follow([prog.gm for prog in program.stages] + [seg.gm for seg in program.saved])
            self._input_grad_programs[inputs] = program
        return self._input_grad_programs[inputs]

    def _forward_backward(self, inputs: Sequence[Any], target: Any, kwargs: dict[str, Any],
                          accumulation: tuple[float, float | None] = (1.0, None)) -> torch.Tensor:
        check_call_mode("forward_backward", self.precision)
        self.executor.training = self.check_model()
        wait_for_steps(self._masters, besides=self._overlap)  # another pipeline's over the same parameters
        total_of = None if self._rank is None else self._rank.global_total  # data-parallel: over every rank
        store, m, loss_of, targets, wanted = call_batch(self, "forward_backward", inputs, target, kwargs,
                                                        total_of=total_of, accumulation=accumulation)
        scale = 1.0
        if self.scaler is not None and self.scaler.is_enabled():
            scale = float(self.scaler.scale(torch.ones(())))  # also starts the scaler's bookkeeping
        main = self.executor.program
        if wanted:  # inputs that require grad: the stages that read them send their gradients home too
            self.executor.program = self._program_for(frozenset(wanted))
        overlapped = self._iterations_overlap
        self._defer_gradients()
        try:
            with CaptureProgress(self.executor.program.saved, show=self.progress):
                if overlapped:
                    losses = self._overlapped(store, m, loss_of, targets, wait_all=bool(wanted))
                else:
                    losses = self.executor.run(self._schedule(m), store, iteration=self.iteration,
                                               loss_fn=loss_of, targets=targets, grad_scale=scale)
        except BaseException as e:  # .grad is as before the call; an overlapped step in flight finishes (not taken)
            self.executor.finish()  # (a call a Ctrl-C left running: stopped, its gradients taken back)
            if self._step is not None:
                wait([self._step])
            self._reraise(e)
        finally:
            # the program with input gradients serves this call only
            self.executor.program = main
        with deferred():  # a Ctrl-C from here on is raised once the iteration is wholly done
            _input_gradients(store, m, wanted)
            self.iteration += 1
            # each microbatch's loss came weighted by its share of the batch (batches.call_batch): their sum is
            # the batch's mean, or the sum of a summed loss
            loss = torch.stack(losses).sum()
            if self._rank is not None:  # data-parallel: the gradients summed across the ranks, the batch's loss
                loss = self._rank.reduced(loss)
            if self._overlap_optimizer is not None and not overlapped:  # the step beside it done: its gradients
                self._finish_step()
                self.executor.grads.install()
        return loss

    def _defer_gradients(self) -> None:
        """Whether this call keeps the summed gradients on the devices (:meth:`no_sync`), refused where the sums
        could not be kept whole: beside an overlapped step (the gradients are held apart for it) or data-parallel
        (each call's gradients are reduced across ranks as they land)."""
        sums = self.executor.sums
        sums.check()
        sums.deferring = self._no_sync and sums.active
        if not sums.deferring:
            return
        if self._overlap_optimizer is not None:
            sums.deferring = False
            raise ConfigError("pipe.no_sync() does not run beside an overlapped step: call pipe.synchronize() and "
                              "step with overlap=False while accumulating, or accumulate outside no_sync()")
        if self._rank is not None:
            sums.deferring = False
            raise ConfigError("pipe.no_sync() does not run data-parallel (each call's gradients are reduced across "
                              "the ranks as they land): accumulate outside no_sync()")

    def _overlapped(self, store: ValueStore, m: int, loss_of: Any, targets: Any, *, wait_all: bool) -> list:
        """The iteration overlapped with the one before (:mod:`.overlap`): started on each device as soon as that
        device is done with the iteration before — the round-robin pointer carrying on — with the weights from
        before the step in flight; its losses once the fused stage has computed them, its last stages left
        draining (all of it with ``wait_all``: input gradients come home at its end)."""
        self._overlap.check_drains()  # a failure while the iteration before drained surfaces here
        if (step := self._step) is not None and step.done() and step.exception() is not None:
            self._finish_step()  # so does a failed step's
        # the round-robin pointer carries on across iterations: stage k of iteration i runs on device
        # (i * stages + k) mod devices, so each device's next stage follows the last one it ran
        offset = self.iteration * len(self.plan.stages) % len(self.devices)
        run = self.executor.start(self._schedule(m, offset), store, iteration=self.iteration, loss_fn=loss_of,
                                  targets=targets, held=self._overlap.held, after=self._overlap.last)
        self._overlap.began(run)
        try:
            losses = run.losses()
            if wait_all and (error := run.wait()) is not None:
                raise error
        except BaseException:
            self._overlap.running.remove(run)  # settled, its gradients taken back: reported here, not again
            raise
        return losses

    def _reraise(self, e: BaseException) -> NoReturn:
        """A failed call's error as the caller sees it: a stage out of device memory as
        :class:`~.oom.StageOutOfMemoryError`, a ``loss_fn`` that failed on its target as that
        :class:`~rpcompile.LossFnError` itself (the stage ran), anything else as it is."""
        if isinstance(e, PipelineError):
            oom = out_of_memory(e, self.plan, [str(d.torch_device) for d in self.devices])
            if oom is not None:
                # chained to the worker's own exception (the PipelineError's cause), not to the one-line wrapper
                raise oom from e.__cause__
            if isinstance(e.__cause__, LossFnError):
                raise e.__cause__ from None
        raise e

    @one_call
    @torch.no_grad()
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Evaluation: the model's output for the whole batch, computed as :meth:`forward_backward` splits it —
        the plan's microbatches, each stage's weights uploaded once and its microbatches run in turn, so a stage
        never holds more than the plan allows — and joined on the host: every tensor with a batch dimension
        concatenated along it, a scalar (the model's own loss) the batch's mean (:func:`~rpcompile.core.batch.joined`). In train mode a
        batch norm normalises each microbatch by its own statistics, as in :meth:`forward_backward`; in eval mode
        (``model.eval()``, the usual way to evaluate) it uses its running statistics, as eager does."""
        check_call_mode("forward", self.precision)
        self.executor.training = self.check_model()
        wait_for_steps(self._masters, besides=self._overlap)
        self._overlap.drain()  # the devices idle: no overlapped iteration draining
        # the in-graph loss's target rides along
        # popped before bind (the compiled signature has no such input) and put back after it
        target = {TARGET: kwargs.pop(TARGET)} if self.loss_in_graph and TARGET in kwargs else {}
        if self.signature is not None:  # the inputs as compiled (signature.py)
            inputs, kwargs = self.signature.bind(inputs, kwargs)
        kwargs = {**kwargs, **target}
        m = microbatches_of(inputs, kwargs, self.microbatches)
        store, sizes = microbatch_store(self.gm, self.program.placeholders, inputs, kwargs, m)
        # split as the inputs are, so each microbatch's weight counts its own labels
        pieces = [p[0] for p in split_microbatches((target[TARGET],), m)] if target else [None] * m
        try:
            outputs = self.executor.run_forward(store, iteration=self.iteration, microbatches=m)
        except BaseException as e:
            self._reraise(e)
        # a scalar output is a mean loss: the model's own over its labels, the in-graph loss over its target
        weights = microbatch_weights(self.loss_fn, self.loss_weight, kwargs, pieces, sizes, m) \
            if self.loss_fn is None or target else sizes
        return joined(outputs, weights)

    @one_call
    @torch.no_grad()
    def evaluate(self, *inputs: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """The batch's loss without gradients: what :meth:`forward_backward` returns, computed as it does — the
        plan's microbatches, the loss on the fused stage's device (no output comes home; a split LM head never
        materialises the logits) — and weighted as it is (padding left out): eager's ``loss_fn(model(x), y)``
        under ``torch.no_grad()``, in the model's mode (``model.eval()``: dropouts off). Nothing changes: no
        gradient, no dropout iteration. Data-parallel: this rank's batch's loss. Beside an overlapped step
        (``pipe.step(opt, overlap=True)``) it sees the weights the next iteration computes with, from before that
        step; :meth:`synchronize` first for the stepped ones."""
        check_call_mode("evaluate", self.precision)
        self.executor.training = self.check_model()
        wait_for_steps(self._masters, besides=self._overlap)
        self._overlap.drain()  # the devices idle: no overlapped iteration draining
        store, m, loss_of, targets, _ = call_batch(self, "evaluate", inputs, target, dict(kwargs))
        try:
            losses = self.executor.run_forward(store, iteration=self.iteration, microbatches=m, loss_fn=loss_of,
                                               targets=targets)
        except BaseException as e:
            self._reraise(e)
        # each microbatch's loss already weighted by its share of the batch (batches.call_batch): the sum is its mean
        return torch.stack(losses).sum().as_subclass(BatchLoss)

    def codegen(self, directory: str | os.PathLike) -> list[Path]:
        """Write each stage's generated Python into ``directory``; returns the files."""
        return self.lowering.write(self.program, directory)


def _input_gradients(store: ValueStore, m: int, inputs: Mapping[str, torch.Tensor]) -> None:
    """The gradients of the inputs that require grad, from their ``m`` microbatches' (``store``), as eager's
    ``loss.backward()`` leaves them: accumulated into a leaf's ``.grad``, or on through the autograd graph that
    made the input (a soft prompt's parameters), in the input's dtype. A microbatch whose stages used no gradient
    of it adds zeros; an input no stage differentiated through keeps ``.grad`` None, as in eager."""
    for name, x in inputs.items():
        parts = [store.grad(name, j) for j in range(m)]
        if all(g is None for g in parts):
            continue
        # on x's device: one GPU keeps the gradients stages leave for each other there (runtime.executor)
        parts = [g.to(device=x.device, dtype=x.dtype) if g is not None else None for g in parts]
        if x.dim() == 0 or m == 1:  # one value every microbatch read (not split): the sum of their gradients
            grad = sum((g for g in parts if g is not None), torch.zeros_like(x))
        else:
            # detached: the rows only give the shape of a microbatch that has no gradient, and make no autograd nodes
            rows = torch.tensor_split(x.detach(), m)
            grad = torch.cat([g if g is not None else torch.zeros_like(r) for g, r in zip(parts, rows)])
        with torch.enable_grad():
            torch.autograd.backward([x], [grad.reshape(x.shape)])
