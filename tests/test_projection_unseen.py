"""The projection (`plan.hybrid`, `plan.stat_efficiency`, scripts/project.py) on inputs its
authors did not write: odd device counts, every schedule kind, hand-built costs, slow
inter-node links, odd statistical-efficiency points, bad flags (docs/projection.md,
"Tried on inputs nobody here wrote"). Pure numpy except the script runs."""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import pytest

from jaxhybrid.plan import hybrid
from jaxhybrid.plan.costs import LayerCost
from jaxhybrid.plan.hardware import PRESETS
from jaxhybrid.plan.stat_efficiency import StatEfficiency, fit
from jaxhybrid.schedules import make_schedule
from test_hybrid import hw as _hw, synth

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAT = StatEfficiency.from_epochs(10.0, 2048.0, 1e6)


def hw(**kw):
    """test_hybrid's device with 10 GB/s links."""
    return _hw(**{**dict(p2p_bandwidth=1e10, allreduce_bandwidth=1e10, inter_bandwidth=1e10), **kw})


def _same_as_step_time(proj, costs, h, b):
    """Every row of a search equals `step_time` of its configuration."""
    for r in proj.rows:
        d = hybrid.step_time(costs, h, data=r.data, pipe=r.pipe, per_worker_batch=b,
                             num_microbatches=r.num_microbatches, schedule=r.schedule,
                             model=r.model, zero=r.zero)
        assert r.feasible == d.feasible, r.layout
        if r.feasible:
            assert r.step_time == pytest.approx(d.step_time, rel=1e-12), (r.layout, r.schedule)


# --- schedules -----------------------------------------------------------------------
def test_dp_rows_with_virtual_stage_schedules():
    # interleaved / zbv put 2 stages on a device; a DP-only worker (pipe = 1) runs its
    # microbatches one after another whatever the schedule: it used to crash the whole
    # search ("spmd_memory: schedule has 1 stages, boundaries give 2").
    costs = synth(8)
    kw = dict(data=2, pipe=1, num_microbatches=4, per_worker_batch=8)
    base = hybrid.step_time(costs, PRESETS["v100_dgx1"], **kw)
    for s in ("interleaved", "zbv", "zb-h1", "gpipe"):
        assert hybrid.step_time(costs, PRESETS["v100_dgx1"], schedule=s, **kw).step_time == \
            pytest.approx(base.step_time)
    proj = hybrid.search(costs, PRESETS["v100_dgx1"], STAT, devices=[4, 6],
                         per_worker_batch=8, schedules=("interleaved", "zbv", "1f1b"))
    dp = [r for r in proj.rows if r.pipe == 1]
    assert len(dp) == 2 * 4                        # one row per (N, M), not one per schedule
    assert {r.schedule for r in proj.rows if r.pipe > 1} == {"interleaved", "zbv", "1f1b"}
    for r in proj.rows:
        if r.feasible and r.pipe > 1:
            sched = make_schedule(r.schedule, r.pipe, r.num_microbatches)
            want = sched.bubble_fraction(r.stage_fwd, r.stage_bwd)
            assert r.bubble_fraction == pytest.approx(want)


@pytest.mark.parametrize("schedule", ["async", "pipedream", "2bw", "spectrain", "pipedream-1t"])
def test_asynchronous_schedules_are_refused(schedule):
    # They apply M / window optimizer updates per call on stale weights: one step of
    # global batch data x b, one all-reduce and one update per call (what the model
    # prices) is not what they run, and staleness is not in the statistical efficiency.
    with pytest.raises(ValueError, match="asynchronous"):
        hybrid.search(synth(4), PRESETS["v100_dgx1"], STAT, devices=[4], per_worker_batch=4,
                      schedules=("1f1b", schedule))
    # step_time prices one call: one update (all-reduce + optimizer pass) per window.
    est = hybrid.step_time(synth(4), PRESETS["v100_dgx1"], data=2, pipe=2, num_microbatches=4,
                           per_worker_batch=8, schedule=schedule)
    sync = hybrid.step_time(synth(4), PRESETS["v100_dgx1"], data=2, pipe=2, num_microbatches=4,
                            per_worker_batch=8, schedule="1f1b")
    # (2bw's default window at S=2, M=4 is all 4 microbatches: one update.)
    assert est.updates == (1 if schedule == "2bw" else 4) and sync.updates == 1
    assert est.update_time > 0 and est.allreduce_time > 0
    assert est.step_time == pytest.approx(est.pipeline_time + est.updates * (
        est.allreduce_time + est.update_time) + PRESETS["v100_dgx1"].step_overhead)


# --- the search's cache ----------------------------------------------------------------
def test_rows_equal_step_time_with_finite_lockstep_slots():
    # Unlimited compute_slots but finite lock-step slots: a pipelined tick depends on
    # data (devices share the slots); the search reused the pipeline of the first data
    # value for every N (2x2 M=4: 3.3 ms in the table, 5.2 ms by step_time).
    h = PRESETS["v100_dgx1"].replace(lockstep_slots=4, lockstep_contention=0.5, tick_overhead=1e-5)
    costs = synth(6)
    proj = hybrid.search(costs, h, STAT, devices=[2, 4, 8, 12], per_worker_batch=8,
                         schedules=("1f1b", "zb-h1"), zero=(0, 1))
    _same_as_step_time(proj, costs, h, 8)


def test_duplicate_options_give_no_duplicate_rows():
    costs = synth(4)
    once = hybrid.search(costs, hw(), STAT, devices=[4, 4], per_worker_batch=4)
    twice = hybrid.search(costs, hw(), STAT, devices=[4], per_worker_batch=4,
                          schedules=("1f1b", "1f1b"), model_degrees=(1, 1), zero=(0, 0))
    assert len(twice.rows) == len(once.rows)


def test_device_count_without_any_layout_is_an_error():
    with pytest.raises(ValueError, match="N=8.*model degrees"):
        hybrid.search(synth(4), hw(), STAT, devices=[8, 12], per_worker_batch=4, model_degrees=(3,))
    with pytest.raises(ValueError, match="max_pipe=0"):
        hybrid.search(synth(4), hw(), STAT, devices=[8], per_worker_batch=4, max_pipe=0)


# --- links -----------------------------------------------------------------------------
def test_replicas_that_straddle_nodes_pay_the_slow_link():
    # 3-stage pipelines, 8 devices per node: replica 2 sits on devices 6, 7 | 8, so its
    # stage 1 -> 2 transfer crosses nodes, and the lock-step ticks of every replica wait
    # for it. It used to be priced on the intra-node link (1.7 ms for ~20 s).
    slow = hw(inter_bandwidth=1e6, inter_latency=1e-3)
    costs = synth(12, act=1_000_000)
    kw = dict(pipe=3, num_microbatches=4, per_worker_batch=4)
    inside = hybrid.step_time(costs, slow, data=2, **kw)        # devices 0-5: one node
    straddle = hybrid.step_time(costs, slow, data=8, **kw)
    ticks = make_schedule("1f1b", 3, 4).num_ticks
    nb = 1_000_000.0                                            # every boundary the same
    assert inside.transfer_time == pytest.approx(ticks * 2 * (slow.intra_latency + nb / 1e10))
    assert straddle.transfer_time == pytest.approx(ticks * 2 * (1e-3 + nb / 1e6))
    # pipe dividing the node: no replica straddles, whatever data is.
    assert hybrid.step_time(costs, slow, data=8, pipe=4, num_microbatches=4,
                            per_worker_batch=4).transfer_time < 1.0
    proj = hybrid.search(costs, slow, STAT, devices=[6, 24], per_worker_batch=4)
    _same_as_step_time(proj, costs, slow, 4)


# --- statistical efficiency ------------------------------------------------------------
def test_fit_constant_steps_is_zero_noise_scale():
    # Steps that do not fall at all: B_noise = 0 (a legal curve), not "steps should fall".
    s = fit([(100, 500), (1000, 500), (10000, 500)])
    assert s.b_noise == 0.0 and s.s_min == pytest.approx(500)


def test_fit_errors_name_the_problem():
    pts = [(100, 1000), (1000, 200)]
    for cap in (0, -5, True):
        with pytest.raises(ValueError, match="max_batch"):
            fit(pts, max_batch=cap)
    with pytest.raises(ValueError, match="below every measured batch"):
        fit(pts, max_batch=50)
    # Steps x batch constant (perfect scaling) or falling faster than 1 / B: the points
    # do not bound B_noise; the message says so instead of "steps should fall".
    for p in ([(100, 2e4), (1000, 2e3), (10000, 200)], [(100, 10000), (200, 4000), (400, 1000)]):
        with pytest.raises(ValueError, match="larger batch"):
            fit(p)
    with pytest.raises(ValueError, match="steps should fall"):
        fit([(64, 100), (128, 200), (256, 400)])
    # An infinite cap or dataset wrote "Infinity" into the JSON (not JSON) or crashed
    # in ceil(D / B); both are refused where the curve is made.
    with pytest.raises(ValueError, match="max_batch=inf must be a finite number"):
        StatEfficiency(100.0, 1000.0, max_batch=math.inf)
    with pytest.raises(ValueError, match="dataset_size=inf must be a finite number"):
        StatEfficiency(100.0, 1000.0, dataset_size=math.inf)


# --- scripts/project.py --------------------------------------------------------------
def _run(*args):
    # PYTHONPATH: this checkout's package, also where another one is installed (worktrees).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "project.py"), "--out=",
                           *args], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)


def test_script_flags_zero_values_and_schedules():
    bad = _run("--model=gnmt", "--devices=8", "--e_min=0")           # was: the default, silently
    assert bad.returncode != 0 and "e_min=0" in bad.stderr and "Traceback" not in bad.stderr
    bad = _run("--model=gnmt", "--devices=8", "--model_degrees=3")   # was: an empty table
    assert bad.returncode != 0 and "N=8" in bad.stderr and "Traceback" not in bad.stderr
    bad = _run("--model=gnmt", "--devices=8", "--out=/nonexistent/p.png")   # was: after the work
    assert bad.returncode != 0 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr
    bad = _run("--model=gnmt", "--devices=8", "--schedules=1f1b,pipedream")
    assert bad.returncode != 0 and "asynchronous" in bad.stderr and "Traceback" not in bad.stderr
    ok = _run("--model=gnmt", "--devices=6,12", "--schedules=interleaved,zbv,zb-h1", "--json",
              "--all_configs")
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    best = {s["devices"]: s["hybrid"]["time_to_accuracy"] for s in data["summary"]}
    for n in (6, 12):
        times = [c["time_to_accuracy"] for c in data["configs"]
                 if c["feasible"] and c["data"] * c["pipe"] * c["model"] == n and c["pipe"] > 1]
        assert math.isclose(best[n], min(times))


def test_model_groups_that_straddle_nodes_use_the_network():
    # Model degree 3 on nodes of 8: groups at devices 0-2, 3-5 stay inside node 0, the
    # third (6, 7 | 8) crosses it, and its all-reduces set the pace of every group.
    slow = hw(inter_bandwidth=1e6, inter_latency=1e-3)
    c = [LayerCost("blk", 1, 1e9, 2e9, 0.0, 0.0, 4_000_000, 1_000_000, 1000, 1000, 1000, 1000,
                   0.0, 0.0, model_param_bytes=4_000_000, model_flops_fraction=1.0,
                   model_fwd_comm_bytes=3_000_000, model_bwd_comm_bytes=3_000_000,
                   model_fwd_collectives=2, model_bwd_collectives=2)]
    inside, _ = hybrid.model_times(c, slow, 3, groups=2)
    across, _ = hybrid.model_times(c, slow, 3, groups=3)
    assert inside[0] == pytest.approx(2 * 2 / 3 * 3e6 / 1e10 + 2 * 2 * 2 * slow.intra_latency)
    assert across[0] == pytest.approx(2 * 2 / 3 * 3e6 / 1e6 + 2 * 2 * 2 * 1e-3)
    kw = dict(pipe=2, model=3, num_microbatches=1, per_worker_batch=1)
    a = hybrid.step_time(c * 4, slow, data=1, **kw)
    b = hybrid.step_time(c * 4, slow, data=2, **kw)
    assert b.model_time > 100 * a.model_time      # data 2: the second replica's groups cross


def test_nothing_fits_says_why():
    # The reason quoted the memory without recomputation as what is needed "even with
    # recomputation"; the table showed only "-" where nothing fits.
    costs = [dataclasses.replace(c, saved_bytes=50 * c.saved_bytes)
             for c in synth(4, params=1000, act=10_000_000)]
    h = hw(memory=0.3e9, memory_fraction=1.0)
    est = hybrid.step_time(costs, h, data=1, pipe=1, num_microbatches=1, per_worker_batch=1)
    assert not est.feasible
    need, full = (float(x) for x in re.findall(r"([\d.]+) GB", est.reason)[:2])
    assert full < need / 5 and "with every layer recomputed" in est.reason
    proj = hybrid.search(costs, h, STAT, devices=[2], per_worker_batch=1)
    assert "nothing fits of 2 configs; e.g. 1x2 M=1: needs" in proj.table()
    # Its row and the at-scale line printed nan; "crossover N = None" said no crossover.
    assert "nan" not in proj.table() and "None" not in proj.table()
    assert "no crossover (hybrid wins at no N in 2)" in proj.table()


def test_custom_hardware_checks():
    # Accepted before: efficiency=30 (meant 30%) made every layer 100x faster; a
    # fractional devices_per_node put replicas at fractional node offsets.
    base = PRESETS["v100_dgx1"]
    for kw, msg in ((dict(efficiency=30), "efficiency=30 is a fraction"),
                    (dict(memory_fraction=90), "memory_fraction=90 is a fraction"),
                    (dict(devices_per_node=8.5), "devices_per_node=8.5 must be an int"),
                    (dict(devices_per_node=True), "devices_per_node=True must be an int")):
        with pytest.raises(ValueError, match=msg):
            base.replace(**kw)
    assert base.replace(devices_per_node=6, efficiency=1.0).devices_per_node == 6


def test_fit_weighs_points_by_their_relative_error():
    # One point 10% off, the smallest batch's (the most steps): absolute residuals let it
    # move B_noise by 36% (5584 for 4096); relative residuals by 5%.
    true = StatEfficiency(s_min=1000.0, b_noise=4096.0)
    batches = [128, 512, 2048, 8192, 32768, 131072]
    pts = [(b, true.steps(b) * (1.1 if b == 128 else 1.0)) for b in batches]
    got = fit(pts)
    assert got.b_noise == pytest.approx(4096.0, rel=0.06)
    assert got.s_min == pytest.approx(1000.0, rel=0.02)


def test_a_memory_only_whole_stages_meet_is_feasible_with_them():
    # A chain (each layer's input is what it saves): recomputing layers one by one saves
    # nothing; each stage recomputed whole keeps one input per stage.
    costs = synth(16, params=1000, act=10_000_000)
    kw = dict(data=1, pipe=2, num_microbatches=8, per_worker_batch=8, schedule="gpipe")
    tight = hybrid.step_time(costs, hw(memory=1e6, memory_fraction=1.0), **kw)
    need, whole = (float(x) * 1e9 for x in re.findall(r"([\d.]+) GB", tight.reason)[:2])
    assert "with every stage recomputed whole" in tight.reason and whole < need / 2
    est = hybrid.step_time(costs, hw(memory=whole * 1.01, memory_fraction=1.0), **kw)
    assert est.feasible and est.stage_remat == [True, True]
    assert max(est.stage_memory) <= whole * 1.01
