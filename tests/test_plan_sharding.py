"""The planner with a tensor-parallel "model" degree and ZeRO: what profiling reads off a
layer's logical names and its degree-2 trace, the memory model, the step time, the
projection's search over data x pipe x model, and the largest-model search."""
import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

from jaxhybrid import models
from jaxhybrid.plan import hybrid, largest
from jaxhybrid.plan.costs import LayerCost, profile
from jaxhybrid.plan.hardware import Hardware
from jaxhybrid.plan.model_axis import local_cost, model_comm_time
from jaxhybrid.plan.memory_model import spmd_memory
from jaxhybrid.plan.stat_efficiency import StatEfficiency
from jaxhybrid.schedules import make_schedule


@pytest.fixture(scope="module")
def gpt_costs():
    spec = models.get_model("gpt", "tiny", num_layers=1, d_model=64, num_heads=4)
    x = spec.sample_batch(2)[0]
    return spec, x, profile(spec.layers, x, cache_dir=None)


def test_profile_reads_the_model_split_of_each_layer(gpt_costs):
    spec, x, (emb, block, head) = gpt_costs
    # Independently: the block's parameters whose logical names include "heads" or "mlp".
    boxed = jax.eval_shape(lambda k: spec.layers[1].init(k, jax.numpy.zeros((2, 16, 64))),
                           jax.random.key(0))["params"]
    leaves = jax.tree_util.tree_flatten_with_path(
        boxed, is_leaf=lambda l: isinstance(l, nn.LogicallyPartitioned))[0]
    split = sum(int(np.prod(l.value.shape)) * 4 for _, l in leaves
                if {"heads", "mlp"} & set(l.names))
    assert 0 < split < block.param_bytes
    assert block.model_param_bytes == split
    assert emb.model_param_bytes == head.model_param_bytes == 0     # vocab 257: replicated
    # Megatron: 2 all-reduces of the block's [B, T, D] output forward, 2 backward.
    assert (block.model_fwd_collectives, block.model_bwd_collectives) == (2, 2)
    assert block.model_fwd_comm_bytes == block.model_bwd_comm_bytes == 2 * block.out_bytes
    assert block.model_flops_fraction == pytest.approx(1.0)   # every matmul is split
    assert 0 < block.model_saved_bytes < block.saved_bytes
    assert emb.model_saved_bytes == head.model_saved_bytes == head.model_fwd_comm_bytes == 0
    # Scaling to another microbatch scales the per-example model terms.
    s = block.scaled(4)
    assert s.model_saved_bytes == 2 * block.model_saved_bytes
    assert s.model_fwd_comm_bytes == 2 * block.model_fwd_comm_bytes


def _layer(name, param, split, saved, saved_split):
    return LayerCost(name, 1, 1e9, 2e9, 0.0, 0.0, param, param // 4, 0, 0, saved, 0, 1.0, 2.0,
                     model_param_bytes=split, model_saved_bytes=saved_split,
                     model_flops_fraction=1.0 if split else 0.0)


def test_memory_model_halves_the_split_part_exactly():
    sched = make_schedule("1f1b", 2, 4)
    split = [_layer(f"s{i}", 4000, 4000, 1000, 1000) for i in range(4)]
    # Everything split (no inputs/outputs): the whole device memory halves.
    one, two = spmd_memory(split, [2], sched)[1], spmd_memory(split, [2], sched, model=2)[1]
    assert two == pytest.approx(one / 2)
    # A replicated part stays whole: device(2) = replicated + split / 2.
    mixed = [_layer(f"m{i}", 4000, 3000, 1000, 600) for i in range(4)]
    rep = [_layer(f"r{i}", 1000, 0, 400, 0) for i in range(4)]
    spl = [_layer(f"p{i}", 3000, 3000, 600, 600) for i in range(4)]
    assert spmd_memory(mixed, [2], sched)[1] == pytest.approx(
        spmd_memory(rep, [2], sched)[1] + spmd_memory(spl, [2], sched)[1])
    assert spmd_memory(mixed, [2], sched, model=2)[1] == pytest.approx(
        spmd_memory(rep, [2], sched)[1] + spmd_memory(spl, [2], sched)[1] / 2)
    assert spmd_memory(mixed, [2], sched, model=4)[1] == pytest.approx(
        spmd_memory(rep, [2], sched)[1] + spmd_memory(spl, [2], sched)[1] / 4)


@pytest.mark.parametrize("data", [2, 4])
def test_zero_divides_the_optimizer_state_by_data(data):
    sched = make_schedule("1f1b", 2, 4)
    costs = [_layer(f"l{i}", 4000 * (i + 1), 0, 1000, 0) for i in range(4)]
    largest_stage = 4000 * (3 + 4)
    base = spmd_memory(costs, [2], sched)[1]
    assert spmd_memory(costs, [2], sched, zero_shards=data)[1] == pytest.approx(
        base - 2 * largest_stage * (1 - 1 / data))      # Adam: 2 x param bytes of state
    assert spmd_memory(costs, [2], sched, zero_shards=data, optimizer_factor=1)[1] == \
        pytest.approx(base - largest_stage * (1 - 1 / data))
    # A value_and_grad step (parameters and gradients, factor 2) has no optimizer state
    # to split: ZeRO took 2 x param bytes off it all the same (1.62x under its compiled step).
    plain = spmd_memory(costs, [2], sched, param_state_factor=2)[1]
    assert spmd_memory(costs, [2], sched, param_state_factor=2, zero_shards=data)[1] == plain
    assert spmd_memory(costs, [2], sched, param_state_factor=3, zero_shards=data)[1] == \
        pytest.approx(plain + largest_stage - largest_stage * (1 - 1 / data))
    # ZeRO and the model degree compose: the state of a split layer / (model x data).
    split = [_layer(f"s{i}", 4000, 4000, 0, 0) for i in range(4)]
    full = spmd_memory(split, [2], sched)[1]
    assert spmd_memory(split, [2], sched, model=2, zero_shards=data)[1] == pytest.approx(
        full / 2 - 2 * 8000 / 2 * (1 - 1 / data))


STAT = StatEfficiency(100.0, 1000.0, 1e6)


def _hw(memory):
    return Hardware("test", peak_flops=1e12, mem_bandwidth=1e12, memory=memory,
                    devices_per_node=8, p2p_bandwidth=1e10, allreduce_bandwidth=1e10,
                    inter_bandwidth=1e10, efficiency=1.0, bytes_scale=1.0, grad_bytes=4.0,
                    weight_bytes=8.0, memory_fraction=1.0)


def _big(L=2):
    return [LayerCost(f"l{i}", 1, 1e9, 2e9, 0.0, 0.0, 4_000_000, 1_000_000, 100, 100, 100, 100,
                      0.0, 0.0, model_param_bytes=4_000_000, model_flops_fraction=1.0,
                      model_fwd_comm_bytes=100, model_bwd_comm_bytes=100,
                      model_fwd_collectives=2, model_bwd_collectives=2) for i in range(L)]


def test_search_finds_model_parallel_configs_when_only_they_fit():
    # 2 layers of 1M parameters, 16 bytes each with Adam: one layer per device needs
    # 16 MB (12 MB with ZeRO over 2 replicas), 11 MB are there. Half a layer per device
    # (pipe 2 x model 2) fits, at 8 MB.
    proj = hybrid.search(_big(), _hw(11e6), STAT, devices=[4], per_worker_batch=4,
                         model_degrees=(1, 2), zero=(0, 1), optimizer_states=2)
    ok = [r for r in proj.rows if r.feasible]
    assert {(r.data, r.pipe, r.model, r.zero) for r in ok} == {(1, 2, 2, 0)}
    assert all(not r.feasible and "GB per device" in r.reason for r in proj.rows if r.model == 1)
    assert proj.best(4).model == 2 and proj.best(4).devices == 4
    # With enough memory the model=1 layouts come back.
    roomy = hybrid.search(_big(), _hw(1e9), STAT, devices=[4], per_worker_batch=4,
                          model_degrees=(1, 2), optimizer_states=2)
    assert any(r.feasible and r.model == 1 for r in roomy.rows)
    assert {(r.data, r.pipe, r.model) for r in roomy.rows} == {
        (4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)}


def test_step_time_splits_compute_and_adds_the_model_all_reduces():
    h = _hw(1e9)
    one = hybrid.step_time(_big(), h, data=1, pipe=1, num_microbatches=2, per_worker_batch=2)
    two = hybrid.step_time(_big(), h, data=1, pipe=1, num_microbatches=2, per_worker_batch=2,
                           model=2)
    assert one.model_time == 0.0
    per_layer = 2 * model_comm_time(100, 2, 1e10, h.intra_latency, 2)   # forward + backward
    assert two.model_time == pytest.approx(2 * per_layer)
    # Per microbatch: half the layers' work plus the all-reduces.
    assert two.stage_fwd[0] + two.stage_bwd[0] == pytest.approx(
        (one.stage_fwd[0] + one.stage_bwd[0]) / 2 + two.model_time)
    assert two.devices == 2


def test_local_cost_keeps_replicated_layers_whole():
    c = _layer("r", 1000, 0, 400, 0)
    assert local_cost(c, 4) == dataclasses.replace(c)
    s = local_cost(_layer("s", 1000, 600, 400, 100), 2)
    assert (s.param_bytes, s.saved_bytes) == (700, 350)


@pytest.fixture(scope="module")
def depth_costs():
    spec = models.get_model("gpt", "tiny", num_layers=1, d_model=64, num_heads=4, seq_len=8)
    emb, block, head = profile(spec.layers, spec.sample_batch(1)[0], cache_dir=None)
    return largest.stacked([emb], block, [head])


def test_largest_depth_is_the_boundary_and_monotone_in_layout(depth_costs):
    budget = 4_000_000
    lays = [largest.Layout.parse(t) for t in ("4x2x1", "2x2x2", "2x2x2z")]
    depth = [largest.largest_depth(depth_costs, lay, budget, num_microbatches=2) for lay in lays]
    for lay, n in zip(lays, depth):
        mem = lambda k: largest.device_memory(depth_costs(k), lay, num_microbatches=2)  # noqa: E731
        assert mem(n) <= budget < mem(n + 1)
    assert 0 < depth[0] < depth[1] <= depth[2]
    assert depth[2] > depth[1]    # parameter-bound at 8 tokens: ZeRO's saving counts
    with pytest.raises(ValueError, match="data x pipe x model"):
        largest.Layout.parse("2x2")


def test_pipeline_plans_with_its_model_degree_and_zero(gpt_costs):
    import jaxhybrid as jh
    from jaxhybrid import pipeline as jp
    from jaxhybrid.plan import make_plan
    spec, x, costs = gpt_costs
    sched = make_schedule("1f1b", 1, 2)
    plans = {}
    for model, zero in ((1, 0), (2, 0), (2, 1)):
        pipe = jp.Pipeline(spec.layers, mesh=jh.make_mesh(data=2, pipe=1, model=model),
                           num_microbatches=2, remat="auto", memory_budget="1GB", zero=zero)
        pipe.make_plan(np.repeat(x, 4, axis=0))   # data 2 x M 2 microbatches of 2
        plans[model, zero] = pipe.plan.device_memory
        shards = dict(model=model, zero_shards=2 if zero else 1)
        assert plans[model, zero] == pytest.approx(
            spmd_memory(costs, [], sched, None, **shards)[1])
        assert make_plan(costs, num_stages=1, num_microbatches=2, memory_budget="1GB",
                         **shards).device_memory == pytest.approx(plans[model, zero])
    assert plans[1, 0] > plans[2, 0] > plans[2, 1]


def test_odd_heads_are_traced_at_a_degree_that_divides_them():
    spec = models.get_model("gpt", "tiny", num_layers=1, d_model=48, num_heads=3)
    block = profile(spec.layers, spec.sample_batch(2)[0], cache_dir=None)[1]
    even = models.get_model("gpt", "tiny", num_layers=1, d_model=48, num_heads=2)
    ref = profile(even.layers, even.sample_batch(2)[0], cache_dir=None)[1]
    assert block.model_param_bytes == ref.model_param_bytes > 0   # same weight shapes
    assert (block.model_fwd_collectives, block.model_fwd_comm_bytes) == (2, 2 * block.out_bytes)
    assert block.model_flops_fraction == pytest.approx(1.0)
    assert 0 < block.model_saved_bytes < block.saved_bytes
