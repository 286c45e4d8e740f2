"""Planning: per-layer costs -> stage partition, device mapping, recomputation -> Plan.

Pure Python/numpy except `profile` (and `Topology.default`), which run JAX; nothing here
imports `jaxhybrid.pipeline`.

    from jaxhybrid import plan
    costs = plan.profile(layers, sample_inputs)
    cuts = plan.partition(plan.layer_times(costs), num_stages=4)
    p = plan.make_plan(costs, num_stages=4, num_microbatches=8, memory_budget="2GB")
    print(p.summary()); p.plot("plan.png")
"""
from jaxhybrid.boundaries import even_boundaries, stage_ranges
from jaxhybrid.plan.costs import (LayerCost, cost_arrays, device_peak, layer_times, profile,
                                  roofline_time)
from jaxhybrid.plan.partitioning import (OBJECTIVES, StageCosts, device_grid, map_devices,
                                      partition, stage_costs)
from jaxhybrid.plan.from_config import plan_from_config
from jaxhybrid.plan.plan import Plan
from jaxhybrid.plan.planner import make_plan
from jaxhybrid.plan.memory_model import spmd_memory
from jaxhybrid.plan.remat import MemoryBudgetError, choose_remat_spmd, recompute_time
from jaxhybrid.plan.topology import (Topology, fmt_bytes, parse_bandwidth, parse_bytes,
                                     parse_time)
from jaxhybrid.plan.burst import BurstPlan, plan_burst

__all__ = [
    "LayerCost", "profile", "cost_arrays", "layer_times", "device_peak", "roofline_time",
    "partition", "map_devices", "stage_costs", "StageCosts", "even_boundaries", "stage_ranges", "device_grid",
    "OBJECTIVES", "recompute_time", "MemoryBudgetError",
    "choose_remat_spmd", "spmd_memory",
    "Plan", "make_plan", "plan_from_config", "Topology", "parse_bandwidth", "parse_bytes",
    "parse_time", "fmt_bytes",
    "BurstPlan", "plan_burst",
]
