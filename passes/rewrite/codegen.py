"""Writing stage code for people: one Python file per stage, with a header saying what it is."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

from rpcompile.core.files import write_atomic
from rpcompile.core.plan import Plan
from rpcompile.core.program import HostEmbedding, Program, StageProgram
from rpcompile.core.text import printable

__all__ = ["stage_source", "write_stages"]

_KIND_TEXT = {
    "forward": "runs without autograd; hands its outputs to later stages through host memory",
    "fused": "runs forward, the loss and backward in one go; nothing is recomputed",
    "backward": "recomputes this forward from its saved inputs with autograd on, then runs backward",
}


def stage_source(prog: StageProgram, plan: Plan, host: Sequence[HostEmbedding] = ()) -> str:
    """The generated Python of one stage, headed by a comment block (stage, kind, device, nodes, modules; inputs
    the host looks up, :mod:`rpcompile.passes.rewrite.host`). Every name in the header is :func:`~rpcompile.core.text.printable` (one line
    whatever the plan says: nothing from a plan file becomes code)."""
    s = prog.stage
    n = plan.hardware.device_count
    looked_up = [f"# {printable(h.value)}: rows the host looks up, embedding({printable(h.index)}, "
                 f"{printable(h.weight)}" + (f", padding_idx={h.padding_idx})" if h.padding_idx is not None else ")")
                 for h in host if h.value in prog.inputs]
    # attribute -> canonical name: a tied weight read under two attributes is listed once
    params = list(dict.fromkeys(prog.params.values()))
    header = [
        f"# rpcompile stage {printable(s.name)} ({printable(s.kind)}), position {prog.index} of {len(plan.stages)}, "
        f"device {prog.index % n} of {n} (round-robin)",
        f"# {_KIND_TEXT.get(s.kind, '')}.",
        f"# nodes: {printable(s.nodes[0])} .. {printable(s.nodes[-1])} ({len(s.nodes)} nodes)",
        "# source modules: " + _names(s.modules[:12])
        + (f", … (+{len(s.modules) - 12})" if len(s.modules) > 12 else ""),
        f"# inputs: {_names(prog.inputs) or '-'}",
        *looked_up,
        f"# outputs: {_names(prog.outputs) or '(the model output)'}",
        f"# parameters ({len(params)}): " + _names(params[:8]) + (" …" if len(params) > 8 else ""),
        f"# predicted: {s.time_s * 1e3:.3f} ms per microbatch, {s.memory_bytes / 2**20:.1f} MiB peak",
        "# model fingerprint: " + printable(plan.model.digest),
        "",
    ]
    return "\n".join(header) + _prologue(prog) + prog.gm.code.lstrip("\n")


def _prologue(prog: StageProgram) -> str:
    """The stage's prologue as code (:mod:`.dequantize`), said to run once per stage: what its ``forward`` reads as
    ``self.…_dequantized``."""
    if prog.prologue is None:
        return ""
    # renamed so that the file does not read as two forwards
    code = prog.prologue.code.lstrip("\n").replace("def forward(self)", "def prologue(self)", 1)
    return ("# once per stage, when its weights are up (before its first microbatch, without autograd): the\n"
            f"# {len(prog.derived)} dequantized weights it returns are held until the stage ends, read by forward as\n"
            "# self.<packed weight>_dequantized\n" + code + "\n")


def _names(xs: Sequence[object]) -> str:
    return ", ".join(printable(x) for x in xs)


def write_stages(program: Program, plan: Plan, directory: str | os.PathLike) -> list[Path]:
    """Write ``stage_<k>_<name>.py`` for every stage (the name's other characters than letters, digits and ``_``
    as ``_``: a name never leaves ``directory``); returns the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for prog in program.stages:
        # the index keeps the names unique and the files in stage order; the name part is capped at 40 characters
        path = out / f"stage_{prog.index:02d}_{re.sub(r'[^A-Za-z0-9_]', '_', prog.name)[:40]}.py"
        write_atomic(path, stage_source(prog, plan, program.host))
        paths.append(path)
    return paths
