"""Exact save and resume (rpcompile/training/checkpoint/, ``Pipeline.state_dict``): a run resumed from a checkpoint —
in this process or a fresh one after a SIGKILL at a random point, a save included — ends with the weights of an
uninterrupted run bit for bit (fp32 and bf16, dropout, overlapped steps, fp16 loss scaling); a checkpoint torn or
corrupted anywhere is detected and the previous one used; a state that cannot continue exactly is refused in one
line. The formats themselves (safetensors, HF, background saves, the older ``.ckpt``): tests/test_checkpoint_formats.py."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import rpcompile
from rpcompile.core.files import host_name
from rpcompile.training.checkpoint.layout import MANIFEST, checkpoints, verify_path
from rpcompile.training.checkpoint.state import CheckpointWarning
from rpcompile.training.checkpoint.tensorfile import read_file, write_tensors

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _resume  # noqa: E402
from _resume import Net, batch, build, train  # noqa: E402

HELPER = Path(__file__).resolve().parent / "_resume.py"
STEPS = 6


@pytest.fixture(scope="module")
def plan():
    """The plan every run here shares (analytic costs: forward, fused and backward stages on two CPU devices)."""
    _, pipe, _ = build()
    assert [s.kind for s in pipe.plan.stages] == ["forward", "fused", "backward"]
    return pipe.plan


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs by {(got[k].float() - want[k].float()).abs().max():.3g}"


def uninterrupted(plan, steps: int = STEPS, overlap: bool = False, **options) -> dict[str, torch.Tensor]:
    model, pipe, opt = build(plan, **options)
    train(model, pipe, opt, 0, steps, overlap=overlap)
    return weights(model)


def keep_up_to(directory: Path, step: int) -> None:
    """Delete the checkpoints after ``step``: the directory as a run killed after saving ``step`` left it."""
    for s, path in checkpoints(directory):
        if s > step:
            shutil.rmtree(path)


# ---------------------------------------------------------------------------------------------- same process
@pytest.mark.parametrize("precision,overlap,scaler,frozen", [
    ("fp32", False, False, None), ("fp32", True, False, None), ("bf16", True, False, None),
    ("fp16", False, True, None), ("bf16", False, False, "l1")],
    ids=["fp32", "fp32-overlap", "bf16-overlap", "fp16-scaler", "bf16-frozen"])
def test_resume_into_a_fresh_pipeline_is_exact(plan, tmp_path, precision, overlap, scaler, frozen):
    """Saving every step changes nothing; a new model, optimizer and pipeline loaded from step 3's checkpoint
    continue to the uninterrupted run's weights bit for bit — with dropout, with an overlapped step in flight at
    the save (the next iteration is one step stale, as it would have been), with an fp16 GradScaler, and with a
    frozen layer kept only in bf16 (its ``.data`` is the pipeline's copy)."""
    options = dict(precision=precision, scaler=scaler, frozen=frozen)
    if frozen:  # another model fingerprint (requires_grad is part of it): a plan of its own
        plan = build(**options)[1].plan
    want = uninterrupted(plan, overlap=overlap, **options)
    model, pipe, opt = build(plan, **options)
    train(model, pipe, opt, 0, STEPS, overlap=overlap, ckpt=tmp_path, keep=STEPS)
    assert_bitwise(weights(model), want)  # saving did not change training
    keep_up_to(tmp_path, 3)
    model, pipe, opt = build(rpcompile.checkpoint_plan(tmp_path), **options)
    seed, pipe.dropout_seed = pipe.dropout_seed, 12345  # as a process seeded otherwise: the saved seed wins
    resumed = rpcompile.load_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe)
    assert resumed is not None and resumed.step == 3 and pipe.iteration == 3 and pipe.dropout_seed == seed == 0
    assert bool(pipe.state_dict()["stale_weights"]) == overlap  # the step-3 copies the next iteration reads
    if scaler:
        assert pipe.scaler.get_scale() == 2.0 ** 13  # grown once (growth_interval=2), carried over
    if frozen:
        assert model.l1.weight.dtype == torch.bfloat16
    train(model, pipe, opt, 3, STEPS, overlap=overlap)
    assert_bitwise(weights(model), want)


def test_without_the_pipeline_state_dropout_repeats_its_masks(plan, tmp_path):
    """What the pipeline state fixes: the model's and the optimizer's state alone resume at iteration 0, whose
    dropout masks differ — the weights drift (issue 21: 3.9e-2)."""
    want = uninterrupted(plan)
    model, pipe, opt = build(plan)
    train(model, pipe, opt, 0, 3, ckpt=tmp_path)
    model, pipe, opt = build(plan)
    rpcompile.load_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe)
    pipe.iteration = 0
    train(model, pipe, opt, 3, STEPS)
    assert not all(torch.equal(a, want[k]) for k, a in weights(model).items())


def test_resume_on_other_devices_with_the_same_cuts(plan, tmp_path):
    """The devices are not part of the arithmetic: the same cuts on three logical devices continue a
    two-device run bit for bit — nor are the weights that stay on a device (F0 keeps its own for B1 on device 0
    of two; on three, B1 runs elsewhere and uploads them)."""
    want = uninterrupted(plan)
    model, pipe, opt = build(plan)
    train(model, pipe, opt, 0, 3, ckpt=tmp_path)
    assert plan.stages[0].keeps
    moved = tuple(dataclasses.replace(s, keeps=(), finds=(), weight_bytes=s.weight_bytes + s.found_bytes,
                                      found_bytes=0, kept_bytes=0, held_bytes=0) for s in plan.stages)
    three = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, device_count=3), stages=moved)
    model, pipe, opt = build(three, devices=["cpu"] * 3)
    rpcompile.load_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe)
    train(model, pipe, opt, 3, STEPS)
    assert_bitwise(weights(model), want)


# ---------------------------------------------------------------------------------------------- refusals
def test_a_state_that_cannot_continue_exactly_is_refused_in_one_line(plan, tmp_path):
    model, pipe, opt = build(plan)
    train(model, pipe, opt, 0, 1, ckpt=tmp_path)
    state = pipe.state_dict()
    _, bf16, _ = build(plan, precision="bf16")
    with pytest.raises(rpcompile.CheckpointError, match=r"^the pipeline state ran 2 microbatches in fp32, this "
                       r"pipeline runs 2 in bf16; compile with microbatches=2, precision='fp32', or pass exact=False$"):
        bf16.load_state_dict(state)
    torch.manual_seed(0)
    from _resume import loss_fn
    single = rpcompile.compile(Net(), (batch(0)[0],), loss_fn=loss_fn, devices=["cpu"], microbatches=2, spec="cpu",
                               host_embedding=False, time_limit_s=5.0)
    assert [s.kind for s in single.plan.stages] == ["fused"]
    with pytest.raises(rpcompile.CheckpointError, match=r"^the pipeline state was computed with a plan cut otherwise "
                       r"\(cuts \w+, this pipeline's \w+\), which changes the last bits; compile with the plan it "
                       r"was saved with \(plan=rpcompile.checkpoint_plan\(directory\)"):
        single.load_state_dict(state)
    single.load_state_dict(state, exact=False)  # continues, not bit for bit
    assert single.iteration == 1
    other = rpcompile.compile(torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32)),
                              (batch(0)[0],), loss_fn=loss_fn, devices=["cpu"], spec="cpu", time_limit_s=5.0)
    with pytest.raises(rpcompile.CheckpointError, match=r"^the pipeline state is for another graph \(fingerprint "):
        other.load_state_dict(state)
    with pytest.raises(rpcompile.CheckpointError, match=r"^Pipeline.load_state_dict takes what Pipeline.state_dict\(\) "
                       r"returned .*; got OrderedDict$"):
        pipe.load_state_dict(model.state_dict())
    with pytest.raises(rpcompile.CheckpointError, match=r"^the pipeline state has version 99 but this rpcompile "
                       r"reads up to 2; "):
        pipe.load_state_dict({**state, "version": 99})
    older = {k: v for k, v in state.items() if k != "dropout_seed"}  # version 1: saved before the dropout seed
    pipe.load_state_dict({**older, "version": 1})
    assert pipe.dropout_seed is None and pipe.iteration == 1  # it draws the masks it was drawing
    _, scaled, _ = build(plan, scaler=True)
    with pytest.raises(rpcompile.CheckpointError, match=r"^the pipeline state has no GradScaler state but this "
                       r"pipeline has scaler; "):
        scaled.load_state_dict(state)
    # a state saved beside an overlapped step needs its optimizer
    pipe.forward_backward(*batch(1)[:1], target=batch(1)[1])
    pipe.step(opt, overlap=True)
    overlapped = pipe.state_dict()
    assert overlapped["stale_weights"]
    with pytest.raises(rpcompile.CheckpointError, match=r"^this pipeline state was saved right after "
                       r"step\(optimizer, overlap=True\): pass load_state_dict\(state, optimizer=optimizer\)"):
        build(plan)[1].load_state_dict(overlapped)
    # a resume that goes backwards would be shadowed by the newer checkpoint
    with pytest.raises(rpcompile.CheckpointError, match=r"^save_checkpoint: .* already holds ckpt-00000001, "
                       r"newer than step 0: "):
        rpcompile.save_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe, step=0)


def test_model_and_optimizer_that_do_not_fit_are_refused_in_one_line(plan, tmp_path):
    model, pipe, opt = build(plan)
    train(model, pipe, opt, 0, 1, ckpt=tmp_path)
    model, pipe, opt = build(plan)
    with pytest.raises(rpcompile.CheckpointError, match=r"the optimizer's state does not fit this optimizer \("):
        rpcompile.load_checkpoint(tmp_path, model=model, pipeline=pipe,
                                  optimizer=torch.optim.AdamW([{"params": [model.head.weight]},
                                                               {"params": [model.head.bias]}]))


def _untouched(model, pipe, opt) -> tuple[dict[str, torch.Tensor], int]:
    """What a refused load must leave as it was: the weights, the optimizer's state (empty: fresh) and the
    pipeline's iteration."""
    assert not opt.state
    return weights(model), pipe.iteration


def test_an_optimizer_state_that_does_not_fit_changes_nothing(plan, tmp_path):
    """Issue 36: it was refused only after the model's weights had been overwritten."""
    model, pipe, opt = build(plan)
    train(model, pipe, opt, 0, 1, ckpt=tmp_path)
    model, pipe, _ = build(plan)
    two_groups = torch.optim.AdamW([{"params": [p for n, p in model.named_parameters() if n != "head.bias"]},
                                    {"params": [model.head.bias]}])
    before, iteration = _untouched(model, pipe, two_groups)
    with pytest.raises(rpcompile.CheckpointError, match=r"the optimizer's state does not fit this optimizer \(the "
                                                        r"checkpoint holds 1 parameter group\(s\), this optimizer has "
                                                        r"2\)") as info:
        rpcompile.load_checkpoint(tmp_path, model=model, pipeline=pipe, optimizer=two_groups)
    assert "\n" not in str(info.value)
    assert_bitwise(weights(model), before)
    assert not two_groups.state and pipe.iteration == iteration


def _rewrite(path: Path, change) -> None:
    """Change the checkpoint directory ``path`` — ``change(parts)`` edits ``parts``: ``pipeline`` (pipeline.json
    as JSON), ``model`` (model.safetensors' tensors), ``optimizer`` (optimizer.pt's object), ``manifest``
    (checkpoint.json less its digest) — and write it back with sizes, checksums and digest that hold."""
    parts = {"pipeline": json.loads((path / "pipeline.json").read_text()), "model": read_file(path / "model.safetensors")[1],
             "optimizer": torch.load(path / "optimizer.pt", weights_only=True),
             "manifest": {k: v for k, v in json.loads((path / MANIFEST).read_text()).items() if k != "digest"}}
    change(parts)
    files = {}
    if parts["pipeline"] is not None:
        (path / "pipeline.json").write_text(json.dumps(parts["pipeline"]))
        files["pipeline.json"] = path / "pipeline.json"
    else:
        (path / "pipeline.json").unlink()
    with open(path / "model.safetensors", "wb") as f:
        write_tensors(f, parts["model"], {"format": "pt"})
    torch.save(parts["optimizer"], path / "optimizer.pt")
    manifest = parts["manifest"]
    for name in list(manifest["files"]):
        if (path / name).exists():
            data = (path / name).read_bytes()
            manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        else:
            del manifest["files"][name]
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (path / MANIFEST).write_text(json.dumps({**manifest, "digest": digest}))


MALFORMED = {  # issue 36: valid checksums over these raised raw KeyError, AttributeError, ValueError
    "no pipeline state": (lambda p: p.update(pipeline=None), r"its content is malformed \(no pipeline.json\)"),
    "no fingerprint": (lambda p: p["pipeline"].pop("model"), r"the pipeline state is malformed \(no 'model'\)"),
    "stale weights a list of numbers": (lambda p: p["pipeline"].update(stale_weights=[1]),
                                        r"malformed \(pipeline.json: stale_weights is not a list of names\)"),
    "iteration a string": (lambda p: p["pipeline"].update(iteration="3"), r"malformed \(iteration is str '3'\)"),
    "the plan malformed": (lambda p: p["pipeline"]["plan"].update(microbatches=-1),
                           r"malformed \(pipeline.json's plan is corrupt: microbatches: .*\)"),
    "the seed a number": (lambda p: p["pipeline"].update(dropout_seed=7),
                          r"malformed \(pipeline.json: dropout_seed is '7', not a 64-bit seed as text\)"),
    "scaler empty": (lambda p: p["pipeline"].update(scaler={}), r"scaler is not a GradScaler state_dict"),
    "a weight of another shape": (lambda p: p["model"].update({"head.bias": torch.zeros(3)}),
                                  r"the model's state does not fit this model \('head\.bias' is \(3,\), this "
                                  r"model's \(32,\)\)"),
    "a weight of another kind": (lambda p: p["model"].update({"head.bias": torch.zeros(32, dtype=torch.int64)}),
                                 r"does not fit this model \('head\.bias' is torch.int64, this model's torch.float32\)"),
    "a weight missing": (lambda p: p["model"].pop("norm.weight"), r"does not fit this model \(missing 'norm\.weight'"),
    "an unexpected weight": (lambda p: p["model"].update(extra=torch.zeros(1)), r"does not fit this model \(unexpected 'extra'"),
    "optimizer state a string": (lambda p: p.update(optimizer="adam"), r"the optimizer's state does not fit this "
                                                                       r"optimizer \(not an optimizer state_dict\)"),
    "a moment of another shape": (lambda p: p["optimizer"]["state"][0].update(exp_avg=torch.zeros(2)),
                                  r"the optimizer's state does not fit this optimizer \(parameter 0's exp_avg is "
                                  r"\(2,\), the parameter is \(32, 16\)"),
    "a pickled object": (lambda p: p.update(optimizer={"state": {}, "param_groups": [], "x": Net}),
                         r"optimizer.pt: torch.load\(weights_only=True\) refused it \(UnpicklingError"),
    "a tied name unknown": (lambda p: p["manifest"].update(tied={"x": "nowhere"}),
                            r"malformed \(x is tied to nowhere, which no file holds\)"),
}


@pytest.mark.parametrize("change, message", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_payload_is_one_line_and_changes_nothing(plan, tmp_path, change, message):
    model, pipe, opt = build(plan)
    train(model, pipe, opt, 0, 1, ckpt=tmp_path)
    (step, path), = checkpoints(tmp_path)
    _rewrite(path, change)
    verify_path(path)  # whole: sizes and checksums hold
    model, pipe, opt = build(plan)
    before, iteration = _untouched(model, pipe, opt)
    with pytest.raises(rpcompile.CheckpointError, match=message) as info:
        rpcompile.load_checkpoint(tmp_path, model=model, pipeline=pipe, optimizer=opt)
    assert "\n" not in str(info.value)
    assert_bitwise(weights(model), before)
    assert not opt.state and pipe.iteration == iteration


def test_a_save_follows_no_link_planted_where_its_temporary_would_be(plan, tmp_path):
    """Issue 36: the temporary's name was predictable (``.<name>.tmp<pid>``) and opened through a planted link."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    for name in (f".ckpt-00000000.tmp{os.getpid()}", f".plan.json.tmp{os.getpid()}", "ckpt-00000000.tmp"):
        (tmp_path / name).symlink_to(victim)
    room = tmp_path / "room"  # a directory planted at the checkpoint's own name, through a link
    room.mkdir()
    (room / "model.safetensors").write_bytes(b"precious")
    (tmp_path / "ckpt-00000000").symlink_to(room)
    model, pipe, opt = build(plan)
    rpcompile.save_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe)
    assert victim.read_bytes() == b"precious" and (room / "model.safetensors").read_bytes() == b"precious"
    assert (tmp_path / "ckpt-00000000").is_dir() and not (tmp_path / "ckpt-00000000").is_symlink()
    assert rpcompile.load_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe).step == 0


@pytest.mark.parametrize("step", [-1, 1.5, True, "3", None])
def test_a_step_load_checkpoint_would_not_take_is_refused_when_saving(plan, tmp_path, step):
    """Issue 36: step=-1 wrote a file that load_checkpoint then ignored."""
    model, pipe, opt = build(plan)
    if step is None:  # the default, pipeline.iteration, is fine
        path = rpcompile.save_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe)
        assert path.name == "ckpt-00000000"
        return
    with pytest.raises(rpcompile.CheckpointError, match=rf"^save_checkpoint: step={re.escape(repr(step))}; give a "
                                                        r"whole number >= 0 \(load_checkpoint takes the largest\)"):
        rpcompile.save_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe, step=step)
    assert checkpoints(tmp_path) == []


def test_extra_comes_back_and_one_that_would_not_load_is_refused_when_saving(plan, tmp_path):
    model, pipe, opt = build(plan)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, pipe, opt, 0, 1)
    scheduler.step()
    rpcompile.save_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe,
                              extra={"scheduler": scheduler.state_dict(), "batches": 7})
    model, pipe, opt = build(plan)
    resumed = rpcompile.load_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe)
    assert resumed.extra["batches"] == 7 and resumed.step == 1 and opt.param_groups[0]["lr"] == 5e-3
    with pytest.raises(rpcompile.CheckpointError, match=r"^save_checkpoint: extra= would not load back with "
                       r"torch.load\(weights_only=True\) \(UnpicklingError: .*\); keep it to tensors, numbers"):
        rpcompile.save_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe, extra={"data": Net})
    assert [s for s, _ in checkpoints(tmp_path)] == [1]


# ---------------------------------------------------------------------------------------------- torn files
def test_every_truncation_and_bit_flip_is_detected(tmp_path):
    """A checkpoint with any of its files cut at every byte (the manifest: within its JSON), or with one bit
    flipped at every byte, fails its manifest's size, checksum or digest check
    (:func:`rpcompile.training.checkpoint.verify_path`) — before any file is parsed (pipeline.json: a sample)."""
    model = torch.nn.Linear(2, 2)
    pipe = rpcompile.compile(model, (torch.randn(2, 2),), loss_fn=torch.nn.MSELoss(), devices=["cpu"], spec="cpu",
                             time_limit_s=5.0)
    path = rpcompile.save_checkpoint(tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters()),
                                     pipeline=pipe, step=1)
    verify_path(path)
    for file in sorted(path.iterdir()):
        good = file.read_bytes()
        step = max(1, len(good) // 300)  # pipeline.json holds the plan: every byte of the small files, a sample of it
        whole = len(good.rstrip()) if file.name == MANIFEST else len(good)  # its final newline is only whitespace
        for n in range(0, whole, step):
            file.write_bytes(good[:n])
            with pytest.raises(ValueError):
                verify_path(path)
        for i in range(0, len(good), step):
            flipped = bytearray(good)
            flipped[i] ^= 1 << (i % 8)
            file.write_bytes(bytes(flipped))
            with pytest.raises(ValueError):
                verify_path(path)
        file.write_bytes(good)
    verify_path(path)


def test_a_torn_newest_checkpoint_is_skipped_for_the_previous(plan, tmp_path):
    want = uninterrupted(plan)
    model, pipe, opt = build(plan)
    train(model, pipe, opt, 0, 4, ckpt=tmp_path)  # keeps ckpt 3 and 4
    newest = tmp_path / "ckpt-00000004" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:-100])  # torn: the disk lost its tail
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = tmp_path / f".ckpt-00000005.{host_name()}.{int(dead.stdout)}.{'0' * 16}.tmp"
    in_flight = tmp_path / f".ckpt-00000005.{host_name()}.{os.getppid()}.{'1' * 16}.tmp"  # another rank's
    killed.mkdir()  # a save killed midway
    (killed / "model.safetensors").write_bytes(b"half a save")
    in_flight.mkdir()
    model, pipe, opt = build(plan)
    with pytest.warns(CheckpointWarning, match=r"^checkpoint .*ckpt-00000004 is torn or corrupt \(model.safetensors "
                      r"is [\d,]+ bytes where checkpoint.json says [\d,]+ \(truncated\)\); moved to "
                      r"ckpt-00000004.corrupt, trying the previous one$"):
        resumed = rpcompile.load_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe)
    assert resumed.step == 3 and (tmp_path / "ckpt-00000004.corrupt").is_dir()
    train(model, pipe, opt, 3, STEPS, ckpt=tmp_path)
    assert_bitwise(weights(model), want)
    assert list(tmp_path.glob(".ckpt-*")) == [in_flight], "the next save removes what a killed save left, only"
    assert [s for s, _ in checkpoints(tmp_path)] == [STEPS, STEPS - 1]


def test_no_good_checkpoint_is_one_line_and_none_is_a_fresh_start(plan, tmp_path):
    model, pipe, opt = build(plan)
    assert rpcompile.load_checkpoint(tmp_path / "absent", model=model, optimizer=opt, pipeline=pipe) is None
    assert rpcompile.checkpoint_plan(tmp_path / "absent") is None
    train(model, pipe, opt, 0, 2, ckpt=tmp_path)
    for _, path in checkpoints(tmp_path):
        data = bytearray((path / "model.safetensors").read_bytes())
        data[-1] ^= 0xFF
        (path / "model.safetensors").write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with pytest.raises(rpcompile.CheckpointError, match=r"^no good checkpoint in .*: all 2 are torn, corrupt or "
                           r"unreadable \(the corrupt ones moved aside as \*.corrupt\); start afresh or restore one "
                           r"from a backup$"):
            rpcompile.load_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe)


# ---------------------------------------------------------------------------------------------- SIGKILL
class Run:
    """``_resume.main`` in a process of its own: ``spawn`` — a new interpreter (``python tests/_resume.py``) —
    or ``fork`` — forked from multiprocessing's forkserver, which imported torch and rpcompile once and has run
    nothing (a new interpreter spends ~4 s of CPU importing them: the default suite forks, the slow one spawns).
    Either way nothing of an earlier run is in its memory; what it prints goes to ``log``."""

    def __init__(self, how: str, args: list[str], slow_save: str = ""):
        self.log = Path(args[-1])
        if how == "spawn":
            env = dict(os.environ, RESUME_SLOW_SAVE=slow_save)
            self.proc: Any = subprocess.Popen([sys.executable, str(HELPER), *args], env=env,
                                              stderr=subprocess.PIPE, text=True)
        else:
            self.proc = _forkserver().Process(target=_resume.main, args=(args, slow_save))
            self.proc.start()

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def alive(self) -> bool:
        return (self.proc.poll() if isinstance(self.proc, subprocess.Popen) else self.proc.exitcode) is None

    def kill_when(self, marker: str, delay: float, timeout: float = 120.0) -> None:
        """SIGKILL ``delay`` seconds after ``marker`` is printed (at once if the run ended first)."""
        end = time.monotonic() + timeout
        while marker not in self.lines() and self.alive() and time.monotonic() < end:
            time.sleep(0.002)
        time.sleep(delay)
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)

    def wait(self) -> int:
        if isinstance(self.proc, subprocess.Popen):
            _, err = self.proc.communicate(timeout=120)
            assert "Traceback" not in err, err
            return self.proc.returncode
        self.proc.join(120)
        return self.proc.exitcode


@functools.cache
def _forkserver() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "rpcompile.training.pipeline", "rpcompile.training.checkpoint.load", "_resume"])
    return context


def _kill_and_resume(plan_file: Path, want: dict[str, torch.Tensor], root: Path, rep: int, how: str) -> None:
    """One run of the helper killed at a point drawn from ``rep`` — inside a save (its fsyncs made slow, so the
    kill tears it), while training, or anywhere (a save of its own slow) — then a fresh process that resumes
    it, which must end with the uninterrupted run's weights."""
    rng = random.Random(rep)
    ckpt, out = root / f"ckpt{rep}", root / f"out{rep}.pt"
    phase = ("save", "train", "anywhere")[rep % 3]
    k = rng.randint(1, STEPS - 1)
    args = [str(ckpt), str(plan_file), str(STEPS), str(out)]
    killed = Run(how, [*args, str(root / f"killed{rep}.log")], slow_save=f"{k}:1.0")
    marker, delay = {"save": (f"fsync {k}", rng.uniform(0, 0.3)), "train": (f"saved {k}", rng.uniform(0, 0.05)),
                     "anywhere": ("resumed 0", rng.uniform(0, 1))}[phase]
    killed.kill_when(marker, delay)
    code, lines = killed.wait(), killed.lines()
    assert code == -signal.SIGKILL or "done" in lines, (code, lines)
    saved = max((int(x.split()[1]) for x in lines if x.startswith("saved ")), default=0)
    if phase == "save":  # the kill tore save k: its temporary file written, not renamed into place
        assert saved == k - 1 and list(ckpt.glob(".*.tmp*")) and not (ckpt / f"ckpt-{k:08d}").exists(), lines
    resumed = Run(how, [*args, str(root / f"resumed{rep}.log")])
    assert resumed.wait() == 0, resumed.lines()
    start = int(resumed.lines()[0].split()[1])
    assert saved <= start <= saved + 1, (lines, resumed.lines())  # +1: killed between the rename and the print
    assert_bitwise(torch.load(out, weights_only=True), want)


@pytest.fixture(scope="module")
def killed_setup(plan, tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    plan_file = plan.save(root / "plan.json")
    return plan_file, uninterrupted(plan), root


@pytest.mark.parametrize("rep", range(3))
def test_resume_after_sigkill_is_exact(killed_setup, rep):
    """Killed inside a save (the previous checkpoint is used), while training and at a random time: the fresh
    process that resumes ends with the uninterrupted run's weights bit for bit (forked processes)."""
    _kill_and_resume(*killed_setup, rep, "fork")


@pytest.mark.slow
@pytest.mark.parametrize("rep", range(3, 23))
def test_resume_after_sigkill_is_exact_20_more(killed_setup, rep):
    """The same, 20 times more, each process a new interpreter (~10 s each)."""
    _kill_and_resume(*killed_setup, rep, "spawn")
