"""`python scripts/bench.py burst`: what burst parallelism and multiplexing cost on the 8
simulated CPU devices, and how well the planner's device-time accounting predicts them.

Prints (figures, never pass/fail):
  1. CPU-seconds of a burst train step vs a data-parallel step of the same work (same
     model, global batch, devices; target <= 1.10x);
  2. CPU-seconds of the multiplexed pair (foreground burst step + background job in its
     idle branches) vs the two run one after the other (target <= 1.10x), and the
     foreground's wall-clock slowdown (on CPU the simulated devices share the cores, so
     background work slows the foreground here; on a GPU it would fill idle time);
  3. validation: device-time the planner predicts (per-layer forward and backward
     CPU-seconds timed on this host at every per-device batch) vs the CPU-seconds measured
     for the DP and burst steps, with the predicted busy time per device;
  4. the small-batch efficiency model fitted on this host (per layer kind).
Process CPU time (`time.process_time`, all threads) is used because the simulated
devices share two cores: like is compared with like, in one run, repeats interleaved.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags

from jaxhybrid.bench.timing import least
from jaxhybrid.config_flags import define_int_list
from jaxhybrid import burst, models
from jaxhybrid.burst import multiplex
from jaxhybrid.layers import apply_layer
from jaxhybrid.mesh import make_mesh
from jaxhybrid.plan import burst as planner
from jaxhybrid.plan.costs import profile
from jaxhybrid.plan.hardware import measured_device
from jaxhybrid.plan.topology import Topology

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "vgg16", "foreground model (jaxhybrid.models name)")
flags.DEFINE_string("bg_model", "wrn", "background model")
flags.DEFINE_string("size", "tiny", "model size preset")
flags.DEFINE_integer("batch", 64, "foreground global batch")
flags.DEFINE_integer("bg_batch", 8, "background batch per device instance")
define_int_list("widths", [], "burst widths (one per layer); default: the first half of "
                  "the layers on 8 devices, then 4, 2, 1 (a DeepPool-like narrowing)")
flags.DEFINE_integer("repeats", 5, "interleaved timing repeats (minimum taken)")
flags.DEFINE_integer("steps", 2, "steps per timing")
flags.DEFINE_bool("validate", True, "profile per-layer times and compare predicted device-time")


def default_widths(num_layers: int, G: int) -> list[int]:
    half = num_layers // 2
    rest = num_layers - half
    tail = [max(1, G >> (1 + (3 * i) // max(rest, 1))) for i in range(rest)]
    return [G] * half + tail


def setup(G: int):
    mesh = make_mesh(data=G)
    fg = models.get_model(FLAGS.model, FLAGS.size)
    bg = models.get_model(FLAGS.bg_model, FLAGS.size)
    x, y = fg.sample_batch(FLAGS.batch)
    bx, by = zip(*(bg.sample_batch(FLAGS.bg_batch, seed=d) for d in range(G)))
    bx, by = np.stack(bx), np.stack(by)
    key = jax.random.key(0, impl="rbg")
    fv = fg.init(key, x[:2])
    bv = bg.init(jax.random.fold_in(key, 1), bx[0])
    return mesh, fg, bg, (x, y), (bx, by), fv, bv


def main(argv):
    del argv
    for flag in ("repeats", "steps", "batch", "bg_batch"):   # --repeats=0 failed in min()
        if FLAGS[flag].value < 1:                            # after a minute of compiling
            raise ValueError(f"--{flag}={FLAGS[flag].value} must be >= 1.")
    G = jax.device_count()
    mesh, fg, bg, (x, y), (bx, by), fv, bv = setup(G)
    L = len(fg.layers)
    widths = FLAGS.widths or default_widths(L, G)
    opt, bg_opt = optax.sgd(1e-2, momentum=0.9), optax.sgd(1e-2, momentum=0.9)
    dp = burst.BurstProgram(fg.layers, fg.loss_fn, burst.data_parallel_widths(L, mesh), mesh,
                            FLAGS.batch)
    bp = burst.BurstProgram(fg.layers, fg.loss_fn, widths, mesh, FLAGS.batch)
    job = multiplex.BackgroundJob(bg.layers, bg.loss_fn, bg_opt, FLAGS.bg_batch)
    mux = multiplex.MuxProgram(bp, opt, job)
    fts = burst.init_train_state(opt, fv, mesh)
    bts = burst.init_train_state(bg_opt, bv, mesh)
    k1, k2 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
    print(f"{FLAGS.model} ({FLAGS.size}) batch {FLAGS.batch} on {G} CPU devices; burst widths "
          f"{widths}; background {FLAGS.bg_model} ({FLAGS.size}) batch {FLAGS.bg_batch} on "
          f"{int(mux.runs_background.sum())} devices")
    t0 = time.perf_counter()
    fns = {"dp": (burst.train_step, (dp, opt, fts, x, y, k1)),
           "burst": (burst.train_step, (bp, opt, fts, x, y, k1)),
           "bg": (multiplex.background_step, (mux, bts, bx, by, k2)),
           "mux": (multiplex.multiplexed_step, (mux, fts, bts, x, y, bx, by, k1, k2))}
    for fn, args in fns.values():        # compile outside the timings
        jax.block_until_ready(fn(*args))
    print(f"compiled 4 programs in {time.perf_counter() - t0:.1f} s")
    cpu = least(fns, FLAGS.repeats, FLAGS.steps)
    wall = least({k: fns[k] for k in ("burst", "mux")}, FLAGS.repeats, FLAGS.steps,
                 time.perf_counter)
    print(f"burst step vs data-parallel step (CPU-seconds): {cpu['burst']:.4f} s vs "
          f"{cpu['dp']:.4f} s, ratio {cpu['burst'] / cpu['dp']:.3f}x (target <= 1.10x)")
    pair = cpu["burst"] + cpu["bg"]
    print(f"multiplexed pair vs one after the other (CPU-seconds): {cpu['mux']:.4f} s vs "
          f"{pair:.4f} s ({cpu['burst']:.4f} + {cpu['bg']:.4f}), ratio {cpu['mux'] / pair:.3f}x "
          f"(target <= 1.10x)")
    print(f"foreground wall-clock with the background vs alone: {wall['mux']:.4f} s vs "
          f"{wall['burst']:.4f} s, slowdown {wall['mux'] / wall['burst']:.3f}x (CPU: shared cores)")
    if FLAGS.validate:
        validate(fg, x, mesh, widths, cpu)


def layer_cpu_times(layers, variables, x, repeats: int, steps: int):
    """(forward, backward) process CPU-seconds of each layer on one device at the batch
    of `x`, timed like the steps (min over repeats): the layer alone, jitted."""
    key = jax.random.PRNGKey(0)
    fwd, bwd = [], []
    h = x
    for l, layer in enumerate(layers):
        params = variables[l].get("params", {})
        state = {k: v for k, v in variables[l].items() if k != "params"}

        def f(p, hh, _layer=layer, _state=state):
            return apply_layer(_layer, {"params": p, **_state}, hh, train=True, rng=key)[0]

        def fb(p, hh, _f=f):
            y, vjp = jax.vjp(_f, p, hh)
            return vjp(jax.tree.map(jnp.ones_like, y))

        jf, jfb = jax.jit(f), jax.jit(fb)
        t = least({"f": (jf, (params, h)), "fb": (jfb, (params, h))}, repeats, steps)
        fwd.append(t["f"])
        bwd.append(max(t["fb"] - t["f"], 0.0))
        h = jf(params, h)
    return fwd, bwd


def validate(fg, x, mesh, widths, cpu):
    """Planner device-time (per-layer CPU-seconds measured here at every per-device
    batch) against the measured CPU-seconds of the same steps."""
    G = int(mesh.shape["data"])
    B = FLAGS.batch
    t0 = time.perf_counter()
    sizes = planner.widths_for(G, B)
    base = profile(fg.layers, x)                        # bytes and parameters (XLA)
    variables = fg.init(jax.random.key(0, impl="rbg"), x[:2])
    by_batch = {}
    for g in sizes:
        m = B // g
        f, b = layer_cpu_times(fg.layers, variables, x[:m], FLAGS.repeats, FLAGS.steps)
        by_batch[m] = [dataclasses.replace(c.scaled(m), fwd_time=tf, bwd_time=tb, measured=True)
                       for c, tf, tb in zip(base, f, b)]
    print(f"timed {len(fg.layers)} layers at batches {sorted(by_batch)} in "
          f"{time.perf_counter() - t0:.1f} s")
    hw = measured_device(bandwidth=10e9)
    topo = Topology.uniform(G, 10e9)
    tab = planner.build_tables(lambda m: by_batch[m], num_devices=G, batch_size=B, hardware=hw,
                               topology=topo)
    ks = {"dp": [len(sizes) - 1] * len(widths), "burst": [sizes.index(w) for w in widths]}
    plans = {k: planner._make_plan(tab, v, len(sizes) - 1, G, B, 2.0) for k, v in ks.items()}
    for k, p in plans.items():
        busy = p.busy_time()
        print(f"{k:>5}: predicted device-time {p.device_time:.4f} s (busy per device "
              f"{', '.join(f'{b * 1e3:.1f}' for b in busy)} ms; idle {p.idle_time().sum() / (G * p.iteration_time):.0%}), "
              f"measured CPU-seconds {cpu[k]:.4f} s, measured/predicted {cpu[k] / p.device_time:.2f}")
    pr = plans["burst"].device_time / plans["dp"].device_time
    print(f"burst/DP device-time: predicted {pr:.3f}x, measured {cpu['burst'] / cpu['dp']:.3f}x")
    samples = [(planner.layer_kind(by_batch[B][l]), planner.outputs_per_example(by_batch[B][l]),
                sorted(by_batch), [by_batch[m][l].fwd_time + by_batch[m][l].bwd_time
                                   for m in sorted(by_batch)]) for l in range(len(fg.layers))]
    fit = planner.fit_small_batch(samples, "measured on this host (CPU)")
    print("small-batch model fitted here (output elements per device at half throughput): "
          + ", ".join(f"{k} {v:,.0f}" for k, v in fit.half_work.items()))
    best = planner.plan_burst(None, num_devices=G, batch_size=B, tables=tab)
    print(f"planner on these measured costs (limit 2.0): widths {best.widths}, predicted "
          f"iteration {best.iteration_time * 1e3:.2f} ms vs DP {best.dp_time * 1e3:.2f} ms")
