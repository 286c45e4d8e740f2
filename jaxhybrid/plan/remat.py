"""Cost-balanced rematerialisation under the engine's memory model
(`jaxhybrid.plan.memory_model`; pure numpy): which layers to recompute so that a
device fits a memory budget with the slowest stage as fast as possible.

So a stage with little to stash gains nothing from the schedule's low in-flight count
on it: every stage's kept residuals must fit the same padded stash row. Stages are still
independent once that row is fixed: for a row size C (searched over the kept sizes the
stages can reach), every stage must keep <= C and have kept + transient + grads <= budget
- fixed - stash_slots * C, and each takes its cheapest choice (least extra forward time)
that does: exact over subsets for up to `exact_limit` candidate layers, else Pipe-Torch's
rule (most bytes saved per second of forward first, then drop what is not needed). The
best C gives the fastest slowest stage (exact against brute force, tests/test_remat.py).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from jaxhybrid.boundaries import stage_ranges
from jaxhybrid.plan.costs import LayerCost
from jaxhybrid.plan.memory_model import (_backward_work, _checked, _kept_by_dtype, _loss_bytes,
                                         _on_device, _spmd_terms, spmd_memory)
from jaxhybrid.plan.topology import fmt_bytes, parse_bytes


class MemoryBudgetError(ValueError):
    """No recomputation choice fits a stage into the memory budget."""


def recompute_time(costs: Sequence[LayerCost], boundaries: Sequence[int],
                   remat: Sequence[bool]) -> np.ndarray:
    """Extra backward time per stage from recomputation (one forward per remat layer)."""
    return np.array([sum(costs[i].fwd_time for i in range(a, b) if remat[i])
                     for a, b in stage_ranges(boundaries, len(costs))])


# --- SPMD runtime model ----------------------------------------------------------------
def _spmd_options(delta, fwd, saved_sum, exact_limit):
    """All recompute subsets of one stage (candidate layers only) as arrays, or None when
    there are too many (then the greedy rule is used)."""
    n = len(delta)
    if n > exact_limit:
        return None
    masks = ((np.arange(2 ** n)[:, None] >> np.arange(n)[None, :]) & 1).astype(bool)
    kept = saved_sum - (masks * delta).sum(1)
    trans = np.where(masks, delta, 0).max(1, initial=0)
    extra = (masks * fwd).sum(1)
    # Cheapest first (least extra time, then transient, then fewest layers): the pick
    # for a cap is the first subset that fits, with no sort per cap (1,000 layers in 64
    # stages took ~50 s under a budget, sorting 2^16 subsets per stage and cap).
    order = np.lexsort((masks.sum(1), trans, extra))
    return masks[order], kept[order], trans[order], extra[order]


def _spmd_stage_pick(opts, delta, fwd, saved_sum, cap, work_cap):
    """Least extra forward time with kept <= cap and transient <= work_cap.
    Returns (indices into delta, extra time, kept, transient) or None if impossible."""
    if opts is not None:
        masks, kept, trans, extra = opts   # cheapest first (`_spmd_options`)
        ok = (kept <= cap) & (trans <= work_cap)
        if not ok.any():
            return None
        best = int(ok.argmax())
        return np.nonzero(masks[best])[0], extra[best], kept[best], trans[best]
    # Greedy (Pipe-Torch's ratio rule), then drop what is not needed.
    def mem(ch):
        return saved_sum - delta[ch].sum(), (delta[ch].max() if ch else 0.0)
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


def _greedy_caps(delta, fwd, saved_sum) -> np.ndarray:
    """The kept sizes a stage too big to enumerate reaches along the greedy ratio order
    (most bytes saved per second first): every prefix, not only none and all (with only
    those two a stage over the row recomputed every layer, however little was missing)."""
    order = np.argsort(-(delta / np.maximum(fwd, 1e-30)), kind="stable")
    return saved_sum - np.concatenate([[0.0], np.cumsum(delta[order])])


def choose_remat_spmd(costs: Sequence[LayerCost], boundaries: Sequence[int], schedule,
                      memory_budget: float | str, *, param_state_factor: float = 4,
                      exact_limit: int = 16, max_caps: int = 256, model: int = 1,
                      zero_shards: int = 1, optimizer_factor: float = 2) -> list[bool]:
    """Per-layer recompute flags so that the SPMD program's device memory
    (`spmd_memory(...)[1]`) fits `memory_budget` with the slowest stage as fast as
    possible (then the least total recompute). MemoryBudgetError when it cannot fit.

    Device memory = fixed + rows * row + max_s (transient_s + backward work_s), with row
    >= max_s kept_s (equal when residuals are of one dtype).
    For a stash-row cap C every stage must have kept_s <= C and transient_s <= budget -
    fixed - rows * C - work_s; given C the stages are independent and each takes its
    cheapest fitting choice (exact over subsets up to `exact_limit` candidate layers, else
    the greedy ratio rule). C is searched over the kept values the stages can reach (at
    most `max_caps` of them, spread over the range when there are more); a choice whose
    dtype-padded row breaks the budget gives way to the next best."""
    budget = parse_bytes(memory_budget)
    costs, param_state_factor = _on_device(costs, param_state_factor, model, zero_shards,
                                           optimizer_factor)
    L = len(costs)
    ranges, *_ = _checked(costs, boundaries, schedule, None, None)
    fixed, rows = _spmd_terms(costs, ranges, schedule, param_state_factor)
    full = [c.saved_bytes > c.saved_bytes_remat for c in costs]
    device = lambda r: spmd_memory(costs, boundaries, schedule, r,  # noqa: E731
                                   param_state_factor=param_state_factor)
    # Nothing recomputed first: recomputing everything is not always the least (its
    # transient and a split backward's crossing gradients can outweigh the rows saved),
    # and budgets that needed no recompute were refused "even with full recompute".
    none_dev = device(None)
    if none_dev[1] <= budget:
        return [False] * L
    stages = []
    for a, b in ranges:
        saved = np.array([c.saved_bytes for c in costs[a:b]], float)
        delta = saved - np.array([c.saved_bytes_remat for c in costs[a:b]], float)
        cand = np.nonzero(delta > 0)[0]
        fwd = np.array([costs[a + i].fwd_time for i in cand], float)
        base = sum(c.fwd_time + c.bwd_time for c in costs[a:b])
        kept = saved.sum() + _loss_bytes(costs, b)
        stages.append(_StageChoices(a, cand, delta[cand], fwd, kept, base,
                                    _spmd_options(delta[cand], fwd, kept, exact_limit),
                                    _backward_work(costs, a, b)))
    caps = np.unique(np.concatenate(
        [o.options[1] if o.options is not None else _greedy_caps(o.delta, o.fwd, o.kept)
         for o in stages]))
    caps = caps[caps <= (budget - fixed) / rows * (1 + 1e-12)]
    if caps.size > max_caps:
        caps = np.unique(caps[np.linspace(0, caps.size - 1, max_caps).round().astype(int)])
    options = []
    for cap in caps:
        work_cap = budget - fixed - rows * cap
        picks = [_spmd_stage_pick(o.options, o.delta, o.fwd, o.kept, cap, work_cap - o.work)
                 for o in stages]
        if any(p is None for p in picks):
            continue
        options.append((_option_key(stages, picks, rows * max(p[2] for p in picks)), picks))
    options += _per_dtype_options(costs, ranges, stages, budget, fixed, rows, max_caps)
    for _, picks in sorted(options, key=lambda option: option[0]):
        remat = [False] * L
        for o, p in zip(stages, picks):
            for i in o.cand[p[0]]:
                remat[o.first + int(i)] = True
        if device(remat)[1] <= budget * (1 + 1e-12):
            return remat
    # max_caps thinned out the caps that work, or dtype padding broke them: full, if it fits.
    full_dev = device(full)
    if full_dev[1] <= budget:
        return full
    least, how = min((full_dev, "with every layer recomputed"),
                     (none_dev, "without recompute"), key=lambda d: d[0][1])
    over = least[1] - budget
    # The choices are per layer: in a chain of layers whose output is the next one's
    # input (Dense + tanh), recomputing a layer keeps its input and saves nothing, where
    # the runtime's stage-level remat="full" keeps only each stage's input (a probe: 321KB
    # predicted per layer, 115KB compiled for "full"); make_plan tries that next.
    raise MemoryBudgetError(
        f"the SPMD program needs {fmt_bytes(least[1])} per device {how}, the least of the "
        f"per-layer choices tried (largest stage: {int(np.argmax(least[0]))}; "
        f"parameters/optimizer state and buffers alone {fmt_bytes(fixed)}), "
        f"{fmt_bytes(over)} ({int(round(over))} bytes) over the {fmt_bytes(budget)} memory "
        f"budget; use more pipeline stages, more microbatches with a smaller microbatch, a "
        f"bigger budget, or remat=\"full\" (each stage recomputed whole from its input, "
        f"keeping only that input: less than this in a chain of layers, where each "
        f"recomputed layer keeps its own input).")


def whole_stages_within(costs: Sequence[LayerCost], boundaries: Sequence[int], schedule,
                        memory_budget: float | str, error: MemoryBudgetError,
                        **memory) -> tuple[list[bool], list[bool]]:
    """(per-layer remat, whole-stage flags) with stages recomputed whole from their input
    (the runtime's stage-level remat="full"): the last resort where no per-layer choice
    meets `memory_budget` (in a chain each recomputed layer still keeps its input: 96 x
    Dense(8)+tanh needed 321KB so, 115KB compiled recomputed by stages). The fewest
    stages that fit, those keeping the most first: the stash row every device holds is
    padded to the largest stage's, so recomputing the stage that sets it can be enough
    (an early convolution's), and the others keep their forward time. Every stage when
    no fewer fit; raises `error` (the per-layer search's), saying what that needs, when
    it misses the budget too. `memory`: `spmd_memory`'s keywords (param_state_factor,
    model, ...)."""
    L, S = len(costs), schedule.num_stages
    budget = parse_bytes(memory_budget)
    ranges = stage_ranges(boundaries, L)
    kept = [sum(_kept_by_dtype(costs, a, b, np.zeros(L, bool)).values()) for a, b in ranges]
    order = sorted(range(S), key=lambda s: -kept[s])
    for k in range(1, S):
        whole = [s in order[:k] for s in range(S)]
        remat = [whole[s] for s, (a, b) in enumerate(ranges) for _ in range(a, b)]
        if spmd_memory(costs, boundaries, schedule, remat, whole_stage=whole,
                       **memory)[1] <= budget:
            return remat, whole
    need = spmd_memory(costs, boundaries, schedule, [True] * L, whole_stage=[True] * S,
                       **memory)[1]
    if need > budget:
        raise MemoryBudgetError(f"{error} Each stage recomputed whole from its input needs "
                                f"{fmt_bytes(need)} per device, over the budget too.") from None
    return [True] * L, [True] * S


def recompute_within(costs: Sequence[LayerCost], boundaries: Sequence[int], schedule,
                     memory_budget: float | str, **memory) -> tuple[list[bool], list | None]:
    """(per-layer remat, whole-stage flags or None) meeting `memory_budget`: the per-layer
    choice (`choose_remat_spmd`), else every stage recomputed whole
    (`whole_stages_within`); MemoryBudgetError when neither does. `memory`: their
    keywords (param_state_factor, model, zero_shards, optimizer_factor)."""
    try:
        return choose_remat_spmd(costs, boundaries, schedule, memory_budget, **memory), None
    except MemoryBudgetError as e:
        return whole_stages_within(costs, boundaries, schedule, memory_budget, e, **memory)


class _StageChoices(NamedTuple):
    """One stage's recomputation choices (`choose_remat_spmd`)."""
    first: int            # the stage's first layer
    cand: np.ndarray      # stage-local indices of the layers whose recomputation saves bytes
    delta: np.ndarray     # bytes each candidate saves
    fwd: np.ndarray       # the forward time each candidate's recomputation adds
    kept: float           # stash bytes with nothing recomputed
    base: float           # forward + backward time with nothing recomputed
    options: Any          # `_spmd_options` (every subset, cheapest first) or None (greedy)
    work: float           # the backward's temporaries (`_backward_work`)


def _option_key(stages, picks, stash_bytes: float) -> tuple:
    """How a choice of one pick per stage ranks: the slowest stage's time, the total
    recomputed time, then the bytes (stash rows + the largest transient)."""
    return (max(o.base + p[1] for o, p in zip(stages, picks)), sum(p[1] for p in picks),
            stash_bytes + max(p[3] + o.work for o, p in zip(stages, picks)))


def _per_dtype_options(costs, ranges, stages, budget, fixed, rows, max_caps) -> list:
    """With residuals of several dtypes the stash row is per dtype the largest stage's,
    summed, so one cap on each stage's total misses choices (a stage may keep more of
    one dtype where another keeps less): search a cap per dtype, over the values the
    stages' subsets reach (exact up to `max_caps` cap vectors, thinned beyond). Only
    when every stage's subsets are enumerated (`exact_limit`); [] otherwise."""
    if any(o.options is None for o in stages):
        return []
    per_stage = []   # [options, dtypes] kept bytes of every subset of every stage
    for (a, b), o in zip(ranges, stages):
        masks = o.options[0]
        plain = _kept_by_dtype(costs, a, b, np.zeros(len(costs), bool), shared=False)
        per_stage.append((plain, masks))
    dtypes = sorted({d for plain, _ in per_stage for d in plain} | {"float32"})
    if len(dtypes) < 2:
        return []
    kept = []
    for (a, b), o, (plain, masks) in zip(ranges, stages, per_stage):
        base = np.array([plain.get(d, 0.0) for d in dtypes])
        change = np.zeros((len(o.cand), len(dtypes)))   # remat of a candidate: its parts go,
        for j, i in enumerate(o.cand):                   # its input comes (as float32)
            r = np.zeros(len(costs), bool)
            r[a + i] = True
            one = _kept_by_dtype(costs, a + i, a + i + 1, r)
            keep = _kept_by_dtype(costs, a + i, a + i + 1, np.zeros(len(costs), bool))
            change[j] = [one.get(d, 0.0) - keep.get(d, 0.0) for d in dtypes]
        kept.append(base[None, :] + masks.astype(float) @ change)
    values = [np.unique(np.concatenate([k[:, j] for k in kept])) for j in range(len(dtypes))]
    per = int(2 ** (16 / len(dtypes)))   # at most ~65536 vectors before the budget's cut
    values = [v if v.size <= per else v[np.unique(np.linspace(0, v.size - 1, per).round()
                                                  .astype(int))] for v in values]
    grid = np.stack(np.meshgrid(*values, indexing="ij"), -1).reshape(-1, len(dtypes))
    grid = grid[fixed + rows * grid.sum(1) <= budget * (1 + 1e-12)]
    if len(grid) > 4 * max_caps:
        grid = grid[np.unique(np.linspace(0, len(grid) - 1, 4 * max_caps).round().astype(int))]
    out = []
    for caps in grid:
        work_cap = budget - fixed - rows * caps.sum()
        picks = []
        for o, k in zip(stages, kept):
            masks, _, trans, extra = o.options
            ok = (k <= caps * (1 + 1e-12) + 1e-9).all(1) & (trans <= work_cap - o.work)
            if not ok.any():
                break
            j = int(ok.argmax())   # the options are cheapest first
            picks.append((np.nonzero(masks[j])[0], extra[j], k[j], trans[j]))
        if len(picks) < len(stages):
            continue
        row = float(np.max([p[2] for p in picks], 0).sum())   # per dtype the largest, summed
        out.append((_option_key(stages, picks, rows * row), picks))
    return out
