"""The schedule IR: typed tasks, the stage -> device map, and what follows from them
(bubble, memory, ring buffers, validation, charts). See `jaxhybrid.schedules`."""
from __future__ import annotations

import dataclasses
import enum
import functools

import numpy as np

from jaxhybrid.checks import is_int

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


def _broadcast(cost, n: int, what: str) -> np.ndarray:
    """A per-stage cost: a scalar or one per stage, finite and >= 0 (a negative one made
    `bubble_fraction` a number in (0, 1) that meant nothing)."""
    c = np.asarray(cost, float)
    if c.ndim > 1 or c.size not in (1, n) or not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError(f"{what}={cost!r} must be a finite cost >= 0, a scalar or one "
                         f"per stage ({n} stages).")
    return np.broadcast_to(c.reshape(-1) if c.ndim else c, (n,)).copy()


# Which weights a task sees (`Schedule.weights`): one version per step, or an
# asynchronous policy (`jaxhybrid.schedules.asynchronous`, `pipeline/async_weights.py`).
WEIGHT_POLICIES = ("sync", "newest", "stash", "two-buffer", "predict-v1", "predict-v2")


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
    # Which weights each task sees: "sync" (one version per step), or an asynchronous
    # policy of `jaxhybrid.schedules.asynchronous` (U tasks then name the last microbatch
    # of the gradient window they apply).
    weights: str = "sync"

    def __post_init__(self):
        # Lists work as well (a user's table): tuples keep the schedule hashable, which
        # the pipeline's caches need ("unhashable type: 'list'" deep inside otherwise).
        for field in ("stage_device", "tasks"):
            if isinstance(getattr(self, field), list):
                object.__setattr__(self, field, tuple(getattr(self, field)))

    @property
    def num_stages(self) -> int:
        return len(self.stage_device)

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.num_devices

    @property
    def takes_virtual_stages(self) -> bool:
        """Whether its builder takes `virtual_stages` (interleaved), so that fewer stages
        per device is a fix to offer; zbv always runs two."""
        return "virtual_stages" in dict(self.options)

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
    def task_costs(self, fwd_cost=1.0, bwd_cost=2.0, weight_cost=None, update_cost=0.0) -> dict:
        """{kind: per-stage cost}. bwd_cost is the full backward; a split schedule's B and
        W cost bwd_cost - weight_cost and weight_cost (default: half each)."""
        K = self.num_stages
        f, b = _broadcast(fwd_cost, K, "fwd_cost"), _broadcast(bwd_cost, K, "bwd_cost")
        w = b / 2 if weight_cost is None else _broadcast(weight_cost, K, "weight_cost")
        if self.split_backward and np.any(w > b):   # B would cost bwd - weight < 0
            raise ValueError(f"weight_cost={weight_cost!r} exceeds bwd_cost={bwd_cost!r}: "
                             f"bwd_cost is the full backward, B + W; give weight_cost <= it.")
        return {TaskType.F: f, TaskType.B: b - w if self.split_backward else b,
                TaskType.W: w, TaskType.U: _broadcast(update_cost, K, "update_cost")}

    def work(self, fwd_cost=1.0, bwd_cost=2.0, weight_cost=None, update_cost=0.0) -> np.ndarray:
        """[ticks, devices] busy time of each device in each tick, from per-stage costs
        (scalars or one per stage). bwd_cost is the full backward; a split schedule's B
        and W cost bwd_cost - weight_cost and weight_cost (default: half each)."""
        cost = self.task_costs(fwd_cost, bwd_cost, weight_cost, update_cost)
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
        span = work.max(axis=1).sum()
        if span == 0:   # 0 / 0: nan, with a RuntimeWarning
            raise ValueError("bubble_fraction: every task costs 0; give some cost > 0.")
        return float(1.0 - work.sum() / (span * self.num_devices))

    def _peak_live(self, by: str) -> np.ndarray:
        """Most microbatches with stashed residuals at once, per device or per stage:
        from F until the last backward (W when split), freed after the tick reading it."""
        free = TaskType.W if self.split_backward else TaskType.B
        n = self.num_devices if by == "device" else self.num_stages
        delta = np.zeros((self.num_ticks + 1, n), int)
        for t in self.tasks:
            i = t.device if by == "device" else t.stage
            if t.kind == TaskType.F:
                delta[t.tick, i] += 1
            elif t.kind == free:
                delta[t.tick + 1, i] -= 1
        return np.cumsum(delta, axis=0).max(axis=0)

    def in_flight(self) -> np.ndarray:
        """Per device, the most microbatch-stages whose residuals it holds at once."""
        return self._peak_live("device")

    def stage_in_flight(self) -> np.ndarray:
        """Per stage, the most microbatches whose residuals it holds at once."""
        return self._peak_live("stage")

    def forward_order_break(self, stages=None) -> tuple | None:
        """(stage, microbatch) of the first forward (of `stages`, default all) that runs
        before the forward of the microbatch before it on the same stage, or None. Such
        a stage updates mutable state (batch statistics) out of microbatch order: other
        numbers than the reference's (the pipeline refuses it for a stage with state)."""
        when = {(t.stage, t.microbatch): t.tick for t in self.tasks if t.kind == TaskType.F}
        return next(((k, m) for k in (range(self.num_stages) if stages is None else stages)
                     for m in range(1, self.num_microbatches)
                     if when[(k, m)] < when[(k, m - 1)]), None)

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
            if kind == TaskType.B and k < K - 1:   # gradient from k+1, read by B only (what
                # W needs of it, B hands over with its cotangents: the cross ring)
                grad.append((dev[k], (k, m), when[(TaskType.B, k + 1, m)], t))
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
        a stage's F; grad: gradients received for its B (only B reads them); stash:
        residuals from F to the last backward; cross: what a split B hands to W."""
        return self._rings

    def validate(self) -> None:
        """Raises ValueError unless every (stage, microbatch) runs F and B (and W when
        split) exactly once on its stage's device, at most one task per kind per device
        and tick, in an order the lock-step data movement allows."""
        K, M, D = self.num_stages, self.num_microbatches, self.num_devices
        err = lambda msg: ValueError(f"schedule {self.name}: {msg}")
        self._validate_fields(err)
        if self.weights not in WEIGHT_POLICIES:   # else the engine ran it as naive async
            raise err(f"weights={self.weights!r} must be one of {', '.join(WEIGHT_POLICIES)}")
        if self.weights != "sync" and (self.split_backward or K != D):
            raise err(f"weights={self.weights!r} needs one stage per device and whole "
                      f"backwards (build it with jaxhybrid.schedules.asynchronous)")
        if K < D or K % D or sorted(np.bincount(self.stage_device, minlength=D)) != [K // D] * D:
            raise err(f"stage_device {self.stage_device} must give each of {D} devices "
                      f"the same number of stages")
        when: dict = {}
        slots = set()
        for t in self.tasks:
            if not 0 <= t.stage < K:
                raise err(f"{t.kind.name}{t.microbatch} names stage {t.stage}; stages are "
                          f"0..{K - 1} (one per entry of stage_device)")
            if t.device != self.stage_device[t.stage]:
                raise err(f"{t} runs on device {t.device}, its stage lives on "
                          f"{self.stage_device[t.stage]}; put it on that device or change "
                          f"stage_device")
            if (t.tick, t.device, t.kind) in slots:
                raise err(f"two {t.kind.name} tasks on device {t.device} in tick {t.tick}")
            slots.add((t.tick, t.device, t.kind))
            key = (t.kind, t.stage, t.microbatch)
            if t.kind != TaskType.U and not 0 <= t.microbatch < M:
                raise err(f"{t} names microbatch {t.microbatch}; the schedule has "
                          f"num_microbatches={M} (0..{M - 1})")
            if key in when:
                raise err(f"{t} is repeated (ticks {when[key]} and {t.tick}); keep one")
            when[key] = t.tick
        kinds = (TaskType.F,) if self.forward_only else \
            (TaskType.F, TaskType.B) + ((TaskType.W,) if self.split_backward else ())
        if not self.split_backward and any(k == TaskType.W for k, _, _ in when):
            raise err("W tasks need split_backward=True")
        if self.forward_only and any(k != TaskType.F for k, _, _ in when):
            raise err("a forward_only schedule runs F tasks only; drop its B / W / U "
                      "tasks or set forward_only=False")
        self._validate_updates(err)
        updates_on = np.bincount([t.device for t in self.tasks if t.kind == TaskType.U],
                                 minlength=D)
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
                # A step's U waits for every backward; an asynchronous U for those of
                # its gradient window (a later one's gradient was never applied).
                window = M // updates_on[d]
                upto = range(M) if m == IDLE else range(m - window + 1, m + 1)
                if any(when[(last, j, i)] > t for j in mine for i in upto):
                    raise err(f"U of device {d} at tick {t} before a backward of its gradient "
                              f"window (microbatches {upto.start}..{upto.stop - 1})")

    def _validate_fields(self, err) -> None:
        """Types and ranges of the fields (a negative or fractional tick indexed the
        runtime's table from its end, silently)."""
        D, M = self.num_devices, self.num_microbatches
        if not is_int(D) or D < 1 or not is_int(M) or M < 1:
            raise err(f"num_devices={D!r} and num_microbatches={M!r} must be ints >= 1")
        if not all(is_int(d) and 0 <= d < D for d in self.stage_device):
            raise err(f"stage_device {tuple(self.stage_device)} must hold device indices "
                      f"0..{D - 1}")
        if not self.tasks:
            raise err("has no tasks")
        for t in self.tasks:
            if not isinstance(t, Task) or not isinstance(t.kind, TaskType):
                raise err(f"task {t!r} must be a Task(tick, device, TaskType, stage, "
                          f"microbatch)")
            if not all(is_int(x) for x in (t.tick, t.device, t.stage, t.microbatch)) or \
                    t.tick < 0 or not 0 <= t.device < D:
                raise err(f"{t!r}: tick, device, stage and microbatch must be ints, with "
                          f"tick >= 0 and device in 0..{D - 1}")

    def _validate_updates(self, err) -> None:
        """A synchronous schedule's U tasks: none (`with_updates` adds them), or one per
        device naming no microbatch (the step's update waits for every backward; with U
        on some devices only, the others silently kept their old parameters). An
        asynchronous one's: the same gradient windows on every device, the last closed
        by microbatch M-1 (else a device skipped updates, or the tail's gradient was
        never applied, silently)."""
        updates = [t for t in self.tasks if t.kind == TaskType.U]
        if self.weights != "sync":
            ends = [sorted(t.microbatch for t in updates if t.device == d)
                    for d in range(self.num_devices)]
            last = self.num_microbatches - 1
            bad = next((d for d, e in enumerate(ends)
                        if e != ends[0] or not e or e[-1] != last), None)
            show = lambda e: f"{e[:8]}"[:-1] + (", ...]" if len(e) > 8 else "]")
            if bad is not None:
                raise err(f"weights={self.weights!r}: every device needs U tasks closing the "
                          f"same gradient windows, the last at microbatch {last} (device "
                          f"{bad}'s close {show(ends[bad])}, device 0's {show(ends[0])})")
            # The engine scales every window's gradient sum by (updates / M): windows of
            # unequal sizes got other than their mean gradient, silently.
            n, w = len(ends[0]), self.num_microbatches // len(ends[0])
            if self.num_microbatches % n or ends[0] != list(range(w - 1, last + 1, w)):
                raise err(f"weights={self.weights!r}: the U tasks must close gradient windows "
                          f"of one size, num_microbatches / updates (their ends {show(ends[0])}; "
                          f"{n} updates of {self.num_microbatches} microbatches)")
            return
        if not updates:
            return
        if any(t.microbatch != IDLE for t in updates):
            raise err(f"a synchronous schedule's U tasks update once per step after every "
                      f"backward: give them microbatch={IDLE} (IDLE), or leave U out and "
                      f"let Schedule.with_updates place them")
        missing = sorted(set(range(self.num_devices)) - {t.device for t in updates})
        if missing or len(updates) != self.num_devices:
            raise err(f"a synchronous schedule needs one U task per device or none "
                      f"(devices without one: {missing}; with_updates places them)")

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
        from jaxhybrid.schedules import gantt
        gantt.draw(path, self.gantt_bars(fwd_cost, bwd_cost, weight_cost), self.num_devices,
                   width=min(40, max(6, self.num_ticks * 0.3)),
                   xlabel="time (F blue, B orange, W green, U gray; later virtual stages lighter)",
                   title=title or f"{self.name}  S={self.num_devices} v={self.virtual_stages} "
                                  f"M={self.num_microbatches}  bubble="
                                  f"{self.bubble_fraction(fwd_cost, bwd_cost, weight_cost):.3f}")

    def gantt_bars(self, fwd_cost=1.0, bwd_cost=2.0, weight_cost=None) -> list:
        """`plot`'s bars: a device's tasks of one tick side by side; a tick as wide as its
        busiest device's drawn tasks, U (drawn thin, a tenth of a mean F) included, so no
        bar reaches into the next tick."""
        from jaxhybrid.schedules import gantt
        update_cost = 0.1 * float(np.mean(fwd_cost))
        cost = self.task_costs(fwd_cost, bwd_cost, weight_cost, update_cost)
        color = {TaskType.F: "tab:blue", TaskType.B: "tab:orange", TaskType.W: "tab:green",
                 TaskType.U: "tab:gray"}
        drawn = self.work(fwd_cost, bwd_cost, weight_cost, update_cost)
        starts = np.concatenate([[0.0], np.cumsum(drawn.max(axis=1))])
        offset = np.zeros((self.num_ticks, self.num_devices))
        bars = []
        for t in sorted(self.tasks, key=lambda t: (t.tick, t.device, t.kind)):
            c = cost[t.kind][t.stage]
            bars.append(gantt.Bar(starts[t.tick] + offset[t.tick, t.device], c, t.device,
                                  color[t.kind], label="" if t.kind == TaskType.U
                                  else str(t.microbatch),
                                  alpha=1.0 if t.stage < self.num_devices else 0.65))
            offset[t.tick, t.device] += c
        return bars


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
