"""Memory model vs the compiled step: predicted and compiled bytes per device.

    python scripts/bench.py memory [--models=inception_v3,gnmt,biglstm,gpt] [--size=tiny]
                                   [--pipe=4] [--step=train|grad] [--config_schedule=zb-h1]
                                   [--remat=none|layers|full|dots_saveable|...]

For each model, its config in configs/ (`<name>_hybrid.py`: mesh data, microbatches,
batch, schedule, model overrides) at --size and pipe = --pipe (and --config_schedule in
place of the config's, if given), with the planner's boundaries and no recomputation
(--remat=layers: every layer recomputed in its backward, each under its own
`jax.checkpoint`, as the planner's recomputation choices run; --remat=full: the
runtime's stage-level remat="full", each stage recomputed whole from its input;
--remat=<a jax.checkpoint_policies name>: every stage under that policy, priced from the
residuals it keeps, `pipeline.policy_costs`):

  predicted  the planner's memory model of the engine (`plan.memory_model.memory_terms`, the
             terms `spmd_memory` adds up: what `make_plan`, `remat="auto"` and the
             projection use), from the layers' profiled costs at the microbatch run, with
             param_state_factor 4 (Adam: parameters, two moments, gradient accumulator;
             plus the microbatch's stage gradient);
  compiled   `memory_analysis()` of the step `scripts/train.py` runs
             (`jaxhybrid.train.make_train_step`: the pipeline's value_and_grad, then AdamW
             on the packed buffers, state donated), lowered on zero-valued variables and
             compiled for the simulated devices: argument + output + temp - alias bytes
             per device (what the step holds at its peak: its inputs, including the
             donated parameters and Adam moments, temporaries, and outputs that do not
             reuse an input buffer). --step=grad compiles the value_and_grad step alone
             (then the prediction drops the Adam moments: param_state_factor 2);
  padding    the runtime's packed buffers next to the model's sizes: parameter buffer
             per device vs the largest device's parameters, residual row vs the largest
             stage's kept residuals (whole buffers and the longest stage set the padding),
             and with a split backward the cross ring (crossing values that did not fit
             in the row's free space) vs the model's `cross` term.

Printed per model: the predicted terms, their sum, the compiled figures and the error
(predicted / compiled - 1). Nothing is run: compiling needs shapes only.
"""
from __future__ import annotations

import os
import time

if "jax" not in __import__("sys").modules:   # simulated devices must exist before jax starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from absl import flags

from jaxhybrid.plan.topology import fmt_bytes
from jaxhybrid.step_memory import compiled_bytes

FLAGS = flags.FLAGS
flags.DEFINE_list("models", "inception_v3,gnmt,biglstm,gpt", "models (configs/<name>_hybrid.py; "
                  "inception_v3 reads inception_hybrid.py).")
flags.DEFINE_string("size", "tiny", "model size (tiny | small | full), or 'config' for the "
                    "config's own size.")
flags.DEFINE_integer("pipe", 4, "pipeline stages S.")
flags.DEFINE_enum("step", "train", ["train", "grad"], "train: the training step with AdamW "
                  "(scripts/train.py); grad: the pipeline's value_and_grad step alone.")
flags.DEFINE_string("remat", "none", "recomputation of the step "
                  "compared: none, layers (every layer's forward again in its backward, per "
                  "layer as the planner's choices run) or full (each stage recomputed whole "
                  "from its input: Pipeline(remat='full')) or a jax.checkpoint_policies "
                  "name (every stage under it, e.g. dots_saveable).")
flags.DEFINE_string("config_schedule", "", "a registered schedule in place of each config's "
                    "pipeline.schedule (e.g. zb-h1, zbv); empty: the config's own.")

CONFIGS = {"inception_v3": "inception_hybrid.py", "gnmt": "gnmt_hybrid.py",
           "biglstm": "biglstm_hybrid.py", "gpt": "gpt_hybrid.py"}
TERMS = ("params", "opt_state", "grads", "state", "stash", "working", "cross", "inboxes", "inputs",
         "versions")


def model_config(name: str, size: str, pipe: int, schedule: str = ""):
    """The model's training config with its size, pipeline depth and (if given) schedule
    replaced."""
    from jaxhybrid import config_flags
    overrides = {"mesh.pipe": pipe}
    if size != "config":
        overrides["model.size"] = size
    if schedule:
        overrides["pipeline.schedule"] = schedule
    return config_flags.load_config(CONFIGS.get(name, f"{name}_hybrid.py"), overrides)


def _nbytes(lengths: dict) -> int:
    from jaxhybrid.pipeline.packing import dtype_of
    return int(sum(n * np.dtype(dtype_of(k)).itemsize for k, n in lengths.items()))


def compare(config, step: str = "train", remat: str = "none") -> dict:
    """Predicted terms and compiled bytes of one config's step (module docstring)."""
    import jaxhybrid as jh
    from jaxhybrid import models
    from jaxhybrid import pipeline as jp
    from jaxhybrid import train as jtrain
    from jaxhybrid.models.spec import abstract_variables
    from jaxhybrid.pipeline.planning import profile_cached
    from jaxhybrid.plan.memory_model import memory_terms

    spec = models.get_model(config.model.name, config.model.size,
                            **config.model.overrides.to_dict())
    mesh = jh.make_mesh(data=config.mesh.data, pipe=config.mesh.pipe)
    M = config.pipeline.num_microbatches
    policy = remat not in ("none", "layers", "full")
    every = [remat in ("layers", "full")] * len(spec.layers)
    pipe = jp.Pipeline(spec.layers, mesh=mesh, num_microbatches=M,
                       schedule=config.pipeline.schedule,
                       remat=remat if remat == "full" or policy else every)
    x, y = spec.sample_batch(config.train.batch_size)
    t0 = time.perf_counter()
    pipe.make_plan(x)
    costs = profile_cached(pipe.layers, pipe._sample)
    factor = 4 if step == "train" else 2
    terms = memory_terms(costs, pipe.boundaries, pipe.schedule, every,
                         param_state_factor=factor,
                         whole_stage=[remat == "full"] * pipe.num_stages,
                         policy_kept=pipe.plan.stage_policy_kept)
    plan_s = time.perf_counter() - t0

    # Compiling needs shapes only: zeros in place of initialised values.
    per_layer = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_variables(
        spec.layers, jax.tree.map(lambda a: a[:1], x)))
    variables = pipe.pack(per_layer)
    xs, ys = jax.device_put((x, y), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    rng = jax.random.key(0)
    t0 = time.perf_counter()
    if step == "train":
        run = jtrain.Run(spec, mesh, pipe, None, None, x)
        state = jtrain.initial_state(pipe, config.train, variables, (None, None))
        lowered = jtrain.make_train_step(run, config.train).lower(state, (None, None), xs, ys, rng)
    else:
        lowered = pipe.value_and_grad(spec.loss_fn).lower(variables, xs, ys, rng)
    executable = lowered.compile()
    compile_s = time.perf_counter() - t0
    ma, compiled = executable.memory_analysis(), compiled_bytes(executable)

    # The runtime's packed sizes next to the model's (padding).
    mb_in = pipe._microbatch(xs, "inputs")
    mb_tg = pipe._microbatch(ys, "targets")
    rng_aval = jax.ShapeDtypeStruct(jax.random.key_data(rng).shape, jax.random.key_data(rng).dtype)
    lay = pipe._layouts(mb_in, mb_tg, spec.loss_fn, True, rng_aval)
    rings = pipe.schedule.ring_slots()[1]
    rows = rings["stash"]
    predicted = float(sum(terms.values()))
    return dict(model=config.model.name, size=config.model.size, data=config.mesh.data,
                pipe=config.mesh.pipe, M=M, microbatch=costs[0].batch_size,
                schedule=config.pipeline.schedule, boundaries=list(pipe.boundaries),
                terms=terms, predicted=predicted, argument=float(ma.argument_size_in_bytes),
                output=float(ma.output_size_in_bytes), temp=float(ma.temp_size_in_bytes),
                alias=float(ma.alias_size_in_bytes), compiled=compiled,
                error=predicted / compiled - 1.0,
                param_buffer=float(_nbytes(pipe.param_len)), residual_row=float(_nbytes(lay.res_len)),
                cross_ring=float(rings.get("cross", 0) * _nbytes(lay.cross_len)),
                model_row=terms["stash"] / rows if rows else 0.0,
                plan_s=plan_s, compile_s=compile_s)


def print_row(r: dict) -> None:
    print(f"\n{r['model']} ({r['size']}), data {r['data']} x pipe {r['pipe']}, {r['schedule']}, "
          f"M={r['M']} microbatches of {r['microbatch']}, boundaries {r['boundaries']} "
          f"(plan {r['plan_s']:.1f} s, compile {r['compile_s']:.1f} s)")
    print("  predicted: " + ", ".join(f"{k} {fmt_bytes(r['terms'][k])}" for k in TERMS
                                      if r["terms"].get(k)))
    print(f"  compiled:  argument {fmt_bytes(r['argument'])} + output {fmt_bytes(r['output'])} "
          f"+ temp {fmt_bytes(r['temp'])} - alias {fmt_bytes(r['alias'])}")
    print(f"  padding:   parameter buffer {fmt_bytes(r['param_buffer'])} (model "
          f"{fmt_bytes(r['terms']['params'])}); residual row {fmt_bytes(r['residual_row'])} "
          f"(model {fmt_bytes(r['model_row'])})" + (
              f"; cross ring {fmt_bytes(r['cross_ring'])} (model {fmt_bytes(r['terms']['cross'])})"
              if r["cross_ring"] or r["terms"]["cross"] else ""))
    print(f"  per device: predicted {fmt_bytes(r['predicted'])} ({r['predicted']:.0f} B), "
          f"compiled {fmt_bytes(r['compiled'])} ({r['compiled']:.0f} B), error {r['error']:+.1%}")


def main(argv) -> None:
    del argv
    t0 = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"host: {jax.device_count()} x {jax.devices()[0].platform} devices; step "
          f"{FLAGS.step}; pipe {FLAGS.pipe}; size {FLAGS.size}; schedule "
          f"{FLAGS.config_schedule or 'as configured'}; load average {load:.2f}")
    if FLAGS.remat not in ("none", "layers", "full"):
        from jaxhybrid.pipeline.stages import check_stage_remat
        try:
            check_stage_remat(FLAGS.remat)
        except ValueError as e:
            raise SystemExit(f"bench memory: --remat={FLAGS.remat}: {e}") from None
    rows = []
    for name in FLAGS.models:
        config = model_config(name, FLAGS.size, FLAGS.pipe, FLAGS.config_schedule)
        if config.mesh.data * config.mesh.pipe > jax.device_count():
            raise SystemExit(f"bench memory: {name} needs data {config.mesh.data} x pipe "
                             f"{config.mesh.pipe} devices, found {jax.device_count()}.")
        rows.append(compare(config, FLAGS.step, FLAGS.remat))
        print_row(rows[-1])
    err = np.abs([r["error"] for r in rows])
    print(f"\nmean |error| {err.mean():.1%}, worst {err.max():.1%} over {len(rows)} models; "
          f"bench took {time.perf_counter() - t0:.0f} s")
