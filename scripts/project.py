"""Projects time to accuracy of DP-only vs hybrid DP x PP (x TP, ZeRO) training for 8..1024
devices.

    python scripts/project.py --model=inception_v3 --devices=8,16,32,64,128,256,512,1024
    python scripts/project.py --model=gnmt --hardware=a100_dgx --json > gnmt.json
    python scripts/project.py --model=biglstm --stat_points=1024:60000,4096:21000,16384:9000
    python scripts/project.py --model=gpt --costs=profile --per_worker_batch=8 \\
        --model_degrees=1,2,4 --zero=0,1 --stat_points=256:40000,1024:12000,4096:5000
        # data x pipe x model, ZeRO on and off; GPT has no statistical-efficiency
        # default, so --stat_points (measured batch:steps points) is required

Prints the best data-parallel-only and the best hybrid configuration for each N (step
time, epochs to target, hours), the speedup, the crossover N and the at-scale gain (best
DP over all N vs best hybrid over all N), and writes a PNG of time to accuracy vs N
(--out; default projection_<model>_<hardware>.png, '.png' added to a path without a
suffix, --out= to skip). --json prints the
same as JSON. Every assumption is in docs/projection.md.

Costs: --costs=reference (analytic full-size costs of inception_v3 / gnmt / biglstm),
--costs=profile (XLA cost analysis of jaxhybrid.models at --size, scaled to the target
device by its peak FLOP/s and memory bandwidth) or --costs=measured (layers timed on
this machine; use with --hardware=measured).
Statistical efficiency: the model's documented default, modified by --e_min / --b_noise
/ --max_batch, or fitted to measured (global batch, steps to target) points given as
--stat_points=B:S,B:S,... (--stat_kind=epochs for epochs instead of steps).
"""
from __future__ import annotations

import json
import math
import os
import sys

from absl import app, flags

# Run from anywhere without the package installed, as scripts/train.py, plan.py and
# burst.py are (the import below failed outside the repository).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxhybrid.config_flags import define_int_list  # noqa: E402
from jaxhybrid.plan.plan import png_path  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "inception_v3", "inception_v3 | gnmt | biglstm (or any "
                    "jaxhybrid.models name with --costs=profile and --per_worker_batch).")
define_int_list("devices", "8,16,32,64,128,256,512,1024", "device counts N to project (each "
                "must fit a hybrid layout to compare DP-only with: N >= 2).")
flags.DEFINE_string("hardware", "v100_dgx1", "v100_dgx1 | a100_dgx | h100_dgx | measured.")
# Sizes are checked when the flags are parsed: 0 or less was found only after profiling
# (--profile_batch=0: a ZeroDivisionError scaling the costs, -2: "negative dimensions").
flags.DEFINE_integer("per_worker_batch", None, "examples per DP worker (default: per model).",
                     lower_bound=1)
flags.DEFINE_string("costs", "reference", "reference (analytic, full size) | profile | measured.")
flags.DEFINE_string("size", "full", "model size to profile with --costs=profile/measured.")
flags.DEFINE_integer("profile_batch", 2, "examples per profiled microbatch (--costs=profile).",
                     lower_bound=1)
flags.DEFINE_list("schedules", "1f1b", "pipeline schedules to search (names in "
                  "jaxhybrid.schedules.SCHEDULES: gpipe, 1f1b, interleaved, zb-h1, zbv).")
define_int_list("microbatches", None, "microbatch counts to search (default: every divisor "
                  "of the per-worker batch up to 512, hybrid.MAX_MICROBATCHES).")
flags.DEFINE_integer("max_pipe", None, "largest pipeline depth to consider.", lower_bound=1)
define_int_list("model_degrees", "1", "tensor-parallel degrees to search (mesh model=; "
                  "each must divide the model's heads / MLP width), e.g. 1,2,4.")
define_int_list("zero", "0", "ZeRO settings to search: 0 (replicated optimizer state), "
                "1 (sharded over data), or 0,1.", minimum=0)
flags.DEFINE_float("b_noise", None, "override the gradient noise scale B_noise (examples).")
flags.DEFINE_float("e_min", None, "override the small-batch epochs to target E_min.")
flags.DEFINE_float("max_batch", None, "critical batch: no fewer steps beyond it.")
flags.DEFINE_list("stat_points", None, "measured points BATCH:STEPS (or BATCH:EPOCHS with "
                  "--stat_kind=epochs) to fit the statistical-efficiency curve to.")
flags.DEFINE_enum("stat_kind", "steps", ["steps", "epochs"], "what --stat_points measure.")
flags.DEFINE_float("dataset_size", None, "examples per epoch (default: the model's).")
flags.DEFINE_bool("json", False, "print JSON instead of the table.")
flags.DEFINE_bool("all_configs", False, "with --json: include every configuration tried.")
flags.DEFINE_string("out", None, "PNG of time to accuracy vs N (default "
                    "projection_<model>_<hardware>.png; '.png' added when it has no "
                    "suffix; empty: no PNG).")


def _points(items):
    pts = []
    for item in items:
        parts = str(item).split(":")
        try:
            b, y = (float(p) for p in parts)
        except ValueError:
            raise ValueError(f"--stat_points entry {item!r}: write BATCH:STEPS, e.g. 4096:21000.")
        pts.append((b, y))
    return pts


def _check_model():
    """The model must have reference costs (--costs=reference) or be a jaxhybrid model."""
    from jaxhybrid.models import registered_models
    from jaxhybrid.plan.reference_costs import PAPER_MODELS
    names = registered_models()
    if FLAGS.costs == "reference" and FLAGS.model not in PAPER_MODELS:
        hint = (f"; jaxhybrid models for --costs=profile: {', '.join(names)}"
                if FLAGS.model not in names
                else "; to project it, use --costs=profile --per_worker_batch=N")
        raise ValueError(f"--model={FLAGS.model!r} has no reference costs: choose one of "
                         f"{', '.join(PAPER_MODELS)}{hint}.")
    if FLAGS.costs != "reference" and FLAGS.model not in names:
        raise ValueError(f"--model={FLAGS.model!r} is not a jaxhybrid model; choose one of "
                         f"{', '.join(names)}.")


def _layer_count() -> int:
    """The model's layers, the deepest pipeline the search tries (cheap: no profiling)."""
    if FLAGS.costs == "reference":
        from jaxhybrid.plan.reference_costs import PAPER_MODELS
        return len(PAPER_MODELS[FLAGS.model].costs(1))
    from jaxhybrid.models import get_model
    return len(get_model(FLAGS.model, FLAGS.size).layers)


def _no_hybrid(n: int, layers: int) -> bool:
    """No hybrid layout can run on n devices (data x pipe x model = n with pipe > 1 up to
    the layers and --max_pipe, or model > 1 from --model_degrees): the search would give
    its row no hybrid to compare DP-only with."""
    deepest = min(layers, FLAGS.max_pipe or layers)
    for t in FLAGS.model_degrees:
        if n % t:
            continue
        rest = n // t   # data x pipe
        if t > 1 or any(rest % p == 0 for p in range(2, min(rest, deepest) + 1)):
            return False
    return True


def check_stat_flags() -> None:
    """--b_noise / --e_min / --max_batch / --dataset_size: finite and > 0, named by flag
    (inf was refused later as "StatEfficiency: s_min=inf", NaN as "must be > 0")."""
    for f in ("b_noise", "e_min", "max_batch", "dataset_size"):
        v = getattr(FLAGS, f)      # None: unset; 0 is a value, refused here
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"--{f}={v:g} must be a finite number > 0 (leave it out for "
                             f"the default).")


def stat_curve():
    """The statistical-efficiency curve the flags ask for (None: the model's default)."""
    from jaxhybrid.plan import stat_efficiency as se
    default = se.MODEL_DEFAULTS.get(FLAGS.model)
    given = {f: getattr(FLAGS, f) for f in ("b_noise", "e_min", "max_batch", "dataset_size")
             if getattr(FLAGS, f) is not None}     # 0 is a value (refused below), not "unset"
    check_stat_flags()
    dataset = given.get("dataset_size", default.dataset_size if default else None)
    if FLAGS.stat_points:
        if "b_noise" in given or "e_min" in given:
            raise ValueError("--stat_points fits B_noise and E_min; drop --b_noise/--e_min.")
        return se.fit(_points(FLAGS.stat_points), dataset_size=dataset, kind=FLAGS.stat_kind,
                      max_batch=FLAGS.max_batch, name=f"{FLAGS.model}/fit")
    if given:
        if default is None:
            raise ValueError(f"--b_noise/--e_min/--max_batch modify a default curve; "
                             f"{FLAGS.model!r} has none: pass --stat_points.")
        return se.StatEfficiency.from_epochs(
            given.get("e_min", default.e_min), given.get("b_noise", default.b_noise), dataset,
            max_batch=given.get("max_batch", default.max_batch), name=default.name,
            source="command line")
    if default is None:
        raise ValueError(f"no statistical-efficiency default for {FLAGS.model!r}; pass "
                         f"--stat_points (and --dataset_size for epochs).")
    return default


def main(argv):
    if len(argv) > 1:   # one line, as every other error (they were ignored: exit 0)
        sys.exit(f"project.py: unexpected arguments {argv[1:]}; flags are --name=value.")
    from jaxhybrid.plan import hybrid
    try:
        costs = FLAGS.costs
        if costs not in ("reference", "profile", "measured"):
            raise ValueError(f"--costs={costs!r}: choose reference, profile or measured.")
        _check_model()
        layers = _layer_count()
        bad = [n for n in FLAGS.devices if _no_hybrid(n, layers)]
        if bad:   # N=1 printed a hybrid of "nan" ms, a speedup of nan and "crossover None"
            deepest = min(layers, FLAGS.max_pipe or layers)
            one = len(bad) == 1
            raise ValueError(
                f"--devices: N={','.join(map(str, bad))} {'has' if one else 'have'} no hybrid "
                f"layout to compare DP-only with (it needs a model degree from --model_degrees="
                f"{','.join(map(str, FLAGS.model_degrees))} dividing N, and then a pipe > 1 "
                f"dividing the rest, at most {deepest}: the model's {layers} layers"
                + (f", --max_pipe={FLAGS.max_pipe}" if FLAGS.max_pipe else "")
                + ", or a model degree > 1); drop " + ("it" if one else "them")
                + (" or raise --max_pipe." if FLAGS.max_pipe and FLAGS.max_pipe < layers else "."))
        if not set(FLAGS.zero) <= {0, 1}:
            raise ValueError(f"--zero={','.join(map(str, FLAGS.zero))}: ZeRO settings are 0 "
                             f"(replicated optimizer state) and 1 (sharded over data), e.g. "
                             f"--zero=0,1.")
        path = (FLAGS.out if FLAGS.out is not None
                else f"projection_{FLAGS.model}_{FLAGS.hardware}.png")
        if path:
            path = png_path(path, "--out")
        stat = stat_curve()   # its errors before minutes of profiling
        if costs == "measured":
            from jaxhybrid.models import get_model
            from jaxhybrid.plan.costs import profile
            spec = get_model(FLAGS.model, FLAGS.size)
            costs = profile(spec.layers, spec.sample_batch(FLAGS.profile_batch)[0], measure=True)
        proj = hybrid.project(
            FLAGS.model, FLAGS.devices, FLAGS.hardware, per_worker_batch=FLAGS.per_worker_batch,
            stat=stat, costs=costs, size=FLAGS.size, profile_batch=FLAGS.profile_batch,
            schedules=FLAGS.schedules, max_pipe=FLAGS.max_pipe,
            model_degrees=FLAGS.model_degrees, zero=FLAGS.zero,
            microbatches=FLAGS.microbatches or None)
    except ValueError as e:
        sys.exit(f"project.py: {e}")
    if FLAGS.json:
        out = proj.to_json()
        if not FLAGS.all_configs:
            out.pop("configs")
        print(json.dumps(out, indent=1, allow_nan=False))   # strict JSON: a NaN fails here
    else:
        print(proj.table())
    if path:
        proj.plot(path)
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
