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
from jax.extend import core as jcore

from jaxhybrid.pipeline import packing
from jaxhybrid.pipeline.tables import COL
from jaxhybrid.schedules.asynchronous import is_asynchronous, staleness, updates_per_call


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
        # Kept in the parameters' dtypes (as init made it): an optimizer may return
        # float32 updates for bf16 parameters (inject_hyperparams keeps a float32 rate),
        # and the U task's cond needs one type whether it runs or not.
        last = jax.tree.map(lambda u, old: u.astype(old.dtype), updates, state.last_update)
        return updates, PredictionState(inner, last)

    return optax.GradientTransformation(init, update)


def _predicted(weights: dict, opt_state, s) -> dict:
    """W + s u (u: the last update; s = 0 gives W exactly)."""
    u = opt_state.last_update
    return {n: w + s.astype(w.dtype) * u[n] if jnp.issubdtype(w.dtype, jnp.inexact) else w
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


def check_remat(sched, programs) -> None:
    """A ValueError naming the fix when remat would change an asynchronous algorithm: a
    recomputing backward reruns the forward with the backward's weights, which "newest"
    (async) and "predict-v1" take other than the forward's on a stage with staleness, so
    the activations would not be the ones the forward saw (docs/async.md)."""
    if sched.weights not in ("newest", "predict-v1"):
        return
    stale = staleness(sched)
    if any(stale[k] > 0 and (p.stage_remat != "none" or any(p.layer_remat))
           for k, p in enumerate(programs)):
        raise ValueError(f"Pipeline: schedule {sched.name!r} runs a backward on other weights "
                         f"than its forward, and remat would recompute the forward with them "
                         f"(not the activations the forward saw); use remat='none', or a "
                         f"schedule whose backward reuses its forward's weights (pipedream, "
                         f"2bw, spectrain).")


_REMAT = ("checkpoint", "remat", "remat2")


def _has_remat(jaxpr) -> bool:
    return any(e.primitive.name in _REMAT
               or any(_has_remat(j) for j in jcore.jaxprs_in_params(e.params))
               for e in jaxpr.eqns)


def check_planned_remat(sched, plan, budget) -> None:
    """remat='auto' under a memory budget planned recomputation that `check_remat` then
    refused in train_step ("use remat='none'", which the user had not asked for): the
    budget is refused at planning instead, naming why."""
    if sched.weights in ("newest", "predict-v1") and any(plan.remat):
        raise ValueError(f"Pipeline: memory_budget={budget!r} needs recomputation (planned "
                         f"for layers {[i for i, r in enumerate(plan.remat) if r]}), which "
                         f"schedule {sched.name!r} cannot use (its backward runs on newer "
                         f"weights than its forward); raise the budget, or use a schedule "
                         f"whose backward reuses its forward's weights (pipedream, 2bw, "
                         f"spectrain).")


def _recomputes_from(jaxpr, params: set) -> bool:
    """Whether a recompute (jax.checkpoint / nn.remat) in `jaxpr` takes the parameter
    arrays themselves: the backward replaces those residuals by its own weights (a remat
    of values computed from the parameters keeps the forward's values, which is right).
    Through calls whose inputs map one to one; any other call that takes parameters and
    recomputes inside counts (conservative)."""
    for eqn in jaxpr.eqns:
        takes = [not isinstance(v, jcore.Literal) and v in params for v in eqn.invars]
        if not any(takes):
            continue
        if eqn.primitive.name in _REMAT:
            return True
        for sub in jcore.jaxprs_in_params(eqn.params):
            if len(sub.invars) == len(eqn.invars):
                if _recomputes_from(sub, {v for v, t in zip(sub.invars, takes) if t}):
                    return True
            elif _has_remat(sub):
                return True
    return False


def check_layer_remat(sched, eng, mb_inputs, train: bool, rng) -> None:
    """`check_remat` for the remat a layer does itself (`nn.remat`, `jax.checkpoint` in
    its __call__), found in each stale stage's traced forward: the backward recomputed
    it with its own weights, silently (a probe: parameters 2.7e-2 off after 3 steps)."""
    if sched.weights not in ("newest", "predict-v1"):
        return
    from jaxhybrid.pipeline.layouts import stage_forwards
    stale, (_, forwards) = staleness(sched), stage_forwards(eng, mb_inputs, train, rng)
    for k, stage in enumerate(eng.stages):
        if stale[k] == 0:
            continue
        closed = forwards[k].closed
        params = closed.jaxpr.invars[:len(jax.tree.leaves(stage.abstract_params))]
        if _recomputes_from(closed.jaxpr, set(params)):
            raise ValueError(f"Pipeline: schedule {sched.name!r} runs a backward on other "
                             f"weights than its forward, and a layer of stage {k} recomputes "
                             f"its forward itself (nn.remat / jax.checkpoint reading its "
                             f"parameters), which would then use the backward's weights; "
                             f"drop that remat from the layer, or use a schedule whose "
                             f"backward reuses its forward's weights (pipedream, 2bw, "
                             f"spectrain).")


def check_opt_state(opt_state, expected, shapes: bool = True) -> None:
    """A ValueError naming the fix when `opt_state` is not of this optimizer on this
    pipeline's packed parameters (None, another optimizer's, one of per-layer params, or
    with `shapes` one made for another split or mesh): else it failed inside optax or as
    a shard_map shape error."""
    packing.check_not_donated(opt_state, "Pipeline.train_step: opt_state")
    fix = "; make it with pipe.init_optimizer(optimizer, variables)."
    if jax.tree.structure(opt_state) != jax.tree.structure(expected):
        raise ValueError("Pipeline.train_step: opt_state is not this optimizer's state on the "
                         "pipeline's packed parameters" + fix)
    for got, want in zip(jax.tree.leaves(opt_state), jax.tree.leaves(expected)):
        if shapes and tuple(jnp.shape(got)) != tuple(want.shape):
            raise ValueError(f"Pipeline.train_step: opt_state has a slot of shape "
                             f"{tuple(jnp.shape(got))} where this pipeline's packed parameters "
                             f"need {tuple(want.shape)} (made for another split or mesh?)" + fix)
        if jnp.result_type(got) != want.dtype:   # else "cond branches must have equal types"
            raise ValueError(f"Pipeline.train_step: opt_state has a slot of dtype "
                             f"{jnp.result_type(got)} where this optimizer keeps {want.dtype} "
                             f"(cast, or restored in another dtype?)" + fix)


def init_on_packed(init, params):
    """init(params) on a pipeline's packed parameters; an optimizer that fails there (an
    optax.masked / multi_transform tree of per-layer parameters: "pytree structure
    error") is told why: it sees the packed buffers, not the layers."""
    try:
        return init(params)
    except (ValueError, TypeError) as e:
        shapes = {k: tuple(v.shape) for k, v in params.items()}
        raise ValueError(f"Pipeline: the optimizer's init failed on the packed parameters "
                         f"{shapes} ({str(e).splitlines()[0]}); in the pipeline it sees packed "
                         f"buffers, not per-layer trees: pack a mask or label tree like them "
                         f"(a weight-decay mask: jaxhybrid.optim.masked_weight_decay(rate, "
                         f"jaxhybrid.optim.weight_decay_mask(pipe, variables)), for an "
                         f"optimizer applied outside the pipeline) or make it a function of "
                         f"the packed tree.") from e
