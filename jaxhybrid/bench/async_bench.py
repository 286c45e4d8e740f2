"""Convergence study of the asynchronous schedules (docs/async.md).

    python scripts/bench.py async [--tasks=digits,text] [--stages=4,8] [--examples=...]

What is held equal. Every run trains the same model from the same initial weights on the
same data stream (the same examples in the same order) with the same optimizer
(momentum SGD, the setting SpecTrain's prediction W - s lr v is defined for), the same
learning-rate schedule over updates and the same microbatch (--microbatch examples, so
BatchNorm's batch statistics are taken over equally many examples everywhere), through
`jaxhybrid.train` (prepare / initial_state / make_train_step / evaluate: the path
scripts/train.py runs). What differs is when weights change:

  * `1f1b` (= `1f1b:1`): synchronous, one microbatch per update, flushed: the same
    sequence of updates as the asynchronous schedules without staleness (what the
    papers' data-parallel baseline is to them);
  * `async`, `pipedream`, `spectrain`, `spectrain-v1`: a call streams
    --async_microbatches microbatches, one update per microbatch; stage k's updates are
    D_k = 2(S-1-k) stale in the lock-step table;
  * `2bw`: the same stream, one update per window of w microbatches (PipeDream-2BW's
    gradient accumulation), one version stale; `1f1b:window` is its synchronous twin
    (w microbatches per update, flushed), `1f1b:N` any other count.

Printed per run: final test accuracy (digits: Inception-V3 tiny on scikit-learn digits)
or test loss (text: GPT on the shipped Python sources), mean training loss of the last
tenth of the run, the compiled step's temp memory per device and the weight-version
ring's bytes per device, CPU-seconds per example (calls after the first; this host's
cores are shared, so compare within one run) and the planner's step-time model for a GPU
cluster (--hardware, `jaxhybrid.plan.hybrid.step_time` on the model's profiled layer
costs at one microbatch, the same stage split): time per example of a call as the engine
runs it (fill and drain once per call, plus every U task's optimizer update), and of the
steady stream the asynchronous schedules reach without a drain.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

if "jax" not in __import__("sys").modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from absl import flags

from jaxhybrid.config_flags import define_int_list
from jaxhybrid import data, models, startup, train
from jaxhybrid.boundaries import even_boundaries
from jaxhybrid.config_flags import load_config
from jaxhybrid.metrics import evaluate
from jaxhybrid.pipeline import packing, tables
from jaxhybrid.plan.topology import fmt_bytes
from jaxhybrid.schedules import asynchronous, make_schedule

FLAGS = flags.FLAGS
flags.DEFINE_list("tasks", "digits,text", "digits (Inception-V3 tiny, accuracy) and/or text "
                  "(GPT, loss).")
define_int_list("stages", "4,8", "pipeline depths S (mesh data=1 x pipe=S).")
flags.DEFINE_list("schedules", "1f1b,async,pipedream,spectrain,spectrain-v1,2bw,1f1b:window",
                  "schedules to compare: 1f1b[:N] is synchronous with N microbatches per "
                  "update (N=window: 2bw's window at that S), the others asynchronous.")
flags.DEFINE_integer("microbatch", 16, "examples per microbatch, the same for every run.")
flags.DEFINE_integer("async_microbatches", 16, "microbatches per asynchronous call.")
flags.DEFINE_integer("examples", 0, "training examples per run (0: the task's default).")
flags.DEFINE_integer("eval_examples", 0, "test examples, the first of the test split, the "
                     "same for every run (0: the whole split).")
flags.DEFINE_float("learning_rate", 0.0, "peak learning rate (0: the task's default).")
flags.DEFINE_float("momentum", 0.9, "SGD momentum.")
flags.DEFINE_string("hardware", "v100_dgx1", "preset of jaxhybrid.plan.hardware for the "
                    "GPU step-time prediction.")
flags.DEFINE_string("json", "", "also write the rows to this file (one JSON object a line).")
flags.DEFINE_string("from_json", "", "train nothing: print the table of the rows in this file "
                    "(--json output; e.g. docs/async_study.jsonl), the GPU columns recomputed "
                    "(and, with --json, written there).")
flags.DEFINE_string("cache_dir", None, "jax's persistent compilation cache (default: "
                    "scripts/train.py's, ~/.cache/jaxhybrid); empty: none.")
flags.DEFINE_integer("seed", 0, "seed of initialisation, data order and dropout.")


@dataclasses.dataclass(frozen=True)
class Task:
    config: str
    overrides: dict
    examples: int          # default training examples per run
    learning_rate: float   # default peak learning rate (momentum SGD)
    metric: str
    label: str


TASKS = {
    # digits: 1,920 updates (~21 epochs); at 480 the sync seeds spanned 8 points (0.77-0.85)
    "digits": Task("inception_hybrid.py", {"model.size": "tiny"}, 16 * 1920, 0.05,
                   "eval_accuracy", "test accuracy"),
    "text": Task("gpt_hybrid.py", {"model.size": "tiny", "data.options.max_bytes": 200_000}, 16 * 960, 0.1,
                 "eval_loss", "test loss"),
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One row of the study: a schedule and how its calls are sized."""
    name: str          # as printed: "1f1b", "1f1b:8", "spectrain", ...
    schedule: str      # the registered schedule
    M: int             # microbatches per call
    per_update: int    # microbatches per optimizer update

    @property
    def synchronous(self) -> bool:
        return self.schedule == "1f1b"


def resolve(name: str, S: int) -> Run:
    """The study's name for a schedule -> how it runs at depth S."""
    M = FLAGS.async_microbatches
    if name == "1f1b" or name.startswith("1f1b:"):
        n = name.partition(":")[2] or "1"
        n = asynchronous.two_bw_window(S, M) if n == "window" else int(n)
        return Run(f"1f1b:{n}" if n > 1 else "1f1b", "1f1b", n, n)
    sched = make_schedule(name, S, M)
    return Run(name, name, M, M // asynchronous.updates_per_call(sched))


def run_config(task: str, S: int, run: Run, examples: int):
    spec = TASKS[task]
    mb = FLAGS.microbatch
    per_call = run.M * mb
    steps = max(1, examples // per_call)
    updates = steps * run.M // run.per_update
    eval_steps = FLAGS.eval_examples and max(1, FLAGS.eval_examples // per_call)
    config = load_config(spec.config, {
        **spec.overrides, "mesh.data": 1, "mesh.pipe": S, "pipeline.schedule": run.schedule,
        "pipeline.num_microbatches": run.M, "pipeline.remat": "none",
        "train.optimizer": "sgd", "train.momentum": FLAGS.momentum,
        "train.learning_rate": FLAGS.learning_rate or spec.learning_rate,
        "train.batch_size": per_call, "train.steps": steps,
        # warm-up: the first tenth of the updates, in every run
        "train.warmup_steps": max(1, steps // 10), "train.weight_decay": 0.0,
        "train.grad_clip_norm": 0.0, "train.eval_steps": eval_steps,
        "train.seed": FLAGS.seed, "train.log_every": steps, "train.eval_every": 0})
    if task == "text":   # 6 blocks: embedding | 6 blocks | head splits 8 ways too
        with config.unlocked():
            config.model.overrides.num_layers = 6
    return config, updates


def even_cuts(config, S: int) -> tuple:
    """`boundaries.even_boundaries` over the config's layers (no planner profiling: the
    same split for every run)."""
    L = len(models.get_model(config.model.name, config.model.size,
                             **config.model.overrides.to_dict()).layers)
    return tuple(even_boundaries(L, S))


def gpu_prediction(config, S: int, run: Run, bounds) -> tuple[float, float]:
    """(per call, steady stream) seconds per example on --hardware from the planner's
    step-time model: `hybrid.step_time` of the call's table on the model's layer costs
    at one microbatch (the same stage split), which prices every U task's update. The
    stream (no fill, no drain, what carrying in-flight microbatches across calls would
    reach): the time a call of 2M microbatches adds over one of M, per example; for a
    synchronous schedule the call itself."""
    from jaxhybrid.plan import costs as plan_costs, hybrid
    from jaxhybrid.plan.hardware import get_hardware
    hw = get_hardware(FLAGS.hardware)
    spec = models.get_model(config.model.name, config.model.size, **config.model.overrides.to_dict())
    per_layer = plan_costs.profile(spec.layers, spec.sample_batch(FLAGS.microbatch)[0])

    def call_time(M: int) -> float:
        est = hybrid.step_time(per_layer, hw, data=1, pipe=S, num_microbatches=M,
                               per_worker_batch=M * FLAGS.microbatch, schedule=run.schedule,
                               optimizer_states=1, boundaries=list(bounds))
        return est.step_time

    call = call_time(run.M) / (run.M * FLAGS.microbatch)
    if run.synchronous:
        return call, call
    return call, (call_time(2 * run.M) - call_time(run.M)) / (run.M * FLAGS.microbatch)


def run_one(task: str, S: int, name: str, examples: int) -> dict:
    run = resolve(name, S)
    config, updates = run_config(task, S, run, examples)
    bounds = even_cuts(config, S)
    config.pipeline.boundaries = bounds
    t = config.train
    prepared = train.prepare(config)
    pipe = prepared.pipe
    init_rng, train_rng = jax.random.split(jax.random.key(t.seed))
    state = train.initial_state(pipe, t, pipe.init(init_rng, prepared.sample_inputs))
    step_fn = train.make_train_step(prepared, t)
    batches = data.prefetch_to_mesh(prepared.train_batches(), prepared.mesh)
    x, y = next(batches)
    started = time.time()
    compiled = step_fn.lower(state, (None, None), x, y, jax.random.fold_in(train_rng, 1)).compile()
    compile_s = time.time() - started
    temp = compiled.memory_analysis().temp_size_in_bytes
    ring = tables.control_table(pipe.schedule.with_updates()).sizes.get("versions", 0)
    version_bytes = ring * sum(np.dtype(packing.dtype_of(k)).itemsize * n
                               for k, n in pipe.param_len.items())
    losses, cpu = [], 0.0
    for step in range(1, t.steps + 1):
        if step > 1:
            x, y = next(batches)
        c0 = time.process_time()
        state, m = compiled(state, (None, None), x, y, jax.random.fold_in(train_rng, step))
        losses.append(float(m["loss"]))   # waits for the step (see train.py: no deep queue)
        if step > 1:
            cpu += time.process_time() - c0
    metrics = evaluate(prepared, state["variables"], t.eval_steps)
    timed = (t.steps - 1) * t.batch_size
    gpu_call, gpu_stream = gpu_prediction(config, S, run, bounds)
    sched = pipe.schedule
    return dict(task=task, S=S, schedule=run.name, updates=updates,
                update_batch=run.per_update * FLAGS.microbatch, examples=t.steps * t.batch_size,
                metric=metrics[TASKS[task].metric],
                train_loss=float(np.mean(losses[-max(1, len(losses) // 10):])),
                temp=int(temp), versions=int(version_bytes),
                cpu_per_example=cpu / max(timed, 1), compile_s=compile_s,
                gpu_call=gpu_call, gpu_stream=gpu_stream,
                staleness=[] if run.synchronous else asynchronous.staleness(sched).tolist(),
                learning_rate=t.learning_rate, seed=t.seed, microbatch=FLAGS.microbatch,
                async_microbatches=FLAGS.async_microbatches, load=os.getloadavg()[0],
                host=f"{os.cpu_count()} cores, jax {jax.__version__}")


HEADER = (f"{'task':6} {'S':>2} {'schedule':15} {'lr':>5} {'updates':>7} {'upd.batch':>9} {'examples':>8} "
          f"{'metric':>8} {'train loss':>10} {'temp/dev':>9} {'versions/dev':>12} "
          f"{'CPU-ms/ex':>9} {'vs 1f1b':>7} {'GPU us/ex call':>14} {'stream':>7}")


def format_row(r: dict, rows: list) -> str:
    """One run's row; CPU-seconds also as a ratio to that of the 1f1b row of the same
    task, S, learning rate, examples and seed."""
    key = lambda q: (q["task"], q["S"], q["learning_rate"], q["examples"], q.get("seed", 0))  # noqa: E731
    base = {key(q): q["cpu_per_example"] for q in rows if q["schedule"] == "1f1b"}
    ref = base.get(key(r))
    ratio = f"{r['cpu_per_example'] / ref:7.2f}" if ref else f"{'-':>7}"
    return (f"{r['task']:6} {r['S']:>2} {r['schedule']:15} {r['learning_rate']:5.3g} {r['updates']:>7} "
            f"{r['update_batch']:>9} {r['examples']:>8} {r['metric']:8.4f} "
            f"{r['train_loss']:10.4f} {fmt_bytes(r['temp']):>9} {fmt_bytes(r['versions']):>12} "
            f"{1e3 * r['cpu_per_example']:9.3f} {ratio} {1e6 * r['gpu_call']:14.2f} "
            f"{1e6 * r['gpu_stream']:7.2f}")


def print_means(rows: list) -> None:
    """Mean, standard deviation and range of the metric over the seeds of each setting
    (task, S, schedule, learning rate, examples, examples per update) on each platform
    (the rows' jax version: float summation orders differ between them)."""
    groups = {}
    for r in rows:
        jax_version = r.get("host", "jax ?").rpartition("jax ")[2]
        key = (r["task"], r["S"], r["schedule"], r["learning_rate"], r["examples"],
               r["update_batch"], jax_version)
        groups.setdefault(key, []).append(r["metric"])
    print(f"\n{'task':6} {'S':>2} {'schedule':15} {'lr':>5} {'examples':>8} {'upd.batch':>9} "
          f"{'jax':>7} {'seeds':>5} {'mean':>7} {'sd':>7} {'min':>7} {'max':>7}")
    for (task, S, name, lr, examples, batch, version), v in groups.items():
        v = np.asarray(v)
        sd = v.std(ddof=1) if len(v) > 1 else float("nan")
        print(f"{task:6} {S:>2} {name:15} {lr:5.3g} {examples:>8} {batch:>9} {version:>7} "
              f"{len(v):>5} {v.mean():7.4f} {sd:7.4f} {v.min():7.4f} {v.max():7.4f}")


def print_saved(path: str) -> None:
    """The table of saved rows (in file order), GPU columns from today's step-time model."""
    rows = []
    print(HEADER)
    with open(path) as f:
        for line in filter(str.strip, f):
            r = json.loads(line)
            FLAGS.microbatch = r.get("microbatch", 16)
            FLAGS.async_microbatches = r.get("async_microbatches", 16)
            run = resolve(r["schedule"], r["S"])
            config, _ = run_config(r["task"], r["S"], run, r["examples"])
            r["gpu_call"], r["gpu_stream"] = gpu_prediction(config, r["S"], run,
                                                            even_cuts(config, r["S"]))
            rows.append(r)
            print(format_row(r, rows) + f"   # seed {r.get('seed', 0)}, load {r['load']:.1f}"
                  + (f", {r['host']}" if "host" in r else ""))
    print_means(rows)
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def main(argv) -> None:
    del argv
    unknown = [t for t in FLAGS.tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"--tasks: unknown {unknown}; choose from {', '.join(TASKS)}.")
    startup.enable_caches(startup.default_cache_dir() if FLAGS.cache_dir is None
                          else FLAGS.cache_dir)
    if FLAGS.from_json:
        if FLAGS.json and os.path.abspath(FLAGS.json) == os.path.abspath(FLAGS.from_json):
            raise ValueError(f"--json={FLAGS.json} is the file --from_json reads; its rows "
                             f"would be rewritten with this run's predictions: write another "
                             f"file.")
        print_saved(FLAGS.from_json)
        return
    rows = []
    print(f"microbatch {FLAGS.microbatch} examples; asynchronous calls of "
          f"{FLAGS.async_microbatches} microbatches; momentum SGD ({FLAGS.momentum}); "
          f"GPU model: {FLAGS.hardware}", flush=True)
    print(HEADER, flush=True)
    for task in FLAGS.tasks:
        examples = FLAGS.examples or TASKS[task].examples
        for S in FLAGS.stages:
            for name in FLAGS.schedules:
                started = time.time()
                rows.append(run_one(task, S, name, examples))
                print(format_row(rows[-1], rows), flush=True)
                r = rows[-1]
                print(f"#   ({TASKS[task].label}; lr {r['learning_rate']:g}; staleness per stage "
                      f"{r['staleness']}; compile {r['compile_s']:.0f} s; "
                      f"{time.time() - started:.0f} s wall; load average {r['load']:.1f})",
                      flush=True)
                if FLAGS.json:
                    with open(FLAGS.json, "a") as f:
                        f.write(json.dumps(r) + "\n")
