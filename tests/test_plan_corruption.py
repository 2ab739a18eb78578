"""A corrupted plan file gives one line, never a traceback (issue 21: 8 of 50 bit flips gave a UnicodeDecodeError).

Hypothesis corrupts a golden plan (tests/golden/cnn-demo.json, the smallest) three ways — flipped bits, a
truncated file, a JSON value swapped for one of another type — and checks the property: ``Plan.load`` either
raises :class:`PlanFileError` in one line naming the file, or returns a plan (a flip inside a number or a name can
leave a well-formed plan that says something else; ``rpcompile check`` judges it against the model), and
``rpcompile show`` and ``rpcompile simulate`` on the file exit 0, or 2 with one ``rpcompile: error:`` line — never
the catch-all "unexpected" line. A few dozen examples by default; ``-m slow`` runs many more."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpcompile.cli import main
from rpcompile.core.errors import PlanFileError
from rpcompile.core.plan import Plan

GOLDEN = Path(__file__).parent / "golden" / "cnn-demo.json"
RAW = GOLDEN.read_bytes()
DATA = json.loads(RAW)
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SLOW = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside the JSON tree (keys and list indices)."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


PATHS = _paths(DATA)
OTHER_TYPES = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                        st.text(max_size=8), st.just([]), st.just({}), st.just([1, "x"]), st.just({"a": 1}))


def _swapped(path: tuple, value: Any) -> bytes:
    data = json.loads(RAW)
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return json.dumps(data).encode()


def _flipped(bits: list[int]) -> bytes:
    raw = bytearray(RAW)
    for b in bits:
        raw[b // 8] ^= 1 << (b % 8)
    return bytes(raw)


def _assert_one_line(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The property (module docstring) for the plan file at ``path``."""
    try:
        Plan.load(path)
    except PlanFileError as e:
        assert "\n" not in str(e) and str(path) in str(e), str(e)
    for argv in (["show", str(path)], ["simulate", str(path), "--json"]):
        code = main(argv)
        out, err = capsys.readouterr()
        assert code in (0, 2), (argv, err)
        assert all(c == "\n" or c.isprintable() for c in out + err), (argv, out, err)  # no escape reaches a terminal
        if code == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("rpcompile: error: "), (argv, err)
            assert "unexpected" not in err and "Traceback" not in err, (argv, err)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("corrupt") / "plan.json"


def test_the_golden_plan_loads_and_shows(plan_file, capsys):
    shutil.copy(GOLDEN, plan_file)
    assert main(["show", str(plan_file)]) == 0
    assert Plan.from_dict(json.loads(Plan.load(plan_file).to_json())) == Plan.load(plan_file)


def _bit_flips(plan_file, capsys, bits):
    plan_file.write_bytes(_flipped(bits))
    _assert_one_line(plan_file, capsys)


def _truncation(plan_file, capsys, length):
    plan_file.write_bytes(RAW[:length])
    _assert_one_line(plan_file, capsys)


def _type_swap(plan_file, capsys, path, value):
    plan_file.write_bytes(_swapped(path, value))
    _assert_one_line(plan_file, capsys)


def _at(path: tuple) -> Any:
    node: Any = DATA
    for key in path:
        node = node[key]
    return node


NUMBER_PATHS = [p for p in PATHS if isinstance(_at(p), (int, float)) and not isinstance(_at(p), bool)]
HOSTILE_NUMBERS = st.sampled_from(["-1", "-0.5", "NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" + "0" * 400,
                                   "1e300", str(2**63), str(2**53 + 1), "1e19", "0", "4097", "100000000"])


def _hostile_number(plan_file, capsys, path, text):
    """Issue 36: every hostile number in every numeric field is refused in one line or harmless — in bounded time
    (10**8 microbatches ran 19 s into a MemoryError)."""
    plan_file.write_bytes(_swapped(path, "@@").replace(b'"@@"', text.encode()))
    start = time.monotonic()
    _assert_one_line(plan_file, capsys)
    assert time.monotonic() - start < 30, (path, text)


BITS = st.lists(st.integers(0, len(RAW) * 8 - 1), min_size=1, max_size=3)
LENGTHS = st.integers(0, len(RAW) - 1)
SWAPS = dict(path=st.sampled_from(PATHS), value=OTHER_TYPES)


@FAST
@given(bits=BITS)
def test_bit_flips_give_one_line(plan_file, capsys, bits):
    _bit_flips(plan_file, capsys, bits)


@FAST
@given(length=LENGTHS)
def test_truncations_give_one_line(plan_file, capsys, length):
    _truncation(plan_file, capsys, length)


@FAST
@given(**SWAPS)
def test_type_swaps_give_one_line(plan_file, capsys, path, value):
    _type_swap(plan_file, capsys, path, value)


@FAST
@given(path=st.sampled_from(NUMBER_PATHS), text=HOSTILE_NUMBERS)
def test_hostile_numbers_give_one_line(plan_file, capsys, path, text):
    _hostile_number(plan_file, capsys, path, text)


@pytest.mark.slow
@SLOW
@given(path=st.sampled_from(NUMBER_PATHS), text=HOSTILE_NUMBERS)
def test_many_hostile_numbers_give_one_line(plan_file, capsys, path, text):
    _hostile_number(plan_file, capsys, path, text)


@pytest.mark.slow
@SLOW
@given(bits=BITS)
def test_many_bit_flips_give_one_line(plan_file, capsys, bits):
    _bit_flips(plan_file, capsys, bits)


@pytest.mark.slow
@SLOW
@given(**SWAPS)
def test_many_type_swaps_give_one_line(plan_file, capsys, path, value):
    _type_swap(plan_file, capsys, path, value)


def test_every_byte_that_is_not_utf8_is_a_plan_file_error(plan_file):
    """The issue's UnicodeDecodeError: the high bit of one byte of a name."""
    at = RAW.index(b'"forward"') + 2
    plan_file.write_bytes(_flipped([at * 8 + 7]))
    with pytest.raises(PlanFileError, match=rf"^{plan_file} is corrupt: byte {at} is not UTF-8 text \(0xef\); "
                                            "re-plan to regenerate it$"):
        Plan.load(plan_file)


@pytest.mark.parametrize("path, value, message", [
    (("microbatches",), "3", r"microbatches: expected an integer, found a string \('3'\)"),
    (("microbatches",), 0, r"microbatches: must be >= 1, found 0"),
    (("microbatches",), True, r"microbatches: expected an integer, found a boolean \(true\)"),
    (("stages", 0, "time_s"), -1.0, r"stages\[0\]\.time_s: must be a finite number >= 0, found -1\.0"),
    (("stages", 0, "nodes"), "conv1", r"stages\[0\]\.nodes: expected a list, found a string"),
    (("stages", 0, "nodes", 0), 7, r"stages\[0\]\.nodes\[0\]: expected a string, found a number \(7\)"),
    (("stages", 0, "kind"), "fused", r"stages: kinds must run forward…, one fused, backward…"),
    (("stages", 1, "name"), "F0", r"stages: the name 'F0' appears twice"),
    (("stages",), [], r"stages: empty"),
    (("hardware", "device_count"), 0, r"hardware\.device_count: must be >= 1, found 0"),
    (("hardware", "spec", "tensor_flops"), None, r"hardware\.spec\.tensor_flops: expected a number, found null"),
    (("hardware", "spec", "efficiency", "conv"), "x", r"hardware\.spec\.efficiency\.conv: expected a number"),
    (("predicted", "bubble_fraction"), 1.5, r"predicted\.bubble_fraction: must be in \[0, 1\], found 1\.5"),
    (("model",), [], r"model: expected a JSON object, found a list"),
    (("model", "num_nodes"), 1e300, r"model\.num_nodes: expected an integer, found a number \(1e\+300\)"),
])
def test_each_corrupt_field_is_named(plan_file, path, value, message):
    plan_file.write_bytes(_swapped(path, value))
    with pytest.raises(PlanFileError, match=rf"^{plan_file} is corrupt: {message}.*; re-plan to regenerate it$"):
        Plan.load(plan_file)


@pytest.mark.parametrize("text, message", [
    ('{"schema_version": 3, "microbatches": NaN}', r"NaN is not a number a plan holds"),
    ('{"schema_version": 3, "microbatches": Infinity}', r"Infinity is not a number a plan holds"),
])
def test_non_numbers_are_refused(plan_file, text, message):
    plan_file.write_text(text)
    with pytest.raises(PlanFileError, match=rf"^{plan_file} is corrupt: {message}; re-plan to regenerate it$"):
        Plan.load(plan_file)


def test_an_unknown_field_is_named(plan_file):
    data = json.loads(RAW)
    data["stages"][0]["colour"] = "red"
    plan_file.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"is corrupt: stages\[0\]: unknown field 'colour'; re-plan"):
        Plan.load(plan_file)
