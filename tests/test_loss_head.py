"""The loss in the graph and the LM head split along the sequence (``rpcompile.passes.rewrite.loss_head``)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

import rpcompile
from rpcompile.cli import main
from rpcompile.core.errors import InfeasibleError, LossHeadError
from rpcompile.models.registry import load_model
from rpcompile.passes.graph.trace import trace
from rpcompile.passes.rewrite.loss_head import attach_loss, chunk_loss_head, split_head
from rpcompile.planner.plan_options import AUTO_HEAD_CHUNKS, fastest, head_chunk_candidates

from test_runtime import FINE_CPU, TOL, assert_grads_equal


def _ce_count(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is F.cross_entropy)


@pytest.mark.parametrize("name", ["llama-demo", "gpt-demo"])
@pytest.mark.parametrize("chunks", [2, 3, 7])
def test_split_head_gives_the_eager_loss_and_gradients(name, chunks):
    spec = load_model(name, batch_size=2)
    ref = copy.deepcopy(spec.model)
    (x,), y = spec.example_inputs, spec.example_target.clone()
    y[0, :5] = -100  # ignored tokens: the mean counts only the others, per chunk as in eager
    gm = attach_loss(trace(spec.model, (x,)), spec.loss_fn)
    split = chunk_loss_head(gm, chunks)
    assert split.chunks == chunks and _ce_count(gm) == chunks
    loss = gm(x, y)
    ref_loss = spec.loss_fn(ref(x), y)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    loss.backward()
    ref_loss.backward()
    assert_grads_equal(spec.model, ref)


def test_head_split_refuses_what_it_cannot_split():
    spec = load_model("llama-demo", batch_size=2)
    gm = attach_loss(trace(spec.model, spec.example_inputs), lambda out, t: F.mse_loss(out.float(), t))
    assert chunk_loss_head(gm, 4).reason == "expected one cross_entropy in the graph, found 0"
    weighted = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), reduction="sum")  # noqa: E731
    gm = attach_loss(trace(spec.model, spec.example_inputs), weighted)
    assert chunk_loss_head(gm, 4).reason == "cross_entropy must be a plain mean (no class weights, default reduction)"
    assert _ce_count(gm) == 1  # refused: the graph is left as it was
    # asked for explicitly, a split that cannot happen is a domain error (and a ValueError, for planning.fastest)
    with pytest.raises(LossHeadError, match=r"^head_chunks=4: the LM head cannot be split \(cross_entropy must be a "
                                            r"plain mean .*\); use head_chunks=1$"):
        split_head(trace(spec.model, spec.example_inputs), weighted, 4)
    with pytest.raises(LossHeadError, match=r"^head_chunks=2 splits the LM head together with its loss: pass loss_fn=$"):
        split_head(trace(spec.model, spec.example_inputs), None, 2)
    gm = attach_loss(trace(spec.model, spec.example_inputs), spec.loss_fn)
    with pytest.raises(LossHeadError, match=r"^the model already has an input named 'target'; rename it"):
        attach_loss(gm, spec.loss_fn)


def test_split_head_with_a_loss_module_and_label_smoothing():
    """``nn.CrossEntropyLoss`` is traced into its functional call, options kept; unflattened logits are refused."""
    spec = load_model("llama-demo", batch_size=2)
    ref = copy.deepcopy(spec.model)
    (x,), y = spec.example_inputs, spec.example_target
    ce = torch.nn.CrossEntropyLoss(label_smoothing=0.1)

    class TokenLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ce = ce

        def forward(self, logits, target):
            return self.ce(logits.flatten(0, 1), target.flatten())

    gm = attach_loss(trace(spec.model, (x,)), TokenLoss())
    assert chunk_loss_head(gm, 3).chunks == 3
    loss = gm(x, y)
    ref_loss = ce(ref(x).flatten(0, 1), y.flatten())
    torch.testing.assert_close(loss, ref_loss, **TOL)
    loss.backward()
    ref_loss.backward()
    assert_grads_equal(spec.model, ref)
    gm = attach_loss(trace(spec.model, (x,)), ce)  # class dim 1 would be the sequence: not a token loss
    assert chunk_loss_head(gm, 3).reason.startswith("cross_entropy must see [tokens, vocab] logits")


def test_pipeline_with_split_head_matches_eager():
    spec = load_model("llama-demo", batch_size=6)
    ref = copy.deepcopy(spec.model)
    (x,), y = spec.example_inputs, spec.example_target
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu", "cpu"], microbatches=3,
                             spec=FINE_CPU, time_limit_s=2.0, example_target=y, head_chunks=4)
    assert _ce_count(pipe.gm) == 4
    loss = pipe.forward_backward(x, target=y)
    ref_loss = spec.loss_fn(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(spec.model, ref)
    with pytest.raises(rpcompile.RPCompileError, match=r"pass the batch's target, forward_backward\(x, target=y\)"):
        pipe.forward_backward(x)
    # the loss is inside the graph: a label the head has no class for is refused on the host, before anything runs
    # (on a GPU the chunks' cross-entropy would stop at a device-side assert)
    assert pipe.classes == spec.model.lm_head.out_features
    beyond = y.index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor(pipe.classes))
    with pytest.raises(rpcompile.InputError, match=rf"^target has label {pipe.classes}, beyond the {pipe.classes} "
                                                   r"classes of the model's output"):
        pipe.forward_backward(x, target=beyond)


def test_split_head_needs_a_loss_and_a_sequence_target():
    spec = load_model("llama-demo", batch_size=2)
    with pytest.raises(ValueError, match=r"head_chunks=2 splits the LM head together with its loss: pass loss_fn= "
                                         r"and example_target="):
        rpcompile.plan(spec.model, spec.example_inputs, gpus=2, spec="cpu", head_chunks=2)
    with pytest.raises(ValueError, match=r"the target must be a \[batch, sequence\] tensor, got torch.Size\(\[1\]\)"):
        rpcompile.plan(spec.model, spec.example_inputs, gpus=2, spec="cpu", microbatches=2, head_chunks=2,
                       loss_fn=spec.loss_fn, example_target=torch.zeros(2, dtype=torch.long))


def test_split_head_plan_file_round_trip_and_reuse(tmp_path):
    """The plan records head_chunks (only when > 1), and compile(plan=...) rebuilds the same graph from it."""
    spec = load_model("llama-demo", batch_size=6)
    (x,), y = spec.example_inputs, spec.example_target
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=spec.loss_fn, devices=["cpu", "cpu"], microbatches=3,
                             spec=FINE_CPU, time_limit_s=2.0, example_target=y, head_chunks=3)
    assert pipe.plan.head_chunks == 3 and pipe.plan.to_dict()["head_chunks"] == 3
    path = pipe.plan.save(tmp_path / "split.json")
    plain = rpcompile.plan(spec.model, (x,), gpus=2, spec="cpu", microbatches=3, time_limit_s=1.0)
    assert plain.head_chunks == 1 and "head_chunks" not in plain.to_dict()

    fresh = load_model("llama-demo", batch_size=6)
    ref = copy.deepcopy(fresh.model)
    again = rpcompile.compile(fresh.model, (x,), loss_fn=fresh.loss_fn, devices=["cpu", "cpu"], plan=path)
    assert again.plan.head_chunks == 3 and _ce_count(again.gm) == 3
    loss = again.forward_backward(x, target=y)
    ref_loss = fresh.loss_fn(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(fresh.model, ref)


def test_cli_plans_and_checks_a_split_head(tmp_path, capsys):
    out = tmp_path / "split.json"
    assert main(["plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--head-chunks", "4", "-o", str(out),
                 "--json"]) == 0
    capsys.readouterr()
    assert rpcompile.Plan.load(out).head_chunks == 4
    assert main(["check", str(out), "llama-demo"]) == 0


def test_auto_head_chunk_candidates():
    target = torch.zeros(2, 64, dtype=torch.long)
    assert head_chunk_candidates("auto", F.cross_entropy, target) == (1, AUTO_HEAD_CHUNKS)
    assert head_chunk_candidates("auto", F.cross_entropy, target[:, :3]) == (1, 3)  # no more chunks than tokens
    assert head_chunk_candidates("auto", None, target) == (1,)  # no loss: nothing to split with the head
    assert head_chunk_candidates("auto", F.cross_entropy, torch.zeros(2, dtype=torch.long)) == (1,)  # no sequence
    assert head_chunk_candidates(4, None, None) == (4,)
    for bad in (0, -1, True, "eight", 2.0):
        with pytest.raises(ValueError, match=r"head_chunks must be a positive integer or 'auto', got "):
            head_chunk_candidates(bad, None, None)


def test_fastest_keeps_the_shortest_prediction_and_skips_refusals():
    times = {1: 3.0, 4: 2.0, 8: 2.0}
    assert fastest((1, 4, 8), lambda k: (times[k], k)) == 4  # the first of equals wins
    assert fastest((1, 8), lambda k: (times[k], k)) == 8

    def refuse(k):
        if k > 1:
            raise ValueError("head_chunks=8: the LM head cannot be split (no Linear)")
        return times[k], k

    assert fastest((1, 8), refuse) == 1
    with pytest.raises(ValueError, match="cannot be split"):
        fastest((8,), refuse)  # asked for explicitly: the refusal is the answer

    def infeasible(k):
        raise InfeasibleError(f"no plan with {k}")

    with pytest.raises(InfeasibleError, match="no plan with 1"):  # every candidate failed: the first error
        fastest((1, 8), infeasible)

    def whole_head_broken(k):
        if k == 1:
            raise ValueError("precision must be one of ...")
        return times[k], k

    with pytest.raises(ValueError, match="precision"):  # only a split may be refused; the whole head's error stands
        fastest((1, 8), whole_head_broken)
    assert fastest((1, 8), lambda k: (times[k], k) if k > 1 else infeasible(k)) == 8  # only the chunks fit


def test_auto_plans_both_heads_and_keeps_the_faster():
    spec = load_model("llama-demo", batch_size=6)
    (x,), y = spec.example_inputs, spec.example_target
    kw = dict(gpus=2, spec="rtx4090", microbatches=3, time_limit_s=10.0, loss_fn=spec.loss_fn, example_target=y)
    # a limit the solves never reach on this tiny model: a solve cut short by the clock (a loaded machine) would
    # make the two plannings of one head differ
    whole = rpcompile.plan(spec.model, (x,), head_chunks=1, **kw)
    split = rpcompile.plan(spec.model, (x,), head_chunks=8, **kw)
    auto = rpcompile.plan(spec.model, (x,), **kw)  # head_chunks="auto" is the default
    assert (whole.head_chunks, split.head_chunks) == (1, 8)
    faster = min((whole, split), key=lambda p: p.predicted.iteration_time_s)
    assert auto.head_chunks == faster.head_chunks
    assert auto.predicted.iteration_time_s == pytest.approx(faster.predicted.iteration_time_s)
    # without a target there is nothing to split the head with: the whole head, no error
    assert rpcompile.plan(spec.model, (x,), gpus=2, spec="rtx4090", microbatches=3, time_limit_s=1.0).head_chunks == 1


def test_auto_compile_of_a_model_whose_head_cannot_split_trains_as_eager():
    """Logits not flattened to tokens cannot be split: auto falls back to the whole head, the loss stays outside."""
    spec = load_model("llama-demo", batch_size=6)
    ref = copy.deepcopy(spec.model)
    (x,), y = spec.example_inputs, spec.example_target
    classes_first = lambda out, t: F.cross_entropy(out.transpose(1, 2), t)  # noqa: E731
    pipe = rpcompile.compile(spec.model, (x,), loss_fn=classes_first, devices=["cpu", "cpu"], microbatches=3,
                             spec=FINE_CPU, time_limit_s=1.0, example_target=y)
    assert pipe.plan.head_chunks == 1 and _ce_count(pipe.gm) == 0
    loss = pipe.forward_backward(x, target=y)
    ref_loss = classes_first(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads_equal(spec.model, ref)


def test_cli_head_chunks_flag(capsys):
    for bad in ("0", "x"):
        with pytest.raises(SystemExit):
            main(["plan", "llama-demo", "--gpus", "2", "--head-chunks", bad])
        assert f"argument --head-chunks: expected a positive integer or auto, got '{bad}'" in capsys.readouterr().err
    # a split the model cannot take is one line, not a traceback
    for command in ("plan", "simulate"):
        assert main([command, "cnn-demo", "--gpus", "2", "--spec", "rtx4090", "--head-chunks", "4"]) == 2
        assert re.match(r"rpcompile: error: head_chunks=4 splits along the sequence: the target must be a "
                        r"\[batch, sequence\] tensor, got torch.Size\(\[\d\]\)$", capsys.readouterr().err)
