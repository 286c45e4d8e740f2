"""Step-time model vs the real engine: predicted and measured pipeline steps on this host.

    python scripts/bench.py projection [--val_configs=1x2x2,zb-h1:1x4x8@384,...] [--runs=7]
                                       [--calibration=auto|fit|stored] [--cache_dir=DIR]
                                       [--cal_configs=1x2x8@8,2x2x4@512/8,...] [--reduce=min]
                                       [--profile_timing=alone|loop]

The "hardware" is this host: 8 simulated CPU devices that share its cores. The model is
`jaxhybrid.plan.hybrid.step_time` on `measured_device` with

  layer times     `plan.profile(measure=True)` of every layer on one device, at each
                  microbatch size run (times are not linear in the batch on a CPU);
  compute_slots   C, how many simulated devices' work runs at once, from data-parallel
                  scaling of the validation model: C = 8 t(1x1) / t(8x1) (pipe = 1, no
                  ticks; same per-device batch). It depends on the model's op sizes
                  (XLA splits big ops over the cores, so one device may already use
                  them all) and on what else runs on the host, so it is measured here
                  and now; those two calibration runs are not validation rows;
  mem_bandwidth   a streaming-add microbenchmark on one device;
  engine terms    `ENGINE_TERMS`: `lockstep_slots` (devices computing at once inside the
                  pipelined program), the engine's work per step, tick, packed parameter,
                  task and collective, and its waiting per tick, least-squares fitted to
                  pipelined runs of *calibration* models (`--cal_configs`: the same MLP
                  at widths 8, 128 and 512, none a validation width; width 8 shows the
                  engine alone, width 512 at microbatch 1 the per-parameter cost, larger
                  microbatches the slots).

So every validation row (each pipelined config, and DP at data 2 and 4) is held out:
no number was fitted on it. A validation config is `[schedule:]DATAxPIPExM[@width]`
(default schedule --schedule, width --val_width): the rows cover schedules, meshes,
microbatch counts and model widths.

The fitted terms are stored per device kind (`jaxhybrid.plan.calibration`, in
--cache_dir): --calibration=auto reuses a stored fit and fits (and stores) one when
there is none, fit always fits anew, stored requires one.

Each row is a real `jaxhybrid.pipeline.Pipeline` step (`value_and_grad`, jitted, inputs
sharded as in training), the median (--reduce=min: the minimum) wall time of `--runs`
runs after a warm-up, with the planner's boundaries (the ones the model assumes). The
runs go round robin over all rows (and over all calibration runs): a burst of load from
other processes slows every row a little rather than one row a lot.
Rows: data x pipe x M; predicted (compute, engine, all-reduce parts) and measured ms,
relative error, the same without the engine terms, and the noise of the measurement
(the validation steps are timed in two passes of --runs rounds each; the row's measured
time is their minimum, or with --reduce=median their mean; noise = |pass 1 / pass 2 - 1|);
then the mean absolute relative error, the rank correlation of predicted vs measured and
the mean and worst noise: an error below the noise says nothing about the model.

Timings on a shared machine are noisy (other processes take cores); the figures are
a check of the model's structure (bubbles, ticks, serialisation, engine overheads),
not of absolute CPU speed.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time

if "jax" not in __import__("sys").modules:   # simulated devices must exist before jax starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import jaxhybrid as jh
from jaxhybrid.bench.mlp import Block, Head, xent
from jaxhybrid import pipeline as jp
from jaxhybrid.models.spec import init_layers
from jaxhybrid.plan import hybrid
from jaxhybrid.plan.costs import profile
from jaxhybrid.plan.hardware import Hardware, measured_device

FLAGS = flags.FLAGS
flags.DEFINE_integer("val_width", 256, "validation model: hidden width of the residual MLP.")
flags.DEFINE_integer("val_blocks", 7, "validation model: residual blocks (+ 1 head layer).")
flags.DEFINE_integer("val_batch", 32, "per-worker batch (examples per data replica).")
flags.DEFINE_list("val_configs", "2x1x1,1x2x2,1x2x8,2x2x4,4x2x2,1x4x4,1x4x8,1x8x8,"
                  "gpipe:1x4x8,gpipe:2x2x4@384,zb-h1:1x4x8,zb-h1:2x2x4@384,"
                  "interleaved:1x4x8@384,1x2x8@384",
                  "validation configs, [schedule:]data x pipe x microbatches[@width].")
flags.DEFINE_integer("cal_width", 512, "calibration model width (same depth; wider than the "
                     "validation model so the per-parameter engine cost shows).")
flags.DEFINE_list("cal_configs", "1x2x8@8,1x8x4@8,2x2x4@8,4x2x2@8,zb-h1:1x4x4@8,zb-h1:2x2x8@8,"
                  "gpipe:1x2x8@8,interleaved:1x2x4@8,1x2x8,1x8x8,2x4x4,2x2x4@512/8,1x8x4@512/4,"
                  "1x4x2@128/16",
                  "calibration configs, [schedule:]data x pipe x M[@width][/microbatch] (default "
                  "width --cal_width, microbatch 1): width 8 shows the engine's costs alone "
                  "(per tick, task, collective, step), two widths tell the per-parameter cost "
                  "from the fixed ones, larger microbatches how many devices compute at once.")
flags.DEFINE_string("schedule", "1f1b", "pipeline schedule of calibration and of the "
                    "validation configs that name none.")
flags.DEFINE_integer("runs", 7, "timed runs per configuration.")
flags.DEFINE_enum("reduce", "median", ["median", "min"], "how the timed runs of one "
                  "configuration, and of each profiled layer, are summarised (min: steadier on a "
                  "busy machine).")
flags.DEFINE_enum("profile_timing", "alone", ["alone", "loop"], "how each layer is timed "
                  "(plan.profile's timing): alone, less a compiled no-op's call; or one "
                  "application of many in a compiled loop, weights cycled through copies as "
                  "large as the model. A stored calibration was fitted with one of them: use "
                  "--calibration=fit when changing it.")
flags.DEFINE_string("json_out", None, "also write the rows and the calibration as JSON here.")
flags.DEFINE_enum("calibration", "auto", ["auto", "fit", "stored"], "auto: the stored fit of "
                  "this device kind if there is one, else fit and store; fit: fit anew and "
                  "store; stored: the stored fit or an error.")
flags.DEFINE_string("cache_dir", None, "where calibrations are stored (default: "
                    "jaxhybrid.startup.default_cache_dir(), ~/.cache/jaxhybrid)")


# --- the model --------------------------------------------------------------------------
@dataclasses.dataclass
class Model:
    """A residual MLP as pipeline layers, its per-layer variables and a batch maker."""
    width: int
    blocks: int
    reduce: str = "median"    # of each layer's timed runs (profile's `reduce`)
    profile_rounds: int = 3   # profiles per microbatch size, per layer the least (`costs`)
    timing: str = "alone"     # how each layer is timed (profile's `timing`)

    def __post_init__(self):
        self.layers = [Block(self.width) for _ in range(self.blocks)] + [Head()]
        x = jnp.zeros((1, self.width), jnp.float32)
        self.variables = init_layers(self.layers, jax.random.key(0), x)
        self._costs: dict = {}

    def batch(self, n: int, seed: int = 0):
        r = np.random.default_rng(seed)
        return (r.standard_normal((n, self.width), np.float32),
                r.integers(0, 10, n).astype(np.int32))

    def costs(self, m: int, repeats: int = 7):
        """Measured per-layer costs at microbatch m (profiled once per size): each layer's
        times the least of `profile_rounds` profiles (seconds apart; reduce="min") or their
        median, so that a burst of load during one layer's timed runs does not make it
        the slowest layer of the model."""
        if m not in self._costs:
            runs = [profile(self.layers, self.batch(m)[0], measure=True, repeats=repeats,
                            variables=self.variables, reduce=self.reduce, timing=self.timing)
                    for _ in range(max(1, self.profile_rounds))]
            pick = min if self.reduce == "min" else statistics.median
            self._costs[m] = [dataclasses.replace(
                layer, fwd_time=pick([r[i].fwd_time for r in runs]),
                bwd_time=pick([r[i].bwd_time for r in runs])) for i, layer in enumerate(runs[0])]
        return self._costs[m]


def parse_configs(items) -> list[tuple[int, int, int]]:
    """["2x4x8", ...] -> [(data, pipe, M), ...]."""
    return [c[1:4] for c in parse_val_configs(items, None, 0)]


def parse_val_configs(items, schedule: str | None, width: int) -> list[tuple]:
    """["zb-h1:2x4x8@384", "1x2x2", ...] -> [(schedule, data, pipe, M, width), ...]; the
    schedule and width default to the arguments."""
    from jaxhybrid.schedules import SCHEDULES
    out = []
    for item in items:
        text = str(item).lower()
        sched, _, text = text.rpartition(":") if ":" in text else (schedule, "", text)
        text, _, w = text.partition("@")
        parts = text.split("x")
        if (len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts)
                or (w and not w.isdigit())):
            raise ValueError(f"config {item!r}: write [schedule:]data x pipe x microbatches"
                             f"[@width], e.g. 2x4x8 or zb-h1:1x4x8@384.")
        if sched is not None and sched not in SCHEDULES:
            raise ValueError(f"config {item!r}: unknown schedule {sched!r}; choose one of "
                             f"{', '.join(SCHEDULES)}.")
        out.append((sched, *(int(p) for p in parts), int(w) if w else width))
    return out


# --- measuring --------------------------------------------------------------------------
def prepare_step(model: Model, *, data: int, pipe: int, M: int, batch: int, boundaries,
                 schedule: str = "1f1b"):
    """A real Pipeline value_and_grad step (jitted, inputs sharded as in training), compiled
    and run once: a no-argument function that runs it and waits for the result."""
    mesh = jh.make_mesh(data=data, pipe=pipe, devices=jax.devices()[:data * pipe])
    p = jp.Pipeline(model.layers, mesh=mesh, num_microbatches=M, schedule=schedule,
                    boundaries=list(boundaries) if pipe > 1 else [], remat="none")
    variables = p.pack(model.variables)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x, y = jax.device_put(model.batch(data * batch), sharding)
    step = p.value_and_grad(xent)
    run = lambda: jax.block_until_ready(step(variables, x, y))  # noqa: E731
    run()
    return run


def time_steps(runs_of, runs: int = 7, reduce: str = "median") -> list[float]:
    """Wall seconds of each prepared step: `runs` rounds, each timing every step once in
    turn (round robin), so a burst of load from other processes hits all of them alike
    instead of one; per step the median of its runs, or (reduce="min") the minimum,
    steadier on a shared host since interference only ever adds time."""
    times = [[] for _ in runs_of]
    for _ in range(max(1, runs)):
        for i, run in enumerate(runs_of):
            t0 = time.perf_counter()
            run()
            times[i].append(time.perf_counter() - t0)
    return [float(min(t) if reduce == "min" else statistics.median(t)) for t in times]


def measure_step(model: Model, *, data: int, pipe: int, M: int, batch: int, boundaries,
                 schedule: str = "1f1b", runs: int = 7, reduce: str = "median") -> float:
    """Wall seconds of one real Pipeline value_and_grad step (`prepare_step`, `time_steps`)."""
    return time_steps([prepare_step(model, data=data, pipe=pipe, M=M, batch=batch,
                                    boundaries=boundaries, schedule=schedule)], runs, reduce)[0]


def stream_bandwidth(n: int = 1 << 20, loops: int = 20, runs: int = 5) -> float:
    """Bytes/s of a jitted streaming add (read 2, write 1 float32 per element) on one
    device, dispatch overhead excluded by looping inside the program."""
    a = jnp.ones(n, jnp.float32)
    f = jax.jit(lambda a: jax.lax.fori_loop(0, loops, lambda i, c: c + a * 0.5, a))
    jax.block_until_ready(f(a))
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a))
        ts.append(time.perf_counter() - t0)
    return 12.0 * n * loops / statistics.median(ts)


# --- the model's prediction -------------------------------------------------------------
def predict(model: Model, hw: Hardware, *, data: int, pipe: int, M: int, batch: int,
            schedule: str = "1f1b") -> hybrid.Estimate:
    """The step-time model's estimate of one value_and_grad step (no optimizer update)."""
    if batch % M:
        raise ValueError(f"M={M} does not divide the per-worker batch {batch}.")
    est = hybrid.step_time(model.costs, hw, data=data, pipe=pipe, num_microbatches=M,
                           per_worker_batch=batch, schedule=schedule, include_update=False)
    if not est.feasible:
        raise ValueError(f"{data}x{pipe}x{M}: {est.reason}")
    return est


def parse_cal_configs(items, schedule: str | None, width: int) -> list[tuple]:
    """["zb-h1:1x4x4@8/4", "1x2x8", ...] -> [(schedule, data, pipe, M, width, microbatch),
    ...]: a validation config (`parse_val_configs`) with an optional "/microbatch"
    (examples per microbatch, default 1)."""
    out = []
    for item in items:
        text, _, mb = str(item).partition("/")
        if mb and not (mb.isdigit() and int(mb) > 0):
            raise ValueError(f"config {item!r}: the microbatch after '/' must be a positive "
                             f"integer, e.g. 2x2x4@512/8.")
        out.append((*parse_val_configs([text], schedule, width)[0], int(mb) if mb else 1))
    return out


# The engine terms `calibrate` fits: (Hardware field, unit of the fitted number, start,
# lower bound). lockstep_slots is relative to the profile's layer times, which a lone
# device measures with all the host's intra-op threads to itself (on XLA CPU a
# pipelined program's devices run nearly one at a time, each with fewer threads than
# that), and is what one device would get (`lockstep_contention` divides it by
# devices ** contention): it may be below 1, and its upper bound is twice the host's
# cores; the contention's is 1 (slots falling as 1 / devices: one device at a time).
ENGINE_TERMS = (("lockstep_slots", 1.0, 1.0, 0.25), ("lockstep_contention", 1.0, 0.0, 0.0),
                ("launch_overhead", 1e-6, 100.0, 0.0),
                ("tick_overhead", 1e-6, 10.0, 0.0), ("tick_param_bytes", 1.0, 4.0, 0.0),
                ("task_overhead", 1e-6, 10.0, 0.0), ("weight_task_overhead", 1e-6, 10.0, 0.0),
                ("collective_overhead", 1e-6, 10.0, 0.0),
                ("tick_latency", 1e-6, 10.0, 0.0))

# The terms that say how many devices compute at once (kept when the engine's costs
# are left out of a prediction).
SLOT_TERMS = ("lockstep_slots", "lockstep_contention")


def fit_engine_terms(base: Hardware, measured, predict_fn, max_slots: float) -> tuple[Hardware, list]:
    """Least-squares fit of the `ENGINE_TERMS` of `base` to measured steps (relative
    residuals): `measured` [(config, seconds)], `predict_fn(hw, config)` the model's
    seconds. Returns (the fitted Hardware, the residuals)."""
    from scipy.optimize import least_squares

    def hardware(x):
        return base.replace(**{f: float(v) * unit for (f, unit, _, _), v in zip(ENGINE_TERMS, x)})

    def residuals(x):
        hw = hardware(x)
        return [predict_fn(hw, c) / t - 1 for c, t in measured]

    lo = [b for *_, b in ENGINE_TERMS]
    upper = dict(lockstep_slots=2 * max(max_slots, 1.0), lockstep_contention=1.0)
    hi = [upper.get(f, np.inf) for f, *_ in ENGINE_TERMS]
    fits = []
    # The slots and the per-device work trade off (more slots, more work per device):
    # start from a few slot counts and keep the best fit.
    for slots in (0.5, 1.0, max(max_slots, 1.0)):
        x0 = [min(max(slots if f == "lockstep_slots" else s, l), h)
              for (f, _, s, _), l, h in zip(ENGINE_TERMS, lo, hi)]
        fits.append(least_squares(residuals, x0, bounds=(lo, hi), x_scale="jac"))
    best = min(fits, key=lambda f: f.cost).x
    return hardware(best), [float(r) for r in residuals(best)]


def calibrate(model: Model, cal: Model, *, configs, batch: int, schedule: str = "1f1b",
              runs: int = 7, reduce: str = "median", log=print) -> tuple[Hardware, dict]:
    """The host as a `measured_device`: C from DP scaling of `model` (1x1 vs all-devices x1
    at per-worker `batch`), the engine terms (`ENGINE_TERMS`) from pipelined runs of `cal`
    at other widths: `configs` [(schedule, data, pipe, M, width, microbatch)]
    (`parse_cal_configs`; schedule None: `schedule`)."""
    n = jax.device_count()
    bw = stream_bandwidth()
    steps = [prepare_step(model, data=d, pipe=1, M=1, batch=batch, boundaries=[],
                          schedule=schedule) for d in (1, n)]
    configs = [(sched or schedule, d, p, M, w, mb) for sched, d, p, M, w, mb in configs]
    cals = {cal.width: cal}
    for sched, data, pipe, M, width, mb in configs:
        m = cals.setdefault(width, Model(width, cal.blocks, cal.reduce, cal.profile_rounds,
                                         cal.timing))
        b = hybrid.step_time(m.costs, measured_device("host_cpu", mem_bandwidth=bw),
                             data=data, pipe=pipe, num_microbatches=M, per_worker_batch=M * mb,
                             schedule=sched).boundaries
        steps.append(prepare_step(m, data=data, pipe=pipe, M=M, batch=M * mb, boundaries=b,
                                  schedule=sched))
    t1, tn, *cal_times = time_steps(steps, runs, reduce)
    # n replicas' compute shares C slots: t(nx1) = n t(1x1) / C + the gradient all-reduce
    # (which 1x1 does not run), itself modelled with C; a few fixed-point rounds solve it.
    cores = min(n, os.cpu_count() or n)
    clip = lambda c: float(np.clip(c, 1.0, cores))
    device = lambda c: measured_device(
        "host_cpu", mem_bandwidth=bw, devices_per_node=n, compute_slots=c,
        description=f"{n} simulated CPU devices on {os.cpu_count()} cores")
    slots = clip(n * t1 / tn)
    for _ in range(5):
        ar = hybrid.step_time(model.costs, device(slots), data=n, pipe=1, num_microbatches=1,
                              per_worker_batch=batch, schedule=schedule,
                              include_update=False).allreduce_time
        slots = clip(n * t1 / max(tn - ar, 1e-9))
    log(f"calibration: stream bandwidth {bw / 1e9:.1f} GB/s; DP scaling t(1x1)={t1 * 1e3:.2f} ms, "
        f"t({n}x1)={tn * 1e3:.2f} ms (all-reduce {ar * 1e3:.2f} ms) -> compute_slots "
        f"C={slots:.2f} (host cores: {os.cpu_count()})")
    meas = list(zip(configs, cal_times))
    hw, res = fit_engine_terms(
        device(slots), meas, lambda hw, c: predict(cals[c[4]], hw, data=c[1], pipe=c[2], M=c[3],
                                                   batch=c[3] * c[5], schedule=c[0]).step_time,
        max_slots=cores)
    name = lambda c: (f"{c[0]}:" if c[0] != schedule else "") + "x".join(map(str, c[1:4])) + (
        f"@{c[4]}" + (f"/{c[5]}" if c[5] != 1 else ""))
    info = dict(stream_bandwidth=bw, dp_1x1=t1, dp_nx1=tn, compute_slots=slots,
                **{f: getattr(hw, f) for f, *_ in ENGINE_TERMS},
                rows=[dict(config=name(c), measured=t) for c, t in meas], residuals=res)
    log("calibration: engine " + ", ".join(
        f"{f}={getattr(hw, f) / unit:.3g}" + (" us" if unit == 1e-6 else "")
        for f, unit, *_ in ENGINE_TERMS) + " (us: per device per tick / task / collective / "
        f"step; tick_param_bytes: B per packed parameter per device per tick; fit to "
        + ", ".join(f"{r['config']} {e:+.0%}" for r, e in zip(info["rows"], res))
        + " (config@width[/microbatch]))")
    return hw, info


def validate(model: Model, hw: Hardware, configs, *, batch: int, schedule: str = "1f1b",
             runs: int = 7, reduce: str = "median") -> list[dict]:
    """Predicted vs measured step for each (data, pipe, M), or each (schedule, data, pipe,
    M, width) (`parse_val_configs`; other widths: a `Model` of that width, same depth)."""
    compute_only = hw.replace(**{f: 0.0 for f, *_ in ENGINE_TERMS if f not in SLOT_TERMS})
    models = {model.width: model}
    rows, steps = [], []
    for config in configs:
        sched, data, pipe, M, width = (config if len(config) == 5
                                       else (schedule, *config, model.width))
        sched = sched or schedule
        m = models.setdefault(width, Model(width, model.blocks, model.reduce,
                                           model.profile_rounds, model.timing))
        est = predict(m, hw, data=data, pipe=pipe, M=M, batch=batch, schedule=sched)
        bare = predict(m, compute_only, data=data, pipe=pipe, M=M, batch=batch, schedule=sched)
        steps.append(prepare_step(m, data=data, pipe=pipe, M=M, batch=batch,
                                  boundaries=est.boundaries, schedule=sched))
        name = (f"{sched}:" if sched != schedule else "") + f"{data}x{pipe}x{M}" + (
            f"@{width}" if width != model.width else "")
        rows.append(dict(config=name, schedule=sched, width=width, data=data, pipe=pipe, M=M,
                         boundaries=est.boundaries, bubble=est.bubble_fraction,
                         predicted=est.step_time, compute=est.compute_time,
                         engine=est.engine_time, allreduce=est.allreduce_time,
                         compute_only=bare.step_time))
    # Two passes of `runs` rounds each: what they disagree by is the noise of the measured
    # steps themselves (other processes on the host), below which no error is meaningful.
    first, second = time_steps(steps, runs, reduce), time_steps(steps, runs, reduce)
    for r, a, b in zip(rows, first, second):
        t = min(a, b) if reduce == "min" else (a + b) / 2
        r.update(measured=t, rel_error=r["predicted"] / t - 1.0, pass_spread=abs(a / b - 1.0))
    return rows


def rank_correlation(a, b) -> float:
    """Spearman's rho (no ties expected in timings)."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def summary(rows) -> dict:
    err = np.array([r["rel_error"] for r in rows])
    bare = np.array([r["compute_only"] / r["measured"] - 1 for r in rows])
    spread = np.array([r.get("pass_spread", np.nan) for r in rows])
    return dict(mean_abs_rel_error=float(np.abs(err).mean()),
                max_abs_rel_error=float(np.abs(err).max()),
                mean_pass_spread=float(spread.mean()), max_pass_spread=float(spread.max()),
                compute_only_mean_abs_rel_error=float(np.abs(bare).mean()),
                rank_correlation=rank_correlation([r["predicted"] for r in rows],
                                                  [r["measured"] for r in rows]))


def print_rows(rows) -> None:
    print(f"{'data x pipe x M':>15} {'bubble':>7} {'compute':>8} {'engine':>8} {'allred':>7} "
          f"{'predicted':>9} {'measured':>9} {'error':>7} | {'no-engine':>9} {'error':>7} "
          f"{'noise':>6}")
    for r in rows:
        print(f"{r['config']:>15} {r['bubble']:>7.3f} {r['compute'] * 1e3:>8.2f} "
              f"{r['engine'] * 1e3:>8.2f} {r['allreduce'] * 1e3:>7.2f} "
              f"{r['predicted'] * 1e3:>9.2f} {r['measured'] * 1e3:>9.2f} {r['rel_error']:>+7.0%} | "
              f"{r['compute_only'] * 1e3:>9.2f} {r['compute_only'] / r['measured'] - 1:>+7.0%} "
              f"{r.get('pass_spread', float('nan')):>6.0%}")


def main(argv) -> None:
    del argv
    import json
    n = jax.device_count()
    if n < 8:
        raise SystemExit(f"bench projection: needs 8 devices, found {n}; on CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count=8.")
    try:
        configs = parse_val_configs(FLAGS.val_configs, FLAGS.schedule, FLAGS.val_width)
    except ValueError as e:
        raise SystemExit(f"bench projection: {e}")
    for _, d, p, M, _ in configs:
        if d * p > n or FLAGS.val_batch % M or p > FLAGS.val_blocks + 1:
            raise SystemExit(f"bench projection: config {d}x{p}x{M} needs data*pipe <= {n}, M "
                             f"dividing --val_batch={FLAGS.val_batch}, pipe <= layers.")
    t0 = time.perf_counter()
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    print(f"host: {n} x {jax.devices()[0].platform} devices, {os.cpu_count()} cores, load "
          f"average {load[0]:.2f} (timings are noisy when other processes use the cores)")
    model = Model(FLAGS.val_width, FLAGS.val_blocks, FLAGS.reduce, timing=FLAGS.profile_timing)
    cal = Model(FLAGS.cal_width, FLAGS.val_blocks, FLAGS.reduce, timing=FLAGS.profile_timing)
    from jaxhybrid import startup
    from jaxhybrid.plan import calibration
    cache_dir = FLAGS.cache_dir or startup.default_cache_dir()
    stored = None if FLAGS.calibration == "fit" else calibration.load(cache_dir)
    if stored is None and FLAGS.calibration == "stored":
        raise SystemExit(f"bench projection: no stored calibration for {calibration.device_key()} "
                         f"in {cache_dir}; run with --calibration=fit first.")
    if stored is not None:
        hw, doc = stored
        info = {**doc["info"], "stored": str(calibration.path(cache_dir)), "saved": doc["saved"]}
        print(f"calibration: stored fit of {doc['device']} from {doc['saved']} "
              f"({calibration.path(cache_dir)}): " + ", ".join(
                  f"{k}={v:.4g}" for k, v in doc["terms"].items()))
    else:
        hw, info = calibrate(model, cal, configs=parse_cal_configs(FLAGS.cal_configs, None,
                                                                   cal.width),
                             batch=FLAGS.val_batch, schedule=FLAGS.schedule, runs=FLAGS.runs,
                             reduce=FLAGS.reduce)
        print(f"calibration stored in {calibration.save(hw, cache_dir, info)}")
    print(f"\nvalidation model: {FLAGS.val_blocks} residual Dense(width) blocks (width "
          f"{FLAGS.val_width} unless @width) + "
          f"head, per-worker batch {FLAGS.val_batch}, schedule {FLAGS.schedule}; times in ms "
          f"(held out: none of these configs was used above)")
    rows = validate(model, hw, configs, batch=FLAGS.val_batch, schedule=FLAGS.schedule,
                    runs=FLAGS.runs, reduce=FLAGS.reduce)
    print_rows(rows)
    s = summary(rows)
    print(f"mean |error| {s['mean_abs_rel_error']:.1%} (max {s['max_abs_rel_error']:.1%}); "
          f"without the engine terms {s['compute_only_mean_abs_rel_error']:.1%}; rank "
          f"correlation predicted vs measured {s['rank_correlation']:.2f}; measured steps' "
          f"noise (two timing passes disagree by) mean {s['mean_pass_spread']:.1%}, max "
          f"{s['max_pass_spread']:.1%}; "
          f"bench took {time.perf_counter() - t0:.0f} s")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(dict(calibration=info, rows=rows, summary=s, load_average=load[0]), f,
                      indent=1)
