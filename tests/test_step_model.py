"""The one lock-step step-time model (plan.step_model), as the planner and the projection
use it."""
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
