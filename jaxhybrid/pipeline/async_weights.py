"""Which weights a task of an asynchronous schedule runs with, inside the engine.

The policies are `jaxhybrid.schedules.asynchronous`'s; here they act on one device's
buffers. The carry holds the current weights (`params`, which U tasks update), a
version ring `versions` ({buffer key: [slots, length]}, sized by the control table)
and, for prediction, the optimizer's last update, kept in the optimizer state
(`PredictionState`) so that it is packed like the parameters and checkpointed with
them. Per task the control table gives the slot to read (f_ver / b_ver), the slot a
forward saves its weights to (f_save) and the prediction distance s (f_pred / b_pred).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxhybrid.pipeline.tables import COL
from jaxhybrid.schedules.asynchronous import is_asynchronous, updates_per_call


class PredictionState(NamedTuple):
    """Optimizer state of a predicting schedule: the wrapped optimizer's, and the
    update it applied last (shaped like the parameters)."""
    inner: Any
    last_update: Any


def pipeline_optimizer(optimizer, sched, num_microbatches: int):
    """The optimizer the U tasks of `sched` run. A synchronous schedule's U applies the
    step's gradient (the mean over microbatches): `optimizer` as is. An asynchronous U
    applies the mean gradient of its window (microbatch losses are divided by M in the
    engine, so the window's sum is rescaled by M / window), and a predicting one also
    records the update it applied."""
    if not is_asynchronous(sched):
        return optimizer
    import optax
    scale = float(updates_per_call(sched))   # M / window, the window being M / updates
    predict = sched.weights.startswith("predict")

    def init(params):
        state = optimizer.init(params)
        return PredictionState(state, jax.tree.map(jnp.zeros_like, params)) if predict else state

    def update(grads, state, params=None):
        grads = jax.tree.map(lambda g: g * jnp.asarray(scale, g.dtype), grads)
        if not predict:
            return optimizer.update(grads, state, params)
        updates, inner = optimizer.update(grads, state.inner, params)
        return updates, PredictionState(inner, updates)

    return optax.GradientTransformation(init, update)


def _predicted(weights: dict, opt_state, s) -> dict:
    """W + s u (u: the last update; s = 0 gives W exactly)."""
    u = opt_state.last_update
    return {n: w + s.astype(w.dtype) * u[n] if jnp.issubdtype(w.dtype, jnp.floating) else w
            for n, w in weights.items()}


def _version(versions: dict, slot) -> dict:
    return {n: lax.dynamic_index_in_dim(v, slot, keepdims=False) for n, v in versions.items()}


def _save(versions: dict, slot, weights: dict) -> dict:
    return {n: lax.dynamic_update_index_in_dim(v, weights[n], slot, 0) for n, v in versions.items()}


def forward_weights(policy: str, live: dict, versions, opt_state, row) -> tuple[dict, Any]:
    """(weights the forward runs with, the version ring after it saved them)."""
    if policy == "sync" or policy == "newest":
        return live, versions
    if policy == "two-buffer":
        return _version(versions, row[COL["f_ver"]]), versions
    weights = _predicted(live, opt_state, row[COL["f_pred"]]) if policy.startswith("predict") \
        else live
    if policy in ("stash", "predict-v2"):
        versions = _save(versions, row[COL["f_save"]], weights)
    return weights, versions


def backward_weights(policy: str, live: dict, versions, opt_state, row) -> dict:
    if policy in ("stash", "predict-v2", "two-buffer"):
        return _version(versions, row[COL["b_ver"]])
    if policy == "predict-v1":
        return _predicted(live, opt_state, row[COL["b_pred"]])
    return live


def after_update(policy: str, params: dict, versions, row):
    """The version ring after a U: the two-buffer policy publishes the new weights."""
    if policy != "two-buffer":
        return versions
    return _save(versions, row[COL["u_ver"]], params)


def initial_versions(policy: str, size: int, params: dict):
    """The version ring at the start of a call: slot 0 holds the current weights (the
    two-buffer policy's version 0); None when the policy keeps no versions."""
    if size == 0 or policy in ("sync", "newest", "predict-v1"):
        return None
    ring = {n: jnp.zeros((size, *v.shape), v.dtype) for n, v in params.items()}
    return _save(ring, 0, params)
