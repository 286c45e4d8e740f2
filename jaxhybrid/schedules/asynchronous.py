"""Asynchronous pipeline schedules: every stage updates its weights inside the stream.

All four run the lock-step 1F1B task order over the M microbatches of one call, with a
U task on a stage right after the backward that closes a gradient window (one
microbatch, or `window` of them for 2bw), so a microbatch is forwarded while the
gradients of earlier ones are still on their way back: its forward and its backward
see different weight versions unless a policy fixes that. The policy is the schedule's
`weights` field; per task the control table names the version slot it reads or saves
and the prediction distance s (`weight_columns`):

  async       "newest": forward and backward use the stage's current weights (the
              backward with the activations its forward stashed).
  pipedream   "stash": the forward's weights are saved with its residuals; the
              backward uses exactly them. A stage keeps one version per microbatch in
              flight (the stash ring: 2(S-1-k)+1 on stage k in lock step).
  2bw         "two-buffer": two versions; the weights change once per window of
              `window` microbatches (gradients accumulated over it, as in
              PipeDream-2BW); a forward uses the newest version, its backward the
              same one. Two buffers suffice when the window is at least stage 0's
              staleness 2(S-1) (at most one update between a forward and its
              backward; checked when the table is built; default:
              the smallest divisor of M that is >= 2S-1, stage 0's in-flight count).
  spectrain   (and "spectrain-v1" = spectrain with version=1, for configs)
              "predict-v2" (version=2, default): the forward uses W + s u, u the update
              the optimizer applied last (momentum SGD: u = -lr v, the paper's
              W - s lr v), s = D_k the staleness of stage k; the backward reuses the
              predicted weights (stashed). "predict-v1" (version=1): forward s =
              floor(k/2) + D_k, backward s = floor(k/2) at the backward's time.
              The paper's s = N-k-1 is D_k on PipeDream's timing; in lock step a
              microbatch sees D_k = 2(S-1-k) updates between its forward and its
              backward on stage k (`staleness`).

`<name>-1t` (async, pipedream, spectrain, spectrain-v1; option tasks_per_tick=1) runs the
same policies on a table with one task per device per tick (`one_task_per_tick`):
PipeDream's timing, where stage k holds S-k microbatches and D_k = S-1-k, the paper's
N-k-1, at the price of a larger lock-step bubble.

Microbatches stream through one call without a flush; the pipeline fills and drains
once per call (bubble (S-1)/(M+S-1) in ticks, as 1F1B's per step), so a call should
hold many microbatches: each is a whole optimizer batch here. With Adam, u is Adam's
last step (-lr m/(sqrt(v)+eps)), and W + s u extrapolates that step s times, which is
SpecTrain's rule applied to Adam's update direction rather than to a momentum buffer.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxhybrid.checks import is_int as _is_int
from jaxhybrid.schedules.builders import (_one_f_one_b_order, one_f_one_b, one_f_one_b_warmup,
                                          register_schedule)
from jaxhybrid.schedules.placer import place_tasks
from jaxhybrid.schedules.tasks import IDLE, WEIGHT_POLICIES, Schedule, Task, TaskType

ASYNC_POLICIES = WEIGHT_POLICIES[1:]
# Policies whose backward reads a version its forward saved in the stash ring's slot.
_STASHED = ("stash", "predict-v2")


def is_asynchronous(sched: Schedule) -> bool:
    return sched.weights != "sync"


def one_task_per_tick(S: int, M: int) -> Schedule:
    """1F1B with at most one task per device per tick (S-k forwards, then alternately a
    backward and a forward): PipeDream's timing, where stage k holds S-k microbatches
    and sees S-1-k updates between a microbatch's forward and backward (the paper's
    N-k-1), against 2(S-1-k)+1 and 2(S-1-k) when a tick holds a forward and a backward.
    In lock step a tick lasts as long as a backward, so this table idles more."""
    orders = [_one_f_one_b_order([(TaskType.F, d, m) for m in range(M)],
                                 [(TaskType.B, d, m) for m in range(M)], S - d) for d in range(S)]
    return place_tasks("1f1b-1t", S, M, range(S), orders, per_tick=1)


def _async_table(name: str, S: int, M: int, weights: str, window: int = 1,
                 tasks_per_tick: int = 2) -> Schedule:
    if M % window:
        raise ValueError(f"{name}: num_microbatches={M} is not a multiple of the gradient "
                         f"window {window}; use a multiple of {window}.")
    if not _is_int(tasks_per_tick) or tasks_per_tick not in (1, 2):
        raise ValueError(f"{name}: tasks_per_tick={tasks_per_tick!r} must be 2 (a forward and a "
                         f"backward per tick) or 1 (PipeDream's timing).")
    base = one_f_one_b(S, M) if tasks_per_tick == 2 else one_task_per_tick(S, M)
    b_tick = {(t.stage, t.microbatch): t.tick for t in base.tasks if t.kind == TaskType.B}
    updates = [Task(b_tick[(d, m)], d, TaskType.U, d, m)
               for d in range(S) for m in range(window - 1, M, window)]
    sched = dataclasses.replace(base, name=name, tasks=tuple(sorted(base.tasks + tuple(updates))),
                                weights=weights)
    sched.validate()
    return sched


@register_schedule("async")
def naive_async(num_stages: int, num_microbatches: int, tasks_per_tick: int = 2) -> Schedule:
    return _async_table("async", num_stages, num_microbatches, "newest",
                        tasks_per_tick=tasks_per_tick)


@register_schedule("pipedream")
def pipedream(num_stages: int, num_microbatches: int, tasks_per_tick: int = 2) -> Schedule:
    return _async_table("pipedream", num_stages, num_microbatches, "stash",
                        tasks_per_tick=tasks_per_tick)


def two_bw_window(num_stages: int, num_microbatches: int) -> int:
    """2bw's default gradient window: the smallest divisor of M that two buffers allow
    (stage 0's in-flight count, 2S-1 in lock step), or M itself."""
    need = one_f_one_b_warmup(num_stages, 0)
    return min(w for w in range(1, num_microbatches + 1)
               if num_microbatches % w == 0 and (w >= need or w == num_microbatches))


@register_schedule("2bw")
def two_bw(num_stages: int, num_microbatches: int, window: int | None = None) -> Schedule:
    if window is None:
        window = two_bw_window(num_stages, num_microbatches)
    if not _is_int(window) or window < 1:
        raise ValueError(f"2bw: window={window!r} must be an int >= 1.")
    sched = _async_table("2bw", num_stages, num_microbatches, "two-buffer", int(window))
    _two_buffer_versions(sched)   # raises when two buffers do not suffice
    return dataclasses.replace(sched, options=(("window", int(window)),))


@register_schedule("spectrain")
def spectrain(num_stages: int, num_microbatches: int, version: int = 2,
              tasks_per_tick: int = 2) -> Schedule:
    if not _is_int(version) or version not in (1, 2):
        # (2.0 or True named the policy "predict-v2.0" / "predict-vTrue": naive async)
        raise ValueError(f"spectrain: version={version!r} must be the int 1 or 2 (the "
                         f"paper's two choices of s).")
    return _async_table("spectrain", num_stages, num_microbatches, f"predict-v{int(version)}",
                        tasks_per_tick=tasks_per_tick)


@register_schedule("spectrain-v1")
def spectrain_v1(num_stages: int, num_microbatches: int, tasks_per_tick: int = 2) -> Schedule:
    """spectrain(version=1) under a name a config's pipeline.schedule can give."""
    return dataclasses.replace(spectrain(num_stages, num_microbatches, version=1,
                                         tasks_per_tick=tasks_per_tick), name="spectrain-v1")


def _one_task_variant(name: str, fn):
    """`<name>-1t`: `fn` with tasks_per_tick=1 (PipeDream's timing), a name configs can give."""
    @register_schedule(f"{name}-1t")
    def variant(num_stages: int, num_microbatches: int) -> Schedule:
        return dataclasses.replace(fn(num_stages, num_microbatches, tasks_per_tick=1),
                                   name=f"{name}-1t")
    return variant


for _name, _fn in (("async", naive_async), ("pipedream", pipedream), ("spectrain", spectrain),
                   ("spectrain-v1", spectrain_v1)):
    _one_task_variant(_name, _fn)


# --- what each task sees --------------------------------------------------------------
def _ticks(sched: Schedule) -> dict:
    return {(t.kind, t.stage, t.microbatch): t.tick for t in sched.tasks}


def staleness(sched: Schedule) -> np.ndarray:
    """Per stage, the most updates of that stage between a microbatch's forward and its
    backward (a U in the forward's tick runs after it and counts; one in the
    backward's tick runs after it and does not)."""
    when = _ticks(sched)
    out = np.zeros(sched.num_stages, int)
    for k in range(sched.num_stages):
        u = [t for (kind, j, _), t in when.items() if kind == TaskType.U and j == k]
        for m in range(sched.num_microbatches):
            f, b = when[(TaskType.F, k, m)], when[(TaskType.B, k, m)]
            out[k] = max(out[k], sum(f <= t < b for t in u))
    return out


def prediction_distances(sched: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """(forward s, backward s) per stage for the predicting policies (zeros otherwise)."""
    K = sched.num_stages
    fwd, bwd = np.zeros(K, int), np.zeros(K, int)
    if sched.weights == "predict-v2":
        fwd = staleness(sched)
    elif sched.weights == "predict-v1":
        bwd = np.arange(K) // 2
        fwd = bwd + staleness(sched)
    return fwd, bwd


def _two_buffer_versions(sched: Schedule) -> dict:
    """{(kind, stage, microbatch): version slot} for "two-buffer", and for U the slot
    the new version goes to. Version n (n updates done) lives in slot n % 2; raises
    when a backward would find its forward's version overwritten."""
    D = sched.num_devices
    done, seen, slots = [0] * D, {}, {}
    for t in sorted(sched.tasks, key=lambda t: (t.tick, t.kind)):
        if t.kind == TaskType.F:
            seen[(t.stage, t.microbatch)] = done[t.device]
            slots[(TaskType.F, t.stage, t.microbatch)] = done[t.device] % 2
        elif t.kind == TaskType.B:
            v = seen[(t.stage, t.microbatch)]
            if done[t.device] > v + 1:
                # The most other microbatches any stage has in flight (stage 0's): the
                # failing stage's count was named, and its window then failed on stage 0.
                need = int(max(sched.stage_in_flight())) - 1
                M = sched.num_microbatches
                fits = [w for w in range(need, M + 1) if M % w == 0]
                raise ValueError(f"{sched.name}: microbatch {t.microbatch}'s backward on "
                                 f"stage {t.stage} needs weight version {v}, overwritten by "
                                 f"then; use a gradient window of at least {need} (the other "
                                 f"microbatches stage 0 has in flight) that divides M={M}: "
                                 + (f"window={fits[0]}." if fits else
                                    f"none does, so use num_microbatches >= {need}."))
            slots[(TaskType.B, t.stage, t.microbatch)] = v % 2
        elif t.kind == TaskType.U:
            done[t.device] += 1
            slots[(TaskType.U, t.stage, t.microbatch)] = done[t.device] % 2
    return slots


WEIGHT_COLUMNS = ("f_ver", "f_save", "f_pred", "b_ver", "b_pred", "u_ver")


def weight_columns(sched: Schedule, stash_slot: dict, stash_size: int) -> tuple[dict, int]:
    """({column: [ticks, devices] int}, version ring size) for the control table:
    f_ver / b_ver the version slot a forward / backward reads (IDLE: the current
    weights), f_save the slot a forward saves the weights it used to, f_pred / b_pred
    the prediction distance s, u_ver the slot a U copies the new weights to."""
    T, D = sched.num_ticks, sched.num_devices
    cols = {c: np.full((T, D), IDLE if c.endswith(("ver", "save")) else 0, np.int32)
            for c in WEIGHT_COLUMNS}
    if not is_asynchronous(sched):
        return cols, 0
    fwd_s, bwd_s = prediction_distances(sched)
    two = _two_buffer_versions(sched) if sched.weights == "two-buffer" else {}
    for t in sched.tasks:
        at, k, m = (t.tick, t.device), t.stage, t.microbatch
        if t.kind == TaskType.F:
            cols["f_pred"][at] = fwd_s[k]
            if sched.weights in _STASHED:
                cols["f_save"][at] = stash_slot[(t.device, (k, m))]
            if two:
                cols["f_ver"][at] = two[(TaskType.F, k, m)]
        elif t.kind == TaskType.B:
            cols["b_pred"][at] = bwd_s[k]
            if sched.weights in _STASHED:
                cols["b_ver"][at] = stash_slot[(t.device, (k, m))]
            if two:
                cols["b_ver"][at] = two[(TaskType.B, k, m)]
        elif t.kind == TaskType.U and two:
            cols["u_ver"][at] = two[(TaskType.U, k, m)]
    size = stash_size if sched.weights in _STASHED else (2 if two else 0)
    return cols, size


def synchronous_view(sched: Schedule) -> Schedule:
    """The same table without its U tasks: gradients of one set of weights (what
    `value_and_grad` computes; a user's synchronous table may carry U tasks too, which
    without an optimizer have nothing to run)."""
    if not is_asynchronous(sched) and not any(t.kind == TaskType.U for t in sched.tasks):
        return sched
    return dataclasses.replace(sched, tasks=tuple(t for t in sched.tasks if t.kind != TaskType.U),
                               weights="sync")


def updates_per_call(sched: Schedule) -> int:
    """Optimizer updates a stage applies per call (1 for a synchronous step)."""
    if not is_asynchronous(sched):
        return 1
    return sum(t.kind == TaskType.U and t.device == 0 for t in sched.tasks)
