"""The simulator walks the executor's action lists: it reproduces the timing model and shows prefetch hiding."""

from __future__ import annotations

import random

import pytest

from rpcompile.passes.problem import pipeline_time
from rpcompile.runtime.schedule import round_robin
from rpcompile.runtime.simulator import SimStage, simulate


def kinds(f: int, b: int) -> list[str]:
    return ["forward"] * f + ["fused"] + ["backward"] * b


@pytest.mark.parametrize("stages,devices,m", [(5, 2, 3), (16, 8, 16), (7, 4, 4), (3, 4, 2), (1, 1, 1)])
def test_equal_stages_match_the_closed_form(stages, devices, m):
    lists = round_robin(kinds(stages // 2, stages - stages // 2 - 1), devices, m)
    t = 0.01
    res = simulate(lists, [t] * stages)
    expected = ((stages - 1) // devices * m + (stages - 1) % devices + m) * t  # DESIGN.md §3
    assert res.iteration_time_s == pytest.approx(expected)
    assert res.bubble_fraction == pytest.approx(1 - stages * m * t / (devices * expected))


def test_random_stage_times_match_the_timing_model():
    rng = random.Random(0)
    for _ in range(50):
        devices, m = rng.randint(1, 4), rng.randint(1, 6)
        f, b = rng.randint(0, 4), rng.randint(0, 4)
        times = [rng.uniform(0.001, 0.01) for _ in range(f + b + 1)]
        res = simulate(round_robin(kinds(f, b), devices, m), times)
        assert res.iteration_time_s == pytest.approx(pipeline_time(times, devices, m))


def stages(times, **per_stage):
    """SimStages with ``compute_s`` from ``times`` and any other field given as a list."""
    return [SimStage(name=str(k), compute_s=t, **{f: v[k] for f, v in per_stage.items()}) for k, t in enumerate(times)]


def test_prefetched_weights_hide_behind_the_previous_stage():
    lists = round_robin(kinds(1, 2), devices=2, microbatches=4)  # stages 0..3; device 0 runs 0 and 2
    base = simulate(lists, [1.0] * 4).iteration_time_s
    # a link of 1 byte/s makes bytes read as seconds
    hidden = simulate(lists, stages([1.0] * 4, weight_bytes=[0, 0, 3, 3]), link_bytes_per_s=1.0).iteration_time_s
    assert hidden == pytest.approx(base)  # 3 s uploads < the 4 s of stage 0/1
    exposed = simulate(lists, stages([1.0] * 4, weight_bytes=[0, 0, 6, 0]), link_bytes_per_s=1.0).iteration_time_s
    assert exposed == pytest.approx(base + 2.0)  # stage 2 could start at 4 s, its weights land at 6 s


def test_timeline_lanes_and_gradient_download():
    lists = round_robin(kinds(0, 1), devices=1, microbatches=2)
    res = simulate(lists, stages([1.0, 1.0], weight_bytes=[0.5, 0.5], grad_bytes=[0.25, 0.25]), link_bytes_per_s=1.0)
    assert sorted((e.start, e.action, e.lane, e.end) for e in res.timeline) == [
        (0.0, "0W", "upload", 0.5), (0.5, "0F0", "compute", 1.5), (0.5, "1W", "upload", 1.0),
        (1.5, "0F1", "compute", 2.5), (2.5, "0G", "download", 2.75), (2.5, "1F0", "compute", 3.5),
        (3.5, "1F1", "compute", 4.5), (4.5, "1G", "download", 4.75),
    ]
    assert res.iteration_time_s == 4.75 and res.utilisation == (4.0 / 4.75,)


@pytest.mark.parametrize("devices,m", [(2, 4), (4, 8), (8, 16), (4, 2)])
@pytest.mark.parametrize("builder", ["gpipe", "one_f_one_b"])
def test_static_schedules_have_the_classic_bubble(devices, m, builder):
    """One stage per device, forward t and backward 2t: both take (m + N − 1)·3t, bubble (N−1)/(m+N−1)."""
    from rpcompile.runtime import schedule

    lists = getattr(schedule, builder)(devices, m)
    t = 0.01
    times = [t] * devices + [2 * t] * devices  # chain positions: F_0..F_{N-1}, then B_{N-1}..B_0
    res = simulate(lists, times)
    assert res.iteration_time_s == pytest.approx((m + devices - 1) * 3 * t)
    assert res.bubble_fraction == pytest.approx((devices - 1) / (m + devices - 1))


def test_one_f_one_b_order_is_literal():
    from rpcompile.runtime.schedule import format_schedule, one_f_one_b

    # chain positions for N=2: F_0=0, F_1=1, B_1=2, B_0=3
    assert format_schedule(one_f_one_b(2, 3)) == (
        "dev0: 0F0 0F1 3F0 0F2 3F1 3F2\n"
        "dev1: 1F0 2F0 1F1 2F1 1F2 2F2"
    )
