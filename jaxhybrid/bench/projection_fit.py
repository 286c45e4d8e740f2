"""The host as a `measured_device` for the step-time model: `compute_slots` from
data-parallel scaling, the engine terms (`ENGINE_TERMS`) least-squares fitted to timed
pipelined steps of calibration models (`calibrate`; `prepare_calibration` and
`fit_calibration` when the steps are timed together with others, as `bench projection`
does). `jaxhybrid.plan.calibration` stores the fit per device kind."""
from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from jaxhybrid.bench.projection_steps import (Model, parse_val_configs, predict, prepare_step,
                                              stream_bandwidth, time_steps)
from jaxhybrid.plan import hybrid
from jaxhybrid.plan.hardware import Hardware, measured_device
from jaxhybrid.plan.layer_cost import cpu_seconds, layer_times


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


def cores_busy(costs) -> float:
    """The cores a model's measured layers kept busy on average (CPU over wall seconds,
    `LayerCost.fwd_threads`), weighted by their times."""
    wall = float(layer_times(costs).sum())
    cpu = float(sum(x.sum() for x in cpu_seconds(costs)))
    return cpu / wall if wall > 0 else 1.0


@dataclasses.dataclass
class Calibration:
    """The steps a calibration times (`steps`: DP 1x1, DP all-devices x1, then `configs`),
    prepared and run once; `fit_calibration` fits the host to their times."""
    model: Model
    cals: dict            # width -> calibration Model
    configs: list         # [(schedule, data, pipe, M, width, microbatch)]
    batch: int
    bandwidth: float      # stream bandwidth, B/s
    steps: list


def host_device(bandwidth: float, **fields) -> Hardware:
    """This host's simulated devices as a `measured_device` (before any fit: the
    boundaries every timed step uses come from it)."""
    n = jax.device_count()
    return measured_device("host_cpu", mem_bandwidth=bandwidth, devices_per_node=n,
                           description=f"{n} simulated CPU devices on {os.cpu_count()} cores",
                           **fields)


def prepare_calibration(model: Model, cal: Model, *, configs, batch: int,
                        schedule: str = "1f1b") -> Calibration:
    """The calibration's steps (`calibrate`), compiled and run once, not yet timed."""
    n = jax.device_count()
    bw = stream_bandwidth()
    steps = [prepare_step(model, data=d, pipe=1, M=1, batch=batch, boundaries=[],
                          schedule=schedule) for d in (1, n)]
    configs = [(sched or schedule, d, p, M, w, mb) for sched, d, p, M, w, mb in configs]
    cals = {cal.width: cal}
    for sched, data, pipe, M, width, mb in configs:
        m = cals.setdefault(width, cal.at_width(width))
        b = hybrid.step_time(m.costs, host_device(bw), data=data, pipe=pipe, num_microbatches=M,
                             per_worker_batch=M * mb, schedule=sched).boundaries
        steps.append(prepare_step(m, data=data, pipe=pipe, M=M, batch=M * mb, boundaries=b,
                                  schedule=sched))
    return Calibration(model, cals, configs, batch, bw, steps)


def fit_calibration(c: Calibration, times, *, schedule: str = "1f1b",
                    log=print) -> tuple[Hardware, dict]:
    """The host as a `measured_device` from the timed `c.steps` (`times`, in order): C
    from DP scaling, the engine terms (`ENGINE_TERMS`) from the pipelined configs."""
    model, n = c.model, jax.device_count()
    t1, tn, *cal_times = times
    # n replicas' compute shares C slots: t(nx1) = n r t(1x1) / C + the gradient all-reduce
    # (which 1x1 does not run), itself modelled with C; a few fixed-point rounds solve it.
    # r: the cores the model's layers kept busy when profiled (CPU over wall seconds), as
    # the step-time model prices the shared cores by CPU seconds.
    cores = min(n, os.cpu_count() or n)
    clip = lambda s: float(np.clip(s, 1.0, cores))  # noqa: E731
    device = lambda s: host_device(c.bandwidth, compute_slots=s)  # noqa: E731
    r = cores_busy(model.costs(c.batch))
    slots = clip(n * r * t1 / tn)
    for _ in range(5):
        ar = hybrid.step_time(model.costs, device(slots), data=n, pipe=1, num_microbatches=1,
                              per_worker_batch=c.batch, schedule=schedule,
                              include_update=False).allreduce_time
        slots = clip(n * r * t1 / max(tn - ar, 1e-9))
    log(f"calibration: stream bandwidth {c.bandwidth / 1e9:.1f} GB/s; DP scaling "
        f"t(1x1)={t1 * 1e3:.2f} ms, t({n}x1)={tn * 1e3:.2f} "
        f"ms (all-reduce {ar * 1e3:.2f} ms), layers' cores busy {r:.2f} -> compute_slots "
        f"C={slots:.2f} (host cores: "
        f"{os.cpu_count()})")
    meas = list(zip(c.configs, cal_times))
    hw, res = fit_engine_terms(
        device(slots), meas, lambda hw, k: predict(c.cals[k[4]], hw, data=k[1], pipe=k[2],
                                                   M=k[3], batch=k[3] * k[5],
                                                   schedule=k[0]).step_time,
        max_slots=cores)
    name = lambda k: (f"{k[0]}:" if k[0] != schedule else "") + "x".join(map(str, k[1:4])) + (  # noqa: E731
        f"@{k[4]}" + (f"/{k[5]}" if k[5] != 1 else ""))
    info = dict(stream_bandwidth=c.bandwidth, dp_1x1=t1, dp_nx1=tn, compute_slots=slots,
                profile_timing=model.timing, **{f: getattr(hw, f) for f, *_ in ENGINE_TERMS},
                rows=[dict(config=name(k), measured=t) for k, t in meas], residuals=res)
    log("calibration: engine " + ", ".join(
        f"{f}={getattr(hw, f) / unit:.3g}" + (" us" if unit == 1e-6 else "")
        for f, unit, *_ in ENGINE_TERMS) + " (us: per device per tick / task / collective / "
        "step; tick_param_bytes: B per packed parameter per device per tick; fit to "
        + ", ".join(f"{r['config']} {e:+.0%}" for r, e in zip(info["rows"], res))
        + " (config@width[/microbatch]))")
    return hw, info


def calibrate(model: Model, cal: Model, *, configs, batch: int, schedule: str = "1f1b",
              runs: int = 7, reduce: str = "median", log=print) -> tuple[Hardware, dict]:
    """The host as a `measured_device`: C from DP scaling of `model` (1x1 vs all-devices x1
    at per-worker `batch`), the engine terms (`ENGINE_TERMS`) from pipelined runs of `cal`
    at other widths: `configs` [(schedule, data, pipe, M, width, microbatch)]
    (`parse_cal_configs`; schedule None: `schedule`)."""
    c = prepare_calibration(model, cal, configs=configs, batch=batch, schedule=schedule)
    return fit_calibration(c, time_steps(c.steps, runs, reduce), schedule=schedule, log=log)
