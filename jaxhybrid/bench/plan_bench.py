"""Planner figures: partition quality, topology-aware mapping, recomputation, speed.

    python scripts/bench.py plan [--sections=partition,mapping,remat,speed] [--measure]
    python -m jaxhybrid.bench.plan_bench [same flags]

Prints (never asserts):
  partition  Inception-V3 at 4 and 8 stages, from the full-size analytic costs
             (`plan.reference_costs`, layer times on a V100 roofline) and from costs
             profiled on this host (size --size, microbatch --microbatch): the slowest
             stage of the planner's split vs the best of all C(L-1, S-1) splits (brute
             force) vs the equal-layer-count split.
  mapping    2 nodes x 4 devices whose inter-node link is 25x slower than intra-node, for
             data x pipe = 1x8, 2x4, 2x3, 4x2: boundary transfer, all-reduce and bottleneck
             of the topology-oblivious split on devices in order (naive), of the same split
             with the planner's device mapping, of the topology-aware split in order, and
             of the full planner; a note per layout says why the mapping does or does not
             matter there.
  remat      a budget halfway between the predicted device memory with every layer
             recomputed and with none (microbatch
             --remat_microbatch): peak memory and recomputed FLOPs for remat none / full /
             auto, predicted by the planner (SPMD model) and measured on compiled programs
             (`memory_analysis()` of the real pipeline step; `cost_analysis()` of each
             stage's backward with the same jax.checkpoint choices).
  speed      planning time of 1,000 random layers into 64 stages (best of --repeats).
  policy     a stage's forward + backward under jax.checkpoint policies, priced by the plan
             and measured, against no recompute; remat="auto" with and without the
             policies it may choose, under a budget (`bench.policy_time`; not in the
             default sections: python scripts/bench.py plan --sections=policy).
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
from jaxhybrid.plan.hybrid import times_on_hardware
from jaxhybrid.plan.topology import fmt_bytes
from jaxhybrid.schedules import make_schedule
from jaxhybrid.step_memory import compiled_bytes

FLAGS = flags.FLAGS
flags.DEFINE_list("sections", "partition,mapping,remat,speed", "which figures to print.")
flags.DEFINE_bool("measure", False, "time layers when profiling (default: roofline estimate).")
flags.DEFINE_string("size", "small", "Inception size profiled (partition) and compiled (remat).")
flags.DEFINE_integer("microbatch", 8, "microbatch of the profiled costs and the remat step.")
flags.DEFINE_integer("ref_microbatch", 8, "microbatch of the full-size analytic costs.")
flags.DEFINE_string("hardware", "v100_dgx1", "roofline for the analytic costs' layer times.")
flags.DEFINE_string("topology", "2x4:intra=300GB/s,inter=12GB/s", "mapping section topology.")
flags.DEFINE_integer("remat_microbatch", 16, "microbatch of the remat figures (profiled costs "
                     "scaled linearly): large enough that activations, not parameters, dominate.")
flags.DEFINE_list("remat_modes", "none,full,auto", "remat settings compiled (also: layers).")
flags.DEFINE_integer("speed_layers", 1000, "layers of the planning-speed instance.")
flags.DEFINE_integer("policy_width", 256, "width of the policy section's blocks.")
flags.DEFINE_integer("policy_microbatch", 64, "microbatch of the policy section.")
flags.DEFINE_integer("speed_stages", 64, "stages of the planning-speed instance.")
flags.DEFINE_integer("repeats", 3, "runs of the speed figure (best and median).")

M = 8   # microbatches per step everywhere


# --- costs --------------------------------------------------------------------------
def reference_inception(microbatch: int, hardware: str = "v100_dgx1") -> list:
    """Full-size Inception-V3 analytic costs with layer times on `hardware`'s roofline."""
    costs = reference_costs.inception_v3(microbatch)
    fwd, bwd = times_on_hardware(costs, get_hardware(hardware))
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
        eq_cuts = planner.even_boundaries(len(t), S)
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
MAPPING_LAYOUTS = ((1, 8), (2, 4), (2, 3), (4, 2))
MAPPING_NOTES = {
    (1, 8): "8 stages on 2 nodes: any node-contiguous mapping crosses the slow link exactly "
            "once and in order is already one; what helps is moving the cut (topology split).",
    (2, 4): "each replica fills one node in order, so only the stage all-reduces cross nodes; "
            "putting each stage's replicas on one node would make a pipeline cut cross in both "
            "replicas instead, which costs more per microbatch here (exhaustive search): in "
            "order stays.",
    (2, 3): "6 of 8 devices: in order, replica 1 sits on devices 3,4,5 and its pipeline "
            "crosses nodes; the mapping keeps each replica inside one node.",
    (4, 2): "either the pipeline cut or the stage all-reduces must cross nodes; the mapping "
            "picks the cheaper one for the split it is given. The planner's own split is best "
            "per microbatch (its objective amortises the all-reduce over M); in the predicted "
            "step the mapped layout's cut pays the slow link in every tick, in order only its "
            "all-reduce once after the drain.",
}


def mapping_rows(costs, topology: str, layouts=MAPPING_LAYOUTS) -> list[dict]:
    """Per layout: the topology-oblivious split on devices in order (naive), the same split
    with the planner's device mapping, the topology-aware split in order, and the full
    planner (split and mapping alternated)."""
    t = planner.layer_times(costs)
    topo = planner.Topology.from_spec(topology)
    rows = []
    for data, S in layouts:
        oblivious = planner.partition(t, S)
        e = [0, *oblivious, len(costs)]
        mapped = planner.map_devices(
            [costs[b - 1].out_bytes for b in oblivious], topo, data,
            stage_times=planner.stage_costs(t, oblivious).compute, num_microbatches=M,
            stage_param_bytes=[sum(c.param_bytes for c in costs[e[s]:e[s + 1]]) for s in range(S)])
        in_order = list(range(data * S))
        variants = [("oblivious split, in order", dict(boundaries=oblivious, device_order=in_order)),
                    ("oblivious split, mapped", dict(boundaries=oblivious, device_order=mapped)),
                    ("topology split, in order", dict(device_order=in_order)),
                    ("planner split + mapping", {})]
        for label, kw in variants:
            p = planner.make_plan(costs, num_stages=S, num_microbatches=M, data=data,
                                  topology=topo, **kw)
            rows.append(dict(data=data, S=S, variant=label, plan=p,
                             transfer=float(sum(p.stage_transfer_time)),
                             worst_transfer=float(max(p.stage_transfer_time)),
                             allreduce=float(max(p.stage_allreduce_time)),
                             bottleneck=p.bottleneck_time, step=p.predicted_step_time))
    return rows


def print_mapping(rows) -> None:
    print("Times per microbatch except all-reduce (per step); xfer = activation + gradient over "
          "each cut's slowest link, summed over cuts; bottleneck = slowest stage incl. xfer and "
          "all-reduce / M; step = predicted 1F1B step.")
    print(f"{'data x pipe':>11} {'variant':<27} {'xfer sum ms':>11} {'xfer max ms':>11} "
          f"{'allred ms':>9} {'bottleneck':>10} {'step ms':>8}  boundaries / device order")
    for r in rows:
        p = r["plan"]
        print(f"{r['data']:>5} x {r['S']:<3} {r['variant']:<27} {1e3 * r['transfer']:>11.3f} "
              f"{1e3 * r['worst_transfer']:>11.3f} {1e3 * r['allreduce']:>9.3f} "
              f"{1e3 * r['bottleneck']:>10.3f} {1e3 * r['step']:>8.2f}  {p.boundaries} / "
              f"{p.device_order}")
    for key in dict.fromkeys((r["data"], r["S"]) for r in rows):
        naive, mapped, _, full = [r for r in rows if (r["data"], r["S"]) == key]
        print(f"data={key[0]} x pipe={key[1]}: same split, mapped vs in order: transfer "
              f"{1e3 * mapped['transfer']:.3f} vs {1e3 * naive['transfer']:.3f} ms, all-reduce "
              f"{1e3 * mapped['allreduce']:.3f} vs {1e3 * naive['allreduce']:.3f} ms, bottleneck "
              f"{naive['bottleneck'] / mapped['bottleneck']:.2f}x; planner vs naive: bottleneck "
              f"{naive['bottleneck'] / full['bottleneck']:.2f}x, step {naive['step'] / full['step']:.2f}x")
        if key in MAPPING_NOTES:
            print(f"    ({MAPPING_NOTES[key]})")


# --- cost-balanced recomputation ----------------------------------------------------
# The compiled value_and_grad step (no optimizer) holds params, the gradient accumulator
# and the output gradients; the model adds the per-microbatch stage gradient itself.
PARAM_STATE = 3


def _compiled_peak(spec, per_layer, batch, cuts, remat, S: int) -> float:
    """Peak bytes per device of the compiled pipeline value_and_grad step."""
    import jax

    import jaxhybrid as jh
    from jaxhybrid import pipeline as jp
    mesh = jh.make_mesh(data=1, pipe=S)
    p = jp.Pipeline(spec.layers, mesh=mesh, num_microbatches=M, schedule="1f1b",
                    boundaries=cuts, remat=remat)
    variables = p.pack(per_layer)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x, y = jax.device_put(batch, sharding)
    return compiled_bytes(
        p.value_and_grad(spec.loss_fn).lower(variables, x, y, jax.random.key(1)).compile())


def _backward_flops(spec, per_layer, x, y, cuts, flags, stage_level: bool) -> float:
    """XLA FLOPs of the stages' compiled backward passes on one microbatch, summed over
    stages: each stage's vjp (w.r.t. its params and input, loss on the last stage) is
    taken under jit, and the function applying it to a cotangent is compiled on its own
    with the residuals as inputs, as the pipeline's backward slot runs it. jax.checkpoint
    wraps each flagged layer (or the whole stage when stage_level), so the difference to
    no checkpointing is the recomputed forward work. (The pipelined step itself cannot
    give this figure: XLA's cost analysis counts a while-loop body once.)"""
    import jax
    import jax.numpy as jnp

    from jaxhybrid.layers import apply_layer, layer_rng
    e = [0, *cuts, len(spec.layers)]

    def layer_fn(i):
        def f(p, h):
            return apply_layer(spec.layers[i], {**per_layer[i], "params": p}, h, train=True,
                               rng=layer_rng(jax.random.key(1), 0, i))[0]
        return jax.checkpoint(f) if flags[i] and not stage_level else f

    total, h = 0.0, x
    for s in range(len(e) - 1):
        a, b = e[s], e[s + 1]

        def stage(ps, hh, a=a, b=b, last=s == len(e) - 2):
            for i in range(a, b):
                hh = layer_fn(i)(ps[i - a], hh)
            return spec.loss_fn(hh, y) if last else hh

        fn = jax.checkpoint(stage) if stage_level else stage
        params = [per_layer[i].get("params", {}) for i in range(a, b)]
        out, vjp_fn = jax.jit(lambda ps, hh, fn=fn: jax.vjp(fn, ps, hh))(params, h)
        ct = jax.tree.map(jnp.ones_like, out)
        cost = jax.jit(lambda vf, c: vf(c)).lower(vjp_fn, ct).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        total += float(cost.get("flops", 0.0))
        h = out
    return total


def remat_rows(spec, costs, modes, S: int = 4) -> tuple[list[dict], float]:
    """Planner prediction and compiled measurement of each remat mode at a budget halfway
    between the predicted device memory with every layer recomputed and with none.
    Returns (rows, budget)."""
    import jax
    mb = costs[0].batch_size
    x, y = spec.sample_batch(M * mb)
    L, sched = len(costs), make_schedule("1f1b", S, M)
    cuts = planner.partition(planner.layer_times(costs), S)
    mem = lambda r, whole=None: planner.spmd_memory(  # noqa: E731
        costs, cuts, sched, r, param_state_factor=PARAM_STATE, whole_stage=whole)
    # Halfway between recomputing every layer and none: a budget the planner can meet
    # only by recomputing some layers.
    budget = (mem([True] * L)[1] + mem(None)[1]) / 2
    # Compiling needs shapes only: zeros in place of initialised values.
    from jaxhybrid.models.spec import abstract_variables
    per_layer = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype),
                             abstract_variables(spec.layers, jax.tree.map(lambda a: a[:1], x)))
    x1, y1 = jax.tree.map(lambda a: a[:mb], (x, y))
    base_flops = None
    rows = []
    for mode in modes:
        if mode == "auto":
            try:
                flags_ = planner.choose_remat_spmd(costs, cuts, sched, budget,
                                                   param_state_factor=PARAM_STATE)
            except planner.MemoryBudgetError as e:
                rows.append(dict(mode=mode, error=str(e)))
                continue
            remat = flags_
        elif mode in ("full", "layers"):
            flags_, remat = [True] * L, ("full" if mode == "full" else [True] * L)
        else:
            flags_, remat = [False] * L, "none"
        peak = _compiled_peak(spec, per_layer, (x, y), cuts, remat, S)
        flops = _backward_flops(spec, per_layer, x1, y1, cuts, flags_, mode == "full")
        base_flops = flops if mode == "none" else base_flops
        slow = planner.layer_times(costs) + np.array([c.fwd_time if r else 0.0
                                                      for c, r in zip(costs, flags_)])
        whole = [True] * S if mode == "full" else None
        rows.append(dict(mode=mode, predicted=mem(flags_, whole)[1], measured=peak, flops=flops,
                         predicted_recompute=M * sum(c.fwd_flops for c, r in zip(costs, flags_) if r),
                         layers=int(sum(flags_)), slowest=planner.stage_costs(slow, cuts).bottleneck))
    for r in rows:
        if "flops" in r and base_flops is not None:
            r["recompute"] = M * (r["flops"] - base_flops)
    return rows, budget


def print_remat(rows, budget: float, size: str, microbatch: int, S: int = 4) -> None:
    print(f"Inception-V3 ({size}), {S} stages x M={M}, microbatch {microbatch}, 1F1B, data=1; "
          f"budget = halfway between the predicted full and no recompute = {fmt_bytes(budget)} (the step "
          f"has no optimizer: params, gradient accumulator, microbatch gradient, output "
          f"gradients, stash, inboxes, inputs)")
    print("predicted: the planner's SPMD memory model; compiled: memory_analysis() of the real "
          "pipeline value_and_grad step on the simulated devices (args + outputs + temps - "
          "aliased). Recomputed GFLOP per step: the planner (M x forward FLOPs of recomputed "
          "layers) / M x (XLA FLOPs of the stages' compiled backward passes with the same "
          "jax.checkpoint choices - without).")
    print(f"{'remat':<7} {'layers':>6} {'predicted':>10} {'compiled':>10} {'fits pred/comp':>14} "
          f"{'recomputed GFLOP pred / compiled':>33} {'slowest stage ms':>16}")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:<7} {r['error']}")
            continue
        fits = f"{'yes' if r['predicted'] <= budget else 'no'}/{'yes' if r['measured'] <= budget else 'no'}"
        print(f"{r['mode']:<7} {r['layers']:>6} {fmt_bytes(r['predicted']):>10} "
              f"{fmt_bytes(r['measured']):>10} {fits:>14} "
              f"{r['predicted_recompute'] / 1e9:>16.3f} / {r.get('recompute', 0.0) / 1e9:<14.3f} "
              f"{1e3 * r['slowest']:>16.3f}")
    print("(full = the pipeline recomputes each stage whole from its input, predicted so: "
          "`spmd_memory(..., whole_stage=...)`.)")


# --- planning speed -----------------------------------------------------------------
def speed(L: int, S: int, repeats: int) -> tuple[float, float]:
    """(median, best) seconds of planner.partition on L random layer times into S stages."""
    t = np.random.default_rng(0).lognormal(0.0, 1.0, L)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        planner.partition(t, S)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs), min(runs)


def main(argv) -> None:
    del argv
    sections = set(FLAGS.sections)
    unknown = sections - {"partition", "mapping", "remat", "speed", "policy"}
    if unknown:
        raise SystemExit(f"bench plan: unknown sections {sorted(unknown)}; choose from "
                         f"partition, mapping, remat, speed, policy.")
    print("Timings are wall-clock on this host, shared with other work: upper bounds.")
    if "partition" in sections or "mapping" in sections:
        ref = reference_inception(FLAGS.ref_microbatch, FLAGS.hardware)
    if "partition" in sections or "remat" in sections:
        t0 = time.perf_counter()
        spec, small = profiled_inception(FLAGS.size, FLAGS.microbatch, FLAGS.measure)
        print(f"profiled Inception-V3 ({FLAGS.size}, {len(small)} layers, microbatch "
              f"{FLAGS.microbatch}) in {time.perf_counter() - t0:.1f} s")
    if "partition" in sections:
        print("\n== partition: slowest stage (fwd + bwd per microbatch) ==")
        rows = partition_rows(f"full analytic ({FLAGS.hardware})", ref)
        rows += partition_rows(f"{FLAGS.size} profiled (this host)", small)
        print_partition(rows)
    if "mapping" in sections:
        print(f"\n== mapping on {FLAGS.topology} (inter-node link 25x slower; full-size "
              f"analytic costs, microbatch {FLAGS.ref_microbatch}, M={M}) ==")
        print_mapping(mapping_rows(ref, FLAGS.topology))
    if "remat" in sections:
        print("\n== recomputation under a budget between full and no recompute ==")
        costs = [c.scaled(FLAGS.remat_microbatch) for c in small]
        rows, budget = remat_rows(spec, costs, FLAGS.remat_modes)
        print_remat(rows, budget, FLAGS.size, FLAGS.remat_microbatch)
    if "speed" in sections:
        med, best = speed(FLAGS.speed_layers, FLAGS.speed_stages, FLAGS.repeats)
        print(f"\n== speed: partition of {FLAGS.speed_layers} layers into {FLAGS.speed_stages} "
              f"stages: best {best:.3f} s (median {med:.3f} s) of {FLAGS.repeats} runs ==")
    if "policy" in sections:
        from jaxhybrid.bench.policy_time import policy_rows, print_policy
        print("\n== checkpoint policies: the backward's recomputation, priced and measured ==")
        rows = policy_rows(FLAGS.policy_width, FLAGS.policy_microbatch, 4 * FLAGS.repeats)
        print_policy(rows, FLAGS.policy_width, FLAGS.policy_microbatch)
        from jaxhybrid.bench.policy_time import auto_rows, print_auto
        print_auto(*auto_rows(FLAGS.policy_width, FLAGS.policy_microbatch, 4 * FLAGS.repeats))


if __name__ == "__main__":
    app.run(main)
