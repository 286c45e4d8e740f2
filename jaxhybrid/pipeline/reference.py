"""The single-device reference the pipeline must match (used by tests and benchmarks).

Semantics the pipeline promises: the global batch is split into `data` contiguous shards
and each shard into `num_microbatches` contiguous microbatches; microbatch m of shard d
has global index g = d*M + m and layer i draws dropout from layer_rng(rng, g, i). The loss
is the mean of loss_fn over all microbatches; each shard updates mutable state (batch
statistics) microbatch by microbatch, in order, from the same starting state, and the
new state is the mean over shards (integer state: the floor of the mean, still integer).
The state a microbatch starts from is a value, not differentiated through, as when
gradients are accumulated step by step: where a model reads state it wrote (an EMA of
its features), no gradient flows from one microbatch's loss into an earlier one's.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jaxhybrid.layers import apply_layer, layer_rng, loss_dtype
from jaxhybrid.weighted_loss import per_part

PyTree = Any


def reference_value_and_grad(layers: Sequence, per_layer: Sequence[dict], loss_fn: Callable,
                             inputs: PyTree, targets: PyTree, *, data: int = 1,
                             num_microbatches: int = 1, rng: jax.Array | None = None,
                             train: bool = True):
    """Returns (loss, per-layer param grads, new per-layer variables), run sequentially."""
    params, states, total = _reference_total(layers, per_layer, loss_fn, inputs, targets,
                                             data, num_microbatches, rng, train)
    (loss, new_states), grads = jax.jit(jax.value_and_grad(total, has_aux=True))(params, states)
    return loss, grads, _variables(params, new_states)


def reference_loss(layers: Sequence, per_layer: Sequence[dict], loss_fn: Callable,
                   inputs: PyTree, targets: PyTree, *, data: int = 1,
                   num_microbatches: int = 1, rng: jax.Array | None = None,
                   train: bool = True):
    """Returns (loss, new per-layer variables) of `reference_value_and_grad` without the
    gradients: its forward alone (compiles in about a third of the time)."""
    params, states, total = _reference_total(layers, per_layer, loss_fn, inputs, targets,
                                             data, num_microbatches, rng, train)
    loss, new_states = jax.jit(total)(params, states)
    return loss, _variables(params, new_states)


def _variables(params, states) -> list:
    return [{"params": p, **st} for p, st in zip(params, states)]


def _reference_total(layers, per_layer, loss_fn, inputs, targets, data, num_microbatches,
                     rng, train):
    """(per-layer params, per-layer other variables, total(params, states) -> (loss, new
    states)): the model run as the module docstring says."""
    n = data * num_microbatches
    loss_fn, targets = per_part(loss_fn, targets, n)   # as the step (a WeightedMean)
    params = [dict(v).get("params", {}) for v in per_layer]
    states = [{c: t for c, t in dict(v).items() if c != "params"} for v in per_layer]
    # [data, M, microbatch, ...]: shard d holds rows d*B/data .. (d+1)*B/data, in order.
    split = lambda tree: jax.tree.map(
        lambda a: a.reshape(data, num_microbatches, a.shape[0] // n, *a.shape[1:]), tree)

    def shard(params, states, d, xs, ys):
        def microbatch(st, m_x_y):
            m, x, y = m_x_y
            g = d * num_microbatches + m
            st = list(jax.lax.stop_gradient(st))   # the module docstring: a value
            for i, layer in enumerate(layers):
                key = layer_rng(rng, g, i) if rng is not None else None   # eval too (a VAE)
                x, st[i] = apply_layer(layer, {"params": params[i], **st[i]}, x, train=train, rng=key)
            return st, jnp.asarray(loss_fn(x, y), loss_dtype())
        final, losses = jax.lax.scan(microbatch, states, (jnp.arange(num_microbatches), xs, ys))
        return jnp.mean(losses), final

    def total(params, states):
        # The data shards one after another, as separate devices run them, not vmapped:
        # vmap batches every shard's convolutions into one call with another summation
        # order, which batch norm over a microbatch of 2 amplifies to ~1e-4 of the loss
        # (Inception tiny on a Xeon; tests/test_module_training.py).
        losses, finals = jax.lax.map(lambda d_x_y: shard(params, states, *d_x_y),
                                     (jnp.arange(data), split(inputs), split(targets)))
        return jnp.mean(losses), jax.tree.map(_mean_over_shards, finals)

    return params, states, total


def _mean_over_shards(a: jax.Array) -> jax.Array:
    """The new state of the shards [data, ...]: mean, or floor of the mean for integers
    (a count keeps its dtype, as `runtime.data_mean` does)."""
    if jnp.issubdtype(a.dtype, jnp.integer):
        return jnp.sum(a, axis=0) // a.shape[0]
    return jnp.mean(a, axis=0)
