"""The one step-time model of the engine: a schedule's task table run in lock step.

Every consumer prices a step through `lockstep_time`: `Plan.predicted_step_time` (and so the
planner's reports), the projection (`jaxhybrid.plan.hybrid`), and the benchmarks that
compare predictions with measured steps.

    tick t lasts   max over devices of work[t, d]             (`Schedule.work`: the
                   F/B/W tasks the engine runs in that tick, from per-stage costs)
                   or, with finite `compute_slots` C (simulated devices sharing C cores),
                   max(that, data * sum_d cpu[t, d] / C): the CPU seconds of every device
                   of all `data` replicas in the tick serialise over the cores there are
                   (cpu: the work x the cores each layer kept busy when it was timed
                   alone, `LayerCost.fwd_threads`: XLA spreads a large matmul over the
                   cores, so a lone device's time understates what it takes from
                   others);
    engine         the engine's own work, added to a device's work in a tick:
                   `tick_overhead` every tick (control flow, the table row, the
                   packed-buffer reads: `Hardware.tick_overhead` and `tick_param_bytes`),
                   `task_overhead` per F/B/W task it runs (the branch dispatch, packing
                   the stage's output and residuals, the stash and inbox writes),
                   `weight_task_overhead` more per W task (a split backward's weight
                   half reads its stash, gradient and cross rows and rebuilds the
                   residuals again) and
                   `collective_overhead` per collective the tick issues (`ppermute` per
                   transfer channel in ticks where some device sends on it: every
                   device takes part); `launch_overhead` once per step per device (the
                   program's launch, buffers zeroed, the loss and gradients' final
                   reductions), priced like one more tick of work; `tick_latency` added
                   once to every tick: waiting (the tick's rendezvous), not work;
    transfer       `transfer_per_tick` x number of ticks (the tick-level ppermutes);
    all-reduce     after the flush, not overlapped.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import typing

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


def lockstep_slots(hw, devices: int) -> float:
    """How many of the lock-step program's `devices` (all of them: data x pipe x model)
    compute at once on `hw`: `Hardware.lockstep_slots` (by default `compute_slots`)
    divided by devices ** `Hardware.lockstep_contention`."""
    slots = hw.lockstep_slots if hw.lockstep_slots else hw.compute_slots
    return float(slots) / float(max(devices, 1)) ** float(hw.lockstep_contention)


def engine_terms(hw, device_param_elems: float, devices: int) -> dict:
    """`lockstep_time`'s engine keywords for a pipelined step (pipe > 1) of `devices`
    devices in all on `hw` (a `Hardware`), whose largest device holds
    `device_param_elems` packed parameters: the engine's costs and `compute_slots`, the
    devices that compute at once inside the lock-step program (`lockstep_slots`)."""
    slots = lockstep_slots(hw, devices)
    return dict(compute_slots=float(slots), tick_overhead=engine_tick_cost(hw, device_param_elems),
                task_overhead=float(hw.task_overhead),
                weight_task_overhead=float(hw.weight_task_overhead),
                collective_overhead=float(hw.collective_overhead),
                launch_overhead=float(hw.launch_overhead), tick_latency=float(hw.tick_latency))


class EngineCounts(typing.NamedTuple):
    """What the runtime does in each tick of a schedule, as `lockstep_time` prices it."""
    tasks: np.ndarray          # [tick, device] F/B/W tasks run
    weight_tasks: np.ndarray   # [tick, device] of which W (a split backward's weight half)
    collectives: np.ndarray    # [tick] collectives issued


@functools.lru_cache(maxsize=512)
def engine_counts(schedule) -> EngineCounts:
    """The tasks and collectives of `schedule` as the runtime executes it
    (`jaxhybrid.pipeline.tables.control_table`: one `ppermute` per transfer channel in
    every tick where some device sends on it)."""
    from jaxhybrid.pipeline.tables import control_table
    from jaxhybrid.schedules import TaskType
    tasks = np.zeros((schedule.num_ticks, schedule.num_devices))
    weight = np.zeros_like(tasks)
    for t in schedule.tasks:
        if t.kind in (TaskType.F, TaskType.B, TaskType.W):
            tasks[t.tick, t.device] += 1
        if t.kind == TaskType.W:
            weight[t.tick, t.device] += 1
    ct = control_table(schedule)
    return EngineCounts(tasks, weight, _issued(ct.act_send, ct.act_channels)
                        + _issued(ct.grad_send, ct.grad_channels))


def _issued(send: np.ndarray, channels) -> np.ndarray:
    """Per tick, the collectives issued: flagged channels that move data between devices
    (a channel of shift 0 stays on the device)."""
    send = np.asarray(send, bool).reshape(len(send), len(channels))
    moving = np.array([bool(c.perm) for c in channels], bool)
    return (send & moving).sum(axis=1).astype(float)


def tick_lengths(work: np.ndarray, data: int = 1, compute_slots: float = math.inf,
                 cpu_work: np.ndarray | None = None) -> np.ndarray:
    """Length of each lock-step tick from the [tick, device] work of one replica (and,
    sharing the cores, its CPU seconds `cpu_work`: by default the work itself)."""
    longest = work.max(axis=1)
    if math.isfinite(compute_slots):
        shared = work if cpu_work is None else cpu_work
        return np.maximum(longest, data * shared.sum(axis=1) / compute_slots)
    return longest


def lockstep_time(schedule, fwd_cost, bwd_cost, *, data: int = 1, compute_slots: float = math.inf,
                  tick_overhead: float = 0.0, transfer_per_tick: float = 0.0,
                  allreduce: float = 0.0, tick_latency: float = 0.0, task_overhead: float = 0.0,
                  collective_overhead: float = 0.0, launch_overhead: float = 0.0,
                  weight_task_overhead: float = 0.0, cpu_cost=None) -> StepTime:
    """The step of `schedule` (a `jaxhybrid.schedules.Schedule`) with per-stage forward
    and (full) backward costs, under the model in the module docstring. `cpu_cost`:
    (forward, backward) CPU seconds per stage for the cores' share (costs x the cores
    each layer kept busy, `LayerCost.fwd_threads`); None: the costs themselves."""
    work = schedule.work(fwd_cost, bwd_cost)
    cpu = work if cpu_cost is None else schedule.work(*cpu_cost)
    compute = float(tick_lengths(work, data, compute_slots, cpu).sum())
    extra = np.full(work.shape, float(tick_overhead))
    if task_overhead or collective_overhead or weight_task_overhead:
        tasks, weight, coll = engine_counts(schedule)
        extra = (extra + task_overhead * tasks + weight_task_overhead * weight
                 + collective_overhead * coll[:, None])
    engine = 0.0
    if extra.any():
        engine = float(tick_lengths(work + extra, data, compute_slots, cpu + extra).sum()) - compute
    if launch_overhead:
        engine += float(tick_lengths(np.full((1, work.shape[1]), float(launch_overhead)), data,
                                     compute_slots).sum())
    engine += float(tick_latency) * schedule.num_ticks
    return StepTime(compute, engine, float(transfer_per_tick) * schedule.num_ticks,
                    float(allreduce))
