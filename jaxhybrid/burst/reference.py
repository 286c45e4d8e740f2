"""The single-device program a burst step must equal (tests and benchmarks use it).

Semantics of a burst plan with per-layer widths g_l over a global batch B: layer l sees
the batch as g_l consecutive chunks of B / g_l rows; chunk c draws dropout from
`layer_rng(rng, c, l)`; stateful layers (BatchNorm) normalise per chunk and the new
state is the mean over chunks. The loss is the mean over the last layer's chunks of
`loss_fn(chunk outputs, chunk targets)`; a `jp.WeightedMean`'s is the whole batch's
total over its weight (a mean per token, whatever the widths). For layers without state or dropout, chunking
changes nothing: the result is the plain model on the whole batch.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxhybrid.layers import apply_layer, layer_rng, loss_dtype
from jaxhybrid.weighted_loss import per_part


def _chunks(x, n):
    return jax.tree.map(lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:]), x)


def _merge(x):
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), x)


def reference_value_and_grad(layers: Sequence, variables: Sequence[dict], loss_fn: Callable,
                             inputs, targets, widths: Sequence[int], rng=None):
    """(loss, per-layer param grads, new per-layer variables), sequentially on one device."""
    params = [dict(v).get("params", {}) for v in variables]
    states = [{c: t for c, t in dict(v).items() if c != "params"} for v in variables]

    def total(params):
        x, new_states = inputs, []
        for l, (layer, g) in enumerate(zip(layers, widths)):
            def one(c, xc, _l=l, _layer=layer):
                key = layer_rng(rng, c, _l) if rng is not None else None
                return apply_layer(_layer, {"params": params[_l], **states[_l]}, xc,
                                   train=True, rng=key)
            y, st = jax.vmap(one)(jnp.arange(g), _chunks(x, g))
            new_states.append(jax.tree.map(lambda a: jnp.mean(a, axis=0), st))
            x = _merge(y)
        g = widths[-1]
        chunk_loss, chunk_targets = per_part(loss_fn, targets, g)   # as the step (a WeightedMean)
        losses = jax.vmap(lambda y, t: jnp.asarray(chunk_loss(y, t), loss_dtype()))(
            _chunks(x, g), _chunks(chunk_targets, g))
        return jnp.mean(losses), new_states

    (loss, new_states), grads = jax.jit(jax.value_and_grad(total, has_aux=True))(params)
    return loss, grads, [{"params": p, **s} for p, s in zip(params, new_states)]
