"""Burst planner's tables (DeepPool, PAPERS.md §2): every layer's forward, backward and
all-reduce time at every candidate width, the relayout terms between widths and the
per-branch times of layers with parallel branches. `jaxhybrid.plan.burst` runs the DP
over them (and re-exports every name here).

Pure numpy: nothing here runs JAX or imports `jaxhybrid.pipeline`.

Small batches: per-device time falls slower than 1/g because small kernels leave the
device part idle. `SmallBatchModel` gives, per layer kind (conv, dense, other), the work
w_half (output elements per device) at which a kernel reaches half its large-batch
throughput: compute time x (1 + w_half / w). `fit_small_batch` fits it to times measured
at several batches (t(b) = a + c b per layer -> w_half = a / c x outputs per example);
GPU presets are assumptions from occupancy arithmetic (docs/burst.md).

Transfers: the batch moved at a width change (forward activations and backward
gradients: 2x, point to point over the topology, each device's messages one after the
other). Sync: the all-reduce of the layer's gradient over its g devices (a ring over a
given topology; on a preset cluster the hierarchical model of `plan.hybrid`).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Sequence

import numpy as np

from jaxhybrid.plan.costs import LayerCost
from jaxhybrid.plan.hardware import Hardware, get_hardware
from jaxhybrid.plan.hybrid_network import allreduce_time
from jaxhybrid.plan.topology import Topology

KINDS = ("conv", "dense", "other")
DEFAULT_FAST_LAYER_TIME = 300e-6


def layer_kind(c: LayerCost) -> str:
    """conv: weights reused across positions (FLOPs per example >> 2 x params); dense:
    each weight used once per example; other: no parameters (pooling, reshapes)."""
    if c.param_count == 0:
        return "other"
    reuse = c.fwd_flops / max(c.batch_size, 1) / (2.0 * c.param_count)
    return "conv" if reuse > 1.5 else "dense"


def outputs_per_example(c: LayerCost) -> float:
    return max(c.out_bytes / max(c.batch_size, 1) / 4.0, 1.0)


@dataclasses.dataclass(frozen=True)
class SmallBatchModel:
    """Per kind: output elements per device at which throughput is half its peak."""
    half_work: dict
    source: str = ""

    def factor(self, kind: str, work: float) -> float:
        """Time multiplier of a kernel producing `work` output elements."""
        return 1.0 + self.half_work.get(kind, 0.0) / max(work, 1.0)


NO_SMALL_BATCH_LOSS = SmallBatchModel({k: 0.0 for k in KINDS}, "none")
# Assumptions (docs/burst.md): a GEMM/implicit-GEMM kernel needs ~2 waves of
# 128x128-output tiles on every SM to run near peak (V100: 80 SMs -> ~2.6M outputs, half
# at ~0.65M; H100: 132 SMs, 128x256 tiles -> half at ~2M); a Dense layer at small batch
# is weight-bandwidth bound anyway (small w_half); elementwise/pooling kernels need
# ~one wave of threads (SMs x 2048).
SMALL_BATCH_PRESETS = {
    "v100_dgx1": SmallBatchModel({"conv": 0.65e6, "dense": 16e3, "other": 0.16e6},
                                 "assumed: V100 occupancy (80 SMs)"),
    "a100_dgx": SmallBatchModel({"conv": 1.1e6, "dense": 27e3, "other": 0.22e6},
                                "assumed: A100 occupancy (108 SMs)"),
    "h100_dgx": SmallBatchModel({"conv": 2.0e6, "dense": 34e3, "other": 0.27e6},
                                "assumed: H100 occupancy (132 SMs)"),
}


def fit_small_batch(samples: Sequence[tuple[str, float, Sequence[int], Sequence[float]]],
                    source: str = "measured") -> SmallBatchModel:
    """samples: (kind, outputs per example, batches, times) per layer. Fits
    t(b) = a + c b by least squares per layer; w_half = (a / c) x outputs per example;
    per kind the median over its layers (0 if none, or if time scales linearly)."""
    per_kind: dict = {k: [] for k in KINDS}
    for kind, outs, batches, times in samples:
        b, t = np.asarray(batches, float), np.asarray(times, float)
        if b.size < 2 or np.ptp(b) == 0:
            raise ValueError("fit_small_batch: each layer needs times at >= 2 batch sizes.")
        c, a = np.polyfit(b, t, 1)
        if c <= 0:       # time does not grow with batch: all overhead
            per_kind[kind].append(b.max() * outs * 100.0)
        else:
            per_kind[kind].append(max(a, 0.0) / c * outs)
    return SmallBatchModel({k: float(np.median(v)) if v else 0.0 for k, v in per_kind.items()},
                           source)


# --- per-layer times at every width ------------------------------------------------------
def cost_fn(costs) -> Callable[[int], Sequence[LayerCost]]:
    from jaxhybrid.plan.hybrid import cost_fn     # scales parameter traffic correctly
    return cost_fn(costs)


def widths_for(num_devices: int, batch_size: int) -> list[int]:
    """Candidate widths: powers of two that divide both num_devices and the batch, and
    num_devices itself when it is not a power of two but divides the batch (6 devices:
    1, 2, 6): every width divides the device count, as the executor needs."""
    out, g = [], 1
    while g <= num_devices and num_devices % g == 0 and batch_size % g == 0:
        out.append(g)
        g *= 2
    if out[-1] != num_devices and batch_size % num_devices == 0:
        out.append(num_devices)
    return out


def layer_times_at(costs_at_m: Sequence[LayerCost], hw: Hardware, model: SmallBatchModel,
                   base: Sequence[LayerCost] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds per layer on one device at the costs' batch. On
    measured hardware the costs' times are used; if they were scaled from `base` (other
    batch) the small-batch factor ratio is applied."""
    f, b = [], []
    for i, c in enumerate(costs_at_m):
        kind, outs = layer_kind(c), outputs_per_example(c)
        fac = model.factor(kind, c.batch_size * outs)
        if hw.uses_measured_times:
            r = 1.0
            if base is not None and base[i].batch_size != c.batch_size:
                r = fac / model.factor(kind, base[i].batch_size * outs)
            f.append(c.fwd_time * r)
            b.append(c.bwd_time * r)
            continue
        for flops, nbytes, out in ((c.fwd_flops, c.fwd_bytes, f), (c.bwd_flops, c.bwd_bytes, b)):
            compute = flops / (hw.peak_flops * hw.efficiency) * fac
            out.append(max(compute, nbytes * hw.bytes_scale / hw.mem_bandwidth)
                       + hw.layer_overhead)
    return np.array(f), np.array(b)


def cluster_topology(hw: Hardware, num_devices: int) -> Topology:
    """Nodes of `devices_per_node`: inside a node links at the all-reduce bus bandwidth,
    between nodes each device gets its share of the node's network cards."""
    dpn = min(hw.devices_per_node, num_devices)
    nodes = math.ceil(num_devices / dpn)
    t = Topology.nodes(nodes, dpn, hw.allreduce_bandwidth, hw.inter_bandwidth / dpn,
                       hw.intra_latency, hw.inter_latency)
    if t.n == num_devices:
        return t
    return Topology(t.bandwidth[:num_devices, :num_devices],
                    t.latency[:num_devices, :num_devices], t.description)


def _relayout_terms(topo: Topology, g_from: int, g_to: int, batch: int):
    """Per device (latency seconds, seconds per byte-per-example) of moving the batch
    from g_from to g_to consecutive-row layouts; time = max over devices."""
    G = topo.n
    lat, per = np.zeros(G), np.zeros(G)
    if g_from == g_to:
        return lat, per
    send_lat, send_per = np.zeros(G), np.zeros(G)
    rows_from, rows_to = batch // g_from, batch // g_to
    for i in range(g_from):
        lo, hi = i * rows_from, (i + 1) * rows_from
        for j in range(lo // rows_to, (hi - 1) // rows_to + 1):
            if j == i:
                continue
            rows = min(hi, (j + 1) * rows_to) - max(lo, j * rows_to)
            cost_lat, cost_per = topo.latency[i, j], rows / topo.bandwidth[i, j]
            send_lat[i] += cost_lat
            send_per[i] += cost_per
            lat[j] += cost_lat
            per[j] += cost_per
    return np.maximum(lat, send_lat), np.maximum(per, send_per)


@dataclasses.dataclass
class _Tables:
    widths: list                 # candidate g
    fwd: np.ndarray              # [L, K] seconds
    bwd: np.ndarray
    sync: np.ndarray             # [L, K]
    in_bytes: np.ndarray         # [L] bytes per example entering layer l
    relayout: dict               # (k_from, k_to) -> (lat [G], per [G])
    fast: np.ndarray             # [L] bool: exempt from the amplification limit
    names: list
    batch: int = 0
    fast_time: float = DEFAULT_FAST_LAYER_TIME
    branches: dict = dataclasses.field(default_factory=dict)  # l -> fwd/bwd/sync [nb, K], out_bytes [nb]
    bw_min: np.ndarray | None = None   # [n]: slowest link among the first n devices
    lat_max: np.ndarray | None = None

    @property
    def time(self):
        return self.fwd + self.bwd

    def transfer(self, kf: int, kt: int, l: int) -> float:
        if kf == kt:
            return 0.0
        lat, per = self.relayout[(kf, kt)]
        return 2.0 * float(np.max(lat + per * self.in_bytes[l]))

    def allowed(self, l: int, k: int, limit: float) -> bool:
        t = self.time[l]
        return bool(k == 0 or self.fast[l] or t[k] * self.widths[k] / t[0] <= limit + 1e-12)


def _sync_times(costs, widths, hw: Hardware, topology: Topology | None) -> np.ndarray:
    """[layer, width] seconds of each layer's (or branch's) gradient all-reduce over a
    group of that width: a given network (`topology`), a ring over its first g devices;
    else the preset cluster's hierarchical (NCCL-style) all-reduce, as the projection
    prices it. Layers and branches are priced alike, so that a branch block competes with
    its layers on the same terms."""
    grad_bytes = [c.param_count * hw.grad_bytes for c in costs]
    if topology is not None:
        return np.array([[topology.allreduce_time(range(g), gb) for g in widths]
                         for gb in grad_bytes])
    return np.array([[allreduce_time(hw, g, 1, [gb]) for g in widths] for gb in grad_bytes])


def build_tables(costs, *, num_devices: int, batch_size: int, hardware="v100_dgx1",
                 topology: Topology | None = None, small_batch: SmallBatchModel | None = None,
                 fast_layer_time: float = DEFAULT_FAST_LAYER_TIME,
                 branches: dict | None = None) -> _Tables:
    hw = get_hardware(hardware)
    model = small_batch or SMALL_BATCH_PRESETS.get(hw.name, NO_SMALL_BATCH_LOSS)
    topo = topology or cluster_topology(hw, num_devices)
    if topo.n < num_devices:
        raise ValueError(f"burst: topology has {topo.n} devices, the plan needs {num_devices}.")
    if batch_size % num_devices:
        # The widest width would leave devices that never run a layer: they would count
        # as idle (background throughput) while the DP baseline could not use them.
        raise ValueError(f"burst: batch_size={batch_size} is not a multiple of num_devices="
                         f"{num_devices}; every width must divide the batch, so some devices "
                         f"would never run a layer: give a batch that is a multiple of "
                         f"{num_devices}, or fewer devices.")
    widths = widths_for(num_devices, batch_size)
    fn = cost_fn(costs)
    base = None if callable(costs) else list(costs)
    fb = [layer_times_at(fn(batch_size // g), hw, model, base) for g in widths]
    fwd, bwd = np.stack([x[0] for x in fb], 1), np.stack([x[1] for x in fb], 1)
    full = fn(batch_size)
    sync = _sync_times(full, widths, hw, topology)
    in_bytes = np.array([c.in_bytes / c.batch_size * hw.bytes_scale for c in full])
    relayout = {(a, b): _relayout_terms(topo, widths[a], widths[b], batch_size)
                for a in range(len(widths)) for b in range(len(widths)) if a != b}
    fast = (fwd[:, 0] + bwd[:, 0]) < fast_layer_time   # at g = 1, as DeepPool
    tab = _Tables(widths, fwd, bwd, sync, in_bytes, relayout, fast, [c.name for c in full],
                  batch_size, fast_layer_time)
    off = ~np.eye(topo.n, dtype=bool)
    bw = np.where(off, topo.bandwidth, np.inf)
    lat = np.where(off, topo.latency, 0.0)
    tab.bw_min = np.array([np.inf] + [bw[:n, :n].min() if n > 1 else np.inf
                                      for n in range(1, num_devices + 1)])
    tab.lat_max = np.array([0.0] + [lat[:n, :n].max() for n in range(1, num_devices + 1)])
    bad = [l for l in (branches or {}) if not 0 <= int(l) < len(full)]
    if bad:          # were ignored: the plan had no branch mode, silently
        raise ValueError(f"burst: branches for layers {bad}; the model has layers 0.."
                         f"{len(full) - 1}.")
    for l, bcosts in (branches or {}).items():
        if not callable(bcosts) and not list(bcosts):   # "the model has no layer costs"
            raise ValueError(f"burst: branches[{l}] is empty; give the layer's parallel "
                             f"branches' costs (a list, one entry per branch), or leave the "
                             f"layer out of branches.")
        bfn = cost_fn(bcosts)
        bbase = None if callable(bcosts) else list(bcosts)
        times = [layer_times_at(bfn(batch_size // g), hw, model, bbase) for g in widths]
        bfull = bfn(batch_size)
        tab.branches[int(l)] = {
            "fwd": np.stack([t[0] for t in times], 1), "bwd": np.stack([t[1] for t in times], 1),
            "sync": _sync_times(bfull, widths, hw, topology),
            "out_bytes": np.array([c.out_bytes / c.batch_size * hw.bytes_scale for c in bfull])}
    return tab


def _branch_options(tab: _Tables, l: int, limit: float, G: int):
    """Layer l's branches side by side on disjoint groups of the first devices (branch b
    on g_b, sum <= G): for every (input width index, output width index) the fastest
    feasible assignment -> (time [K, K], {(kf, k): (branch width indices, transfer,
    critical branch)}). Transfers: every group receives the whole input, the output
    width receives every branch's output; each device's rows one after the other over
    the slowest link among the devices involved (x2: forward and backward)."""
    br, B = tab.branches[l], tab.batch
    nb, K = br["fwd"].shape
    w = np.array(tab.widths)
    idx = np.array(list(itertools.product(range(K), repeat=nb)))
    gw = w[idx]
    used = gw.sum(1)
    keep = used <= G
    rows = np.arange(nb)
    tb = (br["fwd"] + br["bwd"])[rows, idx]
    t1 = float((br["fwd"][:, 0] + br["bwd"][:, 0]).sum())
    if not t1 < tab.fast_time:
        keep &= (gw * tb).sum(1) / t1 <= limit + 1e-12
    idx, gw, used, tb = idx[keep], gw[keep], used[keep], tb[keep]
    path = tb + br["sync"][rows, idx]
    crit, tpath = path.argmax(1), path.max(1)
    inb, outb = tab.in_bytes[l], br["out_bytes"]
    cost = np.full((K, K), np.inf)
    detail = {}
    for kf in range(K):
        for k in range(K):
            span = np.maximum(used, max(w[kf], w[k]))
            bw, lat = tab.bw_min[span], tab.lat_max[span]
            t_in = np.maximum((B / gw * inb).max(1), nb * B / w[kf] * inb) / bw + nb * lat
            t_out = np.maximum((B / w[k] * outb).sum(), (B / gw * outb).max(1)) / bw + nb * lat
            xfer = 2.0 * (t_in + t_out)
            total = tpath + xfer
            if total.size:
                j = int(np.argmin(total))
                cost[kf, k] = total[j]
                detail[(kf, k)] = (idx[j].tolist(), float(xfer[j]), int(crit[j]))
    return cost, detail
