"""GPU multiplexing (DeepPool): a background training job in the foreground's idle time.

A burst plan leaves device d idle during every layer l with g_l <= d. Here the idle
branch of that layer's cond runs slices of an independent background job: its own
layers, loss, optax optimizer and data; each device d with idle slots runs its own
instance of the job (its own copy of the state, its own batch). One background step is
a list of tasks run in order,

    F0 .. F{J-1}   forward of layer j (jax.vjp; its residuals go to a stash)
    L              loss and its gradient w.r.t. the outputs
    B{J-1} .. B0   backward of layer j from the stashed residuals (no recompute)
    U              optimizer update

and `assign_slots` spreads them over device d's idle slots, in order, balancing
estimated task times against idle times. A slot is a foreground layer's forward (slot l)
or backward (slot 2L-1-l): the foreground runs with its backward written out layer by
layer (`executor.explicit_value_and_grad`), so both passes have skip branches to fill.
The background state travels through the foreground's conds as a carry of its own, so
the foreground's losses and updates are those of the burst step alone (up to float
rounding), and the background's those of its plain step alone (tests/test_burst.py
checks both). Devices with no idle slot (device 0 runs every layer) skip the background
step.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxhybrid import distributed
from jaxhybrid.burst.checks import check_batch, check_stacked, checked_optimizer
from jaxhybrid.burst.executor import (BurstProgram, TrainState, _squeeze, _stack,
                                      apply_update, current_for, explicit_value_and_grad,
                                      on_every_process, shard, weighed)
from jaxhybrid.checks import is_int
from jaxhybrid.layers import apply_layer, check_loss_fn, layer_rng, loss_dtype, scalar_loss
from jaxhybrid.mesh import DATA


@dataclasses.dataclass(frozen=True, eq=False)
class BackgroundJob:
    """An independent training job: layers, loss_fn(outputs, targets), an optax
    optimizer, and the batch size of one instance (one device)."""
    layers: tuple
    loss_fn: Callable
    optimizer: Any
    batch_size: int

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ValueError("BackgroundJob: no layers.")
        check_loss_fn(self.loss_fn, "BackgroundJob")
        if not is_int(self.batch_size) or self.batch_size < 1:   # 0 ran empty batches
            raise ValueError(f"BackgroundJob: batch_size={self.batch_size!r} must be an int "
                             f">= 1 (examples per device instance).")

    @property
    def task_names(self) -> list[str]:
        J = len(self.layers)
        return ([f"F{j}" for j in range(J)] + ["L"] + [f"B{j}" for j in reversed(range(J))]
                + ["U"])


def slot_widths(widths: Sequence[int]) -> list[int]:
    """Width of every slot in execution order: forward layers 0..L-1, then backward
    layers L-1..0."""
    return list(widths) + list(widths)[::-1]


def assign_slots(widths: Sequence[int], num_devices: int, num_tasks: int,
                 idle_times: Sequence[float] | None = None,
                 task_times: Sequence[float] | None = None) -> np.ndarray:
    """[G, num_tasks] table: the slot (index into `widths`, one width per slot in
    execution order, e.g. `slot_widths`) in whose idle branch device d runs task t
    (non-decreasing in t), or -1 where device d has no idle slot. Tasks are placed by
    cumulative time: task t starts in the idle slot where the fraction (time of tasks
    before t) / (all task time) falls in the cumulative idle time; slots with zero idle
    time get none (unless all of device d's have zero)."""
    widths = np.asarray(widths)
    idle_t = np.ones(len(widths)) if idle_times is None else np.asarray(idle_times, float)
    task_t = np.ones(num_tasks) if task_times is None else np.asarray(task_times, float)
    # Wrong lengths were an IndexError / broadcast error, or (too many idle times)
    # silently read against the wrong slots; NaN times put every task in the last slot.
    for what, t, n, per in (("idle_times", idle_t, len(widths), "slot"),
                            ("task_times", task_t, num_tasks, "task")):
        if t.shape != (n,) or not np.all(t >= 0):
            raise ValueError(f"assign_slots: {what} must be {n} seconds >= 0, one per {per}; "
                             f"got {t.tolist()}.")
    start = np.concatenate([[0.0], np.cumsum(task_t)[:-1]]) / max(task_t.sum(), 1e-30)
    table = np.full((num_devices, num_tasks), -1, int)
    for d in range(num_devices):
        idle = np.flatnonzero(widths <= d)
        if idle.size == 0:
            continue
        if (idle_t[idle] > 0).any():     # the first task went to a slot of zero idle time
            idle = idle[idle_t[idle] > 0]
        cap = np.cumsum(np.maximum(idle_t[idle], 1e-30))
        cap = cap / cap[-1]
        k = np.minimum(np.searchsorted(cap, start, side="right"), idle.size - 1)
        table[d] = idle[k]
    return table


@dataclasses.dataclass(frozen=True, eq=False)
class MuxProgram:
    """A foreground burst program with its optimizer, and a background job packed into
    its idle branches by `slots` (`assign_slots` over `slot_widths(fg.widths)`;
    default: equal task and idle times)."""
    fg: BurstProgram
    fg_optimizer: Any
    bg: BackgroundJob
    slots: Any = None

    def __post_init__(self):
        checked_optimizer(self.fg_optimizer, "MuxProgram")
        G, T = self.fg.num_devices, len(self.bg.task_names)
        sw = np.asarray(slot_widths(self.fg.widths))
        slots = (assign_slots(sw, G, T) if self.slots is None else np.asarray(self.slots, int))
        if slots.shape != (G, T):
            raise ValueError(f"MuxProgram: slots must be [{G} devices, {T} tasks], got {slots.shape}.")
        for d, row in enumerate(slots):
            if (row >= 0).any() and ((row < 0).any() or (np.diff(row) < 0).any()
                                     or (row >= len(sw)).any() or (sw[row] > d).any()):
                raise ValueError(f"MuxProgram: device {d}'s slots {row.tolist()} must be idle "
                                 f"slots (width <= {d}) in non-decreasing order, or all -1.")
        object.__setattr__(self, "slots", slots)

    @property
    def runs_background(self) -> np.ndarray:
        return (self.slots >= 0).all(axis=1)


# --- the background step as tasks over an explicit carry -------------------------------
def _tasks(job: BackgroundJob, targets, key, treedefs: dict):
    """Task functions carry -> carry (treedefs: vjp structures, filled when F tasks are
    traced, read by B tasks)."""
    J = len(job.layers)

    def fwd(j, c):
        c = dict(c)
        layer, st = job.layers[j], c["states"][j]

        def f(p, x):
            return apply_layer(layer, {"params": p, **st}, x, train=True,
                               rng=layer_rng(key, 0, j))
        y, vjp_fn, new_st = jax.vjp(f, c["params"][j], c["acts"][j], has_aux=True)
        leaves, treedefs[j] = jax.tree.flatten(vjp_fn)
        c["acts"] = _set(c["acts"], j + 1, y)
        c["stash"] = _set(c["stash"], j, leaves)
        c["states"] = _set(c["states"], j, jax.tree.unflatten(jax.tree.structure(st),
                                                              jax.tree.leaves(new_st)))
        return c

    def loss(c):
        c = dict(c)
        value, ct = jax.value_and_grad(lambda y: _scalar_loss(job, y, targets))(c["acts"][J])
        c["cts"] = _set(c["cts"], J, ct)
        c["loss"] = value
        return c

    def bwd(j, c):
        c = dict(c)
        vjp_fn = jax.tree.unflatten(treedefs[j], c["stash"][j])
        gp, gx = vjp_fn(c["cts"][j + 1])
        c["grads"] = _set(c["grads"], j, gp)
        c["cts"] = _set(c["cts"], j, gx)
        return c

    def update(c):
        c = dict(c)
        c["params"], c["opt_state"] = apply_update(job.optimizer, c["params"], c["opt_state"],
                                                   c["grads"])
        return c

    return ([functools.partial(fwd, j) for j in range(J)] + [loss]
            + [functools.partial(bwd, j) for j in reversed(range(J))] + [update])


def _scalar_loss(job: BackgroundJob, y, targets):
    return scalar_loss(job.loss_fn, y, targets, "BackgroundJob", "the batch's mean loss")


def _set(seq, i, value):
    out = list(seq)
    out[i] = value
    return out


def _initial_carry(job, ts, x, targets, key, treedefs):
    """The carry at the start of a background step: state and inputs filled in, every
    other buffer zeros of the shape the tasks give it."""
    J = len(job.layers)
    c = {"params": ts["params"], "states": ts["states"], "opt_state": ts["opt_state"],
         "acts": [x] + [None] * J, "stash": [None] * J, "cts": [None] * (J + 1),
         "grads": [None] * J, "loss": jnp.zeros((), loss_dtype())}

    def run_all(c):
        for task in _tasks(job, targets, key, treedefs):
            c = task(c)
        return c
    shapes = jax.eval_shape(run_all, c)
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731
    for k in ("acts", "stash", "cts", "grads"):
        c[k] = [c[k][i] if c[k][i] is not None else zeros(shapes[k][i])
                for i in range(len(c[k]))]
    return c


def background_local_step(job: BackgroundJob, ts, x, targets, key):
    """One background step, all tasks in a row (the job run alone). Returns (loss, new
    train state)."""
    treedefs: dict = {}
    c = _initial_carry(job, ts, x, targets, key, treedefs)
    for task in _tasks(job, targets, key, treedefs):
        c = task(c)
    return c["loss"], {"params": c["params"], "states": c["states"], "opt_state": c["opt_state"]}


def check_background(mux: MuxProgram, bg_state, bg_inputs, bg_targets) -> None:
    """bg inputs/targets [G, job.batch_size, ...] (one row per device), state stacked.
    A flat [G * b, ...] batch was split over the devices and lost its batch axis."""
    G, b = mux.fg.num_devices, mux.bg.batch_size
    fix = (f"the background batch is one row per device: shape [{G}, {b}, ...] "
           f"(BackgroundJob batch_size={b}).")
    for what, tree in (("bg_inputs", bg_inputs), ("bg_targets", bg_targets)):
        for path, a in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if tuple(np.shape(a)[:2]) != (G, b):
                raise ValueError(f"MuxProgram: {what}{jax.tree_util.keystr(path)} has shape "
                                 f"{tuple(np.shape(a))}: {fix}")
    check_stacked("bg_state", bg_state, G)


def _bg_key(rng):
    return jax.random.fold_in(rng, jax.lax.axis_index(DATA))


def multiplexed_step(mux: MuxProgram, fg_state, bg_state, fg_inputs, fg_targets, bg_inputs,
                     bg_targets, fg_rng, bg_rng):
    """One foreground burst train step with the background step in its idle branches.
    States are stacked per device (`init_train_state`); bg_inputs/targets [G, b, ...]
    (device d's instance takes row d). Device d's background draws from
    fold_in(bg_rng, d). Returns (fg loss, new fg state, bg losses [G] (0 where a device
    ran none), new bg state). A foreground state trained under other widths is made
    current first (`executor.current_for`)."""
    check_stacked("fg_state", fg_state, mux.fg.num_devices)
    # The background rows [G, b, ...] split over "data" like the foreground's: placed and
    # compared across processes with them (a process's own background rows trained each
    # device's instance on a mix, silently).
    (fg_inputs, bg_inputs), (fg_targets, bg_targets), fg_rng = on_every_process(
        mux.fg, "multiplexed_step", (fg_inputs, bg_inputs), (fg_targets, bg_targets), fg_rng)
    bg_rng = distributed.place_key_everywhere(bg_rng, mux.fg.mesh,
                                              "burst.multiplexed_step: bg_rng")
    loss, fg, bg_losses, bg = _multiplexed_step(
        mux, dict(current_for(mux.fg, fg_state)), dict(bg_state), fg_inputs, fg_targets,
        bg_inputs, bg_targets, fg_rng, bg_rng)   # plain dicts: one compile (executor.current_for)
    return loss, TrainState(fg, mux.fg.widths), bg_losses, bg


@functools.partial(jax.jit, static_argnums=(0,))
def _multiplexed_step(mux: MuxProgram, fg_state, bg_state, fg_inputs, fg_targets, bg_inputs,
                      bg_targets, fg_rng, bg_rng):
    prog = mux.fg
    slots = mux.slots
    tasks_at = {s: [t for t in range(slots.shape[1]) if (slots[:, t] == s).any()]
                for s in range(2 * len(prog.layers))}

    def body(fts, bts, x, t, bx, bt, frng, brng):
        fts, bts, bx, bt = _squeeze(fts), _squeeze(bts), _squeeze(bx), _squeeze(bt)
        d = jax.lax.axis_index(DATA)
        key = _bg_key(brng)
        treedefs: dict = {}
        carry = _initial_carry(mux.bg, bts, bx, bt, key, treedefs)
        task_fns = _tasks(mux.bg, bt, key, treedefs)
        table = jnp.asarray(slots)

        def idle(slot, c):
            for k in tasks_at[slot]:
                c = jax.lax.cond(table[d, k] == slot, task_fns[k], lambda cc: cc, c)
            return c

        loss, grads, new_states, carry = explicit_value_and_grad(
            prog, fts["params"], fts["states"], x, t, frng, idle, carry)
        params, opt_state = apply_update(mux.fg_optimizer, fts["params"], fts["opt_state"], grads)
        new_fg = {"params": params, "states": new_states, "opt_state": opt_state}
        new_bg = {"params": carry["params"], "states": carry["states"],
                  "opt_state": carry["opt_state"]}
        return loss, _stack(new_fg), carry["loss"][None], _stack(new_bg)

    check_batch(prog, fg_inputs, fg_targets)
    check_stacked("fg_state", fg_state, prog.num_devices)
    check_background(mux, bg_state, bg_inputs, bg_targets)
    prog, fg_targets = weighed(prog, fg_targets)
    return shard(prog, body, (P(), P(DATA), P(DATA), P(DATA)), n_stacked=2, n_batches=4, n_keys=2)(
        fg_state, bg_state, fg_inputs, fg_targets, bg_inputs, bg_targets, fg_rng, bg_rng)


def background_step(mux: MuxProgram, bg_state, bg_inputs, bg_targets, bg_rng):
    """The background job alone on the devices that run it in `mux` (the others skip):
    what the multiplexed step saves against."""
    _, (bg_inputs, bg_targets), bg_rng = on_every_process(
        mux.fg, "background_step", None, (bg_inputs, bg_targets), bg_rng)
    return _background_step(mux, bg_state, bg_inputs, bg_targets, bg_rng)


@functools.partial(jax.jit, static_argnums=(0,))
def _background_step(mux: MuxProgram, bg_state, bg_inputs, bg_targets, bg_rng):
    runs = jnp.asarray(mux.runs_background)

    def body(bts, bx, bt, brng):
        # A plain dict: the cond's branches return the state as the step makes it.
        bts, bx, bt = dict(_squeeze(bts)), _squeeze(bx), _squeeze(bt)
        d = jax.lax.axis_index(DATA)
        key = _bg_key(brng)
        loss, new = jax.lax.cond(
            runs[d], lambda s: background_local_step(mux.bg, s, bx, bt, key),
            lambda s: (jnp.zeros((), loss_dtype()), s), bts)
        return loss[None], _stack(new)

    check_background(mux, bg_state, bg_inputs, bg_targets)
    return shard(mux.fg, body, (P(DATA), P(DATA)), n_stacked=1, n_batches=2)(
        bg_state, bg_inputs, bg_targets, bg_rng)
