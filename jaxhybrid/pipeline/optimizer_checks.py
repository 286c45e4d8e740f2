"""Whether an optax optimizer may run inside the pipeline, as `train_step`'s U tasks run it.

Each U task runs the optimizer on one device's packed buffers ({dtype: [length]}, with
zero=1 on one data shard of them), not on the model's per-layer tree. An optimizer that
looks beyond one element gives other numbers there than on the whole model, silently: a
global-norm clip, a per-leaf trust ratio (lamb, lars), a step size estimated from all
parameters (D-Adaptation, Prodigy), a skip decided by all gradients (apply_if_finite), a
mask or label by the parameters' shapes, names or sizes. `check_per_element` probes the
optimizer on small numpy trees and refuses such an optimizer, naming the fix
(`pipe.value_and_grad` and the optimizer outside, on the packed or unpacked gradients).

`check_layer_by_layer` is the burst executor's narrower check: there each device runs
the optimizer on its copy of the model's own tree, with zero gradients for the layers it
skips, so only an update that reads other leaves' gradients is refused.
"""
from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import numpy as np

# Parameter names a name-based mask or label function tells apart.
_NAMES = ("kernel", "bias", "scale", "embedding")
_STEPS = 5   # finite updates probed (adaptive step sizes drift apart over a few)
# An optimizer that emits no update for a while (optax.MultiSteps accumulating k steps)
# is probed over twice as many steps until it does, up to this many.
_MAX_STEPS = 160

_NOT_PER_ELEMENT = (
    "Pipeline: this optimizer does not act per element (e.g. clip_by_global_norm, "
    "lamb/lars trust ratios, a step size estimated from all parameters as in D-Adaptation "
    "or Prodigy, apply_if_finite): in train_step it would see one device's packed buffers "
    "and silently differ from the unsplit model; use pipe.value_and_grad and apply it "
    "outside, to the packed gradients (global norms are the model's) or to "
    "pipe.unpack(grads) (per layer).")
_UNCHECKED = (
    "Pipeline: the optimizer was built from traced values (e.g. a learning rate traced "
    "by jax.jit, vmap or grad), so train_step cannot check that it acts per element: a "
    "global-norm clip, lamb or a mask by names or sizes would silently differ from the "
    "unsplit model. Build it outside the jit (a traced learning rate can go through "
    "optax.inject_hyperparams' state), or use pipe.value_and_grad and apply it outside.")
# What the probe meets when the optimizer holds traced values.
_TRACED = (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError,
           jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError)
_BY_SHAPES = (
    "Pipeline: this optimizer acts by the parameters' shapes (e.g. a weight-decay mask like "
    "lambda p: jax.tree.map(lambda a: a.ndim > 1, p)): in train_step it sees packed "
    "buffers, not the model's shapes, and would silently decay all or nothing; use "
    "pipe.value_and_grad and apply it to pipe.unpack(grads) (per layer), or drop the mask.")


def check_per_element(optimizer, param_len: dict) -> None:
    """A ValueError unless `optimizer` acts element by element. It is run abstractly on
    one device's buffers, then probed on numbers: two halves of the packed keys against
    the whole over five updates (the first with one half 1e6 times larger, so that any
    clip bites) and once with a non-finite gradient in one half; the same numbers as 2-D
    buffers, under parameter names and inside a large buffer. A probe the optimizer
    cannot run on these small arrays (its own checks) is left to the real call; one
    built from traced values (inside jax.jit) cannot be probed, and a warning says so."""
    require_transformation(optimizer, "Pipeline",
                           "; for gradients alone use pipe.value_and_grad(loss_fn)")
    _check_on_device_buffers(optimizer, param_len)
    keys = sorted(param_len)
    try:
        runs = _probe_runs(optimizer, keys)
    except _TRACED:   # (TypeErrors too)
        runs = None
    except TypeError as e:
        if "required keyword-only argument" in str(e):   # e.g. value= (reduce_on_plateau)
            raise ValueError(f"Pipeline: the optimizer's update needs extra arguments ({e}); "
                             f"train_step calls update(grads, state, params) only: use "
                             f"pipe.value_and_grad and apply it outside.") from e
        return
    except Exception:   # noqa: BLE001 - see the docstring
        return
    if runs is None or any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(runs)):
        # Built from traced values (a learning rate passed into jax.jit, a vmapped sweep,
        # a hypergradient): the probe has no numbers to compare. A global-norm clip built
        # so ran per device and silently differed from the unsplit model.
        warnings.warn(_UNCHECKED, stacklevel=3)
        return
    _check_elementwise(runs, keys)
    _check_names_and_sizes(runs, keys)


def require_transformation(optimizer, who: str, hint: str = "") -> None:
    """A ValueError from `who` unless `optimizer` has optax's init and update."""
    if not all(callable(getattr(optimizer, f, None)) for f in ("init", "update")):
        raise ValueError(f"{who}: optimizer must be an optax.GradientTransformation (e.g. "
                         f"optax.adam(1e-3)), got {type(optimizer).__name__}{hint}.")


class _Jitted(NamedTuple):
    init: Any
    update: Any


def _run(optimizer, params: dict, grads: list) -> list:
    """The updates of `grads` applied in turn from a fresh state."""
    state, out = optimizer.init(params), []
    for g in grads:
        u, state = optimizer.update(g, state, params)
        out.append(u)
    return out


def _probe_runs(optimizer, keys: list) -> dict:
    """The probe's updates: "whole" (every key, 6 elements), "parts" (its halves apart),
    "squares" (as 2-D buffers), "named" (the first key under each of _NAMES), "large"
    (the first key at the start of a large buffer)."""
    rs = np.random.RandomState(0)
    draw = lambda *scale: {k: np.concatenate([rs.randn(3) * s for s in scale]).astype(np.float32)
                           for k in keys}
    params = draw(1, 1)
    grads = [draw(1e6, 1), draw(1e-3, 1e-3), draw(1, 1), draw(0.1, 3), draw(1, 1)][:_STEPS]
    # MultiSteps(lamb, 8) emitted zeros in all five steps, and the probe passed it. Such
    # an optimizer is probed over more steps, jitted (eagerly, MultiSteps took 17 s).
    emits = lambda updates: any(np.any(np.asarray(a) != 0) for a in jax.tree.leaves(updates))
    finite = _run(optimizer, params, grads)
    if not emits(finite):
        optimizer = _Jitted(optimizer.init, jax.jit(optimizer.update))
        while len(grads) < _MAX_STEPS and not emits(finite):
            grads += [draw(10.0 ** rs.randint(-2, 3), 1) for _ in grads]
            finite = _run(optimizer, params, grads)
    nonfinite = [draw(1, 1), draw(1, 1)]
    for v in nonfinite[1].values():
        v[4] = np.nan
    half = lambda tree, h: {k: v[3 * h:3 * h + 3] for k, v in tree.items()}
    as_2d = lambda tree: {k: v.reshape(2, 3) for k, v in tree.items()}
    k0 = keys[0]
    one = lambda tree, name: {name: tree[k0]}
    big = lambda v: np.concatenate([v, rs.randn(1 << 16).astype(np.float32)])
    return dict(
        whole=finite + _run(optimizer, params, nonfinite),
        parts=[_run(optimizer, half(params, h), [half(g, h) for g in grads])
               + _run(optimizer, half(params, h), [half(g, h) for g in nonfinite])
               for h in (0, 1)],
        # What reads the shapes (a mask such as `lambda p: tree.map(lambda a: a.ndim > 1,
        # p)`) decided by the packed buffers'.
        squares=_run(optimizer, as_2d(params), [as_2d(g) for g in grads]),
        # What reads names (a decay mask by path, multi_transform labels) or sizes
        # (`a.size > 16`) saw the packed keys ("float32") and sizes, and silently decayed
        # or froze other parameters.
        named=[_run(optimizer, one(params, name), [one(g, name) for g in grads])
               for name in _NAMES],
        large=_run(optimizer, {k0: big(params[k0])}, [{k0: big(g[k0])} for g in grads]))


def _close(got, want) -> bool:
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    return np.allclose(got, want, rtol=1e-4, equal_nan=True, atol=1e-6 * (
        np.nanmax(np.abs(want)) if np.isfinite(want).any() else 1.0))


def _check_elementwise(runs: dict, keys: list) -> None:
    whole, parts, squares = runs["whole"], runs["parts"], runs["squares"]
    for step, u in enumerate(whole):
        for k in keys:
            if step < len(squares) and not _close(squares[step][k], u[k]):
                raise ValueError(_BY_SHAPES)
            got = np.concatenate([np.asarray(parts[0][step][k]), np.asarray(parts[1][step][k])])
            if not _close(got, u[k]):
                raise ValueError(_NOT_PER_ELEMENT)


def _check_names_and_sizes(runs: dict, keys: list) -> None:
    k0 = keys[0]
    for step in range(len(runs["large"])):
        want = np.asarray(runs["whole"][step][k0])
        seen = [u[step][name] for u, name in zip(runs["named"], _NAMES)]
        if not all(_close(got, want) for got in seen) or not _close(
                np.asarray(runs["large"][step][k0])[:want.size], want):
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
           "scripts/train.py does; a weight-decay mask: jaxhybrid.optim.masked_weight_decay("
           "rate, jaxhybrid.optim.weight_decay_mask(pipe, variables)) in an optax.chain)")
    try:
        state = jax.eval_shape(optimizer.init, buffers)
        updates, new_state = jax.eval_shape(optimizer.update, buffers, state, buffers)
    except Exception as e:  # noqa: BLE001 - lookahead: AttributeError "no attribute 'fast'"
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
    changed = [(a.dtype, b.dtype) for a, b in zip(jax.tree.leaves(state),
                                                   jax.tree.leaves(new_state)) if a.dtype != b.dtype]
    if changed:   # e.g. adam's moments of integer parameters: zeros_like, then floats
        raise ValueError(f"Pipeline: the optimizer's update changes its state's dtypes "
                         f"({changed[0][0]} -> {changed[0][1]}) on one device's packed buffers "
                         f"({', '.join(param_len)}), which a U task cannot carry: keep integer "
                         f"values out of \"params\" (another collection), or {fix}.")
    shapes = {(n,) for n in param_len.values()}
    odd = [a.shape for a in jax.tree.leaves(state) if a.ndim and a.shape not in shapes]
    if odd:
        raise ValueError(f"Pipeline: the optimizer keeps state that is neither per parameter "
                         f"nor a scalar (shapes {odd[:3]}), e.g. factored or matrix-shaped "
                         f"state (adafactor, muon), which packed 1-D buffers do not have; "
                         f"{fix}.")


def check_layer_by_layer(optimizer, who: str) -> None:
    """A ValueError from `who` where `optimizer`'s update of one leaf depends on the
    gradients of others (clip_by_global_norm, apply_if_finite, a step size from all
    parameters). A burst step runs the optimizer on every device's copy of the model,
    and a device that skips a layer holds zero gradients for it: such an optimizer
    moved device 1's copy of a layer 6e-4 from device 0's in one step, silently. Per
    leaf trust ratios (lamb) and masks by name or shape see the model's own tree there
    and are fine. Probed on two leaves, the other's gradients given or zero, over
    `_STEPS` updates; a probe the optimizer cannot run is left to the real call."""
    require_transformation(optimizer, who)
    rs = np.random.RandomState(1)
    draw = lambda: {"kernel": rs.randn(6).astype(np.float32),  # noqa: E731
                    "other": rs.randn(6).astype(np.float32)}
    params, grads = draw(), [draw() for _ in range(_STEPS)]
    grads[0]["other"] *= 1e6   # a clip by the norm of all gradients bites here
    grads[2]["other"][0] = np.nan   # a skip decided by all gradients (apply_if_finite) here
    alone = [{"kernel": g["kernel"], "other": np.zeros(6, np.float32)} for g in grads]
    try:
        with_other, without = _run(optimizer, params, grads), _run(optimizer, params, alone)
    except Exception:   # noqa: BLE001 - see the docstring
        return
    if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((with_other, without))):
        return
    if not all(_close(a["kernel"], b["kernel"]) for a, b in zip(with_other, without)):
        raise ValueError(
            f"{who}: this optimizer's update of a layer depends on other layers' gradients "
            f"(e.g. clip_by_global_norm, apply_if_finite), and devices that skip a layer "
            f"hold zero gradients for it, so their copies would drift from device 0's; use "
            f"burst.value_and_grad and apply the optimizer to device 0's gradients "
            f"(burst.first_copy(grads)), or an optimizer that acts layer by layer.")
