"""The engine's memory model and cost-balanced rematerialisation under it (pure numpy).

One model, used by the planner (`make_plan`), recomputation (`choose_remat_spmd`), the
projection (`jaxhybrid.plan.hybrid`) and the reports. The jaxhybrid runtime is one SPMD
program: every device allocates buffers sized for the *largest* stage (parameters packed
and padded to the device with the most, residual stash and inboxes as ring buffers with
the schedule's slot counts, `Schedule.ring_slots`). Per device (`memory_terms` gives
each term by name; `scripts/bench.py memory` compares their sum with the compiled step):

    params       max_d sum(param_bytes of the stages on device d)      packed parameters
    opt_state    (param_state_factor - 2) * params                     optimizer moments
                                                                       (factor 4: Adam's two)
    grads        2 * params        the gradient accumulator and the stage gradient of the
                                   microbatch in its backward slot, before it joins it
    state        max_s sum(state_bytes)                                e.g. batch_stats
    stash        stash_slots * row                the residual ring (written only by busy
                                                  slots: no idle row)
    working      (1 + split) * row + max_s (transient_s + work_s)   one residual row
                                   outside the ring: the row a forward slot returns before
                                   it is stored, or (never live at the same time) the row a
                                   backward slot reads back, plus what it re-materialises
                                   and the activation gradients and backward temporaries
                                   it holds (work_s: the largest layer's in + out bytes
                                   plus the stage's layers' `bwd_temp_bytes`); a split
                                   backward (zb-h1, zbv: split = 1) holds a second row,
                                   the copy B writes its cotangents for W into before it
                                   goes back to the ring
    cross        cross_slots * max_s overflow_s   a split backward's crossing values
                                   (`LayerCost.cross_by_dtype`) go into the space of the
                                   residuals W no longer reads (the row less the stage's
                                   `weight_saved_by_dtype`, per dtype); what does not fit
                                   into the cross ring (0 without a split backward)
    inboxes      (act_slots + 1 + grad_slots + 1 + 2) * max boundary bytes: the rings
                                   (and their dummy rows), and the last activation and
                                   gradient the device sent (`Carry.act_out` / `grad_out`)
    inputs       num_microbatches * in_bytes[0]   this replica's inputs (on every device)
    versions     weight_copies(schedule) * params  asynchronous schedules: the weight
                                   version ring (pipedream, spectrain: one per stash slot;
                                   2bw: two), a predicting optimizer's last update and
                                   the copies the compiled step holds for in-stream updates

with kept_s = sum over the stage's layers of saved_bytes_remat if recomputed else
saved_bytes (less what an earlier layer of the stage, not recomputed, stashes too: one
value, `LayerCost.shared_residuals`), plus, on the last stage, the loss's residuals (the model output's bytes:
cross-entropy keeps the softmax for its backward); row = per dtype the largest stage's
kept residuals, summed (one stash buffer per dtype); transient_s = the largest
saved_bytes - saved_bytes_remat among its recomputed layers.

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
from jaxhybrid.plan.model_axis import local_cost
from jaxhybrid.plan.topology import fmt_bytes, parse_bytes


class MemoryBudgetError(ValueError):
    """No recomputation choice fits a stage into the memory budget."""


def recompute_time(costs: Sequence[LayerCost], boundaries: Sequence[int],
                   remat: Sequence[bool]) -> np.ndarray:
    """Extra backward time per stage from recomputation (one forward per remat layer)."""
    return np.array([sum(costs[i].fwd_time for i in range(a, b) if remat[i])
                     for a, b in stage_ranges(boundaries, len(costs))])


# --- SPMD runtime model ----------------------------------------------------------------
def _spmd_terms(costs, ranges, schedule, param_state_factor):
    """(fixed bytes, rows of the largest kept residuals: the stash ring and the working
    rows) of the SPMD model."""
    return (float(sum(_fixed_terms(costs, ranges, schedule, param_state_factor).values())),
            schedule.ring_slots()[1]["stash"] + _working_rows(schedule))


def _working_rows(schedule) -> int:
    """Residual rows outside the ring: the one a slot returns or reads, and with a split
    backward the row B writes its cotangents for W into (compiled, tiny models at S=4:
    zb-h1 held one row more than 1F1B in BigLSTM's and GNMT's steps; the model without it
    was 17-21% under zb-h1's compiled bytes)."""
    return 1 + bool(getattr(schedule, "split_backward", False))


def _fixed_terms(costs, ranges, schedule, param_state_factor) -> dict:
    """The terms of the model that do not depend on recomputation, by name."""
    L = len(costs)
    stage_params = [sum(c.param_bytes for c in costs[a:b]) for a, b in ranges]
    # Virtual stages: a device packs the parameters of all of its stages.
    params = float(np.bincount(schedule.stage_device, weights=stage_params).max())
    act = max([costs[b - 1].out_bytes for a, b in ranges if b < L], default=0)
    rings = schedule.ring_slots()[1]
    return dict(params=params, opt_state=(param_state_factor - 2) * params, grads=2 * params,
                state=float(max(sum(c.state_bytes for c in costs[a:b]) for a, b in ranges)),
                inboxes=float((rings["act"] + 1 + rings["grad"] + 1 + 2) * act),
                inputs=float(schedule.num_microbatches * costs[0].in_bytes),
                versions=weight_copies(schedule) * params)


def weight_copies(schedule) -> int:
    """Copies of a device's packed parameters an asynchronous schedule holds beside them
    (`pipeline.async_weights`): the version ring (one slot per stash slot for "stash" /
    "predict-v2", two for "two-buffer") and a predicting optimizer's last update, plus
    what the compiled step was seen to hold: one copy for the weights its U tasks update
    inside the stream, one more with a version ring, and for "predict-v1" the weights
    its backward predicts (GPT tiny, M=4, over 1F1B: pipe 4, AdamW and SGD: async +1,
    2bw +4, pipedream +6, spectrain +7 parameter buffers; pipe 2: spectrain-v1 +3).
    0 for synchronous schedules."""
    policy = getattr(schedule, "weights", "sync")
    if policy == "sync":
        return 0
    ring = (schedule.ring_slots()[1]["stash"] if policy in ("stash", "predict-v2")
            else 2 if policy == "two-buffer" else 0)
    return 1 + ring + (ring > 0) + policy.startswith("predict") + (policy == "predict-v1")


def _backward_work(costs, a, b) -> float:
    """What a stage's backward holds beside its residual row: the largest layer's output
    and input cotangents, and the compiled backward temporaries of all of its layers
    (`LayerCost.bwd_temp_bytes`). The stage's backward is one XLA computation in which
    the layers' temporaries are not reused for one another: in GNMT's compiled step
    (4 LSTM layers per stage) the backward held 282KB of them, the largest layer's own
    backward 82KB, the sum of the four 152KB."""
    return float(max(c.in_bytes + c.out_bytes for c in costs[a:b])
                 + sum(c.bwd_temp_bytes for c in costs[a:b]))


def _loss_bytes(costs, b) -> float:
    """Residuals of the loss, kept by the last stage: the model output's size (the
    softmax cross-entropy saves its probabilities)."""
    return float(costs[-1].out_bytes) if b == len(costs) else 0.0


def _on_device(costs, param_state_factor, model, zero_shards, optimizer_factor):
    """The layers and the parameter-state factor as one device holds them: at model
    degree `model` its share of each layer (`model_axis.local_cost`: what the logical
    rules split over "model" / model), and with ZeRO the `optimizer_factor` part of the
    factor (optimizer state, x param bytes) divided over `zero_shards` data replicas."""
    if model < 1 or zero_shards < 1:
        raise ValueError(f"model={model} and zero_shards={zero_shards} must be >= 1.")
    factor = param_state_factor - optimizer_factor * (1.0 - 1.0 / zero_shards)
    return [local_cost(c, model) for c in costs], factor


def _kept_by_dtype(costs, a, b, r, shared: bool = True) -> dict:
    """A stage's kept residuals by dtype name (one stash buffer per dtype). Residuals of
    unknown dtype, recomputed layers' inputs and the loss's count as float32. A value two
    neighbouring layers both stash (`LayerCost.shared_residuals`) counts once, unless
    `shared=False`: the recompute search's linear model, where recomputing a layer frees
    all of its residuals (an upper bound on what is kept; its picks are checked against
    the model with sharing)."""
    out: dict = {}
    for i, c in enumerate(costs[a:b], a):
        if r[i]:
            parts = {"float32": c.saved_bytes_remat}
        elif sum(c.saved_by_dtype.values()):
            share = _residual_share(c)   # once per layer, not once per dtype
            # What an earlier layer of the stage, not recomputed, stashes too is one value.
            once: dict = {}
            for dist, d, n in (c.shared_residuals if shared else ()):
                if i - dist >= a and not r[i - dist]:
                    once[d] = once.get(d, 0) + n
            parts = {d: max(v - once.get(d, 0), 0) * share for d, v in c.saved_by_dtype.items()}
        else:   # no by-dtype split recorded
            parts = {"float32": c.saved_bytes}
        for d, v in parts.items():
            out[d] = out.get(d, 0.0) + float(v)
    out["float32"] = out.get("float32", 0.0) + _loss_bytes(costs, b)
    return out


def _cross_ring(costs, ranges, r, schedule, row: dict) -> float:
    """Bytes of the cross ring of a split backward (zb-h1, zbv; 0 for others): per stage
    and dtype, the crossing values beyond the row's space that W does not read (the
    padded row less the residuals W still reads); the ring's row is the largest stage's,
    per dtype, summed. A recomputed layer's backward is one jax.checkpoint equation that B
    runs whole (it makes the input gradient), so what crosses to W is its parameter
    gradients, and its row holds its input alone (six Dense(256) layers at microbatch
    64, zb-h1, pipe 2, all recomputed: a ring of 1.57MB, three kernels' gradients per
    slot, where this model said nothing and a budget it called met was missed by 29%).
    Byte counts,
    not the runtime's first fit of whole values (`packing.place_in_free_space`): a value
    that fits only in pieces is counted as fitting (Inception-V3 tiny, zb-h1, S=4: a row
    of 175KB predicted, 314KB in the runtime). `row`: the padded stash row by dtype
    (`_row_terms`)."""
    slots = schedule.ring_slots()[1].get("cross", 0)
    if not (getattr(schedule, "split_backward", False) and slots):
        return 0.0
    over: dict = {}
    for a, b in ranges:
        cross, live = {}, {}
        for i, c in enumerate(costs[a:b], a):
            if r[i]:
                share = _param_share(c)
                for d, v in c.param_by_dtype.items():
                    cross[d] = cross.get(d, 0.0) + v * share
                continue
            scale = _residual_share(c)
            for d, v in c.cross_by_dtype.items():
                cross[d] = cross.get(d, 0.0) + v * scale
            for d, v in c.weight_saved_by_dtype.items():
                live[d] = live.get(d, 0.0) + v * scale
        for d, v in cross.items():
            over[d] = max(over.get(d, 0.0), v - max(row.get(d, 0.0) - live.get(d, 0.0), 0.0))
    return float(slots * sum(max(v, 0.0) for v in over.values()))


def _param_share(c) -> float:
    """The part of a layer's parameters one device holds (below 1 with tensor
    parallelism: `param_bytes` is the local share, `param_by_dtype` the whole)."""
    total = sum(c.param_by_dtype.values())
    return c.param_bytes / total if total else 1.0


def _residual_share(c) -> float:
    """The part of a layer's residuals one device holds (`saved_bytes` over the by-dtype
    total: below 1 with tensor parallelism, `model_axis.local_cost`); a split backward's
    values are split alike."""
    total = sum(c.saved_by_dtype.values())
    return c.saved_bytes / total if total else 1.0


def _transient(costs, a, b, r) -> float:
    """The largest residuals a recomputed layer of the stage re-materialises."""
    return float(max([max(c.saved_bytes - c.saved_bytes_remat, 0)
                      for i, c in enumerate(costs[a:b], a) if r[i]], default=0))


def _checked(costs, boundaries, schedule, remat):
    """(stage ranges, remat flags as a bool array) after checking the arguments agree."""
    L = len(costs)
    ranges = stage_ranges(boundaries, L)
    if schedule.num_stages != len(ranges):
        raise ValueError(f"spmd_memory: schedule has {schedule.num_stages} stages, boundaries "
                         f"give {len(ranges)}.")
    r = np.zeros(L, bool) if remat is None else np.asarray(remat, bool)
    if r.shape != (L,):
        raise ValueError(f"remat needs one bool per layer ({L}), got {len(r)}.")
    return ranges, r


def _row_terms(costs, ranges, r) -> tuple[np.ndarray, dict, np.ndarray]:
    """(kept residuals per stage, the padded row: per dtype the largest stage's, working
    set beside the row per stage: transient + backward work)."""
    by_dtype = [_kept_by_dtype(costs, a, b, r) for a, b in ranges]
    kept = np.array([sum(d.values()) for d in by_dtype])
    row = {k: max(d.get(k, 0.0) for d in by_dtype) for k in {k for d in by_dtype for k in d}}
    work = np.array([_transient(costs, a, b, r) + _backward_work(costs, a, b) for a, b in ranges])
    return kept, row, work


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
    ranges, r = _checked(costs, boundaries, schedule, remat)
    fixed, rows = _spmd_terms(costs, ranges, schedule, param_state_factor)
    kept, row, work = _row_terms(costs, ranges, r)
    cross = _cross_ring(costs, ranges, r, schedule, row)
    return (fixed + cross + rows * kept + work,
            float(fixed + cross + rows * sum(row.values()) + work.max()))


def memory_terms(costs: Sequence[LayerCost], boundaries: Sequence[int], schedule,
                 remat: Sequence[bool] | None = None, *,
                 param_state_factor: float = 4, model: int = 1, zero_shards: int = 1,
                 optimizer_factor: float = 2) -> dict:
    """`spmd_memory`'s device bytes by term (module docstring), {name: bytes}; the values
    add up to `spmd_memory(...)[1]`."""
    costs, param_state_factor = _on_device(costs, param_state_factor, model, zero_shards,
                                           optimizer_factor)
    ranges, r = _checked(costs, boundaries, schedule, remat)
    _, by_dtype, work = _row_terms(costs, ranges, r)
    row = float(sum(by_dtype.values()))
    terms = _fixed_terms(costs, ranges, schedule, param_state_factor)
    terms.update(stash=float(schedule.ring_slots()[1]["stash"] * row),
                 working=float(_working_rows(schedule) * row + work.max()),
                 cross=_cross_ring(costs, ranges, r, schedule, by_dtype))
    return terms


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
    ranges, _ = _checked(costs, boundaries, schedule, None)
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
    least, how = min((full_dev, "with full recompute"), (none_dev, "without recompute"),
                     key=lambda d: d[0][1])
    over = least[1] - budget
    raise MemoryBudgetError(
        f"the SPMD program needs {fmt_bytes(least[1])} per device {how}, the least of the "
        f"choices tried (largest stage: {int(np.argmax(least[0]))}; parameters/optimizer "
        f"state and buffers alone {fmt_bytes(fixed)}), {fmt_bytes(over)} "
        f"({int(round(over))} bytes) over the {fmt_bytes(budget)} memory budget; use more "
        f"pipeline stages, more microbatches with a smaller microbatch, or a bigger budget.")


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
