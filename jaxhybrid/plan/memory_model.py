"""The engine's memory model (pure numpy): the bytes one device of the SPMD program
allocates for given layer costs, boundaries, schedule and recomputation.

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

A stage recomputed whole from its input (`whole_stage`: the runtime's stage-level
remat="full", one jax.checkpoint around the stage) keeps that input alone (and, last,
the loss's residuals); its backward re-materialises every residual of the stage at once
(its transient), and a split backward's B runs it whole, so its crossing values are the
stage's parameter gradients. A stage run under a jax.checkpoint policy (remat=
"dots_saveable", ...: `policy_kept`, its kept residuals by dtype as the runtime's trace
of that stage finds them, `pipeline.policy_costs`) is priced alike, keeping what the
policy saves instead of its input, and re-materialising the rest.

Otherwise kept_s = sum over the stage's layers of saved_bytes_remat if recomputed else
saved_bytes (less what an earlier layer of the stage, not recomputed, stashes too: one
value, `LayerCost.shared_residuals`), plus, on the last stage, the loss's residuals (the model output's bytes:
cross-entropy keeps the softmax for its backward); row = per dtype the largest stage's
kept residuals, summed (one stash buffer per dtype); transient_s = the largest
saved_bytes - saved_bytes_remat among its recomputed layers.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxhybrid.boundaries import stage_ranges
from jaxhybrid.plan.costs import LayerCost
from jaxhybrid.plan.model_axis import local_cost


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
    factor (optimizer state, x param bytes) divided over `zero_shards` data replicas: no
    more of it than the factor holds beyond the parameters and their gradients (a
    value_and_grad step, factor 2, holds no optimizer state: ZeRO priced it at 2 - 2 x
    (1 - 1/shards), 1.62x under its compiled step at data=2)."""
    if model < 1 or zero_shards < 1:
        raise ValueError(f"model={model} and zero_shards={zero_shards} must be >= 1.")
    optimizer_factor = min(optimizer_factor, max(param_state_factor - 2.0, 0.0))
    factor = param_state_factor - optimizer_factor * (1.0 - 1.0 / zero_shards)
    return [local_cost(c, model) for c in costs], factor


def _kept_by_dtype(costs, a, b, r, shared: bool = True, whole: bool = False,
                   kept: dict | None = None) -> dict:
    """A stage's kept residuals by dtype name (one stash buffer per dtype). Residuals of
    unknown dtype, recomputed layers' inputs and the loss's count as float32. A value two
    neighbouring layers both stash (`LayerCost.shared_residuals`) counts once, unless
    `shared=False`: the recompute search's linear model, where recomputing a layer frees
    all of its residuals (an upper bound on what is kept; its picks are checked against
    the model with sharing). `whole`: the stage is recomputed whole and keeps its input;
    `kept`: a policy stage's kept residuals by dtype (the module docstring)."""
    if kept is not None:
        out = {d: float(v) for d, v in kept.items()}
        out["float32"] = out.get("float32", 0.0) + _loss_bytes(costs, b)
        return out
    if whole:
        return {"float32": float(costs[a].saved_bytes_remat) + _loss_bytes(costs, b)}
    out: dict = {}
    for i, c in enumerate(costs[a:b], a):
        # What an earlier layer of the stage, not recomputed, stashes too is one value
        # (recomputed, a layer keeps its input: the output a tanh layer before it stashes).
        once: dict = {}
        for dist, d, n in (c.shared_residuals if shared else ()):
            if i - dist >= a and not r[i - dist]:
                once[d] = once.get(d, 0) + n
        if r[i]:
            parts = {"float32": max(c.saved_bytes_remat - sum(once.values()), 0)}
        elif sum(c.saved_by_dtype.values()):
            share = _residual_share(c)   # once per layer, not once per dtype
            parts = {d: max(v - once.get(d, 0), 0) * share for d, v in c.saved_by_dtype.items()}
        else:   # no by-dtype split recorded
            parts = {"float32": c.saved_bytes}
        for d, v in parts.items():
            out[d] = out.get(d, 0.0) + float(v)
    out["float32"] = out.get("float32", 0.0) + _loss_bytes(costs, b)
    return out


def _cross_ring(costs, ranges, r, schedule, row: dict, whole, policy_kept) -> float:
    """Bytes of the cross ring of a split backward (zb-h1, zbv; 0 for others): per stage
    and dtype, the crossing values that do not fit into the row's space W no longer
    reads (the padded row less the residuals W still reads); the ring's row is the
    largest stage's, per dtype, summed. Values are placed whole, largest first, as the
    runtime places them (`packing.place_in_free_space`); a layer that did not record
    them one by one (`LayerCost.cross_values`) counts as divisible bytes. A recomputed
    layer's backward is one jax.checkpoint equation that B runs whole (it makes the
    input gradient), so what crosses to W is its parameter gradients, and its row holds
    its input alone (six Dense(256) layers at microbatch 64, zb-h1, pipe 2, all
    recomputed: a ring of 1.57MB, three kernels' gradients per slot, where this model
    said nothing and a budget it called met was missed by 29%). The first stage is
    `_first_stage_values`'. `row`: the padded stash row by dtype (`_row_terms`); `whole`:
    per stage, recomputed whole or under a policy (its B runs the one checkpoint: every
    layer's parameter gradients cross); `policy_kept`: per stage, a policy stage's kept
    residuals or None."""
    slots = schedule.ring_slots()[1].get("cross", 0)
    if not (getattr(schedule, "split_backward", False) and slots):
        return 0.0
    over: dict = {}
    piece = _largest_residual(costs, r, ranges, whole)
    for (a, b), w, k in zip(ranges, whole, policy_kept):
        values, live = (_first_stage_values(costs, b, r, w, k) if a == 0
                        else _stage_cross_values(costs, a, b, np.ones(len(costs), bool) if w
                                                 else r))
        for d, n in _overflow(values, row, live, piece).items():
            over[d] = max(over.get(d, 0.0), n)
    return float(slots * sum(over.values()))


def _stage_cross_values(costs, a, b, r) -> tuple[list, dict]:
    """A stage's crossing values ([dtype, bytes, whole?]) and the residuals W reads, by
    dtype (`_cross_ring`)."""
    values, live = [], {}
    for i, c in enumerate(costs[a:b], a):
        if r[i]:
            values += _as_values(c.param_values, c.param_by_dtype, _param_share(c))
            continue
        scale = _residual_share(c)
        values += _as_values(c.cross_values, c.cross_by_dtype, scale)
        for d, v in c.weight_saved_by_dtype.items():
            live[d] = live.get(d, 0.0) + v * scale
    return values, live


def _as_values(whole: list, by_dtype: dict, scale: float) -> list:
    """[dtype, bytes, whole?] entries: the values one by one where they were recorded,
    else each dtype's bytes as one divisible entry."""
    if whole:
        return [[d, v * scale, True] for d, v in whole]
    return [[d, v * scale, False] for d, v in by_dtype.items()]


def _first_stage_values(costs, b, r, whole: bool = False,
                        kept: dict | None = None) -> tuple[list, dict]:
    """The first stage's input is not differentiated, so its B has nothing to make: W
    runs the whole backward, reads every residual of the stage (no row space is free)
    and gets the stage output's cotangent as its crossing value (a Dense(32)+gelu,
    Dense(256)+gelu stage at pipe 4: its 262KB cotangent went to a ring of 4 x 262KB
    that this model priced at 0, and a budget accepted was missed by 21%). One stage
    alone: what crosses is the loss's scalar cotangent."""
    if b == len(costs):
        return [], {}
    last = costs[b - 1]
    dtype = max(last.cross_by_dtype, key=last.cross_by_dtype.get, default="float32")
    return [[dtype, float(last.out_bytes), True]], _kept_by_dtype(costs, 0, b, r, whole=whole,
                                                                  kept=kept)


def _largest_residual(costs, r, ranges, whole) -> dict:
    """By dtype, the largest value a stash row holds (a recomputed layer's input, a stage
    recomputed whole's input and the loss's residual count as one float32 value each;
    {} where no layer recorded its largest)."""
    out: dict = {"float32": _loss_bytes(costs, len(costs))}
    for (a, b), w in zip(ranges, whole):
        for i in range(a, a + 1 if w else b):
            c = costs[i]
            for d, n in ({"float32": c.saved_bytes_remat} if r[i] or w
                         else c.largest_saved_by_dtype).items():
                out[d] = max(out.get(d, 0.0), float(n))
    return out if any(c.largest_saved_by_dtype for c in costs) else {}


def _overflow(values, row: dict, live: dict, piece: dict) -> dict:
    """By dtype, the bytes of `values` ([dtype, bytes, whole?]) that do not fit into the
    row's free space (`row` less `live`): whole values first, largest first, each where
    it fits in full and is no larger than the row's largest value (`piece`, if known:
    large residuals have buffers of their own, and a 262KB kernel gradient fits into
    none of four dead 65KB ones); divisible bytes fill what is left."""
    free = {d: max(n - live.get(d, 0.0), 0.0) for d, n in row.items()}
    over: dict = {}
    for d, n, whole in sorted(values, key=lambda v: (not v[2], -v[1])):
        room = free.get(d, 0.0)
        too_big = whole and piece and n > piece.get(d, 0.0)
        fits = 0.0 if too_big else n if n <= room else 0.0 if whole else room
        free[d] = room - fits
        over[d] = over.get(d, 0.0) + n - fits
    return over


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


def _transient(costs, a, b, r, whole: bool = False, kept: dict | None = None) -> float:
    """The largest residuals a recomputed layer of the stage re-materialises; recomputed
    whole, the residuals of all of its layers at once (its backward recomputes the stage,
    then runs every layer's backward); under a policy, all of them but what it `kept`."""
    if whole or kept is not None:
        every = _kept_by_dtype(costs, a, b, np.zeros(len(costs), bool))
        saved = sum(kept.values()) if kept is not None else 0.0
        return float(max(sum(every.values()) - _loss_bytes(costs, b) - saved, 0.0))
    return float(max([max(c.saved_bytes - c.saved_bytes_remat, 0)
                      for i, c in enumerate(costs[a:b], a) if r[i]], default=0))


def _checked(costs, boundaries, schedule, remat, whole_stage, policy_kept=None):
    """(stage ranges, remat flags as a bool array, whole-stage flags as a bool array,
    per stage a policy stage's kept residuals or None) after checking the arguments
    agree."""
    L = len(costs)
    ranges = stage_ranges(boundaries, L)
    if schedule.num_stages != len(ranges):
        raise ValueError(f"spmd_memory: schedule has {schedule.num_stages} stages, boundaries "
                         f"give {len(ranges)}.")
    r = np.zeros(L, bool) if remat is None else np.asarray(remat, bool)
    if r.shape != (L,):
        raise ValueError(f"remat needs one bool per layer ({L}), got {len(r)}.")
    w = np.zeros(len(ranges), bool) if whole_stage is None else np.asarray(whole_stage, bool)
    if w.shape != (len(ranges),):
        raise ValueError(f"whole_stage needs one bool per stage ({len(ranges)}), got "
                         f"{np.size(w)}.")
    kept = [None] * len(ranges) if policy_kept is None else list(policy_kept)
    if len(kept) != len(ranges):
        raise ValueError(f"policy_kept needs one entry per stage ({len(ranges)}), got "
                         f"{len(kept)}.")
    return ranges, r, w, kept


def _row_terms(costs, ranges, r, whole, policy_kept) -> tuple[np.ndarray, dict, np.ndarray]:
    """(kept residuals per stage, the padded row: per dtype the largest stage's, working
    set beside the row per stage: transient + backward work)."""
    by_dtype = [_kept_by_dtype(costs, a, b, r, whole=w, kept=k)
                for (a, b), w, k in zip(ranges, whole, policy_kept)]
    kept = np.array([sum(d.values()) for d in by_dtype])
    row = {k: max(d.get(k, 0.0) for d in by_dtype) for k in {k for d in by_dtype for k in d}}
    work = np.array([_transient(costs, a, b, r, w, k) + _backward_work(costs, a, b)
                     for (a, b), w, k in zip(ranges, whole, policy_kept)])
    return kept, row, work


def spmd_memory(costs: Sequence[LayerCost], boundaries: Sequence[int], schedule,
                remat: Sequence[bool] | None = None, *,
                param_state_factor: float = 4, model: int = 1, zero_shards: int = 1,
                optimizer_factor: float = 2,
                whole_stage: Sequence[bool] | None = None,
                policy_kept: Sequence[dict | None] | None = None) -> tuple[np.ndarray, float]:
    """SPMD model (module docstring): (per stage, the device bytes if every stage were
    like this one; the device bytes of the real program, >= the per-stage maximum).
    `schedule`: a `jaxhybrid.schedules.Schedule` (its slot counts size the buffers).
    model: tensor-parallel degree; zero_shards: data replicas the optimizer state
    (`optimizer_factor` x param bytes of the factor: Adam's 2 moments) is split over
    (ZeRO; 1 without), both applied by `_on_device`. whole_stage: per stage, recomputed
    whole from its input (the runtime's stage-level remat="full"; None: no stage).
    policy_kept: per stage, the kept residuals by dtype of a stage run under a
    jax.checkpoint policy, or None (`pipeline.policy_costs`; None: no such stage)."""
    costs, param_state_factor = _on_device(costs, param_state_factor, model, zero_shards,
                                           optimizer_factor)
    ranges, r, whole, pk = _checked(costs, boundaries, schedule, remat, whole_stage, policy_kept)
    fixed, rows = _spmd_terms(costs, ranges, schedule, param_state_factor)
    kept, row, work = _row_terms(costs, ranges, r, whole, pk)
    cross = _cross_ring(costs, ranges, r, schedule, row, _as_whole(whole, pk), pk)
    return (fixed + cross + rows * kept + work,
            float(fixed + cross + rows * sum(row.values()) + work.max()))


def memory_terms(costs: Sequence[LayerCost], boundaries: Sequence[int], schedule,
                 remat: Sequence[bool] | None = None, *,
                 param_state_factor: float = 4, model: int = 1, zero_shards: int = 1,
                 optimizer_factor: float = 2,
                 whole_stage: Sequence[bool] | None = None,
                 policy_kept: Sequence[dict | None] | None = None) -> dict:
    """`spmd_memory`'s device bytes by term (module docstring), {name: bytes}; the values
    add up to `spmd_memory(...)[1]`."""
    costs, param_state_factor = _on_device(costs, param_state_factor, model, zero_shards,
                                           optimizer_factor)
    ranges, r, whole, pk = _checked(costs, boundaries, schedule, remat, whole_stage, policy_kept)
    _, by_dtype, work = _row_terms(costs, ranges, r, whole, pk)
    row = float(sum(by_dtype.values()))
    terms = _fixed_terms(costs, ranges, schedule, param_state_factor)
    terms.update(stash=float(schedule.ring_slots()[1]["stash"] * row),
                 working=float(_working_rows(schedule) * row + work.max()),
                 cross=_cross_ring(costs, ranges, r, schedule, by_dtype, _as_whole(whole, pk), pk))
    return terms


def _as_whole(whole, policy_kept) -> np.ndarray:
    """Per stage, whether its backward is one jax.checkpoint (recomputed whole or under a
    policy): B runs it whole, so its crossing values are parameter gradients."""
    return np.asarray([bool(w) or k is not None for w, k in zip(whole, policy_kept)])
