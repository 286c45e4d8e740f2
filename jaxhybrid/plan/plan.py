"""The Plan object: what the pipeline runs (made by `jaxhybrid.plan.planner.make_plan`),
its predicted step, summary, JSON form and charts.

Times in a Plan are seconds per microbatch, except `stage_allreduce_time` (per step).
Predicted step time = the schedule's lock-step ticks (`plan.step_model`, the engine's
model that the projection uses too): per tick the slowest slot, the boundary transfers
(every device sends an activation and a gradient padded to the largest boundary, the
slowest link setting the pace) and the engine's per-tick costs, plus the slowest stage's
gradient all-reduce after the last backward (stages all-reduce concurrently over
disjoint replica groups). `stage_transfer_time` is what the partition balances.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

from jaxhybrid.boundaries import stage_ranges
from jaxhybrid.plan.step_model import StepTime, lockstep_time
from jaxhybrid.plan.topology import fmt_bytes
from jaxhybrid.schedules import SCHEDULES, Schedule, Task, TaskType, make_schedule


@dataclasses.dataclass
class Plan:
    num_layers: int
    boundaries: list[int]
    num_stages: int
    num_microbatches: int
    schedule: str
    data: int
    device_order: list[int] | None
    remat: list[bool]
    stage_compute_time: list[float]      # fwd + bwd (+ recompute) per microbatch
    stage_transfer_time: list[float]     # outgoing activation + its gradient, per microbatch
    stage_allreduce_time: list[float]    # gradient all-reduce over `data`, per step
    stage_memory: list[float]            # bytes per device if every stage were this one
    layer_names: list[str]
    memory_budget: float | None = None
    objective: str = "bottleneck"
    stage_fwd_time: list[float] | None = None   # split of stage_compute_time (recompute
    stage_bwd_time: list[float] | None = None   # counts in the backward)
    microbatch_size: int | None = None
    topology: str | None = None
    device_memory: float | None = None          # bytes every device allocates (`spmd_memory`)
    virtual_stages: int = 1                     # stages per device (num_stages = devices x v)
    schedule_options: dict | None = None        # the schedule builder's options
    # The task table itself (a user's Schedule has no builder to rebuild it from its
    # name: `schedule_table` raised "unknown schedule"); `to_json` writes it when the
    # registered builder would not rebuild it (a user's table under a registered name
    # came back as that builder's table, silently).
    table: Any = dataclasses.field(default=None, repr=False, compare=False)
    # The engine's costs on the hardware planned for (`make_plan(hardware=...)`, e.g. the
    # stored calibration of this device kind): seconds per device per tick, and how many
    # devices compute at once (None: all).
    tick_overhead: float = 0.0
    compute_slots: float | None = None
    tick_latency: float = 0.0                   # seconds per tick, waiting (not work)
    transfer_per_tick: float = 0.0              # the tick's boundary transfers (topology)
    task_overhead: float = 0.0                  # engine work per F/B/W task
    weight_task_overhead: float = 0.0           # more per W task
    collective_overhead: float = 0.0            # engine work per device per collective
    launch_overhead: float = 0.0                # engine work per device per step
    # CPU seconds of stage_fwd_time / stage_bwd_time (x the cores each layer kept busy,
    # `LayerCost.fwd_threads`): how devices sharing a host's cores share them (None: the
    # times themselves).
    stage_fwd_cpu: list[float] | None = None
    stage_bwd_cpu: list[float] | None = None
    # Per stage, recomputed whole from its input (the runtime's stage-level remat="full":
    # its layers' remat entries are True too; None: no stage).
    whole_stage_remat: list[bool] | None = None
    # Per stage, the jax.checkpoint_policies name it runs under (None: none). Held so that
    # `Pipeline(plan=...)` runs it again (the policy was dropped, silently).
    stage_policy: list | None = None
    # Per stage, the residuals (bytes by dtype) it keeps under its policy, as traced
    # (`pipeline.policy_costs`): its memory is priced from them (None: not priced, as
    # not recomputed).
    stage_policy_kept: list | None = None
    # Per stage, the share of its forward its backward runs again under its policy, as
    # traced (`pipeline.policy_costs`), in its stage_bwd_time (None: priced as none).
    stage_policy_recompute: list | None = None

    def __post_init__(self):
        S = self.num_stages
        if len(self.boundaries) != S - 1:
            raise ValueError(f"Plan: {len(self.boundaries)} boundaries for {S} stages (need {S - 1}).")
        if len(self.remat) != self.num_layers or len(self.layer_names) != self.num_layers:
            raise ValueError(f"Plan: remat and layer_names need {self.num_layers} entries.")
        for f in ("stage_compute_time", "stage_transfer_time", "stage_allreduce_time", "stage_memory"):
            if len(getattr(self, f)) != S:
                raise ValueError(f"Plan: {f} needs {S} entries, got {len(getattr(self, f))}.")
        stage_ranges(self.boundaries, self.num_layers)   # increasing, inside the layers
        if self.device_order is not None:   # e.g. a hand-edited JSON plan
            k = self.num_stages // max(self.virtual_stages, 1) * self.data
            if len(self.device_order) != k or len(set(self.device_order)) != k:
                raise ValueError(f"Plan: device_order {self.device_order} must list {k} distinct "
                                 f"devices (data x pipeline devices).")
        if (self.stage_fwd_time is None) != (self.stage_bwd_time is None):
            raise ValueError("Plan: stage_fwd_time and stage_bwd_time come together (the "
                             "split of stage_compute_time); give both or neither.")
        if self.stage_fwd_time is None:   # no split given: assume backward = 2 x forward
            self.stage_fwd_time = [c / 3 for c in self.stage_compute_time]
            self.stage_bwd_time = [2 * c / 3 for c in self.stage_compute_time]
        for f in ("stage_fwd_time", "stage_bwd_time", "stage_fwd_cpu", "stage_bwd_cpu",
                  "whole_stage_remat", "stage_policy", "stage_policy_kept",
                  "stage_policy_recompute"):
            if getattr(self, f) is not None and len(getattr(self, f)) != S:
                raise ValueError(f"Plan: {f} needs {S} entries, got {len(getattr(self, f))}.")

    # --- derived ----------------------------------------------------------------------
    @property
    def stage_ranges(self) -> list[tuple[int, int]]:
        return stage_ranges(self.boundaries, self.num_layers)

    @property
    def pipeline_remat(self) -> list:
        """The plan's recomputation as `Pipeline(remat=...)` takes it: one bool per layer,
        or, with stages recomputed whole (`whole_stage_remat`) or under a policy
        (`stage_policy`), per stage "full", the policy's name or that stage's bools."""
        whole = self.whole_stage_remat or [False] * self.num_stages
        policy = self.stage_policy or [None] * self.num_stages
        if not any(whole) and not any(policy):
            return [bool(r) for r in self.remat]
        return ["full" if w else p if p else [bool(r) for r in self.remat[a:b]]
                for (a, b), w, p in zip(self.stage_ranges, whole, policy)]

    @property
    def stage_time(self) -> np.ndarray:
        """Per-microbatch cost of each stage (compute + transfer + all-reduce / M)."""
        return (np.array(self.stage_compute_time) + np.array(self.stage_transfer_time)
                + np.array(self.stage_allreduce_time) / self.num_microbatches)

    @property
    def bottleneck_time(self) -> float:
        return float(self.stage_time.max())

    def _tick_costs(self):
        return np.array(self.stage_fwd_time), np.array(self.stage_bwd_time)

    def schedule_table(self):
        if self.table is not None:
            return self.table
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Plan: schedule {self.schedule!r} is a user's Schedule, which "
                             f"this plan does not hold (a JSON of an older version); set "
                             f"plan.table = that Schedule.")
        return self._registered_table()

    def _registered_table(self):
        """What the builder registered under the schedule's name makes for this plan."""
        table = make_schedule(self.schedule, self.num_stages // self.virtual_stages,
                              self.num_microbatches, **(self.schedule_options or {}))
        if table.num_stages != self.num_stages:   # e.g. a JSON without its virtual_stages
            raise ValueError(f"Plan: schedule {self.schedule!r} with virtual_stages="
                             f"{self.virtual_stages} has {table.num_stages} stages, the plan "
                             f"{self.num_stages}; set the plan's virtual_stages to "
                             f"{table.virtual_stages}.")
        return table

    @property
    def predicted_step(self) -> StepTime:
        """`predicted_step_time` by part (`plan.step_model.StepTime`: the ticks' layer
        work, what the engine's costs add, the transfers, the all-reduce)."""
        f, b = self._tick_costs()
        cpu = None
        if self.stage_fwd_cpu is not None and self.stage_bwd_cpu is not None:
            cpu = (np.array(self.stage_fwd_cpu), np.array(self.stage_bwd_cpu))
        return lockstep_time(self.schedule_table(), f, b, data=self.data, cpu_cost=cpu,
                             compute_slots=self.compute_slots or math.inf,
                             tick_overhead=self.tick_overhead, tick_latency=self.tick_latency,
                             task_overhead=self.task_overhead,
                             weight_task_overhead=self.weight_task_overhead,
                             collective_overhead=self.collective_overhead,
                             launch_overhead=self.launch_overhead,
                             transfer_per_tick=self.transfer_per_tick,
                             allreduce=max(self.stage_allreduce_time, default=0.0))

    @property
    def predicted_step_time(self) -> float:
        """The schedule's lock-step ticks (`plan.step_model`, the model the projection
        uses too) with the tick's boundary transfers, the engine's per-tick costs and
        shared compute slots of the hardware planned for, plus the slowest stage's
        all-reduce."""
        return self.predicted_step.total

    @property
    def bubble_fraction(self) -> float:
        f, b = self._tick_costs()
        if (f + b).sum() == 0:
            return 0.0
        return self.schedule_table().bubble_fraction(f, b)

    # --- output -----------------------------------------------------------------------
    def summary(self) -> str:
        S, M = self.num_stages, self.num_microbatches
        lines = [f"Plan: {self.num_layers} layers -> {S} stages x data {self.data}, schedule "
                 f"{self.schedule}, {M} microbatches"
                 + (f" of {self.microbatch_size}" if self.microbatch_size else "")
                 + f", objective {self.objective}",
                 f"  topology: {self.topology or 'none (no link costs)'}; memory budget: "
                 f"{fmt_bytes(self.memory_budget) if self.memory_budget else 'none'}"
                 + (f"; device memory {fmt_bytes(self.device_memory)} (each device's "
                    f"buffers sized for the largest stage's rows: at least the memory column)"
                    if self.device_memory is not None else "")]
        head = (f"{'stage':>5} {'layers':>9} {'first .. last':<28} {'fwd ms':>8} {'bwd ms':>8} "
                f"{'xfer ms':>8} {'allred ms':>9} {'memory':>8} {'remat':>5}  devices")
        lines += [head, "-" * len(head)]
        # device_order lists the pipeline's devices (row-major over replica, device); a
        # stage's device is the schedule's (virtual stages: several stages per device).
        D = S // max(self.virtual_stages, 1)
        where = self.schedule_table().stage_device if self.device_order is not None else None
        for s, (a, b) in enumerate(self.stage_ranges):
            names = self.layer_names[a] if b - a == 1 else f"{self.layer_names[a]} .. {self.layer_names[b - 1]}"
            devs = ("-" if self.device_order is None else
                    ",".join(str(self.device_order[r * D + int(where[s])]) for r in range(self.data)))
            lines.append(
                f"{s:>5} {f'{a}-{b - 1}':>9} {names[:28]:<28} {1e3 * self.stage_fwd_time[s]:>8.3f} "
                f"{1e3 * self.stage_bwd_time[s]:>8.3f} {1e3 * self.stage_transfer_time[s]:>8.3f} "
                f"{1e3 * self.stage_allreduce_time[s]:>9.3f} {fmt_bytes(self.stage_memory[s]):>8} "
                f"{self._stage_remat_column(s, a, b):>5}"
                f"  {devs}")
        lines += [self._policy_line(s, name) for s, name in enumerate(self.stage_policy or ())
                  if name]
        lines.append(f"bottleneck {1e3 * self.bottleneck_time:.3f} ms/microbatch; predicted step "
                     f"{1e3 * self.predicted_step_time:.3f} ms; bubble {self.bubble_fraction:.3f}; "
                     f"boundaries {self.boundaries}")
        return "\n".join(lines)

    def _policy_line(self, s: int, name: str) -> str:
        """The summary's line on stage `s` run under the jax.checkpoint policy `name`."""
        kept = (self.stage_policy_kept or [None] * self.num_stages)[s]
        again = (self.stage_policy_recompute or [None] * self.num_stages)[s]
        memory = ("memory priced as no recompute" if kept is None else
                  f"memory priced with the {fmt_bytes(sum(kept.values()))} of residuals it keeps")
        time = ("time as no recompute" if again is None else
                f"its backward runs {100 * again:.0f}% of its forward again")
        return f"  stage {s} runs under jax.checkpoint policy {name!r}: {memory}, {time}"

    def _stage_remat_column(self, s: int, a: int, b: int) -> str:
        """The summary's remat column: "whole", "pol" (a checkpoint policy, named below)
        or the number of layers recomputed."""
        if (self.whole_stage_remat or [False] * self.num_stages)[s]:
            return "whole"
        if (self.stage_policy or [None] * self.num_stages)[s]:
            return "pol"
        return str(sum(self.remat[a:b]))

    def __str__(self) -> str:
        return self.summary()

    def to_json(self) -> str:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "table"}
        if self.table is not None and (self.schedule not in SCHEDULES
                                       or self.table != self._registered_table()):
            t = self.table
            d["table"] = dict(dataclasses.asdict(t), tasks=[
                (x.tick, x.device, int(x.kind), x.stage, x.microbatch) for x in t.tasks])
        return json.dumps(d)

    @classmethod
    def from_json(cls, s: str) -> "Plan":
        d = json.loads(s)
        d.pop("memory_model", None)   # older plans named their memory model (now one model)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"Plan.from_json: unknown fields {sorted(unknown)}.")
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in d
                         and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:   # was a TypeError from __init__
            raise ValueError(f"Plan.from_json: missing fields {missing}; is this a plan's "
                             f"to_json()?")
        if d.get("table") is not None:
            t = d["table"]
            d["table"] = Schedule(**{**t, "stage_device": tuple(t["stage_device"]),
                                     "options": tuple(map(tuple, t["options"])),
                                     "tasks": tuple(Task(a, b, TaskType(k), c, m)
                                                    for a, b, k, c, m in t["tasks"])})
        plan = cls(**d)
        if plan.table is None and plan.schedule in SCHEDULES:
            plan._registered_table()   # its stages agree with the plan's (virtual_stages)
        return plan

    def plot(self, path: str) -> list[str]:
        """PNGs: the schedule's Gantt chart with this plan's per-stage fwd/bwd times
        (drawn by `Schedule.plot`, the one plotter; the title adds what the predicted step
        prices beyond them) at `path` (".png" added when it has no suffix, as matplotlib
        would), and the per-stage memory against the budget at `<path stem>_memory.png`.
        Returns the two paths written."""
        import os

        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        check_chart_path(path, "Plan.plot")
        stem, suffix = os.path.splitext(path)
        # Named here, not left to matplotlib (which takes the suffix from rcParams and
        # so could write chart.svg), so that the paths returned are the files written.
        path = path if suffix else f"{path}.png"
        table = self.schedule_table()
        f, b = (1e3 * x for x in self._tick_costs())
        # The bars are each tick's layer work (a tick as long as its busiest device); the
        # step model adds terms per tick or per step (shared cores, the engine's costs,
        # transfers, the all-reduce) that belong to no task's bar. So the title gives the
        # bars' span and the step by part: with the step alone it read "step 27.7 ms"
        # over an axis ending at 6.9 ms (zbv).
        span, step = float(table.tick_times(f, b).sum()), self.predicted_step
        extra = [(1e3 * step.compute - span, "shared cores"), (1e3 * step.engine, "engine"),
                 (1e3 * step.transfer, "transfers"), (1e3 * step.allreduce, "all-reduce")]
        terms = [f"+ {v:.3g} {name}" for v, name in extra if v > 1e-9 * span]
        lines = [f"{self.schedule} S={self.num_stages} M={self.num_microbatches}, bubble "
                 f"{self.bubble_fraction:.2f}: bars = layer work, {span:.3g} ms",
                 f"predicted step {1e3 * step.total:.3g} ms = "
                 + ("bars" if terms else "the bars (no engine or transfer terms)")]
        for term in terms:   # wrapped: the chart may be 6 inches wide
            lines[-1:] = ([f"{lines[-1]} {term}"] if len(lines[-1]) + len(term) < 60
                          else [lines[-1], term])
        table.plot(path, f, b, title="\n".join(lines))
        S = self.num_stages
        fig, axm = plt.subplots(figsize=(5, 0.5 * S + 2))
        top = max([*self.stage_memory, self.memory_budget or 0, self.device_memory or 0])
        unit, scale = next(((u, f) for u, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3))
                            if top >= f), ("B", 1.0))
        mem = np.array(self.stage_memory) / scale
        axm.barh(range(S), mem, color=["tab:red" if self.memory_budget and m > self.memory_budget
                                       else "tab:green" for m in self.stage_memory])
        if self.device_memory is not None:
            axm.axvline(self.device_memory / scale, color="tab:purple", label="device (spmd)")
        if self.memory_budget:
            axm.axvline(self.memory_budget / scale, color="k", linestyle="--", label="budget")
        if self.memory_budget or self.device_memory is not None:
            axm.legend(loc="lower right", fontsize=7)
        axm.set_yticks(range(S), [f"stage {s}: {self._stage_remat_column(s, a, b)} remat"
                                  for s, (a, b) in enumerate(self.stage_ranges)])
        axm.invert_yaxis()
        axm.set_xlabel(f"memory per device ({unit})")
        fig.tight_layout()
        memory = f"{stem}_memory.png"
        fig.savefig(memory, dpi=100)
        plt.close(fig)
        return [path, memory]


def check_chart_path(path, what: str) -> None:
    """A ValueError where `path` (`Plan.plot`'s) is a folder rather than a file name:
    "outdir/" wrote the hidden outdir/.png.png and reported outdir/.png."""
    import os
    path = str(path)
    if os.path.isdir(path) or path.endswith(os.sep) or os.path.basename(
            os.path.splitext(path)[0]) in ("", "."):
        raise ValueError(f"{what}: {path!r} is a folder, or names a folder, not a file; give "
                         f"a file name in it, e.g. {os.path.join(path, 'plan.png')!r}.")


def png_path(path, what: str) -> str:
    """The PNG a chart flag (`what`: "--plot", "--out") writes, checked before any work:
    a .png suffix or none ('.png' is added: the path printed is the file written; "x.jpg"
    was taken by matplotlib as the format), a file name rather than a folder, in a folder
    that exists (each was found after the planning, or not at all)."""
    import os
    path = str(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{what}={path}: no folder {folder} (it does not exist); create it "
                         f"or pick another path.")
    suffix = os.path.splitext(path)[1]
    if suffix.lower() not in ("", ".png"):
        raise ValueError(f"{what}={path}: the charts are PNGs; give a path ending in .png (or "
                         f"no suffix: .png is added).")
    check_chart_path(path, what)
    return path if suffix else f"{path}.png"
