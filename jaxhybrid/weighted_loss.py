"""Losses that are a weighted mean over the whole batch, whatever the layout.

A step averages `loss_fn` over the data x M microbatches it cuts the batch into. For a
mean over equally many examples per microbatch that is the batch's loss; for a mean per
token with padding it is a mean of per-microbatch token means, which moves with data x M
(a probe: gradients 22% off at two microbatches, 60% at eight, against one batch's). A
`WeightedMean` says what it sums and what it counts: the step then computes the whole
batch's sum over the whole batch's count, on any layout.

    class TokenCE(WeightedMean):
        def total(self, logits, t):   # summed over the microbatch's tokens
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, t["labels"])
            return jnp.sum(ce * t["mask"])
        def weight(self, t):          # from the targets alone
            return jnp.sum(t["mask"])

The weight is computed on the global batch's targets before the microbatches run (their
backwards start before the last forward, so it must not need the outputs); each
microbatch's total is then scaled by its share. Called directly on one batch, a
`WeightedMean` is total / weight.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxhybrid.checks import batch_size_of
from jaxhybrid.layers import loss_dtype


class WeightedMean(abc.ABC):
    """Base class: `total(outputs, targets)` (a sum over the microbatch) and
    `weight(targets)` (what it is a mean over: tokens, non-masked examples); a subclass
    without either cannot be made."""

    @abc.abstractmethod
    def total(self, outputs, targets):
        """The loss summed over this microbatch (a scalar)."""

    @abc.abstractmethod
    def weight(self, targets):
        """What `total` is a sum over (e.g. the number of non-padding tokens), from the
        targets alone."""

    def __call__(self, outputs, targets):
        return self.total(outputs, targets) / nonzero(self.weight(targets))


def nonzero(weight):
    """`weight`, 1 where it is 0 (a batch of padding only: its total is 0 too). Not
    max(weight, 1): fractional weights (importance weights summing to 0.16) made the
    weighted mean a weighted sum, its gradient 6x too small; nor 1 where it is below 0:
    signed weights summing to -4 gave the total itself, not total / weight."""
    return jnp.where(weight != 0, weight, 1)


@dataclasses.dataclass(frozen=True)
class _Share:
    """A WeightedMean's microbatch share: its total times parts / the batch's weight (the
    second half of its targets, one row per example)."""
    loss: Any

    def __call__(self, outputs, targets):
        inner, scale = targets
        return self.loss.total(outputs, inner) * scale[0]


def per_part(loss_fn, targets, parts: int, *, data: int = 1, windows: int = 1):
    """(loss_fn, targets) for a step that averages loss_fn over `parts` equal chunks of
    the batch `targets` (global): a WeightedMean becomes its chunk's share of the whole
    batch's weighted mean; any other loss is returned as it is.

    windows > 1: an asynchronous step whose every update averages its own window of
    chunks (each data replica's rows cut into `windows` consecutive groups; window g is
    group g of every replica): each chunk's share of its window's weighted mean (it was
    the whole batch's, so an update's step scaled with the other windows' weights)."""
    if not isinstance(loss_fn, WeightedMean):
        return loss_fn, targets
    if type(loss_fn).__call__ is not WeightedMean.__call__:
        # The step trains total / weight: an added term (a z-loss in __call__) was dropped.
        raise ValueError(f"{type(loss_fn).__name__} overrides __call__, which a step does not "
                         f"call: it trains total(outputs, targets) / weight(targets) over "
                         f"the whole batch; put every term into total (summed over the "
                         f"microbatch).")
    rows = batch_size_of(targets, "targets", type(loss_fn).__name__)
    weight = jnp.asarray(loss_fn.weight(targets), loss_dtype())
    if weight.shape != ():
        # One value per row (`jnp.sum(mask, axis=-1)`) was broadcast into per-row scales
        # and gave a meaningless loss (32.6 for a token mean of 1.69), silently.
        raise ValueError(f"{type(loss_fn).__name__}.weight(targets) has shape {weight.shape}; "
                         f"a WeightedMean's weight is one number for the whole (micro)batch, "
                         f"e.g. jnp.sum(mask), not one per row.")
    if windows == 1:
        return _Share(loss_fn), (targets, jnp.full((rows,), parts, loss_dtype()) / nonzero(weight))
    cut = lambda a: a.reshape(data, windows, rows // (data * windows), *a.shape[1:])
    weight_of = lambda t: jnp.asarray(loss_fn.weight(t), loss_dtype())
    per_window = jnp.sum(jax.vmap(jax.vmap(weight_of))(jax.tree.map(cut, targets)), axis=0)
    scale = (parts / windows) / nonzero(per_window)                         # [windows]
    rows_scale = jnp.broadcast_to(scale[None, :, None], (data, windows, rows // (data * windows)))
    return _Share(loss_fn), (targets, rows_scale.reshape(rows))
