"""The SPMD executor: one shard_map'd program runs a schedule's task table.

Everything is an explicit value: the stages (`Stage`: how to run one, where its
variables sit in its device's buffers), the boundary layouts (`layouts.StageLayouts`), the
control table (`tables.ControlTable`) and the carry (`Carry`). Per device (data replica,
pipe position) the program is one `lax.scan` over the table's ticks; in tick t the
device reads its row and runs
  F: lax.cond(busy) around a switch over F_0 .. F_{K-1} (a device only takes its own):
     the stage under `jax.vjp`, residuals (minus parameters) into a stash ring, the
     output packed for the next stage (the last stage adds the microbatch loss);
  B: lax.cond(busy) around a switch over stages: the full backward from the stash, or
     with a split schedule only the input gradient (`backward.SplitBackward`), which
     stashes the intermediate cotangents W needs; the parameter gradient is added to
     the accumulator;
  W: lax.cond(busy): the weight-gradient half from stash + cotangents;
  U: lax.cond(busy): the optimizer on the device's buffers (gradients averaged over
     "data" first);
then one `ppermute` per transfer channel and kind (activations, gradients).

Collectives are never under a device's own row: each is issued under a flag of the
tick alone (`ControlTable.act_send`, `grad_send`, `update_tick`: does *some* device send
on this channel / run a U task in this tick), the same on every device, so all devices
issue the same collectives in the same order and none waits for a peer that skipped.
The gate keeps ticks where nobody sends from paying a collective (warm-up ticks have
no gradients to move, most ticks no update) while the whole table stays one scan: one
compiled copy of every stage's F, B and W, whatever the table's shape.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
from jax import lax

from jaxhybrid.mesh import DATA, PIPE
from jaxhybrid.pipeline import async_weights, packing, zero
from jaxhybrid.pipeline.layouts import StageLayouts, backward_fn
from jaxhybrid.layers import loss_dtype
from jaxhybrid.pipeline.stages import differentiable, merge_float
from jaxhybrid.pipeline.tables import COL, ControlTable
from jaxhybrid.schedules import TaskType

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Stage:
    """One model stage as the runtime sees it.
    apply(params, state, x, *, train, rng, microbatch) -> (y, new_state), with state a
    {collection: tree} dict; params / state[c] live in the device's buffers at the
    `params` / `state[c]` layouts; abstract_* are their ShapeDtypeStruct trees."""
    apply: Callable
    params: packing.Layout
    state: dict
    abstract_params: PyTree
    abstract_state: dict


@dataclasses.dataclass(frozen=True)
class Engine:
    """The explicit inputs of every program: stages, buffer lengths, sizes."""
    stages: tuple
    param_len: dict
    state_len: dict            # {collection: lengths}
    data: int
    num_microbatches: int
    zero: bool = False         # optimizer state sharded over "data" (`zero.update_slot`)


@flax.struct.dataclass
class Carry:
    """What a tick changes: inboxes, stashes, accumulated gradients, state, loss, and
    (with U tasks) parameters and optimizer state (else None: parameters that do not
    change stay a loop invariant, which XLA does not copy from tick to tick)."""
    act_in: dict
    grad_in: dict
    # What this device sent last (an idle slot leaves it as it is rather than zero-filling
    # a new buffer: with one task per tick most slots of a kind are idle).
    act_out: dict
    grad_out: dict
    stash: dict
    cross: dict
    acc: dict
    state: dict
    loss: jax.Array
    params: dict
    opt_state: Any
    # Asynchronous schedules (`async_weights`): the weight version ring, and the sum
    # of the gradients U tasks have applied (what the call returns as its gradient).
    versions: Any = None
    applied: Any = None


def _row(bufs: dict, i) -> dict:
    return {k: lax.dynamic_index_in_dim(v, i, keepdims=False) for k, v in bufs.items()}


def _set_row(bufs: dict, i, values: dict) -> dict:
    """Row i := values, for the buffers `values` names (the others stay as they are)."""
    return {**bufs, **{k: lax.dynamic_update_index_in_dim(bufs[k], v, i, 0)
                       for k, v in values.items()}}


def _take(tree: PyTree, i) -> PyTree:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def data_sum(data: int, v: jax.Array) -> jax.Array:
    """Sum over data replicas of a loss or gradient, each already its share of the global
    mean (`stages.microbatch_loss`); data = 1 skips the all-reduce (see data_mean)."""
    return v if data == 1 else lax.psum(v, DATA)


def data_mean(data: int, v: jax.Array) -> jax.Array:
    """Mean over data replicas of a float value, floor of the mean of an integer one (a
    count in a state collection: left alone, each replica kept its own and the array
    claimed to be replicated was not); XLA keeps an all-reduce over a one-device axis (a
    copy of every gradient), so data = 1 skips it. Neither sum overflows where the mean
    does not: summed in its own dtype, uint8 150 on two replicas came back 22 and float16
    40000 inf. Floats are summed in at least float32; integers as floor(v / data) plus
    the floor of the remainders' mean, each term in range."""
    if data == 1 or not jnp.issubdtype(v.dtype, jnp.number):
        return v
    if jnp.issubdtype(v.dtype, jnp.integer):
        q, r = jnp.floor_divide(v, data), jnp.remainder(v, data).astype(jnp.int32)
        return lax.psum(q, DATA) + (lax.psum(r, DATA) // data).astype(v.dtype)
    wide = jnp.promote_types(v.dtype, jnp.float32)
    return lax.pmean(v.astype(wide), DATA).astype(v.dtype)


# --- task branches (module-level builders over explicit values) --------------------------
@dataclasses.dataclass(frozen=True)
class Job:
    """One program's static inputs: the engine, layouts, loss and mode."""
    eng: Engine
    lay: StageLayouts
    loss_fn: Callable
    train: bool
    has_rng: bool
    split: bool
    weights: str = "sync"      # the schedule's weight policy (schedules.asynchronous)


def _stage_vars(stage: Stage, p_bufs: dict, st_bufs: dict):
    params = packing.unpack(stage.params, p_bufs)
    return params, {c: packing.unpack(lay, st_bufs[c]) for c, lay in stage.state.items()}


def forward_branch(job: Job, k: int):
    """F of stage k: (params, state, inbox, inputs, targets, inbox slot, microbatch,
    global mb, rng) -> (packed output, packed residuals, new state buffers, loss). The
    branch reads only what its stage uses, the first stage its raw input and the others
    an inbox row: read before the switch, both rows were copied in every F on every
    stage (XLA CPU, 8 x Dense(256)+tanh on pipe 4, microbatch 64: 196 copies per step,
    now 140)."""
    K, lay, stage = len(job.eng.stages), job.lay, job.eng.stages[k]

    def run(p_bufs, st_bufs, act_in, inputs, targets, slot, m, gmb, rng):
        params, state = _stage_vars(stage, p_bufs, st_bufs)
        x = _take(inputs, m) if k == 0 else packing.unpack(lay.act[k], _row(act_in, slot))
        tgt = _take(targets, m)
        out, kept, new_state, yi = lay.forward(k, params, state, x, tgt,
                                               rng if job.has_rng else None, gmb)
        res = packing.pack(lay.res[k], lay.stashed(k, kept), lay.res_len)
        st_bufs = {**st_bufs, **{c: packing.pack_into(stage.state[c], new_state[c], st_bufs[c])
                                 for c in stage.state}}
        if k == K - 1:
            return packing.zeros(lay.act_len), res, st_bufs, out
        mask = [differentiable(d) for d in lay.act[k + 1].dtypes]
        y = merge_float(jax.tree.structure([0] * len(mask)), mask, out, yi)
        return (packing.pack(lay.act[k + 1], y, lay.act_len), res, st_bufs,
                jnp.zeros((), loss_dtype()))
    return run


def _cotangent(job: Job, k: int, g_row: dict) -> list:
    if k == len(job.eng.stages) - 1:
        return [jnp.ones((), loss_dtype())]
    return packing.unpack_leaves(job.lay.grad[k + 1], g_row)


def backward_branch(job: Job, k: int):
    """B of stage k: (params, stash row, gradient row) -> (packed input gradient, packed
    parameter gradient or None when split, packed overflow crossing values or zeros, the
    stash row with the crossing values in B's dead residuals' space, or None)."""
    lay, stage = job.lay, job.eng.stages[k]

    def run(p_bufs, res_row, g_row):
        params = packing.unpack(stage.params, p_bufs)
        kept = lay.unstashed(k, res_row)
        ct = _cotangent(job, k, g_row)
        if job.split:
            g_x, crossing = lay.split[k].input_half(params, kept, ct)
            in_row = set(range(len(crossing))) - set(lay.overflow[k])
            row = packing.pack_into(lay.in_row[k], [crossing[i] for i in sorted(in_row)],
                                    res_row)
            row = {key: row[key] for key in lay.in_row_keys}
            g_params, cross = None, packing.pack(
                lay.cross[k], [crossing[i] for i in lay.overflow[k]], lay.cross_len)
        else:
            grads = backward_fn(lay.residuals, k, k == len(job.eng.stages) - 1)(params, kept, ct)
            g_params, g_x = grads[0], (grads[1] if k > 0 else [])
            cross, row = packing.zeros(lay.cross_len), None
        g_out = packing.pack(lay.grad[k], g_x, lay.grad_len) if k > 0 else packing.zeros(lay.grad_len)
        # A split B returns no parameter gradient at all (not a zero buffer for W to add).
        g_p = None if g_params is None else packing.pack(stage.params, g_params,
                                                         job.eng.param_len)
        return g_out, g_p, cross, row
    return run


def weight_branch(job: Job, k: int):
    """W of stage k: (params, stash row, crossing row) -> packed parameter gradient, from
    residuals and what B handed over (its cotangents, and the stage's output gradient
    where W reads it) only."""
    lay, stage = job.lay, job.eng.stages[k]

    def run(p_bufs, res_row, cross_row):
        params = packing.unpack(stage.params, p_bufs)
        kept = lay.unstashed(k, res_row)
        in_row = iter(packing.unpack_leaves(lay.in_row[k], res_row))
        spilled = dict(zip(lay.overflow[k], packing.unpack_leaves(lay.cross[k], cross_row)))
        crossing = [spilled[i] if i in spilled else next(in_row)
                    for i in range(len(lay.split[k].crossing_avals))]
        g = lay.split[k].weight_half(params, kept, crossing)
        return packing.pack(stage.params, jax.tree.unflatten(
            jax.tree.structure(stage.abstract_params), g), job.eng.param_len)
    return run


# --- the tick program ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Device:
    """Per-device values a tick reads (not carried): position, table, inputs, branches."""
    s: jax.Array
    d: jax.Array
    ctl: ControlTable
    table: jax.Array
    act_recv: jax.Array
    grad_recv: jax.Array
    inputs: PyTree
    targets: PyTree
    rng: jax.Array
    branches: dict
    optimizer: Any
    params: dict            # the parameter buffers when no U task changes them
    act_send: jax.Array     # [ticks, channels] bool (the same on every device)
    grad_send: jax.Array
    update_tick: jax.Array  # [ticks] bool

    def params_of(self, c: "Carry") -> dict:
        return self.params if c.params is None else c.params


def _forward_slot(job: Job, dev: Device, c: Carry, row):
    k, m = row[COL["f_stage"]], jnp.maximum(row[COL["f_mb"]], 0)

    def busy(stash, state, loss, versions, act_out):
        weights, versions = async_weights.forward_weights(job.weights, dev.params_of(c),
                                                          versions, c.opt_state, row)
        act, res, state, l = lax.switch(
            jnp.maximum(k, 0), dev.branches["F"], weights, state, c.act_in, dev.inputs,
            dev.targets, row[COL["f_act"]], m, dev.d * job.eng.num_microbatches + m, dev.rng)
        return act, _set_row(stash, row[COL["f_stash"]], res), state, loss + l, versions

    def idle(stash, state, loss, versions, act_out):
        return act_out, stash, state, loss, versions

    # An idle slot neither runs a stage nor touches the stash: with one task per tick
    # (zero-bubble tables) most slots of a kind are idle. (The ring may go through the
    # cond: XLA CPU writes its row in place there.)
    act, stash, state, loss, versions = lax.cond(k >= 0, busy, idle, c.stash, c.state, c.loss,
                                                 c.versions, c.act_out)
    return c.replace(act_out=act, stash=stash, state=state, loss=loss, versions=versions)


def _backward_slot(job: Job, dev: Device, c: Carry, row):
    k = row[COL["b_stage"]]

    def busy(acc, stash, cross_buf, grad_in, grad_out):
        weights = async_weights.backward_weights(job.weights, dev.params_of(c), c.versions,
                                                 c.opt_state, row)
        g_out, g_p, cross, res = lax.switch(jnp.maximum(k, 0), dev.branches["B"], weights,
                                            _row(stash, row[COL["b_stash"]]),
                                            _row(grad_in, row[COL["b_grad"]]))
        if not job.split:
            return g_out, {n: acc[n] + g_p[n] for n in acc}, stash, cross_buf
        # A split B leaves the parameter gradient to W (no add) and hands W its values:
        # in the stash row's space of residuals only B read, the rest in the cross ring.
        return (g_out, acc, _set_row(stash, row[COL["b_stash"]], res),
                _set_row(cross_buf, row[COL["b_cross"]], cross))

    def idle(acc, stash, cross_buf, grad_in, grad_out):
        return grad_out, acc, stash, cross_buf

    # An idle slot skips the backward and the gradient add altogether (a cond around
    # switch + add was ~15% faster per step on XLA CPU than adding a zero gradient), and
    # reads no row (a slice outside the cond is a copy every tick, busy or not).
    g_out, acc, stash, cross = lax.cond(k >= 0, busy, idle, c.acc, c.stash, c.cross, c.grad_in,
                                        c.grad_out)
    return c.replace(grad_out=g_out, acc=acc, stash=stash, cross=cross)


def _weight_slot(job: Job, dev: Device, c: Carry, row):
    k = row[COL["w_stage"]]

    def busy(acc, stash, cross):
        g_p = lax.switch(jnp.maximum(k, 0), dev.branches["W"], dev.params_of(c),
                         _row(stash, row[COL["w_stash"]]), _row(cross, row[COL["w_cross"]]))
        return {n: acc[n] + g_p[n] for n in acc}

    # Rows are read inside the busy branch: two thirds of a zero-bubble table's W slots
    # are idle, and a slice outside the cond would copy the rows in every one.
    acc = lax.cond(k >= 0, busy, lambda acc, *_: acc, c.acc, c.stash, c.cross)
    return c.replace(acc=acc)


def _update_slot(job: Job, dev: Device, c: Carry, row, t):
    """U: gated by the tick's flag (some device updates now), so the data collectives
    (gradient mean, or ZeRO's reduce-scatter + all-gather) run only in update ticks."""
    update = functools.partial(zero.update_slot if job.eng.zero and job.eng.data > 1
                               else _replicated_update, job, dev, row=row)
    return lax.cond(dev.update_tick[t], update, lambda c: c, c)


def _replicated_update(job: Job, dev: Device, c: Carry, row) -> Carry:
    grads = {n: data_sum(job.eng.data, v) for n, v in c.acc.items()}

    def busy(params, opt_state, acc, applied, versions):
        import optax
        updates, opt_state = dev.optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if applied is not None:   # asynchronous: the next window starts from zero
            applied = {n: applied[n] + acc[n] for n in acc}
            acc = {n: jnp.zeros_like(v) for n, v in acc.items()}
        return params, opt_state, acc, applied, async_weights.after_update(
            job.weights, params, versions, row)

    params, opt_state, acc, applied, versions = lax.cond(
        row[COL["u_stage"]] >= 0, busy, lambda *a: a, c.params, c.opt_state, c.acc, c.applied,
        c.versions)
    return c.replace(params=params, opt_state=opt_state, acc=acc, applied=applied,
                     versions=versions)


def _send(values: dict, channel, boxes: dict, slot, sending) -> dict:
    """Moves a device's output over one channel and files what arrives at `slot`, in
    ticks where some device sends on it (`sending`: the tick's flag, not the device's)."""
    if channel.perm:
        values = lax.cond(sending, lambda v: {n: lax.ppermute(a, PIPE, channel.perm)
                                              for n, a in v.items()}, lambda v: v, values)
    # A device that receives nothing this tick has `slot` = the inbox's dummy row.
    return _set_row(boxes, slot, values)


def tick(c: Carry, t, *, job: Job, dev: Device, kinds) -> tuple[Carry, None]:
    """One lock-step tick: F, B, W, U slots of this device, then the transfers."""
    row = lax.dynamic_index_in_dim(lax.dynamic_index_in_dim(dev.table, t, keepdims=False),
                                   dev.s, keepdims=False)
    if TaskType.F in kinds:
        c = _forward_slot(job, dev, c, row)
    if TaskType.B in kinds:
        c = _backward_slot(job, dev, c, row)
    if TaskType.W in kinds:
        c = _weight_slot(job, dev, c, row)
    if TaskType.U in kinds:
        c = _update_slot(job, dev, c, row, t)
    recv = lambda table, i: lax.dynamic_index_in_dim(lax.dynamic_index_in_dim(
        table, t, keepdims=False), dev.s, keepdims=False)[i]
    if TaskType.F in kinds:
        for i, ch in enumerate(dev.ctl.act_channels):
            c = c.replace(act_in=_send(c.act_out, ch, c.act_in, recv(dev.act_recv, i),
                                       dev.act_send[t, i]))
    if TaskType.B in kinds:
        for i, ch in enumerate(dev.ctl.grad_channels):
            c = c.replace(grad_in=_send(c.grad_out, ch, c.grad_in, recv(dev.grad_recv, i),
                                        dev.grad_send[t, i]))
    return c, None


def task_branches(job: Job) -> dict:
    K = len(job.eng.stages)
    return {"F": [forward_branch(job, k) for k in range(K)],
            "B": [backward_branch(job, k) for k in range(K)],
            "W": [weight_branch(job, k) for k in range(K)] if job.split else []}


def _local(bufs: dict) -> dict:
    return {k: v[0] for k, v in bufs.items()}


def _split_microbatches(tree: PyTree, M: int) -> PyTree:
    return jax.tree.map(lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:]), tree)


def train_program(job: Job, ctl: ControlTable, optimizer=None):
    """The per-device body (to be shard_map'd over ("data", "pipe")):
    (params, state, opt_state, inputs, targets, rng) -> (loss, grads, new state,
    new params, new opt_state); params / opt_state change only with U tasks."""
    M, lay, sizes = job.eng.num_microbatches, job.lay, ctl.sizes
    branches = task_branches(job)

    def per_device(p_bufs, st_bufs, opt_state, inputs, targets, rng):
        p_bufs = _local(p_bufs)
        dev = Device(lax.axis_index(PIPE), lax.axis_index(DATA), ctl, jnp.asarray(ctl.table),
                     jnp.asarray(ctl.act_recv), jnp.asarray(ctl.grad_recv),
                     _split_microbatches(inputs, M), _split_microbatches(targets, M), rng,
                     branches, optimizer, p_bufs, jnp.asarray(ctl.act_send),
                     jnp.asarray(ctl.grad_send), jnp.asarray(ctl.update_tick))
        c = Carry(act_in=packing.zeros(lay.act_len, (sizes["act"] + 1,)),
                  grad_in=packing.zeros(lay.grad_len, (sizes["grad"] + 1,)),
                  act_out=packing.zeros(lay.act_len), grad_out=packing.zeros(lay.grad_len),
                  # Stashes are written only by busy slots: no dummy row (inboxes take a
                  # transfer every tick, so theirs absorbs what no one is sent).
                  stash=packing.zeros(lay.res_len, (sizes["stash"],)),
                  cross=packing.zeros(lay.cross_len, (sizes["cross"],)),
                  acc={k: jnp.zeros_like(v) for k, v in p_bufs.items()},
                  state={col: _local(b) for col, b in st_bufs.items()},
                  loss=jnp.zeros((), loss_dtype()),
                  params=p_bufs if optimizer is not None else None,
                  opt_state=jax.tree.map(_squeeze, opt_state),
                  versions=async_weights.initial_versions(job.weights, sizes["versions"], p_bufs),
                  applied=(None if job.weights == "sync" else
                           {k: jnp.zeros_like(v) for k, v in p_bufs.items()}))
        c, _ = lax.scan(functools.partial(tick, job=job, dev=dev, kinds=ctl.kinds), c,
                        jnp.arange(ctl.table.shape[0]))
        mean, total = functools.partial(data_mean, job.eng.data), functools.partial(
            data_sum, job.eng.data)
        loss = total(lax.psum(c.loss, PIPE))
        acc = c.acc if c.applied is None else {k: c.applied[k] + v for k, v in c.acc.items()}
        grads = {k: total(v)[None] for k, v in acc.items()}
        state = {col: {k: mean(v)[None] for k, v in b.items()} for col, b in c.state.items()}
        return (loss, grads, state, {k: v[None] for k, v in dev.params_of(c).items()},
                jax.tree.map(_unsqueeze, c.opt_state))

    return per_device


def _squeeze(a):
    return a[0] if jnp.ndim(a) else a


def _unsqueeze(a):
    return a[None] if jnp.ndim(a) else a
