"""Timing for the benchmarks: seconds per call after a warm-up, and the least of several
rounds with the candidates interleaved (a slow spell of a shared host then hits every
candidate alike instead of one). Process CPU time (`time.process_time`: all threads)
is the default clock, because the simulated devices share the host's cores."""
from __future__ import annotations

import time

import jax


def seconds_per_call(fn, args, steps: int = 3, clock=time.process_time) -> float:
    """`clock` seconds of one call of fn(*args), after one warm-up call; mean of `steps`."""
    jax.block_until_ready(fn(*args))
    t = clock()
    for _ in range(steps):
        jax.block_until_ready(fn(*args))
    return (clock() - t) / steps


def least(fns: dict, repeats: int, steps: int = 3, clock=time.process_time) -> dict:
    """{name: minimum over `repeats` rounds of seconds_per_call(*fns[name])}, each round
    timing every candidate once in turn."""
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, (fn, args) in fns.items():
            times[k].append(seconds_per_call(fn, args, steps, clock))
    return {k: min(v) for k, v in times.items()}
