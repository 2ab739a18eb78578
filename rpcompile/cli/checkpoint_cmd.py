"""``rpcompile checkpoint``: ``verify`` a run's checkpoints (each one whole or what is wrong, read only) and
``convert`` an older ``.ckpt`` file into a checkpoint directory that safetensors and ``from_pretrained`` open
(:mod:`rpcompile.training.checkpoint`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rpcompile.core.errors import ConfigError
from rpcompile.training.checkpoint.layout import checkpoints, verify_path
from rpcompile.training.checkpoint.load import checkpoint_summary
from rpcompile.training.checkpoint.save import convert

from .common import say

__all__ = ["checkpoint_command"]


def checkpoint_command(args: argparse.Namespace) -> int:
    return _convert(args) if args.action == "convert" else _verify(args)


def _convert(args: argparse.Namespace) -> int:
    path = convert(args.old, args.new, max_shard_size=args.max_shard_size)
    say(f"converted {args.old} into {path} ({', '.join(sorted(p.name for p in path.iterdir()))})",
        f"resume with rpcompile.load_checkpoint({str(args.new)!r}, ...); open the weights with "
        "rpcompile.load_weights or safetensors; for from_pretrained, add the model's config there "
        "(model.config.save_pretrained)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    root = Path(args.path)
    if not root.exists():
        raise ConfigError(f"{root}: no such file or directory; give a run's checkpoint directory or one checkpoint")
    # a directory with its own checkpoint.json is one checkpoint; any other directory is a run's, holding several
    found = checkpoints(root) if root.is_dir() and not (root / "checkpoint.json").exists() else [(None, root)]
    if not found:
        raise ConfigError(f"{root} holds no checkpoint (ckpt-<step> directories or .ckpt files)")
    rows, bad = [], 0
    for _, path in found:
        try:
            verify_path(path)
            rows.append({"path": str(path), "ok": True, "about": checkpoint_summary(path)})
        # one bad checkpoint is reported and the others are still verified
        except (ValueError, OSError) as e:
            bad += 1
            rows.append({"path": str(path), "ok": False, "about": f"{path.name}: torn or corrupt ({e})"})
    if args.json:
        print(json.dumps({"checkpoints": rows, "bad": bad}))
    else:
        say(*(f"{'ok ' if r['ok'] else 'BAD'}  {r['about']}" for r in rows))
    return 1 if bad else 0
