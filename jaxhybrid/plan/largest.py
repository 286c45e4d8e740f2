"""The deepest model of a family that fits a per-device memory budget, by the planner's
memory model, for each mesh layout (data x pipe x model, ZeRO on or off).

A layout's device bytes are `memory_model.spmd_memory` of the model on it: the stage split of
`partition` (per-layer times of one device's share), the schedule's slots, the model
degree (`model=`, what the layers' logical names split over "model") and ZeRO
(`zero_shards=data`). Optionally the planner's recomputation (`choose_remat_spmd`) may
bring a model under the budget. Depth is searched by doubling then bisection, which
assumes that one more layer never needs less memory (true for a stack of equal blocks,
whose largest stage can only grow).

`python scripts/bench.py sharding --largest` prints the table for GPT (layers x width)
and checks rows against compiled steps on the simulated devices.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

from jaxhybrid.plan.costs import LayerCost, layer_times
from jaxhybrid.plan.model_axis import local_cost
from jaxhybrid.plan.partitioning import partition
from jaxhybrid.plan.memory_model import spmd_memory
from jaxhybrid.plan.remat import MemoryBudgetError, recompute_within
from jaxhybrid.plan.topology import parse_bytes
from jaxhybrid.schedules import make_schedule


@dataclasses.dataclass(frozen=True)
class Layout:
    """data x pipe x model devices; zero=1 shards the optimizer state over data."""
    data: int
    pipe: int
    model: int = 1
    zero: int = 0

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """"DxPxT" with an optional "z" (ZeRO): "4x2x1", "2x2x2z"."""
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)(z?)", text.strip().lower())
        if not m or min(int(g) for g in m.groups()[:3]) < 1:
            raise ValueError(f"layout {text!r}: write data x pipe x model, e.g. 2x2x2 or 2x2x2z "
                             f"(z: ZeRO), each >= 1.")
        return cls(*(int(g) for g in m.groups()[:3]), zero=int(bool(m.group(4))))

    def __str__(self) -> str:
        return f"{self.data}x{self.pipe}x{self.model}" + ("z" if self.zero else "")

    @property
    def devices(self) -> int:
        return self.data * self.pipe * self.model


def device_memory(costs: Sequence[LayerCost], layout: Layout, *, num_microbatches: int,
                  schedule: str = "1f1b", budget: float | str | None = None,
                  param_state_factor: float = 4, optimizer_factor: float = 2) -> float:
    """Planned bytes per device of `costs` on `layout` (inf when it cannot fit `budget`
    even recomputing: with `budget` the planner's recomputation is allowed)."""
    costs = list(costs)
    if layout.pipe > len(costs):
        return float("inf")
    cuts = partition(layer_times([local_cost(c, layout.model) for c in costs]), layout.pipe)
    sched = make_schedule(schedule if layout.pipe > 1 else "1f1b", layout.pipe, num_microbatches)
    kw = dict(param_state_factor=param_state_factor, optimizer_factor=optimizer_factor,
              model=layout.model, zero_shards=layout.data if layout.zero else 1)
    remat = whole = None
    if budget is not None:
        try:
            remat, whole = recompute_within(costs, cuts, sched, parse_bytes(budget), **kw)
        except MemoryBudgetError:
            return float("inf")
    return spmd_memory(costs, cuts, sched, remat, whole_stage=whole, **kw)[1]


def largest_depth(costs_of_depth: Callable[[int], Sequence[LayerCost]], layout: Layout,
                  budget: float | str, *, num_microbatches: int, max_depth: int = 1024,
                  remat: bool = False, **kw) -> int:
    """The largest n <= max_depth whose `costs_of_depth(n)` fits `budget` bytes per device
    on `layout` (0: not even one)."""
    limit = parse_bytes(budget)
    fits = lambda n: device_memory(costs_of_depth(n), layout, num_microbatches=num_microbatches,  # noqa: E731
                                   budget=limit if remat else None, **kw) <= limit
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= max_depth and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, max_depth + 1)
    while hi - lo > 1:           # fits(lo), not fits(hi) (or hi past max_depth)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def stacked(first: Sequence[LayerCost], block: LayerCost, last: Sequence[LayerCost]
            ) -> Callable[[int], list[LayerCost]]:
    """n -> first + n copies of block + last: a model of n equal blocks from the costs of
    one (e.g. GPT: embedding, blocks, head)."""
    return lambda n: [*first, *([block] * n), *last]
