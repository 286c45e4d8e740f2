"""Per-device bytes of parameters and Adam state under (data, pipe, model) and ZeRO; the
largest GPT that fits a per-device budget, by the planner.

    python scripts/bench.py sharding [--layers=4] [--width=128] [--meshes=2x2x1,2x2x2]
    python scripts/bench.py sharding --largest [--budget=16GiB] [--widths=...]
        [--layouts=4x2x1,2x2x2,2x2x2z] [--check_budget=...] [--check_width=128]

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

--largest: for each width in --widths (heads = width / 64, --seq_len tokens, vocabulary
--vocab, microbatches of --microbatch sequences, M=--microbatches, 1F1B, float32 Adam
inside the pipeline) the most blocks whose planned device bytes
(`jaxhybrid.plan.largest`, the planner's SPMD memory model with model degree and ZeRO)
fit --budget on each of --layouts, and the parameter count of the largest GPT per
layout. Costs: `plan.profile` of one embedding, block and head (abstract, XLA cost
analysis) per width. Then the check on this host's simulated devices: at
--check_budget, GPT of --check_width on each layout, the planner's largest depth n
and n + 1 compiled (`memory_analysis()`: argument + output + temp - alias bytes of
scripts/train.py's step, state donated) against the prediction.
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
from jaxhybrid.config_flags import define_int_list
from jaxhybrid import pipeline as jp
from jaxhybrid.pipeline.stages import even_boundaries
from jaxhybrid.step_memory import compiled_bytes

FLAGS = flags.FLAGS
flags.DEFINE_integer("layers", 4, "GPT blocks (not with --largest).")
flags.DEFINE_integer("width", 128, "GPT d_model (4 heads; not with --largest).")
flags.DEFINE_list("meshes", "2x2x1,2x2x2,1x4x2,2x1x4", "data x pipe x model meshes (not with "
                  "--largest, which takes --layouts).")
flags.DEFINE_integer("microbatches", 2, "microbatches per step.")
flags.DEFINE_bool("largest", False, "print the largest GPT that fits --budget per layout.")
flags.DEFINE_string("budget", "16GiB", "per-device memory budget for --largest.")
define_int_list("widths", "512,1024,2048,4096", "GPT widths (d_model) for --largest.")
flags.DEFINE_list("layouts", "4x2x1,2x2x2,2x2x2z", "data x pipe x model (z: ZeRO) layouts for "
                  "--largest (only with it; without it, --meshes).")
flags.DEFINE_integer("seq_len", 1024, "tokens per sequence for --largest.")
flags.DEFINE_integer("vocab", 50257, "vocabulary for --largest.")
flags.DEFINE_integer("microbatch", 1, "sequences per microbatch for --largest.")
flags.DEFINE_bool("remat", False, "--largest: let the planner recompute layers to fit.")
flags.DEFINE_string("check_budget", "12MiB", "budget of the compiled check of --largest "
                    "('' to skip).")
flags.DEFINE_integer("check_width", 128, "GPT width of the compiled check of --largest "
                     "(vocab 257, 16 tokens, 4 heads).")

# Flags each mode reads; one given to the other mode was accepted and ignored
# (`--layouts=3x3x3` without --largest printed the --meshes table).
LARGEST_ONLY = ("budget", "widths", "layouts", "seq_len", "vocab", "microbatch", "remat",
                "check_budget", "check_width")
MESHES_ONLY = ("layers", "width", "meshes")


def check_mode_flags() -> None:
    """A ValueError naming the flags given that the chosen mode (--largest or not) ignores."""
    if FLAGS.largest:
        stray = [f"--{n}" for n in MESHES_ONLY if FLAGS[n].present]
        if stray:
            raise ValueError(f"{', '.join(stray)}: only without --largest (the compiled bytes "
                             f"per --meshes); with --largest give --layouts / --widths, or "
                             f"drop --largest.")
    else:
        stray = [f"--{n}" for n in LARGEST_ONLY if FLAGS[n].present]
        if stray:
            raise ValueError(f"{', '.join(stray)}: only with --largest (the largest GPT per "
                             f"layout); add --largest, or drop "
                             f"{'it' if len(stray) == 1 else 'them'} (without --largest the "
                             f"layouts are --meshes).")


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


def step_bytes(spec, layout, M: int, microbatch: int) -> int:
    """argument + output + temp - alias bytes per device of the compiled training step of
    `scripts/train.py` (`jaxhybrid.train.make_train_step`: the pipeline's gradients, Adam,
    the train state donated; ZeRO as train.zero) on the layout, with the planner's
    boundaries for it."""
    from jaxhybrid import config_flags, train
    from jaxhybrid.plan.costs import layer_times, profile
    from jaxhybrid.plan.model_axis import local_cost
    from jaxhybrid.plan.partitioning import partition
    x, y = spec.sample_batch(layout.data * M * microbatch, 0)
    costs = profile(spec.layers, spec.sample_batch(microbatch)[0])
    cuts = partition(layer_times([local_cost(c, layout.model) for c in costs]), layout.pipe)
    mesh = jh.make_mesh(data=layout.data, pipe=layout.pipe, model=layout.model)
    pipe = jp.Pipeline(spec.layers, mesh=mesh, num_microbatches=M, schedule="1f1b",
                       remat="none", zero=layout.zero, boundaries=cuts)
    t = config_flags.base_config().train
    t.optimizer, t.weight_decay = "adamw", 0.0     # Adam's two moments, no masks
    state = train.initial_state(pipe, t, pipe.init(jax.random.key(0), x))
    run = train.Run(spec, mesh, pipe, None, None, x)
    return int(compiled_bytes(train.make_train_step(run, t).lower(
        state, (None, None), x, y, jax.random.key(1)).compile()))


def gpt_depths(size: str, microbatch: int, **overrides):
    """(n -> per-layer costs of GPT `size` with n blocks, params of one block, of the
    embedding + head), from the profile of a one-block GPT."""
    from jaxhybrid.plan.costs import profile
    from jaxhybrid.plan.largest import stacked
    spec = models.get_model("gpt", size, num_layers=1, **overrides)
    emb, block, head = profile(spec.layers, spec.sample_batch(microbatch)[0])
    return stacked([emb], block, [head]), block.param_count, emb.param_count + head.param_count


def largest(argv_flags) -> None:
    from jaxhybrid.plan.largest import Layout, device_memory, largest_depth
    from jaxhybrid.plan.topology import fmt_bytes, parse_bytes
    f = argv_flags
    layouts = [Layout.parse(t) for t in f.layouts]
    M, budget = f.microbatches, parse_bytes(f.budget)
    print(f"Largest GPT (blocks x width; heads = width/64, {f.seq_len} tokens, vocab {f.vocab}, "
          f"microbatch {f.microbatch} x M={M}, 1f1b, float32 Adam) within {fmt_bytes(budget)} "
          f"per device, by the planner's memory model "
          f"({'with its recomputation' if f.remat else 'no recomputation'})")
    print(f"{'width':>6} " + " ".join(f"{str(l):>22}" for l in layouts))
    best = {str(l): (0, 0, 0) for l in layouts}
    for w in f.widths:
        depth_costs, per_block, rest = gpt_depths(
            "full", f.microbatch, d_model=w, num_heads=max(1, w // 64), seq_len=f.seq_len,
            max_positions=f.seq_len, vocab_size=f.vocab)
        cells = []
        for lay in layouts:
            n = largest_depth(depth_costs, lay, budget, num_microbatches=M, remat=f.remat)
            params = n * per_block + rest if n else 0
            if params > best[str(lay)][0]:
                best[str(lay)] = (params, n, w)
            cells.append(f"{n:>5} blocks {params / 1e9:>7.3f} B" if n else f"{'-':>22}")
        print(f"{w:>6} " + " ".join(f"{c:>22}" for c in cells), flush=True)
    if f.widths:
        print(f"{'largest':>6} " + " ".join(
            f"{f'{best[str(l)][1]}x{best[str(l)][2]} {best[str(l)][0] / 1e9:.3f} B':>22}"
            for l in layouts))
    if not f.check_budget:
        return
    check, w = parse_bytes(f.check_budget), f.check_width
    depth_costs, _, _ = gpt_depths("tiny", 2, d_model=w, num_heads=4)
    print(f"check on {jax.device_count()} simulated devices: GPT width {w} (4 heads, 16 tokens, "
          f"vocab 257, microbatch 2, M={M}), budget {fmt_bytes(check)} ({int(check):,} bytes); the "
          f"planner's largest depth n and n + 1 per layout, predicted vs compiled (train.py's "
          f"step)")
    for lay in layouts:
        n = largest_depth(depth_costs, lay, check, num_microbatches=M)
        for depth in (n, n + 1):
            spec = models.get_model("gpt", "tiny", num_layers=depth, d_model=w, num_heads=4)
            pred = device_memory(depth_costs(depth), lay, num_microbatches=M)
            got = step_bytes(spec, lay, M, 2)
            print(f"  {str(lay):>7} {depth:>3} blocks: predicted {int(pred):>11,} compiled "
                  f"{got:>11,} predicted/compiled {pred / got:.3f}; fits: predicted "
                  f"{pred <= check}, compiled {got <= check}", flush=True)


def main(argv) -> None:
    del argv
    check_mode_flags()
    if FLAGS.largest:
        return largest(FLAGS)
    from jaxhybrid.plan.largest import Layout
    meshes = [(m, Layout.parse(m)) for m in FLAGS.meshes]   # "DxPxT", or one line naming it
    spec = models.get_model("gpt", "tiny", num_layers=FLAGS.layers, d_model=FLAGS.width,
                            num_heads=4)
    print(f"GPT {FLAGS.layers} x {FLAGS.width} (vocab 257), adam in the pipeline, 1f1b, "
          f"M={FLAGS.microbatches}; bytes per device from the compiled step")
    print(f"{'data x pipe x model':>20} {'zero':>4} {'params':>10} {'/ideal':>7} "
          f"{'adam':>10} {'/ideal':>7} {'argument':>10} {'temp':>10}")
    for mesh, layout in meshes:
        data, pipe_size, model = layout.data, layout.pipe, layout.model
        for zero in (0, 1):
            r = measure(spec, data, pipe_size, model, zero, FLAGS.microbatches)
            ideal_p = r["total"] / (pipe_size * model)
            ideal_a = 2 * ideal_p / (data if zero else 1)
            print(f"{mesh:>20} {zero:>4} {r['params']:>10,} {r['params'] / ideal_p:>7.3f} "
                  f"{r['adam']:>10,} {r['adam'] / ideal_a:>7.3f} {r['argument']:>10,} "
                  f"{r['temp']:>10,}", flush=True)
        print(f"{'':>20} total params {r['total']:,} bytes")
