"""Hybrid DP x PP: step-time model, search over (data, pipe, microbatches) and
time-to-accuracy projection (Pal et al. 2019).

Step time of one configuration (each of `data` workers runs a `pipe`-stage pipeline over
its per-worker batch b, split into M microbatches of m = b / M examples):

  layer times   per-layer costs at batch m (`scale_cost`), on the target device by the
                roofline of `Hardware.compute_time`, or the costs' own (measured) times;
  partition     `plan.partition` (minimum-bottleneck split; boundary activations priced on
                the pipeline group's links);
  pipeline      the schedule's task table run in lock step (as the engine runs it):
                sum over ticks of  max_s work[t, s]  (= `Schedule.tick_times` with the
                per-stage forward/backward costs), plus per tick the boundary transfer
                of one activation and one gradient (every device sends both, padded to
                the largest boundary); with pipe > 1 every device's work in every tick
                also holds the engine's own cost, `tick_overhead` + `tick_param_bytes`
                x (packed parameter elements per device = the largest stage's) /
                `mem_bandwidth` (0 for the GPU presets);
                with finite `compute_slots` (simulated devices sharing C cores) a tick
                lasts max(max_s work, data * sum_s work / C): the work of all devices in
                the tick serialises over the cores that are there;
  all-reduce    the gradients of every stage over its `data` replicas, after the flush
                and not overlapped with compute (Pal et al.'s t_step = t_worker +
                t_allreduce); see `allreduce_time`;
  update        the optimizer touching the state of every parameter that got a gradient
                once (memory-bound; sparse tables: the rows touched by any replica;
                `include_update=False` leaves it out, e.g. to compare with a measured
                value_and_grad step).

Memory per device: the planner's SPMD model of the engine (`remat.spmd_memory`: padded
stage buffers, the schedule's stash and inbox slots), with parameter state
`Hardware.param_state_bytes` per parameter and activations x `bytes_scale`; pipe = 1
accumulates one microbatch after another (1F1B on one device). Over the usable memory,
the planner's own recomputation choice (`remat.choose_remat_spmd`, per layer; bwd +=
the recomputed layers' fwd); configs that still do not fit are infeasible.

Time to accuracy (weak scaling, Pal et al.): global batch B = data * b, steps =
E(B) * ceil(D / B) with E from `StatEfficiency`, time = steps * step time.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from jaxhybrid.boundaries import stage_ranges, stage_sums
from jaxhybrid.plan.costs import LayerCost
from jaxhybrid.plan.hardware import Hardware
from jaxhybrid.plan.remat import MemoryBudgetError, choose_remat_spmd, spmd_memory
from jaxhybrid.plan.partitioning import partition
from jaxhybrid.plan.stat_efficiency import StatEfficiency
from jaxhybrid.plan.step_model import engine_tick_cost, lockstep_time, tick_transfer
from jaxhybrid.plan.topology import Topology
from jaxhybrid.schedules import make_schedule

CostFn = Callable[[int], Sequence[LayerCost]]


# --- costs at a microbatch size --------------------------------------------------------
def scale_cost(c: LayerCost, batch_size: int) -> LayerCost:
    """`c` at another batch size. Like `LayerCost.scaled`, except that the parameter
    traffic inside fwd/bwd bytes (reading the weights: param_bytes forward, reading
    weights and writing gradients: 2 * param_bytes backward) does not scale with the
    batch. Measured times scale linearly (profile at the batch you will run to avoid it)."""
    if batch_size == c.batch_size:
        return c
    s = c.scaled(batch_size)
    r = batch_size / c.batch_size
    pf = min(c.fwd_bytes, c.param_bytes)
    pb = min(c.bwd_bytes, 2 * c.param_bytes)
    return dataclasses.replace(s, fwd_bytes=pf + (c.fwd_bytes - pf) * r,
                               bwd_bytes=pb + (c.bwd_bytes - pb) * r)


def cost_fn(costs) -> CostFn:
    """A function microbatch size -> per-layer costs, from a list of LayerCost (scaled
    with `scale_cost`) or from such a function (e.g. analytic reference costs)."""
    if callable(costs):
        return costs
    costs = list(costs)
    if not costs:
        raise ValueError("hybrid: the model has no layer costs; pass plan.profile(...) output.")
    return lambda m: [scale_cost(c, m) for c in costs]


def times_on_hardware(costs: Sequence[LayerCost], hw: Hardware) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds per layer on `hw`."""
    if hw.uses_measured_times:
        return (np.array([c.fwd_time for c in costs], float),
                np.array([c.bwd_time for c in costs], float))
    return (np.array([hw.compute_time(c.fwd_flops, c.fwd_bytes) for c in costs]),
            np.array([hw.compute_time(c.bwd_flops, c.bwd_bytes) for c in costs]))


def grad_params(c: LayerCost, data: int, per_worker_batch: int) -> float:
    """Parameters whose gradients are exchanged. Layers with sparse-gradient tables
    (reference costs: `table_rows`, `row_params`, `sparse_rows`, `sparse_fixed_rows`)
    exchange only the rows the step touched, at most the whole table."""
    rows = getattr(c, "table_rows", 0)
    if not rows:
        return float(c.param_count)
    touched = data * (per_worker_batch * c.sparse_rows + c.sparse_fixed_rows)
    return float(c.param_count - rows * c.row_params + min(rows, touched) * c.row_params)


# --- network --------------------------------------------------------------------------
def pipeline_topology(hw: Hardware, pipe: int) -> Topology:
    """The links of one pipeline group: `pipe` consecutive devices, node-major."""
    dpn = hw.devices_per_node
    t = Topology.nodes(max(1, math.ceil(pipe / dpn)), min(pipe, dpn) if pipe <= dpn else dpn,
                       hw.p2p_bandwidth, hw.inter_bandwidth, hw.intra_latency, hw.inter_latency)
    if t.n == pipe:
        return t
    return Topology(t.bandwidth[:pipe, :pipe], t.latency[:pipe, :pipe], t.description)


def allreduce_time(hw: Hardware, data: int, pipe: int, stage_bytes: Sequence[float]) -> float:
    """All stages' gradient all-reduces over their `data` replicas, run at once.

    Placement as `make_mesh` builds it: replica r's stage s on device r * pipe + s, nodes
    of `devices_per_node` consecutive devices. Stage s's group has m = dpn // pipe members
    per node (1 when pipe >= dpn) on n = ceil(data / m) nodes. Hierarchical (NCCL-style):
    reduce-scatter and all-gather inside the node, 2 (m-1)/m * bytes / allreduce_bandwidth;
    between nodes a ring moves 2 (n-1)/n of each group's bytes through every node's network
    cards, which all groups with a stage on that node share (their bytes add up);
    latency: ring steps inside a node, a tree (2 ceil(log2 n) hops) between nodes.
    With finite `compute_slots` (one host) the groups' copies serialise like compute.
    """
    if data <= 1:
        return 0.0
    sb = np.asarray(stage_bytes, float)
    dpn = hw.devices_per_node
    m = min(data, max(1, dpn // pipe))
    n = math.ceil(data / m)
    t = 0.0
    if m > 1:
        per = 2.0 * (m - 1) / m / hw.allreduce_bandwidth
        if math.isfinite(hw.compute_slots):
            t += max(sb.max() * per, sb.sum() * per * data / hw.compute_slots)
        else:
            t += sb.max() * per
        t += 2 * (m - 1) * hw.intra_latency
    if n > 1:
        if pipe <= dpn:
            load = sb.sum()
        else:
            load = max(sb[i:i + dpn].sum() for i in range(0, pipe, dpn))
        t += 2.0 * (n - 1) / n * load / hw.inter_bandwidth
        t += 2 * math.ceil(math.log2(n)) * hw.inter_latency
    return float(t)


# --- one configuration ----------------------------------------------------------------
@dataclasses.dataclass
class Estimate:
    """Predicted step of one (data, pipe, M, schedule) configuration (seconds, bytes)."""
    data: int
    pipe: int
    num_microbatches: int
    schedule: str
    per_worker_batch: int
    feasible: bool
    reason: str = ""
    boundaries: list = dataclasses.field(default_factory=list)
    stage_fwd: list = dataclasses.field(default_factory=list)    # per microbatch
    stage_bwd: list = dataclasses.field(default_factory=list)
    stage_memory: list = dataclasses.field(default_factory=list)
    stage_remat: list = dataclasses.field(default_factory=list)
    pipeline_time: float = math.nan
    bubble_fraction: float = math.nan
    compute_time: float = math.nan   # the ticks' layer work alone (no engine overhead)
    engine_time: float = 0.0         # what the engine's per-tick costs add to the ticks
    transfer_time: float = 0.0
    allreduce_time: float = 0.0
    update_time: float = 0.0
    step_time: float = math.nan
    global_batch: int = 0
    epochs: float = math.nan
    steps: float = math.nan
    time_to_accuracy: float = math.nan

    @property
    def devices(self) -> int:
        return self.data * self.pipe

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in dataclasses.asdict(self).items()}


def worker_step(costs, hw: Hardware, *, pipe: int, num_microbatches: int, per_worker_batch: int,
                schedule: str = "1f1b", optimizer_states: int = 1, data: int = 1,
                boundaries: Sequence[int] | None = None, include_update: bool = True) -> Estimate:
    """Step time and memory of one configuration (all-reduce over `data` included),
    without statistical efficiency."""
    est = _pipeline(cost_fn(costs), hw, pipe, num_microbatches, per_worker_batch, schedule,
                    optimizer_states, data, boundaries)
    return _finish(est, cost_fn(costs), hw, data, optimizer_states if include_update else None)


def _pipeline(costs: CostFn, hw: Hardware, pipe: int, M: int, b: int, schedule: str,
              optimizer_states: int, data: int, boundaries=None) -> Estimate:
    """Everything but the all-reduce (which depends on `data`)."""
    est = Estimate(data, pipe, M, schedule, b, False, global_batch=data * b)
    if M < 1 or b % M:
        est.reason = f"M={M} does not divide the per-worker batch {b}"
        return est
    per_layer = list(costs(b // M))
    L = len(per_layer)
    sched = make_schedule(schedule, pipe, M)
    K, v = sched.num_stages, sched.virtual_stages   # K = pipe x virtual stages
    if K > L:
        est.reason = f"{K} stages (pipe={pipe} x {v} virtual) > {L} layers"
        return est
    fwd, bwd = times_on_hardware(per_layer, hw)
    out_bytes = np.array([c.out_bytes for c in per_layer], float) * hw.bytes_scale
    topo = pipeline_topology(hw, pipe) if pipe > 1 else None
    if boundaries is not None and len(boundaries) != K - 1:
        raise ValueError(f"boundaries={list(boundaries)}: a {K}-stage pipeline needs "
                         f"{K - 1} (the first layer of stages 1..{K - 1}).")
    if boundaries is None:   # links between stages are modelled for one stage per device
        boundaries = partition(fwd + bwd, K, boundary_bytes=out_bytes if topo and v == 1 else None,
                               topology=topo if v == 1 else None)
    cuts = est.boundaries = [int(x) for x in boundaries]
    # Memory: the planner's SPMD model of the engine (`remat.spmd_memory`) at the
    # hardware's bytes (parameter state per parameter, activations x bytes_scale); pipe = 1
    # runs microbatches one after another (gradient accumulation: one in flight, as 1F1B
    # on one device). Over the budget: the planner's recomputation (`choose_remat_spmd`).
    mem_sched = sched if pipe > 1 else make_schedule("1f1b", 1, M)
    pstate = hw.param_state_bytes(optimizer_states)
    arr = lambda f: np.array([getattr(c, f) for c in per_layer], float)  # noqa: E731
    params = stage_sums(arr("param_count"), cuts)
    bs = hw.bytes_scale
    engine_costs = [dataclasses.replace(
        c, param_bytes=c.param_count * hw.grad_bytes, saved_bytes=c.saved_bytes * bs,
        saved_bytes_remat=c.saved_bytes_remat * bs, in_bytes=c.in_bytes * bs,
        out_bytes=c.out_bytes * bs, bwd_temp_bytes=c.bwd_temp_bytes * bs) for c in per_layer]
    factor = pstate / hw.grad_bytes - 1.0       # (factor + 1) x gradient bytes = pstate
    F, B = stage_sums(fwd, cuts), stage_sums(bwd, cuts)
    flags = [False] * L
    mem, device = spmd_memory(engine_costs, cuts, mem_sched, flags, param_state_factor=factor)
    if device > hw.usable_memory:
        try:
            flags = choose_remat_spmd(engine_costs, cuts, mem_sched, hw.usable_memory,
                                      param_state_factor=factor)
        except MemoryBudgetError:
            est.reason = (f"needs {device / 1e9:.3g} GB per device > "
                          f"{hw.usable_memory / 1e9:.3g} GB usable even with recomputation")
            return est
        mem, device = spmd_memory(engine_costs, cuts, mem_sched, flags, param_state_factor=factor)
        B = B + stage_sums(np.where(flags, fwd, 0.0), cuts)
    remat = [bool(any(flags[a:b])) for a, b in stage_ranges(cuts, L)]
    est.stage_memory, est.stage_remat = [float(x) for x in mem], remat
    est.stage_fwd, est.stage_bwd = F.tolist(), B.tolist()

    # The lock-step pipeline.
    per_tick_comm = engine = latency = 0.0
    if pipe > 1:
        nb = out_bytes[np.array(cuts) - 1].max()   # padded to the largest boundary
        dev = sched.stage_device
        links = {(dev[k], dev[k + 1]) for k in range(K - 1) if dev[k] != dev[k + 1]}
        per_tick_comm = tick_transfer(topo, links, nb)
        device_params = np.bincount(dev, weights=params, minlength=pipe)
        engine, latency = engine_tick_cost(hw, device_params.max()), hw.tick_latency
    st = lockstep_time(sched, F, B, data=data, compute_slots=hw.compute_slots,
                       tick_overhead=engine, transfer_per_tick=per_tick_comm,
                       tick_latency=latency)
    est.compute_time, est.engine_time, est.transfer_time = st.compute, st.engine, st.transfer
    est.pipeline_time = st.pipeline
    est.bubble_fraction = sched.bubble_fraction(F, B)
    est.feasible = True
    return est


def _finish(est: Estimate, costs: CostFn, hw: Hardware, data: int,
            optimizer_states: int | None = 1) -> Estimate:
    """Adds the gradient all-reduce over `data` replicas and totals the step."""
    est = dataclasses.replace(est, data=data, global_batch=data * est.per_worker_batch)
    if not est.feasible:
        return est
    per_layer = costs(est.per_worker_batch // est.num_microbatches)
    g = np.array([grad_params(c, data, est.per_worker_batch) for c in per_layer])
    stage_grads = stage_sums(g, est.boundaries)
    if len(stage_grads) != est.pipe:   # virtual stages: a device all-reduces all of its own
        dev = make_schedule(est.schedule, est.pipe, est.num_microbatches).stage_device
        stage_grads = np.bincount(dev, weights=stage_grads, minlength=est.pipe)
    est.allreduce_time = allreduce_time(hw, data, est.pipe, stage_grads * hw.grad_bytes)
    if optimizer_states is not None and hw.mem_bandwidth:
        # Every device reads and writes the state of the parameters that got gradients
        # (all of them; for sparse tables, the rows any replica touched).
        est.update_time = float(stage_grads.max() * 2 * hw.param_state_bytes(optimizer_states)
                                / hw.mem_bandwidth)
    est.step_time = est.pipeline_time + est.allreduce_time + est.update_time + hw.step_overhead
    return est


def with_accuracy(est: Estimate, stat: StatEfficiency) -> Estimate:
    """Fills global batch, epochs, steps and time to accuracy: E(B) * ceil(D / B) steps."""
    B = est.data * est.per_worker_batch
    est.global_batch = B
    if stat.dataset_size:
        est.epochs = stat.epochs(B)
        est.steps = est.epochs * math.ceil(stat.dataset_size / B)
    else:
        est.steps = stat.steps(B)
    if est.feasible:
        est.time_to_accuracy = est.steps * est.step_time
    return est


def step_time(costs, hw: Hardware, *, data: int, pipe: int, num_microbatches: int,
              per_worker_batch: int, schedule: str = "1f1b", optimizer_states: int = 1,
              stat: StatEfficiency | None = None, boundaries: Sequence[int] | None = None,
              include_update: bool = True) -> Estimate:
    """One configuration: `worker_step` plus the all-reduce over `data` (and, with
    `stat`, time to accuracy). `boundaries` fixes the stage split (default: the
    planner's); `include_update=False` drops the optimizer update (a value_and_grad step)."""
    if data < 1 or pipe < 1:
        raise ValueError(f"step_time: data={data} and pipe={pipe} must be >= 1.")
    est = worker_step(costs, hw, pipe=pipe, num_microbatches=num_microbatches,
                      per_worker_batch=per_worker_batch, schedule=schedule,
                      optimizer_states=optimizer_states, data=data, boundaries=boundaries,
                      include_update=include_update)
    return with_accuracy(est, stat) if stat is not None else est


# --- search and projection -------------------------------------------------------------
def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass
class Projection:
    """Every configuration tried (`rows`, feasible or not) for each device count."""
    model: str
    hardware: str
    devices: list
    per_worker_batch: int
    stat: StatEfficiency
    rows: list

    def best(self, n: int, hybrid: bool | None = None) -> Estimate | None:
        """Fastest feasible config on n devices: DP-only (hybrid=False), pipe > 1
        (hybrid=True) or any (None)."""
        ok = [r for r in self.rows if r.devices == n and r.feasible and
              (hybrid is None or (r.pipe > 1) == hybrid)]
        return min(ok, key=lambda r: r.time_to_accuracy) if ok else None

    def summary(self) -> list[dict]:
        out = []
        for n in self.devices:
            dp, hy = self.best(n, False), self.best(n, True)
            sp = dp.time_to_accuracy / hy.time_to_accuracy if dp and hy else math.nan
            out.append(dict(devices=n, dp=dp, hybrid=hy, speedup=sp,
                            winner="hybrid" if hy and (not dp or sp > 1) else ("dp" if dp else "-")))
        return out

    @property
    def crossover(self) -> int | None:
        """Smallest N where the best hybrid config beats the best DP-only one."""
        return next((s["devices"] for s in self.summary() if s["winner"] == "hybrid"), None)

    def at_scale(self) -> dict:
        """Best DP-only time over all N against the best hybrid time over all N (Pal et
        al.'s comparison: what each strategy can achieve at scale)."""
        pick = lambda h: min((r for r in self.rows if r.feasible and (r.pipe > 1) == h),  # noqa: E731
                             key=lambda r: r.time_to_accuracy, default=None)
        dp, hy = pick(False), pick(True)
        sp = dp.time_to_accuracy / hy.time_to_accuracy if dp and hy else math.nan
        return dict(dp=dp, hybrid=hy, speedup=sp, gain_percent=(sp - 1) * 100)

    def table(self) -> str:
        def cfg(e):
            return "-" if e is None else f"{e.data}x{e.pipe} M={e.num_microbatches}"

        def hrs(e):
            return "-" if e is None else f"{e.time_to_accuracy / 3600:.3g}"
        head = (f"{self.model} on {self.hardware}, per-worker batch {self.per_worker_batch}; "
                f"{self.stat.describe()}\n"
                f"{'N':>6} | {'best DP':>14} {'step ms':>8} {'epochs':>7} {'hours':>8} | "
                f"{'best hybrid':>15} {'step ms':>8} {'epochs':>7} {'hours':>8} | speedup")
        lines = [head]
        for s in self.summary():
            dp, hy = s["dp"], s["hybrid"]
            lines.append(
                f"{s['devices']:>6} | {cfg(dp):>14} {dp.step_time * 1e3 if dp else math.nan:>8.2f} "
                f"{dp.epochs if dp else math.nan:>7.1f} {hrs(dp):>8} | {cfg(hy):>15} "
                f"{hy.step_time * 1e3 if hy else math.nan:>8.2f} "
                f"{hy.epochs if hy else math.nan:>7.1f} {hrs(hy):>8} | {s['speedup']:.3f}")
        a = self.at_scale()
        lines.append(f"crossover N = {self.crossover}; at scale: best DP {hrs(a['dp'])} h "
                     f"({cfg(a['dp'])}, N={a['dp'].devices if a['dp'] else '-'}), best hybrid "
                     f"{hrs(a['hybrid'])} h ({cfg(a['hybrid'])}, N="
                     f"{a['hybrid'].devices if a['hybrid'] else '-'}): speedup {a['speedup']:.3f} "
                     f"({a['gain_percent']:+.1f}%)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        conv = lambda e: e.to_dict() if isinstance(e, Estimate) else e  # noqa: E731
        clean = lambda x: None if isinstance(x, float) and not math.isfinite(x) else x  # noqa: E731
        return dict(model=self.model, hardware=self.hardware, devices=self.devices,
                    per_worker_batch=self.per_worker_batch, stat_efficiency=self.stat.to_dict(),
                    crossover=self.crossover,
                    at_scale={k: clean(conv(v)) for k, v in self.at_scale().items()},
                    summary=[{k: clean(conv(v)) for k, v in s.items()} for s in self.summary()],
                    configs=[r.to_dict() for r in self.rows])

    def plot(self, path: str) -> None:
        """PNG: time to accuracy vs N (log-log), best DP-only vs best hybrid."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for hybrid, label, style in ((False, "data parallel only", "o-"), (True, "hybrid DP x PP", "s-")):
            pts = [(n, e.time_to_accuracy / 3600) for n in self.devices
                   if (e := self.best(n, hybrid)) is not None]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        if self.crossover:
            ax.axvline(self.crossover, color="gray", ls=":", label=f"crossover N={self.crossover}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("devices N")
        ax.set_ylabel("time to accuracy (hours)")
        ax.set_title(f"{self.model} on {self.hardware} (b={self.per_worker_batch} per worker)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def search(costs, hw: Hardware, stat: StatEfficiency, *, devices: Sequence[int],
           per_worker_batch: int, microbatches: Sequence[int] | None = None,
           schedules: Sequence[str] = ("1f1b",), max_pipe: int | None = None,
           optimizer_states: int = 1, model: str = "model") -> Projection:
    """Every (data, pipe, M, schedule) with data * pipe = N for each N in `devices`, pipe <=
    number of layers (and <= max_pipe), M dividing the per-worker batch (and in
    `microbatches` if given); each with its step time, memory and time to accuracy."""
    b = int(per_worker_batch)
    if b < 1:
        raise ValueError(f"search: per_worker_batch={per_worker_batch} must be >= 1.")
    devices = sorted({int(n) for n in devices})
    if not devices or devices[0] < 1:
        raise ValueError(f"search: devices must be positive device counts, got {devices}.")
    fn = cost_fn(costs)
    memo: dict = {}
    cached = lambda m: memo.setdefault(m, list(fn(m)))  # noqa: E731
    L = len(cached(b))
    ms = [m for m in divisors(b) if microbatches is None or m in set(microbatches)]
    if not ms:
        raise ValueError(f"search: no microbatch count in {list(microbatches)} divides the "
                         f"per-worker batch {b}.")
    cores: dict = {}
    rows = []
    for n in devices:
        for pipe in divisors(n):
            if pipe > L or (max_pipe is not None and pipe > max_pipe):
                continue
            data = n // pipe
            for sched in schedules:
                for m in ms:
                    key = (pipe, m, sched, data if math.isfinite(hw.compute_slots) else None)
                    if key not in cores:
                        cores[key] = _pipeline(cached, hw, pipe, m, b, sched, optimizer_states, data)
                    rows.append(with_accuracy(_finish(cores[key], cached, hw, data, optimizer_states),
                                             stat))
    return Projection(model, hw.name, devices, b, stat, rows)


def project(model: str, devices: Sequence[int], hardware: str | Hardware = "v100_dgx1", *,
            per_worker_batch: int | None = None, stat: StatEfficiency | None = None,
            costs=None, size: str = "full", profile_batch: int = 2,
            optimizer_states: int | None = None, **search_kw) -> Projection:
    """Time-to-accuracy projection of `model` for each device count.

    costs: None / "reference" = the analytic full-size costs of a paper model
      (`reference_costs`); "profile" = `plan.profile` of `jaxhybrid.models.get_model(model,
      size)` at `profile_batch` examples, scaled to each microbatch; or a list of LayerCost
      / a function microbatch -> costs (measured ones for hardware "measured").
    stat: statistical efficiency (default: the model's documented default).
    """
    from jaxhybrid.plan import reference_costs as ref
    from jaxhybrid.plan.hardware import get_hardware
    from jaxhybrid.plan.stat_efficiency import default_for
    hw = get_hardware(hardware)
    known = model in ref.PAPER_MODELS
    if costs is None or costs == "reference":
        pm = ref.paper_model(model)
        costs = pm.costs
    elif costs == "profile":
        from jaxhybrid.models import get_model
        from jaxhybrid.plan.costs import profile
        spec = get_model(model, size)
        costs = profile(spec.layers, spec.sample_batch(profile_batch)[0])
    if per_worker_batch is None:
        if not known:
            raise ValueError(f"project: pass per_worker_batch for {model!r} (no default).")
        per_worker_batch = ref.PAPER_MODELS[model].per_worker_batch
    if optimizer_states is None:
        optimizer_states = ref.PAPER_MODELS[model].optimizer_states if known else 2
    if hw.uses_measured_times and not all(c.measured for c in cost_fn(costs)(per_worker_batch)):
        raise ValueError(f"project: hardware {hw.name!r} uses the costs' measured times, but "
                         f"these costs were not timed; profile with measure=True "
                         f"(scripts/project.py --costs=measured).")
    return search(costs, hw, stat or default_for(model), devices=devices,
                  per_worker_batch=per_worker_batch, optimizer_states=optimizer_states,
                  model=model, **search_kw)
