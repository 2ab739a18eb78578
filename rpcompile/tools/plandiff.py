"""What changed between two plans (``rpcompile diff a.json b.json``), as plain data and as lines for people.

:func:`diff_plans` compares two :class:`~rpcompile.core.plan.Plan`\\ s and returns a :class:`PlanDiff`: only what
changed, section by section (model, header, stage counts, placement per module, activations, prediction).

group
    The partitioner's unit that placement is rolled up to (``rpcompile.passes.rewrite.coarsen``): one level below
    the model's first module list (``layers.7.attn``, ``layers.7`` for the block's own ops) or a top-level module
    (``embed``, ``lm_head``). A plan keeps each stage's modules but not which node came from which module, so
    placement is computed per group; nodes stay the ground truth (:func:`diff_plans`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from ..core.plan import Plan, Stage
from rpcompile.core.units import fmt_bytes

__all__ = ["diff_plans", "model_differences", "PlanDiff", "Change", "Move", "Nodes", "ActivationChange", "StageChange",
           "THRESHOLD"]

THRESHOLD = 0.005
"""A predicted figure (iteration time, bubble, peak memory, a stage's time or memory) is reported when it changed
by more than this fraction of itself."""
_NUMERIC = re.compile(r"^\d+$")


@dataclass(frozen=True)
class Change:
    """One figure that differs: ``what`` names it (``"devices"``, ``"iteration time"``…), ``a`` and ``b`` are the
    raw values (seconds, bytes, fractions, names)."""

    what: str
    a: Any
    b: Any


@dataclass(frozen=True)
class Move:
    """Modules whose stages changed alike: ``label`` (``layers.8–11``) covers ``modules`` (groups, in order);
    ``a`` and ``b`` are the stages holding them in each plan (empty: not in that plan)."""

    label: str
    modules: tuple[str, ...]
    a: tuple[str, ...]
    b: tuple[str, ...]


@dataclass(frozen=True)
class Nodes:
    """Node names in topological order, and the stretches of topological neighbours among them."""

    names: tuple[str, ...]
    runs: tuple[tuple[str, str], ...]
    """(first, last) of each stretch; first == last for a lone node."""

    def __len__(self) -> int:
        return len(self.names)


@dataclass(frozen=True)
class ActivationChange:
    """Nodes whose backward treatment went from ``a`` to ``b``: ``saved`` (uploaded from host memory),
    ``recomputed``, ``fused`` (run in ``FB``) or ``absent``."""

    a: str
    b: str
    nodes: Nodes


@dataclass(frozen=True)
class StageChange:
    """A stage in both plans whose time per microbatch or memory changed by more than :data:`THRESHOLD`;
    an unchanged figure is ``None``, a changed one ``(a, b)``."""

    stage: str
    time_s: tuple[float, float] | None
    memory_bytes: tuple[int, int] | None


@dataclass(frozen=True)
class PlanDiff:
    """The differences between plan ``a`` and plan ``b``; empty sections: no change. In this order:

    - **model**: plans for different models (said first, in capitals). "The same model" is
      :func:`model_differences`: the same parameters, and the same graph unless the plans
      split the LM head (``head_chunks``) or host embedding lookups differently — which the header then reports;
    - **header**: hardware (device count, spec, memory, host link), microbatches, strategy, precision, cost model,
      tokens per microbatch, the embedding lookups the host runs, the LM head's chunks, resident weights;
    - **stage counts**: forward stages ``F0..`` and backward stages ``B1..`` (the fused stage ``FB`` is always one);
    - **placement, per module**, forward and backward separately: which stages hold each module. The forward placement
      looks at the forward stages and ``FB``, the backward placement at ``FB`` and the backward stages; a module in two
      stages reads ``F3+F4``;
    - **activations**: nodes whose backward treatment changed — ``saved`` (uploaded from host memory), ``recomputed`` or
      ``fused`` (run in ``FB``: neither);
    - **prediction**: iteration time, bubble fraction, peak memory and the weight bytes uploaded per iteration (less
      where weights stay on their device), then each stage's time per microbatch and memory (stages in both plans), each
      where it changed by more than 0.5 %.
    """

    a_name: str
    b_name: str
    model: tuple[str, ...]
    """Fingerprint differences (empty when both plans are for the same model)."""
    header: tuple[Change, ...]
    stage_counts: tuple[Change, ...]
    forward: tuple[Move, ...]
    backward: tuple[Move, ...]
    forward_nodes: Nodes
    """Nodes whose forward stage changed (same model only)."""
    backward_nodes: Nodes
    """Nodes whose backward stage changed (same model only)."""
    activations: tuple[ActivationChange, ...]
    predicted: tuple[Change, ...]
    stages: tuple[StageChange, ...]

    @property
    def changed(self) -> bool:
        return any((self.model, self.header, self.stage_counts, self.forward, self.backward, self.forward_nodes,
                    self.backward_nodes, self.activations, self.predicted, self.stages))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (tuples become lists)."""
        return {"changed": self.changed, **asdict(self)}

    def lines(self, *, max_rows: int = 8) -> list[str]:
        """Plain text for a terminal or a CI log; each list shows at most ``max_rows`` rows (neighbouring stages
        whose figures changed alike share one: ``B1–B3``). Times are all in ms, or all in s when one of them
        reaches a second."""
        if not self.changed:
            return ["plans are identical"]
        times = [abs(v) for c in self.predicted if c.what == "iteration time" for v in (c.a, c.b)]
        times += [abs(v) for s in self.stages if s.time_s for v in s.time_s]
        # one unit for every time in the report, so figures compare by eye
        unit = "s" if max(times, default=0.0) >= 1 else "ms"
        out = [f"{self.a_name} → {self.b_name}"]
        if self.model:
            out += ["DIFFERENT MODELS: the plans are for different models; only module placement is compared",
                    "  " + "; ".join(self.model)]
        out += [_change_line(c, unit) for c in self.header]
        if self.stage_counts:
            out.append("; ".join(_change_line(c, unit) for c in self.stage_counts))
        for kind, moves, nodes in (("forward", self.forward, self.forward_nodes),
                                   ("backward", self.backward, self.backward_nodes)):
            if moves or nodes:
                count = f" ({len(nodes)} node{'s' * (len(nodes) != 1)} changed stage)" if nodes else ""
                out.append(f"{kind} placement{count}:")
                rows = [f"{m.label}: {_stages(m.a)} → {_stages(m.b)}" for m in moves] or [
                    f"nodes: {_runs(nodes)} (their modules' stages did not change)"]
                out += _capped(rows, max_rows)
        if self.activations:
            out.append("activations in the backward pass:")
            out += _capped([f"{c.a} → {c.b}: {len(c.nodes)} node{'s' * (len(c.nodes) != 1)}: {_runs(c.nodes)}"
                            for c in self.activations], max_rows)
        if self.predicted:
            out.append("prediction:")
            out += ["  " + _change_line(c, unit) for c in self.predicted]
        if self.stages:
            out.append("stages (time per microbatch, memory):")
            runs: list[tuple[str, str, str]] = []  # first stage, last stage, text; alike neighbours share a row
            for s in self.stages:
                parts = [f"time {_times(*s.time_s, unit)}"] if s.time_s else []
                parts += [f"memory {_bytes(*s.memory_bytes)}"] if s.memory_bytes else []
                text = "; ".join(parts)
                # a row grows only over the next stage of the same kind (F2 then F3) with the same change
                if runs and runs[-1][2] == text and _next_stage(runs[-1][1]) == s.stage:
                    runs[-1] = (runs[-1][0], s.stage, text)
                else:
                    runs.append((s.stage, s.stage, text))
            out += _capped([f"{x}{'' if x == y else '–' + y}: {text}" for x, y, text in runs], max_rows)
        return out


# ---- comparing -------------------------------------------------------------------------------------------------
def model_differences(a: Plan, b: Plan) -> list[str]:
    """Why plans ``a`` and ``b`` are not for the same model; empty when they are. A plan's fingerprint is that of the
    graph it was planned from (its LM head split as ``head_chunks``, its ``host`` lookups on the host), so two plans
    are for the same model when their parameters match and their graphs match or differ only where the plans split
    the LM head or host lookups differently."""
    if a.model == b.model:
        return []
    params = a.model.params_digest == b.model.params_digest
    planned_apart = a.head_chunks != b.head_chunks or tuple(a.host) != tuple(b.host)
    # same parameters, and the graphs differ where the plans chose to rewrite them differently: the same model
    if params and planned_apart:
        return []
    # the fingerprints differ in a way differences() does not name: still say something
    return a.model.differences(b.model) or ["fingerprints differ"]


def diff_plans(a: Plan, b: Plan, *, a_name: str = "a", b_name: str = "b") -> PlanDiff:
    """Compare plan ``a`` (before) with plan ``b`` (after); ``a_name`` and ``b_name`` (file names, say) head the
    lines.

    Granularity. A plan keeps node names and each stage's source modules (``Stage.modules``, innermost module paths) but
    not which node came from which module, so placement is computed from ``Stage.modules`` and rolled up to the
    partitioner's *groups* (``rpcompile.passes.rewrite.coarsen``): one level below the model's first module list
    (``layers.7.attn``, ``layers.7.mlp_norm``, ``layers.7`` for the block's own ops such as residual adds) or a
    top-level module (``embed``, ``lm_head``, ``(root)``). A block whose groups all moved alike is reported as the block
    (``layers.7``), and consecutive modules that moved alike share a line (``layers.8–11: F3 → F4``). A block's own ops
    are left out when other parts of the same block moved (they follow their neighbours). Nodes stay the ground truth:
    each placement section counts the nodes that changed stage, and lists them when no module moved; activation changes
    are listed per node, as runs in topological order (``a … b``). When the models differ only the module placement is
    compared, since node names then mean different things. Solver statistics, the solver's bound and the per-stage
    transfer figures are not compared.
    """
    why = model_differences(a, b)
    same_model = not why
    depth = _list_depth(m for p in (a, b) for s in p.stages for m in s.modules)
    moves: dict[str, tuple[Move, ...]] = {}
    nodes: dict[str, Nodes] = {}
    order = {n: i for i, n in enumerate(_order(a, b))}
    for kind in ("forward", "backward"):
        moves[kind] = _moves(_placement(a, kind, depth), _placement(b, kind, depth), _units(b, a, depth), depth)
        # node names mean the same node only within one model
        nodes[kind] = _moved_nodes(a, b, kind, order) if same_model else Nodes((), ())
    return PlanDiff(
        a_name=a_name,
        b_name=b_name,
        model=tuple(why),
        header=_header(a, b),
        stage_counts=_changes(("forward stages", len(a.forward_stages), len(b.forward_stages)),
                              ("backward stages", len(a.backward_stages), len(b.backward_stages))),
        forward=moves["forward"],
        backward=moves["backward"],
        forward_nodes=nodes["forward"],
        backward_nodes=nodes["backward"],
        activations=_activations(a, b, order) if same_model else (),
        predicted=_predicted(a, b),
        stages=_stage_changes(a, b),
    )


def _changes(*items: tuple[str, Any, Any]) -> tuple[Change, ...]:
    return tuple(Change(what, x, y) for what, x, y in items if x != y)


def _header(a: Plan, b: Plan) -> tuple[Change, ...]:
    ha, hb = a.hardware, b.hardware
    spec: list[tuple[str, Any, Any]] = [("device spec", ha.spec.name, hb.spec.name)]
    if ha.spec.name == hb.spec.name and ha.spec != hb.spec:  # same name, edited figures: name the fields
        da, db = ha.spec.to_dict(), hb.spec.to_dict()
        fields = [k for k in da if da[k] != db.get(k)]
        spec = [(f"device spec {ha.spec.name}", {k: da[k] for k in fields}, {k: db.get(k) for k in fields})]
    return _changes(
        ("devices", ha.device_count, hb.device_count),
        *spec,
        ("memory per device", ha.memory_bytes, hb.memory_bytes),
        ("host link", ha.link_bytes_per_s, hb.link_bytes_per_s),
        ("microbatches", a.microbatches, b.microbatches),
        ("tokens per microbatch", a.tokens_per_microbatch, b.tokens_per_microbatch),
        ("strategy", a.strategy, b.strategy),
        ("precision", a.precision, b.precision),
        ("cost model", a.cost_model or "(unknown)", b.cost_model or "(unknown)"),
        ("on the host", ", ".join(a.host) or "(nothing)", ", ".join(b.host) or "(nothing)"),
        ("LM head chunks", a.head_chunks, b.head_chunks),
        ("weights resident", a.resident, b.resident),
    )


def _predicted(a: Plan, b: Plan) -> tuple[Change, ...]:
    pa, pb = a.predicted, b.predicted
    items = [("iteration time", pa.iteration_time_s, pb.iteration_time_s),
             ("bubble", pa.bubble_fraction, pb.bubble_fraction),
             ("peak memory", pa.peak_memory_bytes, pb.peak_memory_bytes),
             ("weights up per iteration", sum(s.weight_bytes for s in a.stages), sum(s.weight_bytes for s in b.stages))]
    return tuple(Change(what, x, y) for what, x, y in items if _rel(x, y) > THRESHOLD)


def _stage_changes(a: Plan, b: Plan) -> tuple[StageChange, ...]:
    before = {s.name: s for s in a.stages}
    out = []
    for sb in b.stages:
        sa = before.get(sb.name)
        if sa is None:
            continue
        t = (sa.time_s, sb.time_s) if _rel(sa.time_s, sb.time_s) > THRESHOLD else None
        m = (sa.memory_bytes, sb.memory_bytes) if _rel(sa.memory_bytes, sb.memory_bytes) > THRESHOLD else None
        if t or m:
            out.append(StageChange(sb.name, t, m))
    return tuple(out)


def _rel(x: float, y: float) -> float:
    # relative to the larger magnitude: symmetric in x and y, and no 0/0 when both are zero
    return abs(y - x) / max(abs(x), abs(y)) if x != y else 0.0


# ---- module placement ------------------------------------------------------------------------------------------
def _list_depth(paths: Iterable[str]) -> int:
    """Depth of the model's first module list (``layers.3`` → 2), as ``coarsen`` finds it; 1 without one."""
    depths = [i + 1 for p in paths for i, part in enumerate(p.split(".")) if _NUMERIC.match(part)]
    return min(depths, default=1)


def _container(path: str, depth: int) -> str | None:
    """The block a module belongs to (``layers.7``), or None for a module outside the module list."""
    parts = path.split(".")
    return ".".join(parts[:depth]) if len(parts) >= depth and _NUMERIC.match(parts[depth - 1]) else None


def _unit(path: str, depth: int) -> str:
    """The group (see the module docstring) that module ``path`` belongs to."""
    if path in ("", "(root)"):
        return "(root)"
    parts = path.split(".")
    # inside a block the group is one level below it (layers.7.attn); outside the list, the top-level module
    return ".".join(parts[: depth + 1] if _container(path, depth) else parts[:depth])


def _stages_of(plan: Plan, kind: str) -> list[Stage]:
    fused = [plan.fused_stage] if plan.fused_stage is not None else []
    return [*plan.forward_stages, *fused] if kind == "forward" else [*fused, *plan.backward_stages]


def _placement(plan: Plan, kind: str, depth: int) -> dict[str, tuple[str, ...]]:
    """Group → the stages (execution order) holding it, over the forward or the backward stages."""
    out: dict[str, dict[str, None]] = {}
    for s in _stages_of(plan, kind):
        for m in s.modules:
            # a dict as an ordered set: each stage once, in execution order
            out.setdefault(_unit(m, depth), {})[s.name] = None
    return {u: tuple(names) for u, names in out.items()}


def _units(first: Plan, second: Plan, depth: int) -> list[str]:
    """Every group in forward order (``first``'s order, then groups only ``second`` has)."""
    return list(dict.fromkeys(_unit(m, depth) for p in (first, second) for s in _stages_of(p, "forward")
                              for m in s.modules))


def _moves(pa: dict[str, tuple[str, ...]], pb: dict[str, tuple[str, ...]], units: Sequence[str],
           depth: int) -> tuple[Move, ...]:
    """Placement changes, rolled up to blocks and merged across neighbours that moved alike."""
    # 1. one item per block that moved as a whole, per other moved group, None for an unchanged stretch
    items: list[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None] = []
    k = 0
    while k < len(units):
        block = _container(units[k], depth)
        j = k + 1
        # units are in forward order, so a block's groups sit together: j ends past the last of them
        while block is not None and j < len(units) and _container(units[j], depth) == block:
            j += 1
        group = [(u, pa.get(u, ()), pb.get(u, ())) for u in units[k:j]]
        moved = [g for g in group if g[1] != g[2]]
        # reported as the block only when every group of it moved, and all from the same stages to the same stages
        if block is not None and len(moved) == len(group) and len({g[1:] for g in moved}) == 1:
            items.append((block, tuple(units[k:j]), moved[0][1], moved[0][2]))
        else:
            for u, x, y in group:
                if u == block and len(moved) > 1:
                    continue  # the block's own ops (residual adds) follow the parts that moved
                # None marks an unchanged group: it keeps step 2 from merging the moves on either side of it
                items.append((u if u != block else f"{u} (own ops)", (u,), x, y) if x != y else None)
        k = j
    # 2. merge neighbours that moved alike
    runs: list[list[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]]] = []
    previous = None
    for item in items:
        if item is not None and previous is not None and item[2:] == previous[2:]:
            runs[-1].append(item)
        elif item is not None:
            runs.append([item])
        # None included: an unchanged stretch ends a run
        previous = item
    return tuple(Move(_label([r[0] for r in run]), tuple(u for r in run for u in r[1]), run[0][2], run[0][3])
                 for run in runs)


def _label(names: Sequence[str]) -> str:
    """Names of neighbouring modules, compressed: blocks ``layers.8``, ``layers.9``, ``layers.10`` →
    ``layers.8–10``; parts of one block ``layers.4.attn_norm``, ``layers.4.attn`` → ``layers.4.{attn_norm,attn}``;
    more than three pieces → ``first … last``."""
    pieces: list[tuple[str, list[Any]]] = []  # ("range", [prefix, lo, hi]) | ("parts", [block, leaves]) | ("name", [name])
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        kind, last = pieces[-1] if pieces else ("", [])
        if _NUMERIC.match(leaf):
            if kind == "range" and last[0] == prefix and last[2] + 1 == int(leaf):
                last[2] = int(leaf)
            else:
                pieces.append(("range", [prefix, int(leaf), int(leaf)]))
        # a name whose parent is a list index (layers.4.attn): a part of that block
        elif _NUMERIC.match(prefix.rpartition(".")[2]):
            if kind == "parts" and last[0] == prefix:
                last[1].append(leaf)
            else:
                pieces.append(("parts", [prefix, [leaf]]))
        else:
            pieces.append(("name", [name]))
    text = []
    for kind, p in pieces:
        if kind == "range":
            text.append(f"{p[0]}.{p[1]}" + (f"–{p[2]}" if p[2] != p[1] else ""))
        elif kind == "parts":
            text.append(f"{p[0]}.{p[1][0]}" if len(p[1]) == 1 else f"{p[0]}.{{{','.join(p[1])}}}")
        else:
            text.append(p[0])
    return ", ".join(text) if len(text) <= 3 else f"{text[0]} … {text[-1]}"


# ---- nodes -----------------------------------------------------------------------------------------------------
def _node_stage(plan: Plan, kind: str) -> dict[str, str]:
    return {n: s.name for s in _stages_of(plan, kind) for n in s.nodes}


def _order(a: Plan, b: Plan) -> list[str]:
    """Every node in topological order (``b``'s, then nodes only ``a`` has)."""
    # the forward and fused stages hold every node once, in topological order (verify_plan's rules 4 and 6)
    return list(dict.fromkeys(n for p in (b, a) for s in _stages_of(p, "forward") for n in s.nodes))


def _nodes(names: Sequence[str], order: dict[str, int]) -> Nodes:
    """``names`` (already in topological order) with their runs of neighbours."""
    runs: list[list[str]] = []
    for n in names:
        if runs and order[n] == order[runs[-1][1]] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return Nodes(tuple(names), tuple((x, y) for x, y in runs))


def _moved_nodes(a: Plan, b: Plan, kind: str, order: dict[str, int]) -> Nodes:
    sa, sb = _node_stage(a, kind), _node_stage(b, kind)
    return _nodes([n for n in order if n in sa and n in sb and sa[n] != sb[n]], order)


def _treatment(plan: Plan) -> dict[str, str]:
    """Node → how its backward runs: ``fused``, ``saved`` or ``recomputed``."""
    out: dict[str, str] = {}
    for s in _stages_of(plan, "backward"):
        saved = set(s.saved)
        out.update((n, "fused" if s.kind == "fused" else "saved" if n in saved else "recomputed") for n in s.nodes)
    return out


def _activations(a: Plan, b: Plan, order: dict[str, int]) -> tuple[ActivationChange, ...]:
    ta, tb = _treatment(a), _treatment(b)
    by_change: dict[tuple[str, str], list[str]] = {}
    for n in order:
        x, y = ta.get(n, "absent"), tb.get(n, "absent")
        if x != y:
            by_change.setdefault((x, y), []).append(n)
    return tuple(ActivationChange(x, y, _nodes(nodes, order)) for (x, y), nodes in by_change.items())


# ---- text ------------------------------------------------------------------------------------------------------
def _stages(names: Sequence[str]) -> str:
    return "+".join(names) or "—"


def _runs(nodes: Nodes, limit: int = 3) -> str:
    """``a … b, c, d … e`` (at most ``limit`` runs, then how many more)."""
    text = [first if first == last else f"{first} … {last}" for first, last in nodes.runs[:limit]]
    more = len(nodes.runs) - limit
    return ", ".join(text) + (f" and {more} more run{'s' * (more != 1)}" if more > 0 else "")


def _next_stage(name: str) -> str:
    """``F2`` → ``F3``, ``B1`` → ``B2`` (``FB`` has no neighbour of its kind)."""
    return f"{name[0]}{int(name[1:]) + 1}" if name[1:].isdigit() else ""


def _pct(x: float, y: float) -> str:
    if x == 0:
        return ""
    p = (y - x) / abs(x) * 100
    return f" ({'+' if p >= 0 else '−'}{abs(p):.1f}%)"


def _times(x: float, y: float, unit: str) -> str:
    scale = 1.0 if unit == "s" else 1e3
    return f"{x * scale:.3f} {unit} → {y * scale:.3f} {unit}{_pct(x, y)}"


def _bytes(x: int, y: int) -> str:
    return f"{fmt_bytes(x)} → {fmt_bytes(y)}{_pct(x, y)}"


def _change_line(c: Change, unit: str) -> str:
    if c.what == "iteration time":
        return f"iteration time {_times(c.a, c.b, unit)}"
    if c.what == "bubble":
        return f"bubble {c.a:.1%} → {c.b:.1%} ({'+' if c.b >= c.a else '−'}{abs(c.b - c.a) * 100:.1f} pp)"
    if c.what in ("peak memory", "memory per device", "weights up per iteration"):
        return f"{c.what} {_bytes(c.a, c.b)}"
    if c.what == "host link":
        return f"host link {c.a / 1e9:.1f} GB/s → {c.b / 1e9:.1f} GB/s"
    if isinstance(c.a, dict):  # an edited device spec
        return f"{c.what}: " + ", ".join(f"{k} {c.a[k]} → {c.b[k]}" for k in c.a)
    return f"{c.what} {c.a} → {c.b}"


def _capped(rows: list[str], limit: int) -> list[str]:
    # the note takes the last row, so a list never shows more than limit rows
    shown = rows if len(rows) <= limit else rows[: limit - 1] + [f"… {len(rows) - limit + 1} more (--json lists all)"]
    return ["  " + r for r in shown]
