"""Stage boundaries chosen for memory when the time-balanced ones cannot fit a budget.

`make_plan` partitions the layers by time, then `choose_remat_spmd` recomputes what the
budget needs. When even that cannot fit (a stage holding an embedding table and a
position table, say), other boundaries often can: the probe that found it fitted a 7MB
budget with cuts [1, 2, 5] where the time-balanced [2, 4, 6] needed 8.5MB "even with full
recompute", and the planner refused. `cuts_that_fit` partitions a blend of each layer's
time and its memory (parameter state and residuals), from mostly time to memory alone,
and keeps the fitting cuts whose slowest stage (with its recomputation) is fastest.
"""
from __future__ import annotations

import numpy as np

from jaxhybrid.boundaries import stage_sums
from jaxhybrid.plan.partitioning import partition
from jaxhybrid.plan.remat import MemoryBudgetError, choose_remat_spmd, recompute_time

BLENDS = (0.25, 1.0, 4.0, 16.0, 1e6)   # weight of memory against time, relative


def cuts_that_fit(costs, times, t, sched, budget, error: MemoryBudgetError, *,
                  num_microbatches: int, param_state_factor: float, **shard):
    """(cuts, remat) fitting `budget` with the fastest slowest stage among the blends'
    partitions; `error` (the time-balanced cuts' MemoryBudgetError) when none fits.
    `costs` as make_plan got them, `times` one device's share, `t` their layer times."""
    memory = np.array([param_state_factor * c.param_bytes + c.saved_bytes for c in times],
                      float)
    share = lambda a: a / max(float(a.sum()), 1e-30)
    best = None
    for blend in BLENDS:
        weights = share(np.asarray(t, float)) + blend * share(memory)
        cuts = partition(weights, sched.num_stages, num_microbatches=num_microbatches)
        try:
            remat = choose_remat_spmd(costs, cuts, sched, budget,
                                      param_state_factor=param_state_factor, **shard)
        except MemoryBudgetError:
            continue
        slowest = float((stage_sums(t, cuts) + recompute_time(times, cuts, remat)).max())
        if best is None or slowest < best[0]:
            best = (slowest, [int(c) for c in cuts], remat)
    if best is None:
        raise error
    return best[1], best[2]
