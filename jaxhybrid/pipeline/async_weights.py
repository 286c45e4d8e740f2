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


# Parameter names a name-based mask or label function tells apart (check_per_element).
_NAMES = ("kernel", "bias", "scale", "embedding")


def check_per_element(optimizer, param_len: dict) -> None:
    """A ValueError unless `optimizer` acts element by element, as the U tasks need: each
    runs it on one device's packed buffers (with zero=1 on one data shard of them), where a
    global-norm clip, a per-leaf trust ratio (lamb, lars), a step size estimated from the
    whole model (D-Adaptation, Prodigy) or a skip decided by all gradients
    (apply_if_finite) silently gave other numbers than on the whole model. Probed on two
    halves of the packed keys versus the whole over five updates (the first with one half
    1e6 times larger, so that any clip bites), and once with a non-finite gradient in one
    half. Then the optimizer is run abstractly on one device's buffers, as the U tasks
    run it, and its state must be per parameter or scalars. A probe the optimizer cannot
    run on these small arrays (its own checks) is left to the real call to report."""
    import numpy as np
    if not all(callable(getattr(optimizer, f, None)) for f in ("init", "update")):
        raise ValueError(f"Pipeline: optimizer must be an optax.GradientTransformation (e.g. "
                         f"optax.adam(1e-3)), got {type(optimizer).__name__}; for gradients "
                         f"alone use pipe.value_and_grad(loss_fn).")
    _check_on_device_buffers(optimizer, param_len)
    rs = np.random.RandomState(0)
    keys = sorted(param_len)
    draw = lambda *scale: {k: np.concatenate([rs.randn(3) * s for s in scale]).astype(np.float32)
                           for k in keys}
    params = draw(1, 1)
    grads = [draw(1e6, 1), draw(1e-3, 1e-3), draw(1, 1), draw(0.1, 3), draw(1, 1)]
    nonfinite = [draw(1, 1), {k: v.copy() for k, v in draw(1, 1).items()}]
    for v in nonfinite[1].values():
        v[4] = np.nan
    half = lambda tree, h: {k: v[3 * h:3 * h + 3] for k, v in tree.items()}

    def run(p, grads):
        state, out = optimizer.init(p), []
        for g in grads:
            u, state = optimizer.update(g, state, p)
            out.append(u)
        return out
    as_2d = lambda tree: {k: v.reshape(2, 3) for k, v in tree.items()}
    try:
        whole = run(params, grads) + run(params, nonfinite)
        parts = [run(half(params, h), [half(g, h) for g in grads])
                 + run(half(params, h), [half(g, h) for g in nonfinite]) for h in (0, 1)]
        # The same numbers as (2, 3) buffers: what reads the shapes (a mask such as
        # `lambda p: tree.map(lambda a: a.ndim > 1, p)`) decided by the packed buffers'.
        squares = run(as_2d(params), [as_2d(g) for g in grads])
        # Under a parameter's name, and inside a large buffer: what reads names (a decay
        # mask by path, multi_transform labels) or sizes (`a.size > 16`) saw the packed
        # keys ("float32") and sizes, and silently decayed or froze other parameters.
        k0 = keys[0]
        one = lambda tree, name: {name: tree[k0]}
        named = [run(one(params, name), [one(g, name) for g in grads]) for name in _NAMES]
        big = lambda v: np.concatenate([v, rs.randn(1 << 16).astype(np.float32)])
        large = run({k0: big(params[k0])}, [{k0: big(g[k0])} for g in grads])
    except TypeError as e:
        if "required keyword-only argument" in str(e):   # e.g. value= (reduce_on_plateau)
            raise ValueError(f"Pipeline: the optimizer's update needs extra arguments ({e}); "
                             f"train_step calls update(grads, state, params) only: use "
                             f"pipe.value_and_grad and apply it outside.") from e
        return
    except Exception:   # noqa: BLE001 - see the docstring
        return
    close = lambda got, want: np.allclose(got, want, rtol=1e-4, equal_nan=True, atol=1e-6 * (
        np.nanmax(np.abs(want)) if np.isfinite(want).any() else 1.0))
    for step, u in enumerate(whole):
        for k in keys:
            if step < len(squares) and not close(np.asarray(squares[step][k]).reshape(-1),
                                                 np.asarray(u[k])):
                raise ValueError(
                    "Pipeline: this optimizer acts by the parameters' shapes (e.g. a weight-"
                    "decay mask like lambda p: jax.tree.map(lambda a: a.ndim > 1, p)): in "
                    "train_step it sees packed buffers, not the model's shapes, and would "
                    "silently decay all or nothing; use pipe.value_and_grad and apply it to "
                    "pipe.unpack(grads) (per layer), or drop the mask.")
            got = np.concatenate([np.asarray(parts[0][step][k]), np.asarray(parts[1][step][k])])
            if not close(got, np.asarray(u[k])):
                raise ValueError(
                    "Pipeline: this optimizer does not act per element (e.g. "
                    "clip_by_global_norm, lamb/lars trust ratios, a step size estimated "
                    "from all parameters as in D-Adaptation or Prodigy, apply_if_finite): in "
                    "train_step it would see one device's packed buffers and silently "
                    "differ from the unsplit model; use pipe.value_and_grad and apply it "
                    "outside, to the packed gradients (global norms are the model's) or to "
                    "pipe.unpack(grads) (per layer).")
    for step in range(len(grads)):
        want = np.asarray(whole[step][k0])
        seen = [np.asarray(u[step][name]) for u, name in zip(named, _NAMES)]
        if not all(close(got, want) for got in seen) or not close(
                np.asarray(large[step][k0])[:want.size], want):
            raise ValueError(
                f"Pipeline: this optimizer acts by the parameters' names or sizes (e.g. a "
                f"weight-decay mask by path, multi_transform labels by name, a mask by "
                f"a.size): in train_step it sees packed buffers ({', '.join(keys)}), not the "
                f"model's variables, and would silently apply to other parameters; use "
                f"pipe.value_and_grad and apply it to pipe.unpack(grads) (per layer), or "
                f"drop the mask.")


def _check_on_device_buffers(optimizer, param_len: dict) -> None:
    """`optimizer` run abstractly on one device's packed buffers, as a U task runs it: a
    mask packed for all stages (`jaxhybrid.optim.weight_decay_mask`: [stages, length])
    failed inside the step ("cond branches must have equal output types"), and so did a
    state leaf that is neither a scalar nor parameter-shaped (its slots are placed like
    the parameter buffers)."""
    from jaxhybrid.pipeline.packing import dtype_of
    buffers = {k: jax.ShapeDtypeStruct((n,), dtype_of(k)) for k, n in param_len.items()}
    fix = ("train_step runs the optimizer on each device's packed buffers, not per-layer "
           "trees; use pipe.value_and_grad and apply the optimizer outside (as "
           "scripts/train.py does, with jaxhybrid.optim.weight_decay_mask for a mask)")
    try:
        state = jax.eval_shape(optimizer.init, buffers)
        updates, _ = jax.eval_shape(optimizer.update, buffers, state, buffers)
    except (TypeError, ValueError) as e:
        if "required keyword-only argument" in str(e):
            return                                     # check_per_element says it
        raise ValueError(f"Pipeline: the optimizer fails on one device's packed buffers "
                         f"({str(e).splitlines()[0][:160]}), e.g. a mask of the layers or "
                         f"one packed for all stages; {fix}.") from e
    got = {k: tuple(a.shape) for k, a in updates.items()} if isinstance(updates, dict) else {}
    if got != {k: (n,) for k, n in param_len.items()}:
        raise ValueError(f"Pipeline: the optimizer's updates on one device's packed buffers "
                         f"are not shaped like them ({got} for {dict(param_len)}), e.g. a "
                         f"mask packed for all stages; {fix}.")
    shapes = {(n,) for n in param_len.values()}
    odd = [a.shape for a in jax.tree.leaves(state) if a.ndim and a.shape not in shapes]
    if odd:
        raise ValueError(f"Pipeline: the optimizer keeps state that is neither per parameter "
                         f"nor a scalar (shapes {odd[:3]}); {fix}.")


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


def check_opt_state(opt_state, expected, shapes: bool = True) -> None:
    """A ValueError naming the fix when `opt_state` is not of this optimizer on this
    pipeline's packed parameters (None, another optimizer's, one of per-layer params, or
    with `shapes` one made for another split or mesh): else it failed inside optax or as
    a shard_map shape error."""
    fix = "; make it with pipe.init_optimizer(optimizer, variables)."
    if jax.tree.structure(opt_state) != jax.tree.structure(expected):
        raise ValueError("Pipeline.train_step: opt_state is not this optimizer's state on the "
                         "pipeline's packed parameters" + fix)
    for got, want in zip(jax.tree.leaves(opt_state), jax.tree.leaves(expected)):
        if shapes and tuple(jnp.shape(got)) != tuple(want.shape):
            raise ValueError(f"Pipeline.train_step: opt_state has a slot of shape "
                             f"{tuple(jnp.shape(got))} where this pipeline's packed parameters "
                             f"need {tuple(want.shape)} (made for another split or mesh?)" + fix)


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
                         f"(as jaxhybrid.optim.weight_decay_mask does, for an optimizer "
                         f"applied outside the pipeline) or make it a function of the packed "
                         f"tree.") from e
