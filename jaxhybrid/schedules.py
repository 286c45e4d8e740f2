"""Pipeline schedules as data: per-tick, per-stage task tables (pure numpy).

The runtime executes a table tick by tick in lock step. In one tick every stage may run
one forward slot and then one backward slot (either may be idle); after the tick,
activations move one stage down and gradients one stage up (`ppermute`). So a
microbatch's forward at stage s must come in a later tick than at stage s-1, and its
backward at stage s in a later tick than at stage s+1; the last stage may run the
forward and the backward of a microbatch in the same tick.

Tables:
  gpipe : all forwards, then all backwards. In-flight microbatches (stashed residuals)
          per stage: M.
  1f1b  : one-forward-one-backward. Stage s runs F(m) at tick m+s and B(m) at tick
          m+2(S-1)-s, so a steady-state tick does one forward and one backward on every
          stage (no tick is held up by a lone backward elsewhere, as happens when F and B
          take alternate ticks in lock step). In flight per stage: 2(S-1-s)+1 <= 2S-1,
          independent of M.
Both have bubble (S-1)/(M+S-1) with any forward/backward cost ratio.

This module is shared by `jaxhybrid.pipeline` (which runs tables) and `jaxhybrid.plan`
(which predicts step times from them); it imports neither.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

IDLE = -1


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A task table. `fwd[t, s]` / `bwd[t, s]`: microbatch run forward / backward by stage
    s in tick t, or -1 when that slot is idle."""
    name: str
    num_stages: int
    num_microbatches: int
    fwd: np.ndarray
    bwd: np.ndarray

    @property
    def num_ticks(self) -> int:
        return int(self.fwd.shape[0])

    # --- derived quantities --------------------------------------------------------
    def tick_times(self, fwd_cost: Sequence[float] | float = 1.0,
                   bwd_cost: Sequence[float] | float = 2.0) -> np.ndarray:
        """Duration of each lock-step tick: the slowest stage's work in that tick."""
        f = np.broadcast_to(np.asarray(fwd_cost, float), (self.num_stages,))
        b = np.broadcast_to(np.asarray(bwd_cost, float), (self.num_stages,))
        work = (self.fwd >= 0) * f[None, :] + (self.bwd >= 0) * b[None, :]
        return work.max(axis=1)

    def bubble_fraction(self, fwd_cost: Sequence[float] | float = 1.0,
                        bwd_cost: Sequence[float] | float = 2.0) -> float:
        """Fraction of device time spent idle when the table runs in lock step with the
        given per-stage forward / backward costs (per microbatch)."""
        f = np.broadcast_to(np.asarray(fwd_cost, float), (self.num_stages,))
        b = np.broadcast_to(np.asarray(bwd_cost, float), (self.num_stages,))
        busy = self.num_microbatches * (f + b).sum()
        total = self.tick_times(f, b).sum() * self.num_stages
        return float(1.0 - busy / total)

    def in_flight(self) -> np.ndarray:
        """Per stage, the most microbatches whose forward ran and backward has not
        (= residual stash slots the stage needs)."""
        out = np.zeros(self.num_stages, int)
        for s in range(self.num_stages):
            live = 0
            for t in range(self.num_ticks):
                live += self.fwd[t, s] >= 0
                out[s] = max(out[s], live)
                live -= self.bwd[t, s] >= 0
        return out

    def slots(self, kind: str) -> int:
        """Smallest K such that storing microbatch m in slot m % K never overwrites a live
        entry. kind: "stash" (residuals, F -> B on one stage), "act" (activation received
        from stage s-1 -> F), "grad" (gradient received from stage s+1 -> B)."""
        S, M = self.num_stages, self.num_microbatches
        f_tick = np.full((S, M), -1)
        b_tick = np.full((S, M), -1)
        for t in range(self.num_ticks):
            for s in range(S):
                if self.fwd[t, s] >= 0:
                    f_tick[s, self.fwd[t, s]] = t
                if self.bwd[t, s] >= 0:
                    b_tick[s, self.bwd[t, s]] = t
        intervals = []  # (stage, microbatch, written at tick, last read at tick)
        for s in range(S):
            for m in range(M):
                if kind == "stash":
                    intervals.append((s, m, f_tick[s, m], b_tick[s, m]))
                elif kind == "act" and s > 0:
                    intervals.append((s, m, f_tick[s - 1, m] + 1, f_tick[s, m]))
                elif kind == "grad" and s < S - 1:
                    intervals.append((s, m, b_tick[s + 1, m] + 1, b_tick[s, m]))
        for k in range(1, M + 1):
            ok = True
            for s in range(S):
                mine = [iv for iv in intervals if iv[0] == s]
                for i, (_, m1, w1, r1) in enumerate(mine):
                    for _, m2, w2, r2 in mine[i + 1:]:
                        if m1 % k == m2 % k and not (r1 < w2 or r2 < w1):
                            ok = False
                            break
                    if not ok:
                        break
                if not ok:
                    break
            if ok:
                return k
        return M

    def validate(self) -> None:
        """Raises ValueError unless every (stage, microbatch) runs forward and backward
        exactly once, in an order the lock-step data movement allows."""
        S, M, T = self.num_stages, self.num_microbatches, self.num_ticks
        if self.fwd.shape != (T, S) or self.bwd.shape != (T, S):
            raise ValueError(f"schedule {self.name}: tables must both be [ticks, {S}]")
        f_tick = np.full((S, M), -1)
        b_tick = np.full((S, M), -1)
        for table, ticks, what in ((self.fwd, f_tick, "forward"), (self.bwd, b_tick, "backward")):
            for t in range(T):
                for s in range(S):
                    m = table[t, s]
                    if m < 0:
                        continue
                    if m >= M or ticks[s, m] >= 0:
                        raise ValueError(f"schedule {self.name}: {what} of microbatch {m} "
                                         f"on stage {s} is out of range or repeated")
                    ticks[s, m] = t
        if (f_tick < 0).any() or (b_tick < 0).any():
            raise ValueError(f"schedule {self.name}: some forward/backward never runs")
        for s in range(S):
            for m in range(M):
                if s > 0 and f_tick[s, m] <= f_tick[s - 1, m]:
                    raise ValueError(f"schedule {self.name}: F{m} on stage {s} before its input arrives")
                if s < S - 1 and b_tick[s, m] <= b_tick[s + 1, m]:
                    raise ValueError(f"schedule {self.name}: B{m} on stage {s} before its gradient arrives")
                if b_tick[s, m] < f_tick[s, m]:
                    raise ValueError(f"schedule {self.name}: B{m} on stage {s} before its forward")

    def chart(self) -> str:
        """A text Gantt chart: one row per stage, one column per tick; `F3` = forward of
        microbatch 3, `B3` backward, `F3B0` both in one tick, `.` idle."""
        cells = [[("" if self.fwd[t, s] < 0 else f"F{self.fwd[t, s]}") +
                  ("" if self.bwd[t, s] < 0 else f"B{self.bwd[t, s]}") or "."
                  for t in range(self.num_ticks)] for s in range(self.num_stages)]
        width = max(len(c) for row in cells for c in row)
        lines = [f"{self.name}: S={self.num_stages} M={self.num_microbatches} "
                 f"ticks={self.num_ticks} bubble={self.bubble_fraction():.3f}"]
        for s, row in enumerate(cells):
            lines.append(f"stage {s}: " + " ".join(c.ljust(width) for c in row))
        return "\n".join(lines)

    def plot(self, path: str, fwd_cost=1.0, bwd_cost=2.0, title: str | None = None) -> None:
        """PNG Gantt chart with tick widths from the given costs."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        f = np.broadcast_to(np.asarray(fwd_cost, float), (self.num_stages,))
        b = np.broadcast_to(np.asarray(bwd_cost, float), (self.num_stages,))
        starts = np.concatenate([[0.0], np.cumsum(self.tick_times(f, b))])
        fig, ax = plt.subplots(figsize=(max(6, self.num_ticks * 0.35), 0.5 * self.num_stages + 1.2))
        for t in range(self.num_ticks):
            for s in range(self.num_stages):
                x = starts[t]
                if self.fwd[t, s] >= 0:
                    ax.barh(s, f[s], left=x, color="tab:blue", edgecolor="k")
                    ax.text(x + f[s] / 2, s, str(self.fwd[t, s]), ha="center", va="center", fontsize=7, color="w")
                    x += f[s]
                if self.bwd[t, s] >= 0:
                    ax.barh(s, b[s], left=x, color="tab:orange", edgecolor="k")
                    ax.text(x + b[s] / 2, s, str(self.bwd[t, s]), ha="center", va="center", fontsize=7)
        ax.set_yticks(range(self.num_stages), [f"stage {s}" for s in range(self.num_stages)])
        ax.invert_yaxis()
        ax.set_xlabel("time (forward = blue, backward = orange)")
        ax.set_title(title or f"{self.name}  S={self.num_stages} M={self.num_microbatches}  "
                              f"bubble={self.bubble_fraction(f, b):.3f}")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _gpipe(S: int, M: int):
    T = 2 * (M + S - 1) - 1
    fwd = np.full((T, S), IDLE)
    bwd = np.full((T, S), IDLE)
    for s in range(S):
        for m in range(M):
            fwd[m + s, s] = m
            # The last stage starts backwards in the tick of its last forward.
            bwd[(M + S - 2) + m + (S - 1 - s), s] = m
    return fwd, bwd


def _one_f_one_b(S: int, M: int):
    T = M + 2 * (S - 1)
    fwd = np.full((T, S), IDLE)
    bwd = np.full((T, S), IDLE)
    for s in range(S):
        for m in range(M):
            fwd[m + s, s] = m
            bwd[m + 2 * (S - 1) - s, s] = m
    return fwd, bwd


_BUILDERS = {"gpipe": _gpipe, "1f1b": _one_f_one_b}
SCHEDULE_NAMES = tuple(_BUILDERS)


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The task table of a named schedule ("gpipe" | "1f1b")."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}.")
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"schedule needs num_stages >= 1 and num_microbatches >= 1, got "
                         f"{num_stages}, {num_microbatches}.")
    fwd, bwd = _BUILDERS[name](num_stages, num_microbatches)
    # Drop trailing all-idle ticks.
    busy = np.nonzero(((fwd >= 0) | (bwd >= 0)).any(axis=1))[0]
    fwd, bwd = fwd[: busy[-1] + 1], bwd[: busy[-1] + 1]
    sched = Schedule(name, num_stages, num_microbatches, fwd, bwd)
    sched.validate()
    return sched
