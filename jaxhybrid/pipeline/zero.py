"""ZeRO over "data": the optimizer state sharded over the data replicas (ZeRO stage 1).

A packed parameter buffer of length L (one per stage device, stacked over "pipe") is
seen by the optimizer as D = mesh.shape["data"] contiguous shards of ceil(L / D)
elements (zero padded at the end). Replica d keeps only shard d of every optimizer slot
(Adam's two moments: 2 x params / D per device instead of 2 x params). In a tick where
some device updates (the runtime's tick-level flag: every replica issues the same
collectives in the same order; none sits under a device's own row), `update_slot`:
  1. reduce-scatters the accumulated gradient over "data" (`psum_scatter`; each replica's
     is its share of the global mean): replica d receives the mean's shard d only;
  2. runs the optimizer on (shard d of the params, that gradient shard, its slot shard)
     inside the busy cond, like the replicated U task does on whole buffers;
  3. all-gathers the updated shards back into the whole parameter buffer.
Every optimizer that acts elementwise (adam, adamw, sgd + momentum, masked decay) gives
the same numbers as the replicated update; a global-norm clip would see one shard.

Globally an optimizer slot is an array [S, D x ceil(L / D)] sharded P("pipe", "data");
counts and other scalars stay replicated. `opt_state_shardings` gives the same layout for
the jit-level optimizer of `jaxhybrid.train` (`train.zero=1`), where XLA partitions the
elementwise update over the data shards itself.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid.mesh import DATA, PIPE
from jaxhybrid.pipeline.tables import COL

PyTree = Any


def padded_length(length: int, data: int) -> int:
    """The smallest multiple of `data` >= `length`."""
    return -(-int(length) // data) * data


def round_rest_lengths(lengths: dict, data: int) -> dict:
    """Rest buffers ("float32", read by slices anyway) rounded up to a multiple of `data`
    so that their shards need no padding; whole buffers ("float32#w0": read as a
    bitcast) keep their leaf's exact size."""
    return {k: (v if "#" in k else padded_length(v, data)) for k, v in lengths.items()}


def _pad_last(v: jax.Array, data: int) -> jax.Array:
    extra = padded_length(v.shape[-1], data) - v.shape[-1]
    return v if not extra else jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, extra)])


def opt_state_specs(opt_state: PyTree, zero: bool, stage: P = P(PIPE)) -> PyTree:
    """shard_map specs of an optimizer state: parameter-shaped slots like the stage
    buffers (`stage`: over "pipe", or ("pipe", "model")), and over "data" with ZeRO;
    scalars replicated."""
    slot = P(stage[0], DATA) if zero else stage
    return jax.tree.map(lambda a: slot if jnp.ndim(a) else P(), opt_state)


def init_optimizer(optimizer, params: dict, mesh, stage: P = P(PIPE),
                   zero: bool = True) -> PyTree:
    """`optimizer.init` on the packed parameters, each slot placed as the step reads it
    (`opt_state_specs`): like the stage buffers, and with `zero` zero-padded and also
    over "data" (every device holds 1 / (pipe x data) of it). Placed here, not by jax: a
    slot made by zeros_like is a constant that landed on device 0 whole, and the step
    compiled twice (its output slots came back sharded)."""
    data = int(mesh.shape[DATA]) if zero else 1
    init = lambda p: optimizer.init({k: _pad_last(v, data) for k, v in p.items()})
    abstract = jax.eval_shape(init, params)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), opt_state_specs(abstract, zero, stage))
    return jax.jit(init, out_shardings=shardings)(params)


def update_slot(job, dev, c, row):
    """The U task with the optimizer state sharded over "data" (see the module doc)."""
    D = job.eng.data
    d = lax.axis_index(DATA)
    lengths = {n: v.shape[-1] for n, v in c.params.items()}
    # 1. reduce-scatter: replica d gets the data-sum of its shard of each gradient (each
    #    replica's is its share of the global mean already: `stages.microbatch_loss`).
    grads = {n: lax.psum_scatter(_pad_last(v, D), DATA, scatter_dimension=0, tiled=True)
             for n, v in c.acc.items()}
    shard = {n: lax.dynamic_slice_in_dim(_pad_last(v, D), d * grads[n].shape[0],
                                         grads[n].shape[0]) for n, v in c.params.items()}

    def busy(p, opt_state):
        import optax
        updates, opt_state = dev.optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    # 2. the optimizer on this replica's shard (only in the device's U tick).
    shard, opt_state = lax.cond(row[COL["u_stage"]] >= 0, busy, lambda p, o: (p, o),
                                shard, c.opt_state)
    # 3. all-gather the shards into whole buffers (every replica joins).
    params = {n: lax.all_gather(v, DATA, tiled=True)[:lengths[n]] for n, v in shard.items()}
    return c.replace(params=params, opt_state=opt_state)


def opt_state_shardings(mesh, opt_state: PyTree, params: dict, is_slot,
                        stage: P = P(PIPE)) -> PyTree:
    """Shardings of a jit-level optimizer state (`jaxhybrid.train`) with ZeRO: each
    parameter-shaped slot's buffers P(stage rows, "data") where their length divides by
    the data degree (rest buffers always do: `round_rest_lengths`), else P(stage rows);
    `stage`: the stage buffers' spec, over "pipe" or ("pipe", "model")."""
    data = int(mesh.shape[DATA])
    lengths = {k: v.shape[-1] for k, v in params.items()}

    def slot(node):   # (a container of arrays under each key: every array alike)
        return {k: jax.tree.map(lambda _, k=k: NamedSharding(
            mesh, P(stage[0], DATA) if lengths[k] % data == 0 else stage), v)
            for k, v in node.items()}

    return jax.tree.map(lambda node: slot(node) if is_slot(node) else NamedSharding(mesh, P()),
                        opt_state, is_leaf=is_slot)
