"""The optimizer of the training program, on a pipeline's packed parameters: the
learning-rate schedule, adamw or sgd + momentum (`make_optimizer`), weight decay through
a packed mask (`weight_decay_mask`: kernels and embeddings decay, biases and norm scales
do not) and gradient clipping whose norm counts tied copies and model-axis replicas once
(`norm_weights`, `global_norm`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxhybrid import portable

OPTIMIZERS = ("adamw", "sgd")


def learning_rate_schedule(t, updates_per_step: int = 1) -> optax.Schedule:
    """Linear warm-up to train.learning_rate, then cosine decay to 0 at train.steps;
    over updates when a step makes several (asynchronous schedules)."""
    u = updates_per_step
    return optax.warmup_cosine_decay_schedule(
        0.0, t.learning_rate, t.warmup_steps * u, max(t.steps * u, t.warmup_steps * u + 1), 0.0)


def masked_weight_decay(rate: float, mask) -> optax.GradientTransformation:
    """optax.add_decayed_weights(rate) where `mask` (packed like the parameters, e.g.
    `weight_decay_mask(pipe, variables)`) is 1.0, on the packed gradients outside the
    pipeline: `optax.chain(optax.scale_by_adam(), masked_weight_decay(0.1, mask),
    optax.scale(-lr))` is adamw with a mask. optax.masked (and adamw(mask=)) wants one
    bool per leaf and a packed buffer mixes kernels and biases ("The truth value of an
    array ... is ambiguous"), so this mask is itself a packed buffer; None decays all."""
    def update(updates, state, params):
        if mask is None:                  # no mask: decay everything
            return jax.tree.map(lambda g, p: g + rate * p, updates, params), state
        return jax.tree.map(lambda g, p, m: g + rate * m * p, updates, params, mask), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def global_norm(tree, weights=None):
    """optax.tree.norm, or with `weights` (packed like the tree) sqrt(sum(w * x^2)): a
    split model's tied copies each hold the whole gradient and count 1/copies each."""
    if weights is None:
        return optax.tree.norm(tree)
    return jnp.sqrt(sum(jnp.sum(w * jnp.square(x)) for x, w in
                        zip(jax.tree.leaves(tree), jax.tree.leaves(weights))))


def _clip_by_global_norm(max_norm: float, weights) -> optax.GradientTransformation:
    """optax.clip_by_global_norm with the norm of `global_norm(updates, weights)`."""
    if weights is None:
        return optax.clip_by_global_norm(max_norm)

    def update(updates, state, params=None):
        norm = global_norm(updates, weights)
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(t, decay_mask=None, copy_weights=None,
                   updates_per_step: int = 1) -> optax.GradientTransformation:
    """adamw (decoupled weight decay) or sgd + momentum, on the packed params;
    `copy_weights` (from `norm_weights`) make gradient clipping count tied copies once;
    `updates_per_step` > 1 (asynchronous schedules) keeps the learning-rate schedule in
    steps, stretched over the updates the optimizer counts."""
    parts = [_clip_by_global_norm(t.grad_clip_norm, copy_weights)] if t.grad_clip_norm > 0 else []
    if t.optimizer == "adamw":
        parts.append(optax.scale_by_adam())
    if t.weight_decay > 0:
        parts.append(masked_weight_decay(t.weight_decay, decay_mask))
    if t.optimizer == "sgd" and t.momentum > 0:
        parts.append(optax.trace(decay=t.momentum))
    parts.append(optax.scale_by_learning_rate(learning_rate_schedule(t, updates_per_step)))
    return optax.chain(*parts)


def weight_decay_mask(pipe, variables) -> dict:
    """Packed 1.0 for kernels/embeddings (ndim >= 2), 0.0 for biases and norm scales.
    Built on the host from the layers' parameter shapes (unpacking the parameters on the
    mesh compiled a program that took minutes for Inception on a busy CPU); `variables`
    is not read (the signature stays for callers)."""
    del variables
    masks = [jax.tree.map(lambda a: np.full(a.shape, len(a.shape) >= 2, a.dtype),
                          shapes.get("params", {})) for shapes in pipe.layer_shapes]
    return portable.pack_like_params(pipe, portable.whole_from_shard(pipe, masks))


def norm_weights(pipe, variables):
    """For a split model whose pieces share a variable (tied embeddings): packed
    1/copies weights (`global_norm`); with a "model" axis of T, 1/T for the leaves every
    model shard holds whole (each holds the same gradient); None otherwise."""
    if pipe.model > 1:
        T = pipe.model
        weights = [jax.tree.map(lambda a, d: np.full(a.shape, 1.0 if d >= 0 else 1.0 / T, a.dtype),
                                shapes.get("params", {}), pipe._dims(i, "params"))
                   for i, shapes in enumerate(pipe.layer_shapes)]
        return portable.pack_like_params(pipe, portable.whole_from_shard(pipe, weights))
    if pipe.splitter is None:
        return None
    from jaxhybrid.splitter.pipeline_hooks import copy_weights
    return copy_weights(pipe, pipe.splitter.split, variables["params"])
