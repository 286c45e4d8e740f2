"""Convergence study of the asynchronous schedules (docs/async.md).

    python scripts/bench.py async [--tasks=digits,text] [--stages=4,8] [--examples=...]

For each task, pipeline depth S and schedule (sync 1f1b, async, pipedream, 2bw,
spectrain, spectrain-v1) it trains the same model on the same data stream with the same
optimizer, the same update batch (--update_batch examples per optimizer update) and the
same number of examples, through `jaxhybrid.train` (prepare / initial_state /
make_train_step / evaluate: the path scripts/train.py runs):
  * sync 1f1b: one update per step; a step is --sync_microbatches microbatches of
    update_batch / sync_microbatches examples, flushed;
  * asynchronous: a call streams --async_microbatches microbatches of update_batch
    examples each, one update per microbatch; 2bw: one update per window of
    microbatches of update_batch / window examples.
The learning-rate schedule is the same per update (warm-up and cosine over updates).
Printed per run: final test accuracy (digits: Inception-V3 tiny on scikit-learn
digits) or test loss (text: GPT on the shipped Python sources), the compiled step's
temp memory per device and the weight-version ring's bytes per device, CPU-seconds per
example (steps after the first; this host's cores are shared, so compare within one
run), and the tick model's time per example on a GPU cluster relative to an ideal
pipeline, 1 / (1 - bubble) with F = 1, B = 2 and per-example linear cost (the
asynchronous call has no flush between updates, only one fill/drain per call).
"""
from __future__ import annotations

import os
import time

if "jax" not in __import__("sys").modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from absl import app, flags

from jaxhybrid import data, models, train
from jaxhybrid.config_flags import load_config
from jaxhybrid.pipeline import packing, tables
from jaxhybrid.plan.topology import fmt_bytes
from jaxhybrid.schedules import asynchronous, make_schedule

FLAGS = flags.FLAGS
flags.DEFINE_list("tasks", "digits,text", "digits (Inception-V3 tiny, accuracy) and/or text "
                  "(GPT, loss).")
flags.DEFINE_list("stages", "4,8", "pipeline depths S (mesh data=1 x pipe=S).")
flags.DEFINE_list("schedules", "1f1b,async,pipedream,2bw,spectrain,spectrain-v1",
                  "schedules to compare (1f1b is the synchronous baseline).")
flags.DEFINE_integer("update_batch", 16, "examples per optimizer update.")
flags.DEFINE_integer("sync_microbatches", 4, "microbatches per synchronous step.")
flags.DEFINE_integer("async_microbatches", 16, "microbatches (= updates) per asynchronous call.")
flags.DEFINE_integer("examples", 0, "training examples per run (0: the task's default).")
flags.DEFINE_integer("eval_examples", 0, "test examples, the first of the test split, the "
                     "same for every run whatever its batch size (0: the whole split).")
flags.DEFINE_integer("seed", 0, "seed of initialisation, data order and dropout.")

# Per task: config, overrides, default examples, optimizer.
TASKS = {
    "digits": ("inception_hybrid.py", {"model.size": "tiny", "train.optimizer": "sgd",
                                       "train.momentum": 0.9, "train.learning_rate": 0.02},
               16 * 400, ("eval_accuracy", "test accuracy")),
    "text": ("gpt_hybrid.py", {"model.size": "tiny", "train.optimizer": "adamw", "train.learning_rate": 3e-3,
                               "data.options.max_bytes": 200_000},
             16 * 400, ("eval_loss", "test loss")),
}


def run_config(task: str, S: int, schedule: str, examples: int):
    name, overrides, _, _ = TASKS[task]
    b = FLAGS.update_batch
    sync = schedule == "1f1b"
    M = FLAGS.sync_microbatches if sync else FLAGS.async_microbatches
    # Every update takes update_batch examples: 2bw accumulates a window of microbatches
    # per update, so its microbatches are update_batch / window examples.
    per_update = asynchronous.updates_per_call(make_schedule(schedule, S, M))
    per_call = b * per_update
    if per_call % M:
        raise ValueError(f"{schedule}: {per_call} examples per call do not split into {M} "
                         f"microbatches; change --update_batch or the microbatch counts.")
    steps = max(1, examples // per_call)
    updates = steps * per_update
    config = load_config(name, {
        **overrides, "mesh.data": 1, "mesh.pipe": S, "pipeline.schedule": schedule,
        "pipeline.num_microbatches": M, "pipeline.remat": "none",
        "train.batch_size": per_call, "train.steps": steps,
        "train.warmup_steps": max(1, steps // 10), "train.weight_decay": 0.0,
        "train.grad_clip_norm": 0.0, "train.eval_steps": FLAGS.eval_examples and max(1, FLAGS.eval_examples // per_call),
        "train.seed": FLAGS.seed, "train.log_every": steps, "train.eval_every": 0})
    if task == "text":   # 6 blocks: embedding | 6 blocks | head splits 8 ways too
        with config.unlocked():
            config.model.overrides.num_layers = 6
    return config, updates


def run_one(task: str, S: int, schedule: str, examples: int) -> dict:
    config, updates = run_config(task, S, schedule, examples)
    t = config.train
    # Even cuts over the layers (no planner profiling: the same split for every schedule).
    L = len(models.get_model(config.model.name, config.model.size,
                             **config.model.overrides.to_dict()).layers)
    bounds = [round(i * L / S) for i in range(1, S)]
    config.pipeline.boundaries = tuple(bounds)
    run = train.prepare(config)
    pipe = run.pipe
    rng = jax.random.key(t.seed)
    init_rng, train_rng = jax.random.split(rng)
    state = train.initial_state(pipe, t, pipe.init(init_rng, run.sample_inputs))
    step_fn = train.make_train_step(run, t)
    batches = data.prefetch_to_mesh(run.train_batches(), run.mesh)
    x, y = next(batches)
    compiled = step_fn.lower(state, None, x, y, jax.random.fold_in(train_rng, 1)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    sched = pipe.schedule.with_updates()
    ring = tables.control_table(sched).sizes.get("versions", 0)
    version_bytes = ring * sum(np.dtype(packing.dtype_of(k)).itemsize * n
                               for k, n in pipe.param_len.items())
    losses, cpu = [], 0.0
    for step in range(1, t.steps + 1):
        if step > 1:
            x, y = next(batches)
        c0 = time.process_time()
        state, m = compiled(state, None, x, y, jax.random.fold_in(train_rng, step))
        loss = float(m["loss"])
        if step > 1:
            cpu += time.process_time() - c0
        losses.append(loss)
    metrics = train.evaluate(run, state["variables"], t.eval_steps)
    timed = (t.steps - 1) * t.batch_size
    return dict(task=task, S=S, schedule=schedule, updates=updates, examples=t.steps * t.batch_size,
                metric=metrics[TASKS[task][3][0]], train_loss=float(np.mean(losses[-5:])),
                temp=temp, versions=version_bytes, cpu_per_example=cpu / max(timed, 1),
                model_time=1.0 / (1.0 - sched.bubble_fraction()),
                staleness=list(asynchronous.staleness(sched)) if schedule != "1f1b" else [])


def print_header() -> None:
    print(f"{'task':6} {'S':>2} {'schedule':13} {'updates':>7} {'examples':>8} {'metric':>8} "
          f"{'train loss':>10} {'temp mem/dev':>12} {'versions/dev':>12} "
          f"{'CPU-ms/ex':>9} {'vs 1f1b':>7} {'GPU model':>9}", flush=True)


def print_row(r: dict, rows: list) -> None:
    """One run's row; CPU-seconds also as a ratio to 1f1b's of the same task and S."""
    base = {(q["task"], q["S"]): q["cpu_per_example"] for q in rows if q["schedule"] == "1f1b"}
    ref = base.get((r["task"], r["S"]))
    ratio = f"{r['cpu_per_example'] / ref:7.2f}" if ref else f"{'-':>7}"
    print(f"{r['task']:6} {r['S']:>2} {r['schedule']:13} {r['updates']:>7} {r['examples']:>8} "
          f"{r['metric']:8.4f} {r['train_loss']:10.4f} {fmt_bytes(r['temp']):>12} "
          f"{fmt_bytes(r['versions']):>12} {1e3 * r['cpu_per_example']:9.3f} {ratio} "
          f"{r['model_time']:9.3f}", flush=True)


def main(argv) -> None:
    del argv
    rows = []
    print(f"update batch {FLAGS.update_batch}; sync: {FLAGS.sync_microbatches} microbatches "
          f"per update; async: {FLAGS.async_microbatches} microbatches per call")
    print_header()
    for task in FLAGS.tasks:
        examples = FLAGS.examples or TASKS[task][2]
        for S in map(int, FLAGS.stages):
            for schedule in FLAGS.schedules:
                started = time.time()
                rows.append(run_one(task, S, schedule, examples))
                print_row(rows[-1], rows)
                print(f"#   ({TASKS[task][3][1]}; {time.time() - started:.0f} s wall, load "
                      f"average {os.getloadavg()[0]:.1f})", flush=True)
