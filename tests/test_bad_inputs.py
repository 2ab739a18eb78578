"""The bad-input catalogue (issue 21, deliverable 5): every bad input gets one line naming the problem and the fix.

Each row is (id, how to call, the error it must raise, the message it must produce). The rows cover a pipeline's
``forward_backward`` and ``forward`` inputs (checked against the compiled signature before any stage runs,
:mod:`rpcompile.training.signature`), ``rpcompile.compile``'s arguments, plan files (``Plan.load``) and the CLI commands
that read them. Every row asserts the exception type, that the message is one line, and its text. Valid batches
that differ from the compile example only where a real batch may (batch size, a shorter sequence, int32 ids) still
train as eager does: see the last tests.
"""

from __future__ import annotations

import copy
import io
import json
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rpcompile
from rpcompile.cli import main
from rpcompile.core.errors import (ConfigError, InputError, LossFnError, ModelChangedError, PlanFileError,
                                   PlanMismatchError, RPCompileError)
from rpcompile.core.plan import Plan
from rpcompile.training.host_memory import HostMemoryError

from _hf import hf_model
from _hf import token_loss as token_loss_hf
from _toy import TiedToy
from test_runtime import FINE_CPU, TOL, assert_grads_equal

GOLDEN = Path(__file__).parent / "golden"
X, Y = torch.randn(6, 8), torch.randn(6, 4)
IDS, LABELS = torch.randint(0, 16, (6, 5)), torch.randint(0, 16, (6, 5))
LONG = torch.randint(0, 16, (6, 7))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu())


class Huge(nn.Module):
    """A forward whose intermediate is ~2**55 bytes (6 rows of 16 features broadcast over 2**24 × 2**24)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)[..., None, None].expand(-1, -1, 2**24, 2**24)
        return (h * 2).sum((-1, -2))[:, :4]


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _compile(model: nn.Module, *example: Any, **kw: Any) -> rpcompile.Pipeline:
    torch.manual_seed(0)
    opts = dict(devices=["cpu", "cpu"], microbatches=3, spec=FINE_CPU, time_limit_s=2.0, head_chunks=1)
    return rpcompile.compile(model, example, **{**opts, **kw})


@pytest.fixture(scope="module")
def mlp() -> rpcompile.Pipeline:
    """x (6, 8) float32 → (6, 4), mean squared error against a float target."""
    torch.manual_seed(0)
    return _compile(MLP(), X, loss_fn=F.mse_loss, example_target=Y)


@pytest.fixture(scope="module")
def tokens() -> rpcompile.Pipeline:
    """Token ids (6, 5) → logits (6, 5, 16), token cross-entropy against one label per token."""
    torch.manual_seed(0)
    return _compile(TiedToy(), IDS, loss_fn=token_loss, example_target=LABELS)


def _stage0(data: dict, **fields: Any) -> bytes:
    return json.dumps({**data, "stages": [{**data["stages"][0], **fields}, *data["stages"][1:]]}).encode()


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Plan files: the golden llama-demo one and corruptions of it."""
    d = tmp_path_factory.mktemp("plans")
    raw = (GOLDEN / "llama-demo.json").read_bytes()
    data = json.loads(raw)
    files: dict[str, bytes] = {
        "good": raw,
        "latin1": raw.replace(b'"forward"', b'"f\xe9rward"', 1),
        "not-json": b"stages: [F0, FB]\n",
        "truncated": raw[: len(raw) // 2],
        "list": b"[1, 2]",
        "empty": b"",
        "newer": json.dumps({**data, "schema_version": 99}).encode(),
        "no-model": json.dumps({k: v for k, v in data.items() if k != "model"}).encode(),
        "nan": raw.replace(b'"microbatches": 3', b'"microbatches": NaN', 1),
        "negative": json.dumps({**data, "stages": [{**data["stages"][0], "memory_bytes": -5}, *data["stages"][1:]]}
                               ).encode(),
        "string-count": json.dumps({**data, "microbatches": "3"}).encode(),
        "nodes-string": json.dumps({**data, "stages": [{**data["stages"][0], "nodes": "embed"},
                                                       *data["stages"][1:]]}).encode(),
        "no-fused": json.dumps({**data, "stages": [s for s in data["stages"] if s["kind"] != "fused"]}).encode(),
        "unknown-field": json.dumps({**data, "colour": "red"}).encode(),
        "bad-kind": json.dumps({**data, "stages": [{**data["stages"][0], "kind": "sideways"},
                                                   *data["stages"][1:]]}).encode(),
        "zero-devices": json.dumps({**data, "hardware": {**data["hardware"], "device_count": 0}}).encode(),
        # issue 36: text that would become code or reach the terminal, numbers that would run away
        "module-newline": _stage0(data, modules=["layers.0\nimport os; os._exit(7)"]),
        "stage-name-path": _stage0(data, name="../../evil"),
        "escape-in-spec": json.dumps({**data, "hardware": {**data["hardware"], "spec": {
            **data["hardware"]["spec"], "name": "rtx\x1b]0;pwned\x07"}}}).encode(),
        "int8": json.dumps({**data, "precision": "int8"}).encode(),
        "huge-microbatches": json.dumps({**data, "microbatches": 10**8}).encode(),
        "long-number": raw.replace(b'"microbatches": 3', b'"microbatches": 1' + b"0" * 400, 1),
        "float-overflow": raw.replace(b'"microbatches": 3', b'"microbatches": 1e400', 1),
        "deep": raw.replace(b'"stats": {', b'"stats": {"x": ' + b"[" * 50_000 + b"]" * 50_000 + b",", 1),
    }
    paths = {}
    for name, content in files.items():
        paths[name] = d / f"{name}.json"
        paths[name].write_bytes(content)
    paths["missing"] = d / "nope.json"
    paths["directory"] = d
    return paths


Row = tuple[str, Callable[..., Any], type, str]

# ---- forward_backward / forward on a compiled pipeline -----------------------------------------------------------
MLP_ROWS: list[Row] = [
    ("missing target", lambda p: p.forward_backward(X), InputError,
     r"^target is missing: the loss needs it; pass the batch's target, forward_backward\(x, target=y\) \(a "
     r"loss_fn that takes none: give its second parameter a default, def loss\(output, target=None\)\)$"),
    ("wrong feature size", lambda p: p.forward_backward(torch.randn(6, 9), target=Y), InputError,
     r"^x has shape \(6, 9\) but the pipeline was compiled for \(batch, 8\); pass inputs shaped like the compile "
     r"example's \(6, 8\) \(other batch sizes are fine\), or compile again with this shape$"),
    ("extra leading dim", lambda p: p.forward_backward(X[None], target=Y), InputError,
     r"^x has shape \(1, 6, 8\) but the pipeline was compiled for \(batch, 8\)"),
    ("one row without batch dim", lambda p: p.forward_backward(X[0], target=Y[0]), InputError,
     r"^x has shape \(8,\) but the pipeline was compiled for \(batch, 8\)"),
    ("scalar input", lambda p: p.forward_backward(torch.tensor(1.0), target=Y), InputError,
     r"^x has shape \(\) but the pipeline was compiled for \(batch, 8\)"),
    ("float64 input", lambda p: p.forward_backward(X.double(), target=Y), InputError,
     r"^x has dtype float64 but the pipeline was compiled for float32 \(eager would refuse it too\); cast it "
     r"\(x\.float\(\)\)$"),
    ("float16 input, fp32 pipeline", lambda p: p.forward_backward(X.half(), target=Y), InputError,
     r"^x has dtype float16 but the pipeline was compiled for float32"),
    ("integer input", lambda p: p.forward_backward(X.long(), target=Y), InputError,
     r"^x has dtype int64 but the pipeline was compiled for float32 .*\(x\.float\(\)\)$"),
    ("bool input", lambda p: p.forward_backward(X > 0, target=Y), InputError,
     r"^x has dtype bool but the pipeline was compiled for float32"),
    ("python list", lambda p: p.forward_backward(X.tolist(), target=Y), InputError,
     r"^x is a list, not a tensor: the pipeline was compiled for a float32 tensor of shape \(batch, 8\) there; "
     r"pass a tensor \(torch\.as_tensor\(\.\.\.\)\)$"),
    ("python tuple", lambda p: p.forward_backward(tuple(X.tolist()), target=Y), InputError,
     r"^x is a tuple, not a tensor"),
    ("numpy array", lambda p: p.forward_backward(X.numpy(), target=Y), InputError, r"^x is a ndarray, not a tensor"),
    ("a number", lambda p: p.forward_backward(3.0, target=Y), InputError, r"^x is a float, not a tensor"),
    ("None input", lambda p: p.forward_backward(None, target=Y), InputError, r"^x is a NoneType, not a tensor"),
    ("empty batch", lambda p: p.forward_backward(X[:0], target=Y[:0]), InputError,
     r"^x is an empty batch \(shape \(0, 8\)\); pass at least one row$"),
    ("input on meta", lambda p: p.forward_backward(X.to("meta"), target=Y), InputError,
     r"^x is on meta but the pipeline takes inputs on cpu; move it there \(x\.to\('cpu'\)\)$"),
    ("two positional", lambda p: p.forward_backward(X, X, target=Y), InputError,
     r"^the pipeline was compiled for 1 positional input\(s\), got 2; pass the inputs as in compile"),
    ("no positional", lambda p: p.forward_backward(target=Y), InputError,
     r"^the pipeline was compiled for 1 positional input\(s\), got 0"),
    ("unknown keyword", lambda p: p.forward_backward(X, mask=X, target=Y), InputError,
     r"^keyword input\(s\) \['mask'\] were not in the compile example \(keywords: none\); compile with them"),
    ("target batch size", lambda p: p.forward_backward(X, target=Y[:4]), InputError,
     r"^target has batch size 4 but the inputs have 6 rows \(dim 0\); pass the target of this batch$"),
    ("target list", lambda p: p.forward_backward(X, target=Y.tolist()), InputError,
     r"^target is a list, not a tensor: it would not be split into microbatches with the inputs; pass a tensor "
     r"\(torch\.as_tensor\(target\)\)$"),
    ("target numpy", lambda p: p.forward_backward(X, target=Y.numpy()), InputError,
     r"^target is a ndarray, not a tensor"),
    ("target float64", lambda p: p.forward_backward(X, target=Y.double()), InputError,
     r"^target has dtype float64 but the pipeline was compiled for float32 .*\(target\.float\(\)\)$"),
    ("target trailing dims", lambda p: p.forward_backward(X, target=torch.randn(6, 5)), InputError,
     r"^target has shape \(6, 5\) but the pipeline was compiled for \(batch, 4\)"),
    ("target on meta", lambda p: p.forward_backward(X, target=Y.to("meta")), InputError, r"^target is on meta"),
    # every tensor of a tuple or dict target is split with the inputs (issue 36: one-row microbatches broadcast)
    ("tuple target batch size", lambda p: p.forward_backward(X, target=(Y, torch.ones(4))), InputError,
     r"^target\[1\] has batch size 4 but the inputs have 6 rows \(dim 0\): each tensor of a target is split into "
     r"microbatches with the inputs; pass this batch's rows \(a constant such as class weights belongs in "
     r"loss_fn\)$"),
    ("dict target on meta", lambda p: p.forward_backward(X, target={"y": Y, "w": torch.ones(6, device="meta")}),
     InputError, r"^target\['w'\] is on meta but the pipeline takes inputs on cpu; move it there "
                 r"\(target\['w'\]\.to\('cpu'\)\)$"),
    ("num_items below the batch's", lambda p: p.forward_backward(X, target=Y, num_items=4), ConfigError,
     r"^num_items=4 but this batch alone averages over 6 \(its real tokens, or rows\): pass the count over every "
     r"batch the gradients accumulate over$"),
    ("num_items zero", lambda p: p.forward_backward(X, target=Y, num_items=0), ConfigError,
     r"^num_items=0; give what the loss averages over in every batch accumulated \(a positive count of real tokens "
     r"or rows\), or None for this batch's own$"),
    ("loss_scale a string", lambda p: p.forward_backward(X, target=Y, loss_scale="1/4"), ConfigError,
     r"^loss_scale='1/4'; give a finite number \(1 / steps to accumulate over steps\)$"),
    ("eval: wrong feature size", lambda p: p.forward(torch.randn(6, 9)), InputError,
     r"^x has shape \(6, 9\) but the pipeline was compiled for \(batch, 8\)"),
    ("eval: list", lambda p: p.forward(X.tolist()), InputError, r"^x is a list, not a tensor"),
    ("evaluate: missing target", lambda p: p.evaluate(X), InputError,
     r"^target is missing: the loss needs it; pass the batch's target, evaluate\(x, target=y\)"),
    ("evaluate: wrong feature size", lambda p: p.evaluate(torch.randn(6, 9), target=Y), InputError,
     r"^x has shape \(6, 9\) but the pipeline was compiled for \(batch, 8\)"),
    ("evaluate: under autocast", lambda p: _under(torch.autocast("cpu", dtype=torch.bfloat16), p.evaluate, X,
                                                  target=Y), InputError,
     r"^evaluate is called under torch.autocast\('cpu', dtype=torch.bfloat16\)"),
    # the caller's thread runs device 0's stages: under autocast they (and the captures they make) would compute
    # in another dtype than the other devices' — silently wrong gradients from then on, or a raw dtype error
    ("under autocast", lambda p: _under(torch.autocast("cpu", dtype=torch.bfloat16), p.forward_backward, X, target=Y),
     InputError, r"^forward_backward is called under torch.autocast\('cpu', dtype=torch.bfloat16\), but the pipeline "
     r"computes in the precision it was compiled with \('fp32'\) on every device: call it outside autocast; "
     r"compile with precision='bf16' for bfloat16 compute$"),
    ("eval: under autocast", lambda p: _under(torch.autocast("cpu", dtype=torch.float16), p.forward, X),
     InputError, r"^forward is called under torch.autocast\('cpu', dtype=torch.float16\), .* call it outside "
     r"autocast; compile with precision='fp16' for float16 compute$"),
    ("under inference mode", lambda p: _under(torch.inference_mode(), p.forward_backward, X, target=Y), InputError,
     r"^forward_backward is called under torch.inference_mode\(\), but it makes gradients: call it outside "
     r"inference mode \(pipe.forward\(...\) evaluates without them\)$"),
]


def _under(mode: Any, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with mode:
        return call(*args, **kwargs)

TOKEN_ROWS: list[Row] = [
    ("float token ids", lambda p: p.forward_backward(IDS.float(), target=LABELS), InputError,
     r"^ids has dtype float32 but the pipeline was compiled for int64 .*cast it \(ids\.long\(\)\)$"),
    ("ids with a feature dim", lambda p: p.forward_backward(IDS[..., None], target=LABELS), InputError,
     r"^ids has shape \(6, 5, 1\) but the pipeline was compiled for \(batch, seq≤5\)"),
    ("sequence too long", lambda p: p.forward_backward(torch.randint(0, 16, (6, 7)), target=LONG),
     InputError, r"^sequence length 7 is longer than the 5 this pipeline was planned for .*--seq-len 7\)$"),
    ("target shorter than ids", lambda p: p.forward_backward(IDS, target=LABELS[:, :4]), InputError,
     r"^target has sequence length 4 but the inputs have 5 \(dim 1\)"),
    ("float target for token loss", lambda p: p.forward_backward(IDS, target=LABELS.float()), InputError,
     r"^target has dtype float32 but the pipeline was compiled for int64"),
    ("missing target", lambda p: p.forward_backward(IDS), InputError, r"^target is missing"),
    # the target passes the signature (int64, one label per token) but has a label the output has no class for:
    # refused before loss_fn runs (on a GPU cross-entropy would stop at a device-side assert, CUDA gone with it)
    ("label beyond the classes", lambda p: p.forward_backward(IDS, target=LABELS + 16), LossFnError,
     r"^the target of microbatch 0 has label \d+, beyond the 16 classes of the model's output \(its last dimension\): "
     r"labels must be below 16, or -100 \(ignored\); check the tokenizer against the model's vocabulary "
     r"\(resize_token_embeddings, then compile\) — on a GPU the loss would stop at a device-side assert$"),
    ("ids keyword misspelt", lambda p: p.forward_backward(input_ids=IDS, target=LABELS), InputError,
     r"^the pipeline was compiled for 1 positional input\(s\), got 0"),
]


HF_IDS, HF_MASK = torch.randint(1, 64, (4, 8)), torch.ones(4, 8, dtype=torch.long)
HF_BEYOND = HF_IDS.index_put((torch.tensor([3]), torch.tensor([2])), torch.tensor(70))  # a token id past the vocab
HF_ROWS: list[Row] = [
    ("float attention mask", lambda p: p.forward_backward(input_ids=HF_IDS, attention_mask=HF_MASK.float(),
                                                          target=HF_IDS), InputError,
     r"^attention_mask has dtype float32 but the pipeline was compiled for int64 .*\(attention_mask\.long\(\)\)$"),
    ("mask shorter than the ids", lambda p: p.forward_backward(input_ids=HF_IDS, attention_mask=HF_MASK[:, :6],
                                                               target=HF_IDS), InputError,
     r"^the inputs disagree on the sequence length \(dim 1\): input_ids has 8, attention_mask has 6; pass one batch$"),
    ("mask of another batch", lambda p: p.forward_backward(input_ids=HF_IDS, attention_mask=HF_MASK[:2],
                                                           target=HF_IDS), InputError,
     r"^the inputs disagree on the batch size \(dim 0\): input_ids has 4, attention_mask has 2; pass one batch$"),
    ("ids a list in a batch dict", lambda p: p.forward_backward(**{"input_ids": HF_IDS.tolist(),
                                                                   "attention_mask": HF_MASK, "labels": HF_IDS}),
     InputError, r"^input_ids is a list, not a tensor: the pipeline was compiled for a int64 tensor of shape "
                 r"\(batch, seq≤8\)"),
    ("labels of another length", lambda p: p.forward_backward(input_ids=HF_IDS, attention_mask=HF_MASK,
                                                              labels=HF_IDS[:, :5]), InputError,
     r"^target has sequence length 5 but the inputs have 8 \(dim 1\)"),
    ("missing labels and target", lambda p: p.forward_backward(input_ids=HF_IDS, attention_mask=HF_MASK),
     InputError, r"^target is missing"),
    ("token id beyond the vocabulary", lambda p: p.forward_backward(input_ids=HF_IDS, attention_mask=HF_MASK,
                                                                    target=HF_BEYOND),
     LossFnError, r"^the target of microbatch \d has label 70, beyond the 64 classes of the model's output"),
]


# a pipeline compiled without example_target= checks its targets only in loss_fn, when the last stage has run; and
# what users type out of eager habit: loss.backward() after forward_backward, pipe(x) for the model's output
UNCHECKED_HINT = (r"pass a target loss_fn takes \(or fix loss_fn\), or compile with example_target= \(one batch's "
                  r"target\) to have every call's target checked before anything runs$")
HABIT = (r"^loss\.backward\(\) on what forward_backward returned: forward_backward already ran the backward pass and "
         r"added the gradients into each p\.grad; drop loss\.backward\(\) and call optimizer\.step\(\) \(the loss is "
         r"for logging; to accumulate gradients over k calls, pass forward_backward\(\.\.\., loss_scale=1/k\)\)$")
UNCHECKED_ROWS: list[Row] = [
    ("float target", lambda p: p.forward_backward(IDS, target=LABELS.float()), LossFnError,
     r"^loss_fn\(output, target\) failed on microbatch 0 \(RuntimeError: expected .*Long.*got Float\); it was given "
     r"the target float32 \(2, 5\) and the output float32 \(2, 5, 16\): " + UNCHECKED_HINT),
    ("target shorter than ids", lambda p: p.forward_backward(IDS, target=LABELS[:, :4]), LossFnError,
     r"^loss_fn\(output, target\) failed on microbatch 0 \(ValueError: Expected input batch_size \(10\) to match "
     r"target batch_size \(8\)\.\); it was given the target int64 \(2, 4\) and the output float32 \(2, 5, 16\): "
     + UNCHECKED_HINT),
    ("loss.backward()", lambda p: p.forward_backward(IDS, target=LABELS).backward(), RPCompileError, HABIT),
    ("(loss / steps).backward()", lambda p: (p.forward_backward(IDS, target=LABELS) / 4).backward(), RPCompileError,
     HABIT),
    ("pipe(x)", lambda p: p(IDS), RPCompileError,
     r"^a Pipeline is not called like the model: pipe\.forward_backward\(x, target=y\) trains \(the forward and the "
     r"backward in one call: no loss\.backward\(\)\); pipe\.evaluate\(x, target=y\) gives the loss without "
     r"gradients, pipe\.forward\(x\) the model's output$"),
]


@pytest.fixture(scope="module")
def unchecked() -> rpcompile.Pipeline:
    """The token pipeline compiled as the README's snippet does: without example_target=."""
    torch.manual_seed(0)
    return _compile(TiedToy(), IDS, loss_fn=token_loss)


def _run(pipe: rpcompile.Pipeline, call: Callable[..., Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message) as info:
        call(pipe)
    assert "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("call, error, message", [r[1:] for r in MLP_ROWS], ids=[r[0] for r in MLP_ROWS])
def test_bad_inputs_to_a_float_pipeline(mlp, call, error, message):
    _run(mlp, call, error, message)


@pytest.mark.parametrize("call, error, message", [r[1:] for r in TOKEN_ROWS], ids=[r[0] for r in TOKEN_ROWS])
def test_bad_inputs_to_a_token_pipeline(tokens, call, error, message):
    _run(tokens, call, error, message)


@pytest.mark.parametrize("call, error, message", [r[1:] for r in UNCHECKED_ROWS],
                         ids=[r[0] for r in UNCHECKED_ROWS])
def test_bad_targets_and_eager_habits_without_an_example_target(unchecked, call, error, message):
    _run(unchecked, call, error, message)
    unchecked.model.zero_grad(set_to_none=True)


def test_a_loss_that_fails_on_its_target_leaves_no_gradient_and_the_next_call_trains(unchecked):
    """The failed call adds nothing to ``.grad`` (all or none), the loss returned by a good one is what eager's is,
    as a plain tensor where users log it (formatted, copied, pickled)."""
    model = unchecked.model
    model.zero_grad(set_to_none=True)
    with pytest.raises(LossFnError):
        unchecked.forward_backward(IDS, target=LABELS.float())
    assert all(p.grad is None for p in model.parameters())
    ref = copy.deepcopy(model)
    loss = unchecked.forward_backward(IDS, target=LABELS)
    ref_loss = token_loss(ref(IDS), LABELS)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert_grads_equal(model, ref)
    assert f"{loss:.3f}" == f"{ref_loss.item():.3f}" and repr(loss) == repr(loss.as_subclass(torch.Tensor))
    assert type(copy.deepcopy(loss)) is torch.Tensor
    saved = io.BytesIO()
    torch.save({"loss": loss}, saved)
    saved.seek(0)
    assert type(torch.load(saved, weights_only=True)["loss"]) is torch.Tensor
    model.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def hf_pipe() -> rpcompile.Pipeline:
    """A two-layer HF llama traced by torch.export (symbolic batch and sequence), ids and mask as keywords."""
    return rpcompile.compile(hf_model("llama"), (), example_kwargs={"input_ids": HF_IDS, "attention_mask": HF_MASK},
                             loss_fn=token_loss_hf, example_target=HF_IDS, devices=["cpu"], spec=FINE_CPU,
                             time_limit_s=2.0, head_chunks=1)


@pytest.mark.hf
@pytest.mark.parametrize("call, error, message", [r[1:] for r in HF_ROWS], ids=[r[0] for r in HF_ROWS])
def test_bad_inputs_to_an_hf_pipeline(hf_pipe, call, error, message):
    _run(hf_pipe, call, error, message)


# ---- rpcompile.compile's arguments --------------------------------------------------------------------------------
def _c(**kw: Any) -> Callable[[dict[str, Path]], Any]:
    example = kw.pop("example", (X,))
    model = kw.pop("model", None)
    return lambda plans: rpcompile.compile(model if model is not None else MLP(), example,
                                           **{"loss_fn": F.mse_loss, "spec": FINE_CPU, "time_limit_s": 2.0,
                                              **{k: (v(plans) if callable(v) and k == "plan" else v)
                                                 for k, v in kw.items()}})


COMPILE_ROWS: list[Row] = [
    ("cuda device without CUDA", _c(devices=["cuda:0"]), ConfigError,
     r"^device 'cuda:0': no CUDA device is visible \(or torch has no CUDA\); use devices=\['cpu'\] \* k"),
    ("cuda index out of range", _c(devices=["cuda:99"]), ConfigError, r"^device 'cuda:99': (no CUDA|only cuda:0)"),
    ("unknown device string", _c(devices=["tpu"]), ConfigError,
     r"^device 'tpu' is not a device name; use 'cpu' \(a logical CPU device\) or 'cuda:i'$"),
    ("device type not supported", _c(devices=["meta"]), ConfigError,
     r"^device 'meta': rpcompile runs stages on 'cpu' \(logical CPU devices\) or 'cuda:i', not meta$"),
    ("devices a string", _c(devices="cpu"), ConfigError,
     r"^devices='cpu' is one device, not a list; pass devices=\['cpu'\]$"),
    ("devices empty", _c(devices=[]), ConfigError, r"^need at least one device"),
    ("gpus=0", _c(gpus=0), ConfigError, r"^gpus=0; give a whole number >= 1, or devices=\['cpu'\] \* k"),
    ("gpus negative", _c(gpus=-2), ConfigError, r"^gpus=-2; give a whole number >= 1"),
    ("gpus not a number", _c(gpus=1.5), ConfigError, r"^gpus=1\.5; give a whole number >= 1"),
    ("gpus beyond the visible", _c(gpus=64), ConfigError,
     r"^gpus=64 but \d+ CUDA device\(s\) are visible; use devices=\['cpu'\] \* k"),
    ("microbatches 0", _c(devices=["cpu"], microbatches=0), ConfigError,
     r"^microbatches=0; give a whole number >= 1 \(or None: the planner picks\)$"),
    ("microbatches negative", _c(devices=["cpu"], microbatches=-3), ConfigError, r"^microbatches=-3; "),
    ("microbatches fractional", _c(devices=["cpu"], microbatches=2.5), ConfigError, r"^microbatches=2\.5; "),
    ("loss_fn a string", _c(devices=["cpu"], loss_fn="mse"), ConfigError,
     r"^loss_fn='mse' is not callable; pass a function loss_fn\(output, target\) -> scalar"),
    ("loss_fn a number", _c(devices=["cpu"], loss_fn=3), ConfigError, r"^loss_fn=3 is not callable"),
    ("unknown precision", _c(devices=["cpu"], precision="fp8"), ConfigError,
     r"^precision must be one of \['bf16', 'fp16', 'fp32'\], got 'fp8'$"),
    ("unknown loss_weight", _c(devices=["cpu"], loss_weight="tokens"), RPCompileError,
     r"^loss_weight='tokens'; use 'auto', 'rows' or a function"),
    ("model not a module", _c(devices=["cpu"], model=F.relu), ConfigError,
     r"^model is a function, not a torch\.nn\.Module; pass the module to compile$"),
    ("model under torch.compile", lambda plans: rpcompile.compile(torch.compile(MLP()), (X,), loss_fn=F.mse_loss,
                                                                  devices=["cpu"]), ConfigError,
     r"^model is a torch\.compile wrapper \(OptimizedModule\): rpcompile compiles the model itself, into stages of "
     r"its own; pass the module it wraps, model\._orig_mod$"),
    ("example a list of numbers", _c(devices=["cpu"], example=(X.tolist(),)), ConfigError,
     r"^example input 0 is a list of numbers, not a tensor; pass a tensor \(torch\.as_tensor\(\.\.\.\)\)"),
    ("example a numpy array", _c(devices=["cpu"], example=(X.numpy(),)), ConfigError,
     r"^example input 0 is a ndarray of numbers, not a tensor"),
    ("example kwarg a list", _c(devices=["cpu"], example=(), example_kwargs={"x": X.tolist()}), ConfigError,
     r"^example_kwargs\['x'\] is a list of numbers, not a tensor"),
    # issue 36: torch's device error from inside a stage at the first call; the allocator's raw error while
    # compile measured the example (an allocation no machine can make: past the 47-bit address space)
    ("model on the meta device", _c(devices=["cpu"], model=nn.Linear(8, 4, device="meta")), ConfigError,
     r"^model has 2 parameter\(s\) or buffer\(s\) on the meta device \(e\.g\. weight\), which hold no values to "
     r"train; load its weights first \(model\.to_empty\(device='cpu'\) then load_state_dict\(\.\.\.\), or "
     r"from_pretrained without a meta device_map\) — rpcompile\.plan plans a model on the meta device$"),
    ("host memory runs out while compiling", _c(devices=["cpu"], model=Huge(), head_chunks=1, spec=None),
     HostMemoryError, r"^compile ran out of host memory: an allocation of [\d.]+ \w+ failed in passes/(\w+/)?\w+\.py "
                      r"\(\w+\)(; [\d.]+ \w+ available)?; free host memory, or give compile less to do: an example "
                      r"batch no larger than one step's \(it is run once, node by node, to measure costs\), or "
                      r"spec='rtx4090' \(any GPU spec\) for analytic costs that run nothing$"),
    ("plan file for another model", _c(devices=["cpu", "cpu"], plan=lambda p: p["good"]), PlanMismatchError,
     r"^plan was made for a different model.*; re-plan for this model$"),
    ("plan file missing", _c(devices=["cpu"], plan=lambda p: p["missing"]), PlanFileError,
     r"^cannot read plan file .*nope\.json: No such file or directory$"),
    ("plan file corrupt", _c(devices=["cpu"], plan=lambda p: p["latin1"]), PlanFileError,
     r"latin1\.json is corrupt: byte \d+ is not UTF-8 text \(0xe9\); re-plan to regenerate it$"),
    ("plan file with code in a module name", _c(devices=["cpu"], plan=lambda p: p["module-newline"]), PlanFileError,
     r"module-newline\.json is corrupt: stages\[0\]\.modules\[0\]: holds the control or format character"),
    ("microbatches beyond the bound", _c(devices=["cpu"], microbatches=10**8), ConfigError,
     r"^microbatches=100000000; at most 4096 \(a plan holds no more\): give fewer, larger microbatches$"),
]


@pytest.mark.parametrize("call, error, message", [r[1:] for r in COMPILE_ROWS], ids=[r[0] for r in COMPILE_ROWS])
def test_bad_compile_arguments(plans, call, error, message):
    if "CUDA" in message and torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    _run(plans, call, error, message)


# ---- plan files ---------------------------------------------------------------------------------------------------
PLAN_ROWS: list[tuple[str, str]] = [
    ("latin1", r"is corrupt: byte \d+ is not UTF-8 text \(0xe9\)"),
    ("not-json", r"is corrupt: invalid JSON at line 1 column 1 \(Expecting value\)"),
    ("truncated", r"is corrupt: invalid JSON at line \d+ column \d+"),
    ("empty", r"is corrupt: invalid JSON at line 1 column 1"),
    ("list", r"is not an rpcompile plan: expected a JSON object, found list$"),
    ("newer", r"has schema_version 99 but this rpcompile reads up to \d+; upgrade rpcompile"),
    ("no-model", r"is corrupt: missing field 'model'"),
    ("nan", r"is corrupt: NaN is not a number a plan holds"),
    ("negative", r"is corrupt: stages\[0\]\.memory_bytes: must be >= 0, found -5"),
    ("string-count", r"is corrupt: microbatches: expected an integer, found a string \('3'\)"),
    ("nodes-string", r"is corrupt: stages\[0\]\.nodes: expected a list, found a string \('embed'\)"),
    ("no-fused", r"is corrupt: stages: kinds must run forward…, one fused, backward… \(found F0:forward, "),
    ("unknown-field", r"is corrupt: plan: unknown field 'colour'"),
    ("bad-kind", r"is corrupt: stages\[0\]\.kind: expected one of \['forward', 'fused', 'backward'\], "
                 r"found 'sideways'"),
    ("zero-devices", r"is corrupt: hardware\.device_count: must be >= 1, found 0"),
    ("module-newline", r"is corrupt: stages\[0\]\.modules\[0\]: holds the control or format character '\\n', "
                       r"which no plan text has"),
    ("stage-name-path", r"is corrupt: stages\[0\]\.name: '\.\./\.\./evil' is not a stage name \(F<i>, FB or B<i>\)"),
    ("escape-in-spec", r"is corrupt: hardware\.spec\.name: holds the control or format character '\\x1b'"),
    ("int8", r"is corrupt: precision: 'int8' is not a precision rpcompile runs \(fp32, bf16 or fp16\)"),
    ("huge-microbatches", r"is corrupt: microbatches: must be at most 4096, found 100000000"),
    ("long-number", r"is corrupt: the number 1000000000000\S+ is out of range \(beyond 2\*\*63\)"),
    ("float-overflow", r"is corrupt: the number 1e400 is out of range \(beyond a float\)"),
    ("deep", r"is corrupt: nested deeper than 8 levels"),
    ("missing", r"^cannot read plan file .*: No such file or directory$"),
    ("directory", r"^cannot read plan file .*: Is a directory$"),
]
FIX = {"missing": "", "directory": "", "list": "", "newer": r".* or re-plan with this version$"}


@pytest.mark.parametrize("name, message", PLAN_ROWS, ids=[r[0] for r in PLAN_ROWS])
def test_bad_plan_files(plans, name, message):
    fix = FIX.get(name, r".*; re-plan to regenerate it$")
    with pytest.raises(PlanFileError, match=message + fix) as info:
        Plan.load(plans[name])
    assert "\n" not in str(info.value) and str(info.value).startswith(str(plans[name]) if name not in
                                                                       ("missing", "directory") else "cannot")


CLI_ROWS: list[tuple[str, list[str], str]] = [
    ("show latin1", ["show", "{latin1}"], r"is corrupt: byte \d+ is not UTF-8 text"),
    ("show truncated", ["show", "{truncated}"], r"is corrupt: invalid JSON"),
    ("show wrong type", ["show", "{string-count}"], r"is corrupt: microbatches: expected an integer"),
    ("show missing", ["show", "{missing}"], r"cannot read plan file"),
    ("diff corrupt", ["diff", "{good}", "{latin1}"], r"latin1\.json is corrupt: byte"),
    ("diff truncated first", ["diff", "{truncated}", "{good}"], r"truncated\.json is corrupt: invalid JSON"),
    ("simulate corrupt plan", ["simulate", "{nan}"], r"nan\.json is corrupt: NaN is not a number a plan holds"),
    ("simulate no fused stage", ["simulate", "{no-fused}"], r"is corrupt: stages: kinds must run"),
    ("simulate 10**8 microbatches", ["simulate", "{huge-microbatches}"], r"microbatches: must be at most 4096"),
    ("simulate int8", ["simulate", "{int8}"], r"precision: 'int8' is not a precision"),
    ("show an escape sequence", ["show", "{escape-in-spec}"], r"hardware\.spec\.name: holds the control"),
]


@pytest.mark.parametrize("argv, message", [r[1:] for r in CLI_ROWS], ids=[r[0] for r in CLI_ROWS])
def test_cli_commands_on_bad_plan_files(plans, capsys, argv, message):
    code = main([str(plans[a.strip("{}")]) if a.startswith("{") else a for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("rpcompile: error: ") and "unexpected" not in err[0], err
    assert re.search(message, err[0]), err


def test_a_microbatch_count_no_plan_holds_is_refused_before_any_work(capsys):
    with pytest.raises(SystemExit) as info:
        main(["simulate", "llama-demo", "--gpus", "2", "--microbatches", "100000000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and err[-1].startswith("rpcompile simulate: error: argument --microbatches: at most "
                                                       "4096 (a plan holds no more), got 100000000"), err


def test_check_reports_an_undecodable_plan_in_one_line(plans, capsys):
    at = (GOLDEN / "llama-demo.json").read_bytes().index(b'"forward"') + 2
    assert main(["check", str(plans["latin1"]), "llama-demo"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{plans['latin1']}: corrupt: byte {at} is not UTF-8 text (0xe9); re-plan to regenerate it",
        f"{plans['latin1']}: 1 problem"]


# ---- what must still pass -----------------------------------------------------------------------------------------
def test_the_catalogue_has_the_issue_s_breadth():
    rows = len(MLP_ROWS) + len(TOKEN_ROWS) + len(UNCHECKED_ROWS) + len(HF_ROWS) + len(COMPILE_ROWS) + len(PLAN_ROWS) \
        + len(CLI_ROWS) + 1
    assert rows >= 72, rows


def test_batches_a_real_loop_sees_still_train_like_eager(tokens):
    """Another batch size, a shorter sequence and int32 ids differ from the compile example only where a real
    batch may: they pass the checks and give eager's loss and gradients."""
    model = tokens.model
    for ids, labels in [(IDS[:2], LABELS[:2]), (IDS[:, :3], LABELS[:, :3]), (IDS.int(), LABELS)]:
        ref = copy.deepcopy(model)
        model.zero_grad(set_to_none=True)
        loss = tokens.forward_backward(ids, target=labels)
        ref_loss = token_loss(ref(ids), labels)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, **TOL)
        assert_grads_equal(model, ref)
    model.zero_grad(set_to_none=True)


def test_a_loss_without_a_target_may_leave_it_out():
    """``needs_target``: a loss whose second parameter has a default is called with ``target=None``."""
    pipe = _compile(MLP(), X, loss_fn=lambda out, target=None: out.pow(2).mean(), devices=["cpu"], microbatches=2)
    ref = copy.deepcopy(pipe.model)
    loss = pipe.forward_backward(X)
    torch.testing.assert_close(loss, ref(X).pow(2).mean(), **TOL)


def test_a_tensor_where_a_constant_was_traced_is_named_in_one_line():
    """``mask=None`` in the example is traced as a constant: a tensor there would be ignored by the graph."""
    class Masked(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            return x if mask is None else x * mask

    sig = rpcompile.training.pipeline.InputSignature(Masked(), (X,), {"mask": None})
    with pytest.raises(InputError, match=r"^mask=<float32 tensor \(6, 8\)> but the pipeline was compiled with "
                                         r"mask=None \(traced as a constant\); compile again with mask=<float32 "
                                         r"tensor \(6, 8\)> in example_kwargs=$"):
        sig.bind((X,), {"mask": torch.ones(6, 8)})


def test_a_target_no_loss_reads_is_refused_in_one_line():
    """``loss_fn=None``: the model's own loss; a ``target=`` would be ignored silently."""
    class OwnLoss(MLP):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).pow(2).mean()

    pipe = _compile(OwnLoss(), X, loss_fn=None, devices=["cpu"], microbatches=2)
    with pytest.raises(InputError, match=r"^target= is given but the pipeline has no loss_fn: with loss_fn=None the "
                                         r"model computes its own loss .*; pass them as labels=\.\.\., or compile "
                                         r"with loss_fn=$"):
        pipe.forward_backward(X, target=Y)
    ref = copy.deepcopy(pipe.model)
    torch.testing.assert_close(pipe.forward_backward(X), ref(X), **TOL)


def test_a_parameter_replaced_after_compile_is_refused_and_values_changed_in_place_train():
    """The stages hold the parameters compiled: a new ``nn.Parameter`` put in one's place, one added or removed,
    is refused in one line before anything runs (training would go to the old objects, silently); the original
    put back trains again, and values changed in place train as eager."""
    pipe = _compile(MLP(), X, loss_fn=F.mse_loss, example_target=Y, devices=["cpu"], microbatches=2)
    model, weight, bias = pipe.model, pipe.model.b.weight, pipe.model.a.bias
    fix = (r", but the pipeline trains the parameters it was compiled with; change values in place \(with "
           r"torch.no_grad\(\): p.copy_\(new\), or model.load_state_dict\(...\)\) or compile the model again$")
    model.b.weight = nn.Parameter(weight.detach() * 2)
    for call in (lambda p: p.forward_backward(X, target=Y), lambda p: p.forward(X)):
        _run(pipe, call, ModelChangedError, r"^the model changed after compile: parameter b.weight was replaced by "
                                            r"a new nn.Parameter" + fix)
    model.b.weight = weight
    model.extra = nn.Linear(2, 2)
    _run(pipe, lambda p: p.forward_backward(X, target=Y), ModelChangedError,
         r"^the model changed after compile: parameter extra.weight was added \(and 1 more\)" + fix)
    del model.extra
    del model.a.bias
    _run(pipe, lambda p: p.forward_backward(X, target=Y), ModelChangedError,
         r"^the model changed after compile: parameter a.bias was removed" + fix)
    model.a.bias = bias
    with torch.no_grad():
        model.b.weight.mul_(2)  # in place: the pipeline sees it
    ref = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(pipe.forward_backward(X, target=Y), F.mse_loss(ref(X), Y), **TOL)
    F.mse_loss(ref(X), Y).backward()
    assert_grads_equal(model, ref)


def test_trainable_16_bit_parameters_are_warned_about_once_and_a_frozen_16_bit_base_is_not():
    """A model loaded in bfloat16 trains (its masters are bf16, as eager's would be), with one warning naming the
    fix; a LoRA-style frozen bf16 base with fp32 adapters gets none."""
    model = MLP().to(torch.bfloat16)
    with pytest.warns(rpcompile.PrecisionWarning, match=r"^4 trainable parameter\(s\) are bfloat16 \(e\.g\. a\.weight\): "
                      r"the optimizer updates them in bfloat16, losing small updates; for fp32 masters with bfloat16 "
                      r"compute load the model in float32 \(torch_dtype=torch\.float32\) and compile with "
                      r"precision='bf16'$") as record:
        _compile(model, X.bfloat16(), loss_fn=F.mse_loss, devices=["cpu"], microbatches=1)
    ours = [w for w in record if w.category is rpcompile.PrecisionWarning]
    assert len(ours) == 1 and ours[0].filename == __file__  # at the compile call
    frozen = MLP()
    frozen.a.to(torch.bfloat16).requires_grad_(False)
    frozen.b.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", rpcompile.PrecisionWarning)
        rpcompile.training.signature.check_compile_arguments(frozen, (X,), None, loss_fn=F.mse_loss, devices=["cpu"],
                                                    gpus=None, microbatches=None)


def test_no_grad_and_eval_under_inference_mode_are_fine(mlp):
    """``torch.no_grad`` around ``forward_backward`` changes nothing (the pipeline makes its gradients itself), and
    ``forward`` may run under inference mode: both give eager's results."""
    model = mlp.model
    ref = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        loss = mlp.forward_backward(X, target=Y)
    ref_loss = F.mse_loss(ref(X), Y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert_grads_equal(model, ref)
    model.zero_grad(set_to_none=True)
    with torch.inference_mode():
        torch.testing.assert_close(mlp.forward(X), ref(X), **TOL)
