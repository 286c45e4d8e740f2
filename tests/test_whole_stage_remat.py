"""Stages recomputed whole from their input (the runtime's stage-level remat="full"): the
memory model prices what such a stage keeps and re-materialises, the planner reports it
for `Pipeline(remat="full")`, falls back to it when no per-layer choice meets a budget,
and the Pipeline runs the plan it made."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from jaxhybrid.plan import LayerCost, MemoryBudgetError, make_plan, spmd_memory
from jaxhybrid.plan.memory_model import memory_terms
from jaxhybrid.plan.plan import Plan
from jaxhybrid.schedules import make_schedule
from jaxhybrid.step_memory import compiled_bytes


def layer(i, saved=1000, inp=100, params=8, out=None):
    return LayerCost(name=f"l{i}", batch_size=1, fwd_flops=1, bwd_flops=2, fwd_bytes=1,
                     bwd_bytes=1, param_bytes=params, param_count=params // 4, in_bytes=inp,
                     out_bytes=inp if out is None else out, saved_bytes=saved,
                     saved_bytes_remat=inp, fwd_time=1.0, bwd_time=2.0)


def test_a_stage_recomputed_whole_keeps_its_input_and_rematerialises_every_residual():
    costs = [dataclasses.replace(layer(i, saved=1000 + 100 * i, inp=100 + i), bwd_temp_bytes=30)
             for i in range(6)]
    sched = make_schedule("1f1b", 2, 4)
    rows = sched.ring_slots()[1]["stash"] + 1
    plain = memory_terms(costs, [3], sched)
    whole = memory_terms(costs, [3], sched, [True] * 6, whole_stage=[True, True])
    # Stage inputs 100 and 103 bytes, the last stage also the loss's (its 105-byte output).
    row = max(100, 103 + 105)
    assert whole["stash"] == rows * row - row
    # Working: a row beside the ring, the largest stage's residuals all at once (layers
    # 3-5: 1300 + 1400 + 1500), the largest layer's in + out cotangents and the stage's
    # backward temporaries.
    assert whole["working"] == row + (1300 + 1400 + 1500) + (105 + 105) + 3 * 30
    for k in ("params", "opt_state", "grads", "inboxes", "inputs"):
        assert whole[k] == plain[k]
    # Per layer, every layer recomputed keeps every layer's input.
    per_layer = memory_terms(costs, [3], sched, [True] * 6)
    assert per_layer["stash"] == (rows - 1) * (103 + 104 + 105 + 105)
    with pytest.raises(ValueError, match=r"whole_stage needs one bool per stage \(2\), got 3"):
        spmd_memory(costs, [3], sched, whole_stage=[True] * 3)


def test_a_split_backward_stage_recomputed_whole_crosses_its_parameter_gradients():
    costs = [dataclasses.replace(layer(i, saved=4000, inp=100, params=400),
                                 cross_by_dtype={"float32": 100}, param_by_dtype={"float32": 400},
                                 weight_saved_by_dtype={"float32": 100})
             for i in range(6)]
    sched = make_schedule("zb-h1", 2, 4)
    slots = sched.ring_slots()[1]["cross"]
    whole = memory_terms(costs, [3], sched, [True] * 6, whole_stage=[True, True])
    # Stage 1's B runs the one checkpoint whole: its three layers' 400-byte kernel
    # gradients cross to W, into a row of max(100, 100 + 100) bytes (the loss's 100) that
    # W no longer reads: 1200 - 200 per slot overflow into the cross ring.
    assert whole["cross"] == slots * (1200 - 200)


def _chain(n, width):
    return [nn.Sequential([nn.Dense(width), jnp.tanh]) for _ in range(n)]


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


def _lowered_bytes(pipe, variables, x, y):
    return compiled_bytes(pipe.value_and_grad(_mse).lower(variables, x, y, None).compile())


def _assert_exact(pipe, layers, variables, x, y):
    """The pipeline's loss and gradients against the layers run in sequence on one device."""
    loss, grads, _ = pipe.value_and_grad(_mse)(variables, x, y, None)

    def reference(per):
        h = x
        for lay, v in zip(layers, per):
            h = lay.apply(v, h)
        return _mse(h, y)

    ref_loss, ref_grads = jax.value_and_grad(reference)(pipe.unpack(variables))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(pipe.unpack(grads)), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def test_pipeline_remat_full_is_planned_as_compiled():
    """A chain of Dense+tanh layers on 4 stages with remat="full": the plan's device memory
    within 15% of the compiled value_and_grad step (+2% here; the per-layer reading, every
    layer's input kept, is 1.55x it)."""
    mesh = jh.make_mesh(data=1, pipe=4)
    x = jax.random.normal(jax.random.key(0), (512, 8))
    y = jnp.zeros((512, 8))
    pipe = jp.Pipeline(_chain(24, 8), mesh=mesh, num_microbatches=4, remat="full",
                       param_state_factor=2)
    variables = pipe.init(jax.random.key(1), x)
    plan = pipe.plan
    assert plan.whole_stage_remat == [True] * 4 and all(plan.remat)
    assert plan.pipeline_remat == ["full"] * 4
    compiled = _lowered_bytes(pipe, variables, x, y)
    assert abs(plan.device_memory / compiled - 1) < 0.15, (plan.device_memory, compiled)
    per_layer = spmd_memory(pipe._layer_costs(), plan.boundaries, pipe.schedule, plan.remat,
                            param_state_factor=2)[1]
    assert per_layer > 1.4 * compiled


def test_a_budget_only_whole_stages_meet_is_planned_and_run_with_them():
    mesh = jh.make_mesh(data=1, pipe=4)
    x = jax.random.normal(jax.random.key(0), (512, 8))
    y = jnp.zeros((512, 8))
    layers = _chain(24, 8)
    probe = jp.Pipeline(layers, mesh=mesh, num_microbatches=4, remat="full",
                        param_state_factor=2)
    probe.init(jax.random.key(1), x)
    full = probe.plan
    costs = probe._layer_costs()
    per_layer = spmd_memory(costs, full.boundaries, probe.schedule, [True] * 24,
                            param_state_factor=2)[1]
    budget = (full.device_memory + per_layer) / 2
    plan = make_plan(costs, num_stages=4, num_microbatches=4, schedule="1f1b",
                     memory_budget=budget, boundaries=full.boundaries, param_state_factor=2)
    assert plan.whole_stage_remat == [True] * 4 and plan.device_memory <= budget
    assert Plan.from_json(plan.to_json()).whole_stage_remat == [True] * 4
    with pytest.raises(MemoryBudgetError, match=r"every layer recomputed.*Each stage "
                                                r"recomputed whole from its input needs "):
        make_plan(costs, num_stages=4, num_microbatches=4, schedule="1f1b",
                  memory_budget=full.device_memory * 0.9, boundaries=full.boundaries,
                  param_state_factor=2)
    pipe = jp.Pipeline(layers, mesh=mesh, num_microbatches=4, remat="auto",
                       memory_budget=budget, boundaries=full.boundaries, param_state_factor=2)
    variables = pipe.init(jax.random.key(1), x)
    assert [p.stage_remat for p in pipe.programs] == ["full"] * 4
    _assert_exact(pipe, layers, variables, x, y)
    assert _lowered_bytes(pipe, variables, x, y) <= budget


def test_a_plan_mixing_whole_stages_and_single_layers_runs_as_planned():
    """One stage recomputed whole, another recomputing one of its layers: the plan hands
    the Pipeline both (per stage "full" or that stage's bools), the Pipeline plans what it
    runs, and the step is exact against one device."""
    costs = [layer(i) for i in range(4)]
    plan = make_plan(costs, num_stages=2, num_microbatches=2, schedule="1f1b",
                     boundaries=[2], remat=[False, False, True, False],
                     whole_stage_remat=[True, False])
    assert plan.remat == [True, True, True, False]
    assert plan.pipeline_remat == ["full", [True, False]]
    with pytest.raises(ValueError, match=r"whole_stage_remat has 3 entries, one per stage \(2\)"):
        make_plan(costs, num_stages=2, num_microbatches=2, whole_stage_remat=[True] * 3)

    mesh = jh.make_mesh(data=2, pipe=4)
    x = jax.random.normal(jax.random.key(0), (16, 8))
    y = jnp.ones((16, 8))
    layers = _chain(8, 8)
    remat = ["full", [False, True], "none", [True, True]]
    pipe = jp.Pipeline(layers, mesh=mesh, num_microbatches=2, remat=remat,
                       boundaries=[2, 4, 6])
    variables = pipe.init(jax.random.key(1), x)
    assert [p.stage_remat for p in pipe.programs] == ["full", "none", "none", "none"]
    assert [p.layer_remat for p in pipe.programs] == [(False, False), (False, True),
                                                      (False, False), (True, True)]
    assert pipe.plan.whole_stage_remat == [True, False, False, False]
    assert pipe.plan.pipeline_remat == ["full", [False, True], [False, False], [True, True]]
    _assert_exact(pipe, layers, variables, x, y)
    with pytest.raises(ValueError, match=r"remat\[1\] has 3 bools, stage 1 has 2 layers "
                                         r"\(2\.\.3\)"):
        jp.Pipeline(layers, mesh=mesh, num_microbatches=2, boundaries=[2, 4, 6],
                    remat=["full", [True] * 3, "none", "none"])


class _Wide(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(8)(jnp.tanh(nn.Dense(self.width)(x))))


def test_per_stage_remat_under_the_planners_cuts_is_planned_as_it_runs():
    """remat=["full", "none"] with boundaries=None: the plan took per-layer flags from the
    even split standing in before planning (layers 2-3 "recomputed" in stage 1, device
    memory 16% low); a list of one stage's bools cannot follow cuts not yet chosen; a
    policy stage blanked every other stage's recompute in the plan."""
    layers = [_Wide(256)] * 3 + [_Wide(8)] * 5
    x = jax.random.normal(jax.random.key(0), (32, 8))
    mesh = jh.make_mesh(data=1, pipe=2)
    pipe = jp.Pipeline(layers, mesh=mesh, num_microbatches=2, remat=["full", "none"])
    pipe.init(jax.random.key(1), x)
    (a, b), _ = pipe.ranges
    assert [p.stage_remat for p in pipe.programs] == ["full", "none"]
    assert pipe.plan.remat == [True] * b + [False] * (8 - b)
    assert pipe.plan.pipeline_remat == ["full", [False] * (8 - b)]
    fixed = jp.Pipeline(layers, mesh=mesh, num_microbatches=2, remat=["full", "none"],
                        boundaries=pipe.plan.boundaries)
    fixed.init(jax.random.key(1), x)
    assert fixed.plan.device_memory == pipe.plan.device_memory
    with pytest.raises(ValueError, match=r"remat lists some stages' own layers, but the planner "
                                         r"chooses the cuts \(boundaries=None\): give boundaries="):
        jp.Pipeline(layers, mesh=mesh, num_microbatches=2, remat=["full", [True] * 4])
    policy = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=4), num_microbatches=2,
                         boundaries=[2, 4, 6],
                         remat=["full", [True, False], "none", "dots_saveable"])
    policy.init(jax.random.key(1), x)
    assert policy.plan.whole_stage_remat == [True, False, False, False]
    assert policy.plan.pipeline_remat == ["full", [True, False], [False, False], "dots_saveable"]
    assert policy.plan.remat[6:] == [False, False]   # priced as no recompute


def test_a_budget_met_by_recomputing_the_stage_that_sets_the_row_recomputes_only_it():
    """The stash row every device holds is padded to the largest stage's: where the wide
    first stage sets it, recomputing that stage whole meets the budget, and the narrow
    stages keep their forward time (the fallback recomputed every stage whole)."""
    mesh = jh.make_mesh(data=1, pipe=4)
    x = jax.random.normal(jax.random.key(0), (512, 8))
    y = jnp.zeros((512, 8))
    layers = _chain(12, 64) + [nn.Dense(8)] + _chain(11, 8)
    cuts = [12, 16, 20]
    none = jp.Pipeline(layers, mesh=mesh, num_microbatches=4, remat="none", boundaries=cuts,
                       param_state_factor=2)
    none_vars = none.init(jax.random.key(1), x)
    costs = none._layer_costs()
    first = [True] * 12 + [False] * 12
    first_only = spmd_memory(costs, cuts, none.schedule, first,
                             whole_stage=[True, False, False, False], param_state_factor=2)[1]
    every = spmd_memory(costs, cuts, none.schedule, [True] * 24, whole_stage=[True] * 4,
                        param_state_factor=2)[1]
    per_layer = spmd_memory(costs, cuts, none.schedule, [True] * 24, param_state_factor=2)[1]
    assert every < first_only < per_layer / 1.5   # the budget below needs a whole stage
    budget = 1.05 * first_only
    plan = make_plan(costs, num_stages=4, num_microbatches=4, schedule="1f1b",
                     memory_budget=budget, boundaries=cuts, param_state_factor=2)
    assert plan.whole_stage_remat == [True, False, False, False] and plan.remat == first
    assert plan.device_memory <= budget
    all_whole = make_plan(costs, num_stages=4, num_microbatches=4, schedule="1f1b",
                          boundaries=cuts, param_state_factor=2, whole_stage_remat=[True] * 4)
    assert plan.predicted_step_time < all_whole.predicted_step_time
    with pytest.raises(MemoryBudgetError, match=r"Each stage recomputed whole from its input "
                                                r"needs "):
        make_plan(costs, num_stages=4, num_microbatches=4, schedule="1f1b",
                  memory_budget=0.95 * every, boundaries=cuts, param_state_factor=2)

    pipe = jp.Pipeline(layers, mesh=mesh, num_microbatches=4, remat="auto",
                       memory_budget=budget, boundaries=cuts, param_state_factor=2)
    variables = pipe.init(jax.random.key(1), x)
    assert [p.stage_remat for p in pipe.programs] == ["full", "none", "none", "none"]
    _assert_exact(pipe, layers, variables, x, y)
    assert _lowered_bytes(pipe, variables, x, y) < 0.6 * _lowered_bytes(none, none_vars, x, y)


def _tanh_count(pipe, variables, x, y):
    return pipe.value_and_grad(_mse).lower(variables, x, y, None).as_text().count("stablehlo.tanh")


def test_a_plan_runs_a_stages_checkpoint_policy_again():
    """A stage under a jax.checkpoint policy: the plan held only bools and "full", so
    `Pipeline(plan=pipe.plan)` ran that stage without recompute, silently. A policy given
    as the object is taken by its name; "auto" for one stage is refused by what it is."""
    mesh = jh.make_mesh(data=1, pipe=2)
    x = jax.random.normal(jax.random.key(0), (64, 8))
    y = jnp.zeros((64, 8))
    layers = _chain(8, 8)
    pipe = jp.Pipeline(layers, mesh=mesh, num_microbatches=4, boundaries=[4],
                       remat=["none", jax.checkpoint_policies.dots_saveable])
    variables = pipe.init(jax.random.key(1), x)
    assert [p.stage_remat for p in pipe.programs] == ["none", "dots_saveable"]
    plan = Plan.from_json(pipe.plan.to_json())
    assert plan.stage_policy == [None, "dots_saveable"]
    assert plan.pipeline_remat == [[False] * 4, "dots_saveable"]
    assert "stage 1 runs under jax.checkpoint policy 'dots_saveable'" in plan.summary()
    again = jp.Pipeline(layers, mesh=mesh, num_microbatches=4, plan=plan)
    again_vars = again.init(jax.random.key(1), x)
    assert [p.stage_remat for p in again.programs] == ["none", "dots_saveable"]
    plain = jp.Pipeline(layers, mesh=mesh, num_microbatches=4, boundaries=[4], remat="none")
    plain_vars = plain.init(jax.random.key(1), x)
    # Stage 1 recomputes its four tanh layers' forward in the backward.
    assert (_tanh_count(again, again_vars, x, y)
            == _tanh_count(pipe, variables, x, y) == _tanh_count(plain, plain_vars, x, y) + 4)
    _assert_exact(again, layers, again_vars, x, y)
    with pytest.raises(ValueError, match=r"remat 'auto' is for the whole pipeline .* not for "
                                         r"one stage"):
        jp.Pipeline(layers, mesh=mesh, boundaries=[4], remat=["auto", "none"])
    mine = jax.checkpoint_policies.save_only_these_names("h")
    with pytest.raises(ValueError, match=r"a policy the pipeline cannot name .* give a name "
                                         r"such as 'dots_saveable'"):
        jp.Pipeline(layers, mesh=mesh, boundaries=[4], remat=[mine, "none"])
