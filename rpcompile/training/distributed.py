"""Data parallelism over ``torch.distributed``: one round-robin pipeline per process, gradients summed across them.

Launch one process per machine (``torchrun --nnodes N --nproc-per-node 1 train.py``), each driving that machine's
GPUs; once the script has called ``torch.distributed.init_process_group``, :func:`rpcompile.compile` makes every
process run the same plan on its own shard of the batch (``data_parallel=False`` opts out).

rank
    One such process; rank 0 plans and hands the plan to the others, and every rank checks it runs the same one.
one loss
    Each microbatch's loss weighted by the *whole* batch's count (summed across ranks), so the ranks' gradients
    add up to one process's on the concatenated batch.

Collectives run over gloo on CPU tensors (the gradients live in the host's memory); under an NCCL default group a
gloo group over the same ranks is made for them. :class:`DataParallel` states the contracts (plan, loss,
gradients, dropout, failures).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import torch
import torch.distributed as dist

from rpcompile.runtime import rng
from rpcompile.runtime.reduce import GradReducer
from rpcompile.runtime.weights import GradSink

from ..core.digest import short_digest
from ..core.errors import ConfigError, RPCompileError, first_line, one_line
from ..core.plan import Plan
from ..core.program import Program

__all__ = ["DistributedError", "DataParallel", "RankCalls", "data_parallel_group", "plan_digest", "shard"]


class DistributedError(RPCompileError):
    """Another rank failed or differs, or a collective failed (a rank died, the network, the timeout)."""


def data_parallel_group(data_parallel: bool | None) -> "DataParallel | None":
    """The data-parallel setting ``compile(data_parallel=...)`` asks for: None (the default) runs data-parallel
    when a default process group with more than one rank is initialised; False never; True requires one."""
    up = dist.is_available() and dist.is_initialized()
    if data_parallel is False or (data_parallel is None and (not up or dist.get_world_size() < 2)):
        return None
    if not up:
        raise ConfigError("data_parallel=True but torch.distributed has no process group: call "
                          "torch.distributed.init_process_group(...) first (torchrun sets up its environment), "
                          "or leave data_parallel unset")
    backend = str(dist.get_backend())
    # the collectives here carry CPU tensors (gradients in host memory), which NCCL does not take
    group = dist.group.WORLD if "gloo" in backend else dist.new_group(backend="gloo")
    return DataParallel(group)


def plan_digest(plan: Plan, *, devices: int, precision: str) -> str:
    """A short digest of what a rank runs: the plan (model, hardware, stages, microbatches) and its devices and
    precision — not the solver's statistics, which differ between equal plans."""
    d = plan.to_dict()
    keep = {k: d.get(k) for k in ("model", "hardware", "microbatches", "stages", "precision", "head_chunks", "host")}
    keep["run"] = {"devices": devices, "precision": precision}
    # sorted keys: the same plan serialises to the same bytes on every rank
    return short_digest(json.dumps(keep, sort_keys=True), 12)


class DataParallel:
    """This process's part in data-parallel training over ``group``. The contracts:

    - **One plan.** Rank 0 plans and hands the plan to the others (measured costs differ from machine to machine, and
      the solver's time limits make even analytic plans differ on a loaded machine); a plan given to ``compile`` is
      checked instead. Either way every rank then compares a digest of the plan it runs (and of what it runs it with:
      devices, precision) in one collective, and a rank that differs, or failed to get that far, stops every rank with
      one line naming it.
    - **One loss.** Each microbatch's mean loss is weighted by what it averages over (real tokens of a padded target)
      divided by the *whole* batch's count — summed across ranks first, one small collective — so the ranks' gradients
      add up to those of one process on the concatenated batch, and ``forward_backward`` returns that whole batch's loss
      on every rank.
    - **Gradients** are summed by :class:`rpcompile.runtime.reduce.GradReducer`: buckets launched as soon as the
      backward stages that compute them have landed, overlapping the stages still running; frozen parameters never, tied
      ones once. The optimizer step is the user's, on identical gradients, so the weights stay identical.
    - **Dropout** masks are seeded per (iteration, node, microbatch) as on one machine, salted with the rank
      (:data:`rpcompile.runtime.rng.stream`), so each shard draws its own; rank 0 draws what one process would.
    - **Failures.** A rank whose iteration raises still takes part in the remaining collectives and reports its failure
      in the last one, so every rank raises one line naming it rather than waiting. A rank that dies or hangs is caught
      by the process group's timeout (``init_process_group(timeout=...)``); the survivors raise
      :class:`DistributedError`.
    """

    def __init__(self, group: Any):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.reducer: GradReducer | None = None

    # ------------------------------------------------------------------------------------------ at compile
    def shared_plan(self, make: Callable[[], Any]) -> tuple[Any, Plan]:
        """Rank 0 runs ``make()`` (returns an object with ``.plan``) and sends the plan to every rank; returns
        ``(what make returned on this rank or None, the plan)``. A failure on rank 0 stops every rank."""
        made: Any = None
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                made = make()
                box = [{"plan": made.plan.to_dict()}]
            except Exception as e:  # noqa: BLE001 - sent to the other ranks, then raised here as it was
                box = [{"error": one_line(e)}]
                # the other ranks wait in this broadcast: they get the error, not a hang until the timeout
                self._collective("sending rank 0's plan", dist.broadcast_object_list, box, src=0, group=self.group)
                raise
        self._collective("sending rank 0's plan", dist.broadcast_object_list, box, src=0, group=self.group)
        got = box[0]
        if "error" in got:
            raise DistributedError(f"rank {self.rank}: rank 0 could not plan ({got['error']}); fix that on rank 0, "
                                   "every rank stops")
        return made, Plan.from_dict(got["plan"], source="rank 0's plan")

    def agree(self, digest: "str | None", error: str = "") -> None:
        """Every rank's plan digest compared in one collective (``digest`` None with ``error``: this rank failed
        before it had a plan); raises one line naming the ranks that differ from rank 0 or failed."""
        everyone: list[Any] = [None] * self.world
        self._collective("comparing the ranks' plans", dist.all_gather_object, everyone, (digest, error),
                         group=self.group)
        # a rank that failed has no digest to compare: named first
        failed = [f"rank {r} ({e})" for r, (_, e) in enumerate(everyone) if e]
        if failed:
            raise DistributedError(f"rank {self.rank}: {', '.join(failed)} failed before training; every rank stops")
        # rank 0's is the plan the others were sent (shared_plan)
        base = everyone[0][0]
        differ = [r for r, (d, _) in enumerate(everyone) if d != base]
        if differ:
            ranks = ", ".join(f"rank {r} runs plan {everyone[r][0]}" for r in differ)
            raise DistributedError(f"rank {self.rank}: every rank must run the same plan but {ranks} while rank 0 runs "
                                   f"{base}; give every rank the same plan file, devices and precision (or let rank 0 "
                                   "plan: compile without plan=)")

    def attach(self, program: Program, params: dict[str, torch.nn.Parameter], sink: GradSink) -> None:
        """Reduce ``program``'s gradients as the sink adds them (its listener)."""
        def held(name: str) -> torch.Tensor | None:
            return (sink.private or {}).get(name)

        def put(name: str, g: torch.Tensor) -> None:
            assert sink.private is not None
            sink.private[name] = g

        self.reducer = GradReducer(program, params, self.group, held=held, put=put)
        sink.listener = self.reducer.landed
        rng.stream = f"rank{self.rank}/" if self.rank else ""  # each shard its own dropout masks (rank 0 as alone)

    # ------------------------------------------------------------------------------------------ per call
    def start(self, total: float, error: BaseException | None) -> float:
        """Before a call runs: the whole batch's loss total (summed over the ranks), or one line naming the ranks
        that failed to get here (``error`` on this one: raised after the collective)."""
        out = self._status("starting the iteration", total, error)
        assert self.reducer is not None
        self.reducer.begin()
        return out

    def finish(self, loss: float, error: BaseException | None) -> float:
        """After a call ran (``error``: it raised on this rank): the gradient buckets waited for — launched
        anyway after a failure, so the collectives pair up — then the whole batch's loss, summed over the ranks."""
        assert self.reducer is not None
        try:
            if error is not None:
                # the buckets not launched yet go anyway, so that every rank's all-reduces still pair up
                self.reducer.abort()
            self.reducer.finish()
        except Exception as e:  # noqa: BLE001 - after a failure here, the rank's own failure is what it reports
            if error is None:
                raise self._failed("reducing the gradients", e) from e
        return self._status("finishing the iteration", loss, error)

    def _status(self, what: str, value: float, error: BaseException | None) -> float:
        """One all-reduce of ``[value, rank failed?...]``: the sum of the values, or a one-line error naming
        the ranks that failed (this one re-raises its own error)."""
        # float64: token counts sum exactly (float32 rounds past 2**24); one slot per rank flags a failure, so one
        # all-reduce both sums the value and tells every rank who failed
        t = torch.zeros(1 + self.world, dtype=torch.float64)
        t[0] = value
        t[1 + self.rank] = error is not None
        self._collective(what, dist.all_reduce, t, group=self.group)
        failed = [r for r in range(self.world) if t[1 + r] > 0]
        # raised only after the collective: the other ranks wait in it for this one
        if error is not None:
            raise error
        if failed:
            ranks = ", ".join(f"rank {r}" for r in failed)
            raise DistributedError(f"rank {self.rank}: {ranks} failed while {what} (its own error says why); every "
                                   "rank stops this iteration — its gradients are dropped")
        return float(t[0])

    def _collective(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        # already one line, naming the ranks
        except DistributedError:
            raise
        except Exception as e:  # noqa: BLE001 - gloo's errors (a closed peer, the timeout) in one line
            raise self._failed(what, e) from e

    def _failed(self, what: str, e: BaseException) -> DistributedError:
        first = first_line(e) or type(e).__name__
        return DistributedError(f"rank {self.rank}: {what} failed ({first}): another rank stopped or hangs (its own "
                                "error says why), or the network failed; every rank stops")


class RankCalls:
    """A pipeline's training calls as one rank of :class:`DataParallel` training (``Pipeline.join``): the batch's
    total summed over the ranks before the call runs, its gradients held apart from ``.grad`` (``grads``) until
    they are summed across the ranks, and a failure told to the other ranks in the collective they wait in.
    ``overlapped()``: an overlapped optimizer step is in place, which installs the held gradients itself."""

    def __init__(self, dp: DataParallel, grads: GradSink, overlapped: Callable[[], bool]):
        self.dp, self.grads, self.overlapped = dp, grads, overlapped
        self.phase = "done"  # a call: "before" its first collective, "running", "done"

    def run(self, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``call()`` (one ``forward_backward``); a failure on any rank raises on every rank and drops the call's
        gradients."""
        self.phase = "before"
        try:
            return call()
        except DistributedError:
            self.drop_held()
            raise
        except BaseException as e:  # tell the other ranks, in the collective they wait in, then raise it here
            self.drop_held()
            # the collective the other ranks wait in: the start's if this call failed before reaching it, else the
            # finish's
            if self.phase == "before":
                self.dp.start(0.0, e)
            elif self.phase == "running":
                self.dp.finish(0.0, e)
            raise

    def drop_held(self) -> None:
        """A data-parallel call failed: its gradients (held apart from ``.grad``) are dropped."""
        if self.grads.private is not None:
            # the held buffers remade empty: still held beside an overlapped step (it reads .grad), into .grad otherwise
            self.grads.hold(self.overlapped())

    def global_total(self, total: float) -> float:
        """What the whole batch's mean averages over: this rank's ``total`` summed over the ranks (the call's
        gradients are held apart from ``.grad`` until they are reduced)."""
        total = self.dp.start(total, None)
        self.phase = "running"
        # already held beside an overlapped step: what it holds stays
        if self.grads.private is None:
            self.grads.hold(True)
        return total

    def reduced(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradients summed across the ranks (then into ``.grad``) and the whole batch's loss."""
        total = self.dp.finish(float(loss), None)
        self.phase = "done"  # the call's collectives are over
        # beside an overlapped step the held gradients go into .grad once the step is done (the pipeline installs them)
        if not self.overlapped():
            self.grads.install()
            self.grads.hold(False)
        return torch.tensor(total, dtype=loss.dtype)


def shard(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``batch`` (``tensor_split`` along dim 0: the first ranks take one row more)."""
    return torch.tensor_split(batch, world)[rank]
