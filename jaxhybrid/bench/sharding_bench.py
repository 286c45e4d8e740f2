"""Per-device bytes of parameters and Adam state under (data, pipe, model) and ZeRO.

    python scripts/bench.py sharding [--layers=4] [--width=128] [--meshes=2x2x1,2x2x2]

For GPT (vocabulary 257, `--layers` blocks of `--width`), compiles the pipeline's
`train_step` (adam inside the pipeline, 1f1b) on each mesh, with zero=0 and zero=1, and
prints per device, from the compiled executable's own input shardings:
  * parameter bytes, and their ratio to total / (pipe x model);
  * Adam state bytes (both moments), and their ratio to 2 x total / (pipe x model) for
    zero=0, 2 x total / (pipe x model x data) for zero=1;
  * `memory_analysis()`: argument and temp bytes of the whole step.
Embedding, head, LayerNorms and biases of the row-parallel layers stay replicated over
"model" (sharding.TENSOR_PARALLEL_AXES), stages are padded to the largest: ratios above
1 come from those.
"""
from __future__ import annotations

import math
import os

if "jax" not in __import__("sys").modules:   # simulated devices must exist before jax starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import optax
from absl import flags

import jaxhybrid as jh
from jaxhybrid import models
from jaxhybrid import pipeline as jp
from jaxhybrid.pipeline.stages import even_boundaries

FLAGS = flags.FLAGS
flags.DEFINE_integer("layers", 4, "GPT blocks.")
flags.DEFINE_integer("width", 128, "GPT d_model (4 heads).")
flags.DEFINE_list("meshes", "2x2x1,2x2x2,1x4x2,2x1x4", "data x pipe x model meshes.")
flags.DEFINE_integer("microbatches", 2, "microbatches per step.")


def _bytes_per_device(shardings, avals) -> int:
    return sum(math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
               for s, a in zip(jax.tree.leaves(shardings), jax.tree.leaves(avals)))


def measure(spec, data: int, pipe_size: int, model: int, zero: int, M: int) -> dict:
    layers = spec.layers
    x, y = spec.sample_batch(data * M * 2, 0)
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=data, pipe=pipe_size, model=model),
                       num_microbatches=M, schedule="1f1b", remat="none", zero=zero,
                       boundaries=even_boundaries(len(layers), pipe_size))
    variables = pipe.init(jax.random.key(0), x)
    tx = optax.adam(1e-3)
    opt = pipe.init_optimizer(tx, variables)
    compiled = pipe.train_step(spec.loss_fn, tx).lower(variables, opt, x, y,
                                                       jax.random.key(1)).compile()
    (args, _) = compiled.input_shardings
    total = sum(int(np.prod(np.shape(a))) * 4 for a in jax.tree.leaves(
        [v.get("params", {}) for v in pipe.unpack(variables)]))
    mem = compiled.memory_analysis()
    return dict(total=total, params=_bytes_per_device(args[0]["params"], variables["params"]),
                adam=_bytes_per_device(args[1], opt) - 8,   # minus the two int32 counts
                argument=mem.argument_size_in_bytes, temp=mem.temp_size_in_bytes)


def main(argv) -> None:
    del argv
    spec = models.get_model("gpt", "tiny", num_layers=FLAGS.layers, d_model=FLAGS.width,
                            num_heads=4)
    print(f"GPT {FLAGS.layers} x {FLAGS.width} (vocab 257), adam in the pipeline, 1f1b, "
          f"M={FLAGS.microbatches}; bytes per device from the compiled step")
    print(f"{'data x pipe x model':>20} {'zero':>4} {'params':>10} {'/ideal':>7} "
          f"{'adam':>10} {'/ideal':>7} {'argument':>10} {'temp':>10}")
    for mesh in FLAGS.meshes:
        data, pipe_size, model = (int(v) for v in mesh.split("x"))
        for zero in (0, 1):
            r = measure(spec, data, pipe_size, model, zero, FLAGS.microbatches)
            ideal_p = r["total"] / (pipe_size * model)
            ideal_a = 2 * ideal_p / (data if zero else 1)
            print(f"{mesh:>20} {zero:>4} {r['params']:>10,} {r['params'] / ideal_p:>7.3f} "
                  f"{r['adam']:>10,} {r['adam'] / ideal_a:>7.3f} {r['argument']:>10,} "
                  f"{r['temp']:>10,}", flush=True)
        print(f"{'':>20} total params {r['total']:,} bytes")
