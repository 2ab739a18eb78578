"""The per-step record and the timeline as a trace (:mod:`rpcompile.training.metrics`): every ``forward_backward``
is measured into ``pipe.last_step`` and handed to ``pipe.on_step``; ``pipe.export_trace`` writes the timeline in the
Trace Event Format that Perfetto and chrome://tracing open."""

from __future__ import annotations

import json

import pytest
import torch

import rpcompile
from _hf import VOCAB, hf_model, token_loss
from test_runtime import FINE_CPU

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def pipe():
    model = hf_model("llama")
    ids = torch.randint(0, VOCAB, (4, 8))
    return rpcompile.compile(model, (ids,), loss_fn=token_loss, devices=["cpu", "cpu"], microbatches=2,
                             spec=FINE_CPU, time_limit_s=2.0, host_embedding=False)


def test_every_call_is_measured_and_reported(pipe):
    seen = []
    pipe.on_step = seen.append
    ids = torch.randint(0, VOCAB, (4, 8))
    loss = pipe.forward_backward(ids, target=ids)
    (record,) = seen
    assert record is pipe.last_step and record.loss == float(loss) and record.iteration == pipe.iteration
    assert record.tokens == ids.numel() and record.tokens_per_s == pytest.approx(ids.numel() / record.wall_s)
    compute = [e for e in pipe.timeline if e.action.lstrip("0123456789").startswith("F")]
    span = max(e.end for e in pipe.timeline) - min(e.start for e in pipe.timeline)
    assert record.bubble == pytest.approx(1 - sum(e.end - e.start for e in compute) / (2 * span))
    assert sum(record.stage_s.values()) == pytest.approx(sum(e.end - e.start for e in compute))
    assert json.loads(json.dumps(record.to_dict()))["tokens_per_s"] == pytest.approx(record.tokens_per_s)
    pipe.on_step = None


def test_the_timeline_exports_as_a_perfetto_trace(pipe, tmp_path):
    ids = torch.randint(0, VOCAB, (4, 8))
    pipe.forward_backward(ids, target=ids)
    path = pipe.export_trace(tmp_path / "step.json")
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(pipe.timeline)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "device 0", 1: "device 1"}
    for e, t in zip(spans, pipe.timeline):
        assert e["tid"] == t.device and e["args"]["stage"] == t.stage
        assert e["ts"] == pytest.approx(t.start * 1e6, abs=1e-3) and e["dur"] >= 0
    assert {e["cat"] for e in spans} == {"W", "F", "G"}


def test_compile_says_what_it_is_doing_unless_told_not_to(monkeypatch, capsys):
    """``compile(..., progress=True)`` (the default on a terminal) shows each pass on stderr while it runs — the
    solve against its time limit; ``progress=False`` shows nothing."""
    from rpcompile.planner import planning

    shown = []

    class Recording:
        def __init__(self, *columns, **kwargs):
            shown.append([getattr(c, "text_format", "") for c in columns])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def add_task(self, *args, **kwargs):
            return 0

        task_ids, tasks = [0], [type("T", (), {"total": 1.0})()]

        def update(self, *args, **kwargs):
            pass

    monkeypatch.setattr(planning, "Progress", Recording)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(6, 8)
    rpcompile.compile(mlp, (x,), loss_fn=torch.nn.functional.cross_entropy, devices=["cpu"], spec=FINE_CPU,
                      time_limit_s=1.0, progress=False)
    assert shown == []
    rpcompile.compile(mlp, (x,), loss_fn=torch.nn.functional.cross_entropy, devices=["cpu"], spec=FINE_CPU,
                      time_limit_s=1.0, progress=True)
    texts = [t for columns in shown for t in columns if t]
    assert "compile: tracing the model" in texts and "compile: solving the partition" in texts
    assert "(time limit 1 s)" in texts


def test_the_first_calls_captures_show_progress_unless_told_not_to(monkeypatch):
    """A call that captures saved segments shows them on stderr: on the first call one per saved segment against
    that count (hence a time left), at a new shape the captures it makes (one-row microbatches: sizes 0 and 1 are
    specialised; captured at their second sighting), at a shape already captured nothing; ``compile(progress=False)`` shows nothing at all."""
    from rpcompile.training import capture_progress

    shown = []

    class Recording:  # rich's Progress as the display sees it
        def __init__(self, *columns, **kwargs):
            self.task = type("Task", (), {"id": 0, "completed": 0, "total": None})()
            self.tasks = [self.task]
            shown.append(self.task)

        def add_task(self, text, total=None):
            self.task.total = total

        def update(self, task_id, advance=0, total=None):
            self.task.completed += advance
            self.task.total = total

        def start(self):
            pass

        def stop(self):
            self.task.stopped = True

    monkeypatch.setattr(capture_progress, "Progress", Recording)
    ids = torch.randint(0, VOCAB, (4, 8))
    for progress in (False, True):
        shown.clear()
        pipe = rpcompile.compile(hf_model("llama"), (ids,), loss_fn=token_loss, devices=["cpu", "cpu"],
                                 microbatches=2, spec=FINE_CPU, time_limit_s=2.0, progress=progress)
        saved = pipe.program.saved
        assert saved
        pipe.forward_backward(ids, target=ids)
        first = [(t.completed, t.total, t.stopped) for t in shown]
        pipe.forward_backward(ids[:, :6], target=ids[:, :6])  # a new length, the same symbolic capture
        again = len(shown)
        for _ in range(2):  # one-row microbatches: recomputed when first seen, captured when seen again
            pipe.forward_backward(ids[:1], target=ids[:1])
        if not progress:
            assert shown == []
            continue
        assert first == [(len(saved), len(saved), True)]
        assert again == 1 and len(shown) == 2 and shown[1].total is None and shown[1].stopped
        assert shown[1].completed == sum(s.n_captures for s in saved) - len(saved) > 0
