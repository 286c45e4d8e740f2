"""`make_plan`: layer costs -> a `Plan` (the split, the device order, what to recompute,
and the predicted times and memory of the engine's step; `jaxhybrid.plan.plan` holds
the Plan itself). The steps, each a function below: check the arguments, build the
schedule, cut the layers into stages (alternating with the device mapping on a
non-uniform topology), choose recomputation under a memory budget (re-cutting where
no recomputation fits), then price the stages with the one memory model
(`memory_model.spmd_memory`) and the one step model (`step_model`).
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import Sequence

import numpy as np

from jaxhybrid.boundaries import check_boundaries, stage_ranges, stage_sums
from jaxhybrid.checks import is_int
from jaxhybrid.plan.costs import LayerCost
from jaxhybrid.plan.layer_cost import cpu_seconds, layer_times
from jaxhybrid.plan.memory_cuts import cuts_that_fit
from jaxhybrid.plan.memory_model import spmd_memory
from jaxhybrid.plan.model_axis import local_cost
from jaxhybrid.plan.partitioning import OBJECTIVES, device_grid, map_devices, partition, stage_costs
from jaxhybrid.plan.plan import Plan
from jaxhybrid.plan.remat import (MemoryBudgetError, choose_remat_spmd, recompute_time,
                                  whole_stages_within)
from jaxhybrid.plan.step_model import engine_terms, tick_transfer
from jaxhybrid.plan.topology import Topology, parse_bytes
from jaxhybrid.schedules import make_schedule

PLAN_OBJECTIVES = (*OBJECTIVES, "step")


def _objective_value(sc, objective: str, M: int) -> float:
    t = sc.per_microbatch
    return float(t.max()) if objective == "bottleneck" else float(t.sum() + (M - 1) * t.max())


def checked_budget(value, what: str) -> float:
    """The budget in bytes; a bad one named ("size must be > 0, got 0.0" said not which)."""
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise ValueError(f"{what}={value!r}: {e}") from None


def checked_topology(topology, stages: int, data: int, v: int, who: str, flag: str):
    """`topology` (a spec string parsed) when it can carry `stages` x `data` devices without
    virtual stages (`v` per device), which the link model does not price yet; else a
    ValueError from `who` naming `flag`."""
    if topology is None:
        return None
    if v > 1:
        raise ValueError(f"{who}: a topology with virtual stages is not modelled yet; drop "
                         f"{flag} or use a schedule without virtual stages.")
    if isinstance(topology, str):
        topology = Topology.from_spec(topology)
    if topology.n < stages * data:
        raise ValueError(f"{who}: {stages} stages x data={data} need {stages * data} devices "
                         f"but the topology has {topology.n}; pass a bigger topology.")
    return topology


def _fixed_cuts(boundaries, S: int, L: int) -> list[int]:
    """The user's boundaries, checked by the one boundary check (as ValueErrors: make_plan
    reports every bad argument as one)."""
    try:
        return check_boundaries(boundaries, L, S)
    except (TypeError, ValueError) as e:
        raise ValueError(f"make_plan: {e}") from None


def make_plan(costs: Sequence[LayerCost], *, num_stages: int, num_microbatches: int,
              schedule: str = "1f1b", data: int = 1, topology: Topology | str | None = None,
              memory_budget: float | str | None = None, objective: str = "bottleneck",
              microbatch_size: int | None = None, param_state_factor: float = 4,
              device_order: Sequence[int] | None = None, max_mapping_rounds: int = 4,
              boundaries: Sequence[int] | None = None, virtual_stages: int = 1,
              hardware=None, model: int = 1, zero_shards: int = 1,
              remat: Sequence[bool] | None = None,
              whole_stage_remat: Sequence[bool] | None = None,
              stage_policy: Sequence[str | None] | None = None,
              policy_kept: Sequence[dict | None] | None = None,
              policy_recompute: Sequence[float | None] | None = None) -> Plan:
    """`boundaries` given: keep those cuts (and `device_order`) and plan the rest. Otherwise:
    partition (fwd+bwd time per layer; output bytes cross each cut; parameter bytes are
    all-reduced over `data`), device mapping on a non-uniform topology (alternating with
    re-partitioning until the mapping stops changing), recompute choice when
    `memory_budget` is set, and the resulting predicted times and memory. Memory is the
    engine's (`memory_model.spmd_memory`: every device sizes its buffers for the largest stage;
    the budget bounds `device_memory`). `hardware` (a `Hardware`, e.g.
    `calibration.stored_hardware()`): its engine terms (per-tick cost, compute slots)
    price the predicted step as the projection does; None: layer work and transfers only.
    model: tensor-parallel degree (times and memory of one device's share of each layer,
    `model_axis.local_cost`); zero_shards: data replicas the optimizer state is split over
    (ZeRO; 1 without). remat: one bool per layer, recomputation already chosen (the
    user's); its memory and recompute time are predicted instead of choosing one (a
    `memory_budget` beside it is the plan's to report, not to meet).
    whole_stage_remat: one bool per stage, recomputed whole from its input (the runtime's
    stage-level remat="full": it keeps only that input); with `memory_budget` and
    neither given, stages recomputed whole are the last resort when no per-layer choice
    fits. stage_policy: per stage, the jax.checkpoint_policies name it runs under, or None
    (`Plan.stage_policy`: `Pipeline(plan=...)` runs it again); policy_kept: per such
    stage, the residuals it keeps (bytes by dtype, `pipeline.policy_costs`; needs
    `boundaries`: they are those stages' residuals), its memory priced from them (else
    as no recompute); policy_recompute: per such stage, the share of its forward its
    backward runs again (`pipeline.policy_costs`; needs `boundaries` too), added to its
    backward's time (else priced as no recompute).
    objective: "bottleneck" (the least slowest stage, ties to the most even split),
    "alpa" (sum + (M - 1) x slowest stage) or "step" (the least predicted step,
    `fastest_cuts`: the schedule's fill and drain, the engine terms of `hardware`)."""
    costs = _checked_costs(costs, data=data, virtual_stages=virtual_stages,
                           num_stages=num_stages, num_microbatches=num_microbatches,
                           param_state_factor=param_state_factor,
                           microbatch_size=microbatch_size)
    if objective not in PLAN_OBJECTIVES:
        raise ValueError(f"make_plan: objective={objective!r}; choose one of "
                         f"{', '.join(PLAN_OBJECTIVES)}.")
    M, L = int(num_microbatches), len(costs)
    sched = _planned_schedule(schedule, int(num_stages), M, virtual_stages, L)
    S, v = sched.num_stages, sched.virtual_stages
    topology = checked_topology(topology, S, data, v, "make_plan", "topology=")
    budget = None if memory_budget is None else checked_budget(memory_budget, "make_plan: memory_budget")
    shard = dict(model=model, zero_shards=zero_shards)
    times = [local_cost(c, model) for c in costs]     # one device's share of each layer
    t = layer_times(times)
    link = {}
    if topology is not None:
        # One device's share: with model > 1 a device all-reduces its part of the
        # parameters over its replicas, not the whole layer's (`local_cost`).
        link = dict(topology=topology, boundary_bytes=[c.out_bytes for c in times], data=data,
                    param_bytes=[c.param_bytes for c in times] if data > 1 else None)
    if device_order is not None:
        device_grid(S // v, int(data), topology, device_order)   # distinct devices
    cut_by = "bottleneck" if objective == "step" else objective
    cut = lambda fixed: _cuts_and_order(times, t, S, M, data, cut_by, topology,  # noqa: E731
                                        device_order, fixed, max_mapping_rounds, link)
    cuts, order, sc = cut(boundaries)
    if remat is not None and len(remat) != L:
        raise ValueError(f"make_plan: remat has {len(remat)} entries, one per layer ({L}).")
    chosen, remat = remat is not None, [False] * L if remat is None else [bool(r) for r in remat]
    whole = _whole_stages(whole_stage_remat, S)
    for name, traced in (("policy_kept", policy_kept), ("policy_recompute", policy_recompute)):
        _check_policies(stage_policy, traced, name, boundaries, S)
    priced = functools.partial(_priced_plan, costs, times, sched, data=int(data),
                               topology=topology, hardware=hardware, budget=budget,
                               objective=objective, param_state_factor=param_state_factor,
                               shard=shard, stage_policy=stage_policy, policy_kept=policy_kept,
                               policy_recompute=policy_recompute)
    if objective == "step" and boundaries is None:
        def step_time(c):
            c_sc = stage_costs(t, c, device_order=order, num_microbatches=M, **link)
            return priced(c, order, c_sc, remat, whole).predicted_step_time
        cuts = fastest_cuts(cuts, L, step_time)
        sc = stage_costs(t, cuts, device_order=order, num_microbatches=M, **link)
    if budget is not None and whole_stage_remat is None and not chosen:
        try:
            remat = choose_remat_spmd(costs, cuts, sched, budget,
                                      param_state_factor=param_state_factor, **shard)
        except MemoryBudgetError as e:
            # Next: cuts that leave memory room (unless the cuts are the user's), then
            # every stage recomputed whole on these cuts.
            fitted = None
            if boundaries is None:
                try:
                    fitted = cuts_that_fit(costs, times, t, sched, budget, e,
                                           num_microbatches=M,
                                           param_state_factor=param_state_factor, **shard)
                except MemoryBudgetError:
                    pass
            if fitted is not None:
                cuts, order, sc = cut(fitted[0])
                remat = fitted[1]
            else:
                remat, whole = whole_stages_within(costs, cuts, sched, budget, e,
                                                   param_state_factor=param_state_factor,
                                                   **shard)
    return priced(cuts, order, sc, remat, whole)


def _check_policies(stage_policy, traced, name: str, boundaries, S: int) -> None:
    """`traced` (make_plan's argument `name`: per stage, what its policy costs) fits the
    stages and the policies named."""
    if stage_policy is not None and len(stage_policy) != S:
        raise ValueError(f"make_plan: stage_policy has {len(stage_policy)} entries, one per "
                         f"stage ({S}).")
    if traced is None:
        return
    if boundaries is None or len(traced) != S:
        raise ValueError(f"make_plan: {name} needs the boundaries it was traced for and "
                         f"one entry per stage ({S}), got "
                         f"{'no boundaries' if boundaries is None else len(traced)}.")
    named = stage_policy or [None] * S
    if any(k is not None and not p for k, p in zip(traced, named)):
        raise ValueError(f"make_plan: {name} prices stages under a policy: name each "
                         f"one's policy in stage_policy (the plan runs it again).")


def _whole_stages(whole_stage_remat, S: int) -> list[bool]:
    if whole_stage_remat is None:
        return [False] * S
    if len(whole_stage_remat) != S:
        raise ValueError(f"make_plan: whole_stage_remat has {len(whole_stage_remat)} entries, "
                         f"one per stage ({S}).")
    return [bool(w) for w in whole_stage_remat]


def _priced_plan(costs, times, sched, cuts, order, sc, remat, whole, *, data, topology,
                 hardware, budget, objective, param_state_factor, shard,
                 stage_policy=None, policy_kept=None, policy_recompute=None) -> Plan:
    """The Plan of these cuts, device order, stage costs `sc`, recomputation (`remat` per
    layer, `whole` per stage; per stage under a policy, the share of its forward it runs
    again, `policy_recompute`): its stage times, memory (`memory_model.spmd_memory`) and
    the engine terms its predicted step (`Plan.predicted_step`, the one step model) is
    priced with."""
    # A stage recomputed whole runs every layer's forward again: its layers' time.
    remat = [bool(r) or w for (a, b), w in zip(stage_ranges(cuts, len(costs)), whole)
             for r in remat[a:b]]
    mem, device_mem = spmd_memory(costs, cuts, sched, remat, param_state_factor=param_state_factor,
                                  whole_stage=whole, policy_kept=policy_kept, **shard)
    engine, slots = _engine_fields(hardware, times, cuts, sched, data)
    S = sched.num_stages
    return Plan(num_layers=len(costs), boundaries=[int(b) for b in cuts], num_stages=S,
                num_microbatches=sched.num_microbatches, schedule=sched.name, data=data,
                device_order=None if order is None else [int(d) for d in order],
                remat=[bool(r) for r in remat], whole_stage_remat=list(whole) if any(whole) else None,
                stage_policy=list(stage_policy) if stage_policy and any(stage_policy) else None,
                stage_policy_kept=None if policy_kept is None else [
                    None if k is None else {d: float(n) for d, n in k.items()} for k in policy_kept],
                stage_policy_recompute=None if policy_recompute is None else [
                    None if f is None else float(f) for f in policy_recompute],
                stage_transfer_time=sc.transfer.tolist(), stage_allreduce_time=sc.allreduce.tolist(),
                stage_memory=mem.tolist(), layer_names=[c.name for c in costs],
                memory_budget=budget, objective=objective, microbatch_size=costs[0].batch_size,
                topology=None if topology is None else (topology.description or repr(topology)),
                device_memory=device_mem, virtual_stages=sched.virtual_stages,
                schedule_options=dict(sched.options), table=sched, compute_slots=slots,
                transfer_per_tick=_transfer_per_tick(topology, times, cuts, order, S, data),
                **_stage_times(times, cuts, remat, policy_recompute), **engine)


# objective="step": every split is priced where there are at most this many; else a
# descent from the bottleneck split, moving one cut by up to `_STEP_MOVE` layers at a time.
EXHAUSTIVE_SPLITS, _STEP_MOVE = 300, 2


def fastest_cuts(start: list[int], L: int, step_time) -> list[int]:
    """The cuts of `L` layers into len(start) + 1 stages with the least `step_time(cuts)`
    (the predicted step, `Plan.predicted_step_time`), `start` (the least bottleneck's)
    kept on ties: every split when there are at most `EXHAUSTIVE_SPLITS`, else a steepest
    descent from `start` (each round the best move of one cut by 1.._STEP_MOVE layers)
    until no move shortens the step. A split by the bottleneck stage alone ignores the
    fill and drain: on a mixed model at M=4 a split with a larger bottleneck was
    predicted 8.8% faster."""
    best, best_time = list(start), step_time(start)
    better = lambda s: s < best_time * (1 - 1e-9)  # noqa: E731
    if math.comb(L - 1, len(start)) <= EXHAUSTIVE_SPLITS:
        for c in itertools.combinations(range(1, L), len(start)):
            if better(s := step_time(list(c))):
                best, best_time = list(c), s
        return best
    while True:
        moves = []
        for k in range(len(best)):
            lo = best[k - 1] + 1 if k else 1
            hi = best[k + 1] - 1 if k + 1 < len(best) else L - 1
            for d in range(-_STEP_MOVE, _STEP_MOVE + 1):
                if d and lo <= best[k] + d <= hi:
                    c = best[:k] + [best[k] + d] + best[k + 1:]
                    moves.append((step_time(c), c))
        if not moves:
            return best
        s, c = min(moves)
        if not better(s):
            return best
        best, best_time = c, s


def _checked_costs(costs, *, data, virtual_stages, num_stages, num_microbatches,
                   param_state_factor, microbatch_size) -> list[LayerCost]:
    """The costs as a list, at `microbatch_size`, after checking `make_plan`'s numbers
    before any work: data=0 or -1 gave a plan "x data 0" (no topology), virtual_stages=0
    was read as 1."""
    costs = list(costs)
    if not costs or not all(isinstance(c, LayerCost) for c in costs):
        raise ValueError("make_plan: costs must be a non-empty list of LayerCost (plan.profile(...)).")
    for name, value in (("data", data), ("virtual_stages", virtual_stages),
                        ("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not is_int(value) or value < 1:
            raise ValueError(f"make_plan: {name}={value!r} must be an int >= 1.")
    if not param_state_factor >= 2:   # below 2 the optimizer state came out negative
        raise ValueError(f"make_plan: param_state_factor={param_state_factor!r} would give "
                         f"(factor - 2) x params of optimizer state, less than none; use >= 2 "
                         f"(2: no optimizer state, 4: Adam's two moments).")
    if microbatch_size is not None and microbatch_size != costs[0].batch_size:
        costs = [c.scaled(microbatch_size) for c in costs]
    return costs


def _planned_schedule(schedule, num_stages: int, M: int, virtual_stages: int, L: int):
    """The schedule's table (the name and sizes checked early; `schedule` may be a
    Schedule, e.g. interleaved with virtual stages: then num_stages devices hold S x v
    stages, planned as such), refused where it has more stages than `L` layers."""
    sched = make_schedule(schedule, num_stages, M,
                          **({"virtual_stages": virtual_stages} if virtual_stages > 1 else {}))
    S, v = sched.num_stages, sched.virtual_stages
    if S > L:   # named in the user's terms (partition would say "16 stages" for 4 x 4)
        how = f"{S // v} devices x {v} stages each ({sched.name}) = " if v > 1 else ""
        raise ValueError(f"make_plan: {how}{S} stages but only {L} layers; use "
                         + (("fewer virtual stages, " if sched.takes_virtual_stages
                             else "a schedule with one stage per device, ") if v > 1 else "")
                         + "fewer pipeline stages or split the model into more layers.")
    return sched


def _stage_times(times, cuts, remat, policy_recompute=None) -> dict:
    """The Plan's per-stage seconds per microbatch: forward, backward (with what it
    recomputes: its recomputed layers' forward, and the share `policy_recompute` of a
    policy stage's), both, and the CPU seconds of each (`layer_cost.cpu_seconds`)."""
    fwd = stage_sums([c.fwd_time for c in times], cuts)
    cpu_f, cpu_b = cpu_seconds(times)
    cpu_fwd = stage_sums(cpu_f, cuts)
    again = np.asarray([f or 0.0 for f in policy_recompute or [0.0] * len(fwd)])
    bwd = (stage_sums([c.bwd_time for c in times], cuts) + recompute_time(times, cuts, remat)
           + again * fwd)
    return dict(stage_fwd_time=fwd.tolist(), stage_bwd_time=bwd.tolist(),
                stage_compute_time=(fwd + bwd).tolist(), stage_fwd_cpu=cpu_fwd.tolist(),
                # a recomputed layer's forward runs again in the backward
                stage_bwd_cpu=(stage_sums(cpu_b + np.where(remat, cpu_f, 0.0), cuts)
                               + again * cpu_fwd).tolist())


def _transfer_per_tick(topology, times, cuts, order, S: int, data: int) -> float:
    """Seconds a tick's boundary transfers take over the topology's links (0 without a
    topology or with one stage; no virtual stages with a topology: `checked_topology`)."""
    if topology is None or S == 1:
        return 0.0
    dev = list(range(S * data)) if order is None else order
    links = {(dev[r * S + k], dev[r * S + k + 1]) for r in range(data) for k in range(S - 1)}
    return tick_transfer(topology, links, max(times[b - 1].out_bytes for b in cuts))


RANDOM_STARTS = 4   # random device orders the split/mapping alternation also starts from


def _cuts_and_order(costs, t, S: int, M: int, data: int, objective: str, topology,
                    device_order, boundaries, max_rounds: int, link: dict):
    """(cuts, device order, stage costs): `boundaries` kept, or a partition of the layer
    times `t`; on a non-uniform topology with no given order, partition and device
    mapping alternate until the mapping stops changing, from in order and from
    stage-major (the best objective kept)."""
    L = len(costs)
    remap = (topology is not None and device_order is None and not topology.is_uniform()
             and boundaries is None)
    starts = [None if device_order is None else list(device_order)]
    if remap:
        # From in order (replica-major) and, with replicas, from stage-major (a stage's
        # replicas on neighbouring devices): from in order alone the alternation stopped
        # at a replica crossing nodes, 1.3-1.9x slower than the best (cuts, order) on
        # 2 nodes x 3 devices, data=2.
        starts = [list(range(S * data))]
        if data > 1 and S > 1:
            starts.append([s * data + r for r in range(data) for s in range(S)])
        rng = np.random.default_rng(0)   # and a few seeded random orders, when cheap
        starts += [rng.permutation(topology.n)[:S * data].tolist()
                   for _ in range(RANDOM_STARTS if L * S <= 20_000 else 0)]
    best = None
    for order in starts:
        for _ in range(max(1, max_rounds)):
            cuts = (partition(t, S, device_order=order, objective=objective, num_microbatches=M,
                              **link)
                    if boundaries is None else _fixed_cuts(boundaries, S, L))
            sc = stage_costs(t, cuts, device_order=order, num_microbatches=M, **link)
            value = _objective_value(sc, objective, M)
            if best is None or value < best[0] * (1 - 1e-9):
                best = (value, cuts, order, sc)
            if not remap or S * data == 1:
                break
            new = map_devices([costs[b - 1].out_bytes for b in cuts], topology, data,
                              stage_times=sc.compute,
                              stage_param_bytes=stage_sums([c.param_bytes for c in costs], cuts),
                              num_microbatches=M)
            if new == order:
                break
            order = new
    return best[1:]


def _engine_fields(hardware, times, cuts, sched, data: int) -> tuple[dict, float | None]:
    """(Plan's engine-term fields, its compute_slots or None) on `hardware`, priced as the
    projection prices them: the engine's ticks only with more than one pipeline device;
    none without `hardware`."""
    if hardware is None:
        return {}, None
    engine = dict(compute_slots=hardware.compute_slots)
    devices = sched.num_stages // sched.virtual_stages
    if devices > 1:
        stage_params = stage_sums([c.param_count for c in times], cuts)
        engine = engine_terms(hardware, np.bincount(sched.stage_device,
                                                    weights=stage_params).max(),
                              devices * data)
    slots = engine.pop("compute_slots")
    return engine, (slots if math.isfinite(slots) else None)
