"""The single-device reference the pipeline must match (used by tests and benchmarks).

Semantics the pipeline promises: the global batch is split into `data` contiguous shards
and each shard into `num_microbatches` contiguous microbatches; microbatch m of shard d
has global index g = d*M + m and layer i draws dropout from layer_rng(rng, g, i). The loss
is the mean of loss_fn over all microbatches; each shard updates mutable state (batch
statistics) microbatch by microbatch, in order, from the same starting state, and the
new state is the mean over shards.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jaxhybrid.layers import apply_layer, layer_rng

PyTree = Any


def reference_value_and_grad(layers: Sequence, per_layer: Sequence[dict], loss_fn: Callable,
                             inputs: PyTree, targets: PyTree, *, data: int = 1,
                             num_microbatches: int = 1, rng: jax.Array | None = None,
                             train: bool = True):
    """Returns (loss, per-layer param grads, new per-layer variables), run sequentially."""
    n = data * num_microbatches
    batch = jax.tree.leaves(inputs)[0].shape[0]
    mb = batch // n
    params = [dict(v).get("params", {}) for v in per_layer]
    states = [{c: t for c, t in dict(v).items() if c != "params"} for v in per_layer]

    def rows(tree, g):
        return jax.tree.map(lambda a: a[g * mb:(g + 1) * mb], tree)

    def total(params, states):
        loss, finals = 0.0, []
        for d in range(data):
            st = list(states)
            for m in range(num_microbatches):
                g = d * num_microbatches + m
                x = rows(inputs, g)
                for i, layer in enumerate(layers):
                    key = layer_rng(rng, g, i) if (rng is not None and train) else None
                    x, st[i] = apply_layer(layer, {"params": params[i], **st[i]}, x,
                                           train=train, rng=key)
                loss = loss + jnp.asarray(loss_fn(x, rows(targets, g)), jnp.float32) / n
            finals.append(st)
        mean_state = jax.tree.map(lambda *xs: sum(xs) / len(xs), *finals) if finals[0] else finals[0]
        return loss, mean_state

    (loss, new_states), grads = jax.jit(jax.value_and_grad(total, has_aux=True))(params, states)
    new_vars = [{"params": p, **st} for p, st in zip(params, new_states)]
    return loss, grads, new_vars
