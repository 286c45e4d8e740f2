"""Pipeline engine figures: bubble, per-device memory, parameter placement, CPU-seconds.

    python scripts/bench.py pipeline [--model=mlp] [--microbatch=8] [--repeats=5]

Prints, for each (schedule, S, M):
  * the bubble fraction read off the schedule's task table (backward = 2 x forward);
  * per-device temp memory of the compiled step (`memory_analysis().temp_size_in_bytes`);
  * parameter bytes per device and the padding waste of the packed stage buffers (also
    for the tiny jaxhybrid.models with the planner's split);
and CPU-second ratios, each pair measured interleaved in one run:
  * a pipelined step (data=1, pipe=4, --speed_m microbatches, remat "none") over a
    data-parallel step (data=4, pipe=1) of the same model and global batch, for each
    schedule in --speed_schedules x width in --speed_widths x --speed_microbatches, on a
    stack of --blocks Dense+tanh layers and a head (--speed_model).
    Simulated devices share this machine's cores, so CPU-seconds (total work), not wall
    time, is the fair comparison: a pipeline that computed in its bubbles, padded heavily
    or recomputed needlessly would burn more of them. The data-parallel step is taken
    twice: M=1 (each device runs 2 microbatches' rows at once) and M=2 (the pipelined
    step's microbatch size, so both run the same matmul shapes: on XLA CPU a 16-row
    matmul costs clearly more per row than a 32-row one, a cost of microbatching that
    is not the pipeline's);
  * a 1x1-mesh pipeline step over a plain `jax.jit` step of the same model (the cost of
    packing and the pipeline program when there is nothing to pipeline), CPU and wall.
CPU-seconds only grow with interference (other processes, threads contending for the
cores), so each figure is the least-disturbed (minimum) of --repeats measurements.
Needs 8 devices: on CPU it sets --xla_force_host_platform_device_count=8 itself.
"""
from __future__ import annotations

import os
import time

if "jax" not in __import__("sys").modules:   # simulated devices must exist before jax starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from absl import app, flags

import jaxhybrid as jh
from jaxhybrid.config_flags import define_int_list
from jaxhybrid.bench.mlp import Block, Head, xent
from jaxhybrid.bench.timing import least
from jaxhybrid import pipeline as jp
from jaxhybrid.layers import apply_layer
from jaxhybrid.models.spec import init_layers
from jaxhybrid.plan.topology import fmt_bytes

FLAGS = flags.FLAGS
MEMORY_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved", "zbv")
flags.DEFINE_string("model", "mlp", "mlp (residual relu Dense blocks + head) | tanh (Dense+tanh "
                    "blocks + head) | a jaxhybrid.models name.")
flags.DEFINE_integer("blocks", 15, "mlp residual blocks (+ 1 head layer: 16 layers split "
                     "4 ways leave one stage a block short, the rest even).")
flags.DEFINE_string("size", "tiny", "model size for jaxhybrid.models names.")
flags.DEFINE_integer("width", 512, "mlp hidden width.")
flags.DEFINE_integer("microbatch", 16, "examples per microbatch.")
flags.DEFINE_integer("repeats", 7, "timed repeats (minimum) for the CPU-seconds ratios.")
define_int_list("speed_widths", "512,1024", "mlp widths of the pipelined vs data-parallel "
                  "table (the wider model moves 4x the parameters per step).")
define_int_list("memory_m", "4,8,16,32", "microbatch counts of the memory table (S=4).")
flags.DEFINE_list("memory_schedules", ",".join(MEMORY_SCHEDULES), "schedules of the memory table.")
flags.DEFINE_string("speed_model", "tanh", "mlp | tanh: the stack of the CPU-seconds table.")
define_int_list("speed_microbatches", "", "microbatch sizes of the CPU-seconds table "
                  "(empty: --microbatch).")
flags.DEFINE_list("speed_schedules", "1f1b,interleaved,zb-h1", "schedules of the CPU-seconds table.")
flags.DEFINE_integer("speed_m", 8, "microbatches of the pipelined step in the CPU-seconds table.")
flags.DEFINE_list("compile_schedules", "", "schedules whose Inception-V3 tiny step (data=2, "
                  "pipe=4) compile time is measured (empty: skip).")
define_int_list("compile_m", "4,16", "microbatch counts of the compile-time table.")
flags.DEFINE_list("padding_models", "gpt,inception_v3,gnmt,biglstm",
                  "jaxhybrid.models (tiny) whose padding waste at S=4 is printed.")


def bench_model(name: str, size: str = "tiny", width: int = 512, blocks: int = 15):
    """(layers, loss_fn, make_batch(n) -> (inputs, targets)) of the benchmark model."""
    if name in ("mlp", "tanh"):
        block = Block(width) if name == "mlp" else Block(width, "tanh", residual=False)
        layers = [block.clone() for _ in range(blocks)] + [Head()]

        def make_batch(n, seed=0):
            r = np.random.default_rng(seed)
            return (r.standard_normal((n, width), np.float32),
                    r.integers(0, 10, n).astype(np.int32))
        return layers, xent, make_batch
    from jaxhybrid.models import get_model
    spec = get_model(name, size=size)
    return spec.layers, spec.loss_fn, spec.sample_batch


def _place(mesh, tree):
    return jax.device_put(tree, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))


def pipeline_step(layers, loss_fn, per_layer, batch, *, data, pipe, M, schedule="1f1b",
                  remat="none"):
    """(jitted step, its args, the Pipeline) on a (data, pipe) mesh with even stages."""
    mesh = jh.make_mesh(data=data, pipe=pipe)
    stages = jp.make_schedule(schedule, pipe, M).num_stages
    p = jp.Pipeline(layers, mesh=mesh, num_microbatches=M, schedule=schedule,
                    boundaries=jp.even_boundaries(len(layers), stages), remat=remat)
    variables = p.pack(per_layer)
    return p.value_and_grad(loss_fn), (variables, *_place(mesh, batch)), p


def plain_step(layers, loss_fn, per_layer, batch):
    """The same model's loss and gradient as one `jax.jit` on one device."""
    def loss(params, state, x, y):
        for layer, p, st in zip(layers, params, state):
            x, _ = apply_layer(layer, {"params": p, **st}, x, train=True)
        return loss_fn(x, y)
    params = [v.get("params", {}) for v in per_layer]
    state = [{c: t for c, t in v.items() if c != "params"} for v in per_layer]
    return jax.jit(jax.value_and_grad(loss)), (params, state, *batch)


def speed_rows(widths, blocks: int, mb: int, repeats: int, schedule: str = "1f1b",
               M: int = 8, model: str = "tanh") -> list[dict]:
    """Pipelined (data=1, pipe=4, M microbatches of `mb`) vs data-parallel (data=4) CPU-
    seconds per step of the same global batch: DP with M/4 microbatches of the same size
    (the engine's own overhead), and plain DP (no microbatching)."""
    rows = []
    for width in widths:
        layers, loss_fn, make_batch = bench_model(model, width=width, blocks=blocks)
        per_layer = init_layers(layers, jax.random.key(0), make_batch(1)[0])
        batch = make_batch(M * mb)   # one global batch for every layout
        step = lambda **kw: pipeline_step(layers, loss_fn, per_layer, batch, **kw)[:2]
        t = least(dict(piped=step(data=1, pipe=4, M=M, schedule=schedule),
                       dp1=step(data=4, pipe=1, M=1), dp2=step(data=4, pipe=1, M=M // 4)),
                  repeats)
        rows.append(dict(width=width, microbatch=mb, schedule=schedule, M=M, model=model, **t))
    return rows


def print_speed_rows(rows) -> None:
    print("\nCPU-seconds per step, same model and global batch on 4 of the simulated devices "
          "(DP acc = data 4 accumulating M/4 microbatches of the same size):")
    print(f"{'schedule / model':34} {'pipelined 1x4':>14} {'DP 4x1 M=1':>11} {'ratio':>6} "
          f"{'DP acc':>11} {'ratio':>6}")
    for r in rows:
        name = f"{r['schedule']} M={r['M']} {r['model']} w={r['width']} mb={r['microbatch']}"
        print(f"{name:34} "
              f"{r['piped'] * 1e3:14.1f} ms {r['dp1'] * 1e3:8.1f} ms {r['piped'] / r['dp1']:5.2f}x "
              f"{r['dp2'] * 1e3:8.1f} ms {r['piped'] / r['dp2']:5.2f}x")


def memory_table(layers, loss_fn, make_batch, per_layer, mb: int, ms, S: int = 4,
                 schedules=MEMORY_SCHEDULES) -> list[dict]:
    rows = []
    for schedule in schedules:
        for M in ms:
            f, args, p = pipeline_step(layers, loss_fn, per_layer, make_batch(M * mb),
                                       data=1, pipe=S, M=M, schedule=schedule)
            mem = f.lower(*args).compile().memory_analysis()
            pad = p.padding_stats()
            itemsize = 4   # the benchmark models are float32
            rows.append(dict(schedule=schedule, S=S, M=M,
                             bubble=p.schedule.bubble_fraction(1.0, 2.0),
                             temp_bytes=int(mem.temp_size_in_bytes),
                             param_bytes_per_device=pad["buffer_params"] * itemsize,
                             total_param_bytes=pad["total_params"] * itemsize,
                             padding_waste=pad["padding_waste"]))
    return rows


def print_memory_table(rows) -> None:
    print(f"{'schedule':8} {'S':>2} {'M':>3} {'bubble':>7} {'temp/device':>12} "
          f"{'params/device':>14} {'total/S':>10} {'padding':>8}")
    for r in rows:
        print(f"{r['schedule']:8} {r['S']:>2} {r['M']:>3} {r['bubble']:>7.3f} "
              f"{fmt_bytes(r['temp_bytes']):>12} {fmt_bytes(r['param_bytes_per_device']):>14} "
              f"{fmt_bytes(r['total_param_bytes'] / r['S']):>10} {r['padding_waste']:>8.1%}")
    for schedule in dict.fromkeys(r["schedule"] for r in rows):
        t = {r["M"]: r["temp_bytes"] for r in rows if r["schedule"] == schedule}
        lo, hi = min(t), max(t)
        print(f"{schedule}: temp memory M={hi} / M={lo} = {t[hi] / max(1, t[lo]):.2f}x")


def padding_table(names, S: int = 4, M: int = 8) -> None:
    """Padding waste of the packed parameter buffers with the planner's split."""
    from jaxhybrid.models import get_model
    print(f"\npadding waste of packed parameters, S={S}, planner boundaries (tiny models):")
    for name in names:
        spec = get_model(name, size="tiny")
        p = jp.Pipeline(spec.layers, mesh=jh.make_mesh(data=1, pipe=S), num_microbatches=M,
                        remat="none")
        p.init(jax.random.key(0), spec.sample_batch(2 * M)[0])
        pad = p.padding_stats()
        print(f"  {name:13} layers={len(spec.layers):3} boundaries={p.boundaries} "
              f"params={pad['total_params']:,} padding={pad['padding_waste']:.1%}")


def compile_table(schedules, ms, model: str = "inception_v3") -> None:
    """Seconds to lower + compile the default config's train step (tiny model, data=2,
    pipe=4, planner boundaries, microbatch 8, dropout), per schedule and M: wall and this
    process's CPU seconds (the ratio that survives a busy host), and StableHLO lines."""
    from jaxhybrid.models import get_model
    spec = get_model(model, size="tiny", num_classes=10, image_size=75, dropout_rate=0.1)
    print(f"\ncompile time of the {model} tiny step, data=2 x pipe=4, microbatch 8:")
    for schedule in schedules:
        for M in ms:
            x, y = spec.sample_batch(2 * M * 8)
            p = jp.Pipeline(spec.layers, mesh=jh.make_mesh(data=2, pipe=4), num_microbatches=M,
                            schedule=schedule, remat="none")
            variables = p.init(jax.random.key(0, impl="rbg"), x)
            step = p.value_and_grad(spec.loss_fn)
            t, cpu = time.perf_counter(), time.process_time()
            lowered = step.lower(variables, x, y, jax.random.key(1))
            t_lower = time.perf_counter() - t
            lines = lowered.as_text().count("\n")
            t, cpu_lower = time.perf_counter(), time.process_time() - cpu
            cpu = time.process_time()
            lowered.compile()
            print(f"  {schedule:12} M={M:<3} stages={p.num_stages:<2} boundaries={p.boundaries} "
                  f"lower {t_lower:.1f} s ({cpu_lower:.1f} CPU-s), {lines:,} StableHLO lines; "
                  f"compile {time.perf_counter() - t:.1f} s ({time.process_time() - cpu:.1f} CPU-s)",
                  flush=True)


def check_speed_m(m: int) -> None:
    """The DP-accumulating step runs m / 4 microbatches on each of 4 devices: with m not a
    multiple of 4 it would be another program than the pipelined step's work."""
    if m < 4 or m % 4:
        raise ValueError(f"--speed_m={m} must be a multiple of 4 (DP accumulating runs "
                         f"speed_m / 4 microbatches on each of 4 devices).")


def main(argv) -> None:
    del argv
    check_speed_m(FLAGS.speed_m)
    if jax.device_count() < 8:
        raise SystemExit(f"bench pipeline: needs 8 devices, found {jax.device_count()}; on CPU "
                         f"set XLA_FLAGS=--xla_force_host_platform_device_count=8.")
    layers, loss_fn, make_batch = bench_model(FLAGS.model, FLAGS.size, FLAGS.width, FLAGS.blocks)
    mb = FLAGS.microbatch
    per_layer = init_layers(layers, jax.random.key(0), make_batch(1)[0])
    print(f"model={FLAGS.model} layers={len(layers)} microbatch={mb} "
          f"devices={jax.device_count()} x {jax.devices()[0].platform} "
          f"cores={os.cpu_count()}\n")
    if FLAGS.compile_schedules:
        compile_table(FLAGS.compile_schedules, FLAGS.compile_m)
    if FLAGS.memory_m:
        print_memory_table(memory_table(layers, loss_fn, make_batch, per_layer, mb,
                                        FLAGS.memory_m,
                                        schedules=FLAGS.memory_schedules))
    if FLAGS.padding_models:
        padding_table(FLAGS.padding_models)

    print_speed_rows([row for schedule in FLAGS.speed_schedules
                      for smb in FLAGS.speed_microbatches or [mb]
                      for row in speed_rows(FLAGS.speed_widths, FLAGS.blocks,
                                            smb, FLAGS.repeats, schedule, FLAGS.speed_m,
                                            FLAGS.speed_model)])

    batch = make_batch(8 * mb)
    fns = dict(one=pipeline_step(layers, loss_fn, per_layer, batch, data=1, pipe=1, M=1)[:2],
               plain=plain_step(layers, loss_fn, per_layer, batch))
    # Steps this short are cheap to repeat, and need it: one disturbed step is 5% of them.
    cpu = least(fns, 3 * FLAGS.repeats)
    wall = least(fns, 3 * FLAGS.repeats, clock=time.perf_counter)
    print(f"\n1x1 pipeline vs plain jax.jit ({FLAGS.model}): CPU-seconds {cpu['one'] * 1e3:.1f} "
          f"vs {cpu['plain'] * 1e3:.1f} ms, ratio {cpu['one'] / cpu['plain']:.3f}x; wall "
          f"{wall['one'] * 1e3:.1f} vs {wall['plain'] * 1e3:.1f} ms, ratio "
          f"{wall['one'] / wall['plain']:.3f}x")


if __name__ == "__main__":
    app.run(main)
