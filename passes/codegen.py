"""Writing stage code for people: one Python file per stage, with a header saying what it is."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from rpcompile.core.files import write_atomic
from rpcompile.core.plan import Plan
from rpcompile.core.program import HostEmbedding, Program, StageProgram

__all__ = ["stage_source", "write_stages"]

_KIND_TEXT = {
    "forward": "runs without autograd; hands its outputs to later stages through host memory",
    "fused": "runs forward, the loss and backward in one go; nothing is recomputed",
    "backward": "recomputes this forward from its saved inputs with autograd on, then runs backward",
}


def stage_source(prog: StageProgram, plan: Plan, host: Sequence[HostEmbedding] = ()) -> str:
    """The generated Python of one stage, headed by a comment block (stage, kind, device, nodes, modules; inputs
    the host looks up, :mod:`rpcompile.passes.host`)."""
    s = prog.stage
    n = plan.hardware.device_count
    looked_up = [f"# {h.value}: rows the host looks up, embedding({h.index}, {h.weight}"
                 + (f", padding_idx={h.padding_idx})" if h.padding_idx is not None else ")")
                 for h in host if h.value in prog.inputs]
    header = [
        f"# rpcompile stage {s.name} ({s.kind}), position {prog.index} of {len(plan.stages)}, "
        f"device {prog.index % n} of {n} (round-robin)",
        f"# {_KIND_TEXT[s.kind]}.",
        f"# nodes: {s.nodes[0]} .. {s.nodes[-1]} ({len(s.nodes)} nodes)",
        "# source modules: " + ", ".join(s.modules[:12]) + (f", … (+{len(s.modules) - 12})" if len(s.modules) > 12 else ""),
        f"# inputs: {', '.join(prog.inputs) or '-'}",
        *looked_up,
        f"# outputs: {', '.join(prog.outputs) or '(the model output)'}",
        f"# parameters ({len(set(prog.params.values()))}): " + ", ".join(list(dict.fromkeys(prog.params.values()))[:8])
        + (" …" if len(set(prog.params.values())) > 8 else ""),
        f"# predicted: {s.time_s * 1e3:.3f} ms per microbatch, {s.memory_bytes / 2**20:.1f} MiB peak",
        "# model fingerprint: " + plan.model.digest,
        "",
    ]
    return "\n".join(header) + prog.gm.code.lstrip("\n")


def write_stages(program: Program, plan: Plan, directory: str | os.PathLike) -> list[Path]:
    """Write ``stage_<k>_<name>.py`` for every stage; returns the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for prog in program.stages:
        path = out / f"stage_{prog.index:02d}_{prog.name}.py"
        write_atomic(path, stage_source(prog, plan, program.host))
        paths.append(path)
    return paths
