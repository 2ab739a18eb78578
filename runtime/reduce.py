"""Data-parallel gradient reduction: each rank's gradients summed across ranks while its backward still runs.

Under ``torch.distributed`` every rank runs the same plan on its own shard of the batch; the gradients of one
``forward_backward`` are summed over the ranks (each rank's losses are already weighted by the global batch's
total, so the sum is the whole batch's mean gradient). The reduction is a gloo collective over CPU tensors (the
masters' gradients live on the host).

Terms:

- **bucket** (:func:`buckets`): trainable parameters grouped, about ``bucket_bytes`` each, in the order their
  gradients complete; reduced as one flattened ``all_reduce``.
- **landed**: a stage's gradients are all added on the host (:meth:`~GradReducer.landed`); a bucket is complete
  when every stage it waits for has landed.
- **launch order**: buckets are launched strictly by index, so every rank issues the same collectives in the same
  order.

:class:`GradReducer` does the reduction for one call; its docstring gives the rules.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from rpcompile.core.program import Program

__all__ = ["Bucket", "GradReducer", "buckets", "BUCKET_BYTES"]

#: Bucket size: large enough that per-collective latency is small, small enough that the first bucket goes out
#: early (DDP's default is 25 MiB too).
BUCKET_BYTES = 25 << 20


@dataclass
class Bucket:
    """Parameters reduced together, in one flattened collective."""

    names: list[str]
    waits_for: set[Any]
    """Stage indices (and ``"host"``) whose gradients must have landed first."""
    numel: int = 0
    dtype: torch.dtype = torch.float32
    flat: torch.Tensor | None = None
    work: Any = None
    sizes: list[int] = field(default_factory=list)


def buckets(program: Program, params: dict[str, torch.nn.Parameter], *, bucket_bytes: int | None = None,
            ) -> list[Bucket]:
    """The buckets of ``program``'s trainable parameters, in the order their gradients complete (:class:`GradReducer`);
    ``bucket_bytes`` defaults to :data:`BUCKET_BYTES`."""
    bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    events: dict[str, set[Any]] = {}
    order: dict[str, float] = {}
    for prog in program.stages:
        if prog.kind == "forward":
            continue
        for name in dict.fromkeys(prog.params.values()):
            if params[name].requires_grad:
                events.setdefault(name, set()).add(prog.index)
                # grad stages run in index order (FB, B1, ...): the last one that computes a gradient completes it
                order[name] = max(order.get(name, -1.0), prog.index)
    last = max((p.index for p in program.stages), default=0)
    for h in program.host:
        if params[h.weight].requires_grad:
            events.setdefault(h.weight, set()).add("host")
            order[h.weight] = last + 0.5  # after every stage: the host adds the rows once their readers are done
    out: list[Bucket] = []
    for name in sorted(events, key=lambda n: (order[n], n)):  # ties by name: every rank builds the same buckets
        p = params[name]
        b = out[-1] if out else None
        # one flat tensor has one dtype; an empty bucket takes a parameter however large
        if b is None or b.dtype != p.dtype or (b.numel and (b.numel + p.numel()) * p.element_size() > bucket_bytes):
            b = Bucket([], set(), dtype=p.dtype)
            out.append(b)
        b.names.append(name)
        b.sizes.append(p.numel())
        b.numel += p.numel()
        b.waits_for |= events[name]
    return out


class GradReducer:
    """Sums one call's gradients across the ranks of ``group`` bucket by bucket (the module docstring's terms).

    ``held(name)`` gives the call's gradient of a parameter (None if it got none here); ``put(name, g)`` stores
    its reduced sum in its place. ``on_error(what, exc)`` turns a failed collective into the caller's error.

    - **Buckets.** The trainable parameters are grouped into buckets of about ``bucket_bytes`` in the order their
      gradients complete: by the last grad stage (in the schedule's ``FB, B1, B2, …`` order) that computes them; a
      token-embedding table the host looks rows up in (:mod:`rpcompile.passes.rewrite.host`) completes when the host
      thread has added the last microbatch's rows. Frozen parameters are in no bucket; a tied parameter is one
      ``Parameter`` and sits in one bucket, reduced once.
    - **Events.** The gradient sink calls :meth:`~GradReducer.landed` with a stage's index once that stage's gradients
      are all added (:class:`~.weights.GradSink`'s ``listener``); the executor's host thread calls it with ``"host"``
      once the embedding rows are in. A bucket is complete when every stage it waits for has landed.
    - **Order.** Every rank must issue the same collectives in the same order, whatever order its devices happen to
      finish in: buckets are launched strictly by index (a complete bucket waits for the ones before it), each as one
      flattened ``all_reduce(SUM, async_op=True)`` so the network works while the later backward stages run.
      :meth:`~GradReducer.finish` waits for them and hands each parameter its reduced slice.
    - **Only this call's gradients.** The sink holds the call's gradients apart from ``.grad`` while it runs (its
      ``hold`` mode, as for an overlapped step), so what is reduced is this call's contribution alone and gradient
      accumulation over several calls stays correct; the pipeline installs the reduced sums into ``.grad`` after.
    - **Failure.** :meth:`~GradReducer.abort` launches every bucket not launched yet (with whatever it holds) so that
      the ranks' collective sequences stay aligned and a rank that failed can tell the others
      (:mod:`rpcompile.training.distributed`).
    """

    def __init__(self, program: Program, params: dict[str, torch.nn.Parameter], group: Any, *,
                 held: Callable[[str], torch.Tensor | None], put: Callable[[str, torch.Tensor], None],
                 bucket_bytes: int | None = None):
        self.params, self.group, self.held, self.put = params, group, held, put
        self.buckets = buckets(program, params, bucket_bytes=bucket_bytes)
        self._lock = threading.Lock()
        self._landed: set[Any] = set()
        self._next = 0

    def begin(self) -> None:
        """A new call: nothing has landed, nothing is launched."""
        with self._lock:
            self._landed = set()
            self._next = 0
            for b in self.buckets:
                b.flat, b.work = None, None

    def landed(self, event: Any) -> None:
        """Stage ``event``'s gradients (or the host's embedding rows, ``"host"``) are all added: launch every
        complete bucket next in line (on the calling thread: the sink's or the host's)."""
        with self._lock:
            self._landed.add(event)
            # a complete bucket behind an incomplete one waits: buckets go out strictly by index
            while self._next < len(self.buckets) and self.buckets[self._next].waits_for <= self._landed:
                self._launch(self.buckets[self._next])
                self._next += 1

    def abort(self) -> None:
        """The call failed on this rank: launch what is left, as it is, so every rank's collectives still pair up."""
        with self._lock:
            while self._next < len(self.buckets):
                self._launch(self.buckets[self._next])
                self._next += 1

    def finish(self) -> None:
        """Wait for every bucket and give each parameter its reduced gradient (a view into the bucket)."""
        for k, b in enumerate(self.buckets):
            if b.work is None:
                raise RuntimeError(f"gradient bucket {k} of {len(self.buckets)} was never launched "
                                   f"(stages {sorted(map(str, b.waits_for - self._landed))} did not report)")
            b.work.wait()
            assert b.flat is not None
            offset = 0
            for name, n in zip(b.names, b.sizes):
                self.put(name, b.flat[offset:offset + n].view_as(self.params[name]))
                offset += n
            b.flat, b.work = None, None  # the parameters' views keep the memory they need

    @property
    def bytes_per_call(self) -> int:
        """Bytes each rank contributes to the reduction per call (all buckets)."""
        return sum(b.numel * torch.empty((), dtype=b.dtype, device="cpu").element_size() for b in self.buckets)

    def _launch(self, b: Bucket) -> None:
        parts = []
        for name in b.names:
            g = self.held(name)
            # a parameter with no gradient on this rank still takes its place: the ranks' buckets must match
            parts.append(g.reshape(-1) if g is not None else torch.zeros(self.params[name].numel(), dtype=b.dtype, device="cpu"))
        # the all_reduce writes in place: a lone part is cloned so the held gradient itself is not overwritten
        b.flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        b.work = dist.all_reduce(b.flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
