"""Hybrid DP x PP x TP: step-time model, search over (data, pipe, model, ZeRO, microbatches) and
time-to-accuracy projection (Pal et al. 2019).

Step time of one configuration (each of `data` workers runs a `pipe`-stage pipeline over
its per-worker batch b, split into M microbatches of m = b / M examples):

  layer times   per-layer costs at batch m (`scale_cost`), on the target device by the
                roofline of `Hardware.compute_time`, or the costs' own (measured) times;
  partition     `plan.partition` (minimum-bottleneck split; boundary activations priced on
                the pipeline group's links);
  pipeline      the schedule's task table run in lock step (as the engine runs it):
                sum over ticks of  max_s work[t, s]  (= `Schedule.tick_times` with the
                per-stage forward/backward costs), plus per tick the boundary transfer
                of one activation and one gradient (every device sends both, padded to
                the largest boundary); with pipe > 1 every device's work in every tick
                also holds the engine's own cost (`step_model.engine_terms`: per tick
                `tick_overhead` + `tick_param_bytes` x (packed parameter elements per
                device = the largest stage's) / `mem_bandwidth`, per task (more per
                W task), per collective, per step; 0 for the GPU presets), its ticks
                run with `step_model.lockstep_slots(hw, data x pipe x model)` compute
                slots (fewer the more devices share the cores);
                with finite `compute_slots` (simulated devices sharing C cores) a tick
                lasts max(max_s work, data * sum_s work / C): the work of all devices in
                the tick serialises over the cores that are there;
  all-reduce    the gradients of every stage over its `data` replicas, after the flush
                and not overlapped with compute (Pal et al.'s t_step = t_worker +
                t_allreduce); see `allreduce_time`;
  update        the optimizer touching the state of every parameter that got a gradient
                once (memory-bound; sparse tables: the rows touched by any replica;
                `include_update=False` leaves it out, e.g. to compare with a measured
                value_and_grad step).

Memory per device: the planner's SPMD model of the engine (`memory_model.spmd_memory`: padded
stage buffers, the schedule's stash and inbox slots), with parameter state
`Hardware.param_state_bytes` per parameter and activations x `bytes_scale`; pipe = 1
accumulates one microbatch after another (1F1B on one device). Over the usable memory,
the planner's own recomputation choice (`remat.choose_remat_spmd`, per layer; bwd +=
the recomputed layers' fwd); configs that still do not fit are infeasible.

Tensor parallelism and ZeRO: with model degree T every device holds and computes its
share of each layer (`model_axis.local_cost`: what the layers' logical names split over
"model" / T, read from the profile) and its work includes the layers' collectives over
the model group (`model_times`: Megatron GPT blocks, 2 all-reduces of their activation
forward and 2 backward, on the intra-node all-reduce links); a configuration uses data x
pipe x model devices. ZeRO (`zero=1`) divides the optimizer state over the data
replicas in the memory model and the update time.

Time to accuracy (weak scaling, Pal et al.): global batch B = data * b, steps =
E(B) * ceil(D / B) with E from `StatEfficiency`, time = steps * step time.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from jaxhybrid.boundaries import stage_ranges, stage_sums
from jaxhybrid.plan.costs import LayerCost
from jaxhybrid.plan.layer_cost import cpu_seconds
from jaxhybrid.plan.hardware import Hardware
from jaxhybrid.plan.hybrid_network import (allreduce_time, model_times, pipeline_topology,
                                           replica_offsets)
from jaxhybrid.plan.model_axis import local_cost
from jaxhybrid.plan.memory_model import spmd_memory
from jaxhybrid.plan.remat import MemoryBudgetError, recompute_within
from jaxhybrid.plan.partitioning import partition
from jaxhybrid.plan.projection import Projection
from jaxhybrid.plan.stat_efficiency import StatEfficiency
from jaxhybrid.plan.step_model import engine_terms, lockstep_slots, lockstep_time, tick_transfer
from jaxhybrid.schedules import make_schedule
from jaxhybrid.schedules.asynchronous import is_asynchronous, updates_per_call

CostFn = Callable[[int], Sequence[LayerCost]]


# --- costs at a microbatch size --------------------------------------------------------
def scale_cost(c: LayerCost, batch_size: int) -> LayerCost:
    """`c` at another batch size. Like `LayerCost.scaled`, except that the parameter
    traffic inside fwd/bwd bytes (reading the weights: param_bytes forward, reading
    weights and writing gradients: 2 * param_bytes backward) does not scale with the
    batch. Measured times scale linearly (profile at the batch you will run to avoid it)."""
    if batch_size == c.batch_size:
        return c
    s = c.scaled(batch_size)
    r = batch_size / c.batch_size
    pf = min(c.fwd_bytes, c.param_bytes)
    pb = min(c.bwd_bytes, 2 * c.param_bytes)
    return dataclasses.replace(s, fwd_bytes=pf + (c.fwd_bytes - pf) * r,
                               bwd_bytes=pb + (c.bwd_bytes - pb) * r)


def cost_fn(costs) -> CostFn:
    """A function microbatch size -> per-layer costs, from a list of LayerCost (scaled
    with `scale_cost`) or from such a function (e.g. analytic reference costs)."""
    if callable(costs):
        return costs
    costs = list(costs)
    if not costs:
        raise ValueError("hybrid: the model has no layer costs; pass plan.profile(...) output.")
    return lambda m: [scale_cost(c, m) for c in costs]


def times_on_hardware(costs: Sequence[LayerCost], hw: Hardware) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds per layer on `hw`."""
    if hw.uses_measured_times:
        return (np.array([c.fwd_time for c in costs], float),
                np.array([c.bwd_time for c in costs], float))
    return (np.array([hw.compute_time(c.fwd_flops, c.fwd_bytes) for c in costs]),
            np.array([hw.compute_time(c.bwd_flops, c.bwd_bytes) for c in costs]))


def cpu_on_hardware(costs: Sequence[LayerCost], hw: Hardware, fwd, bwd) -> tuple:
    """(forward, backward) CPU seconds per layer of the times `fwd`, `bwd` on `hw`: the
    measured times x the cores each kept busy (`LayerCost.fwd_threads`), where `hw`
    prices by measured times; the times themselves otherwise."""
    if not hw.uses_measured_times:
        return np.asarray(fwd, float), np.asarray(bwd, float)
    return cpu_seconds(costs)


def grad_params(c: LayerCost, data: int, per_worker_batch: int) -> float:
    """Parameters whose gradients are exchanged. Layers with sparse-gradient tables
    (reference costs: `table_rows`, `row_params`, `sparse_rows`, `sparse_fixed_rows`)
    exchange only the rows the step touched, at most the whole table."""
    rows = getattr(c, "table_rows", 0)
    if not rows:
        return float(c.param_count)
    touched = data * (per_worker_batch * c.sparse_rows + c.sparse_fixed_rows)
    return float(c.param_count - rows * c.row_params + min(rows, touched) * c.row_params)


# --- one configuration ----------------------------------------------------------------
@dataclasses.dataclass
class Estimate:
    """Predicted step of one (data, pipe, model, ZeRO, M, schedule) configuration
    (seconds, bytes)."""
    data: int
    pipe: int
    num_microbatches: int
    schedule: str
    per_worker_batch: int
    feasible: bool
    reason: str = ""
    boundaries: list = dataclasses.field(default_factory=list)
    stage_fwd: list = dataclasses.field(default_factory=list)    # per microbatch
    stage_bwd: list = dataclasses.field(default_factory=list)
    stage_memory: list = dataclasses.field(default_factory=list)
    stage_remat: list = dataclasses.field(default_factory=list)
    pipeline_time: float = math.nan
    bubble_fraction: float = math.nan
    compute_time: float = math.nan   # the ticks' layer work alone (no engine overhead)
    engine_time: float = 0.0         # what the engine's per-tick costs add to the ticks
    transfer_time: float = 0.0
    allreduce_time: float = 0.0      # per optimizer update
    update_time: float = 0.0         # per optimizer update
    updates: int = 1                 # per step (an asynchronous call: one per window)
    step_time: float = math.nan
    global_batch: int = 0
    epochs: float = math.nan
    steps: float = math.nan
    time_to_accuracy: float = math.nan
    model: int = 1                   # tensor-parallel degree
    zero: int = 0                    # 1: optimizer state sharded over the data replicas
    model_time: float = 0.0          # collectives over "model" inside the stages' work

    @property
    def devices(self) -> int:
        return self.data * self.pipe * self.model

    @property
    def hybrid(self) -> bool:
        """Anything but plain data parallelism."""
        return self.pipe > 1 or self.model > 1

    @property
    def layout(self) -> str:
        """"data x pipe" (x model, + Z with ZeRO)."""
        return (f"{self.data}x{self.pipe}" + (f"x{self.model}" if self.model > 1 else "")
                + ("Z" if self.zero else ""))

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in dataclasses.asdict(self).items()}


def worker_step(costs, hw: Hardware, *, pipe: int, num_microbatches: int, per_worker_batch: int,
                schedule: str = "1f1b", optimizer_states: int = 1, data: int = 1,
                boundaries: Sequence[int] | None = None, include_update: bool = True,
                model: int = 1, zero: int = 0) -> Estimate:
    """Step time and memory of one configuration (all-reduce over `data` included),
    without statistical efficiency."""
    est = _pipeline(cost_fn(costs), hw, pipe, num_microbatches, per_worker_batch, schedule,
                    optimizer_states, data, boundaries, model, zero)
    return _finish(est, cost_fn(costs), hw, data, optimizer_states if include_update else None)


def synchronous(schedule: str) -> str:
    """`schedule` if it is a synchronous one, else a ValueError (the search): an
    asynchronous schedule (async, pipedream, 2bw, spectrain...) applies M / window
    updates per call on stale weights, which the statistical efficiency (no staleness)
    does not describe. (`step_time` prices such a call: every update's all-reduce and
    optimizer pass.)"""
    if is_asynchronous(make_schedule(schedule, 2, 2)):
        raise ValueError(f"schedule {schedule!r} is asynchronous (optimizer updates inside "
                         f"the pipeline on stale weights); the projection models synchronous "
                         f"steps only: choose from gpipe, 1f1b, interleaved, zb-h1, zbv.")
    return schedule


def _pipeline(costs: CostFn, hw: Hardware, pipe: int, M: int, b: int, schedule: str,
              optimizer_states: int, data: int, boundaries=None, model: int = 1,
              zero: int = 0) -> Estimate:
    """Everything but the all-reduce (which depends on `data`). With model > 1 a device
    holds and computes its share of each layer (`model_axis.local_cost`) and its
    stages' work includes the collectives over the model group (`model_times`)."""
    est = Estimate(data, pipe, M, schedule, b, False, global_batch=data * b, model=model,
                   zero=zero)
    if M < 1 or b % M:
        est.reason = f"M={M} does not divide the per-worker batch {b}"
        return est
    per_layer = list(costs(b // M))
    local = [local_cost(c, model) for c in per_layer]
    L = len(per_layer)
    # pipe = 1: a DP worker runs its microbatches one after another whatever the
    # schedule (interleaved / zbv would put 2 stages on the one device).
    sched = make_schedule(schedule if pipe > 1 else "1f1b", pipe, M)
    # An asynchronous call updates once per gradient window, each update averaging its
    # gradient over `data` first (`pipeline.runtime`'s U task); `_finish` prices them.
    est.updates = updates_per_call(sched)
    K, v = sched.num_stages, sched.virtual_stages   # K = pipe x virtual stages
    if K > L:
        est.reason = f"{K} stages (pipe={pipe} x {v} virtual) > {L} layers"
        return est
    fwd, bwd = times_on_hardware(local, hw)
    comm_f, comm_b = model_times(per_layer, hw, model, data * pipe)
    cpu_f, cpu_b = cpu_on_hardware(local, hw, fwd, bwd)
    fwd, bwd, cpu_f, cpu_b = fwd + comm_f, bwd + comm_b, cpu_f + comm_f, cpu_b + comm_b
    out_bytes = np.array([c.out_bytes for c in per_layer], float) * hw.bytes_scale
    topo = pipeline_topology(hw, pipe, model, data) if pipe > 1 else None
    if boundaries is not None and len(boundaries) != K - 1:
        raise ValueError(f"boundaries={list(boundaries)}: a {K}-stage pipeline needs "
                         f"{K - 1} (the first layer of stages 1..{K - 1}).")
    if boundaries is None:   # links between stages are modelled for one stage per device
        boundaries = partition(fwd + bwd, K, boundary_bytes=out_bytes if topo and v == 1 else None,
                               topology=topo if v == 1 else None)
    cuts = est.boundaries = [int(x) for x in boundaries]
    # Memory: the planner's SPMD model of the engine (`memory_model.spmd_memory`) at the
    # hardware's bytes (parameter state per parameter, activations x bytes_scale); pipe = 1
    # runs microbatches one after another (gradient accumulation: one in flight, as 1F1B
    # on one device). Over the budget: the planner's recomputation (`choose_remat_spmd`).
    mem_sched = sched if pipe > 1 else make_schedule("1f1b", 1, M)
    pstate = hw.param_state_bytes(optimizer_states)
    params = stage_sums(np.array([c.param_count for c in local], float), cuts)
    engine_costs = _at_training_bytes(per_layer, hw)
    factor = pstate / hw.grad_bytes - 1.0       # (factor + 1) x gradient bytes = pstate
    shard = dict(param_state_factor=factor, model=model, zero_shards=data if zero else 1,
                 optimizer_factor=4.0 * optimizer_states / hw.grad_bytes)
    F, B = stage_sums(fwd, cuts), stage_sums(bwd, cuts)
    est.model_time = float((stage_sums(comm_f + comm_b, cuts)).max()) if model > 1 else 0.0
    fitted = _fit_memory(engine_costs, cuts, mem_sched, hw.usable_memory, shard)
    if isinstance(fitted, str):
        est.reason = fitted
        return est
    flags, mem = fitted
    B = B + stage_sums(np.where(flags, fwd, 0.0), cuts)   # recomputed (collectives too)
    cpu = (stage_sums(cpu_f, cuts), stage_sums(cpu_b + np.where(flags, cpu_f, 0.0), cuts))
    remat = [bool(any(flags[a:b])) for a, b in stage_ranges(cuts, L)]
    est.stage_memory, est.stage_remat = [float(x) for x in mem], remat
    est.stage_fwd, est.stage_bwd = F.tolist(), B.tolist()

    # The lock-step pipeline.
    per_tick_comm, engine = 0.0, dict(compute_slots=hw.compute_slots)
    if pipe > 1:
        nb = out_bytes[np.array(cuts) - 1].max()   # padded to the largest boundary
        dev = sched.stage_device
        links = {(dev[k], dev[k + 1]) for k in range(K - 1) if dev[k] != dev[k + 1]}
        per_tick_comm = tick_transfer(topo, links, nb)
        engine = engine_terms(hw, np.bincount(dev, weights=params, minlength=pipe).max(),
                              data * pipe * model)
    st = lockstep_time(sched, F, B, data=data * model, transfer_per_tick=per_tick_comm,
                       cpu_cost=cpu, **engine)
    est.compute_time, est.engine_time, est.transfer_time = st.compute, st.engine, st.transfer
    est.pipeline_time = st.pipeline
    est.bubble_fraction = sched.bubble_fraction(F, B)
    est.feasible = True
    return est


def _at_training_bytes(per_layer, hw: Hardware) -> list:
    """The layers' costs as the memory model reads them on `hw`: activations at its
    training dtype (x bytes_scale), parameters at its gradient bytes."""
    bs = hw.bytes_scale
    return [dataclasses.replace(
        c, param_bytes=c.param_count * hw.grad_bytes, saved_bytes=c.saved_bytes * bs,
        saved_bytes_remat=c.saved_bytes_remat * bs, in_bytes=c.in_bytes * bs,
        out_bytes=c.out_bytes * bs, model_saved_bytes=c.model_saved_bytes * bs,
        bwd_temp_bytes=c.bwd_temp_bytes * bs,
        model_param_bytes=(c.model_param_bytes / c.param_bytes * c.param_count * hw.grad_bytes
                           if c.param_bytes else 0)) for c in per_layer]


def _fit_memory(engine_costs, cuts, mem_sched, usable: float, shard: dict):
    """(per-layer recompute flags, stage memory) within `usable` bytes per device: none
    recomputed when it fits, else the planner's choice (`recompute_within`: per layer,
    then every stage recomputed whole); or the reason (a str) when even that does not
    fit."""
    flags, whole = [False] * len(engine_costs), None
    mem, device = spmd_memory(engine_costs, cuts, mem_sched, flags, **shard)
    if device <= usable:
        return flags, mem
    try:
        flags, whole = recompute_within(engine_costs, cuts, mem_sched, usable, **shard)
    except MemoryBudgetError:
        every = [True] * len(flags)
        full, how = min((spmd_memory(engine_costs, cuts, mem_sched, every, **shard)[1],
                         "every layer recomputed"),
                        (spmd_memory(engine_costs, cuts, mem_sched, every, **shard,
                                     whole_stage=[True] * mem_sched.num_stages)[1],
                         "every stage recomputed whole"))
        least = f" ({full / 1e9:.3g} GB with {how})" if full < device else ""
        return f"needs {device / 1e9:.3g} GB per device{least} > {usable / 1e9:.3g} GB usable"
    return flags, spmd_memory(engine_costs, cuts, mem_sched, flags, whole_stage=whole, **shard)[0]


def _finish(est: Estimate, costs: CostFn, hw: Hardware, data: int,
            optimizer_states: int | None = 1) -> Estimate:
    """Adds the gradient all-reduce over `data` replicas and totals the step."""
    est = dataclasses.replace(est, data=data, global_batch=data * est.per_worker_batch)
    if not est.feasible:
        return est
    per_layer = [local_cost(c, est.model)
                 for c in costs(est.per_worker_batch // est.num_microbatches)]
    g = np.array([grad_params(c, data, est.per_worker_batch) for c in per_layer])
    stage_grads = stage_sums(g, est.boundaries)
    if len(stage_grads) != est.pipe:   # virtual stages: a device all-reduces all of its own
        dev = make_schedule(est.schedule, est.pipe, est.num_microbatches).stage_device
        stage_grads = np.bincount(dev, weights=stage_grads, minlength=est.pipe)
    # Every device of a (pipe, model) position all-reduces its own share over `data`
    # (ZeRO's reduce-scatter + all-gather move the same bytes); with the "model" axis
    # innermost, the pipe x model groups are laid out like pipe x model stages.
    est.allreduce_time = allreduce_time(hw, data, est.pipe * est.model,
                                        np.repeat(stage_grads, est.model) * hw.grad_bytes)
    if optimizer_states is not None and hw.mem_bandwidth:
        # Every device reads and writes the state of the parameters that got gradients
        # (all of them; for sparse tables, the rows any replica touched); with ZeRO
        # only its 1 / data shard of them.
        est.update_time = float(stage_grads.max() * 2 * hw.param_state_bytes(optimizer_states)
                                / hw.mem_bandwidth / (data if est.zero else 1))
    est.step_time = (est.pipeline_time + est.updates * (est.allreduce_time + est.update_time)
                     + hw.step_overhead)
    return est


def with_accuracy(est: Estimate, stat: StatEfficiency) -> Estimate:
    """Fills global batch, epochs, steps and time to accuracy: E(B) * ceil(D / B) steps."""
    B = est.data * est.per_worker_batch
    est.global_batch = B
    if stat.dataset_size:
        est.epochs = stat.epochs(B)
        est.steps = est.epochs * math.ceil(stat.dataset_size / B)
    else:
        est.steps = stat.steps(B)
    if est.feasible:
        est.time_to_accuracy = est.steps * est.step_time
    return est


def step_time(costs, hw: Hardware, *, data: int, pipe: int, num_microbatches: int,
              per_worker_batch: int, schedule: str = "1f1b", optimizer_states: int = 1,
              stat: StatEfficiency | None = None, boundaries: Sequence[int] | None = None,
              include_update: bool = True, model: int = 1, zero: int = 0) -> Estimate:
    """One configuration: `worker_step` plus the all-reduce over `data` (and, with
    `stat`, time to accuracy). `boundaries` fixes the stage split (default: the
    planner's); `include_update=False` drops the optimizer update (a value_and_grad step);
    `model`: tensor-parallel degree; `zero=1`: optimizer state sharded over `data`."""
    if data < 1 or pipe < 1 or model < 1 or zero not in (0, 1):
        raise ValueError(f"step_time: data={data}, pipe={pipe} and model={model} must be >= 1, "
                         f"zero={zero} 0 or 1.")
    est = worker_step(costs, hw, pipe=pipe, num_microbatches=num_microbatches,
                      per_worker_batch=per_worker_batch, schedule=schedule,
                      optimizer_states=optimizer_states, data=data, boundaries=boundaries,
                      include_update=include_update, model=model, zero=zero)
    return with_accuracy(est, stat) if stat is not None else est


# --- search and projection -------------------------------------------------------------
def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


# The most microbatches `search` tries unless told (`microbatches`): a task table grows
# with M, and past a few hundred the bubble it saves ((S - 1) / (M + S - 1) at S <= 64)
# is below what more, smaller microbatches cost. (Every divisor of a per-worker batch of
# 65536 took minutes.)
MAX_MICROBATCHES = 512


def search(costs, hw: Hardware, stat: StatEfficiency, *, devices: Sequence[int],
           per_worker_batch: int, microbatches: Sequence[int] | None = None,
           schedules: Sequence[str] = ("1f1b",), max_pipe: int | None = None,
           optimizer_states: int = 1, model: str = "model", model_degrees: Sequence[int] = (1,),
           zero: Sequence[int] = (0,)) -> Projection:
    """Every (data, pipe, model, ZeRO, M, schedule) with data * pipe * model = N for each N
    in `devices`, model in `model_degrees`, ZeRO in `zero` (only with data > 1), pipe <=
    number of layers (and <= max_pipe), M dividing the per-worker batch (and in
    `microbatches` if given, else at most `MAX_MICROBATCHES`); each with its step time,
    memory and time to accuracy
    (configurations that do not fit memory are kept as infeasible rows, with a reason).
    pipe = 1 rows are built once per (N, M), labelled with the first schedule (a DP
    worker runs its microbatches one after another whatever the schedule); asynchronous
    schedules are refused (`synchronous`). Model degrees must divide the layers' split
    dimensions (heads, MLP width): the costs do not say which do."""
    b = int(per_worker_batch)
    if b < 1:
        raise ValueError(f"search: per_worker_batch={per_worker_batch} must be >= 1.")
    devices = sorted({int(n) for n in devices})
    if not devices or devices[0] < 1:
        raise ValueError(f"search: devices must be positive device counts, got {devices}.")
    fn = cost_fn(costs)
    memo: dict = {}
    cached = lambda m: memo.setdefault(m, list(fn(m)))  # noqa: E731
    L = len(cached(b))
    ms = [m for m in divisors(b) if (m <= MAX_MICROBATCHES if microbatches is None
                                     else m in set(microbatches))]
    if not ms:
        raise ValueError(f"search: no microbatch count in {list(microbatches)} divides the "
                         f"per-worker batch {b}.")
    model_degrees, zero = sorted(set(model_degrees)), sorted(set(zero))
    schedules = [synchronous(s) for s in dict.fromkeys(schedules)]
    for name, value, ok, want in (
            ("schedules", schedules, schedules, "at least one"),
            ("model_degrees", model_degrees, model_degrees and model_degrees[0] >= 1, "ints >= 1"),
            ("zero", zero, zero and set(zero) <= {0, 1}, "0 and/or 1"),
            ("max_pipe", max_pipe, max_pipe is None or max_pipe >= 1, "None or >= 1")):
        if not ok:
            raise ValueError(f"search: {name}={value!r} must be {want}.")
    layouts = {n: [(t, p, z) for t in model_degrees if n % t == 0 for p in divisors(n // t)
                   for z in zero if p <= min(L, max_pipe or L) and not (z and n == t * p)]
               for n in devices}
    for n, lay in layouts.items():
        if not lay:
            raise ValueError(f"search: no data x pipe x model layout for N={n}: model degrees "
                             f"{model_degrees} must divide it, pipe <= {L} layers and max_pipe="
                             f"{max_pipe}, ZeRO {zero} needs data > 1; change --devices or those.")
    cores: dict = {}
    rows = []
    # The pipeline part depends on data only through shared compute slots, ZeRO and where
    # the replicas sit in their nodes (`replica_offsets`).
    shared = math.isfinite(hw.compute_slots) or math.isfinite(lockstep_slots(hw, 1))
    for n in devices:
        for t, pipe, z in layouts[n]:
            data = n // (t * pipe)
            for sched in schedules if pipe > 1 else schedules[:1]:
                for m in ms:
                    where = (data if shared or z else (replica_offsets(hw, pipe * t, data),
                                                       replica_offsets(hw, t, data * pipe)))
                    key = (pipe, t, z, m, sched, where)
                    if key not in cores:
                        cores[key] = _pipeline(cached, hw, pipe, m, b, sched, optimizer_states,
                                               data, None, t, z)
                    rows.append(with_accuracy(_finish(cores[key], cached, hw, data, optimizer_states),
                                             stat))
    return Projection(model, hw.name, devices, b, stat, rows)


def project(model: str, devices: Sequence[int], hardware: str | Hardware = "v100_dgx1", *,
            per_worker_batch: int | None = None, stat: StatEfficiency | None = None,
            costs=None, size: str = "full", profile_batch: int = 2,
            optimizer_states: int | None = None, **search_kw) -> Projection:
    """Time-to-accuracy projection of `model` for each device count.

    costs: None / "reference" = the analytic full-size costs of a paper model
      (`reference_costs`); "profile" = `plan.profile` of `jaxhybrid.models.get_model(model,
      size)` at `profile_batch` examples, scaled to each microbatch; or a list of LayerCost
      / a function microbatch -> costs (measured ones for hardware "measured").
    stat: statistical efficiency (default: the model's documented default).
    """
    from jaxhybrid.plan import reference_costs as ref
    from jaxhybrid.plan.hardware import get_hardware
    from jaxhybrid.plan.stat_efficiency import default_for
    hw = get_hardware(hardware)
    known = model in ref.PAPER_MODELS
    if costs is None or costs == "reference":
        pm = ref.paper_model(model)
        costs = pm.costs
    elif costs == "profile":
        from jaxhybrid.models import get_model
        from jaxhybrid.plan.costs import profile
        spec = get_model(model, size)
        costs = profile(spec.layers, spec.sample_batch(profile_batch)[0])
    if per_worker_batch is None:
        if not known:
            raise ValueError(f"project: pass per_worker_batch for {model!r} (no default).")
        per_worker_batch = ref.PAPER_MODELS[model].per_worker_batch
    if optimizer_states is None:
        optimizer_states = ref.PAPER_MODELS[model].optimizer_states if known else 2
    if hw.uses_measured_times and not all(c.measured for c in cost_fn(costs)(per_worker_batch)):
        raise ValueError(f"project: hardware {hw.name!r} uses the costs' measured times, but "
                         f"these costs were not timed; profile with measure=True "
                         f"(scripts/project.py --costs=measured).")
    return search(costs, hw, stat or default_for(model), devices=devices,
                  per_worker_batch=per_worker_batch, optimizer_states=optimizer_states,
                  model=model, **search_kw)
