"""The one lock-step step-time model (plan.step_model), as the planner and the projection
use it."""
import dataclasses
import math

import numpy as np
import pytest

from jaxhybrid.plan import make_plan
from jaxhybrid.plan.costs import LayerCost
from jaxhybrid.plan.step_model import lockstep_time, tick_lengths
from jaxhybrid.schedules import make_schedule


def test_ticks_engine_transfer_and_slots():
    s = make_schedule("1f1b", 4, 8)
    f, b = np.array([1.0, 2.0, 1.0, 1.0]), np.array([2.0, 4.0, 2.0, 2.0])
    st = lockstep_time(s, f, b)
    assert st.compute == pytest.approx(s.tick_times(f, b).sum())
    assert st.engine == st.transfer == st.allreduce == 0.0
    e = lockstep_time(s, f, b, tick_overhead=0.5, transfer_per_tick=0.25, allreduce=3.0)
    assert e.engine == pytest.approx(0.5 * s.num_ticks)       # every tick, every device
    assert e.transfer == pytest.approx(0.25 * s.num_ticks)
    assert e.total == pytest.approx(st.compute + 0.75 * s.num_ticks + 3.0)
    work = s.work(f, b)
    # 2 replicas of 4 devices on 2 slots: every tick at least all their work / 2.
    np.testing.assert_allclose(tick_lengths(work, 2, 2.0),
                               np.maximum(work.max(1), work.sum(1)))
    assert lockstep_time(s, f, b, data=2, compute_slots=math.inf).compute == st.compute


def test_shared_cores_count_cpu_seconds():
    """Devices sharing C cores share them by CPU seconds: a layer that kept two cores busy
    when timed alone takes twice its time from the others; the longest device's own
    time still bounds the tick; no cpu_cost: the times themselves."""
    s = make_schedule("1f1b", 4, 8)
    f, b = np.ones(4), 2 * np.ones(4)
    plain = lockstep_time(s, f, b, compute_slots=2.0)
    assert lockstep_time(s, f, b, compute_slots=2.0, cpu_cost=(f, b)).total == plain.total
    busy = lockstep_time(s, f, b, compute_slots=2.0, cpu_cost=(2 * f, 2 * b))
    np.testing.assert_allclose(busy.compute, tick_lengths(s.work(f, b), 1, 1.0).sum())
    assert busy.compute > plain.compute
    # Enough cores for every device's CPU seconds: the busiest device sets the pace.
    wide = lockstep_time(s, f, b, compute_slots=16.0, cpu_cost=(2 * f, 2 * b))
    assert wide.compute == pytest.approx(s.tick_times(f, b).sum())
    # Without shared cores (a GPU), the CPU seconds do not matter.
    assert lockstep_time(s, f, b, cpu_cost=(9 * f, 9 * b)).total == lockstep_time(s, f, b).total


def test_plan_prices_the_cores_its_layers_kept_busy():
    """make_plan's stage CPU seconds (fwd_time x fwd_threads, recomputation included)
    price its step on a host whose devices share the cores as the projection does, and
    survive the plan's JSON."""
    from jaxhybrid.plan import Plan
    from jaxhybrid.plan.hardware import measured_device
    costs = [LayerCost(f"l{i}", 4, 1e6, 2e6, 1e5, 2e5, 400, 100, 64, 64, 64, 64,
                       1e-3, 2e-3, fwd_threads=1.0 + (i % 2), bwd_threads=2.0) for i in range(8)]
    hw = measured_device("two_cores", compute_slots=2.0, mem_bandwidth=1e10)
    p = make_plan(costs, num_stages=4, num_microbatches=8, hardware=hw)
    np.testing.assert_allclose(p.stage_fwd_cpu, [3e-3] * 4)
    np.testing.assert_allclose(p.stage_bwd_cpu, [8e-3] * 4)
    one = [dataclasses.replace(c, fwd_threads=1.0, bwd_threads=1.0) for c in costs]
    assert p.predicted_step_time > make_plan(one, num_stages=4, num_microbatches=8,
                                             hardware=hw).predicted_step_time
    assert Plan.from_json(p.to_json()).predicted_step_time == pytest.approx(p.predicted_step_time)
    r = make_plan(costs, num_stages=4, num_microbatches=8, hardware=hw, remat=[True] * 8)
    np.testing.assert_allclose(r.stage_bwd_cpu, [8e-3 + 3e-3] * 4)


def test_plan_predicts_its_step_with_the_same_model():
    costs = [LayerCost(f"l{i}", 4, 1e6, 2e6, 1e5, 2e5, 400, 100, 64, 64, 64, 64,
                       1e-3 * (1 + i % 3), 2e-3 * (1 + i % 3)) for i in range(8)]
    p = make_plan(costs, num_stages=4, num_microbatches=8, topology="uniform:4:1MB/s")
    sched = make_schedule("1f1b", 4, 8)
    # The engine's transfers: per tick an activation and a gradient of the largest
    # boundary (64 bytes) over the (uniform) link.
    topo = __import__("jaxhybrid").plan.Topology.from_spec("uniform:4:1MB/s")
    assert p.transfer_per_tick == pytest.approx(2 * topo.transfer_time(0, 1, 64))
    expect = lockstep_time(sched, np.array(p.stage_fwd_time), np.array(p.stage_bwd_time),
                           transfer_per_tick=p.transfer_per_tick,
                           allreduce=max(p.stage_allreduce_time)).total
    assert p.predicted_step_time == pytest.approx(expect)
    assert p.predicted_step_time > make_plan(costs, num_stages=4, num_microbatches=8,
                                             boundaries=p.boundaries).predicted_step_time


def test_engine_work_per_task_collective_and_launch():
    """The engine's own work: per F/B/W task a device runs, per collective a tick issues
    (every device takes part), once per device per step; all of it shares the compute
    slots like the layers' work."""
    from jaxhybrid.plan.step_model import engine_counts
    s = make_schedule("1f1b", 4, 8)
    f, b = np.ones(4), 2 * np.ones(4)
    tasks, weight, coll = engine_counts(s)
    assert tasks.sum() == 2 * 4 * 8                    # an F and a B per stage and microbatch
    assert weight.sum() == 0                           # no W tasks in 1F1B
    # One activation and one gradient channel (+1 / -1): 1 or 2 ppermutes a tick, never
    # more, and none in a tick where nobody sends.
    assert coll.max() == 2 and coll.min() >= 0 and coll.sum() >= 2 * (8 - 1)
    bare = lockstep_time(s, f, b)
    per_task = lockstep_time(s, f, b, task_overhead=0.5)
    # Idle devices are not slower: a tick lasts its busiest device's work + its tasks' cost.
    np.testing.assert_allclose(bare.compute + per_task.engine,
                               (s.work(f, b) + 0.5 * tasks).max(axis=1).sum())
    per_coll = lockstep_time(s, f, b, collective_overhead=0.25)
    assert per_coll.engine == pytest.approx(0.25 * coll.sum())     # the same on every device
    # On one slot (simulated devices one at a time) everything serialises: the step is
    # all devices' work and the engine's, summed.
    serial = lockstep_time(s, f, b, compute_slots=1.0, task_overhead=0.5, collective_overhead=0.25,
                           launch_overhead=3.0, tick_overhead=0.1)
    assert serial.compute == pytest.approx(s.work(f, b).sum())
    assert serial.engine == pytest.approx(0.5 * tasks.sum() + 4 * (0.25 * coll.sum() + 3.0
                                                                   + 0.1 * s.num_ticks))
    assert lockstep_time(s, f, b, launch_overhead=3.0).engine == pytest.approx(3.0)


def test_split_and_interleaved_tables_count_their_own_tasks_and_collectives():
    from jaxhybrid.plan.step_model import engine_counts
    zb, one = engine_counts(make_schedule("zb-h1", 4, 8)), engine_counts(make_schedule("1f1b", 4, 8))
    assert zb.tasks.sum() == 3 * 4 * 8 and one.tasks.sum() == 2 * 4 * 8     # W tasks
    assert zb.weight_tasks.sum() == 4 * 8 and one.weight_tasks.sum() == 0
    inter = engine_counts(make_schedule("interleaved", 4, 8, virtual_stages=2))
    assert inter.tasks.sum() == 2 * 8 * 8 and inter.collectives.sum() > one.collectives.sum()


def test_weight_tasks_cost_their_own_overhead():
    """A split backward's W task costs `weight_task_overhead` more than an F or B; a
    schedule without W tasks does not pay it."""
    from jaxhybrid.plan.step_model import engine_counts
    f, b = np.ones(4), 2 * np.ones(4)
    zb, one = make_schedule("zb-h1", 4, 8), make_schedule("1f1b", 4, 8)
    serial = dict(compute_slots=1.0, weight_task_overhead=0.5)
    assert lockstep_time(zb, f, b, **serial).engine == pytest.approx(0.5 * 4 * 8)
    assert lockstep_time(one, f, b, **serial).engine == 0.0
    # Own devices (no slots): each tick is longer by its busiest device's W work at most.
    free = lockstep_time(zb, f, b, weight_task_overhead=0.5)
    w = engine_counts(zb).weight_tasks
    np.testing.assert_allclose(free.compute + free.engine,
                               (zb.work(f, b) + 0.5 * w).max(axis=1).sum())


def test_engine_terms_use_the_lockstep_slots():
    from jaxhybrid.plan.hardware import measured_device
    from jaxhybrid.plan.step_model import engine_terms
    hw = measured_device("h", mem_bandwidth=1e9, compute_slots=1.5, tick_overhead=1e-5,
                         tick_param_bytes=8.0, task_overhead=2e-6, collective_overhead=3e-6,
                         launch_overhead=4e-6, tick_latency=5e-6)
    t = engine_terms(hw, 1000, 4)
    assert t["compute_slots"] == 1.5                       # no lock-step figure: compute_slots
    assert t["tick_overhead"] == pytest.approx(1e-5 + 1000 * 8.0 / 1e9)
    assert (t["task_overhead"], t["collective_overhead"], t["launch_overhead"],
            t["tick_latency"]) == (2e-6, 3e-6, 4e-6, 5e-6)
    assert engine_terms(hw.replace(lockstep_slots=0.8), 1000, 4)["compute_slots"] == 0.8
    # More devices in the lock-step program, fewer slots: devices ** -contention.
    crowded = hw.replace(lockstep_slots=2.0, lockstep_contention=0.25)
    assert engine_terms(crowded, 1000, 1)["compute_slots"] == pytest.approx(2.0)
    assert engine_terms(crowded, 1000, 8)["compute_slots"] == pytest.approx(2.0 / 8 ** 0.25)
    assert engine_terms(hw.replace(weight_task_overhead=6e-6), 1000, 4)[
        "weight_task_overhead"] == 6e-6
    with pytest.raises(ValueError, match="lockstep_contention"):
        measured_device(lockstep_contention=-0.1)
    with pytest.raises(ValueError, match="task_overhead"):
        measured_device(task_overhead=-1.0)
