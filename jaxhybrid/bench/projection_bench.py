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
runs after a warm-up, with the planner's boundaries (the model predicts the split that
ran). The runs go round robin over all rows: a burst of load from other processes slows
every row a little rather than one row a lot. When the calibration is fitted in the same
run, its steps join the same rounds: this host's speed drifts by tens of percent over the
minutes a run takes, and a fit timed minutes before the rows mis-predicts all of them
alike (the same steps ran 40% slower a few minutes after their calibration, 2026-11-26).
Rows: data x pipe x M; predicted (compute, engine, all-reduce parts) and measured ms,
relative error, the same without the engine terms, and the noise of the measurement
(the validation steps are timed in two passes of --runs rounds each; the row's measured
time is their minimum, or with --reduce=median their mean; noise = |pass 1 / pass 2 - 1|);
then the mean absolute relative error, the rank correlation of predicted vs measured and
the mean and worst noise: an error below the noise says nothing about the model.

The steps and the model's estimate of them are `projection_steps`; the calibration's fit
is `projection_fit`; this module is the bench (flags, validation rows, the report).

Timings on a shared machine are noisy (other processes take cores); the figures are
a check of the model's structure (bubbles, ticks, serialisation, engine overheads),
not of absolute CPU speed.
"""
from __future__ import annotations

import os
import time

if "jax" not in __import__("sys").modules:   # simulated devices must exist before jax starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from absl import flags

from jaxhybrid.bench.projection_fit import (  # noqa: F401  (the bench's API, used by tests)
    ENGINE_TERMS, SLOT_TERMS, Calibration, calibrate, fit_calibration, fit_engine_terms,
    host_device, parse_cal_configs, prepare_calibration)
from jaxhybrid.bench.projection_steps import (  # noqa: F401
    Model, combine_passes, measure_step, parse_configs, parse_val_configs, predict, prepare_step,
    stream_bandwidth, time_steps)
from jaxhybrid.plan import hybrid
from jaxhybrid.plan.hardware import Hardware

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


def prepare_validation(model: Model, configs, *, batch: int, hw: Hardware,
                       schedule: str = "1f1b") -> tuple[list[dict], list]:
    """(rows, steps) of the validation configs (`validate`), each step compiled and run
    once with the planner's boundaries on `hw`; the rows carry what `finish_validation`
    needs to predict them."""
    models = {model.width: model}
    rows, steps = [], []
    for config in configs:
        sched, data, pipe, M, width = (config if len(config) == 5
                                       else (schedule, *config, model.width))
        sched = sched or schedule
        m = models.setdefault(width, model.at_width(width))
        boundaries = predict(m, hw, data=data, pipe=pipe, M=M, batch=batch,
                             schedule=sched).boundaries
        steps.append(prepare_step(m, data=data, pipe=pipe, M=M, batch=batch,
                                  boundaries=boundaries, schedule=sched))
        name = (f"{sched}:" if sched != schedule else "") + f"{data}x{pipe}x{M}" + (
            f"@{width}" if width != model.width else "")
        rows.append(dict(config=name, schedule=sched, width=width, data=data, pipe=pipe, M=M,
                         batch=batch, boundaries=boundaries, model=m))
    return rows, steps


def finish_validation(rows, hw: Hardware, first, second, reduce: str = "median") -> list[dict]:
    """The rows of `prepare_validation` with the model's prediction on `hw` (at the
    boundaries measured) and the measured time from two timing passes (`first`,
    `second`: seconds per row): what they disagree by is the noise of the measured
    steps themselves (other processes on the host), below which no error is meaningful."""
    compute_only = hw.replace(**{f: 0.0 for f, *_ in ENGINE_TERMS if f not in SLOT_TERMS})
    out = []
    for row, a, b in zip(rows, first, second):
        r = {k: v for k, v in row.items() if k not in ("model", "batch")}
        m = row["model"]
        kw = dict(data=r["data"], pipe=r["pipe"], num_microbatches=r["M"],
                  per_worker_batch=row["batch"], schedule=r["schedule"], include_update=False,
                  boundaries=r["boundaries"] if r["pipe"] > 1 else None)
        est = hybrid.step_time(m.costs, hw, **kw)
        bare = hybrid.step_time(m.costs, compute_only, **kw)
        t = combine_passes(a, b, reduce)
        r.update(bubble=est.bubble_fraction, predicted=est.step_time, compute=est.compute_time,
                 engine=est.engine_time, allreduce=est.allreduce_time,
                 compute_only=bare.step_time, measured=t, rel_error=est.step_time / t - 1.0,
                 pass_spread=abs(a / b - 1.0))
        out.append(r)
    return out


def validate(model: Model, hw: Hardware, configs, *, batch: int, schedule: str = "1f1b",
             runs: int = 7, reduce: str = "median") -> list[dict]:
    """Predicted vs measured step for each (data, pipe, M), or each (schedule, data, pipe,
    M, width) (`parse_val_configs`; other widths: a `Model` of that width, same depth)."""
    rows, steps = prepare_validation(model, configs, batch=batch, hw=hw, schedule=schedule)
    first, second = time_steps(steps, runs, reduce), time_steps(steps, runs, reduce)
    return finish_validation(rows, hw, first, second, reduce)


def calibrate_and_validate(model: Model, cal: Model, val_configs, *, cal_configs, batch: int,
                           schedule: str = "1f1b", runs: int = 7, reduce: str = "median",
                           log=print) -> tuple[Hardware, dict, list[dict]]:
    """`calibrate` and `validate` with every step timed in the same rounds: the host's speed
    drifts by tens of percent over the minutes a run takes (the same step measured 40%
    slower a few minutes later, every step alike), and a fit taken before that drift
    would mis-predict every row after it. Both timing passes time the calibration's steps
    too; the fit uses the faster (reduce="min") or mean of the two. The layers are profiled
    once more after the timing (`Model.reprofile`), for the same reason."""
    c = prepare_calibration(model, cal, configs=cal_configs, batch=batch, schedule=schedule)
    rows, steps = prepare_validation(model, val_configs, batch=batch,
                                     hw=host_device(c.bandwidth), schedule=schedule)
    k = len(c.steps)
    first = time_steps(c.steps + steps, runs, reduce)
    second = time_steps(c.steps + steps, runs, reduce)
    for m in {id(m): m for m in [c.model, *c.cals.values(), *(r["model"] for r in rows)]}.values():
        m.reprofile()
    hw, info = fit_calibration(c, [combine_passes(a, b, reduce)
                                   for a, b in zip(first[:k], second[:k])],
                               schedule=schedule, log=log)
    return hw, info, finish_validation(rows, hw, first[k:], second[k:], reduce)


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
    header = (f"\nvalidation model: {FLAGS.val_blocks} residual Dense(width) blocks (width "
              f"{FLAGS.val_width} unless @width) + head, per-worker batch {FLAGS.val_batch}, "
              f"schedule {FLAGS.schedule}; times in ms (held out: none of these configs was "
              f"fitted)")
    if stored is not None:
        hw, doc = stored
        fitted_with = doc["info"].get("profile_timing", "alone")
        if fitted_with != FLAGS.profile_timing:
            raise SystemExit(f"bench projection: the stored calibration was fitted with "
                             f"--profile_timing={fitted_with}; pass that, or "
                             f"--calibration=fit to fit one for {FLAGS.profile_timing}.")
        info = {**doc["info"], "stored": str(calibration.path(cache_dir)), "saved": doc["saved"]}
        print(f"calibration: stored fit of {doc['device']} from {doc['saved']} "
              f"({calibration.path(cache_dir)}): " + ", ".join(
                  f"{k}={v:.4g}" for k, v in doc["terms"].items()))
        print(header)
        rows = validate(model, hw, configs, batch=FLAGS.val_batch, schedule=FLAGS.schedule,
                        runs=FLAGS.runs, reduce=FLAGS.reduce)
    else:
        # Calibration and validation steps timed in the same rounds (the host drifts).
        hw, info, rows = calibrate_and_validate(
            model, cal, configs, cal_configs=parse_cal_configs(FLAGS.cal_configs, None, cal.width),
            batch=FLAGS.val_batch, schedule=FLAGS.schedule, runs=FLAGS.runs, reduce=FLAGS.reduce)
        print(f"calibration stored in {calibration.save(hw, cache_dir, info)}")
        print(header)
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
