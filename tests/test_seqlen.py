"""The longest sequence that fits (rpcompile/planner/seqlen.py, ``rpcompile plan --max-seq-len``), on a tiny model with a
small memory limit: the bisection's answer fits and one granularity more does not, the binding stage is the one
at the limit, and the command line's output and exit codes."""

from __future__ import annotations

import pytest

import rpcompile
from rpcompile.cli import main
from rpcompile.core.errors import InfeasibleError
from rpcompile.models.registry import load_model
from rpcompile.planner.seqlen import SeqLenResult, max_sequence_length

LIMIT = 16 * 2**20  # llama-demo's activations pass this between 4K and 8K tokens per microbatch
G = 1024


@pytest.fixture(scope="module")
def found() -> SeqLenResult:
    return max_sequence_length("llama-demo", gpus=2, spec="rtx4090", memory_limit=LIMIT, granularity=G,
                               head_chunks=8, time_limit_s=1.0)


def _plan_at(seq_len: int) -> rpcompile.Plan:
    ms = load_model("llama-demo", seq_len=seq_len, batch_size=3, device="meta")
    return rpcompile.plan(ms.model, ms.example_inputs, gpus=2, spec="rtx4090", memory_limit=LIMIT, precision="bf16",
                          time_limit_s=1.0, loss_fn=ms.loss_fn, example_target=ms.example_target, head_chunks=8)


def test_boundary_exact(found):
    assert found.seq_len % G == 0 and found.seq_len >= 4 * G
    assert found.refused is not None and found.refused.seq_len == found.seq_len + G and not found.refused.feasible
    assert found.refused.need_bytes > LIMIT
    probes = {p.seq_len: p.feasible for p in found.probes}
    assert probes[found.seq_len] and all(ok == (n <= found.seq_len) for n, ok in probes.items())
    # independently of the search: the planner accepts the answer and refuses one granularity more
    assert _plan_at(found.seq_len).predicted.peak_memory_bytes <= LIMIT
    with pytest.raises(InfeasibleError):
        _plan_at(found.seq_len + G)


def test_binding_stage_is_the_one_at_the_limit(found):
    b, stages = found.binding, found.plan.stages
    at_limit = max(stages, key=lambda s: s.memory_bytes)
    assert b.stage == at_limit.name and b.memory_bytes == at_limit.memory_bytes == found.plan.predicted.peak_memory_bytes
    assert b.limit_bytes == LIMIT and 0.9 * LIMIT < b.memory_bytes <= LIMIT
    assert b.weight_bytes + b.activation_bytes == b.memory_bytes
    assert b.dominated_by == "activations"  # a tiny model: its weights are kilobytes
    lines = found.lines()
    assert lines[0].startswith(f"longest sequence that fits (a prediction of the analytic cost model): {found.seq_len} "
                               "tokens per microbatch of one sequence, 3 microbatches, LM head in 8 chunks")
    assert lines[1].startswith(f"binds: stage {b.stage} at ") and lines[1].endswith("activations dominate")
    assert lines[2].startswith(f"{found.seq_len + G} tokens do not fit: segment ")
    d = found.to_dict()
    assert d["prediction"] is True and d["seq_len"] == found.seq_len and d["binding"]["stage"] == b.stage


def test_cli(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    code = main(["plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--memory-limit", "16MiB", "--max-seq-len",
                 "--granularity", "4096", "--head-chunks", "8", "--time-limit", "1", "-o", str(out_file)])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "llama-demo at 4096 tokens: ilp plan" in out
    assert ("longest sequence that fits (a prediction of the analytic cost model): 4096 tokens per microbatch of one "
            "sequence") in out
    assert "8192 tokens do not fit: segment " in out and "binds: stage " in out
    assert rpcompile.Plan.load(str(out_file)).microbatches == 3


def test_cli_errors(capsys):
    code = main(["plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--max-seq-len", "--seq-len", "64"])
    _, err = capsys.readouterr()
    assert code == 2 and "drop --seq-len and --batch-size" in err
    code = main(["plan", "llama-demo", "--gpus", "2", "--spec", "rtx4090", "--memory-limit", "64KiB", "--max-seq-len",
                 "--granularity", "4096", "--head-chunks", "8", "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.strip() == ("rpcompile: error: not even 4096 tokens per microbatch fit: lower granularity, add devices "
                           "or memory")



def test_the_search_takes_the_planner_s_options_as_one_object(found):
    """``options=rpcompile.PlanOptions(...)`` instead of the planner keywords: the same search, the same answer;
    a planner keyword beside it, or a device to measure on (the search is analytic), refused in one line."""
    options = rpcompile.PlanOptions(gpus=2, spec="rtx4090", memory_limit=LIMIT, precision="bf16", head_chunks=8,
                                    time_limit_s=1.0)
    again = max_sequence_length("llama-demo", granularity=G, options=options)
    assert (again.seq_len, again.head_chunks, again.microbatches) == (found.seq_len, found.head_chunks,
                                                                      found.microbatches)
    assert [(p.seq_len, p.feasible, p.need_bytes) for p in again.probes] == \
        [(p.seq_len, p.feasible, p.need_bytes) for p in found.probes]
    with pytest.raises(rpcompile.ConfigError, match=r"^max_sequence_length: gpus given beside options="):
        max_sequence_length("llama-demo", gpus=4, options=options)
    with pytest.raises(rpcompile.ConfigError, match=r"^max_sequence_length predicts with analytic costs"):
        max_sequence_length("llama-demo", options=rpcompile.PlanOptions(gpus=2, device="cpu"))
