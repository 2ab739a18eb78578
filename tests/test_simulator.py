"""The simulator walks the executor's action lists: it reproduces the timing model and shows prefetch hiding."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from rpcompile.core import schedule
from rpcompile.core.schedule import (OVERLAP_ITERATIONS, format_schedule, interleaved_one_f_one_b, one_f_one_b, parse_action,
                                     round_robin)
from rpcompile.core.errors import SimulationError
from rpcompile.core.stages import HostLoad, StageCost
from rpcompile.passes.solver.timing import pipeline_time
from rpcompile.runtime.sim.simulator import simulate
from rpcompile.tools.scenarios import layer_profile_scenarios, load_layer_profile


def kinds(f: int, b: int) -> list[str]:
    return ["forward"] * f + ["fused"] + ["backward"] * b


@pytest.mark.parametrize("stages,devices,m", [(5, 2, 3), (16, 8, 16), (7, 4, 4), (3, 4, 2), (1, 1, 1)])
def test_equal_stages_match_the_closed_form(stages, devices, m):
    lists = round_robin(kinds(stages // 2, stages - stages // 2 - 1), devices, m)
    t = 0.01
    res = simulate(lists, [t] * stages)
    expected = ((stages - 1) // devices * m + (stages - 1) % devices + m) * t  # docs/architecture.md §3
    assert res.iteration_time_s == pytest.approx(expected)
    assert res.bubble_fraction == pytest.approx(1 - stages * m * t / (devices * expected))


def random_pipelines(seed: int, count: int):
    """``count`` random round-robin pipelines: (devices, microbatches, stage times, simulated result)."""
    rng = random.Random(seed)
    for _ in range(count):
        devices, m = rng.randint(1, 4), rng.randint(1, 6)
        f, b = rng.randint(0, 4), rng.randint(0, 4)
        times = [rng.uniform(0.001, 0.01) for _ in range(f + b + 1)]
        yield devices, m, times, simulate(round_robin(kinds(f, b), devices, m), times)


def test_random_stage_times_match_the_timing_model():
    for devices, m, times, res in random_pipelines(0, 50):
        assert res.iteration_time_s == pytest.approx(pipeline_time(times, devices, m))


def stages(times, **per_stage):
    """StageCosts with ``compute_s`` from ``times`` and any other field given as a list."""
    return [StageCost(name=str(k), compute_s=t, **{f: v[k] for f, v in per_stage.items()}) for k, t in enumerate(times)]


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
    lists = getattr(schedule, builder)(devices, m)
    t = 0.01
    times = [t] * devices + [2 * t] * devices  # chain positions: F_0..F_{N-1}, then B_{N-1}..B_0
    res = simulate(lists, times)
    assert res.iteration_time_s == pytest.approx((m + devices - 1) * 3 * t)
    assert res.bubble_fraction == pytest.approx((devices - 1) / (m + devices - 1))


def test_one_f_one_b_order_is_literal():
    # chain positions for N=2: F_0=0, F_1=1, B_1=2, B_0=3
    assert format_schedule(one_f_one_b(2, 3)) == (
        "dev0: 0F0 0F1 3F0 0F2 3F1 3F2\n"
        "dev1: 1F0 2F0 1F1 2F1 1F2 2F2"
    )


# ---------------------------------------------------------------------------------------------- links and memory
def test_host_bandwidth_cap_is_shared_by_every_link():
    """Two devices upload 10 bytes at once over 10 B/s links: alone each takes 1 s; a host cap of 10 B/s
    halves both rates, so the weights land at 2 s."""
    lists = round_robin(kinds(1, 0), devices=2, microbatches=1)
    sts = stages([0.0, 0.0], weight_bytes=[10, 10])
    free = simulate(lists, sts, link_bytes_per_s=10.0)
    capped = simulate(lists, sts, link_bytes_per_s=10.0, host_bytes_per_s=10.0)
    assert free.iteration_time_s == pytest.approx(1.0)
    assert capped.iteration_time_s == pytest.approx(2.0)
    assert capped.host_traffic_bytes == 20.0


def test_weight_uploads_yield_the_link_to_activations():
    """Once stage 0 starts (0.5 s), stage 1's weights (10 B) may prefetch, but stage 0's second input (5 B) is
    uploading: it keeps the whole 10 B/s link and lands at 1.0 s; the weights go up after it and land at 2.0 s."""
    lists = round_robin(kinds(0, 1), devices=1, microbatches=2)
    sts = stages([1.0, 1.0], weight_bytes=[0, 10], input_bytes=[5, 0])
    res = simulate(lists, sts, link_bytes_per_s=10.0)
    by_action = {e.action: (e.start, e.end) for e in res.timeline}
    assert by_action["0F0<"] == pytest.approx((0.0, 0.5))
    assert by_action["0F0"] == pytest.approx((0.5, 1.5))
    assert by_action["0F1<"] == pytest.approx((0.5, 1.0))
    assert by_action["1W"] == pytest.approx((0.5, 2.0))


def test_activation_copies_on_one_link_share_it_fairly():
    """A microbatch's input (5 B, after its producer) and its saved activations (5 B, already in host memory)
    go up together on a 10 B/s link: 5 B/s each, both land at 1.0 s."""
    lists = round_robin(kinds(0, 0), devices=1, microbatches=1)
    res = simulate(lists, stages([1.0], input_bytes=[5], prefetch_bytes=[5]), link_bytes_per_s=10.0)
    by_action = {e.action: (e.start, e.end) for e in res.timeline}
    assert by_action["0F0<"] == pytest.approx((0.0, 1.0)) and by_action["0F0<<"] == pytest.approx((0.0, 1.0))
    assert by_action["0F0"] == pytest.approx((1.0, 2.0))


def test_memory_accounting_follows_prefetch_and_gradients():
    """One device, stages FB (W=100, G=10, working 5) and B1 (W=50, G=20, working 7), free links: at t=0 the
    device holds FB's weights, gradients and working set and the prefetched B1 weights: 165 bytes. Under a
    160-byte limit the prefetch waits until FB's microbatch ends and frees its weights: peak 115, and it fits."""
    lists = round_robin(kinds(0, 1), devices=1, microbatches=1)
    sts = stages([1.0, 1.0], weight_bytes=[100, 50], grad_bytes=[10, 20], working_bytes=[5, 7])
    free = simulate(lists, sts)
    assert free.peak_memory_bytes == (165,) and free.fits
    res = simulate(lists, sts, memory_limit_bytes=160)
    assert res.peak_memory_bytes == (115,) and res.fits and res.summary()["fits"] is True
    assert {e.action: e.start for e in res.timeline}["1W"] == 1.0
    over = simulate(lists, sts, memory_limit_bytes=100)  # nothing fits: work goes on and the peak says so
    assert over.peak_memory_bytes == (115,) and not over.fits


def test_saved_activations_go_down_lazily_within_the_memory_limit():
    """Each microbatch leaves 10 bytes of saved activations to copy out at 10 B/s (1 s) while compute takes
    0.1 s. Nobody in the forward pass waits for them: without a limit the stage computes back to back and the
    copies trail behind (all four held at once); with room for one, each compute waits for the copy before it."""
    lists = round_robin(kinds(1, 0), devices=1, microbatches=4)
    sts = stages([0.1, 0.1], offload_bytes=[10, 0])
    piled = simulate(lists, sts, link_bytes_per_s=10.0)
    held = simulate(lists, sts, link_bytes_per_s=10.0, memory_limit_bytes=10)
    starts = {e.action: e.start for e in piled.timeline}
    assert [starts[f"0F{j}"] for j in range(4)] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert starts["1F0"] == pytest.approx(0.4)  # the fused stage does not wait for them either
    assert piled.peak_memory_bytes == (40,) and piled.iteration_time_s == pytest.approx(4.1)
    assert piled.offload_backlog_bytes == (40,) and piled.summary()["offload_backlog_bytes"] == [40]
    assert held.peak_memory_bytes == (10,) and held.fits and held.offload_backlog_bytes == (10,)
    assert simulate(lists, sts).offload_backlog_bytes == (0,)  # free links: nothing waits to go down
    starts = {e.action: e.start for e in held.timeline}
    assert [starts[f"0F{j}"] for j in range(4)] == pytest.approx([0.0, 1.1, 2.2, 3.3])
    assert held.iteration_time_s == pytest.approx(4.4)


def test_saved_activations_yield_the_link_to_hand_offs():
    """F0 hands 10 bytes to FB on the other device and offloads 10 saved bytes, one 10 B/s link: the hand-off
    goes first at the full rate (FB starts at 1.1 s, not 2.1 s as with a fair share), the saves after it."""
    lists = round_robin(kinds(1, 0), devices=2, microbatches=1)
    res = simulate(lists, stages([0.1, 0.1], output_bytes=[10, 0], offload_bytes=[10, 0]), link_bytes_per_s=10.0)
    ev = {e.action: (e.start, e.end) for e in res.timeline}
    assert ev["0F0>"] == pytest.approx((0.1, 1.1)) and ev["1F0"][0] == pytest.approx(1.1)
    assert ev["0F0>>"] == pytest.approx((1.1, 2.1))


def test_the_saves_needed_first_go_down_first():
    """Two forward stages on one device each save 10 bytes per microbatch (1 s at 10 B/s): the backward pass
    runs the chain in reverse, so once the first copy is done the later stage's saves go first, in microbatch
    order, and the earlier stage's last."""
    lists = round_robin(kinds(2, 0), devices=1, microbatches=2)
    res = simulate(lists, stages([0.1, 0.1, 0.1], offload_bytes=[10, 10, 0]), link_bytes_per_s=10.0)
    order = [e.action for e in sorted(res.timeline, key=lambda e: e.start) if e.action.endswith(">>")]
    assert order == ["0F0>>", "1F0>>", "1F1>>", "0F1>>"]


def test_a_backward_prefetch_waits_for_the_saves_it_reads():
    """B1 reads what F0 saved (``saved_by``): its prefetch starts when F0's 1-second offload has landed (1.1 s)
    and takes 1 s, so B1 computes at 2.1 s; without the dependency it would have prefetched from t = 0."""
    lists = round_robin(kinds(1, 1), devices=2, microbatches=1)
    sts = stages([0.1, 0.1, 0.1], offload_bytes=[10, 0, 0], prefetch_bytes=[0, 0, 10])
    linked = [*sts[:2], dataclasses.replace(sts[2], saved_by=(0,))]
    assert {e.action: e.start for e in simulate(lists, sts, link_bytes_per_s=10.0).timeline}["2F0"] == \
        pytest.approx(1.0)
    ev = {e.action: (e.start, e.end) for e in simulate(lists, linked, link_bytes_per_s=10.0).timeline}
    assert ev["2F0<<"] == pytest.approx((1.1, 2.1)) and ev["2F0"][0] == pytest.approx(2.1)
    with pytest.raises(ValueError, match="position 1 saves no activations for microbatch 0"):
        simulate(lists, [*sts[:2], dataclasses.replace(sts[2], saved_by=(1,))], link_bytes_per_s=10.0)


def test_a_compute_is_admitted_by_its_peak_not_by_working_set_plus_outputs():
    """The saved activations a forward microbatch offloads are part of its working set (12 bytes, 10 of them
    saved): under a 25-byte limit the second microbatch (12) fits beside the first one's 10 bytes still copying
    out, so it starts at once; counting its outputs on top of its working set (32 bytes) would stall it 1 s."""
    lists = round_robin(kinds(1, 0), devices=1, microbatches=4)
    sts = stages([0.1, 0.1], working_bytes=[12, 0], offload_bytes=[10, 0])
    res = simulate(lists, sts, link_bytes_per_s=10.0, memory_limit_bytes=25)
    starts = {e.action: e.start for e in res.timeline}
    assert starts["0F1"] == pytest.approx(0.1) and starts["0F2"] == pytest.approx(1.1)
    assert res.peak_memory_bytes == (22,) and res.fits


@pytest.mark.parametrize("builder,stashes", [("gpipe", 3), ("one_f_one_b", 2)])
def test_static_schedules_hold_their_in_flight_activations(builder, stashes):
    """GPipe keeps every microbatch's activations until its backward; 1F1B at most N−d on device d."""
    n, m = 2, 3
    sts = [StageCost(name=f"F{d}", compute_s=1.0, resident_bytes=1000, stash_bytes=10) for d in range(n)]
    sts += [StageCost(name=f"B{d}", compute_s=2.0, releases=d) for d in reversed(range(n))]
    res = simulate(getattr(schedule, builder)(n, m), sts)
    assert res.peak_memory_bytes[0] == 1000 + stashes * 10


def test_interleaved_order_is_literal_and_its_bubble_shrinks_with_chunks():
    assert format_schedule(interleaved_one_f_one_b(2, 4, 2)) == (
        "dev0: 0F0 0F1 2F0 2F1 0F2 5F0 0F3 5F1 2F2 7F0 2F3 7F1 5F2 5F3 7F2 7F3\n"
        "dev1: 1F0 1F1 3F0 4F0 3F1 4F1 1F2 6F0 1F3 6F1 3F2 4F2 3F3 4F3 6F2 6F3"
    )
    for n, m, v in [(4, 8, 2), (8, 16, 3), (4, 4, 4)]:
        t = 0.01
        res = simulate(interleaved_one_f_one_b(n, m, v), [t] * (n * v) + [2 * t] * (n * v))
        waste = (n - 1) / v  # Narayanan et al.: the bubble shrinks by the number of chunks
        assert res.bubble_fraction == pytest.approx(waste / (m + waste))
    with pytest.raises(ValueError, match=r"needs microbatches to be a multiple of devices \(6 is not a multiple of 4\); use 8"):
        interleaved_one_f_one_b(4, 6, 2)


def test_a_stage_nobody_runs_is_a_deadlock_not_a_hang():
    lists = [[parse_action("1F0")]]
    with pytest.raises(ValueError, match=r"1F0 waits for 0F0, which no device runs"):
        simulate(lists, [1.0, 1.0])


# ---------------------------------------------------------------------------------------------- the paper's inputs
PROFILE = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "roundpipe-simulator-inputs.json"


@pytest.fixture(scope="module")
def paper_results():
    out = {}
    for model in ("qwen3-1.7b", "llama3-8b", "gpt-oss-20b", "qwen3-32b", "qwen3-235b-a22b"):
        entry, n, m = load_layer_profile(PROFILE, model)
        out[model] = {k: sc.run() for k, sc in layer_profile_scenarios(entry, devices=n, microbatches=m, time_limit_s=5).items()}
    return out


def test_paper_profiles_reproduce_the_bubble_ordering(paper_results):
    """RoundPipe reports 1F1B/GPipe 31–42%, interleaved 6–31%, its round-robin 3–19% (docs/architecture.md §3)."""
    for model, r in paper_results.items():
        b = {k: v.bubble_fraction for k, v in r.items()}
        assert b["1f1b"] > b["interleaved-1f1b"] > b["roundpipe"], (model, b)
        assert 0.30 <= b["1f1b"] <= 0.46 and 0.30 <= b["gpipe"] <= 0.46, (model, b)
        assert 0.03 <= b["roundpipe"] <= 0.26, (model, b)


def test_ilp_beats_the_papers_partition_on_its_own_costs(paper_results):
    for model, r in paper_results.items():
        assert r["ilp"].iteration_time_s <= r["roundpipe"].iteration_time_s, model


def test_per_device_traffic_adds_up():
    lists = round_robin(kinds(0, 1), devices=1, microbatches=2)
    sts = stages([1.0, 1.0], weight_bytes=[3, 4], grad_bytes=[1, 2], input_bytes=[5, 0], output_bytes=[0, 7])
    res = simulate(lists, sts, link_bytes_per_s=100.0)
    assert res.uploaded_bytes == (3 + 4 + 2 * 5,) and res.downloaded_bytes == (1 + 2 + 2 * 7,)
    assert res.host_traffic_bytes == sum(res.uploaded_bytes) + sum(res.downloaded_bytes)


def test_idle_time_splits_into_fill_drain_and_waits():
    # 16 equal stages on 8 devices, 16 microbatches: device d starts d·T late and finishes (7 − d)·T early, and
    # nothing waits in between (docs/architecture.md §3's fill/drain bubble, 7 of 39 T)
    t = 0.01
    res = simulate(round_robin(kinds(8, 7), 8, 16), [t] * 16)
    for d, idle in enumerate(res.idle_s()):
        assert idle["fill"] == pytest.approx(d * t) and idle["drain"] == pytest.approx((7 - d) * t)
        assert idle["waits"] == pytest.approx(0.0, abs=1e-12)
    for *_, res in random_pipelines(1, 20):  # the three parts are the whole bubble
        parts = res.idle_fractions
        assert sum(parts.values()) == pytest.approx(res.bubble_fraction, abs=1e-12)
        assert res.summary()["idle_fractions"] == parts
    # a slow stage in the middle makes the one after it wait for inputs every microbatch
    res = simulate(round_robin(kinds(1, 1), 3, 4), [0.001, 0.01, 0.001])
    assert res.idle_s()[2]["waits"] > 0.02


# ---- the host's own work (HostLoad) -------------------------------------------------------------------------
def _host_case():
    """Device 0 runs stage 0 (1 s, 1000 B of gradients) then stage 2 (1000 B of input from stage 1); device 1
    runs stage 1 (1 s). Stage 0's gradients are down at 2 s, and the host thread then adds them in (5000 B of
    host-memory traffic) while stage 2's input comes up, both through the host's memory bandwidth."""
    lists = round_robin(["fused", "backward", "backward"], devices=2, microbatches=1)
    sts = stages([1.0, 1.0, 1.0], grad_bytes=[1000, 0, 0], input_bytes=[0, 0, 1000])
    return lists, sts


def _start(res, action):
    return next(e.start for e in res.timeline if e.action == action)


def test_the_host_lane_delays_a_stage_when_host_bandwidth_is_tiny():
    lists, sts = _host_case()
    fast_host = HostLoad(accumulate_bytes_per_s=1e12)  # the thread itself is never the limit here
    alone = simulate(lists, sts, link_bytes_per_s=1e12, host_bytes_per_s=1000.0)
    shared = simulate(lists, sts, link_bytes_per_s=1e12, host_bytes_per_s=1000.0, host=fast_host)
    # without accumulation stage 2's 1000 B input takes 1 s (2 → 3); beside it the accumulation takes half the
    # host's 1000 B/s, so the input needs 2 s and stage 2 starts at 4 s
    assert _start(alone, "2F0") == pytest.approx(3.0)
    assert _start(shared, "2F0") == pytest.approx(4.0)
    acc = [e for e in shared.host_timeline if e.kind == "accumulate"]
    assert [(e.action, e.start) for e in acc] == [("0A", pytest.approx(2.0))]
    assert shared.accumulate_s == pytest.approx(acc[0].end - acc[0].start)
    assert shared.iteration_time_s == pytest.approx(acc[0].end)  # the iteration waits for the last add
    # with ample host bandwidth the host lane delays nothing
    roomy = simulate(lists, sts, link_bytes_per_s=1e12, host_bytes_per_s=1e12, host=fast_host)
    assert _start(roomy, "2F0") == pytest.approx(2.0, abs=1e-6)
    assert all(e.lane != "host" for e in shared.timeline)  # the devices' lanes stay the devices'


def test_the_optimizer_step_adds_or_overlaps():
    lists, sts = _host_case()
    pipeline = simulate(lists, sts).iteration_time_s
    sync = simulate(lists, sts, host=HostLoad(optimizer_s=2.0, refresh_s=0.5))
    assert sync.iteration_time_s == pytest.approx(pipeline + 2.5) and sync.pipeline_s == pytest.approx(pipeline)
    step = next(e for e in sync.host_timeline if e.kind == "optimizer")
    assert (step.start, step.end) == (pytest.approx(pipeline), pytest.approx(pipeline + 2.5))
    overlap = simulate(lists, sts, host=HostLoad(optimizer_s=2.0, refresh_s=0.5, overlap_step=True))
    assert overlap.iteration_time_s == pytest.approx(max(pipeline, 2.5))
    short = simulate(lists, sts, host=HostLoad(optimizer_s=0.1, overlap_step=True))
    assert short.iteration_time_s == pytest.approx(pipeline)
    assert sync.summary()["host_step_s"] == pytest.approx(2.5) and not sync.summary()["overlap_step"]


def test_data_parallel_reductions_follow_the_host_adds_in_stage_order_as_the_timing_model_says():
    """Three stages on two devices, each with gradients; with free copies the simulator's all-reduces (kR, one
    network lane, stage order) end where the timing model's do, overlapped or all after the pipeline."""
    lists = round_robin(["fused", "backward", "backward"], devices=2, microbatches=2)
    sts = stages([1.0, 0.5, 1.0], grad_bytes=[3e8, 1e8, 2e8])
    for overlap in (True, False):
        host = HostLoad(nodes=4, network_bytes_per_s=1e8, reduce_bytes_per_grad_byte=2.0, overlap_reduce=overlap)
        res = simulate(lists, sts, host=host)
        want = pipeline_time([1.0, 0.5, 1.0], 2, 2, reduce_s=[host.reduce_s(s.grad_bytes) for s in sts],
                             overlap_reduce=overlap)
        assert res.iteration_time_s == pytest.approx(want)
        reduces = [e for e in res.host_timeline if e.kind == "reduce"]
        assert [e.action for e in reduces] == ["0R", "1R", "2R"]
        assert res.reduce_s == pytest.approx(sum(host.reduce_s(s.grad_bytes) for s in sts))
        plain = simulate(lists, sts).iteration_time_s
        assert res.reduce_exposed_s == pytest.approx(res.iteration_time_s - plain)
        assert res.summary()["reduce_exposed_s"] == pytest.approx(res.reduce_exposed_s)
    assert simulate(lists, sts, host=HostLoad(nodes=1, network_bytes_per_s=1.0)).reduce_s == 0.0


def test_tables_only_the_host_reads_are_reduced_last():
    """A host embedding table's gradient (HostLoad.host_grad_bytes) is all-reduced after every stage's."""
    lists = round_robin(["fused", "backward"], devices=2, microbatches=2)
    sts = stages([1.0, 1.0], grad_bytes=[1e8, 1e8])
    host = HostLoad(nodes=2, network_bytes_per_s=1e8, host_grad_bytes=3e8)
    res = simulate(lists, sts, host=host)
    assert [e.action for e in res.host_timeline if e.kind == "reduce"] == ["0R", "1R", "hostR"]
    want = pipeline_time([1.0, 1.0], 2, 2, reduce_s=[1.0, 1.0], reduce_host_s=3.0)
    assert res.iteration_time_s == pytest.approx(want)


# ---- consecutive iterations: synchronous, the step overlapped, iterations overlapped (issue 35) -------------
OVERLAPPED = HostLoad(overlap_step=True, overlap_iterations=True)


def _three_stages(step_s: float = 0.0) -> tuple[list, list[StageCost]]:
    """F0, FB, B1 of 1 s a microbatch on 2 devices, 2 microbatches: one iteration takes 4 s (docs/architecture.md §3)."""
    names = ["forward", "fused", "backward"]
    return round_robin(names, devices=2, microbatches=2), [StageCost(kind=k, compute_s=1.0) for k in names]


def test_a_run_of_synchronous_iterations_repeats_one_iteration():
    """Synchronous: each iteration waits for the step before it, so K iterations are K single ones (with their
    fill, drain and step); the step overlapped as today's runtime does (forward_backward a barrier): the longer of
    pipeline and step. Random pipelines, the same figures as one iteration."""
    rng = random.Random(3)
    for _ in range(30):
        devices, m, f, b = rng.randint(1, 4), rng.randint(1, 5), rng.randint(0, 4), rng.randint(0, 4)
        names = ["forward"] * f + ["fused"] + ["backward"] * b
        sts = [StageCost(kind=k, compute_s=rng.uniform(0.001, 0.01)) for k in names]
        lists, step = round_robin(names, devices, m), rng.choice([0.0, 0.004, 0.04])
        for host in (HostLoad(optimizer_s=step), HostLoad(optimizer_s=step, overlap_step=True)):
            one, run = simulate(lists, sts, host=host), simulate(lists, sts, host=host, iterations=4)
            assert run.iteration_time_s == pytest.approx(one.iteration_time_s, rel=1e-9)
            assert run.iterations == 4 and one.iterations == 1 and not one.iteration_ends_s
            # synchronous, the bubble is over the pipeline (the step apart); overlapped, over the iteration the
            # devices see, which waits for a step longer than the pipeline
            span = one.iteration_time_s if host.overlap_step else one.pipeline_s
            assert run.bubble_fraction == pytest.approx(1 - sum(one.busy_s) / (devices * span), abs=1e-9)
        sync = simulate(lists, sts, host=HostLoad(optimizer_s=step), iterations=3)
        first = sync.iteration_ends_s[0]
        assert sync.iteration_ends_s == pytest.approx([first + t * (first + step) for t in range(3)])


def test_overlapped_iterations_run_on_without_the_drain():
    """F0, FB, B1 on 2 devices: the pointer carries on, so iteration 1's F0 (position 3) runs on device 1, right
    after FB, while device 0 drains B1; each iteration then adds 3 s, not 4 — no bubble in the steady state,
    and the run pays one fill and one drain (0.5 s a device each)."""
    lists, sts = _three_stages()
    run = simulate(lists, sts, host=OVERLAPPED)  # by default as many iterations as the timing model walks
    assert run.iterations == OVERLAP_ITERATIONS == 15
    assert run.iteration_ends_s == pytest.approx([4.0 + 3 * t for t in range(15)])
    assert run.iteration_time_s == pytest.approx(3.0) and run.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    assert (run.first_iteration_s, run.fill_s, run.drain_s) == (pytest.approx(4.0), 0.5, 0.5)
    second = sorted((e.start, e.action, e.device) for e in run.timeline if e.lane == "compute" and e.iteration == 1)
    assert second == [(3.0, "0F0", 1), (4.0, "0F1", 1), (4.0, "1F0", 0), (5.0, "1F1", 0), (5.0, "2F0", 1),
                      (6.0, "2F1", 1)]
    sync = simulate(lists, sts)
    assert sync.iteration_time_s == pytest.approx(4.0) and sync.bubble_fraction == pytest.approx(0.25)
    summary = run.summary()
    assert summary["period_s"] == pytest.approx(3.0) and summary["iterations"] == 15
    assert summary["fill_s"] == 0.5 and len(summary["iteration_ends_s"]) == 15


def test_the_iteration_after_next_waits_for_the_step():
    """A 10 s step: iteration 2 computes with the weights step 0 made, so its weights go up and its first
    microbatch starts when step 0 ends (4 + 10 s), not when device 0 is free (7 s); from then on the step sets
    the pace: a 10 s period, 70% of it idle."""
    lists, sts = _three_stages()
    run = simulate(lists, sts, host=dataclasses.replace(OVERLAPPED, optimizer_s=10.0))
    step0 = next(e for e in run.host_timeline if e.action == "step0")
    assert (step0.start, step0.end) == (4.0, 14.0)
    third = {e.action: e.start for e in run.timeline if e.iteration == 2 and e.stage == 0}
    assert third["0W"] == third["0F0"] == 14.0
    assert run.iteration_time_s == pytest.approx(10.0) and run.bubble_fraction == pytest.approx(0.7)


def test_the_next_iteration_waits_for_the_loss():
    """Two stages on four devices: devices 2 and 3 are free from the start, but iteration 1 begins only once
    iteration 0's loss is known (its fused stage's last microbatch, 2 s): the caller passes the next batch after
    forward_backward has returned it."""
    names = ["fused", "backward"]
    run = simulate(round_robin(names, 4, 2), [StageCost(kind=k, compute_s=1.0) for k in names], host=OVERLAPPED)
    starts = {(e.iteration, e.device): e.start for e in run.timeline if e.action == "0F0"}
    assert starts[(0, 0)] == 0.0 and starts[(1, 2)] == 2.0 and starts[(2, 0)] == 4.0
    assert run.iteration_time_s == pytest.approx(2.0)


def test_a_static_schedule_or_no_iteration_is_refused_in_one_line():
    with pytest.raises(SimulationError, match=r"^iterations > 1 plays round-robin schedules only .*one iteration at a time$"):
        simulate(one_f_one_b(2, 2), [StageCost(compute_s=1.0, releases=-1)] * 2
                 + [StageCost(compute_s=1.0, releases=k) for k in (1, 0)], iterations=2)
    with pytest.raises(SimulationError, match=r"^iterations must be >= 1, got 0; pass the number of iterations to play$"):
        simulate(*_three_stages(), iterations=0)
