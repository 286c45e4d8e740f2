"""Cost-balanced recomputation: fits when possible, minimal slowdown (brute force),
nothing when loose, full when needed, clear error when impossible."""
import itertools

import numpy as np
import pytest

from jaxhybrid.plan import LayerCost, MemoryBudgetError, choose_remat, stage_memory
from jaxhybrid.plan.remat import recompute_time
from jaxhybrid.schedules import make_schedule


def layer(i, fwd=1.0, saved=1000, inp=100, params=0, out=None):
    return LayerCost(name=f"l{i}", batch_size=1, fwd_flops=1, bwd_flops=2, fwd_bytes=1, bwd_bytes=1,
                     param_bytes=params, param_count=params // 4, in_bytes=inp,
                     out_bytes=inp if out is None else out, saved_bytes=saved, saved_bytes_remat=inp,
                     fwd_time=fwd, bwd_time=2 * fwd)


def random_costs(rng, L):
    return [layer(i, fwd=float(rng.uniform(0.1, 2)), saved=int(rng.integers(0, 5000)),
                  inp=int(rng.integers(1, 800)), params=int(rng.integers(0, 400)))
            for i in range(L)]


def bottleneck(costs, cuts, remat):
    e = [0, *cuts, len(costs)]
    base = np.array([sum(c.fwd_time + c.bwd_time for c in costs[e[s]:e[s + 1]]) for s in range(len(e) - 1)])
    return float((base + recompute_time(costs, cuts, remat)).max())


def test_memory_model_by_hand():
    costs = [layer(0, saved=1000, inp=100, params=40), layer(1, saved=3000, inp=200, params=8, out=50)]
    costs[0].state_bytes = 16
    # 4 x 48 params + 16 state + 3 in flight x 4000 saved + 2 x (100 in + 50 out)
    assert stage_memory(costs, [], [3])[0] == 4 * 48 + 16 + 3 * 4000 + 2 * 150
    # Recomputing layer 1 keeps its input (200) and re-materialises 2800 transiently.
    assert stage_memory(costs, [], [3], [False, True])[0] == 4 * 48 + 16 + 3 * 1200 + 2800 + 2 * 150
    assert list(stage_memory(costs, [1], [3, 1])) == [
        4 * 40 + 16 + 3 * 1000 + 2 * (100 + 100), 4 * 8 + 3000 + 2 * (200 + 50)]


def test_loose_budget_recomputes_nothing():
    costs = [layer(i) for i in range(6)]
    assert choose_remat(costs, [3], [5, 3], "1GB") == [False] * 6


def test_full_recompute_when_needed():
    costs = [layer(i, saved=1000 + i, inp=100) for i in range(6)]
    cuts, fl = [3], [4, 2]
    full = stage_memory(costs, cuts, fl, [True] * 6)
    assert choose_remat(costs, cuts, fl, float(full.max())) == [True] * 6
    assert (stage_memory(costs, cuts, fl, [True] * 6) <= full.max()).all()


def test_impossible_budget_names_stage_and_overage():
    costs = [layer(i, saved=1000, inp=100) for i in range(4)]
    need = stage_memory(costs, [2], [3, 1], [True] * 4)
    budget = float(need.max()) - 123
    with pytest.raises(MemoryBudgetError, match=r"stage 0 .*\(123 bytes\) over .* more pipeline stages, "
                                                 r"more microbatches with a smaller microbatch, or a bigger budget"):
        choose_remat(costs, [2], [3, 1], budget)
    assert issubclass(MemoryBudgetError, ValueError)


def test_prefers_cheap_big_savers():
    # Same memory saving, different forward cost: recompute the cheap one.
    costs = [layer(0, fwd=5.0, saved=2000), layer(1, fwd=0.1, saved=2000), layer(2, fwd=1.0, saved=300)]
    none = stage_memory(costs, [], [4])[0]
    remat = choose_remat(costs, [], [4], none - 1000)
    assert remat == [False, True, False]


def brute_force(costs, cuts, fl, budget):
    best = np.inf
    for bits in itertools.product([False, True], repeat=len(costs)):
        if (stage_memory(costs, cuts, fl, list(bits)) <= budget).all():
            best = min(best, bottleneck(costs, cuts, list(bits)))
    return best


@pytest.mark.parametrize("exact_limit", [16, 0])
def test_against_brute_force(exact_limit):
    rng = np.random.default_rng(3 + exact_limit)
    for _ in range(60):
        L = int(rng.integers(1, 8))
        S = int(rng.integers(1, min(L, 3) + 1))
        costs = random_costs(rng, L)
        cuts = sorted(int(c) for c in rng.choice(np.arange(1, L), S - 1, replace=False)) if S > 1 else []
        fl = make_schedule("1f1b", S, 4).in_flight()
        lo = stage_memory(costs, cuts, fl, [c.saved_bytes > c.saved_bytes_remat for c in costs]).max()
        hi = stage_memory(costs, cuts, fl).max()
        budget = float(rng.uniform(lo, max(hi, lo)))
        remat = choose_remat(costs, cuts, fl, budget, exact_limit=exact_limit)
        assert (stage_memory(costs, cuts, fl, remat) <= budget).all()
        best = brute_force(costs, cuts, fl, budget)
        if exact_limit:   # exact per-stage search: the slowest stage is as fast as possible
            assert bottleneck(costs, cuts, remat) == pytest.approx(best)
        else:             # Pipe-Torch's ratio rule: fits, never better than the optimum
            assert bottleneck(costs, cuts, remat) >= best - 1e-12


def test_input_errors():
    costs = [layer(i) for i in range(3)]
    with pytest.raises(ValueError, match="in_flight needs 2"):
        choose_remat(costs, [1], [1, 2, 3], 1e9)
    with pytest.raises(ValueError, match="strictly increasing"):
        choose_remat(costs, [2, 1], [1, 1, 1], 1e9)
    with pytest.raises(ValueError, match="size"):
        choose_remat(costs, [1], [1, 1], "lots")
