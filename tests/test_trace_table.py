"""benchmarks/trace_table.py on a hand-made trace whose every number is known."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import trace_table  # noqa: E402  (benchmarks/ is scripts, not a package)


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur, "args": args}


#: GPU window 0..1000 µs: kernels 0-100 and 300-400 and 900-1000 (two streams overlapping at 300-400); an upload
#: 100-300 (the gap 100-300 waited for it), a host sync 400-700 (gap 400-900: 300 of 500 µs synced -> host sync),
#: then nothing; flow events and unknown rows are ignored
EVENTS = [
    {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "python3"}},
    _x("kernel", "gemm", 0, 100, tid=7, stream=7), _x("kernel", "gemm", 300, 100, tid=7), _x("kernel", "add", 350, 50, tid=8),
    _x("kernel", "gemm", 900, 100, tid=7),
    _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 100, 200, tid=9, bytes=1 << 20),
    _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 950, 30, tid=10),
    _x("cuda_runtime", "cudaStreamSynchronize", 400, 300, tid=3),
    _x("cuda_runtime", "cudaMemcpyAsync", 390, 5, tid=3),  # not a blocking call
    _x("cpu_op", "aten::linear", 0, 600, tid=1), _x("cpu_op", "aten::mm", 10, 500, tid=1),  # mm inside linear
    _x("cpu_op", "aten::to", 700, 250, tid=1),
    {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 5}, {"ph": "X", "cat": "kernel", "ts": "x"}, "junk",
]


def test_the_numbers_of_a_known_trace():
    r = trace_table.analyse(EVENTS, min_gap_us=50, top=3)
    assert r["window_ms"] == pytest.approx(1.0)
    assert r["busy_ms"] == pytest.approx({"compute": 0.3, "copy DtoH": 0.03, "copy HtoD": 0.2})
    assert r["busy_share"]["compute"] == pytest.approx(0.3)
    gaps = r["gaps"]
    assert gaps["count"] == 2 and gaps["ms"] == pytest.approx(0.7)
    assert gaps["by_cause"] == {"upload": {"gaps": 1, "ms": pytest.approx(0.2)},
                                "host sync": {"gaps": 1, "ms": pytest.approx(0.5)}}
    assert [(g["start_ms"], g["cause"], g["host_op"]) for g in gaps["longest"]] == [
        (pytest.approx(0.4), "host sync", "cudaStreamSynchronize"), (pytest.approx(0.1), "upload", "aten::linear")]
    main, sync = r["threads"]
    assert main["tid"] == 1 and main["busy_ms"] == pytest.approx(0.85)  # linear (mm is inside it) + to
    assert [o["op"] for o in main["top"]] == ["aten::linear", "aten::to"]
    assert sync == {"tid": 3, "busy_ms": pytest.approx(0.3), "top": [{"op": "cudaStreamSynchronize",
                                                                      "ms": pytest.approx(0.3)}]}


def test_a_gap_nothing_covers_waited_for_the_host():
    r = trace_table.analyse([_x("kernel", "a", 0, 10), _x("kernel", "b", 200, 10)], min_gap_us=50)
    assert r["gaps"]["by_cause"] == {"host": {"gaps": 1, "ms": pytest.approx(0.19)}}


def test_slim_keeps_what_the_table_needs_and_perfetto_opens(tmp_path):
    out = tmp_path / "t.json.gz"
    trace_table.slim([e for e in EVENTS if isinstance(e, dict)], out)
    kept = json.loads(gzip.decompress(out.read_bytes()))["traceEvents"]
    assert {e.get("cat") for e in kept} == {None, "kernel", "gpu_memcpy", "cuda_runtime", "cpu_op"}
    assert [e["name"] for e in kept if e.get("cat") == "cuda_runtime"] == ["cudaStreamSynchronize"]
    assert trace_table.analyse(kept, min_gap_us=50) == trace_table.analyse(EVENTS, min_gap_us=50)
    assert [p.name for p in tmp_path.iterdir()] == ["t.json.gz"]  # no temporary left behind


def test_the_command_prints_tables_and_refuses_bad_files_in_one_line(tmp_path, capsys):
    path = tmp_path / "trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": EVENTS}).encode()))
    assert trace_table.main([str(path), "--json", str(tmp_path / "t.json")]) == 0
    assert "compute idle: 2 gaps" in capsys.readouterr().out
    assert json.loads((tmp_path / "t.json").read_text())["gaps"]["count"] == 2
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": 3}')
    assert trace_table.main([str(bad)]) == 2
    assert capsys.readouterr().err == f"trace_table: {bad}: not a Chrome trace (no traceEvents list)\n"
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"traceEvents": [_x("cpu_op", "aten::mm", 0, 5)]}))
    assert trace_table.main([str(cpu)]) == 2
    assert "no GPU activity in this trace" in capsys.readouterr().err


def test_the_documented_command_on_the_kept_h100_trace(capsys):
    """benchmarks/README.md's command on the trace kept in the repository (1.7B, capped, H100, 2026-11-28): the
    figures RESULTS.md quotes."""
    trace = Path(__file__).resolve().parents[1] / "benchmarks/traces/h100-2026-11-28-llama-1.7b-capped.json.gz"
    assert trace_table.main([str(trace)]) == 0
    r = trace_table.analyse(trace_table.load(trace))
    assert r["window_ms"] == pytest.approx(2307.4, abs=0.1)
    assert r["busy_share"]["compute"] == pytest.approx(0.238, abs=0.001)
    assert r["gaps"]["by_cause"]["host"]["ms"] == pytest.approx(783.1, abs=0.1)


def test_the_gpu_session_script_parses_and_slims_its_traces(tmp_path):
    """benchmarks/gpu_session.sh (run only on the lent GPU machine): its syntax, and its ``slim`` step on a GPU trace
    (table and slim copy made, full trace removed) and on a trace without GPU activity (kept, gzipped)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    fn = re.search(r"^slim\(\) \{.*?^\}", script.read_text(), re.S | re.M).group(0)
    (tmp_path / "gpu.json").write_text(json.dumps({"traceEvents": EVENTS[:-1]}))
    (tmp_path / "cpu.json").write_text(json.dumps({"traceEvents": [_x("cpu_op", "aten::mm", 0, 5)]}))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", f"{fn}\nslim {tmp_path}"], check=True, env=env,
                   cwd=Path(__file__).resolve().parents[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cpu.json.gz", "cpu.table.txt", "gpu.slim.json.gz", "gpu.table.json", "gpu.table.txt"]
    assert json.loads((tmp_path / "gpu.table.json").read_text())["gaps"]["count"] == 2


def test_the_gpu_session_script_brings_each_step_home_as_one_archive(tmp_path):
    """The device tool brings back at most 8 files (an H200 session lost its 8B trace to that limit): each step's
    folder — results, plans, logs, traces, however many — becomes one archive $OUT/STEP.tgz and the folder goes;
    a step that wrote nothing leaves no archive."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh"
    fn = re.search(r"^pack\(\) \{.*?^\}", script.read_text(), re.S | re.M).group(0)
    work, out = tmp_path / "work" / "peer8b", tmp_path / "out"
    (work / "traces-8b").mkdir(parents=True)
    (work / "plans").mkdir()
    out.mkdir()
    for name in ("gpu-peer-8b.json", "gpu-peer-8b.txt", "traces-8b/a.slim.json.gz", "traces-8b/a.table.json",
                 "traces-8b/a.table.txt", "plans/capped.json"):
        (work / name).write_text(name)
    (tmp_path / "work" / "tests").mkdir()
    subprocess.run(["bash", "-c", f'{fn}\nOUT={out}\npack peer8b {work}\npack tests {tmp_path / "work" / "tests"}\n'
                    "true"], check=True)
    assert [p.name for p in out.iterdir()] == ["peer8b.tgz"] and not work.exists()
    with tarfile.open(out / "peer8b.tgz") as tar:
        names = sorted(m.name for m in tar.getmembers() if m.isfile())
        assert names == ["./gpu-peer-8b.json", "./gpu-peer-8b.txt", "./plans/capped.json", "./traces-8b/a.slim.json.gz",
                         "./traces-8b/a.table.json", "./traces-8b/a.table.txt"]
        assert tar.extractfile("./plans/capped.json").read() == b"plans/capped.json"
