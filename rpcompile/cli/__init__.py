"""The ``rpcompile`` command line: ``profile`` (cost table of a model), ``plan``, ``simulate``, ``demo`` (the main job).

MODEL is a built-in name (``rpcompile models``) or ``path/to/file.py:factory`` where ``factory()``
returns ``(model, example_inputs)``. Every error rpcompile anticipates — a bad argument included — prints one line
that says what to do and exits 2. Steps that take more than a moment show a progress line on a terminal (never
under ``--json``, nor when stderr is not a terminal, as in CI).

Modules: :mod:`.parser` (commands and options) with :mod:`.argtypes` (option parsing); one module per group of
commands (:mod:`.model_cmds`: profile, models, demo; :mod:`.plan_cmd`; :mod:`.simulate_cmd`; :mod:`.plan_file_cmds`:
check, diff, show; :mod:`.probe_cmd`; :mod:`.cache_cmd`; :mod:`.checkpoint_cmd`), sharing :mod:`.common` (progress, output paths) and :mod:`.loading` (the MODEL argument).
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import cast

from rpcompile.core.errors import RPCompileError, first_line
from rpcompile.core.text import printable

from .parser import build_parser

__all__ = ["main", "COMMANDS"]

COMMANDS = {
    "profile": "model_cmds:profile_command", "models": "model_cmds:models_command", "demo": "model_cmds:demo_command",
    "plan": "plan_cmd:plan_command", "simulate": "simulate_cmd:simulate_command",
    "check": "plan_file_cmds:check_command", "diff": "plan_file_cmds:diff_command",
    "show": "plan_file_cmds:show_command",
    "probe": "probe_cmd:probe_command", "cache": "cache_cmd:cache_command",
    "checkpoint": "checkpoint_cmd:checkpoint_command",
}
"""Each command → ``module:function`` (in this package) that runs it and returns the exit status."""


def _command(name: str) -> Callable[..., int]:
    """The function that runs command ``name``, its module imported now.

    Lazy on purpose: every command module imports torch (seconds), so ``rpcompile --help``, ``--version`` and a
    mistyped option answer at once, without it.
    """
    module, _, function = COMMANDS[name].partition(":")
    return cast("Callable[..., int]", getattr(importlib.import_module(f"{__name__}.{module}"), function))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` asks for (default: this process's command line) and return its exit status."""
    own = argv is None  # the process's own command line (the console script, ``python -m``): it exits next
    status = _main(argv, own)
    if own:
        _freeze()
    return status


def _freeze() -> None:
    """Keep the garbage collector off what lives until the process exits (a process running its own command
    line only): its full collections walk every object, torch's modules and the command's graphs and caches
    included. Frozen once the command's module is imported and again after it ran, ``rpcompile plan llama-8b``
    spends ~0.2 s less in the collections it runs and ~0.5 s less in the interpreter's exit (the 2-core reference
    machine); frozen objects are still freed as the process ends."""
    gc.freeze()


def _main(argv: Sequence[str] | None, own: bool = False) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        command = _command(args.command)
        if own:
            _freeze()
        return int(command(args) or 0)
    except RPCompileError as e:
        print(f"rpcompile: error: {printable(e)}", file=sys.stderr)  # names from files: one line, no escapes
        return 2
    except KeyboardInterrupt:
        print("rpcompile: interrupted", file=sys.stderr)
        # 128 + SIGINT: the status a shell reports for a command stopped by Ctrl-C
        return 130
    except BrokenPipeError:  # `rpcompile ... | head`: the reader left; say nothing more
        # stdout to /dev/null: the interpreter's flush of stdout at exit would hit the closed pipe again and complain
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # not anticipated: still one line, the traceback behind -v
        if args.verbose:
            raise
        text = printable(first_line(e), limit=400)
        print(f"rpcompile: error: {type(e).__name__}{': ' + text if text else ''} (unexpected: rerun with -v for the "
              "traceback, and please report it)", file=sys.stderr)
        return 2
