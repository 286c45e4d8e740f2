"""What a lock-step tick's collectives cost on this host, apart from the engine.

    python scripts/bench.py collectives [--devices=4] [--widths=256,512,1024]
        [--microbatches=16,64] [--ticks=40] [--repeats=15]

Each simulated device runs one `lax.scan` of --ticks ticks inside one shard_map'd program
(the engine's shape); in every tick it computes a forward stand-in `tanh(a @ W)` and a
backward stand-in `tanh(g @ W.T)` on a (microbatch, width) row, then moves the rows as
the variant says:

  none            nothing: the devices never meet (the compute alone)
  barrier         a psum of one scalar: every device meets, no data moves
  act             one ppermute (activations to the next device)
  act+grad        two ppermutes, activations forward and gradients backward (a 1F1B tick)
  act+grad, cond  the same two under one lax.cond of the tick's flag, as the engine gates them
  all_to_all      both directions in one all_to_all (each device sends --devices rows)

and prints process CPU-seconds per step (all threads; the least of --repeats, the variants
interleaved) and each variant's extra over `none` per device and tick. A pipelined step
against data parallelism pays this extra in every tick (docs/pipeline.md, "Work"); data
parallelism meets once per step.
"""
from __future__ import annotations

import os

if "jax" not in __import__("sys").modules:   # simulated devices must exist before jax starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxhybrid.bench.timing import least
from jaxhybrid.config_flags import define_int_list

FLAGS = flags.FLAGS
flags.DEFINE_integer("devices", 4, "devices in the ring (a pipe axis of this size).")
define_int_list("widths", "256,512,1024", "row widths (W is width x width).")
define_int_list("microbatches", "16,64", "rows per tick (the microbatch size).")
flags.DEFINE_integer("ticks", 40, "ticks per step (one scan).")
flags.DEFINE_integer("repeats", 15, "timed rounds; each variant's least is printed.")

AXIS = "ring"


def _both_ways(a, g, n: int):
    """The next device's activation row and the previous one's gradient row, in one
    all_to_all: row j of what a device sends goes to device j."""
    s = lax.axis_index(AXIS)
    to_next = (jnp.arange(n) == (s + 1) % n)[:, None, None]
    got = lax.all_to_all(jnp.where(to_next, a[None], g[None]), AXIS, 0, 0, tiled=False)
    return got[(s - 1) % n], got[(s + 1) % n]


def _transfer(variant: str, a, g, t, n: int):
    fwd = [(i, (i + 1) % n) for i in range(n)]
    bwd = [(i, (i - 1) % n) for i in range(n)]
    two = lambda a, g: (lax.ppermute(a, AXIS, fwd), lax.ppermute(g, AXIS, bwd))
    if variant == "none":
        return a, g
    if variant == "barrier":
        return a + 0 * lax.psum(a[0, 0], AXIS), g
    if variant == "act":
        return lax.ppermute(a, AXIS, fwd), g
    if variant == "act+grad":
        return two(a, g)
    if variant == "act+grad, cond":
        return lax.cond(t >= 0, two, lambda a, g: (a, g), a, g)
    if variant == "all_to_all":
        return _both_ways(a, g, n)
    raise ValueError(f"collectives: unknown variant {variant!r}")


VARIANTS = ("none", "barrier", "act", "act+grad", "act+grad, cond", "all_to_all")


def tick_program(variant: str, mesh, ticks: int):
    """The jitted step: per device a scan of `ticks` ticks of compute + `variant`."""
    n = mesh.shape[AXIS]

    def per_device(w, x):
        w, x = w[0], x[0]

        def tick(carry, t):
            a, g = carry
            return _transfer(variant, jnp.tanh(a @ w), jnp.tanh(g @ w.T), t, n), None
        (a, g), _ = lax.scan(tick, (x, x), jnp.arange(ticks))
        return (a + g).sum()[None]
    spec = P(AXIS)
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec, spec), out_specs=spec))


def rows(devices: int, widths, microbatches, ticks: int, repeats: int) -> list[dict]:
    if devices < 2 or devices > jax.device_count():
        raise ValueError(f"--devices={devices} must be 2..{jax.device_count()} (the simulated "
                         f"devices); set XLA_FLAGS=--xla_force_host_platform_device_count=N.")
    if ticks < 1 or repeats < 1:
        raise ValueError("--ticks and --repeats must be >= 1.")
    mesh = jax.make_mesh((devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:devices])
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(AXIS)))
    rng = np.random.default_rng(0)
    out = []
    for width in widths:
        for mb in microbatches:
            w = put((rng.standard_normal((devices, width, width)) / width ** 0.5).astype(np.float32))
            x = put(rng.standard_normal((devices, mb, width)).astype(np.float32))
            fns = {v: (tick_program(v, mesh, ticks), (w, x)) for v in VARIANTS}
            cpu = least(fns, repeats, steps=1)
            out.append({"width": width, "microbatch": mb, "cpu": cpu,
                        "extra_us": {v: (cpu[v] - cpu["none"]) / (ticks * devices) * 1e6
                                     for v in VARIANTS}})
    return out


def main(argv) -> None:
    del argv
    table = rows(FLAGS.devices, FLAGS.widths, FLAGS.microbatches, FLAGS.ticks, FLAGS.repeats)
    print(f"{FLAGS.devices} devices in a ring, {FLAGS.ticks} ticks per step, least of "
          f"{FLAGS.repeats}; process CPU-ms per step, and [extra over `none` per device "
          f"per tick, us]")
    print("width  mb | " + " | ".join(f"{v:>20s}" for v in VARIANTS))
    for r in table:
        cells = [f"{r['cpu'][v] * 1e3:8.2f} [{r['extra_us'][v]:6.1f}]" for v in VARIANTS]
        print(f"{r['width']:5d} {r['microbatch']:3d} | " + " | ".join(f"{c:>20s}" for c in cells))
