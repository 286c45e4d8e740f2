"""Partition: exact against brute force (both objectives, with and without link terms),
never worse than the equal split, valid boundaries, clear errors; device mapping."""
import itertools

import numpy as np
import pytest

from jaxhybrid.plan import Topology, even_boundaries, map_devices, partition, stage_costs


def objective_value(t, cuts, obj, M, **kw):
    pm = stage_costs(t, cuts, num_microbatches=M, **kw).per_microbatch
    return pm.max() if obj == "bottleneck" else pm.sum() + (M - 1) * pm.max()


def brute_force(t, S, obj, M, **kw):
    return min(objective_value(t, list(c), obj, M, **kw)
               for c in itertools.combinations(range(1, len(t)), S - 1))


def check_valid(cuts, L, S):
    assert len(cuts) == S - 1
    assert all(isinstance(c, int) for c in cuts)
    assert list(cuts) == sorted(set(cuts)) and all(0 < c < L for c in cuts)


def random_links(rng, L, S):
    if rng.random() < 0.5:
        topo = Topology.nodes(2, 4, 100e9, 4e9)
        scale = 1e9   # bytes comparable to compute seconds through 4-100 GB/s links
    else:
        topo = Topology.from_matrix(rng.uniform(1, 10, (8, 8)), rng.uniform(0, 0.1, (8, 8)))
        scale = 1.0
    data = int(rng.integers(1, 8 // S + 1))
    return dict(topology=topo, boundary_bytes=rng.uniform(0, 20, L) * scale,
                param_bytes=rng.uniform(0, 50, L) * scale, data=data,
                device_order=[int(d) for d in rng.permutation(8)[: S * data]])


@pytest.mark.parametrize("objective", ["bottleneck", "alpa"])
@pytest.mark.parametrize("links", [False, True])
def test_matches_brute_force(objective, links):
    rng = np.random.default_rng(1 + links + 2 * (objective == "alpa"))
    for _ in range(120):
        L = int(rng.integers(1, 10))
        S = int(rng.integers(1, min(L, 8) + 1))
        M = int(rng.integers(1, 9))
        t = rng.lognormal(0, 1, L) * (rng.random(L) > 0.1)   # some zero-time layers
        kw = random_links(rng, L, S) if links else {}
        cuts = partition(t, S, objective=objective, num_microbatches=M, **kw)
        check_valid(cuts, L, S)
        assert objective_value(t, cuts, objective, M, **kw) == pytest.approx(
            brute_force(t, S, objective, M, **kw), rel=1e-9, abs=1e-12)


def test_plain_call_minimises_slowest_stage():
    rng = np.random.default_rng(7)
    for _ in range(50):
        L = int(rng.integers(2, 11))
        S = int(rng.integers(1, L + 1))
        t = rng.integers(0, 5, L).astype(float)   # integer times: many ties
        cuts = partition(t, S)
        check_valid(cuts, L, S)
        assert objective_value(t, cuts, "bottleneck", 1) == brute_force(t, S, "bottleneck", 1)


@pytest.mark.parametrize("seed", range(20))
def test_never_worse_than_even_boundaries(seed):
    rng = np.random.default_rng(100 + seed)
    L, S = int(rng.integers(20, 60)), int(rng.integers(2, 12))
    t = rng.lognormal(0, 1.2, L)
    kw = dict(topology=Topology.nodes(2, 8, 100e9, 4e9), boundary_bytes=rng.uniform(0, 1e8, L))
    for extra in ({}, kw):
        ours = objective_value(t, partition(t, S, **extra), "bottleneck", 1, **extra)
        assert ours <= objective_value(t, even_boundaries(L, S), "bottleneck", 1, **extra) * (1 + 1e-12)


def test_ties_prefer_the_most_even_split():
    assert partition(np.ones(8), 4) == [2, 4, 6]
    assert partition(np.ones(17), 4) in ([4, 8, 12], [4, 8, 13], [4, 9, 13], [5, 9, 13])
    # Bottleneck 10 is fixed by the heavy layer; the rest should still be spread evenly.
    assert partition([1, 1, 1, 1, 10, 1, 1, 1, 1], 3) == [4, 5]
    assert partition([3, 3, 3, 1, 1, 1, 1, 1, 1], 3) == [2, 4]  # [6, 4, 4] beats [6, 3, 5]


def test_slow_link_moves_the_cut():
    # Even compute split would cut after layer 1 (big activation) over a 1 GB/s link.
    t = [1.0, 1.0, 1.0, 1.0]
    bb = [1e10, 1e9, 1e6, 0]
    topo = Topology.nodes(2, 1, 100e9, 1e9, intra_latency=0, inter_latency=0)
    assert partition(t, 2) == [2]
    assert partition(t, 2, topology=topo, boundary_bytes=bb) == [3]
    sc = stage_costs(t, [3], topology=topo, boundary_bytes=bb)
    assert sc.transfer[0] == pytest.approx(2 * 1e6 / 1e9) and sc.transfer[1] == 0


def test_allreduce_is_amortised_over_microbatches():
    topo = Topology.uniform(4, 1e9, latency=0)
    kw = dict(topology=topo, param_bytes=[1e9, 0, 0, 0], data=2)
    full = stage_costs([1, 1, 1, 1], [2], **kw)
    amort = stage_costs([1, 1, 1, 1], [2], num_microbatches=4, **kw)
    assert full.allreduce[0] == pytest.approx(1.0) and amort.allreduce[0] == pytest.approx(1.0)
    assert full.bottleneck == pytest.approx(3.0) and amort.bottleneck == pytest.approx(2.25)
    assert partition([1, 1, 1, 1], 2, **kw) == [1]


@pytest.mark.parametrize("args, match", [
    (([1, 2, 3], 4), "4 stages but only 3 layers"),
    (([1, 2, 3], 0), "num_stages"),
    (([1, -2, 3], 2), ">= 0"),
    (([], 1), "empty"),
    (([1, float("nan")], 1), "finite"),
])
def test_errors(args, match):
    with pytest.raises(ValueError, match=match):
        partition(*args)


def test_option_errors():
    with pytest.raises(ValueError, match="objective"):
        partition([1, 2], 2, objective="fastest")
    with pytest.raises(ValueError, match="num_microbatches"):
        partition([1, 2], 2, objective="alpa")
    with pytest.raises(ValueError, match="need a topology"):
        partition([1, 2], 2, boundary_bytes=[1, 1])
    with pytest.raises(ValueError, match="one per layer"):
        partition([1, 2, 3], 2, boundary_bytes=[1], topology=Topology.uniform(2, 1e9))
    with pytest.raises(ValueError, match="device_order"):
        partition([1, 2, 3], 2, boundary_bytes=[1, 1, 1], topology=Topology.uniform(2, 1e9),
                  device_order=[0, 0])


def test_large_instance_is_valid():
    t = np.random.default_rng(0).lognormal(0, 1, 1000)
    cuts = partition(t, 64)
    check_valid(cuts, 1000, 64)
    assert objective_value(t, cuts, "bottleneck", 1) <= objective_value(t, even_boundaries(1000, 64), "bottleneck", 1)


# --- device mapping ------------------------------------------------------------------
def _transfer(order, cuts, topo):
    return sum(2 * topo.transfer_time(order[s], order[s + 1], c) for s, c in enumerate(cuts))


def test_mapping_puts_small_cuts_on_the_slow_link():
    topo = Topology.nodes(2, 4, 300e9, 12e9)   # 25x slower between nodes
    cuts = [5e8, 1e6, 8e8, 9e8, 8e8, 2e6, 5e8]   # in order, the 9e8 cut would cross nodes
    order = map_devices(cuts, topo)
    assert sorted(order) == list(range(8))
    node = [d // 4 for d in order]
    crossing = [cuts[s] for s in range(7) if node[s] != node[s + 1]]
    assert sorted(crossing) == [1e6, 2e6]
    assert _transfer(order, cuts, topo) < _transfer(list(range(8)), cuts, topo) / 2


def test_mapping_keeps_in_order_when_nothing_to_gain():
    assert map_devices([1e9, 1e9, 1e9], Topology.uniform(4, 1e9)) == [0, 1, 2, 3]
    assert map_devices([1e8, 1e6, 1e8], Topology.nodes(2, 2, 100e9, 1e9)) == [0, 1, 2, 3]


def test_mapping_with_replicas_and_heuristic_path():
    topo = Topology.nodes(2, 4, 300e9, 12e9)
    # Huge gradients, tiny activations: replicas of a stage belong on one node.
    order = map_devices([1e3], topo, data=4, stage_param_bytes=[1e10, 1e10])
    grid = np.array(order).reshape(4, 2)
    assert len({d // 4 for d in grid[:, 0]}) == 1 and len({d // 4 for d in grid[:, 1]}) == 1
    cuts = [5e8, 1e6, 8e8, 9e8, 8e8, 2e6, 5e8]
    heur = map_devices(cuts, topo, exhaustive_limit=0)
    assert sorted(heur) == list(range(8))
    assert _transfer(heur, cuts, topo) <= _transfer(list(range(8)), cuts, topo)
    with pytest.raises(ValueError, match="need 9 devices"):
        map_devices([1] * 8, topo)


def test_one_boundary_module_for_planner_and_pipeline():
    from jaxhybrid import boundaries, plan
    from jaxhybrid import pipeline as jp
    assert boundaries.even_boundaries(10, 4) == [3, 6, 8]           # extra layers first
    assert jp.even_boundaries is plan.even_boundaries is boundaries.even_boundaries
    assert callable(plan.partition)                                  # the function, not a module
    assert boundaries.stage_ranges([3, 6, 8], 10) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    np.testing.assert_array_equal(boundaries.stage_sums(np.arange(10), [3, 6, 8]),
                                  [3, 12, 13, 17])
    with pytest.raises(ValueError, match="strictly increasing"):
        boundaries.stage_ranges([3, 3], 10)
    with pytest.raises(ValueError, match="num_stages"):
        boundaries.even_boundaries(3, 4)
