"""Checkpoints in the ecosystem's formats (issue 38 item 2; rpcompile/training/checkpoint/): an HF Llama trained on
two logical CPU devices is saved as safetensors that a process which never imports rpcompile opens with
``safetensors`` and ``from_pretrained`` (sharded with HF's index, tied weights once), resumes bit for bit, loads into
a plain model with no pipeline; a background save overlaps training steps and writes the very files a synchronous
save would; a torn or corrupted shard is refused in one line; the older ``.ckpt`` files still load and convert."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import rpcompile
from rpcompile.cli import main
from rpcompile.training.checkpoint import background, snapshot
from rpcompile.training.checkpoint import save as saving
from rpcompile.training.checkpoint.layout import checkpoints
from rpcompile.training.checkpoint.state import CheckpointWarning
from rpcompile.training.checkpoint.legacy import write_legacy

from _hf import VOCAB, token_loss
from _resume import Net, build, train
from test_checkpoint import assert_bitwise, weights
from test_runtime import FINE_CPU

STEPS = 5


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v.clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()
            if isinstance(v, torch.Tensor)}


# ---------------------------------------------------------------------------------------------- an HF Llama
def llama(tied: bool = False, dropout: float = 0.0) -> torch.nn.Module:
    """A two-layer HF Llama from a config (tests/_hf.py's shape), seeded; ``tied``: its LM head is its embedding."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied, attention_dropout=dropout))


def hf_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, VOCAB, (4, 8), generator=g), torch.randint(0, VOCAB, (4, 8), generator=g)


def hf_run(plan=None, **kw):
    model = llama(**kw)
    options = dict(plan=plan) if plan is not None else dict(spec=FINE_CPU, microbatches=2, time_limit_s=1.0)
    pipe = rpcompile.compile(model, (hf_batch(0)[0],), loss_fn=token_loss, devices=["cpu", "cpu"], **options)
    return model, pipe, torch.optim.AdamW(model.parameters(), lr=1e-2)


def hf_train(model, pipe, opt, start: int, stop: int) -> None:
    for step in range(start, stop):
        x, y = hf_batch(step)
        pipe.forward_backward(x, target=y)
        pipe.step(opt)


OUTSIDE = r'''
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
import transformers

directory, want_file = Path(sys.argv[1]), sys.argv[2]
want = torch.load(want_file, weights_only=True)
index = directory / "model.safetensors.index.json"
files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
tensors = {}
for f in files:
    tensors.update(load_file(directory / f))
model = transformers.AutoModelForCausalLM.from_pretrained(directory)
loaded = model.state_dict()
tied = model.config.tie_word_embeddings
for name, t in want.items():
    source = "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
    assert torch.equal(tensors[source], t), ("safetensors", name)
    assert torch.equal(loaded[name], t), ("from_pretrained", name)
assert tied == (model.lm_head.weight is model.model.embed_tokens.weight)
assert not any(m == "rpcompile" or m.startswith("rpcompile.") for m in sys.modules)
print("ok", len(files), len(tensors), model.dtype)
'''


@pytest.mark.hf
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_hf_llama_checkpoint_opens_without_rpcompile(tmp_path, tied):
    """Trained 3 steps and saved in shards of at most 20 kB: the index names each tensor's shard as HF's does
    (``total_size`` the bytes of the tensors), a tied LM head is written once, and a process that never imports
    rpcompile gets the trained tensors from ``safetensors.torch.load_file`` and from
    ``AutoModelForCausalLM.from_pretrained(directory)`` — as from :func:`rpcompile.save_weights`' directory."""
    model, pipe, opt = hf_run(tied=tied)
    hf_train(model, pipe, opt, 0, 3)
    path = rpcompile.save_checkpoint(tmp_path / "run", model=model, optimizer=opt, pipeline=pipe,
                                     max_shard_size=20_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    names = set(model.state_dict()) - ({"lm_head.weight"} if tied else set())
    assert set(index["weight_map"]) == names and index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for k, t in model.state_dict().items() if k in names)
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    manifest = json.loads((path / "checkpoint.json").read_text())
    assert manifest["tied"] == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] == tied
    want = tmp_path / "want.pt"
    torch.save(weights(model), want)
    exported = rpcompile.save_weights(tmp_path / "export", model)
    for directory in (path, exported):
        done = subprocess.run([sys.executable, "-c", OUTSIDE, str(directory), str(want)], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]


@pytest.mark.hf
def test_an_hf_llama_resumes_bit_for_bit_and_loads_into_a_plain_model(tmp_path):
    """With attention dropout (masks seeded by the pipeline's state): 3 steps, saved, a fresh model, optimizer
    and pipeline from the checkpoint's plan, 2 more steps — the weights and the optimizer's state equal an
    uninterrupted run's bit for bit. The saved weights load into an uncompiled model (no pipeline) exactly."""
    model, pipe, opt = hf_run(dropout=0.25)
    hf_train(model, pipe, opt, 0, STEPS)
    want, want_opt = weights(model), optimizer_tensors(opt)
    model, pipe, opt = hf_run(pipe.plan, dropout=0.25)
    hf_train(model, pipe, opt, 0, 3)
    rpcompile.save_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe, extra={"batches": 3})
    saved = weights(model)
    model, pipe, opt = hf_run(rpcompile.checkpoint_plan(tmp_path), dropout=0.25)
    resumed = rpcompile.load_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe)
    assert resumed.step == 3 and resumed.extra == {"batches": 3} and pipe.iteration == 3
    hf_train(model, pipe, opt, resumed.extra["batches"], STEPS)
    assert_bitwise(weights(model), want)
    assert_bitwise(optimizer_tensors(opt), want_opt)
    plain = llama(dropout=0.25)
    assert rpcompile.load_weights(tmp_path, plain) == tmp_path / "ckpt-00000003"
    assert_bitwise(weights(plain), saved)


def test_weights_load_into_a_plain_model_from_any_layout(tmp_path):
    """``load_weights`` needs no pipeline: from a run's directory (its newest good checkpoint), one checkpoint,
    a ``save_weights`` directory, a lone ``.safetensors`` file; names, shapes and dtypes are checked first and a
    model that does not fit is refused in one line, changing nothing (``strict=False``: the names both have)."""
    model, pipe, opt = build()
    train(model, pipe, opt, 0, 2, ckpt=tmp_path / "run")
    want = weights(model)
    rpcompile.save_weights(tmp_path / "export", model)
    for source in (tmp_path / "run", tmp_path / "run" / "ckpt-00000002", tmp_path / "export",
                   tmp_path / "export" / "model.safetensors"):
        fresh = Net()
        rpcompile.load_weights(source, fresh)
        assert_bitwise(weights(fresh), want)
    other = torch.nn.Sequential(torch.nn.Linear(16, 16))
    before = weights(other)
    with pytest.raises(rpcompile.CheckpointError, match=r"^.*ckpt-00000002: the weights do not fit this model "
                       r"\(missing '0.weight' and 1 more\); load them into the model they were saved from, or "
                       r"pass strict=False$"):
        rpcompile.load_weights(tmp_path / "run", other)
    assert_bitwise(weights(other), before)
    smaller = Net()
    smaller.head = torch.nn.Linear(16, 8)
    with pytest.raises(rpcompile.CheckpointError, match=r"\('head.weight' is \(32, 16\), this model's \(8, 16\)\)"):
        rpcompile.load_weights(tmp_path / "run", smaller, strict=False)
    part = torch.nn.Module()
    part.norm = torch.nn.LayerNorm(16)
    rpcompile.load_weights(tmp_path / "run", part, strict=False)
    assert torch.equal(part.norm.weight, want["norm.weight"])


# ---------------------------------------------------------------------------------------------- background
def _slow(monkeypatch, copy_s: float, write_s: float) -> None:
    """Make a background save's copy and write take at least these times (so steps land inside them)."""
    copy, write = snapshot.Snapshot.copy, snapshot.write_snapshot

    def slow_copy(self):
        time.sleep(copy_s)
        copy(self)

    def slow_write(*args, **kwargs):
        time.sleep(write_s)
        return write(*args, **kwargs)

    monkeypatch.setattr(snapshot.Snapshot, "copy", slow_copy)
    monkeypatch.setattr(saving, "write_snapshot", slow_write)


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous-steps", "overlapped-steps"])
def test_a_background_save_writes_what_a_synchronous_one_would(tmp_path, monkeypatch, overlap):
    """Two runs save at step 2 — one synchronously, one in the background and trains on at once, its steps
    landing inside the save (the copy made slow: they wait for it; the write made slow: they overlap it). Both
    write the same files byte for byte (the weights and optimizer state at the save point, the data position in
    ``extra``), and saving in the background changed nothing of training."""
    model, pipe, opt = build()
    train(model, pipe, opt, 0, 2, overlap=overlap)
    sync = rpcompile.save_checkpoint(tmp_path / "sync", model=model, optimizer=opt, pipeline=pipe,
                                     extra={"batches": 2})
    train(model, pipe, opt, 2, STEPS, overlap=overlap)
    want = weights(model)
    _slow(monkeypatch, copy_s=0.3, write_s=2.0)
    model, pipe, opt = build(pipe.plan)
    train(model, pipe, opt, 0, 2, overlap=overlap)
    position = {"batches": 2}
    pending = rpcompile.save_checkpoint(tmp_path / "bg", model=model, optimizer=opt, pipeline=pipe, extra=position,
                                        background=True)
    position["batches"] = 99  # the save holds a copy
    train(model, pipe, opt, 2, STEPS, overlap=overlap)
    assert not pending.done(), "the steps ran while the save was writing"
    assert pending.wait() == tmp_path / "bg" / "ckpt-00000002" and pending.done()
    assert_bitwise(weights(model), want)
    files = sorted(p.name for p in sync.iterdir())
    assert files == sorted(p.name for p in pending.path.iterdir())
    for name in files:
        assert (sync / name).read_bytes() == (pending.path / name).read_bytes(), name
    fresh, fresh_pipe, fresh_opt = build(pipe.plan)
    assert rpcompile.load_checkpoint(tmp_path / "bg", model=fresh, optimizer=fresh_opt,
                                     pipeline=fresh_pipe).extra == {"batches": 2}


def test_a_failed_background_save_is_told_and_raised_in_one_line(tmp_path, monkeypatch):
    """A write that fails (a full disk) warns when it fails; ``wait()`` and the next save into the directory
    raise it in one line; the one after that saves; the previous checkpoint is intact throughout."""
    model, pipe, opt = build()
    train(model, pipe, opt, 0, 1, ckpt=tmp_path)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saving, "write_snapshot", full)
    train(model, pipe, opt, 1, 2)
    with pytest.warns(CheckpointWarning, match=r"^background save of .*ckpt-00000002 failed \(OSError: \[Errno 28\] "
                      r"No space left on device\); the checkpoints before it are intact$"):
        pending = rpcompile.save_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe, background=True)
        while not pending.done():
            time.sleep(0.01)
    with pytest.raises(rpcompile.CheckpointError, match=r"^the background save of .*ckpt-00000002 failed "
                       r"\(OSError: .*\); the checkpoints before it are intact: free the disk") as info:
        rpcompile.save_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe)
    assert "\n" not in str(info.value)
    assert [s for s, _ in checkpoints(tmp_path)] == [1]
    monkeypatch.undo()
    assert rpcompile.save_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe).name == "ckpt-00000002"


def test_a_background_save_the_host_cannot_hold_is_refused_in_one_line(tmp_path, monkeypatch):
    model, pipe, opt = build()
    train(model, pipe, opt, 0, 1)
    monkeypatch.setattr(background, "available_memory", lambda: 1024)
    with pytest.raises(rpcompile.CheckpointError, match=r"^save_checkpoint\(background=True\) copies [\d.]+ GiB of "
                       r"weights and optimizer state but the host has 0.0 GiB available; save with background=False"):
        rpcompile.save_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe, background=True)
    assert checkpoints(tmp_path) == []


def test_an_optimizer_step_elsewhere_waits_for_the_copy(tmp_path, monkeypatch):
    """An HF Trainer steps its optimizer itself, not through ``pipe.step``: every optimizer step in the process
    waits until the background save's copy is done (a global step pre-hook), so the save still holds the weights
    of its save point."""
    model, pipe, opt = build()
    train(model, pipe, opt, 0, 1)
    at_save = weights(model)
    _slow(monkeypatch, copy_s=0.5, write_s=0.0)
    pending = rpcompile.save_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe, background=True)
    stepped = threading.Event()
    worker = threading.Thread(target=lambda: (opt.step(), stepped.set()))
    with torch.no_grad():
        for p in model.parameters():
            p.grad = torch.ones_like(p)
    worker.start()
    time.sleep(0.2)
    assert not stepped.is_set() and not pending.copied.is_set()
    worker.join()
    pending.wait()
    fresh = Net()
    rpcompile.load_weights(tmp_path, fresh)
    assert_bitwise(weights(fresh), at_save)


# ---------------------------------------------------------------------------------------------- damaged files
def test_a_truncated_or_corrupted_shard_is_refused_in_one_line(tmp_path, capsys):
    """A shard cut short or with a bit flipped: ``load_weights`` refuses the checkpoint in one line naming the
    shard and the fix (its manifest's size or sha256), as it does a directory without a manifest (HF's) by its
    header; ``load_checkpoint`` warns and resumes from the previous one; ``rpcompile checkpoint verify`` lists it
    and exits 1 — never a traceback."""
    model, pipe, opt = build()
    train(model, pipe, opt, 0, 2, ckpt=tmp_path, keep=2)
    newest = tmp_path / "ckpt-00000002"
    shard = newest / "model.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[:-40])
    with pytest.raises(rpcompile.CheckpointError, match=r"^.*ckpt-00000002 is torn or corrupt \(model.safetensors is "
                       r"[\d,]+ bytes where checkpoint.json says [\d,]+ \(truncated\)\); copy it again or load an "
                       r"earlier checkpoint \(rpcompile checkpoint verify lists them\)$"):
        rpcompile.load_weights(newest, Net())
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 4
    shard.write_bytes(bytes(flipped))
    with pytest.raises(rpcompile.CheckpointError, match=r"\(model.safetensors does not match its sha256 in "
                       r"checkpoint.json \(corrupted\)\)"):
        rpcompile.load_weights(newest, Net())
    code = main(["checkpoint", "verify", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 1 and "Traceback" not in out.err + out.out
    assert out.out.splitlines()[0].startswith("BAD  ckpt-00000002: torn or corrupt (model.safetensors does not "
                                              "match its sha256")
    assert out.out.splitlines()[1].startswith("ok   ckpt-00000001: step 1")
    (newest / "checkpoint.json").unlink()  # as save_pretrained leaves a directory: the header is the check
    shard.write_bytes(good[:-40])
    with pytest.raises(rpcompile.CheckpointError, match=r"^.*ckpt-00000002: model.safetensors: its tensors need "
                       r"[\d,]+ bytes of data but the file holds [\d,]+: truncated; copy it again, or load an "
                       r"earlier checkpoint$"):
        rpcompile.load_weights(newest, Net())
    shard.write_bytes(good)
    model, pipe, opt = build(pipe.plan)
    with pytest.warns(CheckpointWarning, match=r"ckpt-00000002 is torn or corrupt \(no checkpoint.json"):
        assert rpcompile.load_checkpoint(tmp_path, model=model, optimizer=opt, pipeline=pipe).step == 1


# ---------------------------------------------------------------------------------------------- the older format
def _old_checkpoint(root: Path, steps: int) -> Path:
    """A run's ``.ckpt`` file as rpcompile wrote them before checkpoint directories (the same payload)."""
    model, pipe, opt = build()
    train(model, pipe, opt, 0, steps)
    root.mkdir()
    (root / "plan.json").write_text(pipe.plan.to_json())
    return write_legacy(root / f"ckpt-{steps:08d}.ckpt", {
        "step": steps, "pipeline": pipe.state_dict(), "model": model.state_dict(), "optimizer": opt.state_dict(),
        "extra": {"batches": steps}})


def test_an_old_ckpt_still_resumes_and_converts(tmp_path, capsys):
    """A ``.ckpt`` of the earlier format resumes bit for bit as before and loads into a plain model;
    ``rpcompile checkpoint verify`` names the conversion command and ``rpcompile checkpoint convert OLD NEW``
    writes a checkpoint directory that resumes the same and that safetensors opens; a torn one is refused."""
    old = _old_checkpoint(tmp_path / "old", 3)
    model, pipe, opt = build()
    train(model, pipe, opt, 0, STEPS)
    want = weights(model)
    for root in ("old", "new"):
        if root == "new":
            assert main(["checkpoint", "convert", str(old), str(tmp_path / "new")]) == 0
            assert "converted" in capsys.readouterr().out
        model, pipe, opt = build(rpcompile.checkpoint_plan(tmp_path / root))
        resumed = rpcompile.load_checkpoint(tmp_path / root, model=model, optimizer=opt, pipeline=pipe)
        assert resumed.step == 3 and resumed.extra == {"batches": 3}
        train(model, pipe, opt, 3, STEPS)
        assert_bitwise(weights(model), want)
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "new" / "ckpt-00000003" / "model.safetensors")) == set(want)
    plain = Net()
    rpcompile.load_weights(old, plain)
    assert main(["checkpoint", "verify", str(tmp_path / "old")]) == 0
    assert f"rpcompile checkpoint convert {old} NEW rewrites it" in capsys.readouterr().out
    old.write_bytes(old.read_bytes()[:-10])
    assert main(["checkpoint", "convert", str(old), str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rpcompile: error: ") and "is torn or corrupt" in err and err.count("\n") == 1
