"""What a researcher's own multi-process script may get wrong with the pipeline API
(tests/test_multihost_misuse.py starts it on 2 processes x 4 devices with
scripts/launch_local.py --script): each process passing its own rows, or other numbers, as
numpy; a process building its pipeline with other cuts, or initialising with its own key. Prints one JSON line per case
on process 0: {"case": name, "loss": float} or {"case": name, "error": first line}."""
import json

import numpy as np

from jaxhybrid import distributed

distributed.initialize()

import flax.linen as nn   # noqa: E402 (after jax.distributed)
import jax                # noqa: E402
import jax.numpy as jnp   # noqa: E402

import jaxhybrid as jh    # noqa: E402
from jaxhybrid import data  # noqa: E402
from jaxhybrid import pipeline as jp  # noqa: E402


def report(case, fn):
    try:
        out = {"case": case, "loss": float(fn())}
    except ValueError as e:
        out = {"case": case, "error": str(e).splitlines()[0]}
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def main():
    layers = [nn.Dense(8) for _ in range(5)]
    mse = lambda o, y: jnp.mean((o - y) ** 2)
    rs = np.random.RandomState(0)
    x, y = rs.randn(16, 8).astype(np.float32), rs.randn(16, 8).astype(np.float32)
    mesh, me = jh.make_mesh(data=2, pipe=4), jax.process_index()
    pipe = jp.Pipeline(layers, mesh=mesh, num_microbatches=4, boundaries=(1, 2, 3))
    variables = pipe.init(jax.random.key(0), x[:2])
    step = pipe.value_and_grad(mse)
    rows = data.process_rows(mesh, 16)
    report("placed rows", lambda: step(variables, *data.place_batch((x[rows], y[rows]), mesh))[0])
    report("the same numpy batch", lambda: step(variables, x, y)[0])
    report("own rows as numpy", lambda: step(variables, x[rows], y[rows])[0])
    report("other numbers", lambda: step(variables, x + me, y)[0])
    other = jp.Pipeline(layers, mesh=mesh, num_microbatches=4,
                        boundaries=(1, 2, 3) if me == 0 else (2, 3, 4))
    report("other cuts", lambda: other.init(jax.random.key(0), x[:2]) and 0.0)
    fresh = jp.Pipeline(layers, mesh=mesh, num_microbatches=4, boundaries=(1, 2, 3))
    report("another init key", lambda: fresh.init(jax.random.key(me), x[:2]) and 0.0)
    report("the same key", lambda: step(variables, x, y, jax.random.key(3))[0])
    report("own key", lambda: step(variables, x, y, jax.random.key(me))[0])
    # Burst: widths planned apart (measured costs differ per process) ran to the end with
    # a wrong loss or hung; a process's own batch was read as its own value.
    from jaxhybrid import burst
    bmesh = jh.make_mesh(data=8, pipe=1)
    per_layer = pipe.unpack(variables)
    bvars = burst.replicate(per_layer, bmesh)
    for case, widths, xb in [("burst same widths", (8, 4, 2, 4, 8), x),
                             ("burst other widths", (8, 4, 2, 4, 8) if me == 0 else
                              (8, 2, 4, 4, 8), x),
                             ("burst own batch", (8, 4, 2, 4, 8), x + me)]:
        prog = burst.BurstProgram(layers, mse, widths, bmesh, 16)
        report(case, lambda: burst.value_and_grad(prog, bvars, xb, y, jax.random.key(0))[0])
    # Multiplexing: the background rows and key were read as each process's own values.
    import optax

    from jaxhybrid.burst import multiplex
    opt = optax.sgd(0.1)
    prog = burst.BurstProgram(layers, mse, (8, 4, 2, 4, 8), bmesh, 16)
    mux = multiplex.MuxProgram(prog, opt, multiplex.BackgroundJob(layers[:2], mse, opt, 2))
    fts = burst.init_train_state(opt, per_layer, bmesh)
    bts = burst.init_train_state(opt, per_layer[:2], bmesh)
    bx, by = rs.randn(8, 2, 8).astype(np.float32), rs.randn(8, 2, 8).astype(np.float32)

    def bg_loss(bx, bkey):
        out = multiplex.multiplexed_step(mux, fts, bts, x, y, bx, by, jax.random.key(0), bkey)
        return jnp.sum(out[2])
    for case, bxs, bkey in [("mux same", bx, jax.random.key(1)),
                            ("mux own bg rows", bx + me, jax.random.key(1)),
                            ("mux own bg key", bx, jax.random.key(me))]:
        report(case, lambda: bg_loss(bxs, bkey))
    report("bg alone own rows", lambda: jnp.sum(
        multiplex.background_step(mux, bts, bx + me, by, jax.random.key(1))[0]))


if __name__ == "__main__":
    main()
