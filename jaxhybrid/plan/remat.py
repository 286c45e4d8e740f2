"""Cost-balanced rematerialisation: which layers to recompute so every stage fits its
device's memory while the slowest stage stays as fast as possible (pure numpy).

Per-stage memory model (bytes, one device of stage s holding layers [a, b)):

    param_state_factor * sum(param_bytes)      params + grads + 2 Adam moments (= 4)
  + sum(state_bytes)                           e.g. batch_stats (no grads, no moments)
  + in_flight[s] * sum(kept_l)                 stashed residuals of in-flight microbatches;
                                               kept_l = saved_bytes_remat if l recomputes
                                               else saved_bytes
  + max over recomputed l of (saved_bytes - saved_bytes_remat)
                                               the one layer being recomputed in backward
                                               re-materialises its residuals transiently
  + 2 * (in_bytes[a] + out_bytes[b-1])         boundary buffers: activation + gradient in
                                               and out

Recomputing layer l costs one extra forward of l in the backward pass. Each device has
its own memory, so stages are independent: an over-budget stage can only fix itself, and
the bottleneck is smallest when every stage picks the cheapest (least extra forward
time) set of recomputed layers that fits. That choice is exact (all subsets) for stages
with <= `exact_limit` layers that would save memory; beyond that it uses Pipe-Torch's
rule: recompute layers in order of most saved bytes per second of forward time until the
stage fits, then drop any chosen layer (slowest first) that is not needed after all.

SPMD model (`spmd_memory`, `choose_remat_spmd`; what `make_plan` uses by default). The
jaxhybrid runtime is one SPMD program: every device allocates buffers sized for the
*largest* stage (DESIGN.md: parameters padded to the largest stage, residual stash and
inboxes as ring buffers with the schedule's slot counts). Per device:

    param_state_factor * max_s sum(param_bytes) + max_s sum(state_bytes)
  + max_s sum(param_bytes)                     the stage gradient of the microbatch in its
                                               backward slot, before it joins the
                                               accumulator (counted in the factor)
  + (stash_slots + 2) * max_s kept_s           stash ring (+1 dummy row for idle slots),
                                               and the row the tick's forward slot returns
                                               (a conditional's result, copied into the ring)
  + max_s (kept_s + transient_s + grads_s)     the row read back for the tick's backward
                                               slot, what it re-materialises, and the
                                               activation gradients it holds (grads_s =
                                               max over the stage's layers of in + out bytes)
  + (act_slots + 1 + grad_slots + 1) * max boundary bytes   activation/gradient inboxes
  + num_microbatches * in_bytes[0]             this replica's inputs (on every device)

So a stage with little to stash gains nothing from the schedule's low in-flight count
on it: every stage's kept residuals must fit the same padded stash row. Stages are still
independent once that row is fixed: for a row size C (searched over the kept sizes the
stages can reach), every stage must keep <= C and have kept + transient + grads <= budget
- fixed - (stash_slots + 2) * C, and each takes its cheapest choice that does; the best C gives
the fastest slowest stage (exact against brute force, tests/test_plan.py).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxhybrid.boundaries import stage_ranges
from jaxhybrid.plan.costs import LayerCost
from jaxhybrid.plan.model_axis import local_cost
from jaxhybrid.plan.topology import fmt_bytes, parse_bytes


class MemoryBudgetError(ValueError):
    """No recomputation choice fits a stage into the memory budget."""


def _in_flight(in_flight, S: int) -> np.ndarray:
    f = np.broadcast_to(np.asarray(in_flight, float), (S,)) if np.ndim(in_flight) == 0 \
        else np.asarray(in_flight, float)
    if f.shape != (S,) or (f < 0).any():
        raise ValueError(f"in_flight needs {S} counts >= 0 (one per stage, e.g. "
                         f"make_schedule(name, S, M).in_flight()), got {list(np.ravel(in_flight))}.")
    return f


def stage_memory(costs: Sequence[LayerCost], boundaries: Sequence[int], in_flight,
                 remat: Sequence[bool] | None = None, *, param_state_factor: float = 4) -> np.ndarray:
    """Bytes per device of each stage under the model in the module docstring."""
    L = len(costs)
    ranges = stage_ranges(boundaries, L)
    f = _in_flight(in_flight, len(ranges))
    r = np.zeros(L, bool) if remat is None else np.asarray(remat, bool)
    if r.shape != (L,):
        raise ValueError(f"remat needs one bool per layer ({L}), got {len(r)}.")
    out = np.zeros(len(ranges))
    for s, (a, b) in enumerate(ranges):
        cs = costs[a:b]
        kept = sum(c.saved_bytes_remat if r[a + i] else c.saved_bytes for i, c in enumerate(cs))
        transient = max([max(c.saved_bytes - c.saved_bytes_remat, 0)
                         for i, c in enumerate(cs) if r[a + i]], default=0)
        out[s] = (param_state_factor * sum(c.param_bytes for c in cs) + sum(c.state_bytes for c in cs)
                  + f[s] * kept + transient + 2 * (cs[0].in_bytes + cs[-1].out_bytes))
    return out


def _fits_options(delta, fwd, base_mem, k, budget):
    """All subsets of the candidate layers: (feasible mask, extra time, memory, size)."""
    n = len(delta)
    masks = ((np.arange(2 ** n)[:, None] >> np.arange(n)[None, :]) & 1).astype(bool)
    mem = base_mem - k * (masks * delta).sum(1) + np.where(masks, delta, 0).max(1, initial=0)
    return masks, (masks * fwd).sum(1), mem


def _stage_choice(delta, fwd, base_mem, k, budget, exact_limit):
    """Indices (into delta) to recompute: least extra forward time that fits."""
    n = len(delta)
    if n <= exact_limit:
        masks, extra, mem = _fits_options(delta, fwd, base_mem, k, budget)
        ok = mem <= budget
        # Least extra time; then least memory; then fewest layers (lexsort: last key first).
        best = np.lexsort((masks.sum(1), mem, np.where(ok, extra, np.inf)))[0]
        return np.nonzero(masks[best])[0]
    order = np.argsort(-(delta / np.maximum(fwd, 1e-30)), kind="stable")
    chosen: list[int] = []
    mem = lambda ch: base_mem - k * delta[ch].sum() + (delta[ch].max() if ch else 0)  # noqa: E731
    for i in order:
        if mem(chosen) <= budget:
            break
        chosen.append(int(i))
    for i in sorted(chosen, key=lambda j: -fwd[j]):
        rest = [j for j in chosen if j != i]
        if mem(rest) <= budget:
            chosen = rest
    return np.array(chosen, int)


def choose_remat(costs: Sequence[LayerCost], boundaries: Sequence[int], in_flight,
                 memory_budget: float | str, *, param_state_factor: float = 4,
                 exact_limit: int = 16) -> list[bool]:
    """Per layer: True = recompute it in backward (jax.checkpoint). Fits every stage
    into `memory_budget` bytes per device with the least extra time on each stage; no
    recomputation where a stage already fits. Raises MemoryBudgetError when a stage does
    not fit even recomputing every layer that would save memory."""
    budget = parse_bytes(memory_budget)
    L = len(costs)
    ranges = stage_ranges(boundaries, L)
    f = _in_flight(in_flight, len(ranges))
    remat = [False] * L
    worst = None   # (overage, stage, full-recompute bytes)
    for s, (a, b) in enumerate(ranges):
        none = stage_memory(costs[a:b], [], [f[s]], param_state_factor=param_state_factor)[0]
        if none <= budget:
            continue
        saved = np.array([c.saved_bytes for c in costs[a:b]], float)
        delta = saved - np.array([c.saved_bytes_remat for c in costs[a:b]], float)
        cand = np.nonzero(delta > 0)[0]
        full = [bool(delta[i] > 0) for i in range(b - a)]
        full_mem = stage_memory(costs[a:b], [], [f[s]], full, param_state_factor=param_state_factor)[0]
        if full_mem > budget:
            if worst is None or full_mem - budget > worst[0]:
                worst = (full_mem - budget, s, full_mem)
            continue
        pick = _stage_choice(delta[cand], np.array([costs[a + i].fwd_time for i in cand]),
                             none, f[s], budget, exact_limit)
        for i in cand[pick]:
            remat[a + int(i)] = True
    if worst is not None:
        over, s, need = worst
        raise MemoryBudgetError(
            f"stage {s} needs {fmt_bytes(need)} even with full recompute, {fmt_bytes(over)} "
            f"({int(round(over))} bytes) over the {fmt_bytes(budget)} memory budget; use more "
            f"pipeline stages, more microbatches with a smaller microbatch, or a bigger budget.")
    return remat


def recompute_time(costs: Sequence[LayerCost], boundaries: Sequence[int],
                   remat: Sequence[bool]) -> np.ndarray:
    """Extra backward time per stage from recomputation (one forward per remat layer)."""
    return np.array([sum(costs[i].fwd_time for i in range(a, b) if remat[i])
                     for a, b in stage_ranges(boundaries, len(costs))])


# --- SPMD runtime model ----------------------------------------------------------------
def _spmd_terms(costs, ranges, schedule, param_state_factor):
    """(fixed bytes, rows of the largest kept residuals) of the SPMD model."""
    L = len(costs)
    params = max(sum(c.param_bytes for c in costs[a:b]) for a, b in ranges)
    state = max(sum(c.state_bytes for c in costs[a:b]) for a, b in ranges)
    act = max([costs[b - 1].out_bytes for a, b in ranges if b < L], default=0)
    rings = schedule.ring_slots()[1]
    inbox_rows = rings["act"] + 1 + rings["grad"] + 1
    fixed = ((param_state_factor + 1) * params + state + inbox_rows * act
             + schedule.num_microbatches * costs[0].in_bytes)
    # The stash ring, plus the residuals of the forward being computed.
    return float(fixed), rings["stash"] + 1


def _act_grads(costs, a, b) -> float:
    """Activation gradients live in a stage's backward: a layer's output cotangent and
    the input cotangent it produces (the largest such pair of the stage)."""
    return float(max(c.in_bytes + c.out_bytes for c in costs[a:b]))


def _kept_transient(costs, a, b, r):
    kept = sum(c.saved_bytes_remat if r[i] else c.saved_bytes for i, c in enumerate(costs[a:b], a))
    trans = max([max(c.saved_bytes - c.saved_bytes_remat, 0)
                 for i, c in enumerate(costs[a:b], a) if r[i]], default=0)
    return float(kept), float(trans)


def _on_device(costs, param_state_factor, model, zero_shards, optimizer_factor):
    """The layers and the parameter-state factor as one device holds them: at model
    degree `model` its share of each layer (`model_axis.local_cost`: what the logical
    rules split over "model" / model), and with ZeRO the `optimizer_factor` part of the
    factor (optimizer state, x param bytes) divided over `zero_shards` data replicas."""
    if model < 1 or zero_shards < 1:
        raise ValueError(f"model={model} and zero_shards={zero_shards} must be >= 1.")
    factor = param_state_factor - optimizer_factor * (1.0 - 1.0 / zero_shards)
    return [local_cost(c, model) for c in costs], factor


def spmd_memory(costs: Sequence[LayerCost], boundaries: Sequence[int], schedule,
                remat: Sequence[bool] | None = None, *,
                param_state_factor: float = 4, model: int = 1, zero_shards: int = 1,
                optimizer_factor: float = 2) -> tuple[np.ndarray, float]:
    """SPMD model (module docstring): (per stage, the device bytes if every stage were
    like this one; the device bytes of the real program, >= the per-stage maximum).
    `schedule`: a `jaxhybrid.schedules.Schedule` (its slot counts size the buffers).
    model: tensor-parallel degree; zero_shards: data replicas the optimizer state
    (`optimizer_factor` x param bytes of the factor: Adam's 2 moments) is split over
    (ZeRO; 1 without), both applied by `_on_device`."""
    costs, param_state_factor = _on_device(costs, param_state_factor, model, zero_shards,
                                           optimizer_factor)
    L = len(costs)
    ranges = stage_ranges(boundaries, L)
    if schedule.num_stages != len(ranges):
        raise ValueError(f"spmd_memory: schedule has {schedule.num_stages} stages, boundaries "
                         f"give {len(ranges)}.")
    r = np.zeros(L, bool) if remat is None else np.asarray(remat, bool)
    if r.shape != (L,):
        raise ValueError(f"remat needs one bool per layer ({L}), got {len(r)}.")
    fixed, rows = _spmd_terms(costs, ranges, schedule, param_state_factor)
    kt = np.array([_kept_transient(costs, a, b, r) for a, b in ranges])
    work = kt[:, 0] + kt[:, 1] + np.array([_act_grads(costs, a, b) for a, b in ranges])
    per_stage = fixed + rows * kt[:, 0] + work
    device = fixed + rows * kt[:, 0].max() + work.max()
    return per_stage, float(device)


def _spmd_options(delta, fwd, saved_sum, exact_limit):
    """All recompute subsets of one stage (candidate layers only) as arrays, or None when
    there are too many (then the greedy rule is used)."""
    n = len(delta)
    if n > exact_limit:
        return None
    masks = ((np.arange(2 ** n)[:, None] >> np.arange(n)[None, :]) & 1).astype(bool)
    kept = saved_sum - (masks * delta).sum(1)
    trans = np.where(masks, delta, 0).max(1, initial=0)
    return masks, kept, kept + trans, (masks * fwd).sum(1)


def _spmd_stage_pick(opts, delta, fwd, saved_sum, cap, work_cap):
    """Least extra forward time with kept <= cap and kept + transient <= work_cap.
    Returns (indices into delta, extra time, kept, work) or None if impossible."""
    if opts is not None:
        masks, kept, work, extra = opts
        ok = (kept <= cap) & (work <= work_cap)
        if not ok.any():
            return None
        best = np.lexsort((masks.sum(1), work, np.where(ok, extra, np.inf)))[0]
        return np.nonzero(masks[best])[0], extra[best], kept[best], work[best]
    # Greedy (Pipe-Torch's ratio rule), then drop what is not needed.
    def mem(ch):
        k = saved_sum - delta[ch].sum()
        return k, k + (delta[ch].max() if ch else 0.0)
    fits = lambda ch: mem(ch)[0] <= cap and mem(ch)[1] <= work_cap  # noqa: E731
    chosen: list[int] = []
    for i in np.argsort(-(delta / np.maximum(fwd, 1e-30)), kind="stable"):
        if fits(chosen):
            break
        chosen.append(int(i))
    if not fits(chosen):
        return None
    for i in sorted(chosen, key=lambda j: -fwd[j]):
        rest = [j for j in chosen if j != i]
        if fits(rest):
            chosen = rest
    return np.array(chosen, int), float(fwd[chosen].sum()), *mem(chosen)


def choose_remat_spmd(costs: Sequence[LayerCost], boundaries: Sequence[int], schedule,
                      memory_budget: float | str, *, param_state_factor: float = 4,
                      exact_limit: int = 16, max_caps: int = 256, model: int = 1,
                      zero_shards: int = 1, optimizer_factor: float = 2) -> list[bool]:
    """Per-layer recompute flags so that the SPMD program's device memory
    (`spmd_memory(...)[1]`) fits `memory_budget` with the slowest stage as fast as
    possible (then the least total recompute). MemoryBudgetError when it cannot fit.

    Device memory = fixed + rows * max_s kept_s + max_s work_s (work = kept + transient +
    activation gradients).
    For a stash-row cap C every stage must have kept_s <= C and work_s <= W = budget -
    fixed - rows * C; given (C, W) the stages are independent and each takes its cheapest
    fitting choice (exact over subsets up to `exact_limit` candidate layers, else the
    greedy ratio rule). C is searched over the kept values the stages can reach (at most
    `max_caps` of them, spread over the range when there are more)."""
    budget = parse_bytes(memory_budget)
    costs, param_state_factor = _on_device(costs, param_state_factor, model, zero_shards,
                                           optimizer_factor)
    L = len(costs)
    ranges = stage_ranges(boundaries, L)
    fixed, rows = _spmd_terms(costs, ranges, schedule, param_state_factor)
    full = [c.saved_bytes > c.saved_bytes_remat for c in costs]
    full_dev = spmd_memory(costs, boundaries, schedule, full, param_state_factor=param_state_factor)
    if full_dev[1] > budget:
        s = int(np.argmax(full_dev[0]))
        over = full_dev[1] - budget
        raise MemoryBudgetError(
            f"the SPMD program needs {fmt_bytes(full_dev[1])} per device even with full "
            f"recompute (largest stage: {s}; parameters/optimizer state and buffers alone "
            f"{fmt_bytes(fixed)}), {fmt_bytes(over)} ({int(round(over))} bytes) over the "
            f"{fmt_bytes(budget)} memory budget; use more pipeline stages, more microbatches "
            f"with a smaller microbatch, or a bigger budget.")
    if spmd_memory(costs, boundaries, schedule, param_state_factor=param_state_factor)[1] <= budget:
        return [False] * L
    stages = []
    for a, b in ranges:
        saved = np.array([c.saved_bytes for c in costs[a:b]], float)
        delta = saved - np.array([c.saved_bytes_remat for c in costs[a:b]], float)
        cand = np.nonzero(delta > 0)[0]
        fwd = np.array([costs[a + i].fwd_time for i in cand], float)
        base = sum(c.fwd_time + c.bwd_time for c in costs[a:b])
        stages.append((a, cand, delta[cand], fwd, saved.sum(), base,
                       _spmd_options(delta[cand], fwd, saved.sum(), exact_limit),
                       _act_grads(costs, a, b)))
    caps = np.unique(np.concatenate(
        [o[6][1] if o[6] is not None else [o[4], o[4] - o[2].sum()] for o in stages]))
    caps = caps[caps <= (budget - fixed) / rows * (1 + 1e-12)]
    if caps.size > max_caps:
        caps = np.unique(caps[np.linspace(0, caps.size - 1, max_caps).round().astype(int)])
    best = None
    for cap in caps:
        work_cap = budget - fixed - rows * cap
        picks = [_spmd_stage_pick(o[6], o[2], o[3], o[4], cap, work_cap - o[7]) for o in stages]
        if any(p is None for p in picks):
            continue
        times = [o[5] + p[1] for o, p in zip(stages, picks)]
        key = (max(times), sum(p[1] for p in picks), rows * max(p[2] for p in picks)
               + max(p[3] + o[7] for o, p in zip(stages, picks)))
        if best is None or key < best[0]:
            best = (key, picks)
    if best is None:   # only when max_caps thinned out the one cap that works
        return full
    remat = [False] * L
    for o, p in zip(stages, best[1]):
        for i in o[1][p[0]]:
            remat[o[0] + int(i)] = True
    return remat
