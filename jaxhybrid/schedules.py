"""Pipeline schedules as typed task data (pure numpy; shared by `pipeline/` and `plan/`).

A schedule is a set of tasks (tick, device, kind, stage, microbatch) plus a stage -> device
map. Kinds (`TaskType`):
  F  forward of one stage on one microbatch (stashes the residuals of its vjp);
  B  backward: the full backward, or — when the schedule splits it — only the input
     gradient (the critical path);
  W  the weight-gradient half of a split backward (deferrable; reuses the forward's
     residuals and B's intermediate cotangents, never recomputes the forward);
  U  apply an optimizer update to a device's parameters (after the last backward of
     its stages; with virtual stages it updates all of them, its `stage` is the first).
`stage` counts model stages: with `virtual_stages=v` a pipeline of S devices has S*v
stages and device d runs stages d, d+S, d+2S, ... (interleaved), so activations wrap
from the last device to the first.

The runtime executes the tasks in lock step: in one tick every device runs at most one
task of each kind, in the order F, B, W, U, then activations and gradients move between
devices (`ppermute`). Dependencies (checked by `Schedule.validate`):
  F(k, m) after F(k-1, m) in an earlier tick;
  B(k, m) after B(k+1, m) in an earlier tick, or on the last stage after F(k, m)
          (the same tick is fine: F runs first);
  W(k, m) after B(k, m) (same tick fine);   U(k) after every B / W of stage k.
So a tick lasts as long as its busiest device; `tick_times` / `bubble_fraction` /
`plot` use that, and so does the planner's step time.

Builders (registered in `SCHEDULES`, built by `make_schedule(name, num_stages,
num_microbatches, **options)`, where `num_stages` is the pipeline depth in devices):
  gpipe        all forwards, then all backwards; M microbatches in flight.
  1f1b         one-forward-one-backward; stage s starts backwards after 2(S-1-s)+1
               forwards, so in lock step a steady tick runs one F and one B on every
               device; in flight <= 2S-1, independent of M.
  interleaved  Megatron's interleaved 1F1B (`virtual_stages=v`, default 2): forwards
               in groups of S microbatches per chunk, 1F1B steady state; the warm-up
               per device is the smallest that does not stall the lock step.
  zb-h1        zero bubble (Qi et al. 2024): backward split into B and W, one task per
               tick; B first, then F, and W fills what would be bubble; stashed
               residuals plus B->W cotangents capped at 1f1b's peak 2S-1 rows.
               Bubble (S-1)/(3M+S-1) with F = B = W.
  zbv          zero-bubble V-shape (Qi et al.): 2 stages per device, d and 2S-1-d;
               half-size stages halve the fill; residual + cotangent rows <= 3S
               half-stages (1.5S stages' worth, below 1f1b's 2S-1).
(ZB-H2's extra warm-up cannot shorten a lock-step table: the last device cannot start
before tick S-1, which already bounds zb-h1; so it is not offered.)
Each is a device-order policy placed on ticks by one greedy placer (`place_tasks`).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Callable, Sequence

import numpy as np

IDLE = -1


class TaskType(enum.IntEnum):
    F = 0
    B = 1
    W = 2
    U = 3


@dataclasses.dataclass(frozen=True, order=True)
class Task:
    tick: int
    device: int
    kind: TaskType
    stage: int
    microbatch: int = IDLE     # IDLE for U tasks

    def __str__(self) -> str:
        m = "" if self.kind == TaskType.U else str(self.microbatch)
        return f"{self.kind.name}{m}" + (f"s{self.stage}" if self.stage >= 0 else "")


def _broadcast(cost, n: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(cost, float), (n,)).copy()


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Tasks and the stage -> device map. `num_devices` = pipeline depth S;
    `num_stages` = S * virtual_stages; `split_backward`: B is the input-gradient half and
    W tasks carry the weight gradient."""
    name: str
    num_devices: int
    num_microbatches: int
    stage_device: tuple
    tasks: tuple
    split_backward: bool = False
    forward_only: bool = False
    options: tuple = ()          # the builder's options, ((name, value), ...)

    @property
    def num_stages(self) -> int:
        return len(self.stage_device)

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.num_devices

    @property
    def num_ticks(self) -> int:
        return 1 + max(t.tick for t in self.tasks)

    @functools.cached_property
    def _grids(self) -> dict:
        T, D = self.num_ticks, self.num_devices
        grids = {k: (np.full((T, D), IDLE), np.full((T, D), IDLE)) for k in TaskType}
        for t in self.tasks:
            st, mb = grids[t.kind]
            st[t.tick, t.device], mb[t.tick, t.device] = t.stage, t.microbatch
        return grids

    def grid(self, kind: TaskType) -> tuple[np.ndarray, np.ndarray]:
        """([ticks, devices] stage, [ticks, devices] microbatch) of `kind`'s tasks, IDLE
        where a device runs no such task."""
        return self._grids[TaskType(kind)]

    def with_updates(self) -> "Schedule":
        """The same schedule with a U task per device after the last backward of its
        stages (a synchronous optimizer step inside the pipeline). U updates every stage
        its device holds (the optimizer's step count advances once per device), so its
        `stage` is the device's first stage."""
        if any(t.kind == TaskType.U for t in self.tasks):
            return self
        last = TaskType.W if self.split_backward else TaskType.B
        done = [-1] * self.num_devices
        for t in self.tasks:
            if t.kind == last:
                done[t.device] = max(done[t.device], t.tick)
        first = [self.stage_device.index(d) for d in range(self.num_devices)]
        tasks = [*self.tasks, *(Task(done[d], d, TaskType.U, first[d])
                                for d in range(self.num_devices))]
        out = dataclasses.replace(self, tasks=tuple(sorted(tasks)))
        out.validate()
        return out

    # --- derived quantities ----------------------------------------------------------
    def work(self, fwd_cost=1.0, bwd_cost=2.0, weight_cost=None, update_cost=0.0) -> np.ndarray:
        """[ticks, devices] busy time of each device in each tick, from per-stage costs
        (scalars or one per stage). bwd_cost is the full backward; a split schedule's B
        and W cost bwd_cost - weight_cost and weight_cost (default: half each)."""
        K = self.num_stages
        f, b = _broadcast(fwd_cost, K), _broadcast(bwd_cost, K)
        w = b / 2 if weight_cost is None else _broadcast(weight_cost, K)
        cost = {TaskType.F: f, TaskType.B: b - w if self.split_backward else b,
                TaskType.W: w, TaskType.U: _broadcast(update_cost, K)}
        out = np.zeros((self.num_ticks, self.num_devices))
        for t in self.tasks:
            out[t.tick, t.device] += cost[t.kind][t.stage]
        return out

    def tick_times(self, fwd_cost=1.0, bwd_cost=2.0, weight_cost=None) -> np.ndarray:
        """Duration of each lock-step tick: its busiest device's work."""
        return self.work(fwd_cost, bwd_cost, weight_cost).max(axis=1)

    def bubble_fraction(self, fwd_cost=1.0, bwd_cost=2.0, weight_cost=None) -> float:
        """Fraction of device time idle when the table runs in lock step with the given
        per-stage costs (defaults: F = 1, B = 2, and B = W = 1 when split)."""
        work = self.work(fwd_cost, bwd_cost, weight_cost)
        return float(1.0 - work.sum() / (work.max(axis=1).sum() * self.num_devices))

    def in_flight(self) -> np.ndarray:
        """Per device, the most microbatch-stages whose forward ran and whose residuals are
        still needed (backward, or W when split, not yet run) = residual stash slots."""
        free = TaskType.W if self.split_backward else TaskType.B
        delta = np.zeros((self.num_ticks + 1, self.num_devices), int)
        for t in self.tasks:
            if t.kind == TaskType.F:
                delta[t.tick, t.device] += 1
            elif t.kind == free:
                delta[t.tick + 1, t.device] -= 1   # freed after the tick that reads it
        return np.cumsum(delta, axis=0).max(axis=0)

    def stage_in_flight(self) -> np.ndarray:
        """Per stage, the most microbatches whose residuals it holds at once."""
        free = TaskType.W if self.split_backward else TaskType.B
        delta = np.zeros((self.num_ticks + 1, self.num_stages), int)
        for t in self.tasks:
            if t.kind == TaskType.F:
                delta[t.tick, t.stage] += 1
            elif t.kind == free:
                delta[t.tick + 1, t.stage] -= 1
        return np.cumsum(delta, axis=0).max(axis=0)

    @functools.cached_property
    def _rings(self):
        K, dev = self.num_stages, self.stage_device
        when = {(t.kind, t.stage, t.microbatch): t.tick for t in self.tasks}
        last = TaskType.W if self.split_backward else TaskType.B
        act, grad, stash, cross = [], [], [], []   # (device, key, write tick, last read tick)
        for (kind, k, m), t in when.items():
            if kind == TaskType.F and not self.forward_only:
                stash.append((dev[k], (k, m), t, when[(last, k, m)]))
            if kind == TaskType.F and k > 0:
                act.append((dev[k], (k, m), when[(TaskType.F, k - 1, m)], t))
            if kind == TaskType.B and k < K - 1:   # gradient from k+1, read by B (and W)
                grad.append((dev[k], (k, m), when[(TaskType.B, k + 1, m)], when[(last, k, m)]))
            if kind == TaskType.B and self.split_backward:
                cross.append((dev[k], (k, m), t, when[(TaskType.W, k, m)]))
        # Inboxes are written at the end of a tick, after its reads: a slot read in tick r
        # can take a new value in r. Stashes are written in F (or B) before B / W read.
        out = [_colour(act, strict=False), _colour(grad, strict=False),
               _colour(stash, strict=True), _colour(cross, strict=True)]
        sizes = {name: max(size, 1) for name, (_, size) in zip(("act", "grad", "stash", "cross"), out)}
        return tuple(slots for slots, _ in out), sizes

    def ring_slots(self) -> tuple[tuple, dict]:
        """Ring buffers the runtime needs: ((act, grad, stash, cross) slot of each
        (device, (stage, microbatch)) value, {ring: size}). act: activations received for
        a stage's F; grad: gradients received for its B (kept for W when split); stash:
        residuals from F to the last backward; cross: what a split B hands to W."""
        return self._rings

    def validate(self) -> None:
        """Raises ValueError unless every (stage, microbatch) runs F and B (and W when
        split) exactly once on its stage's device, at most one task per kind per device
        and tick, in an order the lock-step data movement allows."""
        K, M, D = self.num_stages, self.num_microbatches, self.num_devices
        err = lambda msg: ValueError(f"schedule {self.name}: {msg}")
        if K < D or K % D or sorted(np.bincount(self.stage_device, minlength=D)) != [K // D] * D:
            raise err(f"stage_device {self.stage_device} must give each of {D} devices "
                      f"the same number of stages")
        when: dict = {}
        slots = set()
        for t in self.tasks:
            if not (0 <= t.stage < K) or t.device != self.stage_device[t.stage]:
                raise err(f"{t} runs on device {t.device}, its stage lives on "
                          f"{self.stage_device[t.stage] if 0 <= t.stage < K else '?'}")
            if (t.tick, t.device, t.kind) in slots:
                raise err(f"two {t.kind.name} tasks on device {t.device} in tick {t.tick}")
            slots.add((t.tick, t.device, t.kind))
            key = (t.kind, t.stage, t.microbatch)
            if key in when or (t.kind != TaskType.U and not 0 <= t.microbatch < M):
                raise err(f"{t} is repeated or its microbatch is out of range")
            when[key] = t.tick
        kinds = (TaskType.F,) if self.forward_only else \
            (TaskType.F, TaskType.B) + ((TaskType.W,) if self.split_backward else ())
        if not self.split_backward and any(k == TaskType.W for k, _, _ in when):
            raise err("W tasks need split_backward=True")
        for kind in kinds:
            for k in range(K):
                for m in range(M):
                    if (kind, k, m) not in when:
                        raise err(f"{kind.name}{m} of stage {k} never runs")
        for (kind, k, m), t in when.items():
            if kind == TaskType.F and k > 0 and when[(TaskType.F, k - 1, m)] >= t:
                raise err(f"F{m} of stage {k} at tick {t} before its input arrives")
            if kind == TaskType.B:
                before = (when[(TaskType.F, k, m)] <= t) if k == K - 1 else \
                    (when[(TaskType.B, k + 1, m)] < t)
                if not before or when[(TaskType.F, k, m)] > t:
                    raise err(f"B{m} of stage {k} at tick {t} before its gradient arrives")
            if kind == TaskType.W and when[(TaskType.B, k, m)] > t:
                raise err(f"W{m} of stage {k} at tick {t} before its B")
            if kind == TaskType.U:   # updates every stage of its device
                last, d = kinds[-1], self.stage_device[k]
                mine = [j for j in range(K) if self.stage_device[j] == d]
                if any(when[(last, j, i)] > t for j in mine for i in range(M)):
                    raise err(f"U of device {d} at tick {t} before its last backward")

    # --- pictures --------------------------------------------------------------------
    def chart(self) -> str:
        """Text Gantt chart: one row per device, one column per tick; `F3` forward of
        microbatch 3, `B3` backward, `W3` weight gradient, `U` update; with virtual stages
        `F3s5` names the stage; `.` idle."""
        cells = [["" for _ in range(self.num_ticks)] for _ in range(self.num_devices)]
        show_stage = self.virtual_stages > 1
        for t in sorted(self.tasks, key=lambda t: (t.tick, t.device, t.kind)):
            m = "" if t.kind == TaskType.U else str(t.microbatch)
            cells[t.device][t.tick] += t.kind.name + m + (f"s{t.stage}" if show_stage else "")
        width = max(1, *(len(c) for row in cells for c in row))
        lines = [f"{self.name}: S={self.num_devices} v={self.virtual_stages} "
                 f"M={self.num_microbatches} ticks={self.num_ticks} "
                 f"bubble={self.bubble_fraction():.3f}"]
        for d, row in enumerate(cells):
            lines.append(f"device {d}: " + " ".join((c or ".").ljust(width) for c in row))
        return "\n".join(lines)

    def plot(self, path: str, fwd_cost=1.0, bwd_cost=2.0, weight_cost=None,
             title: str | None = None) -> None:
        """PNG Gantt chart, tick widths from the given per-stage costs (the one plotter:
        plans draw through it too)."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        K = self.num_stages
        f, b = _broadcast(fwd_cost, K), _broadcast(bwd_cost, K)
        w = b / 2 if weight_cost is None else _broadcast(weight_cost, K)
        cost = {TaskType.F: f, TaskType.B: b - w if self.split_backward else b,
                TaskType.W: w, TaskType.U: np.full(K, 0.1 * float(f.mean()))}
        color = {TaskType.F: "tab:blue", TaskType.B: "tab:orange", TaskType.W: "tab:green",
                 TaskType.U: "tab:gray"}
        starts = np.concatenate([[0.0], np.cumsum(self.tick_times(f, b, w))])
        fig, ax = plt.subplots(figsize=(min(40, max(6, self.num_ticks * 0.3)),
                                        0.5 * self.num_devices + 1.3))
        offset = np.zeros((self.num_ticks, self.num_devices))
        for t in sorted(self.tasks, key=lambda t: (t.tick, t.device, t.kind)):
            c = cost[t.kind][t.stage]
            x = starts[t.tick] + offset[t.tick, t.device]
            offset[t.tick, t.device] += c
            ax.barh(t.device, c, left=x, color=color[t.kind], edgecolor="k", linewidth=0.4,
                    alpha=1.0 if t.stage < self.num_devices else 0.65)
            if t.kind != TaskType.U:
                ax.text(x + c / 2, t.device, str(t.microbatch), ha="center", va="center",
                        fontsize=6)
        ax.set_yticks(range(self.num_devices), [f"device {d}" for d in range(self.num_devices)])
        ax.invert_yaxis()
        ax.set_xlabel("time (F blue, B orange, W green, U gray; later virtual stages lighter)")
        ax.set_title(title or f"{self.name}  S={self.num_devices} v={self.virtual_stages} "
                              f"M={self.num_microbatches}  bubble="
                              f"{self.bubble_fraction(f, b, w):.3f}")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _colour(intervals: list, strict: bool) -> tuple[dict, int]:
    """Greedy interval colouring per device of (device, key, write, read) intervals.
    strict: a slot read in tick r may be rewritten only after r; else from r on."""
    slots, size, by_dev = {}, 0, {}
    for iv in intervals:
        by_dev.setdefault(iv[0], []).append(iv)
    for ivs in by_dev.values():
        free_at: list = []           # per slot: first tick it may be written again
        for dev, key, w, r in sorted(ivs, key=lambda iv: (iv[2], iv[3])):
            i = next((j for j, f in enumerate(free_at) if f <= w), len(free_at))
            if i == len(free_at):
                free_at.append(0)
            free_at[i] = r + 1 if strict else r
            slots[(dev, key)] = i
        size = max(size, len(free_at))
    return slots, size


# --- placing device orders on lock-step ticks -----------------------------------------
class ScheduleDeadlock(ValueError):
    """A device order whose next task can never become ready."""


class _Placer:
    """State of a greedy lock-step placement (see `place_tasks`)."""

    def __init__(self, orders, K: int, M: int, split: bool, per_tick: int, cap, priority):
        self.todo = [list(o) for o in orders]
        self.K, self.M, self.split, self.per_tick = K, M, split, per_tick
        self.cap, self.priority = cap, priority
        self.done: dict = {}
        self.pending_w = [[] for _ in orders]
        self.live = [0] * len(orders)     # stash rows in use: residuals (+ B->W cotangents)
        self.tasks: list[Task] = []

    def ready(self, kind, k, m, t) -> bool:
        done = self.done
        if kind == TaskType.F:
            return k == 0 or done.get((TaskType.F, k - 1, m), t) < t
        if kind == TaskType.B:
            if k == self.K - 1:
                return done.get((TaskType.F, k, m), t + 1) <= t
            return done.get((TaskType.B, k + 1, m), t) < t
        last = TaskType.W if self.split else TaskType.B
        return all(done.get((last, k, j), t + 1) <= t for j in range(self.M))

    def runnable(self, d, task, used, t) -> bool:
        blocked = task[0] == TaskType.F and self.cap is not None and self.live[d] >= self.cap[d]
        return task[0] not in used and not blocked and self.ready(*task, t)

    def next_task(self, d, used, t):
        """The next ordered task if it can run, or by priority the best runnable one; else
        a pending W (when split), else None."""
        todo = self.todo[d]
        if self.priority is None:
            i = 0 if todo and self.runnable(d, todo[0], used, t) else None
        else:
            ok = [j for j, task in enumerate(todo) if self.runnable(d, task, used, t)]
            i = min(ok, key=lambda j: self.priority(todo[j])) if ok else None
        if i is not None:
            return todo.pop(i)
        if self.split and TaskType.W not in used and self.pending_w[d]:
            return self.pending_w[d].pop(0)
        return None

    def place(self, d: int, t: int, kind, k: int, m: int) -> None:
        self.done[(kind, k, m)] = t
        self.tasks.append(Task(t, d, TaskType(kind), k, m))
        if kind == TaskType.F:
            self.live[d] += 1
        elif kind == TaskType.B and self.split:
            # B's cotangents for W occupy memory like the residuals: count them.
            self.pending_w[d].append((TaskType.W, k, m))
            self.live[d] += 1
        elif kind == TaskType.B:
            self.live[d] -= 1
        elif kind == TaskType.W:
            self.live[d] -= 2

    def tick(self, t: int) -> bool:
        """Places what every device can run in tick t; False if nothing could run."""
        placed = False
        for d in range(len(self.todo)):
            used = set()
            while len(used) < self.per_tick:
                task = self.next_task(d, used, t)
                if task is None:
                    break
                used.add(task[0])
                self.place(d, t, *task)
                placed = True
        return placed


def place_tasks(name: str, num_devices: int, num_microbatches: int, stage_device: Sequence[int],
                orders: Sequence[Sequence[tuple]], *, split_backward: bool = False,
                per_tick: int = 2, in_flight_cap: Sequence[int] | None = None,
                priority: Callable | None = None, forward_only: bool = False) -> Schedule:
    """Greedy lock-step placement of per-device task orders.

    orders[d]: device d's tasks as (kind, stage, microbatch), F and B (and U) only. In
    every tick a device takes tasks in order while they are ready, of kinds not yet used
    in the tick, up to `per_tick`; with `priority` (a key on (kind, stage, microbatch)) it
    instead takes its runnable task of least key, in any order. With split_backward each
    B's W becomes pending once the B is placed and runs whenever the device's next task
    cannot (not ready, or an F blocked by `in_flight_cap[d]`), the rest at the end. The
    cap counts stashed residuals (F until its last backward) plus, when split, B's
    stashed cotangents (B until W).
    """
    placer = _Placer(orders, len(stage_device), num_microbatches, split_backward, per_tick,
                     in_flight_cap, priority)
    total = sum(len(o) for o in orders) + (sum(t[0] == TaskType.B for o in orders for t in o)
                                            if split_backward else 0)
    tick = 0
    while len(placer.tasks) < total:
        if not placer.tick(tick):
            raise ScheduleDeadlock(f"schedule {name}: no device can run its next task at "
                                   f"tick {tick} (order deadlocks)")
        tick += 1
    sched = Schedule(name, num_devices, num_microbatches, tuple(int(d) for d in stage_device),
                     tuple(sorted(placer.tasks)), split_backward, forward_only)
    sched.validate()
    return sched


# --- builders ---------------------------------------------------------------------------
SCHEDULES: dict[str, Callable[..., Schedule]] = {}


def register_schedule(name: str):
    """Decorator: adds a builder `f(num_stages, num_microbatches, **options) -> Schedule`
    to `SCHEDULES` under `name`."""
    def deco(fn):
        if name in SCHEDULES:
            raise ValueError(f"register_schedule: {name!r} is already registered.")
        SCHEDULES[name] = fn
        return fn
    return deco


def _one_f_one_b_order(forwards: list, backwards: list, warmup: int) -> list:
    """`warmup` forwards, then alternately a backward and a forward, then the rest."""
    warmup = min(warmup, len(forwards))
    order = list(forwards[:warmup])
    rest_f = forwards[warmup:]
    for i, b in enumerate(backwards):
        order.append(b)
        if i < len(rest_f):
            order.append(rest_f[i])
    return order


@register_schedule("gpipe")
def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    S, M = num_stages, num_microbatches
    orders = [[(TaskType.F, d, m) for m in range(M)] + [(TaskType.B, d, m) for m in range(M)]
              for d in range(S)]
    return place_tasks("gpipe", S, M, range(S), orders)


def one_f_one_b_warmup(num_stages: int, device: int) -> int:
    """Forwards before stage `device`'s first backward in lock step: the round trip of
    microbatch 0 to the last stage and back takes 2(S-1-d) ticks."""
    return 2 * (num_stages - 1 - device) + 1


@register_schedule("1f1b")
def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    S, M = num_stages, num_microbatches
    orders = [_one_f_one_b_order([(TaskType.F, d, m) for m in range(M)],
                                 [(TaskType.B, d, m) for m in range(M)],
                                 one_f_one_b_warmup(S, d)) for d in range(S)]
    return place_tasks("1f1b", S, M, range(S), orders)


def _interleaved_orders(S: int, M: int, v: int, extra: int) -> list:
    groups = [list(range(g, min(g + S, M))) for g in range(0, M, S)]
    orders = []
    for d in range(S):
        fw = [(TaskType.F, c * S + d, m) for grp in groups for c in range(v) for m in grp]
        bw = [(TaskType.B, c * S + d, m) for grp in groups for c in reversed(range(v))
              for m in grp]
        orders.append(_one_f_one_b_order(fw, bw, (v - 1) * S + one_f_one_b_warmup(S, d) + extra))
    return orders


@register_schedule("interleaved")
def interleaved(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    S, M, v = num_stages, num_microbatches, virtual_stages
    if not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"interleaved: virtual_stages={v!r} must be an int >= 1.")
    stage_device = [k % S for k in range(S * v)]
    best = None
    # The smallest extra warm-up whose table has the least bubble (more warm-up only
    # costs memory once the lock step no longer stalls).
    for extra in range(0, S + 1):
        try:
            s = place_tasks("interleaved", S, M, stage_device, _interleaved_orders(S, M, v, extra))
        except ScheduleDeadlock:
            continue
        if best is None or s.bubble_fraction() < best.bubble_fraction() - 1e-9:
            best = s
    return best


@register_schedule("zb-h1")
def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    S, M = num_stages, num_microbatches
    # Every device may hold as many microbatches as 1f1b's busiest (2S-1): the later
    # stages then defer W so that B runs first and the last microbatch's backward chain
    # starts early — which is what removes the cool-down bubble.
    cap = [one_f_one_b_warmup(S, 0)] * S
    orders = [_one_f_one_b_order([(TaskType.F, d, m) for m in range(M)],
                                 [(TaskType.B, d, m) for m in range(M)],
                                 one_f_one_b_warmup(S, d)) for d in range(S)]
    return place_tasks("zb-h1", S, M, range(S), orders, split_backward=True, per_tick=1,
                       in_flight_cap=cap)


@register_schedule("zbv")
def zbv(num_stages: int, num_microbatches: int) -> Schedule:
    S, M = num_stages, num_microbatches
    # V-shape: device d holds stages d and 2S-1-d, so the turn (S-1 -> S) stays on the
    # last device and the loss is computed on device 0, next to the input.
    stage_device = [k if k < S else 2 * S - 1 - k for k in range(2 * S)]
    orders = [[(kind, k, m) for kind in (TaskType.F, TaskType.B) for k in (d, 2 * S - 1 - d)
               for m in range(M)] for d in range(S)]
    # B before F before W; then the earlier microbatch; then the later stage (finish a
    # microbatch before starting another: bounded memory).
    priority = lambda t: (0 if t[0] == TaskType.B else 1, t[2], -t[1])
    return place_tasks("zbv", S, M, stage_device, orders, split_backward=True, per_tick=1,
                       in_flight_cap=[3 * S] * S, priority=priority)


SCHEDULE_NAMES = tuple(SCHEDULES)


def forward_schedule(sched: Schedule) -> Schedule:
    """Forward tasks only (evaluation) on the same stage -> device map: every device
    runs its ready forward of the earliest microbatch each tick."""
    D, M, K = sched.num_devices, sched.num_microbatches, sched.num_stages
    orders = [[(TaskType.F, k, m) for k in range(K) if sched.stage_device[k] == d
               for m in range(M)] for d in range(D)]
    return place_tasks(f"{sched.name}-forward", D, M, sched.stage_device, orders, per_tick=1,
                       priority=lambda t: (t[2], t[1]), forward_only=True)


@functools.lru_cache(maxsize=256)
def _cached(name: str, num_stages: int, num_microbatches: int, options: tuple) -> Schedule:
    return dataclasses.replace(SCHEDULES[name](num_stages, num_microbatches, **dict(options)),
                               options=options)


def make_schedule(name: str | Schedule, num_stages: int, num_microbatches: int,
                  **options) -> Schedule:
    """The task table of a registered schedule (see `SCHEDULES`), or a user's `Schedule`
    checked against the pipeline's depth and microbatch count. num_stages = pipeline
    depth in devices; options: e.g. virtual_stages=2 for "interleaved"."""
    if isinstance(name, Schedule):
        if name.num_devices != num_stages or name.num_microbatches != num_microbatches:
            raise ValueError(f"schedule {name.name!r} is for {name.num_devices} devices x "
                             f"{name.num_microbatches} microbatches, the pipeline has "
                             f"{num_stages} x {num_microbatches}; build it for this pipeline.")
        name.validate()
        return name
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)} "
                         f"or pass a jaxhybrid.schedules.Schedule.")
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"schedule needs num_stages >= 1 and num_microbatches >= 1, got "
                         f"{num_stages}, {num_microbatches}.")
    try:
        return _cached(name, int(num_stages), int(num_microbatches), tuple(sorted(options.items())))
    except TypeError as e:
        raise ValueError(f"schedule {name!r} does not take options {sorted(options)}: {e}") from e
