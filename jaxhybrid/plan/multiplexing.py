"""Multiplexing (DeepPool, PAPERS.md §2): what a background job gains on a cluster
whose foreground runs a burst plan (`jaxhybrid.plan.burst`), in the device time the
plan leaves idle. Pure numpy, like the planner."""
from __future__ import annotations

import dataclasses

from jaxhybrid.plan.burst import (NO_SMALL_BATCH_LOSS, SMALL_BATCH_PRESETS, BurstPlan,
                                  SmallBatchModel, cost_fn, layer_times_at)
from jaxhybrid.plan.hardware import get_hardware

# Fraction of a device's idle time the background job turns into its own standalone
# throughput (slices, context switches, interference). An assumption: DeepPool reports
# the background reaching most of its standalone speed in the idle time; the CPU
# measurement of our executor is in docs/burst.md.
MUX_EFFICIENCY = 0.8


def single_device_step_time(costs, batch_size: int, hardware="v100_dgx1",
                            small_batch: SmallBatchModel | None = None) -> float:
    """Forward + backward of the whole model on one device at `batch_size` (a
    background job instance: no all-reduce)."""
    hw = get_hardware(hardware)
    model = small_batch or SMALL_BATCH_PRESETS.get(hw.name, NO_SMALL_BATCH_LOSS)
    base = None if callable(costs) else list(costs)
    f, b = layer_times_at(cost_fn(costs)(batch_size), hw, model, base)
    return float(f.sum() + b.sum())


@dataclasses.dataclass
class Throughput:
    """Examples per second of a G-device cluster: the foreground (burst plan), the
    background in its idle time, and single-job data parallelism at the same batch."""
    num_devices: int
    batch_size: int
    foreground: float
    background: float
    data_parallel: float
    idle_fraction: float

    @property
    def total(self) -> float:
        return self.foreground + self.background

    @property
    def ratio(self) -> float:
        """Total cluster throughput over single-job data parallelism."""
        return self.total / self.data_parallel

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total, "ratio": self.ratio}


def throughput(plan: BurstPlan, *, bg_step_time: float, bg_batch: int,
               efficiency: float = MUX_EFFICIENCY, forward_only: bool = False,
               fg_slowdown: float = 1.0) -> Throughput:
    """Cluster throughput with a background job (one instance per device, `bg_batch`
    examples per step of `bg_step_time` s alone) in the plan's idle time.
    forward_only: only the foreground's forward idle time is used (a runtime that
    cannot fill the backward; `jaxhybrid.burst.multiplex` fills both); fg_slowdown:
    foreground iteration time
    multiplier under multiplexing."""
    if not (bg_step_time > 0 and bg_batch >= 0 and 0 < efficiency <= 1 and fg_slowdown > 0):
        # bg_step_time 0 was a ZeroDivisionError, efficiency 2 a background at twice its speed
        raise ValueError(f"throughput: bg_step_time={bg_step_time} must be > 0 s, bg_batch="
                         f"{bg_batch} >= 0, efficiency={efficiency} in (0, 1], fg_slowdown="
                         f"{fg_slowdown} > 0.")
    T = plan.iteration_time * fg_slowdown
    idle = plan.idle_time(forward_only)
    bg = float(idle.sum()) * efficiency / T * bg_batch / bg_step_time
    return Throughput(plan.num_devices, plan.batch_size, plan.batch_size / T, bg,
                      plan.batch_size / plan.dp_time,
                      float(plan.idle_time().sum() / (plan.num_devices * plan.iteration_time)))
