"""Hybrid DP x PP step-time model, search and projection (pure numpy; no devices)."""
import dataclasses
import math

import pytest

from jaxhybrid.plan import hybrid
from jaxhybrid.plan import reference_costs as ref
from jaxhybrid.plan.costs import LayerCost
from jaxhybrid.plan.hardware import PRESETS, Hardware, get_hardware, measured_device
from jaxhybrid.plan.stat_efficiency import StatEfficiency
from jaxhybrid.schedules import make_schedule


def synth(L=8, flops=1e9, params=1_000_000, act=100_000):
    return [LayerCost(f"l{i}", 1, flops, 2 * flops, 0.0, 0.0, 4 * params, params, act, act, act,
                      act, 0.0, 0.0) for i in range(L)]


def hw(**kw):
    base = dict(peak_flops=1e12, mem_bandwidth=1e12, memory=1e12, devices_per_node=8,
                p2p_bandwidth=1e9, allreduce_bandwidth=1e9, inter_bandwidth=1e9,
                efficiency=1.0, bytes_scale=1.0)
    return Hardware("test", **{**base, **kw})


FREE = dict(p2p_bandwidth=1e30, allreduce_bandwidth=1e30, inter_bandwidth=1e30,
            intra_latency=0.0, inter_latency=0.0)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("S,M", [(2, 4), (4, 8), (4, 1)])
def test_bubble_term_equals_schedule(schedule, S, M):
    est = hybrid.step_time(synth(8), hw(**FREE), data=1, pipe=S, num_microbatches=M,
                           per_worker_batch=4 * M, schedule=schedule)
    # Equal stages: both schedules' bubble is (S-1)/(M+S-1) (schedules.py theory).
    assert est.boundaries == list(range(8 // S, 8, 8 // S))
    assert est.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))
    work = M * (est.stage_fwd[0] + est.stage_bwd[0])
    assert est.pipeline_time == pytest.approx(work / (1 - est.bubble_fraction))
    sched = make_schedule(schedule, S, M)
    assert est.bubble_fraction == pytest.approx(sched.bubble_fraction(est.stage_fwd, est.stage_bwd))


def test_more_data_replicas_more_allreduce():
    h = PRESETS["v100_dgx1"]
    for pipe in (1, 2, 4, 16):
        times = [hybrid.step_time(synth(16), h, data=d, pipe=pipe, num_microbatches=4,
                                  per_worker_batch=8).allreduce_time for d in (1, 2, 4, 8, 64, 512)]
        assert times[0] == 0.0
        assert all(b > a for a, b in zip(times, times[1:])), (pipe, times)
    # Leaving the node costs more than staying in it.
    assert hybrid.allreduce_time(h, 16, 1, [1e8]) > 2 * hybrid.allreduce_time(h, 8, 1, [1e8])


def test_stages_share_the_node_network():
    h = PRESETS["v100_dgx1"]
    # pipe <= node: every node carries all stages' bytes; pipe = 16: half the model each.
    whole = hybrid.allreduce_time(h, 64, 1, [1.6e9])
    halves = hybrid.allreduce_time(h, 64, 16, [1e8] * 16)
    assert halves < whole


def test_memory_infeasible_configs_excluded():
    costs = synth(8, params=10_000_000)            # 40 MB of fp32 params per layer
    h = hw(memory=0.5e9, memory_fraction=1.0, weight_bytes=8.0)   # 12 B/param with 1 state
    est = hybrid.step_time(costs, h, data=1, pipe=1, num_microbatches=1, per_worker_batch=8)
    assert not est.feasible and "needs" in est.reason and math.isnan(est.step_time)
    proj = hybrid.search(costs, h, StatEfficiency(100.0, 1000.0, 1e6), devices=[8, 16],
                         per_worker_batch=8)
    assert all(not r.feasible for r in proj.rows if r.pipe == 1)
    assert all(r.feasible for r in proj.rows if r.pipe >= 2)
    assert proj.best(8, hybrid=False) is None and proj.best(8).pipe >= 2
    assert max(proj.best(16).stage_memory) <= h.usable_memory


def test_recomputation_used_when_needed():
    costs = [dataclasses.replace(c, saved_bytes=5 * c.saved_bytes)   # saves 5x its input
             for c in synth(4, params=1000, act=10_000_000)]
    plain = hybrid.step_time(costs, hw(), data=1, pipe=1, num_microbatches=1, per_worker_batch=8)
    # The planner's SPMD memory model: 5.04 GB without recomputation, 1.52 GB with every
    # layer recomputed, 2.48 GB with all but one: 1.6 GB fits only the full recompute.
    tight = hybrid.step_time(costs, hw(memory=1.6e9, memory_fraction=1.0), data=1, pipe=1,
                             num_microbatches=1, per_worker_batch=8)
    assert plain.feasible and not plain.stage_remat[0]
    assert tight.feasible and tight.stage_remat[0]
    assert tight.stage_memory[0] < plain.stage_memory[0]
    assert tight.stage_bwd[0] == pytest.approx(plain.stage_bwd[0] + plain.stage_fwd[0])
    # Without a pipeline GPipe's table would hold all M microbatches; the engine runs
    # them one by one, so the schedule does not change pipe = 1's memory.
    g, f = (hybrid.step_time(costs, hw(), data=1, pipe=1, num_microbatches=4, per_worker_batch=8,
                             schedule=s).stage_memory for s in ("gpipe", "1f1b"))
    assert g == f
    g2 = hybrid.step_time(costs, hw(), data=1, pipe=2, num_microbatches=4, per_worker_batch=8,
                          schedule="gpipe").stage_memory
    f2 = hybrid.step_time(costs, hw(), data=1, pipe=2, num_microbatches=4, per_worker_batch=8,
                          schedule="1f1b").stage_memory
    assert g2[1] > f2[1]        # GPipe stashes 4 microbatches on the last stage, 1F1B one


def test_table_has_every_valid_factorisation():
    proj = hybrid.search(synth(6), hw(), StatEfficiency(100.0, 1000.0, 1e6), devices=[8, 12],
                         per_worker_batch=12)
    got = {(r.devices, r.data, r.pipe, r.num_microbatches) for r in proj.rows}
    want = {(n, n // p, p, m) for n in (8, 12) for p in range(1, 7) if n % p == 0
            for m in (1, 2, 3, 4, 6, 12)}
    assert got == want and len(proj.rows) == len(want)


def test_microbatch_counts_stop_at_the_cap_unless_given():
    # Every divisor of a per-worker batch of 65536 took minutes (a task table per M).
    assert hybrid.divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    stat = StatEfficiency(100.0, 1000.0, 1e6)
    proj = hybrid.search(synth(6), hw(), stat, devices=[2], per_worker_batch=2 ** 16)
    ms = {r.num_microbatches for r in proj.rows}
    assert ms == {2 ** k for k in range(10)} and max(ms) == hybrid.MAX_MICROBATCHES
    given = hybrid.search(synth(6), hw(), stat, devices=[2], per_worker_batch=2 ** 12,
                          microbatches=[1024])
    assert {r.num_microbatches for r in given.rows} == {1024}


def test_no_statistical_penalty_and_free_comm_dp_never_loses():
    # Perfect scaling (epochs independent of batch: B_noise -> infinity) and free
    # communication: splitting a worker can only add bubbles.
    stat = StatEfficiency.from_epochs(10.0, 1e15, 1e6)
    proj = hybrid.search(synth(8), hw(**FREE), stat, devices=[2, 8, 32, 128],
                         per_worker_batch=16)
    for n in proj.devices:
        dp, hy = proj.best(n, False), proj.best(n, True)
        assert dp.time_to_accuracy <= hy.time_to_accuracy * (1 + 1e-9)
    assert proj.crossover is None


def test_strong_large_batch_penalty_gives_a_crossover():
    stat = StatEfficiency.from_epochs(10.0, 1024.0, 1e6)
    proj = hybrid.search(synth(8), hw(), stat, devices=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                         per_worker_batch=16)
    s = proj.summary()
    assert s[1]["winner"] == "dp"           # small N: DP is better
    x = proj.crossover
    assert x is not None and x > 2
    assert all(r["winner"] == "hybrid" for r in s if r["devices"] >= x)
    assert proj.at_scale()["speedup"] > 1


def test_scale_cost_keeps_parameter_traffic():
    c = LayerCost("x", 4, 4e9, 8e9, 4e6 + 1e6, 8e6 + 2e6, 1_000_000, 250_000, 4e5, 4e5, 8e5,
                  4e5, 1.0, 2.0)
    s = hybrid.scale_cost(c, 8)
    assert s.fwd_flops == 8e9 and s.out_bytes == 8e5
    assert s.fwd_bytes == pytest.approx(1e6 + 8e6) and s.bwd_bytes == pytest.approx(2e6 + 16e6)
    assert s.param_bytes == 1_000_000


def test_reference_costs_match_published_sizes():
    assert ref.param_count("inception_v3") == pytest.approx(23.8e6, rel=0.03)
    assert ref.total_flops("inception_v3") / 2 == pytest.approx(5.7e9, rel=0.05)   # MACs
    assert ref.param_count("biglstm") == pytest.approx(1.8e9, rel=0.03)


def test_paper_shape_on_v100():
    devices = [8, 16, 32, 64, 128, 256, 512, 1024]
    for model in ("inception_v3", "gnmt", "biglstm"):
        proj = hybrid.project(model, devices, "v100_dgx1")
        s = proj.summary()
        assert s[0]["winner"] == "dp" and s[-1]["winner"] == "hybrid", model
        assert proj.at_scale()["speedup"] > 1.0


def test_engine_terms_add_per_tick_and_skip_pipe1():
    costs = synth(8)
    base = hw(**FREE)
    eng = base.replace(tick_overhead=1e-4, tick_param_bytes=8.0)     # infinite compute slots
    for S, M in ((2, 4), (4, 8), (8, 2)):
        kw = dict(data=1, pipe=S, num_microbatches=M, per_worker_batch=8 * M)
        a, b = hybrid.step_time(costs, base, **kw), hybrid.step_time(costs, eng, **kw)
        per_tick = 1e-4 + (8 // S) * 1_000_000 * 8.0 / eng.mem_bandwidth   # largest stage's params
        ticks = make_schedule("1f1b", S, M).num_ticks
        assert b.engine_time == pytest.approx(ticks * per_tick)
        assert b.pipeline_time == pytest.approx(a.pipeline_time + ticks * per_tick)
        assert b.compute_time == pytest.approx(a.compute_time) and a.engine_time == 0.0
    # pipe = 1 runs the single-stage program: no ticks, no engine cost.
    one = hybrid.step_time(costs, eng, data=1, pipe=1, num_microbatches=4, per_worker_batch=32)
    assert one.engine_time == 0.0


def test_include_update_and_hardware_checks():
    a = hybrid.step_time(synth(4), hw(), data=2, pipe=2, num_microbatches=2, per_worker_batch=4)
    b = hybrid.step_time(synth(4), hw(), data=2, pipe=2, num_microbatches=2, per_worker_batch=4,
                         include_update=False)
    assert a.update_time > 0 and b.update_time == 0
    assert a.step_time == pytest.approx(b.step_time + a.update_time)
    m = measured_device(mem_bandwidth=1e10, compute_slots=2)
    assert m.uses_measured_times and get_hardware("measured").uses_measured_times
    with pytest.raises(ValueError, match="peak_flops needs mem_bandwidth"):
        Hardware("x", 1e12, None, 1e9, 8, 1e9, 1e9, 1e9)
    with pytest.raises(ValueError, match="tick_param_bytes needs mem_bandwidth"):
        measured_device(tick_param_bytes=4.0)
    with pytest.raises(ValueError, match="tick_overhead=-1"):
        measured_device(tick_overhead=-1)
    with pytest.raises(ValueError, match="were not timed"):
        hybrid.project("inception_v3", [8], "measured")


def test_dp_saturates_hybrid_keeps_scaling():
    # Inception-V3 on V100 DGX-1 past the crossover: doubling N buys DP less than hybrid,
    # and by the largest N doubling the devices barely helps DP.
    proj = hybrid.project("inception_v3", [512, 1024, 2048, 4096], "v100_dgx1")
    dp = [proj.best(n, False).time_to_accuracy for n in proj.devices]
    hy = [proj.best(n, True).time_to_accuracy for n in proj.devices]
    assert all(h2 / h1 < d2 / d1 for d1, d2, h1, h2 in zip(dp, dp[1:], hy, hy[1:]))
    assert dp[-1] / dp[-2] > 0.9 and hy[-1] / hy[-2] < 0.85   # DP: < 10% from 2x devices
