"""The other two programs: forward only (evaluation), and one stage (nothing to pipeline).

Both are per-device bodies to be shard_map'd over ("data", "pipe"), built from explicit
values like the tick program in `runtime.py`.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxhybrid.mesh import DATA, PIPE
from jaxhybrid.pipeline import packing
from jaxhybrid.pipeline.layouts import StageLayouts
from jaxhybrid.pipeline.runtime import (Engine, _local, _row, _send, _set_row,
                                        _split_microbatches, _take, data_mean,
                                        data_sum)
from jaxhybrid.layers import loss_dtype
from jaxhybrid.pipeline.stages import microbatch_loss
from jaxhybrid.pipeline.tables import COL, ControlTable


def _output_branch(eng: Engine, lay: StageLayouts, k: int, has_rng: bool):
    K, stage = len(eng.stages), eng.stages[k]
    out_len = lay.act[K].size_of

    def run(p_bufs, st_bufs, act_in, inputs, slot, m, gmb, rng):
        params = packing.unpack(stage.params, p_bufs)
        state = {c: packing.unpack(l, st_bufs[c]) for c, l in stage.state.items()}
        # What the stage reads, read here (`runtime.forward_branch`).
        x = _take(inputs, m) if k == 0 else packing.unpack(lay.act[k], _row(act_in, slot))
        y = lay.forwards[k](params, state, x, rng if has_rng else None, gmb)
        if k == K - 1:
            return packing.zeros(lay.act_len), packing.pack(lay.act[K], y, out_len)
        return packing.pack(lay.act[k + 1], y, lay.act_len), packing.zeros(out_len)
    return run


def forward_program(eng: Engine, lay: StageLayouts, ctl: ControlTable, has_rng: bool):
    """(params, state, inputs, rng) -> outputs of the last stage (`_merge_microbatches`);
    state is not updated. ctl: a table with F tasks only (`schedules.forward_schedule`);
    lay: `forward_layouts`, whose stage forwards (traced in train mode or not) it runs."""
    K, M = len(eng.stages), eng.num_microbatches
    out_len = lay.act[K].size_of

    def idle(p_bufs, st_bufs, act_in, inputs, slot, m, gmb, rng):
        return packing.zeros(lay.act_len), packing.zeros(out_len)

    branches = [idle] + [_output_branch(eng, lay, k, has_rng) for k in range(K)]

    def per_device(p_bufs, st_bufs, inputs, rng):
        s, d = lax.axis_index(PIPE), lax.axis_index(DATA)
        p_bufs, st_bufs = _local(p_bufs), {c: _local(b) for c, b in st_bufs.items()}
        inputs = _split_microbatches(inputs, M)
        table, act_recv = jnp.asarray(ctl.table), jnp.asarray(ctl.act_recv)
        act_send = jnp.asarray(ctl.act_send)

        def tick(c, t):
            row = table[t, s]
            k, m = row[COL["f_stage"]], jnp.maximum(row[COL["f_mb"]], 0)
            act, out = lax.switch(jnp.where(k >= 0, k + 1, 0), branches, p_bufs, st_bufs,
                                  c["act_in"], inputs, row[COL["f_act"]], m, d * M + m, rng)
            box = _set_row(c["out"], jnp.where(k == K - 1, m, M), out)
            act_in = c["act_in"]
            for i, ch in enumerate(ctl.act_channels):
                act_in = _send(act, ch, act_in, act_recv[t, s, i], act_send[t, i])
            return dict(act_in=act_in, out=box), None

        c = dict(act_in=packing.zeros(lay.act_len, (ctl.sizes["act"] + 1,)),
                 out=packing.zeros(out_len, (M + 1,)))
        c, _ = lax.scan(tick, c, jnp.arange(table.shape[0]))
        # Only the last stage's device holds outputs; the others hold zeros. (psum makes
        # bool buffers int32: a mask came back as 0/1 ints, and `x[mask]` gathered rows.)
        out = {k: lax.psum(v[:M], PIPE).astype(v.dtype) for k, v in c["out"].items()}
        mb = jax.tree.leaves(inputs)[0].shape[1]
        return jax.tree.map(functools.partial(_merge_microbatches, mb),
                            packing.unpack(lay.act[K], out))

    return per_device


def _merge_microbatches(mb: int, a: jax.Array) -> jax.Array:
    """One output leaf of M microbatches, [M, *leaf]: batch-major leaves (leading axis
    the microbatch size) back to one batch, [M x mb, ...]; any other leaf (a scalar such
    as an auxiliary loss, a parameter the model returns) stays one value per
    microbatch, [M, *leaf]: `Pipeline.apply` cannot know how the model would have
    combined them over the whole batch."""
    if a.ndim >= 2 and a.shape[1] == mb:
        return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])
    return a


def single_stage_program(eng: Engine, loss_fn: Callable, train: bool, has_rng: bool):
    """One stage on one device: no ticks, stash or switch. Parameters are unpacked once,
    microbatches run in a scan under jax.value_and_grad with gradients accumulated as
    trees, and the packed gradient is built once, so the step costs what a plain jitted
    step does. Same semantics as the tick program (microbatch order, rngs, state)."""
    M, (stage,) = eng.num_microbatches, eng.stages

    def per_device(p_bufs, st_bufs, opt_state, inputs, targets, rng):
        d = lax.axis_index(DATA)
        params = packing.unpack(stage.params, _local(p_bufs))
        state = {c: packing.unpack(l, _local(st_bufs[c])) for c, l in stage.state.items()}
        xs, ys = _split_microbatches(inputs, M), _split_microbatches(targets, M)

        def microbatch(carry, m_x_y):
            state, acc, total = carry
            m, x, y = m_x_y

            def loss_of(p):
                out, new_state = stage.apply(p, state, x, train=train,
                                             rng=rng if has_rng else None, microbatch=d * M + m)
                return microbatch_loss(loss_fn, out, y, eng.data * M), new_state

            (loss, new_state), g = jax.value_and_grad(loss_of, has_aux=True)(params)
            acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
            return (new_state, acc, total + loss), None

        # The first microbatch starts the sums (no zero-filled accumulator to add into).
        first = jax.tree.map(lambda a: a[0], (xs, ys))
        (state, grads, loss), _ = microbatch((state, None, jnp.zeros((), loss_dtype())),
                                             (jnp.int32(0), *first))
        if M > 1:
            rest = jax.tree.map(lambda a: a[1:], (jnp.arange(M), xs, ys))
            (state, grads, loss), _ = lax.scan(microbatch, (state, grads, loss), rest)
        g_bufs = packing.pack(stage.params, grads, eng.param_len)
        new_state = {c: packing.pack(stage.state[c], state[c], eng.state_len[c]) for c in stage.state}
        mean = functools.partial(data_mean, eng.data)
        total = functools.partial(data_sum, eng.data)
        return (total(loss), {k: total(v)[None] for k, v in g_bufs.items()},
                {c: {k: mean(v)[None] for k, v in b.items()} for c, b in new_state.items()},
                p_bufs, opt_state)

    return per_device
