"""Stages run under a jax.checkpoint policy (remat="dots_saveable", ...): the memory model
prices what the policy keeps, traced as the runtime traces the stage, and the plan's
backward times what the policy runs again (`jaxhybrid.pipeline.policy_costs`), instead of
pricing the stage as not recomputed."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from jaxhybrid.plan import LayerCost
from jaxhybrid.plan.memory_model import memory_terms
from jaxhybrid.schedules import make_schedule
from jaxhybrid.step_memory import compiled_bytes


class Block(nn.Module):
    """Two matmuls and elementwise work: dots_saveable keeps the matmuls' outputs."""
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(64)(x))
        return x + jnp.sin(nn.Dense(32)(h))


LAYERS = [nn.Dense(32)] + [Block() for _ in range(6)] + [nn.Dense(4)]


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


def _planned_and_compiled(remat, schedule="1f1b"):
    x = jax.random.normal(jax.random.key(0), (256, 16))
    t = jnp.zeros((256, 4))
    pipe = jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=1, pipe=4), num_microbatches=4,
                       schedule=schedule, boundaries=[2, 4, 6], remat=remat,
                       param_state_factor=2)   # value_and_grad alone: no optimizer state
    variables = pipe.init(jax.random.key(1), x)
    compiled = compiled_bytes(pipe.value_and_grad(_mse).lower(variables, x, t).compile())
    return pipe.plan, compiled


@pytest.fixture(scope="module")
def measured():
    return {r: _planned_and_compiled(r) for r in ("none", "dots_saveable", "nothing_saveable")}


def test_policy_stages_are_priced_as_they_compile(measured):
    """Within 10% of the compiled step each; and what a policy saves against no
    recompute as the compiled steps differ (priced as not recomputed, nothing_saveable
    was predicted at no recompute's bytes, 16% over its step)."""
    for remat, (plan, compiled) in measured.items():
        assert abs(plan.device_memory / compiled - 1) < 0.10, (remat, plan.device_memory, compiled)
    none_plan, none_compiled = measured["none"]
    for remat in ("dots_saveable", "nothing_saveable"):
        plan, compiled = measured[remat]
        saved, predicted_saving = none_compiled - compiled, none_plan.device_memory - plan.device_memory
        assert saved > 0 and abs(predicted_saving / saved - 1) < 0.35, (remat, predicted_saving, saved)
        assert plan.stage_policy == [remat] * 4 and not any(plan.remat)
        assert all(k is not None for k in plan.stage_policy_kept)
    # dots_saveable keeps the matmuls' outputs beside the stage input; nothing_saveable
    # the stage input alone (what remat="full" keeps).
    dots, nothing = (measured[r][0].stage_policy_kept for r in ("dots_saveable", "nothing_saveable"))
    assert all(sum(d.values()) > sum(n.values()) for d, n in zip(dots, nothing))
    summary = measured["dots_saveable"][0].summary()
    assert "memory priced with the" in summary and "pol" in summary


def test_make_plan_holds_the_policies_it_prices():
    """Called directly, make_plan priced policy stages but its plan named none: its
    summary said nothing and Pipeline(plan=...) ran no policy."""
    from jaxhybrid.plan import make_plan
    from jaxhybrid.pipeline.planning import profile_cached
    x = jnp.ones((8, 16))
    costs = profile_cached(LAYERS, x)
    kept = [None, {"float32": 64.0}]
    plan = make_plan(costs, num_stages=2, num_microbatches=2, boundaries=[4],
                     stage_policy=[None, "dots_saveable"], policy_kept=kept)
    assert plan.stage_policy == [None, "dots_saveable"]
    assert plan.pipeline_remat[1] == "dots_saveable"
    with pytest.raises(ValueError, match="name each one's policy in stage_policy"):
        make_plan(costs, num_stages=2, num_microbatches=2, boundaries=[4], policy_kept=kept)
    with pytest.raises(ValueError, match="policy_kept needs the boundaries"):
        make_plan(costs, num_stages=2, num_microbatches=2, stage_policy=[None, "dots_saveable"],
                  policy_kept=kept)


def _plan(remat):
    x = jax.random.normal(jax.random.key(0), (64, 16))
    pipe = jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=1, pipe=4), num_microbatches=4,
                       boundaries=[2, 4, 6], remat=remat)
    pipe.init(jax.random.key(1), x)
    return pipe.plan


def test_policy_stages_time_what_their_backward_runs_again():
    """nothing_saveable runs a stage's whole forward again, as remat="full" does (the
    last stage all but its last Dense, whose output no backward reads): its backward is
    priced as full's; dots_saveable keeps the matmuls' outputs and runs only the
    elementwise work again; everything_saveable next to nothing. Priced as not
    recomputed, all three had the backward of remat="none"."""
    none, full = _plan("none"), _plan("full")
    nothing, dots, everything = (_plan(r) for r in ("nothing_saveable", "dots_saveable",
                                                    "everything_saveable"))
    assert none.stage_policy_recompute is None and full.stage_policy_recompute is None
    assert nothing.stage_policy_recompute[:3] == pytest.approx([1.0] * 3)
    assert 0.9 < nothing.stage_policy_recompute[3] < 1.0
    assert nothing.stage_bwd_time[:3] == pytest.approx(full.stage_bwd_time[:3], rel=1e-6)
    assert all(0 < f < 0.2 for f in dots.stage_policy_recompute)
    # (a checkpoint moves the sin's cosine into the backward: 1% of the forward's FLOPs)
    assert all(0 <= f < 0.02 for f in everything.stage_policy_recompute)
    assert everything.stage_bwd_time == pytest.approx(none.stage_bwd_time, rel=0.02)
    for s in range(4):
        assert none.stage_bwd_time[s] < dots.stage_bwd_time[s] < nothing.stage_bwd_time[s]
        assert dots.stage_bwd_cpu[s] > none.stage_bwd_cpu[s]
    assert nothing.predicted_step_time > dots.predicted_step_time > none.predicted_step_time
    assert "its backward runs 100% of its forward again" in nothing.summary()


def test_policy_recompute_is_priced_where_no_lowered_module_is_analysed(monkeypatch):
    # On GPUs jax analyses no lowered module (`Lowered.cost_analysis()` is None under the
    # PJRT plugin, seen on an H200): every policy stage was priced as recomputing
    # nothing. The jaxpr's matmuls count there.
    from jaxhybrid.plan import costs as plan_costs
    monkeypatch.setattr(jax.stages.Lowered, "cost_analysis", lambda self: None)
    monkeypatch.setattr(plan_costs, "_platform", lambda compiled: "gpu")
    nothing = _plan("nothing_saveable")
    assert nothing.stage_policy_recompute[:3] == pytest.approx([1.0] * 3)


def test_auto_runs_a_policy_where_it_fits_and_is_faster(monkeypatch):
    """remat="auto" under a budget that recomputing nothing misses and dots_saveable
    meets: the stages that recompute run under dots_saveable (it recomputes elementwise
    work only, where the per-layer choice ran whole blocks again), within the budget,
    predicted faster than the per-layer plan, and the step is exact. Under a budget
    the policy misses, the per-layer plan stands."""
    from jaxhybrid.pipeline import planning
    x = jax.random.normal(jax.random.key(0), (256, 16))
    t = jnp.zeros((256, 4))

    def pipeline(remat, budget=None):
        pipe = jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=1, pipe=4), num_microbatches=4,
                           boundaries=[2, 4, 6], remat=remat, memory_budget=budget,
                           param_state_factor=2)
        return pipe, pipe.init(jax.random.key(1), x)

    none, variables = pipeline("none")
    dots = pipeline("dots_saveable")[0].plan.device_memory
    assert dots < none.plan.device_memory
    budget = int((dots + none.plan.device_memory) / 2)
    auto, _ = pipeline("auto", budget)
    with monkeypatch.context() as m:
        m.setattr(planning, "AUTO_POLICIES", ())
        layers = pipeline("auto", budget)[0].plan
    assert any(layers.remat) and layers.stage_policy is None
    plan = auto.plan
    assert plan.stage_policy and set(plan.stage_policy) <= {None, "dots_saveable"}
    recomputing = [any(layers.remat[a:b]) for a, b in layers.stage_ranges]
    assert [p is not None for p in plan.stage_policy] == recomputing
    assert not any(plan.remat) and plan.device_memory <= budget
    assert plan.predicted_step_time < layers.predicted_step_time
    want = none.value_and_grad(_mse)(variables, x, t)
    got = auto.value_and_grad(_mse)(variables, x, t)
    for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    tight = pipeline("auto", int(dots * 0.97))[0].plan
    assert tight.stage_policy is None and any(tight.remat)


def test_make_plan_checks_the_recompute_it_is_given():
    from jaxhybrid.plan import make_plan
    from jaxhybrid.pipeline.planning import profile_cached
    costs = profile_cached(LAYERS, jnp.ones((8, 16)))
    plain = make_plan(costs, num_stages=2, num_microbatches=2, boundaries=[4])
    plan = make_plan(costs, num_stages=2, num_microbatches=2, boundaries=[4],
                     stage_policy=[None, "nothing_saveable"], policy_recompute=[None, 1.0])
    assert plan.stage_bwd_time[0] == plain.stage_bwd_time[0]
    assert plan.stage_bwd_time[1] == pytest.approx(plain.stage_bwd_time[1]
                                                   + plain.stage_fwd_time[1])
    with pytest.raises(ValueError, match="policy_recompute prices stages under a policy"):
        make_plan(costs, num_stages=2, num_microbatches=2, boundaries=[4],
                  policy_recompute=[None, 1.0])
    with pytest.raises(ValueError, match="policy_recompute needs the boundaries"):
        make_plan(costs, num_stages=2, num_microbatches=2,
                  stage_policy=[None, "dots_saveable"], policy_recompute=[None, 0.5])


def test_a_split_backward_policy_stage_crosses_its_parameter_gradients():
    """zb-h1: B runs the stage's one checkpoint whole, so W gets parameter gradients, as
    for a stage recomputed whole (both within 15% of the compiled step)."""
    plan, compiled = _planned_and_compiled("dots_saveable", "zb-h1")
    assert abs(plan.device_memory / compiled - 1) < 0.15, (plan.device_memory, compiled)


def test_the_memory_model_keeps_what_the_policy_kept():
    costs = [LayerCost(name=f"l{i}", batch_size=1, fwd_flops=1, bwd_flops=2, fwd_bytes=1,
                       bwd_bytes=1, param_bytes=8, param_count=2, in_bytes=100, out_bytes=100,
                       saved_bytes=1000, saved_bytes_remat=100, fwd_time=1.0, bwd_time=2.0)
             for i in range(6)]
    costs = [dataclasses.replace(c, bwd_temp_bytes=30) for c in costs]
    sched = make_schedule("1f1b", 2, 4)
    rows = sched.ring_slots()[1]["stash"]
    kept = [{"float32": 400.0}, None]
    terms = memory_terms(costs, [3], sched, policy_kept=kept)
    # Stage 0 keeps the 400 bytes the policy saved, stage 1 its three layers' 3000 and the
    # loss's 100: the row is the larger.
    assert terms["stash"] == rows * 3100
    plain = memory_terms(costs, [3], sched)
    assert terms["stash"] == plain["stash"]
    one = memory_terms(costs, [3], sched, policy_kept=[{"float32": 400.0}, {"float32": 500.0}])
    assert one["stash"] == rows * 600   # stage 1: 500 + the loss's 100
    # Working: a row beside the ring and the most a stage re-materialises at once (stage
    # 0: its 3000 residuals less the 400 it kept), plus cotangents and temporaries.
    assert one["working"] == 600 + (3000 - 400) + 200 + 3 * 30
    with pytest.raises(ValueError, match=r"policy_kept needs one entry per stage \(2\), got 1"):
        memory_terms(costs, [3], sched, policy_kept=[None])
