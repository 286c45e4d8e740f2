"""Burst parallelism planner (DeepPool, PAPERS.md §2): per-layer device counts under a
fixed global batch, and what a background job gains in the time left idle.

Pure numpy: nothing here runs JAX or imports `jaxhybrid.pipeline`.

Layer l runs on g_l in {1, 2, 4, ..., G} devices, each with B / g_l examples. The dynamic
program over layers in order (DeepPool's searchBestSplits) is

    t[l][g] = min over g' of t[l-1][g'] + transfer(l, g' -> g) + time(l, g) + sync(l, g)

with `time(l, g)` the layer's forward + backward at batch B / g on one device,
`transfer` the batch moved at a width change and `sync` the all-reduce of the layer's
gradient over its g devices (both modelled in `jaxhybrid.plan.burst_tables`, with the
small-batch model; every name there is importable from here), and the amplification
limit: a layer may run on g devices only if time(l, g) g / time(l, 1) <=
`amplification_limit` (default 2.0, as in the paper), unless it is fast (time(l, 1) <
`fast_layer_time`, 300 us).

Inception blocks: `branches={l: [[branch LayerCost per batch...]], ...}` lets layer l
run its parallel branches side by side on disjoint device groups (branch k on g_k
devices, sum g_k <= G), if the block's amplification stays within the limit.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Sequence

import numpy as np

from jaxhybrid.checks import is_int
from jaxhybrid.plan.burst_tables import (  # noqa: F401  (re-exported: the planner's API)
    DEFAULT_FAST_LAYER_TIME, KINDS, NO_SMALL_BATCH_LOSS, SMALL_BATCH_PRESETS, SmallBatchModel,
    _branch_options, _relayout_terms, _Tables, build_tables, cluster_topology, cost_fn,
    fit_small_batch, layer_kind, layer_times_at, outputs_per_example, widths_for)
from jaxhybrid.plan.topology import Topology


# --- the plan ------------------------------------------------------------------------------
@dataclasses.dataclass
class BurstPlan:
    """Per-layer widths and their predicted times (seconds, per iteration)."""
    widths: list
    layer_names: list
    fwd_time: list           # per layer on each of its devices
    bwd_time: list
    sync_time: list          # gradient all-reduce over its devices
    transfer_time: list      # batch moved into layer l (forward + backward)
    num_devices: int
    batch_size: int
    dp_time: float           # data parallelism over the widest width, same batch
    dp_width: int
    amplification_limit: float
    amplification: list      # g x time(l, g) / time(l, 1)
    # Layers whose branches run side by side: {l: [[offset, g, fwd, bwd, sync] per branch]};
    # their fwd/bwd/sync entries above are the critical (slowest) branch's.
    branch_groups: dict = dataclasses.field(default_factory=dict)

    @property
    def iteration_time(self) -> float:
        return float(sum(self.fwd_time) + sum(self.bwd_time) + sum(self.sync_time)
                     + sum(self.transfer_time))

    def busy_time(self, forward_only: bool = False) -> np.ndarray:
        """Seconds each device works per iteration (layers it runs, their all-reduce,
        transfers it takes part in); forward_only: its forward compute only."""
        busy = np.zeros(self.num_devices)
        prev = self.widths[0]
        for l, (g, f, b, s, x) in enumerate(zip(self.widths, self.fwd_time, self.bwd_time,
                                                self.sync_time, self.transfer_time)):
            groups = self.branch_groups.get(l) or self.branch_groups.get(str(l))
            span = max(g, prev)
            if groups:
                for o, gb, fb, bb, sb in groups:
                    busy[int(o):int(o) + int(gb)] += fb if forward_only else fb + bb + sb
                span = max(span, max(int(o) + int(gb) for o, gb, *_ in groups))
            else:
                busy[:g] += f if forward_only else f + b + s
            if not forward_only:
                busy[:span] += x
            prev = g
        return busy

    def idle_time(self, forward_only: bool = False) -> np.ndarray:
        """Seconds each device is idle per iteration; forward_only: only while the
        foreground runs forward."""
        if forward_only:
            idle = float(sum(self.fwd_time)) - self.busy_time(True)
        else:
            idle = self.iteration_time - self.busy_time()
        return np.maximum(idle, 0.0)      # no negative rounding residue

    @property
    def device_time(self) -> float:
        return float(self.busy_time().sum())

    @property
    def dp_device_time(self) -> float:
        return self.dp_time * self.dp_width

    def summary(self) -> str:
        ms = 1e3
        lines = [f"burst plan: {self.num_devices} devices, global batch {self.batch_size}, "
                 f"amplification limit {self.amplification_limit:g}",
                 f"{'layer':<22} {'g':>5} {'fwd+bwd ms':>11} {'sync ms':>8} {'xfer ms':>8} "
                 f"{'ampl':>6}"]
        for name, g, f, b, s, x, a in zip(self.layer_names, self.widths, self.fwd_time,
                                          self.bwd_time, self.sync_time, self.transfer_time,
                                          self.amplification):
            lines.append(f"{name[:22]:<22} {g:>5} {ms * (f + b):>11.3f} {ms * s:>8.3f} "
                         f"{ms * x:>8.3f} {a:>6.2f}")
        lines.append(f"iteration {ms * self.iteration_time:.3f} ms (data parallel over "
                     f"{self.dp_width}: {ms * self.dp_time:.3f} ms); device-time "
                     f"{ms * self.device_time:.3f} ms vs DP {ms * self.dp_device_time:.3f} ms "
                     f"({self.device_time / max(self.dp_device_time, 1e-30):.2f}x); idle "
                     f"{self.idle_time().sum() / (self.num_devices * self.iteration_time):.1%}"
                     f" of device-time")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(iteration_time=self.iteration_time, device_time=self.device_time,
                 dp_device_time=self.dp_device_time)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def plot(self, path: str, title: str | None = None) -> None:
        """PNG: devices (y) x time (x); forward left to right, then backward; each layer a
        bar over its g devices, transfers and all-reduces grey, idle time white."""
        from jaxhybrid.schedules import gantt
        cmap = __import__("matplotlib").colormaps["tab20"]
        t, ms, L = 0.0, 1e3, len(self.widths)
        prev, bars = self.widths[0], []
        order = [(l, "f") for l in range(L)] + [(l, "b") for l in reversed(range(L))]
        for l, phase in order:
            g = self.widths[l]
            x = self.transfer_time[l] / 2
            if x > 0:
                bars.append(gantt.Bar(t * ms, x * ms, 0, "0.6", rows=max(g, prev), edge=False))
                t += x
            dur = self.fwd_time[l] if phase == "f" else self.bwd_time[l]
            for o, gb, fb, bb, _ in (self.branch_groups.get(l) or [[0, g, self.fwd_time[l],
                                                                    self.bwd_time[l], 0]]):
                bars.append(gantt.Bar(t * ms, (fb if phase == "f" else bb) * ms, o, cmap(l % 20),
                                      rows=gb, alpha=1.0 if phase == "f" else 0.6,
                                      edge=l in self.branch_groups))
            t += dur
            if phase == "b" and self.sync_time[l] > 0:
                bars.append(gantt.Bar(t * ms, self.sync_time[l] * ms, 0, "0.3", rows=g, edge=False))
                t += self.sync_time[l]
            prev = g
        gantt.draw(path, bars, self.num_devices, gap=0.0, dpi=100,
                   xlabel="time (ms): forward, then backward; grey = transfers / all-reduce",
                   title=title or f"burst plan: {self.num_devices} devices, batch "
                                  f"{self.batch_size}, iteration {ms * self.iteration_time:.3g} "
                                  f"ms, idle {self.idle_time().sum() / (self.num_devices * t):.0%}")


def _evaluate(tab: _Tables, ks: Sequence[int], in_k: int) -> float:
    t, prev = 0.0, in_k
    for l, k in enumerate(ks):
        t += tab.transfer(prev, k, l) + tab.time[l, k] + tab.sync[l, k]
        prev = k
    return t


def _make_plan(tab: _Tables, ks, in_k, num_devices, batch_size, limit,
               branch_choice: dict | None = None) -> BurstPlan:
    """branch_choice: {l: (branch width indices, transfer, critical branch)}."""
    L = len(ks)
    branch_choice = branch_choice or {}
    prev, xfer = in_k, []
    for l, k in enumerate(ks):
        xfer.append(branch_choice[l][1] if l in branch_choice else tab.transfer(prev, k, l))
        prev = k
    K = len(tab.widths) - 1
    dp = float(tab.time[:, K].sum() + tab.sync[:, K].sum())
    fwd = [float(tab.fwd[l, ks[l]]) for l in range(L)]
    bwd = [float(tab.bwd[l, ks[l]]) for l in range(L)]
    sync = [float(tab.sync[l, ks[l]]) for l in range(L)]
    amp = [float(tab.time[l, k] * tab.widths[k] / tab.time[l, 0]) for l, k in enumerate(ks)]
    groups = {}
    for l, (bidx, _, crit) in branch_choice.items():
        br, off, rows = tab.branches[l], 0, []
        for b, kb in enumerate(bidx):
            rows.append([off, tab.widths[kb], float(br["fwd"][b, kb]), float(br["bwd"][b, kb]),
                         float(br["sync"][b, kb])])
            off += tab.widths[kb]
        groups[l] = rows
        _, _, fwd[l], bwd[l], sync[l] = rows[crit]
        amp[l] = float(sum(r[1] * (r[2] + r[3]) for r in rows)
                       / (br["fwd"][:, 0] + br["bwd"][:, 0]).sum())
    return BurstPlan(widths=[tab.widths[k] for k in ks], layer_names=list(tab.names),
                     fwd_time=fwd, bwd_time=bwd, sync_time=sync, transfer_time=xfer,
                     num_devices=num_devices, batch_size=batch_size, dp_time=dp,
                     dp_width=tab.widths[K], amplification_limit=limit, amplification=amp,
                     branch_groups=groups)


def plan_burst(costs, *, num_devices: int, batch_size: int, hardware="v100_dgx1",
               topology: Topology | None = None, amplification_limit: float = 2.0,
               fast_layer_time: float = DEFAULT_FAST_LAYER_TIME,
               small_batch: SmallBatchModel | None = None, branches: dict | None = None,
               tables: _Tables | None = None) -> BurstPlan:
    """The fastest per-layer widths under the amplification limit (exact DP).

    costs: LayerCost list (any batch; scaled) or a function batch -> LayerCost list
    (e.g. profiled at every per-device batch, or analytic). The batch starts spread
    over the widest width (data loaded on every device). branches: {layer index: its
    parallel branches' costs (list or batch -> list)}: such a layer may also run its
    branches side by side on separate device groups (`BurstPlan.branch_groups`)."""
    if not (is_int(num_devices) and is_int(batch_size)) or num_devices < 1 or batch_size < 1:
        raise ValueError(f"plan_burst: num_devices={num_devices!r} and batch_size="
                         f"{batch_size!r} must be ints >= 1.")
    if not fast_layer_time >= 0:
        raise ValueError(f"plan_burst: fast_layer_time={fast_layer_time} must be >= 0 seconds "
                         f"(0: no layer is exempt from the amplification limit).")
    if not amplification_limit >= 1:      # also NaN (it allowed no width above 1)
        raise ValueError(f"plan_burst: amplification_limit={amplification_limit} must be >= 1 "
                         f"(1 allows no layer more than one device's time).")
    tab = tables or build_tables(costs, num_devices=num_devices, batch_size=batch_size,
                                 hardware=hardware, topology=topology, small_batch=small_batch,
                                 fast_layer_time=fast_layer_time, branches=branches)
    if tables is not None and (tab.batch, tab.widths[-1]) != (batch_size, num_devices):
        # Tables for 4 devices planned "8": the DP baseline over 4, the other 4 idle.
        raise ValueError(f"plan_burst: the tables were built for batch_size={tab.batch} on "
                         f"{tab.widths[-1]} devices, not batch_size={batch_size} on "
                         f"{num_devices}; pass the same to build_tables.")
    L, K = tab.time.shape
    in_k = K - 1
    best = np.full((L, K), np.inf)
    back = np.zeros((L, K), int)
    mode = np.zeros((L, K), bool)           # True: branches side by side
    details = {}
    for l in range(L):
        prev = best[l - 1] if l else np.where(np.arange(K) == in_k, 0.0, np.inf)
        opts = _branch_options(tab, l, amplification_limit, num_devices) \
            if l in tab.branches else None
        if opts:
            details[l] = opts[1]
        for k in range(K):
            if tab.allowed(l, k, amplification_limit):
                cand = [prev[j] + tab.transfer(j, k, l) for j in range(K)]
                j = int(np.argmin(cand))
                best[l, k] = cand[j] + tab.time[l, k] + tab.sync[l, k]
                back[l, k] = j
            if opts:
                cand = prev + opts[0][:, k]
                j = int(np.argmin(cand))
                if cand[j] < best[l, k]:
                    best[l, k], back[l, k], mode[l, k] = cand[j], j, True
    if not np.isfinite(best[-1]).any():
        raise ValueError("plan_burst: no feasible plan (every width is over the limit).")
    ks = [int(np.argmin(best[-1]))]
    for l in range(L - 1, 0, -1):
        ks.append(int(back[l, ks[-1]]))
    ks.reverse()
    choice = {l: details[l][(ks[l - 1] if l else in_k, ks[l])]
              for l in range(L) if mode[l, ks[l]]}
    return _make_plan(tab, ks, in_k, num_devices, batch_size, amplification_limit, choice)


def brute_force(tab: _Tables, amplification_limit: float = 2.0,
                num_devices: int | None = None) -> tuple[float, list]:
    """(best iteration time, widths) over every feasible assignment, branch modes
    included (small cases: tests)."""
    L, K = tab.time.shape
    G = num_devices or tab.widths[-1]
    opts = {l: _branch_options(tab, l, amplification_limit, G)[0] for l in tab.branches}
    choices = [[(k, False) for k in range(K) if tab.allowed(l, k, amplification_limit)]
               + [(k, True) for k in range(K) if l in opts] for l in range(L)]
    best, arg = np.inf, None
    for combo in itertools.product(*choices):
        t, prev = 0.0, K - 1
        for l, (k, branch) in enumerate(combo):
            t += opts[l][prev, k] if branch else (tab.transfer(prev, k, l) + tab.time[l, k]
                                                  + tab.sync[l, k])
            prev = k
        if t < best:
            best, arg = t, [tab.widths[k] for k, _ in combo]
    return float(best), arg
