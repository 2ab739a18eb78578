"""rpcompile.core.files (issue 36): one safe atomic write for every file, and strict bounded JSON reads.

A link planted at any name a writer could be predicted to use is never followed; two writers into one directory
(threads and processes) never harm each other and the result is one whole file; a temporary is swept only when
its owner is provably dead (same host, pid gone). Strict JSON: no NaN/Infinity, no numbers beyond int64 or a float,
no nesting deeper than asked, no bytes that are not UTF-8: one line each.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rpcompile.core import files
from rpcompile.core.files import (atomic_directory, host_name, parse_json, read_limited, remove_atomically,
                                  sweep_temporaries, temporary_owner, write_atomic, write_atomic_hashed)
from rpcompile.core.plan import Plan

GOLDEN = Path(__file__).parent / "golden" / "cnn-demo.json"
HOST = host_name()


def _planted(tmp_path: Path, name: str) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / name).symlink_to(victim)
    return victim


@pytest.mark.parametrize("name", ["plan.json.tmp", ".plan.json.tmp{pid}", ".tmp-plan.json"])
def test_plan_save_follows_no_link_planted_at_a_predictable_name(tmp_path, name):
    victim = _planted(tmp_path, name.format(pid=os.getpid()))
    Plan.load(GOLDEN).save(tmp_path / "plan.json")
    assert victim.read_text() == "precious"
    assert Plan.load(tmp_path / "plan.json") == Plan.load(GOLDEN)


def test_a_link_at_the_temporary_s_own_name_is_refused_and_another_name_taken(tmp_path, monkeypatch):
    """Even the random part guessed: O_EXCL | O_NOFOLLOW refuses the link and the writer draws again."""
    tokens = iter(["0" * 16, "1" * 16])
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(tokens))
    victim = _planted(tmp_path, f".out.json.{HOST}.{os.getpid()}.{'0' * 16}.tmp")
    write_atomic(tmp_path / "out.json", "{}")
    assert victim.read_text() == "precious" and (tmp_path / "out.json").read_text() == "{}"


def test_a_link_at_the_target_is_replaced_not_written_through(tmp_path):
    victim = _planted(tmp_path, "plan.json")
    Plan.load(GOLDEN).save(tmp_path / "plan.json")
    assert victim.read_text() == "precious" and not (tmp_path / "plan.json").is_symlink()


def test_a_failed_write_leaves_neither_the_target_nor_a_temporary(tmp_path):
    def boom(f):
        f.write(b"half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_atomic(tmp_path / "x.bin", boom)
    assert list(tmp_path.iterdir()) == []


GOLDENS = [GOLDEN, GOLDEN.with_name("llama-demo.json")]


def test_threads_saving_one_plan_file_all_succeed_and_leave_one_whole_plan(tmp_path):
    target, errors = tmp_path / "plan.json", []
    plans = [Plan.load(g) for g in GOLDENS] * 3

    def save(plan: Plan) -> None:
        try:
            for _ in range(5):
                plan.save(target)
        except Exception as e:  # noqa: BLE001 - collected: a thread's exception would vanish
            errors.append(e)

    threads = [threading.Thread(target=save, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and Plan.load(target) in plans[:2]
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


_SAVER = """
import sys
from rpcompile.core.plan import Plan
plan = Plan.load(sys.argv[2])
for _ in range(20):
    plan.save(sys.argv[1])
"""


def test_two_processes_saving_into_one_directory_both_succeed(tmp_path):
    """Two ranks (or two runs) saving side by side: neither deletes the other's temporary in flight."""
    target = tmp_path / "plan.json"
    procs = [subprocess.Popen([sys.executable, "-c", _SAVER, str(target), str(g)], stderr=subprocess.PIPE)
             for g in GOLDENS]
    errors = [p.communicate(timeout=120)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    assert Plan.load(target) in [Plan.load(g) for g in GOLDENS]
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_only_temporaries_of_dead_processes_on_this_host_are_swept(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {"dead": f".plan.json.{HOST}.{_dead_pid()}.{'a' * 16}.tmp",
                 "live": f".plan.json.{HOST}.{live.pid}.{'b' * 16}.tmp",
                 "mine": f".plan.json.{HOST}.{os.getpid()}.{'c' * 16}.tmp",
                 "other host": f".plan.json.{HOST}x.{_dead_pid()}.{'d' * 16}.tmp",
                 "not ours": ".plan.json.tmp"}
        for n in names.values():
            (tmp_path / n).write_text("partial")
        assert sweep_temporaries(tmp_path) == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k != "dead")
    finally:
        live.kill()
        live.wait()


def test_a_write_sweeps_its_target_s_dead_temporaries_only(tmp_path):
    dead = _dead_pid()
    mine, other = (tmp_path / f".{n}.{HOST}.{dead}.{'a' * 16}.tmp" for n in ("plan.json", "other.json"))
    mine.write_text("partial")
    other.write_text("partial")
    write_atomic(tmp_path / "plan.json", "{}")
    assert not mine.exists() and other.exists()


def test_a_directory_appears_whole_or_not_at_all(tmp_path):
    """:func:`atomic_directory` (a checkpoint): filled under a temporary name, renamed into place; an error while
    filling leaves neither the target nor a temporary; an existing target (a directory, or a link — replaced,
    never followed) gives way only once the new one is complete."""
    target = tmp_path / "ckpt-1"
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as tmp:
            write_atomic(tmp / "a", "half")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    for content in ("first", "second"):
        with atomic_directory(target) as tmp:
            assert not target.exists() or (target / "a").read_text() == "first"  # the old one until the rename
            assert temporary_owner(tmp.name) == (HOST, os.getpid())
            write_atomic(tmp / "a", content)
        assert (target / "a").read_text() == content and [p.name for p in tmp_path.iterdir()] == ["ckpt-1"]
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "a").write_text("precious")
    remove_atomically(target)
    target.symlink_to(victim)
    with atomic_directory(target) as tmp:
        write_atomic(tmp / "a", "new")
    assert (victim / "a").read_text() == "precious" and not target.is_symlink() and (target / "a").read_text() == "new"
    assert write_atomic_hashed(tmp_path / "h", b"abc") == (3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")


def test_a_dead_writer_s_temporary_directory_is_swept(tmp_path):
    dead = tmp_path / f".ckpt-1.{HOST}.{_dead_pid()}.{'a' * 16}.tmp"
    mine = tmp_path / f".ckpt-2.{HOST}.{os.getpid()}.{'b' * 16}.tmp"
    for d in (dead, mine):
        d.mkdir()
        (d / "model.safetensors").write_text("partial")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    (dead / "link").symlink_to(outside)
    assert sweep_temporaries(tmp_path) == 1
    assert not dead.exists() and mine.exists() and (outside / "keep").exists()


def test_temporary_names_carry_host_and_pid(tmp_path, monkeypatch):
    seen = []
    real = os.replace
    monkeypatch.setattr(files.os, "replace", lambda a, b: (seen.append(Path(a).name), real(a, b)))
    write_atomic(tmp_path / "plan.json", "{}")
    assert temporary_owner(seen[0]) == (HOST, os.getpid())
    assert socket.gethostname() and temporary_owner("plan.json.tmp") is None


@pytest.mark.parametrize("raw, message", [
    (b'{"a": \xff}', r"^byte 6 is not UTF-8 text \(0xff\)$"),
    (b'{"a": NaN}', r"^NaN is not a number such a file holds$"),
    (b'{"a": -Infinity}', r"^-Infinity is not a number such a file holds$"),
    (b'{"a": 1e400}', r"^the number 1e400 is out of range \(beyond a float\)$"),
    (b'{"a": 1' + b"0" * 400 + b"}", r"^the number 1000000000000\S*… is out of range \(beyond 2\*\*63\)$"),
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", r"^nested deeper than 8 levels$"),
    (b'{"a": ' + b"[" * 20 + b"]" * 20 + b"}", r"^nested deeper than 8 levels$"),
    (b'{"a": [1, 2}', r"^invalid JSON at line 1 column 12"),
])
def test_strict_json_names_each_problem_in_one_line(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_json(raw, max_depth=8)


def test_a_file_beyond_its_bound_is_refused_unread(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 1001)
    assert read_limited(tmp_path / "big", 1001) == b"x" * 1001
    with pytest.raises(ValueError, match=r"^larger than 1,000 bytes"):
        read_limited(tmp_path / "big", 1000)
