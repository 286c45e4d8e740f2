"""The steps `scripts/bench.py projection` times and predicts: a residual MLP as pipeline
layers with its measured per-layer costs (`Model`), a real `Pipeline` step prepared and
timed round robin (`prepare_step`, `time_steps`), and the step-time model's estimate of
the same step (`predict`). No flags: `projection_bench` (the bench) and
`projection_fit` (the host's calibration) share them."""
from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from jaxhybrid.bench.mlp import Block, Head, xent
from jaxhybrid.models.spec import init_layers
from jaxhybrid.plan import hybrid
from jaxhybrid.plan.costs import profile
from jaxhybrid.plan.hardware import Hardware


# --- the model --------------------------------------------------------------------------
@dataclasses.dataclass
class Model:
    """A residual MLP as pipeline layers, its per-layer variables and a batch maker."""
    width: int
    blocks: int
    reduce: str = "median"    # of each layer's timed runs (profile's `reduce`)
    profile_rounds: int = 3   # profiles per microbatch size, per layer the least (`costs`)
    timing: str = "alone"     # how each layer is timed (profile's `timing`)

    def __post_init__(self):
        self.layers = [Block(self.width) for _ in range(self.blocks)] + [Head()]
        x = jnp.zeros((1, self.width), jnp.float32)
        self.variables = init_layers(self.layers, jax.random.key(0), x)
        self._runs: dict = {}    # microbatch -> [per-layer profile, ...]
        self._costs: dict = {}   # microbatch -> the profiles reduced (`costs`)

    def at_width(self, width: int) -> "Model":
        """The same model (depth, profiling settings) at another width: this one at its own."""
        return self if width == self.width else dataclasses.replace(self, width=width)

    def batch(self, n: int, seed: int = 0):
        r = np.random.default_rng(seed)
        return (r.standard_normal((n, self.width), np.float32),
                r.integers(0, 10, n).astype(np.int32))

    def costs(self, m: int, repeats: int = 7):
        """Measured per-layer costs at microbatch m (profiled once per size, `reprofile`
        adds rounds): each layer's times the least of the profiles taken (seconds apart;
        reduce="min") or their median, so that a burst of load during one layer's timed
        runs does not make it the slowest layer of the model."""
        if m not in self._runs:
            self._runs[m] = [self._profile(m, repeats) for _ in range(max(1, self.profile_rounds))]
            self._costs.pop(m, None)
        if m not in self._costs:
            runs = self._runs[m]
            pick = min if self.reduce == "min" else statistics.median
            self._costs[m] = [dataclasses.replace(
                layer, fwd_time=pick([r[i].fwd_time for r in runs]),
                bwd_time=pick([r[i].bwd_time for r in runs])) for i, layer in enumerate(runs[0])]
        return self._costs[m]

    def reprofile(self, repeats: int = 7) -> None:
        """One more profile of every microbatch size profiled so far, joining the ones
        taken (`costs`): a run profiles before and after it times its steps, so the
        profiles span the minutes the steps were timed in (the host's speed drifts)."""
        for m in list(self._runs):
            self._runs[m].append(self._profile(m, repeats))
            self._costs.pop(m, None)

    def _profile(self, m: int, repeats: int):
        return profile(self.layers, self.batch(m)[0], measure=True, repeats=repeats,
                       variables=self.variables, reduce=self.reduce, timing=self.timing)


def parse_configs(items) -> list[tuple[int, int, int]]:
    """["2x4x8", ...] -> [(data, pipe, M), ...]."""
    return [c[1:4] for c in parse_val_configs(items, None, 0)]


def parse_val_configs(items, schedule: str | None, width: int) -> list[tuple]:
    """["zb-h1:2x4x8@384", "1x2x2", ...] -> [(schedule, data, pipe, M, width), ...]; the
    schedule and width default to the arguments."""
    from jaxhybrid.schedules import SCHEDULES
    out = []
    for item in items:
        text = str(item).lower()
        sched, _, text = text.rpartition(":") if ":" in text else (schedule, "", text)
        text, _, w = text.partition("@")
        parts = text.split("x")
        if (len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts)
                or (w and not w.isdigit())):
            raise ValueError(f"config {item!r}: write [schedule:]data x pipe x microbatches"
                             f"[@width], e.g. 2x4x8 or zb-h1:1x4x8@384.")
        if sched is not None and sched not in SCHEDULES:
            raise ValueError(f"config {item!r}: unknown schedule {sched!r}; choose one of "
                             f"{', '.join(SCHEDULES)}.")
        out.append((sched, *(int(p) for p in parts), int(w) if w else width))
    return out


# --- measuring --------------------------------------------------------------------------
def prepare_step(model: Model, *, data: int, pipe: int, M: int, batch: int, boundaries,
                 schedule: str = "1f1b"):
    """A real Pipeline value_and_grad step (jitted, inputs sharded as in training), compiled
    and run once: a no-argument function that runs it and waits for the result."""
    mesh = jh.make_mesh(data=data, pipe=pipe, devices=jax.devices()[:data * pipe])
    p = jp.Pipeline(model.layers, mesh=mesh, num_microbatches=M, schedule=schedule,
                    boundaries=list(boundaries) if pipe > 1 else [], remat="none")
    variables = p.pack(model.variables)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x, y = jax.device_put(model.batch(data * batch), sharding)
    step = p.value_and_grad(xent)
    run = lambda: jax.block_until_ready(step(variables, x, y))  # noqa: E731
    run()
    return run


def combine_passes(first: float, second: float, reduce: str = "median") -> float:
    """One step's time from two timing passes (`time_steps` twice): the faster where runs
    are summarised by their minimum (reduce="min"), else their mean."""
    return min(first, second) if reduce == "min" else (first + second) / 2


def time_steps(runs_of, runs: int = 7, reduce: str = "median") -> list[float]:
    """Wall seconds of each prepared step: `runs` rounds, each timing every step once in
    turn (round robin), so a burst of load from other processes hits all of them alike
    instead of one; per step the median of its runs, or (reduce="min") the minimum,
    steadier on a shared host since interference only ever adds time."""
    times = [[] for _ in runs_of]
    for _ in range(max(1, runs)):
        for i, run in enumerate(runs_of):
            t0 = time.perf_counter()
            run()
            times[i].append(time.perf_counter() - t0)
    return [float(min(t) if reduce == "min" else statistics.median(t)) for t in times]


def measure_step(model: Model, *, data: int, pipe: int, M: int, batch: int, boundaries,
                 schedule: str = "1f1b", runs: int = 7, reduce: str = "median") -> float:
    """Wall seconds of one real Pipeline value_and_grad step (`prepare_step`, `time_steps`)."""
    return time_steps([prepare_step(model, data=data, pipe=pipe, M=M, batch=batch,
                                    boundaries=boundaries, schedule=schedule)], runs, reduce)[0]


def stream_bandwidth(n: int = 1 << 20, loops: int = 20, runs: int = 5) -> float:
    """Bytes/s of a jitted streaming add (read 2, write 1 float32 per element) on one
    device, dispatch overhead excluded by looping inside the program."""
    a = jnp.ones(n, jnp.float32)
    f = jax.jit(lambda a: jax.lax.fori_loop(0, loops, lambda i, c: c + a * 0.5, a))
    jax.block_until_ready(f(a))
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a))
        ts.append(time.perf_counter() - t0)
    return 12.0 * n * loops / statistics.median(ts)


# --- the model's prediction -------------------------------------------------------------
def predict(model: Model, hw: Hardware, *, data: int, pipe: int, M: int, batch: int,
            schedule: str = "1f1b") -> hybrid.Estimate:
    """The step-time model's estimate of one value_and_grad step (no optimizer update)."""
    if batch % M:
        raise ValueError(f"M={M} does not divide the per-worker batch {batch}.")
    est = hybrid.step_time(model.costs, hw, data=data, pipe=pipe, num_microbatches=M,
                           per_worker_batch=batch, schedule=schedule, include_update=False)
    if not est.feasible:
        raise ValueError(f"{data}x{pipe}x{M}: {est.reason}")
    return est
