"""Plans a model's pipeline: stage boundaries, device mapping, recomputation.

    python scripts/plan.py --config=inception_hybrid.py
    python scripts/plan.py --config=gpt_hybrid.py --topology="2x4:intra=300GB/s,inter=12GB/s" \\
        --memory_budget=64MB --plot=plan.png --json=plan.json
    python scripts/plan.py --model=inception_v3 --size=small --stages=8 --microbatches=8 \\
        --batch_size=64

Profiles the model's layers on one microbatch (XLA cost analysis; --measure times them),
then prints `Plan.summary()` (per-stage layers, time, memory, remat) and writes the
Gantt chart (--plot) with the memory chart beside it (<stem>_memory.png), printing both
paths, and the plan as JSON (--json; `Plan.from_json` reads it, and `Pipeline(plan=...)`
runs it). --config takes a path or a name in configs/; --model etc.
override or replace it. Topology spec strings: docs/planner.md.
"""
import os
import sys

# Planning profiles layers on the host device; simulated CPU devices make the configs'
# meshes valid for the checks (a GPU host keeps its GPUs).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "config name in configs/ or a path.")
flags.DEFINE_string("model", None, "model name (overrides the config's model.name).")
flags.DEFINE_string("size", None, "model size: tiny | small | full.")
flags.DEFINE_integer("stages", None, "pipeline stages (default: config mesh.pipe).")
flags.DEFINE_integer("data", None, "data-parallel replicas (default: config mesh.data).")
flags.DEFINE_integer("microbatches", None, "microbatches per step.")
flags.DEFINE_integer("batch_size", None, "global batch size.")
flags.DEFINE_string("schedule", None, "a registered schedule: gpipe, 1f1b, interleaved, zb-h1, zbv, "
                    "async, pipedream, 2bw, spectrain, ... (an unknown name lists them).")
flags.DEFINE_integer("virtual_stages", None, "stages per device of --schedule=interleaved "
                     "(default: config pipeline.virtual_stages, 2); the plan has stages x "
                     "this many stages.")
flags.DEFINE_string("topology", None, 'e.g. "2x4:intra=300GB/s,inter=12GB/s".')
flags.DEFINE_string("memory_budget", None, 'bytes per device, e.g. "16GB".')
flags.DEFINE_enum("objective", None, ["bottleneck", "alpa", "step"],
                  "stage objective: the least slowest stage, alpa's sum + (M - 1) x slowest "
                  "stage, or the least predicted step (make_plan).")
flags.DEFINE_bool("measure", False, "time each layer instead of the roofline estimate.")
flags.DEFINE_string("plot", "plan.png", "PNG path of the Gantt chart ('.png' added when it "
                    "has no suffix); the memory chart goes to <stem>_memory.png beside it "
                    "('' to skip both).")
flags.DEFINE_string("json", None, "write the plan as JSON here.")


def build_config():
    """The config (from --config or defaults) with the command-line overrides applied."""
    import ml_collections
    from jaxhybrid import config_flags
    config = (config_flags.load_config(FLAGS.config) if FLAGS.config
              else config_flags.base_config())
    config = ml_collections.ConfigDict(config.to_dict())   # unlocked copy to override
    for section, key, value in [("model", "name", FLAGS.model), ("model", "size", FLAGS.size),
                                ("mesh", "pipe", FLAGS.stages), ("mesh", "data", FLAGS.data),
                                ("pipeline", "num_microbatches", FLAGS.microbatches),
                                ("pipeline", "schedule", FLAGS.schedule),
                                ("pipeline", "virtual_stages", FLAGS.virtual_stages),
                                ("train", "batch_size", FLAGS.batch_size)]:
        if value is not None:
            config[section][key] = value
    if config.model.get("module"):   # it said "give --config=<name>", which was given
        raise ValueError(f"the config names model.module={config.model.module!r}, one Flax "
                         f"module split at start-up: plan.py plans the registered models "
                         f"(--model=...); scripts/train.py prints that model's plan when it "
                         f"starts (e.g. with --config.train.steps=1).")
    if not config.model.get("name"):
        raise ValueError("give --config=<name> or --model=<inception_v3|gnmt|biglstm|gpt>.")
    if FLAGS.virtual_stages is not None and config.pipeline.get("schedule") != "interleaved":
        # Every other schedule fixes its stages per device: the flag would do nothing.
        raise ValueError(f"--virtual_stages is an option of --schedule=interleaved (the "
                         f"schedule is {config.pipeline.get('schedule')!r}); drop it or use "
                         f"interleaved.")
    # -1 (as in make_mesh): the devices left over, on the topology if given, else this host.
    # None: not set (one); 0 stays 0, so that plan_from_config names it.
    data, pipe = (1 if v is None else v for v in (config.mesh.get("data"), config.mesh.get("pipe")))
    for name, v in (("data (--data)", data), ("pipe (--stages)", pipe)):
        if v != -1 and v < 1:
            raise ValueError(f"mesh.{name}={v} must be >= 1, or -1 for the devices left over.")
    if -1 in (data, pipe):
        if data == pipe:
            raise ValueError("mesh.data and mesh.pipe are both -1; set --stages or --data.")
        if FLAGS.topology:
            from jaxhybrid.plan import Topology
            n = Topology.from_spec(FLAGS.topology).n
        else:
            import jax
            n = jax.device_count()
        data, pipe = (max(1, n // pipe), pipe) if data == -1 else (data, max(1, n // data))
    config.mesh.data, config.mesh.pipe = data, pipe
    return config


def main(argv):
    if len(argv) > 1:   # one line, as every other error (not absl's page of flags)
        sys.exit(f"error: unexpected arguments {argv[1:]}; flags are --name=value.")
    from jaxhybrid.plan import plan_from_config
    from jaxhybrid.plan.plan import png_path
    try:
        if FLAGS.plot:   # each mistake was found after planning
            png_path(FLAGS.plot, "--plot")
        folder = os.path.dirname(os.path.abspath(FLAGS.json)) if FLAGS.json else None
        if folder and not os.path.isdir(folder):
            raise ValueError(f"--json={FLAGS.json}: no folder {folder}; create it or pick "
                             f"another path.")
        if FLAGS.json and os.path.isdir(FLAGS.json):   # "Is a directory", after planning
            raise ValueError(f"--json={FLAGS.json} is a folder; give a file name in it, e.g. "
                             f"{os.path.join(FLAGS.json, 'plan.json')!r}.")
        config = build_config()
        plan, costs = plan_from_config(config, topology=FLAGS.topology,
                                       memory_budget=FLAGS.memory_budget,
                                       measure=FLAGS.measure, objective=FLAGS.objective)
    except ValueError as e:   # includes MemoryBudgetError: says by how much
        sys.exit(f"error: {e}")
    print(f"{config.model.name} ({config.model.size}): {len(costs)} layers, "
          f"data={config.mesh.data} x pipe={config.mesh.pipe}, "
          f"M={config.pipeline.num_microbatches}, batch {config.train.batch_size}")
    print(plan.summary())
    import jax
    need = config.mesh.data * config.mesh.pipe
    if not FLAGS.topology and need > jax.device_count():   # planned, but not for this host
        print(f"note: this plan is for {need} devices (data {config.mesh.data} x pipe "
              f"{config.mesh.pipe}); this host has {jax.device_count()}, so train.py cannot "
              f"run it here (--topology plans for another machine and its links).")
    try:   # the plan first: a chart that cannot be written does not lose it
        if FLAGS.json:
            with open(FLAGS.json, "w") as f:
                f.write(plan.to_json())
            print(f"plan: {FLAGS.json}")
        if FLAGS.plot:   # the files written (--plot=chart wrote chart.png, printed as chart)
            gantt, memory = plan.plot(FLAGS.plot)
            print(f"chart: {gantt}\nmemory chart: {memory}")
    except OSError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    app.run(main)
