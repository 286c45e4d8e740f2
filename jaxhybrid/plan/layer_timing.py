"""How `plan.profile(measure=True)` times one layer's compiled forward or backward on
the device: alone (`timed_alone`: its call less a compiled no-op's with the same
arguments, the per-call overhead a layer inside a stage does not pay), or as one
application of many inside a compiled loop (`timed_in_loop`: the slope of two loop
lengths, weights cycled through copies as large as the model so they leave the caches
as they do in a step). `layer_time` picks one by `profile`'s `timing`."""
from __future__ import annotations

import os
import statistics
import time
import typing

import numpy as np


def timed_alone(fn, args, repeats: int, reduce: str = "median") -> tuple[float, float]:
    """(Seconds of `fn(*args)` beyond the cost of calling any compiled function with
    these arguments (dispatch, argument handling, the wait for the result), the cores
    that work kept busy (`threads`)): inside a stage the layer runs with no call of its
    own, so that per-call overhead, tens of microseconds on a CPU host and most of a
    small layer's measured time, is not its."""
    import jax
    import jax.numpy as jnp
    noop = jax.jit(lambda *a: jnp.zeros((), jnp.float32), keep_unused=True)
    run, base = _timed(fn, args, repeats, reduce), _timed(noop, args, repeats, reduce)
    return max(run.wall - base.wall, 0.0), threads(run, base)


class _Timing(typing.NamedTuple):
    wall: float         # one call's seconds (the runs' median or minimum)
    total_wall: float   # all runs' seconds
    total_cpu: float    # all runs' process CPU seconds (every thread of the process)


def _timed(fn, args, repeats: int, reduce: str) -> _Timing:
    import jax
    jax.block_until_ready(fn(*args))   # warm-up (and any lazy allocation)
    runs, c0 = [], time.process_time()
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - t0)
    cpu = time.process_time() - c0
    return _Timing(float(min(runs) if reduce == "min" else statistics.median(runs)),
                   float(sum(runs)), float(cpu))


def _wall(fn, args, repeats: int, reduce: str) -> float:
    return _timed(fn, args, repeats, reduce).wall


def threads(run: _Timing, base: _Timing) -> float:
    """Cores a layer's own work kept busy on average: the process CPU seconds of `run`
    beyond `base`'s (the same calls without the layer's work) over the wall seconds
    beyond them, between 1 and the host's cores. XLA on a CPU spreads a large matmul
    over the cores (threads near the core count) and runs a small one on one: when
    several simulated devices compute at once they share the cores by these CPU
    seconds, not by the wall seconds a lone device measured (`step_model`)."""
    wall, cpu = run.total_wall - base.total_wall, run.total_cpu - base.total_cpu
    if wall <= 0 or cpu <= 0:
        return 1.0
    return float(np.clip(cpu / wall, 1.0, os.cpu_count() or 1))

# `profile(timing="loop")`: applications of a layer per timed loop (the loop runs
# `_LOOP_MIN` times and then enough times to last about `_LOOP_TARGET` seconds, at most
# `_LOOP_MAX`), cycling through at most `_COPIES_MAX` copies of the layer's arguments.
_LOOP_MIN, _LOOP_MAX, _LOOP_TARGET, _COPIES_MAX = 2, 256, 3e-3, 64


def timed_in_loop(fn, args, repeats: int, reduce: str = "median",
                   context_bytes: int = 0) -> float:
    """(Seconds of one application of `fn(*args)` (a traceable function) as one of many
    inside a compiled loop, the cores it kept busy: `threads`): the slope (t(n2) - t(n1)) / (n2 - n1) of two loop lengths, so
    the per-call cost of launching a compiled function cancels. Between two applications
    of a layer in a step the rest of the model runs (`context_bytes`: the model's
    variables), so application i reads copy i mod R of the arguments, R copies together
    about the model's size (on this CPU host a layer applied to the same weights in a loop
    keeps them in the core's cache and runs 2-4x faster). An optimisation barrier ties
    every application's arguments to the previous one's result, so XLA can neither hoist
    the work out of the loop nor drop an application."""
    import jax
    import jax.numpy as jnp

    from jaxhybrid.plan.costs import _nbytes
    out = jax.eval_shape(fn, *args)
    copies = int(np.clip(-(-int(context_bytes) // max(_nbytes(args), 1)), 1, _COPIES_MAX))
    keyed = lambda l: jnp.issubdtype(l.dtype, jax.dtypes.prng_key)  # noqa: E731
    stacked = jax.tree.map(lambda l: l if keyed(l) else jnp.repeat(l[None], copies, 0), args)

    def looped(n, stacked):
        def body(i, carry):
            st, _ = jax.lax.optimization_barrier(carry)
            a = jax.tree.map(lambda l, s: l if keyed(l) else
                             jax.lax.dynamic_index_in_dim(s, i % copies, keepdims=False),
                             args, st)
            return st, fn(*a)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out)
        return jax.lax.fori_loop(0, n, body, (stacked, zeros))[1]

    loop = jax.jit(looped)
    t1 = _wall(loop, (_LOOP_MIN, stacked), 3, "min")
    probe = _wall(loop, (4 * _LOOP_MIN, stacked), 3, "min")
    per = max((probe - t1) / (3 * _LOOP_MIN), 1e-7)
    n2 = int(np.clip(round(_LOOP_TARGET / per), 4 * _LOOP_MIN, _LOOP_MAX))
    runs = {_LOOP_MIN: [], n2: []}   # the two lengths alternate: load hits both alike
    cpu = {_LOOP_MIN: 0.0, n2: 0.0}
    for _ in range(max(1, repeats)):
        for n in runs:
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(loop(n, stacked))
            runs[n].append(time.perf_counter() - t0)
            cpu[n] += time.process_time() - c0
    pick = min if reduce == "min" else statistics.median
    per = max((pick(runs[n2]) - pick(runs[_LOOP_MIN])) / (n2 - _LOOP_MIN), 0.0)
    return per, threads(*(_Timing(pick(runs[n]), sum(runs[n]), cpu[n]) for n in (n2, _LOOP_MIN)))


def layer_time(timing, compiled, fn, args, roofline: float) -> tuple[float, float]:
    """(A measured layer time, the cores it kept busy: `threads`) (`profile`'s `timing`:
    (repeats, reduce, "alone" | "loop", model variable bytes)). Alone: never below the
    roofline (the no-op's overhead, subtracted, can exceed a small layer's noisy
    measurement); in a loop the layers beat the assumed CPU peaks (weights in cache), so
    the roofline only where nothing was found."""
    repeats, reduce, how, context = timing
    if how == "alone":
        t, busy = timed_alone(compiled, args, repeats, reduce)
        return max(t, roofline), busy
    t, busy = timed_in_loop(fn, args, repeats, reduce, context)
    return (t, busy) if t else (roofline, 1.0)
