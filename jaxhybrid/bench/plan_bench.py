"""Planner figures: partition quality, topology-aware mapping, recomputation, speed.

    python scripts/bench.py plan [--sections=partition,mapping,remat,speed] [--measure]
    python -m jaxhybrid.bench.plan_bench [same flags]

Prints (never asserts):
  partition  Inception-V3 at 4 and 8 stages, from the full-size analytic costs
             (`plan.reference_costs`, layer times on a V100 roofline) and from costs
             profiled on this host (size --small_size): the slowest stage of the planner's
             split vs the best of all C(L-1, S-1) splits (brute force) vs the
             equal-layer-count split.
  mapping    2 nodes x 4 devices whose inter-node link is 25x slower than intra-node:
             boundary transfer, all-reduce and bottleneck time of a topology-oblivious
             split on devices in order, the topology-aware split on devices in order, and
             the planner's split + device mapping (data=1 x pipe=8, data=2 x pipe=4).
  remat      a budget of half the no-recompute device memory: peak memory and
             recomputed FLOPs for remat none / full / all layers / auto, predicted by the
             planner (SPMD model) and measured on the compiled pipeline step
             (`memory_analysis()`, `cost_analysis()`; see docs/planner.md for how the two
             are made comparable).
  speed      planning time of 1,000 random layers into 64 stages (median of --repeats).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import statistics
import time

if "jax" not in __import__("sys").modules:   # the remat section needs >= 4 devices
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np
from absl import app, flags

from jaxhybrid import plan as planner
from jaxhybrid.plan import reference_costs
from jaxhybrid.plan.hardware import get_hardware
from jaxhybrid.plan.hybrid import layer_times as hw_layer_times
from jaxhybrid.plan.topology import fmt_bytes
from jaxhybrid.schedules import make_schedule

FLAGS = flags.FLAGS
flags.DEFINE_list("sections", "partition,mapping,remat,speed", "which figures to print.")
flags.DEFINE_bool("measure", False, "time layers when profiling (default: roofline estimate).")
flags.DEFINE_string("small_size", "small", "Inception size profiled for the partition figures.")
flags.DEFINE_integer("small_microbatch", 8, "microbatch of the profiled partition costs.")
flags.DEFINE_integer("ref_microbatch", 8, "microbatch of the full-size analytic costs.")
flags.DEFINE_string("hardware", "v100_dgx1", "roofline for the analytic costs' layer times.")
flags.DEFINE_string("topology", "2x4:intra=300GB/s,inter=12GB/s", "mapping section topology.")
flags.DEFINE_string("remat_size", "tiny", "Inception size compiled for the remat figures.")
flags.DEFINE_integer("remat_microbatch", 2, "microbatch of the remat figures.")
flags.DEFINE_list("remat_modes", "none,full,layers,auto", "remat settings compiled.")
flags.DEFINE_integer("speed_layers", 1000, "layers of the planning-speed instance.")
flags.DEFINE_integer("speed_stages", 64, "stages of the planning-speed instance.")
flags.DEFINE_integer("repeats", 5, "runs per speed figure (median).")

M = 8   # microbatches per step everywhere


# --- costs --------------------------------------------------------------------------
def reference_inception(microbatch: int, hardware: str = "v100_dgx1") -> list:
    """Full-size Inception-V3 analytic costs with layer times on `hardware`'s roofline."""
    costs = reference_costs.inception_v3(microbatch)
    fwd, bwd = hw_layer_times(costs, get_hardware(hardware))
    return [dataclasses.replace(c, fwd_time=float(f), bwd_time=float(b))
            for c, f, b in zip(costs, fwd, bwd)]


def profiled_inception(size: str, microbatch: int, measure: bool = False):
    """(ModelSpec, per-layer costs profiled on this host on one microbatch)."""
    from jaxhybrid.models import get_model
    spec = get_model("inception_v3", size=size)
    return spec, planner.profile(spec.layers, spec.sample_batch(microbatch)[0], measure=measure)


# --- partition quality --------------------------------------------------------------
def brute_force_bottleneck(times, S: int) -> tuple[float, list[int], int]:
    """Slowest stage of the best contiguous split over all C(L-1, S-1) cut sets
    (vectorised over cut sets). Returns (value, cuts, number of cut sets)."""
    t = np.asarray(times, float)
    L = t.size
    P = np.concatenate([[0.0], np.cumsum(t)])
    best, best_cuts, n = math.inf, [], 0
    it = itertools.combinations(range(1, L), S - 1)
    while True:
        chunk = np.array(list(itertools.islice(it, 200_000)), int).reshape(-1, S - 1)
        if not chunk.size and S > 1:
            break
        n += max(len(chunk), 1)
        edges = np.concatenate([np.zeros((max(len(chunk), 1), 1), int), chunk.reshape(-1, S - 1),
                                np.full((max(len(chunk), 1), 1), L)], axis=1)
        worst = np.diff(P[edges], axis=1).max(axis=1)
        i = int(np.argmin(worst))
        if worst[i] < best:
            best, best_cuts = float(worst[i]), edges[i, 1:-1].tolist()
        if S == 1:
            break
    return best, best_cuts, n


def partition_rows(name: str, costs, stages=(4, 8)) -> list[dict]:
    t = planner.layer_times(costs)
    rows = []
    for S in stages:
        t0 = time.perf_counter()
        cuts = planner.partition(t, S)
        plan_s = time.perf_counter() - t0
        ours = planner.stage_costs(t, cuts).bottleneck
        t0 = time.perf_counter()
        brute, brute_cuts, n = brute_force_bottleneck(t, S)
        brute_s = time.perf_counter() - t0
        eq_cuts = planner.equal_split(len(t), S)
        equal = planner.stage_costs(t, eq_cuts).bottleneck
        rows.append(dict(model=name, L=len(t), S=S, planner=ours, brute=brute, equal=equal,
                         cut_sets=n, cuts=cuts, brute_cuts=brute_cuts, equal_cuts=eq_cuts,
                         plan_s=plan_s, brute_s=brute_s, ideal=float(t.sum() / S)))
    return rows


def print_partition(rows) -> None:
    print(f"{'costs':<28} {'L':>3} {'S':>2} {'planner ms':>10} {'brute ms':>9} {'equal ms':>9} "
          f"{'sum/S ms':>9} {'eq/planner':>10} {'cut sets':>8} {'plan s':>8} {'brute s':>8}  cuts")
    for r in rows:
        print(f"{r['model']:<28} {r['L']:>3} {r['S']:>2} {1e3 * r['planner']:>10.4f} "
              f"{1e3 * r['brute']:>9.4f} {1e3 * r['equal']:>9.4f} {1e3 * r['ideal']:>9.4f} "
              f"{r['equal'] / r['planner']:>10.2f} {r['cut_sets']:>8} {r['plan_s']:>8.4f} "
              f"{r['brute_s']:>8.3f}  {r['cuts']} (equal {r['equal_cuts']})")
    worst = max(r["planner"] / r["brute"] - 1 for r in rows)
    print(f"planner vs brute force: worst relative gap {worst:.2e} (0 = optimal)")


# --- topology-aware mapping ---------------------------------------------------------
def mapping_rows(costs, topology: str, layouts=((1, 8), (2, 4))) -> list[dict]:
    t = planner.layer_times(costs)
    rows = []
    for data, S in layouts:
        k = data * S
        naive_cuts = planner.partition(t, S)
        in_order = list(range(k))
        variants = [
            ("oblivious split, in order", dict(boundaries=naive_cuts, device_order=in_order)),
            ("topology split, in order", dict(device_order=in_order)),
            ("planner split + mapping", {}),
        ]
        for label, kw in variants:
            p = planner.make_plan(costs, num_stages=S, num_microbatches=M, data=data,
                                  topology=topology, **kw)
            rows.append(dict(data=data, S=S, variant=label, plan=p,
                             transfer=float(sum(p.stage_transfer_time)),
                             worst_transfer=float(max(p.stage_transfer_time)),
                             allreduce=float(max(p.stage_allreduce_time)),
                             bottleneck=p.bottleneck_time, step=p.predicted_step_time))
    return rows


def print_mapping(rows) -> None:
    print(f"{'data x pipe':>11} {'variant':<27} {'xfer sum ms':>11} {'xfer max ms':>11} "
          f"{'allred ms':>9} {'bottleneck':>10} {'step ms':>8}  boundaries / device order")
    for r in rows:
        p = r["plan"]
        print(f"{r['data']:>5} x {r['S']:<3} {r['variant']:<27} {1e3 * r['transfer']:>11.3f} "
              f"{1e3 * r['worst_transfer']:>11.3f} {1e3 * r['allreduce']:>9.3f} "
              f"{1e3 * r['bottleneck']:>10.3f} {1e3 * r['step']:>8.2f}  {p.boundaries} / "
              f"{p.device_order}")
    for key in sorted({(r["data"], r["S"]) for r in rows}):
        a, b = [r for r in rows if (r["data"], r["S"]) == key][0::2]
        print(f"data={key[0]} pipe={key[1]}: planner vs oblivious in-order: transfer "
              f"{a['transfer'] / max(b['transfer'], 1e-30):.2f}x less, bottleneck "
              f"{a['bottleneck'] / b['bottleneck']:.2f}x faster, step {a['step'] / b['step']:.2f}x")
