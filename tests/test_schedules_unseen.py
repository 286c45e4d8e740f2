"""Hand-written schedules (odd but valid ones run exactly; broken ones are refused with a
one-line message before any compile) and builder arguments at the edges."""
import dataclasses
import json

import jax
import numpy as np
import pytest

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from jaxhybrid.pipeline.stages import even_boundaries
from jaxhybrid.schedules import (IDLE, Schedule, Task, TaskType, make_schedule,
                                 place_tasks)

import mixed_model as mm

F, B, W, U = TaskType.F, TaskType.B, TaskType.W, TaskType.U
RNG = jax.random.key(42)


def _table(name, D, M, stage_device, rows, **kw):
    return Schedule(name, D, M, tuple(stage_device), tuple(sorted(Task(*r) for r in rows)), **kw)


# Two devices, two microbatches, one stage each: the smallest valid table.
GOOD = [(0, 0, F, 0, 0), (1, 0, F, 0, 1), (1, 1, F, 1, 0), (2, 1, F, 1, 1),
        (2, 1, B, 1, 0), (3, 0, B, 0, 0), (3, 1, B, 1, 1), (4, 0, B, 0, 1)]


def _good(rows=GOOD, **kw):
    return _table("mine", 2, 2, (0, 1), rows, **kw)


ONE_DEVICE_ASYNC = dict(num_devices=1, num_microbatches=3, stage_device=(0,), weights="stash")


# --- refused tables -----------------------------------------------------------------------
@pytest.mark.parametrize("rows,kw,msg", [
    # A negative tick indexed the runtime's table from its end: wrong loss and gradients.
    ([(t - 1, *r) for t, *r in GOOD], {}, "tick >= 0"),
    ([(0.5, 0, F, 0, 0), *GOOD[1:]], {}, "must be ints"),
    ([(0, 0, 0, 0, 0), *GOOD[1:]], {}, "must be a Task"),          # kind not a TaskType
    ([], {}, "has no tasks"),
    (GOOD, dict(stage_device=(0, -1)), r"must hold device indices 0\.\.1"),
    (GOOD, dict(num_microbatches=0), "must be ints >= 1"),
    ([*GOOD, (5, 0, F, 2, 0)], {}, r"names stage 2; stages are 0\.\.1"),
    ([*GOOD, (5, 0, F, 0, 2)], {}, r"names microbatch 2; .*num_microbatches=2"),
    ([*GOOD, (5, 0, F, 0, 0)], {}, r"F0s0 is repeated \(ticks 0 and 5\)"),
    # forward_only with backward tasks: a KeyError from the control table.
    (GOOD, dict(forward_only=True), "runs F tasks only"),
    # A synchronous U on device 0 only: device 1 silently kept its old parameters.
    ([*GOOD, (5, 0, U, 0, IDLE)], {}, r"one U task per device .*devices without one: \[1\]"),
    # A synchronous U naming microbatch 0 passed once B0 was done: the update used the
    # gradient of microbatch 0 alone.
    ([*GOOD, (3, 0, U, 0, 0), (4, 1, U, 1, 0)], {}, "give them microbatch=-1"),
    # Asynchronous tables on one device. Windows [0] and [1, 2]: each U applied 2/3 of its
    # window's sum, not its mean, silently; a U naming microbatch -5: a KeyError.
    ([(0, 0, F, 0, 0), (0, 0, B, 0, 0), (0, 0, U, 0, 0), (1, 0, F, 0, 1), (1, 0, B, 0, 1),
      (2, 0, F, 0, 2), (2, 0, B, 0, 2), (2, 0, U, 0, 2)], ONE_DEVICE_ASYNC,
     r"windows of one size.*ends \[0, 2\]; 2 updates of 3"),
    ([(0, 0, F, 0, 0), (0, 0, B, 0, 0), (0, 0, U, 0, -5), (1, 0, F, 0, 1), (1, 0, B, 0, 1),
      (2, 0, F, 0, 2), (2, 0, B, 0, 2), (2, 0, U, 0, 2)], ONE_DEVICE_ASYNC, "windows of one size"),
    # B0 after the U closing its window [0, 1]: its gradient was never applied.
    ([(0, 0, F, 0, 0), (1, 0, F, 0, 1), (1, 0, B, 0, 1), (1, 0, U, 0, 1), (2, 0, B, 0, 0),
      (3, 0, F, 0, 2), (3, 0, B, 0, 2), (4, 0, F, 0, 3), (4, 0, B, 0, 3), (4, 0, U, 0, 3)],
     {**ONE_DEVICE_ASYNC, "num_microbatches": 4},
     r"U of device 0 at tick 1 before a backward of its gradient window \(microbatches 0\.\.1\)"),
])
def test_broken_tables_are_refused_in_one_line(rows, kw, msg):
    args = dict(name="mine", num_devices=2, num_microbatches=2, stage_device=(0, 1),
                tasks=tuple(Task(*r) if isinstance(r, tuple) else r for r in rows))
    args.update(kw)
    with pytest.raises(ValueError, match=msg) as e:
        Schedule(**args).validate()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("drop", [
    lambda t: t.device == 1,                          # device 1 never updated
    lambda t: t.device == 1 and t.microbatch == 1,    # windows differ between devices
    lambda t: t.microbatch == 3,                      # the tail's gradient never applied
])
def test_asynchronous_tables_need_the_same_closed_windows_on_every_device(drop):
    # Each validated; train_step without the tail U moved the parameters 0.09 away.
    s = make_schedule("pipedream", 2, 4)
    broken = dataclasses.replace(s, tasks=tuple(t for t in s.tasks
                                                if not (t.kind == U and drop(t))))
    with pytest.raises(ValueError, match="every device needs U tasks closing the same "
                                         "gradient windows, the last at microbatch 3"):
        broken.validate()


def test_a_registered_builder_is_checked_like_a_users_table():
    # docs/pipeline.md: a builder may build its tasks by hand; what it returned was never
    # validated (a negative tick ran), nor its size (M + 1 microbatches ran as M).
    from jaxhybrid.schedules import SCHEDULES, register_schedule
    builders = {
        "probe-bad-tick": (lambda S, M: Schedule("probe-bad-tick", S, M, tuple(range(S)),
                                                 (Task(-1, 0, F, 0, 0),)), "tick >= 0"),
        "probe-wrong-size": (lambda S, M: make_schedule("1f1b", S, M + 1),
                             "returned 2 devices x 3 microbatches for 2 x 2"),
        "probe-none": (lambda S, M: None, "returned NoneType"),
    }
    try:
        for name, (fn, msg) in builders.items():
            register_schedule(name)(fn)
            with pytest.raises(ValueError, match=msg):
                make_schedule(name, 2, 2)
    finally:
        for name in builders:
            SCHEDULES.pop(name, None)


def test_a_table_of_plain_tuples_is_refused():
    with pytest.raises(ValueError, match="must be a Task"):
        Schedule("mine", 2, 2, (0, 1), tuple(GOOD)).validate()


def test_a_forward_only_table_is_refused_by_the_pipeline():
    # Its value_and_grad returned zero gradients for every stage but the last.
    fwd = _good([r for r in GOOD if r[2] == F], forward_only=True)
    fwd.validate()
    with pytest.raises(ValueError, match="is forward_only .*pass a training schedule"):
        jp.Pipeline(mm.make_layers(0), mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2,
                    schedule=fwd)


def test_a_table_for_another_mesh_is_refused():
    with pytest.raises(ValueError, match="is for 2 devices x 2 microbatches, the pipeline "
                                         "has 4 x 2"):
        jp.Pipeline(mm.make_layers(2), mesh=jh.make_mesh(data=1, pipe=4), num_microbatches=2,
                    schedule=_good())


@pytest.mark.parametrize("S,M,opts,msg", [
    (True, 2, {}, "whole numbers"),                    # ran as 1 device
    ("2", 2, {}, "whole numbers"),                     # TypeError from '<'
    (2, None, {}, "whole numbers"),
    (2, 2, dict(virtual_stages=True), "virtual_stages=True must be an int"),
    (2, 2, dict(virtual_stages=[2]), "must be plain values"),   # unhashable type: 'list'
])
def test_make_schedule_refuses_odd_arguments(S, M, opts, msg):
    name = "interleaved" if opts else "1f1b"
    with pytest.raises(ValueError, match=msg):
        make_schedule(name, S, M, **opts)


@pytest.mark.parametrize("kw,msg", [
    # weight_cost > bwd_cost made B cost < 0: a bubble of 0.53 for a 1f1b-sized table.
    (dict(weight_cost=3.0), "exceeds bwd_cost=2.0"),
    (dict(fwd_cost=-1.0), "fwd_cost=-1.0 must be a finite cost >= 0"),
    (dict(fwd_cost=[1, 2, 3]), r"one per stage \(2 stages\)"),   # numpy's broadcast error
    (dict(fwd_cost=0.0, bwd_cost=0.0), "every task costs 0"),        # nan, with a warning
])
def test_bubble_fraction_refuses_meaningless_costs(kw, msg):
    with pytest.raises(ValueError, match=msg):
        make_schedule("zb-h1", 2, 3).bubble_fraction(**kw)


@pytest.mark.parametrize("S,M,v", [(8, 13, 3), (8, 21, 3), (6, 9, 4)])
def test_interleaved_builds_where_every_small_warmup_deadlocks(S, M, v):
    # Warm-ups 0..S all deadlocked: the builder returned None ("replace() should be
    # called on dataclass instances").
    s = make_schedule("interleaved", S, M, virtual_stages=v)
    assert s.num_stages == S * v and s.bubble_fraction() < make_schedule("1f1b", S, M).bubble_fraction()


@pytest.mark.parametrize("S,M", [(2, 3), (4, 5), (8, 17)])
def test_interleaved_with_a_short_last_group_beats_1f1b(S, M):
    # A last group of M % S microbatches ran nearly alone through all 2S stages: a bubble
    # above 1f1b's (S=8, M=17: 0.346 against 0.292). Merged into the group before it,
    # the table reaches the interleaved bound (S-1) / (vM + S-1).
    s = make_schedule("interleaved", S, M)
    assert s.bubble_fraction() == pytest.approx((S - 1) / (2 * M + S - 1))
    assert s.in_flight().max() <= 3 * S


def test_a_plan_for_a_users_schedule_reports_and_round_trips():
    # The plan kept only the schedule's name and rebuilt the table from it: summary,
    # predicted_step_time and plot raised "unknown schedule 'v3-odd'".
    from jaxhybrid import plan as planner
    from jaxhybrid.plan.costs import LayerCost
    costs = [LayerCost(f"l{i}", 2, 1e9, 2e9, 1e7, 2e7, 4000, 1000, 4096, 4096, 4096, 4096,
                       1e-3 * (1 + i % 3), 2e-3 * (1 + i % 3)) for i in range(8)]
    s = _v3_round_robin()
    p = planner.make_plan(costs, num_stages=2, num_microbatches=3, schedule=s)
    assert p.schedule_table() is s and "schedule v3-odd" in p.summary()
    assert p.bubble_fraction == pytest.approx(s.bubble_fraction(*p._tick_costs()))
    back = planner.Plan.from_json(p.to_json())          # the table travels in the JSON
    assert back.schedule_table() == s and back.summary() == p.summary()
    # A user's table under a registered name came back as that builder's table, silently
    # (a GPipe table named "1f1b": predicted step 0.025 s, then 0.0217 s).
    gpipe_as_1f1b = dataclasses.replace(make_schedule("gpipe", 2, 3), name="1f1b")
    p = planner.make_plan(costs, num_stages=2, num_microbatches=3, schedule=gpipe_as_1f1b)
    back = planner.Plan.from_json(p.to_json())
    assert back.schedule_table() == gpipe_as_1f1b
    assert back.predicted_step_time == p.predicted_step_time
    registered = planner.make_plan(costs, num_stages=2, num_microbatches=3, schedule="1f1b")
    assert "table" not in json.loads(registered.to_json())   # rebuilt from its name


def test_virtual_stages_beside_a_schedule_is_refused_in_one_line():
    with pytest.raises(ValueError, match="is a Schedule, whose stage_device") as e:
        jp.Pipeline(mm.make_layers(4), mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=3,
                    schedule=_v3_round_robin(), virtual_stages=3)
    assert len(str(e.value)) < 200   # it printed every task


def test_forwards_out_of_microbatch_order_are_refused_for_a_model_with_state():
    # F2 before F0 and F1 on every stage: loss and gradients matched, but BatchNorm's
    # running statistics were updated in that order (7e-2 off the reference's).
    orders = [[(F, d, m) for m in (2, 0, 1)] + [(B, d, m) for m in (1, 2, 0)] for d in range(2)]
    s = place_tasks("perm-mb", 2, 3, range(2), orders)
    assert s.forward_order_break() == (0, 2) and make_schedule("zbv", 2, 3).forward_order_break() is None
    pipe = jp.Pipeline(mm.make_layers(0), mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=3,
                       schedule=s)
    inputs, labels = mm.make_batch(6)
    variables = pipe.init(jax.random.key(0), inputs)
    with pytest.raises(ValueError, match=r"runs F2 of stage 0 before F1, but its "
                                         r"batch_stats update .* in order"):
        pipe.value_and_grad(mm.loss_fn)(variables, inputs, labels, RNG)


# --- odd but valid tables -------------------------------------------------------------------
def _split_reversed():
    """Split backward on reversed devices (stage 0 on device 1): stage 1 runs F, B and W
    of microbatch 0 in one tick, backwards last microbatch first, an idle stretch where
    no device works, and W of stage 0 long after its B in yet another order."""
    rows = [(0, 1, F, 0, 0), (1, 1, F, 0, 1), (2, 1, F, 0, 2),
            (1, 0, F, 1, 0), (1, 0, B, 1, 0), (1, 0, W, 1, 0), (2, 1, B, 0, 0),
            (3, 0, F, 1, 2), (4, 0, B, 1, 2), (5, 0, F, 1, 1), (6, 0, B, 1, 1),
            (5, 1, B, 0, 2), (7, 1, B, 0, 1), (8, 0, W, 1, 2), (8, 0, W, 1, 1),
            (12, 1, W, 0, 1), (13, 1, W, 0, 2), (14, 1, W, 0, 0)]
    return _table("split-reversed", 2, 3, (1, 0), rows, split_backward=True)


def test_odd_tables_validate_and_report_their_shape():
    s = _split_reversed()
    with pytest.raises(ValueError, match="two W tasks on device 0 in tick 8"):
        s.validate()
    s = dataclasses.replace(s, tasks=tuple(sorted(
        dataclasses.replace(t, tick=9) if (t.kind, t.stage, t.microbatch) == (W, 1, 1) else t
        for t in s.tasks)))
    s.validate()
    # Stage 0 (device 1) holds all 3 microbatches from their F to their W; stage 1
    # (device 0) microbatches 2 and 1 in ticks 5..8.
    assert list(s.in_flight()) == [2, 3] and list(s.stage_in_flight()) == [3, 2]
    # Work 18 units (F = B = W = 1 when split, the defaults); ticks 10, 11 idle everywhere
    # cost nothing, tick 1 (F+B+W on device 0) lasts 3 and tick 2 (F+B) 2: 16 units of
    # time on 2 devices.
    assert s.bubble_fraction() == pytest.approx(1 - 18 / 32)
    chart = s.chart().splitlines()
    assert chart[0].startswith("split-reversed: S=2 v=1 M=3 ticks=15")
    assert chart[1].split()[3] == "F0B0W0" and chart[2].split()[2] == "F0"
    # A table given as lists works as well (the pipeline's caches hash it).
    as_lists = Schedule("l", 2, 3, list(s.stage_device), list(s.tasks), split_backward=True)
    assert hash(as_lists) == hash(dataclasses.replace(s, name="l"))


def _v3_round_robin():
    """3 stages per device in a non-contiguous order (1, 0, 0, 1, 1, 0), M = 3 (not a
    multiple of S), backwards first wherever ready."""
    sd, M = (1, 0, 0, 1, 1, 0), 3
    orders = [[(F, k, m) for m in range(M) for k in range(6) if sd[k] == d]
              + [(B, k, m) for m in range(M) for k in reversed(range(6)) if sd[k] == d]
              for d in range(2)]
    return place_tasks("v3-odd", 2, M, sd, orders, priority=lambda t: (-int(t[0]), t[2], t[1]))


def _check_against_reference(sched, data, num_mix):
    layers, M = mm.make_layers(num_mix), sched.num_microbatches
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=data, pipe=sched.num_devices),
                       num_microbatches=M, schedule=sched,
                       boundaries=even_boundaries(len(layers), sched.num_stages))
    single = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=1))
    per_layer = single.unpack(single.init(jax.random.key(0), mm.make_batch(2)[0]))
    for v in per_layer:   # non-trivial running statistics, so their update is checked
        if "batch_stats" in v:
            v["batch_stats"] = jax.tree.map(lambda a: a + 0.3, v["batch_stats"])
    inputs, labels = mm.make_batch(data * M * 2, seed=5)
    ref_loss, ref_grads, ref_vars = jp.reference_value_and_grad(
        layers, per_layer, mm.loss_fn, inputs, labels, data=data, num_microbatches=M, rng=RNG)
    variables = pipe.pack(per_layer)
    loss, grads, new = pipe.value_and_grad(mm.loss_fn)(variables, inputs, labels, RNG)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    got = [v["params"] for v in pipe.unpack({**variables, "params": grads})]
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
    stats = lambda vs: jax.tree.leaves([v.get("batch_stats", {}) for v in vs])
    assert len(stats(ref_vars)) == 4   # two BatchNorms' mean and var
    for g, r in zip(stats(pipe.unpack(new)), stats(ref_vars)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_split_reversed_table_with_its_own_updates_matches_the_reference():
    s = _split_reversed()
    s = dataclasses.replace(s, tasks=tuple(sorted(
        dataclasses.replace(t, tick=9) if (t.kind, t.stage, t.microbatch) == (W, 1, 1) else t
        for t in s.tasks)))
    # U tasks of the user's own (value_and_grad has no optimizer to run them: it raised
    # "'NoneType' object has no attribute 'update'").
    s = s.with_updates()
    assert sum(t.kind == U for t in s.tasks) == 2
    # Stage 1 (Flatten + Head: no mutable state) runs F2 before F1: allowed, exact.
    assert s.forward_order_break() == (1, 2) and s.forward_order_break([0]) is None
    _check_against_reference(s, data=2, num_mix=0)


def test_three_round_robin_stages_per_device_match_the_reference():
    s = _v3_round_robin()
    assert s.virtual_stages == 3 and s.num_ticks == 18
    _check_against_reference(s, data=1, num_mix=2)
