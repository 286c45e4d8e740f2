"""The SPMD executor: one shard_map'd program runs a schedule's task table.

Per device (data replica d, stage s) the program is a `lax.scan` over ticks. In tick t
the device looks up its row of the table and runs
  1. a forward slot:  lax.switch over [idle, F_0 .. F_{S-1}] (branch F_s when busy), which
     runs the stage's layers under `jax.vjp`, packs the vjp residuals (minus parameters,
     recognised by identity and re-supplied later) into a padded stash slot, and packs
     the output activation for the next stage (the last stage computes the microbatch
     loss instead);
  2. a backward slot: lax.cond(busy) around lax.switch over [B_0 .. B_{S-1}], which
     rebuilds the vjp from the stash, pulls back the gradient received from stage s+1
     (or d loss / d loss on the last stage), adds the parameter gradient to the
     accumulator and packs the input gradient for stage s-1;
  3. two `ppermute`s along "pipe": activations down, gradients up. They sit at tick
     level, outside every switch, so all devices issue the same collectives in the same
     order. Received values land in inbox ring buffers at slots the table dictates.
Idle slots take the switch's idle branch (forward) or the cond's idle side (backward),
so bubbles cost no compute. The ticks run as one scan per phase of the table
(`tick_phases`): where no stage runs a backward (warm-up), a tick has no backward
switch, gradient add or gradient ppermute; likewise for forwards. Stash and inbox sizes
come from the table (`Schedule.slots`), so 1F1B keeps O(S) microbatches of residuals and
GPipe O(M). After the scans: loss and gradients are averaged over "data" (pmean; skipped
when data = 1); mutable state (BatchNorm statistics) likewise.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxhybrid.mesh import DATA, PIPE
from jaxhybrid.pipeline import packing
from jaxhybrid.pipeline.stages import merge_float, split_float
from jaxhybrid.schedules import Schedule

PyTree = Any

# Columns of the per-(tick, stage) control table.
_F, _B, _ACT_READ, _ACT_RECV, _GRAD_READ, _GRAD_RECV, _STASH_W, _STASH_R = range(8)


def control_table(sched: Schedule, k_act: int, k_grad: int, k_stash: int) -> np.ndarray:
    """[ticks, stages, 8] int32: microbatches run and buffer slots used. Buffer slot
    k (= the ring size) is a dummy row that absorbs writes of idle slots."""
    T, S = sched.num_ticks, sched.num_stages
    tab = np.zeros((T, S, 8), np.int32)
    slot = lambda m, k: np.where(m >= 0, m % k, k)
    f, b = sched.fwd, sched.bwd
    tab[..., _F], tab[..., _B] = f, b
    tab[..., _ACT_READ] = slot(f, k_act)
    tab[..., _GRAD_READ] = slot(b, k_grad)
    tab[..., _STASH_W] = slot(f, k_stash)
    tab[..., _STASH_R] = slot(b, k_stash)
    from_prev = np.full((T, S), -1)
    from_prev[:, 1:] = f[:, :-1]          # what stage s-1 sent this tick
    from_next = np.full((T, S), -1)
    from_next[:, :-1] = b[:, 1:]          # what stage s+1 sent this tick
    tab[..., _ACT_RECV] = slot(from_prev, k_act)
    tab[..., _GRAD_RECV] = slot(from_next, k_grad)
    return tab


@dataclasses.dataclass(frozen=True)
class Phase:
    """A run of ticks [start, stop) that need the same kinds of work on some stage."""
    start: int
    stop: int
    forward: bool      # some stage runs a forward
    backward: bool     # some stage runs a backward
    send_act: bool     # some stage but the last runs a forward (its output moves down)
    send_grad: bool    # some stage but the first runs a backward (its gradient moves up)


def tick_phases(sched: Schedule) -> list[Phase]:
    """Splits the table into maximal runs of ticks that do or do not run forwards and
    backwards (warm-up, steady state, cool-down for GPipe and 1F1B). Each phase is one
    more copy of the stage branches for XLA to compile, so sends do not split phases:
    a phase sends when any of its ticks does (five phases instead of three cost ~70%
    more compile time for Inception-V3, for two ppermutes per step)."""
    f, b = sched.fwd >= 0, sched.bwd >= 0

    def phase(start: int, stop: int) -> Phase:
        ff, bb = f[start:stop], b[start:stop]
        return Phase(start, stop, bool(ff.any()), bool(bb.any()), bool(ff[:, :-1].any()),
                     bool(bb[:, 1:].any()))

    kinds = [(bool(f[t].any()), bool(b[t].any())) for t in range(sched.num_ticks)]
    phases, start = [], 0
    for t in range(1, sched.num_ticks + 1):
        if t == sched.num_ticks or kinds[t] != kinds[start]:
            phases.append(phase(start, t))
            start = t
    if len(phases) > 3:   # a table that alternates (a custom schedule): one scan, one copy
        return [phase(0, sched.num_ticks)]
    return phases


@dataclasses.dataclass
class StageLayouts:
    """Layouts of everything a stage packs, for one microbatch shape."""
    params: list            # per stage: Layout of the per-layer params list
    state: list             # per stage: {collection: Layout}
    act: list               # per boundary b = 0..S: Layout of the full activation
    grad: list              # per boundary: Layout of its float leaves
    res: list               # per stage: Layout of stashed residuals
    act_len: dict
    grad_len: dict
    res_len: dict


def _take(tree: PyTree, i) -> PyTree:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _set_row(bufs: dict, row, values: dict) -> dict:
    return {k: lax.dynamic_update_index_in_dim(bufs[k], values[k], row, 0) for k in bufs}


def _get_row(bufs: dict, row) -> dict:
    return {k: lax.dynamic_index_in_dim(v, row, keepdims=False) for k, v in bufs.items()}


def _data_mean(data: int, v: jax.Array) -> jax.Array:
    """Mean over the data replicas of a float value; XLA keeps an all-reduce over a
    one-device axis (a copy of every gradient), so data = 1 skips it."""
    if data == 1 or not jnp.issubdtype(v.dtype, jnp.floating):
        return v
    return lax.pmean(v, DATA)


def _ppermute(bufs: dict, perm) -> dict:
    return {k: lax.ppermute(v, PIPE, perm) for k, v in bufs.items()}


class Residuals:
    """Splits a vjp function into stashable residual leaves and parameters.

    `jax.vjp` returns a pytree (a Partial) whose leaves are the residuals. Leaves that are
    the very parameter arrays passed in are not stashed: the backward slot re-supplies
    them from the stage's parameter buffer. The structure is recorded per stage while the
    forward branch is traced and used when the backward branch is traced."""

    def __init__(self):
        self.meta: dict = {}

    def split(self, stage: int, vjp_fn, params: PyTree) -> list:
        leaves, treedef = jax.tree.flatten(vjp_fn)
        where = {id(p): i for i, p in enumerate(jax.tree.leaves(params))}
        kinds = tuple(where.get(id(l)) for l in leaves)
        self.meta[stage] = (treedef, kinds)
        return [l for l, k in zip(leaves, kinds) if k is None]

    def rebuild(self, stage: int, kept: Sequence, params: PyTree):
        treedef, kinds = self.meta[stage]
        p, it = jax.tree.leaves(params), iter(kept)
        return jax.tree.unflatten(treedef, [p[k] if k is not None else next(it) for k in kinds])


def stage_forward_vjp(pipe, s: int, params: list, state: list, x: PyTree, tgt, rng, gmb,
                      loss_fn, num_microbatches: int, train: bool, residuals: Residuals):
    """Stage s's forward under jax.vjp. Returns (out, kept residuals, new state,
    output float leaves' others (ints)). `out` is the microbatch loss / M on the last
    stage, else the list of float leaves of the output."""
    last = s == pipe.num_stages - 1
    prog = pipe.programs[s]
    xf, xi, xmask = split_float(x)
    xdef = jax.tree.structure(x)

    def f(p, xf):
        xx = merge_float(xdef, xmask, xf, xi)
        y, new_state = prog.apply(pipe.layers, p, state, xx, train=train, rng=rng, microbatch=gmb)
        if last:
            loss = jnp.asarray(loss_fn(y, tgt), jnp.float32) / num_microbatches
            return loss, (new_state, [])
        yf, yi, _ = split_float(y)
        return yf, (new_state, yi)

    if s == 0:  # the model input needs no gradient
        out, vjp_fn, (new_state, yi) = jax.vjp(lambda p: f(p, xf), params, has_aux=True)
    else:
        out, vjp_fn, (new_state, yi) = jax.vjp(f, params, xf, has_aux=True)
    return out, residuals.split(s, vjp_fn, params), new_state, yi


def stage_layouts(pipe, mb_inputs: PyTree, mb_targets: PyTree, loss_fn, train: bool,
                  rng: jax.ShapeDtypeStruct | None) -> StageLayouts:
    """Abstractly runs every stage in order on one microbatch to learn its boundary
    activation and residual layouts (no FLOPs are spent)."""
    S = pipe.num_stages
    trees, kept_trees = [mb_inputs], []
    x = mb_inputs
    for s in range(S):
        params, state = pipe.abstract_stage_vars(s)
        probe = Residuals()

        # Every runtime input is an abstract argument here, as in the real program, so
        # that exactly the same values become residuals.
        def run(params, state, x, tgt, key, gmb, s=s, probe=probe):
            out, kept, _, yi = stage_forward_vjp(pipe, s, params, state, x, tgt, key, gmb,
                                                 loss_fn, pipe.num_microbatches, train, probe)
            return out, kept, yi

        out, kept, yi = jax.eval_shape(run, params, state, x, mb_targets, rng,
                                       jax.ShapeDtypeStruct((), jnp.int32))
        kept_trees.append(kept)
        if s < S - 1:
            y_fn = lambda params, state, x, key, s=s: pipe.programs[s].apply(
                pipe.layers, params, state, x, train=train, rng=key, microbatch=0)[0]
            x = jax.eval_shape(y_fn, params, state, x, rng)
            trees.append(x)
    floats = lambda tree: [l for l in jax.tree.leaves(tree) if jnp.issubdtype(l.dtype, jnp.floating)]
    # Boundaries 1..S-1 move between stages and share buffers, one per dtype (one ppermute
    # each); the model input is not packed.
    internal, act_len = packing.shared_layouts(trees[1:], whole_min=None)
    grads, grad_len = packing.shared_layouts([floats(t) for t in trees[1:]], whole_min=None)
    res, res_len = packing.shared_layouts(kept_trees)
    return StageLayouts(
        params=[pipe.param_layouts[s]["params"] for s in range(S)],
        state=[{c: lay for c, lay in pipe.param_layouts[s].items() if c != "params"}
               for s in range(S)],
        act=[packing.layout_of(mb_inputs), *internal],
        grad=[packing.layout_of(floats(mb_inputs)), *grads], res=res,
        act_len=act_len, grad_len=grad_len, res_len=res_len)


def build_train_program(pipe, loss_fn: Callable, sched: Schedule, lay: StageLayouts,
                        mb_shape_inputs: PyTree, train: bool, has_rng: bool):
    """The per-device body (to be shard_map'd) computing (loss, grads, new state)."""
    S, M = pipe.num_stages, pipe.num_microbatches
    k_act, k_grad, k_stash = sched.slots("act"), sched.slots("grad"), sched.slots("stash")
    table = control_table(sched, k_act, k_grad, k_stash)
    colls = pipe.state_collections
    residuals = Residuals()
    act_mask = [[jnp.issubdtype(d, jnp.floating) for d in a.dtypes] for a in lay.act]

    def unpack_stage(s, p_bufs, st_bufs):
        params = packing.unpack(lay.params[s], p_bufs)
        state = pipe.stage_state_from_collections(
            s, {c: packing.unpack(lay.state[s][c], st_bufs[c]) for c in lay.state[s]})
        return params, state

    def pack_state(s, new_state):
        by_coll = pipe.stage_state_to_collections(s, new_state)
        return {c: packing.pack(lay.state[s][c], by_coll[c], pipe.state_len[c]) for c in colls}

    def fwd_branch(s):
        def run(p_bufs, st_bufs, act_in, x_raw, tgt, gmb, rng):
            params, state = unpack_stage(s, p_bufs, st_bufs)
            x = x_raw if s == 0 else packing.unpack(lay.act[s], act_in)
            out, kept, new_state, yi = stage_forward_vjp(
                pipe, s, params, state, x, tgt, rng if has_rng else None, gmb, loss_fn, M,
                train, residuals)
            res = packing.pack(lay.res[s], kept, lay.res_len)
            if s == S - 1:
                act, loss = packing.zeros(lay.act_len), out
            else:
                y_leaves = merge_float(jax.tree.structure([0] * len(act_mask[s + 1])),
                                       act_mask[s + 1], out, yi)
                act, loss = packing.pack(lay.act[s + 1], y_leaves, lay.act_len), jnp.float32(0)
            return act, res, pack_state(s, new_state), loss
        return run

    def fwd_idle(p_bufs, st_bufs, act_in, x_raw, tgt, gmb, rng):
        return (packing.zeros(lay.act_len), packing.zeros(lay.res_len), st_bufs, jnp.float32(0))

    def bwd_branch(s):
        def run(p_bufs, res_bufs, g_in):
            params = packing.unpack(lay.params[s], p_bufs)
            kept = packing.unpack_leaves(lay.res[s], res_bufs)
            vjp_fn = residuals.rebuild(s, kept, params)
            if s == S - 1:
                ct = jnp.ones((), jnp.float32)
            else:
                ct = packing.unpack_leaves(lay.grad[s + 1], g_in)
            grads = vjp_fn(ct)
            g_params = packing.pack(lay.params[s], grads[0], pipe.param_len)
            g_out = (packing.pack(lay.grad[s], grads[1], lay.grad_len) if s > 0
                     else packing.zeros(lay.grad_len))
            return g_out, g_params
        return run

    fwd_branches = [fwd_idle] + [fwd_branch(s) for s in range(S)]
    bwd_branches = [bwd_branch(s) for s in range(S)]
    down = [(i, i + 1) for i in range(S - 1)]
    up = [(i + 1, i) for i in range(S - 1)]

    def per_device(p_bufs, st_bufs, inputs, targets, rng):
        s, d = lax.axis_index(PIPE), lax.axis_index(DATA)
        p_bufs = {k: v[0] for k, v in p_bufs.items()}
        st_bufs = {c: {k: v[0] for k, v in b.items()} for c, b in st_bufs.items()}
        inputs = jax.tree.map(lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:]), inputs)
        targets = jax.tree.map(lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:]), targets)
        ctl = jnp.asarray(table)
        carry = dict(
            act_in=packing.zeros(lay.act_len, (k_act + 1,)),
            grad_in=packing.zeros(lay.grad_len, (k_grad + 1,)),
            stash=packing.zeros(lay.res_len, (k_stash + 1,)),
            acc={k: jnp.zeros_like(v) for k, v in p_bufs.items()},
            state=st_bufs, loss=jnp.float32(0))

        def tick(c, t, phase: Phase):
            row = lax.dynamic_index_in_dim(lax.dynamic_index_in_dim(ctl, t, keepdims=False),
                                           s, keepdims=False)
            c = dict(c)
            if phase.forward:
                fm = row[_F]
                m = jnp.maximum(fm, 0)
                act, res, c["state"], loss = lax.switch(
                    jnp.where(fm >= 0, s + 1, 0), fwd_branches, p_bufs, c["state"],
                    _get_row(c["act_in"], row[_ACT_READ]), _take(inputs, m),
                    _take(targets, m), d * M + m, rng)
                c["stash"] = _set_row(c["stash"], row[_STASH_W], res)
                c["loss"] = c["loss"] + loss
            if phase.backward:
                bm = row[_B]
                # An idle slot skips the backward and the gradient add altogether: a cond
                # around (switch over stages + add), rather than an idle branch returning a
                # zero gradient to add, was ~15% faster per step on XLA CPU.
                def busy(acc, res, g_in):
                    g_out, g_params = lax.switch(s, bwd_branches, p_bufs, res, g_in)
                    return g_out, {k: acc[k] + g_params[k] for k in acc}

                def idle(acc, res, g_in):
                    return packing.zeros(lay.grad_len), acc

                g_out, c["acc"] = lax.cond(bm >= 0, busy, idle, c["acc"],
                                           _get_row(c["stash"], row[_STASH_R]),
                                           _get_row(c["grad_in"], row[_GRAD_READ]))
            if phase.send_act:
                c["act_in"] = _set_row(c["act_in"], row[_ACT_RECV], _ppermute(act, down))
            if phase.send_grad:
                c["grad_in"] = _set_row(c["grad_in"], row[_GRAD_RECV], _ppermute(g_out, up))
            return c, None

        # One scan per phase of the table (warm-up, steady state, cool-down): a tick in
        # which no stage runs a backward needs no backward switch, gradient add or
        # gradient ppermute, and so on.
        c = carry
        for phase in tick_phases(sched):
            c, _ = lax.scan(functools.partial(tick, phase=phase), c,
                            jnp.arange(phase.start, phase.stop))
        mean = functools.partial(_data_mean, pipe.data)
        loss = mean(lax.psum(c["loss"], PIPE))
        grads = {k: mean(v)[None] for k, v in c["acc"].items()}
        state = {col: {k: mean(v)[None] for k, v in b.items()} for col, b in c["state"].items()}
        return loss, grads, state

    return per_device


def build_forward_program(pipe, sched: Schedule, lay: StageLayouts, train: bool, has_rng: bool):
    """Forward only (evaluation / inference): F slots of the table, outputs gathered from
    the last stage."""
    S, M = pipe.num_stages, pipe.num_microbatches
    k_act = sched.slots("act")
    table = control_table(sched, k_act, 1, 1)
    out_lay = lay.act[S]
    out_len = out_lay.size_of
    down = [(i, i + 1) for i in range(S - 1)]

    def branch(s):
        def run(p_bufs, st_bufs, act_in, x_raw, gmb, rng):
            params = packing.unpack(lay.params[s], p_bufs)
            state = pipe.stage_state_from_collections(
                s, {c: packing.unpack(lay.state[s][c], st_bufs[c]) for c in lay.state[s]})
            x = x_raw if s == 0 else packing.unpack(lay.act[s], act_in)
            y, _ = pipe.programs[s].apply(pipe.layers, params, state, x, train=train,
                                          rng=rng if has_rng else None, microbatch=gmb)
            if s == S - 1:
                return packing.zeros(lay.act_len), packing.pack(out_lay, y, out_len)
            return packing.pack(lay.act[s + 1], y, lay.act_len), packing.zeros(out_len)
        return run

    def idle(p_bufs, st_bufs, act_in, x_raw, gmb, rng):
        return packing.zeros(lay.act_len), packing.zeros(out_len)

    branches = [idle] + [branch(s) for s in range(S)]

    def per_device(p_bufs, st_bufs, inputs, rng):
        s, d = lax.axis_index(PIPE), lax.axis_index(DATA)
        p_bufs = {k: v[0] for k, v in p_bufs.items()}
        st_bufs = {c: {k: v[0] for k, v in b.items()} for c, b in st_bufs.items()}
        inputs = jax.tree.map(lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:]), inputs)
        ctl = jnp.asarray(table)
        carry = dict(act_in=packing.zeros(lay.act_len, (k_act + 1,)),
                     out=packing.zeros(out_len, (M + 1,)))

        def tick(c, t):
            row = lax.dynamic_index_in_dim(lax.dynamic_index_in_dim(ctl, t, keepdims=False),
                                           s, keepdims=False)
            fm = row[_F]
            m = jnp.maximum(fm, 0)
            act, out = lax.switch(jnp.where(fm >= 0, s + 1, 0), branches, p_bufs, st_bufs,
                                  _get_row(c["act_in"], row[_ACT_READ]), _take(inputs, m),
                                  d * M + m, rng)
            out_row = jnp.where((fm >= 0) & (s == S - 1), fm, M)
            if S > 1:
                act = _ppermute(act, down)
            return dict(act_in=_set_row(c["act_in"], row[_ACT_RECV], act),
                        out=_set_row(c["out"], out_row, out)), None

        c, _ = lax.scan(tick, carry, jnp.arange(table.shape[0]))
        # Only the last stage holds outputs; the others hold zeros.
        out = {k: lax.psum(v[:M], PIPE) for k, v in c["out"].items()}
        return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]),
                            packing.unpack(out_lay, out))

    return per_device


def build_single_stage_program(pipe, loss_fn: Callable, train: bool, has_rng: bool):
    """pipe = 1: nothing to pipeline, so no ticks, stash or switch. Parameters are unpacked
    once, microbatches run in a scan under jax.value_and_grad with gradients accumulated
    as trees, and the packed gradient is built once: the 1x1 step then costs what a plain
    jitted step does. Same semantics as the tick program (microbatch order, rngs, state)."""
    M, prog = pipe.num_microbatches, pipe.programs[0]
    layouts = pipe.param_layouts[0]

    def per_device(p_bufs, st_bufs, inputs, targets, rng):
        d = lax.axis_index(DATA)
        params = packing.unpack(layouts["params"], {k: v[0] for k, v in p_bufs.items()})
        state = pipe.stage_state_from_collections(0, {
            c: packing.unpack(layouts[c], {k: v[0] for k, v in st_bufs[c].items()})
            for c in pipe.state_collections})
        split = lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:])
        xs, ys = jax.tree.map(split, inputs), jax.tree.map(split, targets)

        def microbatch(carry, m_x_y):
            state, acc, total = carry
            m, x, y = m_x_y

            def loss_of(p):
                out, new_state = prog.apply(pipe.layers, p, state, x, train=train,
                                            rng=rng if has_rng else None, microbatch=d * M + m)
                return jnp.asarray(loss_fn(out, y), jnp.float32) / M, new_state

            (loss, new_state), g = jax.value_and_grad(loss_of, has_aux=True)(params)
            acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
            return (new_state, acc, total + loss), None

        # The first microbatch starts the sums (no zero-filled accumulator to add into);
        # with M = 1 there is no scan at all.
        first = jax.tree.map(lambda a: a[0], (xs, ys))
        (state, grads, loss), _ = microbatch(
            (state, None, jnp.float32(0)), (jnp.int32(0), *first))
        if M > 1:
            rest = jax.tree.map(lambda a: a[1:], (jnp.arange(M), xs, ys))
            (state, grads, loss), _ = lax.scan(microbatch, (state, grads, loss), rest)
        g_bufs = packing.pack(layouts["params"], grads, pipe.param_len)
        by_coll = pipe.stage_state_to_collections(0, state)
        new_state = {c: packing.pack(layouts[c], by_coll[c], pipe.state_len[c])
                     for c in pipe.state_collections}
        mean = functools.partial(_data_mean, pipe.data)
        return (mean(loss), {k: mean(v)[None] for k, v in g_bufs.items()},
                {c: {k: mean(v)[None] for k, v in b.items()} for c, b in new_state.items()})

    return per_device
