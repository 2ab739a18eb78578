"""benchmarks/calibration.py: the recorded GPU rows re-predicted on the CPU (one row here; the full run is the
benchmark's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import calibration  # noqa: E402  (benchmarks/ is scripts, not a package)


def test_every_row_names_a_recorded_measurement():
    for row in calibration.ROWS:
        rec = calibration.recorded(row)
        assert rec["step_s"] > 0 and rec["predicted_s"] > 0, row.key
        assert row.modelled or row.note  # a row left out of the verdict says why


def test_a_row_is_re_predicted_by_both_models_on_the_same_cuts(tmp_path):
    out = tmp_path / "calibration.json"
    assert calibration.main(["--only", "resident-1.7b", "--time-limit", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert "not GPU measurements" in data["what"] and data["old_link"] == 25e9
    (row,) = data["rows"]
    assert row["measured_s"] == calibration.recorded(calibration.ROWS[0])["step_s"]
    assert row["new_over_measured"] == pytest.approx(row["new_prediction_then_s"] / row["measured_s"])
    # one microbatch of 4,096 tokens through the 1.7B shape: launch-bound stages under the new model
    assert row["launch_bound_stages"] > 0 and row["stages_replanned"] == row["stages_priced"]
    # the runtime then: the gradient sink into fresh memory (slower), hand-offs through host memory
    then = row["then_by_sink_rate"]
    assert then["1.5e+09"] > then["2e+09"] > then["3.33e+09"] >= row["new_prediction_s"]
    assert row["new_prediction_then_s"] == then["2e+09"]
