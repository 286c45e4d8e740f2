"""Projects time to accuracy of DP-only vs hybrid DP x PP training for 8..1024 devices.

    python scripts/project.py --model=inception_v3 --devices=8,16,32,64,128,256,512,1024 \
        --hardware=v100_dgx1 --out=proj.png [--json]

Prints the best data-parallel-only and the best hybrid configuration for each N, the
speedup and the crossover N (see docs/projection.md for every assumption).
"""
from __future__ import annotations

import json
import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "inception_v3", "inception_v3 | gnmt | biglstm (or any "
                    "jaxhybrid.models name with --costs=profile and --per_worker_batch).")
flags.DEFINE_list("devices", "8,16,32,64,128,256,512,1024", "device counts N to project.")
flags.DEFINE_string("hardware", "v100_dgx1", "v100_dgx1 | a100_dgx | h100_dgx.")
flags.DEFINE_integer("per_worker_batch", None, "examples per DP worker (default: per model).")
flags.DEFINE_string("costs", "reference", "reference (analytic, full size) | profile.")
flags.DEFINE_string("size", "full", "model size to profile with --costs=profile.")
flags.DEFINE_list("schedules", "1f1b", "pipeline schedules to search.")
flags.DEFINE_integer("max_pipe", None, "largest pipeline depth to consider.")
flags.DEFINE_float("b_noise", None, "override the gradient noise scale B_noise (examples).")
flags.DEFINE_float("e_min", None, "override the small-batch epochs to target E_min.")
flags.DEFINE_float("max_batch", None, "critical batch: no fewer steps beyond it.")
flags.DEFINE_bool("json", False, "print JSON instead of the table.")
flags.DEFINE_bool("all_configs", False, "with --json: include every configuration tried.")
flags.DEFINE_string("out", None, "write a PNG of time to accuracy vs N here.")


def main(argv):
    del argv
    from jaxhybrid.plan import hybrid, stat_efficiency
    try:
        devices = [int(d) for d in FLAGS.devices]
        stat = stat_efficiency.default_for(FLAGS.model) if FLAGS.model in \
            stat_efficiency.MODEL_DEFAULTS else None
        if FLAGS.b_noise or FLAGS.e_min or FLAGS.max_batch:
            if stat is None:
                raise ValueError(f"--b_noise/--e_min need a default curve to modify; "
                                 f"{FLAGS.model!r} has none.")
            stat = stat_efficiency.StatEfficiency.from_epochs(
                FLAGS.e_min or stat.e_min, FLAGS.b_noise or stat.b_noise, stat.dataset_size,
                max_batch=FLAGS.max_batch or stat.max_batch, name=stat.name, source="command line")
        proj = hybrid.project(FLAGS.model, devices, FLAGS.hardware,
                              per_worker_batch=FLAGS.per_worker_batch, stat=stat,
                              costs=FLAGS.costs, size=FLAGS.size, schedules=FLAGS.schedules,
                              max_pipe=FLAGS.max_pipe)
    except ValueError as e:
        sys.exit(f"project.py: {e}")
    if FLAGS.json:
        out = proj.to_json()
        if not FLAGS.all_configs:
            out.pop("configs")
        print(json.dumps(out, indent=1))
    else:
        print(proj.table())
    if FLAGS.out:
        proj.plot(FLAGS.out)
        if not FLAGS.json:
            print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
