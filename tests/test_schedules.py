"""Schedules as task data: one parametrized suite over every registered builder, the
figures the tables promise, control tables, and the runtime's B/W split and U tasks."""
import dataclasses

import numpy as np
import pytest

from jaxhybrid import schedules as sc
from jaxhybrid.pipeline import tables
from jaxhybrid.schedules import SCHEDULES, Schedule, TaskType, make_schedule

SIZES = [(1, 1), (2, 1), (2, 5), (3, 7), (4, 4), (4, 9), (8, 17)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("S,M", SIZES)
def test_every_builder_makes_a_valid_complete_table(name, S, M):
    s = make_schedule(name, S, M)
    s.validate()
    K = s.num_stages
    assert K == S * s.virtual_stages and sorted(set(s.stage_device)) == list(range(S))
    kinds = [TaskType.F, TaskType.B] + ([TaskType.W] if s.split_backward else [])
    for kind in kinds:
        assert sum(t.kind == kind for t in s.tasks) == K * M
    assert 0 <= s.bubble_fraction() < 1
    # Memory: the stash never holds more than M microbatches of any stage.
    assert (s.stage_in_flight() <= M).all() and (s.in_flight() >= 1).all()
    # The chart names every task once.
    assert s.chart().count("F") >= K * M
    # U tasks after the last backward keep the table valid (asynchronous tables have
    # theirs already: one per gradient window).
    u = s.with_updates()
    per_device = sc.asynchronous.updates_per_call(s)
    assert sum(t.kind == TaskType.U for t in u.tasks) == S * per_device
    # The options it records (defaults too) rebuild it: the table is told by them.
    assert make_schedule(name, S, M, **dict(s.options)) == s


def test_options_name_the_defaults_a_table_was_built_with():
    """A 2bw reference written for window 1 mismatched: the default window (from S and
    M) was nowhere on the table."""
    assert dict(make_schedule("2bw", 4, 8).options) == {"window": 8}
    assert dict(make_schedule("2bw", 4, 8).options)["window"] == sc.asynchronous.two_bw_window(4, 8)
    assert dict(make_schedule("interleaved", 4, 8).options) == {"virtual_stages": 2}
    assert dict(make_schedule("spectrain", 4, 8).options)["version"] == 2
    assert make_schedule("interleaved", 4, 8) == make_schedule("interleaved", 4, 8, virtual_stages=2)


def test_bubble_figures_at_8_stages_32_microbatches():
    bubble = {n: make_schedule(n, 8, 32).bubble_fraction() for n in SCHEDULES}
    assert bubble["1f1b"] == pytest.approx(7 / 39)           # (S-1)/(M+S-1)
    assert bubble["gpipe"] == pytest.approx(7 / 39)
    assert bubble["interleaved"] <= 0.10                      # Megatron: 7/71 = 0.099
    assert bubble["zb-h1"] <= 0.07                            # Qi et al.: (S-1)/(3M+S-1)
    assert bubble["zbv"] < bubble["zb-h1"]


def test_memory_bounds():
    for S, M in [(4, 16), (8, 32)]:
        one = make_schedule("1f1b", S, M)
        # 1F1B and zb-h1 hold at most 2S-1 whatever M is; GPipe holds M.
        assert one.in_flight().max() == 2 * S - 1
        assert make_schedule("zb-h1", S, M).in_flight().max() <= one.in_flight().max()
        assert make_schedule("gpipe", S, M).in_flight().max() == M
        assert make_schedule("1f1b", S, 4 * M).in_flight().max() == 2 * S - 1


def test_interleaved_maps_stages_round_robin_and_rejects_bad_v():
    s = make_schedule("interleaved", 4, 8, virtual_stages=3)
    assert s.stage_device == tuple(k % 4 for k in range(12)) and s.virtual_stages == 3
    with pytest.raises(ValueError, match="virtual_stages"):
        make_schedule("interleaved", 4, 8, virtual_stages=0)
    with pytest.raises(ValueError, match="does not take options"):
        make_schedule("1f1b", 4, 8, virtual_stages=2)


def test_zbv_turns_on_the_last_device():
    s = make_schedule("zbv", 4, 4)
    assert s.stage_device == (0, 1, 2, 3, 3, 2, 1, 0)
    ctl = tables.control_table(s)
    assert sorted(c.shift for c in ctl.act_channels) == [0, 1, 3]   # +1, local turn, -1


def test_unknown_name_and_user_schedule():
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("zigzag", 4, 4)
    mine = make_schedule("1f1b", 2, 3)
    assert make_schedule(mine, 2, 3) is mine
    with pytest.raises(ValueError, match="is for 2 devices x 3"):
        make_schedule(mine, 4, 3)


def test_schedule_names_list_every_built_in_schedule():
    # Taken once the asynchronous builders have registered (it held only the five
    # synchronous ones when it was taken in builders.py).
    assert set(SCHEDULES) >= set(sc.SCHEDULE_NAMES) >= {
        "gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "async", "pipedream", "2bw",
        "spectrain", "spectrain-v1", "pipedream-1t", "spectrain-1t"}


def _broken(s: Schedule, f) -> Schedule:
    return dataclasses.replace(s, tasks=tuple(f(list(s.tasks))))


def test_validate_catches_every_broken_dependency():
    s = make_schedule("1f1b", 3, 3)
    first_f1 = next(t for t in s.tasks if t.kind == TaskType.F and t.stage == 1)
    cases = {
        "before its input": lambda ts: [dataclasses.replace(t, tick=0) if t == first_f1 else t
                                        for t in ts],
        "never runs": lambda ts: [t for t in ts if not (t.kind == TaskType.B and t.stage == 0
                                                        and t.microbatch == 2)],
        "repeated": lambda ts: ts + [dataclasses.replace(ts[0], tick=ts[0].tick + 50)],
        "lives on": lambda ts: [dataclasses.replace(t, device=0) if t.stage == 2 and
                                t.kind == TaskType.F and t.microbatch == 0 else t for t in ts],
        "before its gradient": lambda ts: [dataclasses.replace(t, tick=t.tick - 1)
                                           if t.kind == TaskType.B and t.stage == 0 and
                                           t.microbatch == 0 else t for t in ts],
    }
    for msg, f in cases.items():
        with pytest.raises(ValueError, match=msg):
            _broken(s, f).validate()
    z = make_schedule("zb-h1", 2, 2)
    with pytest.raises(ValueError, match="before its B"):
        _broken(z, lambda ts: [dataclasses.replace(t, tick=0) if t.kind == TaskType.W and
                               t.stage == 1 and t.microbatch == 1 else t for t in ts]).validate()


def test_placer_reports_deadlocking_orders():
    # Device 0 wants B0 before its forward: it can never run.
    orders = [[(TaskType.B, 0, 0), (TaskType.F, 0, 0)], [(TaskType.F, 1, 0), (TaskType.B, 1, 0)]]
    with pytest.raises(sc.ScheduleDeadlock, match="deadlocks"):
        sc.place_tasks("bad", 2, 1, [0, 1], orders)


def test_plot_writes_png(tmp_path):
    for name in SCHEDULES:
        path = tmp_path / f"{name}.png"
        make_schedule(name, 4, 6).plot(str(path), fwd_cost=[1, 2, 1, 1] * (
            2 if name in ("interleaved", "zbv") else 1))
        assert path.stat().st_size > 5000


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_plot_bars_stay_in_their_tick(name):
    # A U task (drawn a tenth of an F wide) once ran into the next tick's bars: the
    # ticks were as wide as their F/B/W work alone.
    s = make_schedule(name, 4, 8)
    if not any(t.kind == TaskType.U for t in s.tasks):
        s = s.with_updates()
    bars = s.gantt_bars(fwd_cost=[1.0, 2.0, 1.0, 1.5] * s.virtual_stages)
    for d in range(s.num_devices):
        row = sorted((b.start, b.start + b.length) for b in bars if b.device == d)
        assert all(end <= nxt + 1e-9 for (_, end), (nxt, _) in zip(row, row[1:])), name
    assert len(bars) == len(s.tasks)


# --- control tables ----------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("S,M", [(2, 1), (4, 8), (3, 7)])
def test_control_table_slots_never_clobber_live_values(name, S, M):
    s = make_schedule(name, S, M)
    ctl = tables.control_table(s)
    col = tables.COL
    # Replay the table: every read finds the value that was written for it.
    boxes = {"act": {}, "stash": {}, "grad": {}, "cross": {}}
    dev = s.stage_device
    for t in range(s.num_ticks):
        arrivals = []
        for d in range(S):
            row = ctl.table[t, d]
            k, m = row[col["f_stage"]], row[col["f_mb"]]
            if k >= 0:
                if k > 0:
                    assert boxes["act"][(d, row[col["f_act"]])] == (k, m)
                boxes["stash"][(d, row[col["f_stash"]])] = (k, m)
                if k < s.num_stages - 1:
                    arrivals.append(("act", d, dev[k + 1], (k + 1, m)))
            for p in ("b", "w"):
                k, m = row[col[f"{p}_stage"]], row[col[f"{p}_mb"]]
                if k < 0:
                    continue
                assert boxes["stash"][(d, row[col[f"{p}_stash"]])] == (k, m)
                if k < s.num_stages - 1 and p == "b":   # (W gets it from B: cross)
                    assert boxes["grad"][(d, row[col["b_grad"]])] == (k, m)
                if s.split_backward and p == "b":
                    boxes["cross"][(d, row[col["b_cross"]])] = (k, m)
                elif s.split_backward:
                    assert boxes["cross"][(d, row[col["w_cross"]])] == (k, m)
                if p == "b" and k > 0:
                    arrivals.append(("grad", d, dev[k - 1], (k - 1, m)))
        for box, src, d, key in arrivals:
            recv, chans = ((ctl.act_recv, ctl.act_channels) if box == "act"
                           else (ctl.grad_recv, ctl.grad_channels))
            c = [ch.shift for ch in chans].index((d - src) % S)
            assert recv[t, d, c] != ctl.sizes[box]
            boxes[box][(d, recv[t, d, c])] = key


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_tick_flags_gate_exactly_the_ticks_with_transfers_and_updates(name):
    # The runtime issues a tick's collectives only under these flags: a flag that is
    # off in a tick where some device sends would drop a value; one that is on where
    # nobody sends costs a collective for nothing.
    s = make_schedule(name, 4, 8)
    ctl = tables.control_table(s)
    dev = s.stage_device
    act = np.zeros_like(ctl.act_send)
    grad = np.zeros_like(ctl.grad_send)
    upd = np.zeros(s.num_ticks, bool)
    for t in s.tasks:
        if t.kind == TaskType.F and t.stage < s.num_stages - 1:
            act[t.tick, [c.shift for c in ctl.act_channels].index(
                (dev[t.stage + 1] - dev[t.stage]) % s.num_devices)] = True
        if t.kind == TaskType.B and t.stage > 0:
            grad[t.tick, [c.shift for c in ctl.grad_channels].index(
                (dev[t.stage - 1] - dev[t.stage]) % s.num_devices)] = True
        upd[t.tick] |= t.kind == TaskType.U
    np.testing.assert_array_equal(ctl.act_send, act)
    np.testing.assert_array_equal(ctl.grad_send, grad)
    np.testing.assert_array_equal(ctl.update_tick, upd)
    assert ctl.kinds == {t.kind for t in s.tasks}
    if name in ("gpipe", "1f1b"):   # the warm-up moves no gradients
        assert not ctl.grad_send[0].any()


def test_docs_example_registers_a_new_schedule():
    name = "gpipe-reversed-test"

    @sc.register_schedule(name)
    def gpipe_reversed(num_stages, num_microbatches):
        S, M, F, B = num_stages, num_microbatches, TaskType.F, TaskType.B
        orders = [[(F, d, m) for m in range(M)] + [(B, d, m) for m in reversed(range(M))]
                  for d in range(S)]
        return sc.place_tasks(name, S, M, range(S), orders)

    try:
        s = make_schedule(name, 3, 4)
        s.validate()
        assert s.bubble_fraction() == pytest.approx(make_schedule("gpipe", 3, 4).bubble_fraction())
        with pytest.raises(ValueError, match="already registered"):
            sc.register_schedule(name)(gpipe_reversed)
    finally:
        del SCHEDULES[name]
