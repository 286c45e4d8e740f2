"""Pipeline engine figures: bubble, per-device memory, parameter placement, CPU-seconds.

    python scripts/bench.py pipeline [--model=mlp] [--microbatch=8] [--repeats=5]

Prints, for each (schedule, S, M):
  * the bubble fraction read off the schedule's task table (backward = 2 x forward);
  * per-device temp memory of the compiled step (`memory_analysis().temp_size_in_bytes`);
  * parameter bytes per device and the padding waste of the packed stage buffers (also
    for the tiny jaxhybrid.models with the planner's split);
and two ratios measured in one run:
  * process CPU-seconds of a pipelined step (data=1, pipe=4, M=8, remat "none") over a
    data-parallel step (data=4, pipe=1) of the same model and global batch. Simulated
    devices share this machine's cores, so CPU-seconds (total work), not wall time, is
    the fair comparison: a pipeline that computed in its bubbles, padded heavily or
    recomputed needlessly would burn more of them;
  * a 1x1-mesh pipeline step over a plain `jax.jit` step of the same model (the cost of
    packing, the tick loop and the switch when there is nothing to pipeline).
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
from jaxhybrid.bench.mlp import Block, Head, xent
from jaxhybrid import pipeline as jp
from jaxhybrid.layers import apply_layer
from jaxhybrid.models.spec import init_layers
from jaxhybrid.plan.topology import fmt_bytes

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "mlp", "mlp (residual Dense blocks + head) | a jaxhybrid.models name.")
flags.DEFINE_integer("blocks", 15, "mlp residual blocks (+ 1 head layer: 16 layers split "
                     "4 ways leave one stage a block short, the rest even).")
flags.DEFINE_string("size", "tiny", "model size for jaxhybrid.models names.")
flags.DEFINE_integer("width", 512, "mlp hidden width.")
flags.DEFINE_integer("microbatch", 16, "examples per microbatch.")
flags.DEFINE_integer("repeats", 5, "timed repeats (median) for the CPU-seconds ratios.")
flags.DEFINE_list("memory_m", "4,8,16,32", "microbatch counts of the memory table (S=4).")
flags.DEFINE_list("padding_models", "gpt,inception_v3,gnmt,biglstm",
                  "jaxhybrid.models (tiny) whose padding waste at S=4 is printed.")


def bench_model(name: str, size: str = "tiny", width: int = 512, blocks: int = 15):
    """(layers, loss_fn, make_batch(n) -> (inputs, targets)) of the benchmark model."""
    if name == "mlp":
        layers = [Block(width) for _ in range(blocks)] + [Head()]

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
    p = jp.Pipeline(layers, mesh=mesh, num_microbatches=M, schedule=schedule,
                    boundaries=jp.even_boundaries(len(layers), pipe), remat=remat)
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


def cpu_seconds(fn, args, steps: int = 3) -> float:
    """Process CPU-seconds (all threads) of one call, after warm-up; mean over `steps`."""
    jax.block_until_ready(fn(*args))
    t = time.process_time()
    for _ in range(steps):
        jax.block_until_ready(fn(*args))
    return (time.process_time() - t) / steps


def wall_seconds(fn, args, steps: int = 3) -> float:
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(steps):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t) / steps


def ratio(a, b, repeats: int, measure=cpu_seconds) -> tuple[float, float, float]:
    """Median over interleaved repeats of measure(a) / measure(b); also the medians."""
    xs, ys = [], []
    for _ in range(repeats):
        xs.append(measure(*a))
        ys.append(measure(*b))
    r = float(np.median(np.array(xs) / np.array(ys)))
    return r, float(np.median(xs)), float(np.median(ys))


def memory_table(layers, loss_fn, make_batch, per_layer, mb: int, ms, S: int = 4) -> list[dict]:
    rows = []
    for schedule in ("gpipe", "1f1b"):
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
    for schedule in ("gpipe", "1f1b"):
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


def main(argv) -> None:
    del argv
    if jax.device_count() < 8:
        raise SystemExit(f"bench pipeline: needs 8 devices, found {jax.device_count()}; on CPU "
                         f"set XLA_FLAGS=--xla_force_host_platform_device_count=8.")
    layers, loss_fn, make_batch = bench_model(FLAGS.model, FLAGS.size, FLAGS.width, FLAGS.blocks)
    mb = FLAGS.microbatch
    per_layer = init_layers(layers, jax.random.key(0), make_batch(1)[0])
    print(f"model={FLAGS.model} layers={len(layers)} microbatch={mb} "
          f"devices={jax.device_count()} x {jax.devices()[0].platform} "
          f"cores={os.cpu_count()}\n")
    print_memory_table(memory_table(layers, loss_fn, make_batch, per_layer, mb,
                                    [int(m) for m in FLAGS.memory_m]))
    if FLAGS.padding_models:
        padding_table(FLAGS.padding_models)

    batch = make_batch(8 * mb)   # one global batch for both layouts
    piped = pipeline_step(layers, loss_fn, per_layer, batch, data=1, pipe=4, M=8)[:2]
    dp = pipeline_step(layers, loss_fn, per_layer, batch, data=4, pipe=1, M=1)[:2]
    r, a, b = ratio(piped, dp, FLAGS.repeats)
    print(f"\nCPU-seconds/step: pipelined (data=1, pipe=4, M=8) {a * 1e3:.1f} ms, "
          f"data-parallel (data=4, pipe=1) {b * 1e3:.1f} ms, ratio {r:.3f}x")

    one = pipeline_step(layers, loss_fn, per_layer, batch, data=1, pipe=1, M=1)[:2]
    plain = plain_step(layers, loss_fn, per_layer, batch)
    r, a, b = ratio(one, plain, FLAGS.repeats)
    print(f"1x1 pipeline vs plain jax.jit: CPU-seconds {a * 1e3:.1f} ms vs {b * 1e3:.1f} ms, "
          f"ratio {r:.3f}x")
    r, a, b = ratio(one, plain, FLAGS.repeats, measure=wall_seconds)
    print(f"1x1 pipeline vs plain jax.jit: wall {a * 1e3:.1f} ms vs {b * 1e3:.1f} ms, "
          f"ratio {r:.3f}x")


if __name__ == "__main__":
    app.run(main)
