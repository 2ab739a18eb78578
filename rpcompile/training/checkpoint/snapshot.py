"""What a save holds, taken at the save point, and how it is written as a checkpoint directory.

A :class:`Snapshot` is the model's weights (aliases once, :func:`.weights.untie`), each optimizer's
``state_dict``, the pipeline's state, ``extra`` and an HF model's config, as they are at the save point. Taking it
(:func:`take_snapshot`) copies only what the next ``forward_backward`` may change — the model's buffers (a
BatchNorm's running statistics) — and the containers the optimizer would mutate (its per-parameter state dicts,
the parameter groups a scheduler sets); the parameters and the optimizer's state tensors are referenced. They
change only in an optimizer step: a synchronous save writes them before returning, and a background save
(:mod:`~rpcompile.training.checkpoint.background`) first copies them (:meth:`Snapshot.copy`), with every optimizer step waiting until that copy
is done. :func:`write_snapshot` writes a snapshot as one atomic directory (:mod:`.layout`).
"""

from __future__ import annotations

import copy
import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import torch

from ...core.files import atomic_directory, write_atomic, write_atomic_hashed
from .layout import EXTRA_FILE, MANIFEST, Manifest, optimizer_files
from .pipeline_file import write_pipeline
from .weights import hf_config, untie, write_config, write_weights

__all__ = ["Snapshot", "take_snapshot", "optimizer_states", "config_writer", "hash_file", "write_snapshot"]

ConfigWriter = Callable[[Path], list[str]]


@dataclass
class Snapshot:
    """A checkpoint's content at its save point (module docstring)."""

    step: int
    pipeline: dict[str, Any]
    weights: dict[str, torch.Tensor]
    tied: dict[str, str]
    optimizers: list[dict[str, Any]] | None
    extra: Any = None
    config: ConfigWriter | None = None
    owned: set[int] = field(default_factory=set)
    """``id``\\ s of the tensors that are the snapshot's own already (copies), which :meth:`copy` leaves."""

    def shared(self) -> Iterator[tuple[Any, Any, torch.Tensor]]:
        """``(container, key, tensor)`` of every tensor still shared with training."""
        for name, t in self.weights.items():
            if id(t) not in self.owned:
                yield self.weights, name, t
        for state in self.optimizers or []:
            for entry in state["state"].values():
                for k, v in entry.items():
                    if isinstance(v, torch.Tensor) and id(v) not in self.owned:
                        yield entry, k, v

    def shared_bytes(self) -> int:
        """What :meth:`copy` allocates."""
        seen: set[int] = set()
        total = 0
        for _, _, t in self.shared():
            # by identity: a tensor under two names (tied weights) is copied once
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    def copy(self) -> None:
        """Make every tensor still shared with training the snapshot's own (a clone; aliases stay aliases)."""
        clones: dict[int, torch.Tensor] = {}
        for container, key, t in list(self.shared()):
            if id(t) not in clones:
                clones[id(t)] = t.detach().clone()
                self.owned.add(id(clones[id(t)]))
            container[key] = clones[id(t)]


def optimizer_states(optimizer: Any) -> list[dict[str, Any]] | None:
    """Each optimizer's ``state_dict`` (None for none; a list of optimizers, ``pipe.step([o1, o2])``, each), with
    the containers a later step or scheduler changes made its own (module docstring)."""
    if optimizer is None:
        return None
    out = []
    for o in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]):
        sd = o.state_dict()
        # a scheduler sets lr in the live groups (a tensor lr in place): the save keeps the values as they are now
        groups = [{k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in g.items()}
                  for g in sd["param_groups"]]
        # shallow copies of each parameter's state: a later step may add entries to the live dicts; the tensors in them
        # stay referenced until copy()
        out.append({**sd, "state": {i: dict(entry) for i, entry in sd["state"].items()}, "param_groups": groups})
    return out


def config_writer(model: torch.nn.Module, dtype: torch.dtype | None) -> ConfigWriter | None:
    """A function writing an HF model's config files as they are now (copies are kept), or None for another model."""
    found = hf_config(model)
    if found is None:
        return None
    config, generation = found
    return lambda directory: write_config(directory, config, generation, dtype)


def take_snapshot(*, step: int, model: torch.nn.Module, optimizer: Any, pipeline_state: dict[str, Any],
                  extra: Any) -> Snapshot:
    """The snapshot at this point (module docstring); ``pipeline_state`` and ``extra`` are the caller's copies."""
    state = model.state_dict()
    weights, tied = untie(state, model)
    # by storage: state_dict() holds detached tensors, not the Parameters; empty tensors all share address 0
    params = {p.data_ptr() for p in model.parameters() if p.numel()}
    owned: set[int] = set()
    for name, t in weights.items():
        if t.numel() and t.data_ptr() not in params:  # a buffer: forward_backward may update it
            weights[name] = t.detach().clone()
            owned.add(id(weights[name]))
    owned |= {id(t) for t in pipeline_state["stale_weights"].values()}  # copies already
    # the dtype config.json records (torch_dtype), taken from the weights as save_pretrained takes it
    dtype = next((t.dtype for t in weights.values() if t.is_floating_point()), None)
    return Snapshot(step=step, pipeline=pipeline_state, weights=weights, tied=tied,
                    optimizers=optimizer_states(optimizer), extra=extra, config=config_writer(model, dtype),
                    owned=owned)


def hash_file(path: Path) -> tuple[int, str]:
    """A small file's bytes and sha256 (hex)."""
    data = path.read_bytes()
    return len(data), hashlib.sha256(data).hexdigest()


def _torch_save(obj: Any, f: IO[bytes]) -> None:
    torch.save(obj, f)


def write_snapshot(path: Path, snap: Snapshot, max_shard_bytes: int) -> Manifest:
    """Write ``snap`` as the checkpoint directory ``path``, whole or not at all (module docstring)."""
    with atomic_directory(path) as tmp:
        files = write_weights(tmp, snap.weights, max_shard_bytes)
        for name in snap.config(tmp) if snap.config is not None else []:
            files[name] = hash_file(tmp / name)
        optimizers = snap.optimizers or []
        for name, state in zip(optimizer_files(len(optimizers)), optimizers):
            files[name] = write_atomic_hashed(tmp / name, functools.partial(_torch_save, state))
        files.update(write_pipeline(tmp, snap.pipeline))
        if snap.extra is not None:
            files[EXTRA_FILE] = write_atomic_hashed(tmp / EXTRA_FILE, functools.partial(_torch_save, snap.extra))
        manifest = Manifest(files=files, step=snap.step, tied=snap.tied, optimizers=len(optimizers),
                            extra=snap.extra is not None)
        write_atomic(tmp / MANIFEST, manifest.to_json())
    return manifest
