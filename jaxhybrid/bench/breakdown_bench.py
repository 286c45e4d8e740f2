"""Where a pipelined step's time goes, beside a data-parallel step of the same work.

    python scripts/bench.py breakdown [--width=256] [--microbatch=128] [--blocks=7]
        [--speed_m=8] [--trace_schedule=1f1b] [--trace_steps=20]

Builds the two steps of `scripts/bench.py pipeline`'s CPU-seconds table for one cell
(--speed_model stack of --blocks layers and a head, --width wide; pipelined: data 1 x
pipe 4, --speed_m microbatches of --microbatch; DP accumulating: data 4, the same
microbatch size), times each (process CPU-ms per step, the least of three rounds), then
records --trace_steps steps of each with `jax.profiler` and sums XLA's per-instruction
thunk times by what the instruction does, read off the compiled HLO:

  matmuls               dots and convolutions, alone or fused (the layers' math)
  elementwise, other    the rest of the layers' math, and the adds into accumulators
  row reads             fusions with a dynamic-slice (stash, inbox and parameter rows)
  row writes            fusions with a dynamic-update-slice (stash and inbox writes)
  fills                 broadcasts alone (zeroed rings, accumulators and idle outputs)
  copies                copy instructions
  collectives           ppermute / psum / all-reduce: wall time, waiting included

Thunk times are wall seconds of each instruction summed over the devices' threads. The
pipelined step's devices run nearly one at a time (lock step), so its thunk times are
close to CPU time; the data-parallel devices run at once, and where four device threads
share two cores their thunks include time spent preempted (its matmuls read longer than
the pipelined step's, though they do the same work). So compare shares within each
program, not milliseconds across them: the last line gives the share of data movement
(row reads, row writes, fills, copies; data parallelism has next to none) in each
program's thunk time outside collectives. The collectives' row is wall time, mostly
waiting for the other devices, and has no share.
docs/pipeline.md, "Work", has figures.
"""
from __future__ import annotations

import os
import time

if "jax" not in __import__("sys").modules:   # simulated devices must exist before jax starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
from absl import flags

from jaxhybrid.bench import pipeline_bench
from jaxhybrid.bench.thunk_profile import CATEGORIES, MOVEMENT, hlo_categories, thunk_seconds
from jaxhybrid.bench.timing import least
from jaxhybrid.models.spec import init_layers

FLAGS = flags.FLAGS
flags.DEFINE_string("trace_schedule", "1f1b", "schedule of the pipelined step.")
flags.DEFINE_integer("trace_steps", 20, "steps recorded per program (more: steadier shares).")

def breakdown(width: int, mb: int, M: int, schedule: str, blocks: int, model: str,
              steps: int) -> dict:
    """{"piped"|"dp_acc": {"cpu": CPU-seconds per step, "thunks": {category: seconds}}}."""
    layers, loss_fn, make_batch = pipeline_bench.bench_model(model, width=width, blocks=blocks)
    per_layer = init_layers(layers, jax.random.key(0), make_batch(1)[0])
    batch = make_batch(M * mb)
    steps_of = dict(piped=dict(data=1, pipe=4, M=M, schedule=schedule),
                    dp_acc=dict(data=4, pipe=1, M=max(1, M // 4)))
    fns = {k: pipeline_bench.pipeline_step(layers, loss_fn, per_layer, batch, **kw)[:2]
           for k, kw in steps_of.items()}
    cpu = least(fns, 3)
    out = {}
    for k, (fn, args) in fns.items():
        categories = hlo_categories(fn.lower(*args).compile().as_text())
        out[k] = dict(cpu=cpu[k], thunks=thunk_seconds(fn, args, steps, categories))
    return out


def print_breakdown(r: dict, title: str) -> None:
    p, d = r["piped"], r["dp_acc"]
    work = [c for c in CATEGORIES if c != "collectives"]
    print(title)
    print(f"process CPU-ms per step: pipelined {p['cpu'] * 1e3:.1f}, DP accumulating "
          f"{d['cpu'] * 1e3:.1f} ({p['cpu'] / d['cpu']:.2f}x)")
    print(f"{'thunk ms per step, all devices':32} {'pipelined':>10} {'share':>6} "
          f"{'DP acc':>10} {'share':>6}")
    totals = {k: sum(r[k]["thunks"][c] for c in work) for k in r}
    for c in CATEGORIES:
        share = {k: (f"{r[k]['thunks'][c] / totals[k]:6.1%}" if c in work and totals[k] else "")
                 for k in r}
        print(f"{c:32} {p['thunks'][c] * 1e3:10.2f} {share['piped']:>6} "
              f"{d['thunks'][c] * 1e3:10.2f} {share['dp_acc']:>6}")
    moved = {k: sum(r[k]["thunks"][c] for c in MOVEMENT) / max(totals[k], 1e-12) for k in r}
    print(f"data movement ({', '.join(MOVEMENT)}): {moved['piped']:.1%} of the pipelined "
          f"step's thunk time outside collectives, {moved['dp_acc']:.1%} of DP's")


def main(argv) -> None:
    del argv
    if jax.device_count() < 4:
        raise ValueError(f"needs 4 devices, found {jax.device_count()}; on CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count=8.")
    pipeline_bench.check_speed_m(FLAGS.speed_m)
    t = time.perf_counter()
    r = breakdown(FLAGS.width, FLAGS.microbatch, FLAGS.speed_m, FLAGS.trace_schedule,
                  FLAGS.blocks, FLAGS.speed_model, FLAGS.trace_steps)
    print_breakdown(r, f"{FLAGS.trace_schedule} M={FLAGS.speed_m} {FLAGS.speed_model} "
                       f"x{FLAGS.blocks} + head, width {FLAGS.width}, microbatch "
                       f"{FLAGS.microbatch}; {FLAGS.trace_steps} traced steps each "
                       f"({os.cpu_count()} cores, {jax.devices()[0].platform})")
    print(f"bench took {time.perf_counter() - t:.0f} s")
