"""A model's weights as HF ``save_pretrained`` lays them out, read back into any model without a pipeline.

weight files
    The model's ``state_dict`` as safetensors (:mod:`.tensorfile`): one ``model.safetensors``, or shards and
    ``model.safetensors.index.json`` above ``max_shard_size`` (:func:`write_weights`); an HF model also gets its
    ``config.json`` (:func:`write_config`), so ``AutoModelForCausalLM.from_pretrained(directory)`` builds it.
tied weights
    One tensor under several names (``lm_head.weight`` and ``model.embed_tokens.weight``): written once, as HF
    does, the dropped names listed in ``tied`` (dropped → kept; :func:`untie`).
reading
    :func:`~rpcompile.load_weights` and :func:`read_weights` read a directory rpcompile or ``save_pretrained``
    wrote, checking everything against the model before anything is copied into it (all or nothing).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import IO, Any, Iterable, Mapping

import torch

from ...core.files import read_json, write_atomic_hashed
from ...core.text import printable
from .state import CheckpointError
from .tensorfile import read_file, write_tensors

__all__ = ["WEIGHTS_NAME", "INDEX_NAME", "DEFAULT_SHARD_SIZE", "parse_size", "untie", "shards", "write_weights",
           "hf_config", "write_config", "weight_files", "read_weights", "weights_problem", "apply_weights", "fill_aliases"]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_SIZE = 5 * 10**9  # 5 GB in decimal units: huggingface_hub's default
_SHARD = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors$")
_MAX_INDEX_BYTES = 256 << 20
_METADATA = {"format": "pt"}
"""What HF writes in every shard's ``__metadata__`` (``from_pretrained`` checks ``format``)."""
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}

Written = dict[str, tuple[int, str]]
"""File name → (bytes, sha256 hex) of each file written into a checkpoint directory."""


def parse_size(size: int | str) -> int:
    """``max_shard_size`` as bytes: an int, or ``"5GB"``, ``"500MB"``, ``"2GiB"`` (decimal and binary units, as
    HF reads them)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if m is None or float(m[1]) <= 0:
        raise CheckpointError(f"max_shard_size={size!r}; give bytes (an int > 0) or a size such as '5GB' or '2GiB'")
    return int(float(m[1]) * _UNITS[m[2]])


# ---------------------------------------------------------------------------------------------- writing
def _tied_patterns(model: torch.nn.Module | None) -> list[str]:
    """The names HF models declare tied to another (each submodule's ``_tied_weights_keys``, prefixed)."""
    if model is None:
        return []
    found = []
    for prefix, module in model.named_modules():
        keys = getattr(module, "_tied_weights_keys", None) or ()
        found += [f"{prefix}.{k}" if prefix else str(k) for k in keys]  # a dict's keys (v5) or a list (v4)
    return found


def untie(state: Mapping[str, Any], model: torch.nn.Module | None = None
          ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``state`` with each alias (the same tensor under several names) once, and ``tied``: dropped name → kept
    name. Refuses a non-tensor entry (a module's ``_extra_state``) in one line.

    **Tied weights** (one tensor under several names, e.g. ``lm_head.weight`` and ``model.embed_tokens.weight``):
    safetensors holds no aliases, so each is written once, as HF does: the names a module declares tied
    (``_tied_weights_keys``, matched as HF matches them) are dropped in favour of the one they are tied to; other
    aliases keep their first name in ``state_dict`` order. What was dropped is listed (``tied``: dropped → kept), and
    :func:`~rpcompile.load_weights` fills a dropped name from the one kept — as does ``from_pretrained``, which ties
    them again.
    """
    bad = next((k for k, v in state.items() if not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        raise CheckpointError(f"the model's state_dict holds {printable(bad, limit=80)!r}, a "
                              f"{type(state[bad]).__name__} and not a tensor: safetensors holds tensors only; save "
                              "such a model's state with torch.save")
    groups: dict[tuple, list[str]] = {}
    for name, t in state.items():
        # an alias is the same storage seen the same way (device, address, dtype, shape, strides); empty tensors all
        # have address 0, so each stands alone
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if t.numel() else ("empty", name)
        groups.setdefault(key, []).append(name)
    patterns = _tied_patterns(model)
    tied: dict[str, str] = {}
    for names in groups.values():
        if len(names) < 2:
            continue
        declared = [n for n in names if any(re.search(p, n) for p in patterns)]
        # the one the others are declared tied to; where every name is declared (or none), the first
        kept = next((n for n in names if n not in declared), names[0])
        tied.update({n: kept for n in names if n != kept})
    return {k: v for k, v in state.items() if k not in tied}, tied


def shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """The names in each shard: filled in order up to ``max_bytes`` of data, a larger tensor alone."""
    out: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        # a shard is never left empty: a tensor above the limit goes alone into one
        if out[-1] and size + n > max_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return out


def _write_shard(f: IO[bytes], *, tensors: Mapping[str, torch.Tensor]) -> None:
    write_tensors(f, tensors, _METADATA)


def _shard_names(count: int) -> list[str]:
    return [WEIGHTS_NAME] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_weights(directory: Path, tensors: Mapping[str, torch.Tensor], max_bytes: int) -> Written:
    """Write ``tensors`` (aliases removed: :func:`untie`) into ``directory`` as ``model.safetensors`` or shards
    and their index, each file through :func:`~rpcompile.core.files.write_atomic`; stale shards of an earlier save there are removed.
    Returns each file's bytes and sha256.

    The model's ``state_dict`` (fp32 masters, buffers; frozen parameters in the dtype they are kept in) as safetensors
    (:mod:`.tensorfile`, metadata ``{"format": "pt"}``): one ``model.safetensors``, or — above ``max_shard_size``
    (default ``"5GB"``, as ``huggingface_hub`` splits) — shards ``model-00001-of-00003.safetensors`` filled in the
    ``state_dict``'s order (a tensor larger than the limit alone in its shard) and ``model.safetensors.index.json``:
    ``{"metadata": {"total_size": bytes}, "weight_map": {name: shard}}``, each tensor's shard, written as HF writes it.
    """
    groups = shards(tensors, max_bytes)
    names = _shard_names(len(groups))
    written: Written = {}
    for name, group in zip(names, groups):
        part = {k: tensors[k] for k in group}
        written[name] = write_atomic_hashed(directory / name, functools.partial(_write_shard, tensors=part))
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: name for name, group in zip(names, groups) for k in group}}
        written[INDEX_NAME] = write_atomic_hashed(directory / INDEX_NAME,
                                                  json.dumps(index, indent=2, sort_keys=True) + "\n")
    for stale in directory.iterdir():  # shards of an earlier, differently sharded save (as save_pretrained does)
        if (stale.name == WEIGHTS_NAME or _SHARD.match(stale.name) or stale.name == INDEX_NAME) \
                and stale.name not in written:
            stale.unlink(missing_ok=True)
    return written


def hf_config(model: torch.nn.Module) -> tuple[Any, Any] | None:
    """Copies of an HF model's ``config`` and, when it generates, its ``generation_config``; None for a model
    without one (a ``config`` with no ``save_pretrained``)."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return None
    # copies: the dtype and architectures set on them (and a background save's later write) leave the model's alone
    config = copy.deepcopy(config)
    config.architectures = [type(model).__name__]
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    generates = generation is not None and callable(can_generate) and bool(can_generate())
    return config, copy.deepcopy(generation) if generates else None


def write_config(directory: Path, config: Any, generation_config: Any, dtype: torch.dtype | None) -> list[str]:
    """An HF model's ``config.json`` (and ``generation_config.json``) in ``directory`` (:func:`hf_config`'s copies), as
    ``save_pretrained`` writes them; the files written. An HF model (one whose ``config`` has ``save_pretrained``) also
    gets its ``config.json`` — written by its own ``config.save_pretrained``, with ``architectures`` and the weights'
    dtype set as ``save_pretrained`` sets them — and ``generation_config.json`` when it generates, so
    ``AutoModelForCausalLM.from_pretrained(directory)`` builds it.
    """
    if dtype is not None:
        # newer transformers call the field dtype, older ones torch_dtype
        setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", str(dtype).split(".")[1])
    config.save_pretrained(str(directory))
    files = ["config.json"]
    if generation_config is not None:
        generation_config.save_pretrained(str(directory))
        files.append("generation_config.json")
    return [f for f in files if (directory / f).is_file()]


# ---------------------------------------------------------------------------------------------- reading
def weight_files(directory: Path) -> dict[str, list[str] | None]:
    """Each safetensors file of the weights in ``directory`` → the names its index puts there (None: no index,
    the single ``model.safetensors``); ValueError (one line) for a malformed index."""
    index = directory / INDEX_NAME
    if not index.is_file():
        if not (directory / WEIGHTS_NAME).is_file():
            raise ValueError(f"neither {WEIGHTS_NAME} nor {INDEX_NAME}")
        return {WEIGHTS_NAME: None}
    try:
        obj = read_json(index, max_bytes=_MAX_INDEX_BYTES, max_depth=3, what="a safetensors index")
    except ValueError as e:
        raise ValueError(f"{INDEX_NAME}: {e}") from None
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{INDEX_NAME} has no weight_map of tensor names to files")
    files: dict[str, list[str] | None] = {}
    for name, file in weight_map.items():
        # a plain file of this directory: an index must not send the reader elsewhere (a path, "..")
        if not isinstance(file, str) or not _FILE_NAME.match(file):
            raise ValueError(f"{INDEX_NAME} puts {printable(name, limit=80)} in {printable(file, limit=80)!r}, "
                             "not a safetensors file of this directory")
        files.setdefault(file, []).append(name)  # type: ignore[union-attr]  # lists until returned
    return files


def read_weights(directory: Path, tied: Mapping[str, str] | None = None,
                 listed: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of the weights in ``directory`` (checked), dropped aliases filled from
    ``tied`` (dropped → kept); ``listed``: the files a manifest vouches for, outside which nothing is read.
    ValueError (one line, naming the file) for a malformed one.

    Reads a directory that rpcompile wrote (its manifest's checksums are checked first, :mod:`.layout`), the newest good
    checkpoint of a run's directory, or any directory ``save_pretrained`` wrote; every header is checked
    (:mod:`.tensorfile`), the index against the shards' headers, and the names, shapes and dtypes against the model
    before anything is copied into it (all or nothing).
    """
    state: dict[str, torch.Tensor] = {}
    files = weight_files(directory)
    if listed is not None:
        # the index too when it is there: a manifest that does not list it never checksummed it
        unlisted = next((f for f in [*files, *([INDEX_NAME] if INDEX_NAME not in files and
                                               (directory / INDEX_NAME).is_file() else [])]
                         if f not in set(listed)), None)
        if unlisted is not None:
            raise ValueError(f"{unlisted} is not among the files checkpoint.json vouches for")
    for file, names in files.items():
        header, tensors = read_file(directory / file)
        if names is not None and set(names) != set(header.names()):
            odd = sorted(set(names) ^ set(header.names()))[0]
            raise ValueError(f"{INDEX_NAME} and {file} disagree on tensor {printable(odd, limit=80)}")
        clash = next((n for n in tensors if n in state), None)
        if clash is not None:
            raise ValueError(f"tensor {printable(clash, limit=80)} is in two files")
        state.update(tensors)
    for dropped, kept in (tied or {}).items():
        if kept not in state:
            raise ValueError(f"{printable(dropped, limit=80)} is tied to {printable(kept, limit=80)}, which no file "
                             "holds")
        # the same tensor under both names, as the model held it
        state[dropped] = state[kept]
    return state


def _kind(dtype: torch.dtype) -> str:
    # load_state_dict casts between float dtypes; integer and bool tensors (quantized data, masks) must match
    return "float" if dtype.is_floating_point or dtype.is_complex else str(dtype)


def weights_problem(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True) -> str | None:
    """What does not fit ``model`` in ``state`` — a name missing or unexpected (where ``strict``), a shape, a dtype that
    does not cast — in a few words, or None. A float weight loads into a float parameter of another float dtype cast, as
    ``load_state_dict`` casts; an integer or boolean one must match.
    """
    mine = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    if strict:
        missing, unexpected = [k for k in mine if k not in state], [k for k in state if k not in mine]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            return f"missing {printable(missing[0], limit=80)!r}{more}"
        if unexpected:
            more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
            return f"unexpected {printable(unexpected[0], limit=80)!r}{more}"
    for k, t in state.items():
        if k not in mine:
            continue
        if tuple(t.shape) != tuple(mine[k].shape):
            return f"{printable(k, limit=80)!r} is {tuple(t.shape)}, this model's {tuple(mine[k].shape)}"
        if _kind(t.dtype) != _kind(mine[k].dtype):
            return f"{printable(k, limit=80)!r} is {t.dtype}, this model's {mine[k].dtype}"
    return None


def apply_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """``model.load_state_dict`` of ``state`` (checked already), only the names the model has unless ``strict``."""
    if not strict:
        names = set(model.state_dict())
        state = {k: v for k, v in state.items() if k in names}
    model.load_state_dict(state, strict=strict)


def fill_aliases(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Add to ``state`` each name of ``model`` that it lacks but whose tensor is an alias of one it has (a tied
    weight, dropped when written; a directory ``save_pretrained`` wrote lists none)."""
    # empty tensors all have address 0: none is an alias of another
    mine = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and v.numel()}
    by_alias: dict[tuple, str] = {}
    for k, v in mine.items():
        key = (v.device, v.data_ptr(), v.dtype, tuple(v.shape), v.stride())
        if k in state:
            by_alias.setdefault(key, k)
    for k, v in mine.items():
        key = (v.device, v.data_ptr(), v.dtype, tuple(v.shape), v.stride())
        if k not in state and key in by_alias:
            state[k] = state[by_alias[key]]
