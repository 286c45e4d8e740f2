"""Greedy placement of per-device task orders on lock-step ticks."""
from __future__ import annotations

from typing import Callable, Sequence

from jaxhybrid.schedules.tasks import Schedule, Task, TaskType


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
