"""The one step-time model of the engine: a schedule's task table run in lock step.

Every consumer prices a step through `lockstep_time`: `Plan.predicted_step_time` (and so the
planner's reports), the projection (`jaxhybrid.plan.hybrid`), and the benchmarks that
compare predictions with measured steps.

    tick t lasts   max over devices of work[t, d]             (`Schedule.work`: the
                   F/B/W tasks the engine runs in that tick, from per-stage costs)
                   or, with finite `compute_slots` C (simulated devices sharing C cores),
                   max(that, data * sum_d work[t, d] / C): the work of every device of
                   all `data` replicas in the tick serialises over the cores there are;
    engine         `tick_overhead`, the engine's own cost per device per tick (control
                   flow, the packed-buffer reads: `Hardware.tick_overhead` and
                   `tick_param_bytes`), added to every device's work of every tick;
                   and `tick_latency` (`Hardware.tick_latency`) added once to every
                   tick: waiting (the tick's collectives' rendezvous), not work;
    transfer       `transfer_per_tick` x number of ticks (the tick-level ppermutes);
    all-reduce     after the flush, not overlapped.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one step, by part."""
    compute: float      # the ticks' layer work alone
    engine: float       # what the engine's per-tick costs add to the ticks
    transfer: float
    allreduce: float

    @property
    def pipeline(self) -> float:
        return self.compute + self.engine + self.transfer

    @property
    def total(self) -> float:
        return self.pipeline + self.allreduce


def tick_transfer(topology, links, nbytes: float) -> float:
    """Seconds of a tick's boundary transfers: every device sends one activation and one
    gradient, each padded to the largest boundary (`nbytes`), the slowest of `links`
    (device pairs of consecutive stages) setting the pace."""
    return 2 * max([topology.transfer_time(a, b, nbytes) for a, b in links], default=0.0)


def engine_tick_cost(hw, device_param_elems: float) -> float:
    """The engine's own seconds per device per tick on `hw` (a `Hardware`, e.g. the stored
    calibration of this device kind): `tick_overhead` plus `tick_param_bytes` per element
    of the device's packed parameter buffer at `mem_bandwidth`."""
    per_param = (float(device_param_elems) * hw.tick_param_bytes / hw.mem_bandwidth
                 if hw.tick_param_bytes else 0.0)
    return float(hw.tick_overhead) + per_param


def tick_lengths(work: np.ndarray, data: int = 1, compute_slots: float = math.inf) -> np.ndarray:
    """Length of each lock-step tick from the [tick, device] work of one replica."""
    longest = work.max(axis=1)
    if math.isfinite(compute_slots):
        return np.maximum(longest, data * work.sum(axis=1) / compute_slots)
    return longest


def lockstep_time(schedule, fwd_cost, bwd_cost, *, data: int = 1, compute_slots: float = math.inf,
              tick_overhead: float = 0.0, transfer_per_tick: float = 0.0,
              allreduce: float = 0.0, tick_latency: float = 0.0) -> StepTime:
    """The step of `schedule` (a `jaxhybrid.schedules.Schedule`) with per-stage forward
    and (full) backward costs, under the model in the module docstring."""
    work = schedule.work(fwd_cost, bwd_cost)
    compute = float(tick_lengths(work, data, compute_slots).sum())
    engine = 0.0
    if tick_overhead:
        engine = float(tick_lengths(work + tick_overhead, data, compute_slots).sum()) - compute
    engine += float(tick_latency) * schedule.num_ticks
    return StepTime(compute, engine, float(transfer_per_tick) * schedule.num_ticks,
                    float(allreduce))
