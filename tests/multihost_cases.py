"""Small pipelines (tests/mixed_model.py) run the same way in one process or in each of
several (tests/test_multihost_schedules.py starts this file with scripts/launch_local.py):

    python tests/multihost_cases.py OUT.json '[{"name": ..., "mesh": [data, pipe, model],
        "schedule": ..., ...}, ...]'

Each case builds its mesh (optionally over a permutation `perm` of jax.devices(), to put
"pipe", "data" or "model" across processes), packs one set of initial variables, places
the global batch (each process its rows), and records, on process 0, the loss and the
gathered gradients and batch statistics of `value_and_grad`, and with `steps` the losses
and parameters of that many `train_step`s (Adam). Keys of a case:
  mesh, schedule, num_mix (Mix layers, default 4), M (microbatches, default 4), perm,
  zero, grad (default True), steps, unpack (also unpack variables and gradients),
  boundaries ("planner": the planner's cut), skew (process 1 profiles layer 4 as 20x
  slower: hosts measure differently). A case that raises records {"error": first line}.
"""
import dataclasses
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _gather(tree):
    """numpy copies of a tree of arrays, gathered from every process."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    return jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True))
                        if not a.is_fully_addressable else np.asarray(a), tree)


def _skew_process_1():
    """Process 1 measures layer 4 as 20 times slower than process 0 does."""
    import jax
    from jaxhybrid.pipeline import planning
    if jax.process_index() != 1 or getattr(planning.profile_cached, "skewed", False):
        return
    measured = planning.profile_cached

    def skewed(layers, sample):
        return [dataclasses.replace(c, fwd_time=c.fwd_time * 20, bwd_time=c.bwd_time * 20)
                if i == 4 else c for i, c in enumerate(measured(layers, sample))]
    skewed.skewed = True
    planning.profile_cached = skewed


def run_case(case: dict) -> dict:
    import jax
    import optax
    import jaxhybrid as jh
    from jaxhybrid import data, distributed
    from jaxhybrid import pipeline as jp
    from jaxhybrid.pipeline.stages import even_boundaries
    from jaxhybrid.schedules import make_schedule
    import mixed_model as mm

    d, p, m = case["mesh"]
    M = case.get("M", 4)
    layers = mm.make_layers(num_mix=case.get("num_mix", 4))
    devices = jax.devices()
    if "perm" in case:
        devices = [devices[i] for i in case["perm"]]
    mesh = jh.make_mesh(data=d, pipe=p, model=m, devices=devices)
    boundaries = case.get("boundaries")
    if boundaries is None:
        boundaries = even_boundaries(len(layers), make_schedule(case["schedule"], p, M).num_stages)
    elif boundaries == "planner":
        boundaries = None
    if case.get("skew"):
        _skew_process_1()
    pipe = jp.Pipeline(layers, mesh=mesh, num_microbatches=M, schedule=case["schedule"],
                       boundaries=boundaries, remat="none", zero=case.get("zero", 0))
    sample = mm.make_batch(2)[0]
    out = {}
    if m > 1 or boundaries is None:   # the model axis and the planner need init
        variables = pipe.init(jax.random.key(0), sample)
        out["boundaries"] = distributed.allgather_json([int(b) for b in pipe.boundaries])
        if boundaries is None:   # what this process's own costs would cut
            alone = pipe._make_plan(fixed=False)
            out["alone"] = distributed.allgather_json([int(b) for b in alone.boundaries])
    else:
        single = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=1,
                                                       devices=jax.local_devices()[:1]))
        variables = pipe.pack(single.unpack(single.init(jax.random.key(0), sample)))

    def batch(seed):
        inputs, labels = mm.make_batch(d * M * 2, seed=seed)
        rows = data.process_rows(mesh, len(labels))
        return data.place_batch(jax.tree.map(lambda a: a[rows], (inputs, labels)), mesh)

    rng = jax.random.key(7)
    if case.get("grad", True):
        loss, grads, new = pipe.value_and_grad(mm.loss_fn)(variables, *batch(3), rng)
        out["loss"] = float(loss)
        out["grads"] = _gather(grads)
        out["state"] = _gather({c: v for c, v in new.items() if c != "params"})
        if case.get("unpack"):
            out["unpacked_grads"] = pipe.unpack(grads)
            out["unpacked"] = pipe.unpack(new)
    if case.get("steps"):
        tx = optax.adam(1e-2)
        opt = pipe.init_optimizer(tx, variables)
        step = pipe.train_step(mm.loss_fn, tx)
        losses = []
        for i in range(case["steps"]):
            loss, _, variables, opt = step(variables, opt, *batch(10 + i), rng)
            losses.append(float(loss))
        out["train_losses"] = losses
        out["params"] = _gather(variables["params"])
    return out


def to_json(tree):
    import jax
    import numpy as np
    return jax.tree.map(lambda a: np.asarray(a).tolist() if np.ndim(a) else a, tree)


def main(argv):
    sys.path.insert(0, str(ROOT))            # this checkout's jaxhybrid
    from jaxhybrid import distributed
    if os.environ.get("CASES_JAX_INITIALIZE"):   # jax's own start-up, without our checks
        import jax
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"],
                                   int(os.environ["JAX_NUM_PROCESSES"]),
                                   int(os.environ["JAX_PROCESS_ID"]))
    else:
        distributed.initialize()
    import jax
    results = {}
    for case in json.loads(argv[2]):
        try:
            results[case["name"]] = to_json(run_case(case))
            print(f"case {case['name']}: done", flush=True)
        except Exception as e:   # recorded: the test names it
            message = (str(e).splitlines() or [type(e).__name__])[0]
            results[case["name"]] = {"error": f"{type(e).__name__}: {message}"}
            print(f"case {case['name']}: {type(e).__name__}: {message}", flush=True)
    if jax.process_index() == 0:
        pathlib.Path(argv[1]).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv)
