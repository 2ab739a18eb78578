"""The command line: help, profile tables and JSON, bad MODEL arguments, the console script."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rpcompile.cli import main

PROFILE_FIELDS = {"params", "param_bytes", "fwd_flops", "fwd_time_s", "bwd_time_s", "activation_bytes"}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_console_script_help():
    done = subprocess.run([sys.executable, "-m", "rpcompile", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    for command in ("profile", "plan", "demo", "models"):
        assert command in done.stdout


def test_models_lists_builtins(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0
    assert {"llama-demo", "gpt-demo", "cnn-demo", "llama-8b"} <= set(out.split())


def test_profile_json_schema(capsys):
    code, out, _ = run(capsys, "profile", "llama-demo", "--json")
    assert code == 0
    data = json.loads(out)
    assert PROFILE_FIELDS <= set(data["total"])
    names = [m["name"] for m in data["modules"]]
    assert names[:2] == ["(root)", "embed"] and "layers.3" in names and names[-1] == "lm_head"
    for m in data["modules"]:
        assert PROFILE_FIELDS | {"name"} <= set(m)
    assert sum(m["params"] for m in data["modules"]) == data["total"]["params"]
    assert data["total"]["fwd_time_s"] > 0 and data["trace"] == "fx"


def test_profile_nodes_json(capsys):
    code, out, _ = run(capsys, "profile", "cnn-demo", "--json", "--nodes")
    data = json.loads(out)
    assert code == 0 and len(data["nodes"]) == sum(m["nodes"] for m in data["modules"])


def test_profile_llama8b_analytic_on_meta(capsys):
    code, out, _ = run(capsys, "profile", "llama-8b", "--spec", "rtx4090", "--dtype", "bf16", "--json")
    assert code == 0
    total = json.loads(out)["total"]
    assert abs(total["params"] - 8.03e9) / 8.03e9 < 0.01
    assert total["param_bytes"] == total["params"] * 4  # fp32 masters
    # forward FLOPs of one 4096-token sequence: ~2 * params * tokens plus attention
    assert 2 * 8.0e9 * 4096 < total["fwd_flops"] < 2.4 * 8.0e9 * 4096
    assert 0.1 < total["fwd_time_s"] < 2.0 and total["bwd_time_s"] > total["fwd_time_s"]


def test_profile_table_mentions_modules(capsys):
    code, out, _ = run(capsys, "profile", "gpt-demo", "--spec", "rtx4090")
    assert code == 0
    rows = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert rows == ["(root)", "wte", "wpe", "drop", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "lm_head", "total"]


def test_unknown_model_is_one_line_error(capsys):
    code, out, err = run(capsys, "profile", "no-such-model")
    assert code == 2 and out == ""
    assert err.startswith("rpcompile: error: unknown model 'no-such-model'") and err.count("\n") == 1


def test_bad_factory_file(capsys, tmp_path):
    path = tmp_path / "m.py"
    path.write_text("x = 1\n")
    code, _, err = run(capsys, "profile", f"{path}:factory")
    assert code == 2 and "factory" in err and err.count("\n") == 1


def test_spec_and_device_are_exclusive(capsys):
    with pytest.raises(SystemExit) as info:
        main(["profile", "llama-demo", "--spec", "rtx4090", "--device", "cpu"])
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_batch_too_small_for_microbatches_is_one_line(capsys):
    code, out, err = run(capsys, "plan", "llama-demo", "--gpus", "4", "--spec", "rtx4090", "--batch-size", "4")
    assert code == 2 and out == ""
    assert err == ("rpcompile: error: a batch of 4 cannot be split into 5 microbatches; use microbatches between "
                   "1 and 4 (--microbatches) or a larger batch (--batch-size)\n")


def test_a_small_example_batch_grows_to_one_sample_per_microbatch(capsys):
    """Without --batch-size, a built-in model whose example batch is smaller than the microbatch count (the meta
    presets have one sequence) is loaded with one sample per microbatch."""
    code, out, _ = run(capsys, "plan", "llama-demo", "--gpus", "4", "--spec", "rtx4090", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["microbatches"] == 5 and plan["tokens_per_microbatch"] == 32
