"""One Gantt plotter: schedules, plans and burst plans all draw through schedules.gantt."""
import numpy as np

from jaxhybrid import plan as planner
from jaxhybrid.plan.costs import LayerCost
from jaxhybrid.schedules import gantt, make_schedule


def _record(monkeypatch):
    calls = []
    monkeypatch.setattr(gantt, "draw", lambda path, bars, n, **kw: calls.append((bars, n, kw)))
    return calls


def test_schedule_bars_follow_the_task_table(monkeypatch):
    calls = _record(monkeypatch)
    sched = make_schedule("1f1b", 4, 6)
    sched.plot("unused.png", fwd_cost=1.0, bwd_cost=2.0)
    (bars, n, kw), = calls
    assert n == 4 and len(bars) == len(sched.tasks)
    # Busy time per device drawn = the work of the table.
    busy = np.zeros(4)
    for b in bars:
        busy[int(b.device)] += b.length
    np.testing.assert_allclose(busy, sched.work(1.0, 2.0).sum(axis=0))
    assert max(b.start + b.length for b in bars) == sched.tick_times(1.0, 2.0).sum()


def test_burst_plan_draws_through_the_same_plotter(monkeypatch):
    calls = _record(monkeypatch)
    costs = [LayerCost(f"l{i}", 1, 1e9, 2e9, 1e7, 2e7, 4000, 1000, 4096, 4096, 4096, 4096,
                       0.0, 0.0) for i in range(4)]
    p = planner.plan_burst(costs, num_devices=8, batch_size=64, hardware="v100_dgx1")
    p.plot("unused.png")
    (bars, n, kw), = calls
    assert n == 8 and bars
    layer_bars = [b for b in bars if b.edge or b.color not in ("0.6", "0.3")]
    assert sum(b.length for b in layer_bars) > 0
    assert all(0 <= b.device and b.device + b.rows <= 8 for b in bars)
