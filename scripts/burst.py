"""Burst parallelism + multiplexing projected onto GPU clusters (DeepPool, docs/burst.md).

    python scripts/burst.py --model=vgg16,wrn,inception_v3 --devices=8,16,32,64,128,256,512,1024
    python scripts/burst.py --model=inception_v3 --hardware=h100_dgx --json
    python scripts/burst.py --model=vgg16 --devices=64 --hardware=v100_dgx1 --plot=/tmp/vgg64.png
        # the plan (one model, one cluster) as devices x time

For each model, cluster and size: the burst plan at the fixed global batch (per-layer
widths under the amplification limit), foreground throughput, a background job (the same
model, one instance of --bg_batch per device) in the idle device time, and single-job
data parallelism at the same global batch. Costs: Inception-V3 full from the analytic
`plan.reference_costs`, other models from `plan.profile` (XLA cost analysis at batch 1,
cached under --cache_dir).
"""
import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxhybrid.config_flags import define_int_list  # noqa: E402
from jaxhybrid.plan.plan import png_path  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("model", ["vgg16", "wrn", "inception_v3"], "models (jaxhybrid.models names)")
flags.DEFINE_string("size", "full", "model size preset: tiny | small | full")
define_int_list("devices", "8,16,32,64,128,256,512,1024", "cluster sizes")
flags.DEFINE_list("hardware", ["v100_dgx1", "h100_dgx"], "jaxhybrid.plan.hardware presets")
flags.DEFINE_integer("batch", 1024, "global batch (fixed: strong scaling)")
flags.DEFINE_integer("bg_batch", 32, "background job's batch per device instance")
flags.DEFINE_float("amplification_limit", 2.0, "DeepPool's amplification limit")
flags.DEFINE_float("fast_layer_time", 300e-6, "layers faster than this (s, at g=1) are exempt")
flags.DEFINE_float("mux_efficiency", 0.8, "share of idle time the background turns into work")
flags.DEFINE_string("cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "jaxhybrid"),
                    "where profiled costs are cached")
flags.DEFINE_bool("json", False, "print one JSON document instead of tables")
flags.DEFINE_string("plot", None, "PNG path: devices x time of the plan at the largest "
                    "--devices, for one --model and one --hardware ('.png' added when it has "
                    "no suffix)")
flags.DEFINE_bool("branches", True, "let layers made of parallel branches (Inception blocks) "
                  "run them side by side on separate device groups")

PAPER = "DeepPool (MLSys 2022): 2.2-2.4x total cluster throughput over single-job DP " \
        "(arXiv v1), 1.2-2.3x (final)"


def model_costs(name: str, size: str, cache_dir: str):
    """LayerCost list (or batch -> list) of the model at `size`."""
    from jaxhybrid.plan import LayerCost, reference_costs
    if name == "inception_v3" and size == "full":
        return reference_costs.inception_v3
    path = os.path.join(cache_dir, f"burst_costs_{name}_{size}.json")
    if os.path.exists(path):
        with open(path) as f:
            return [LayerCost.from_dict(d) for d in json.load(f)]
    from jaxhybrid import models
    from jaxhybrid.plan import profile
    spec = models.get_model(name, size)
    costs = profile(spec.layers, spec.sample_batch(1)[0])
    os.makedirs(cache_dir, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump([c.to_dict() for c in costs], f)
    os.replace(tmp, path)          # never a half-written cache
    return costs


def branch_costs(name: str, size: str):
    """{layer: per-branch costs at batch 1} of the model's concatenating layers."""
    from jaxhybrid import models
    from jaxhybrid.burst.branches import model_branch_costs
    spec = models.get_model(name, size)
    return model_branch_costs(spec.layers, spec.sample_batch(1)[0])


def project(costs, hardware: str, devices, batch: int, bg_batch: int, limit: float,
            fast: float, efficiency: float, branches=None):
    from jaxhybrid.plan import burst, multiplexing
    bg_step = multiplexing.single_device_step_time(costs, bg_batch, hardware)
    rows, plans = [], []
    for G in devices:
        p = burst.plan_burst(costs, num_devices=G, batch_size=batch, hardware=hardware,
                             amplification_limit=limit, fast_layer_time=fast,
                             branches=branches)
        t = multiplexing.throughput(p, bg_step_time=bg_step, bg_batch=bg_batch, efficiency=efficiency)
        tf = multiplexing.throughput(p, bg_step_time=bg_step, bg_batch=bg_batch, efficiency=efficiency,
                              forward_only=True)
        rows.append({"devices": G, "widths": p.widths, "branch_groups": {
                         str(l): [[o, g] for o, g, *_ in v] for l, v in p.branch_groups.items()},
                     "iteration_ms": 1e3 * p.iteration_time,
                     "dp_ms": 1e3 * p.dp_time, "device_time_vs_dp": p.device_time / p.dp_device_time,
                     **{k: v for k, v in t.to_dict().items() if k not in ("num_devices", "batch_size")},
                     "ratio_forward_idle_only": tf.ratio})
        plans.append(p)
    return rows, plans


def check_flags() -> str | None:
    """Every flag checked before any model is profiled (the lists by their parsers); the
    PNG --plot writes (None: no plot)."""
    from jaxhybrid.models import SIZES, registered_models
    from jaxhybrid.plan.hardware import get_hardware
    names = registered_models()
    if not FLAGS.model:      # --model= ran nothing and printed only the header
        raise ValueError(f"--model is empty; give one or more of {', '.join(names)}.")
    unknown = [m for m in FLAGS.model if m not in names]
    if unknown:
        raise ValueError(f"--model: unknown {unknown}; choose from {', '.join(names)}.")
    if FLAGS.size not in SIZES:   # was a traceback from get_model, after the first model
        raise ValueError(f"--size={FLAGS.size}: choose one of {', '.join(SIZES)}.")
    if not FLAGS.hardware:
        raise ValueError("--hardware is empty; give one or more plan.hardware presets.")
    for hw in FLAGS.hardware:
        get_hardware(hw)   # names the presets
    for flag in ("batch", "bg_batch"):
        if FLAGS[flag].value < 1:
            raise ValueError(f"--{flag}={FLAGS[flag].value} must be >= 1.")
    if not 0 < FLAGS.mux_efficiency <= 1:
        raise ValueError(f"--mux_efficiency={FLAGS.mux_efficiency:g} is a share of idle time: "
                         f"give a number in (0, 1].")
    if not FLAGS.amplification_limit >= 1:     # NaN passed and kept every layer on 1 device
        raise ValueError(f"--amplification_limit={FLAGS.amplification_limit:g} must be >= 1.")
    if not FLAGS.fast_layer_time >= 0:
        raise ValueError(f"--fast_layer_time={FLAGS.fast_layer_time:g} must be >= 0 seconds.")
    # A batch that does not split over every device left devices that never run a layer;
    # they counted as background time against a DP baseline over fewer devices.
    bad = [g for g in FLAGS.devices if FLAGS.batch % g]
    if bad:
        raise ValueError(f"--batch={FLAGS.batch} is not a multiple of --devices {bad}: the "
                         f"global batch must split over every device; drop those sizes or "
                         f"give a batch that is a multiple of {max(bad)}.")
    if FLAGS.plot:
        if len(FLAGS.model) * len(FLAGS.hardware) > 1:   # each plot overwrote the last
            default = ("" if FLAGS["hardware"].present else
                       f" (--hardware defaults to {','.join(FLAGS.hardware)}: add e.g. "
                       f"--hardware={FLAGS.hardware[0]})")
            raise ValueError(f"--plot draws one plan (the largest --devices): give one --model "
                             f"and one --hardware, not {len(FLAGS.model)} x "
                             f"{len(FLAGS.hardware)}{default}.")
        return png_path(FLAGS.plot, "--plot")
    return None


def main(argv):
    if len(argv) > 1:   # one line, as every other error (they were ignored: exit 0)
        sys.exit(f"burst.py: unexpected arguments {argv[1:]}; flags are --name=value.")
    try:
        plot = check_flags()
    except ValueError as e:
        sys.exit(f"burst.py: {e}")
    devices = FLAGS.devices
    out = {"paper": PAPER, "batch": FLAGS.batch, "bg_batch": FLAGS.bg_batch,
           "amplification_limit": FLAGS.amplification_limit,
           "mux_efficiency": FLAGS.mux_efficiency, "results": []}
    for name in FLAGS.model:
        try:
            costs = model_costs(name, FLAGS.size, FLAGS.cache_dir)
        except OSError as e:          # an unwritable --cache_dir
            sys.exit(f"burst.py: cannot cache {name}'s costs under --cache_dir="
                     f"{FLAGS.cache_dir}: {e}")
        branches = branch_costs(name, FLAGS.size) if FLAGS.branches else None
        for hw in FLAGS.hardware:
            try:
                rows, plans = project(costs, hw, devices, FLAGS.batch, FLAGS.bg_batch,
                                      FLAGS.amplification_limit, FLAGS.fast_layer_time,
                                      FLAGS.mux_efficiency, branches)
            except ValueError as e:   # the planner's checks (amplification limit, ...)
                sys.exit(f"burst.py: {e}")
            out["results"].append({"model": name, "size": FLAGS.size, "hardware": hw, "rows": rows})
            if plot:
                plans[-1].plot(plot, title=f"{name} on {devices[-1]} x {hw}, batch {FLAGS.batch}")
                print(f"wrote {plot}", file=sys.stderr)   # stderr: --json stays one document
    if FLAGS.json:
        print(json.dumps(out, indent=1))
        return
    print(f"global batch {FLAGS.batch}; background: same model, {FLAGS.bg_batch} per device; "
          f"amplification limit {FLAGS.amplification_limit:g}; mux efficiency "
          f"{FLAGS.mux_efficiency:g}\n{PAPER}")
    for r in out["results"]:
        print(f"\n{r['model']} ({r['size']}) on {r['hardware']}")
        print(f"{'G':>5} {'iter ms':>8} {'DP ms':>8} {'fg ex/s':>9} {'bg ex/s':>9} {'DP ex/s':>9} "
              f"{'idle':>5} {'total/DP':>8} {'fwd-idle':>8}  widths")
        for x in r["rows"]:
            print(f"{x['devices']:>5} {x['iteration_ms']:>8.2f} {x['dp_ms']:>8.2f} "
                  f"{x['foreground']:>9.0f} {x['background']:>9.0f} {x['data_parallel']:>9.0f} "
                  f"{x['idle_fraction']:>5.0%} {x['ratio']:>7.2f}x {x['ratio_forward_idle_only']:>7.2f}x"
                  f"  {','.join(map(str, x['widths']))}"
                  + (f"  branches {x['branch_groups']}" if x["branch_groups"] else ""))


if __name__ == "__main__":
    app.run(main)
