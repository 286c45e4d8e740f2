"""What a tensor-parallel "model" degree T does to a layer's costs (the planner's side of
`jaxhybrid.tensor_parallel`).

Which parts of a layer are split over "model" is not listed per model: `profile` reads
it from the layer itself (`model_terms`):

* parameters: the leaves the layer builds at 1 / t of one dimension at degree t
  (`sharding.layer_split_dims`, on its degree-1 input; names alone split nothing) ->
  `model_param_bytes`;
* residuals, matmul FLOPs and collectives: the layer is traced once more, abstractly, at
  degree 2 (`tensor_parallel.degree(2)`, "model" bound by `make_jaxpr`; 3, 5 or 7 when
  its split dimensions are odd), which is how the pipeline runs it. With R replicated
  and S split bytes, R + S at degree 1 and R + S / t at degree t give S = t / (t - 1) x
  (difference): `model_saved_bytes`, and likewise the split fraction of the forward's
  dot/conv FLOPs (`model_flops_fraction`). The collectives over "model" in that trace's
  forward and backward jaxprs give the bytes all-reduced per device (`model_fwd_comm_bytes`, `model_bwd_comm_bytes`; a psum counts its operand, an
  all-gather half its output). A Megatron GPT block: 2 all-reduces of its [B, T, D]
  activation forward (after attention and after the MLP) and 2 backward
  (`model_fwd_collectives`, `model_bwd_collectives` count them, for their latency).

A layer with nothing split over "model" (embeddings of odd vocabularies, convolutions,
LSTMs) runs replicated inside its model group: all its terms are 0 and T changes
nothing of it. `local_cost(c, T)` is one device's share of a layer at degree T
(split parts / T, the rest whole); the memory model (`memory_model.spmd_memory(model=T)`) and
the step-time model (`hybrid`) read layers through it, and `model_comm_time` prices the
collectives on the model group's links.
"""
from __future__ import annotations

import dataclasses
import math


# Degrees tried for the abstract trace, smallest first (a layer whose split dimensions
# no small prime divides keeps only its parameter split).
_TRACE_DEGREES = (2, 3, 5, 7)


def _nbytes(tree) -> int:
    from jaxhybrid.plan.costs import _nbytes as nb
    return nb(tree)


def _collectives(jaxpr) -> tuple[float, int]:
    """(bytes all-reduced over "model" per device, number of collectives) in `jaxpr`
    (psum: its operand bytes; all_gather: half its output's, a ring moving (T-1)/T of it
    once instead of twice)."""
    from jaxhybrid.models.spec import _subjaxprs
    total, count = 0.0, 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
        axes = axes if isinstance(axes, (tuple, list)) else (axes,)
        size = lambda vs: sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in vs)  # noqa: E731
        if "model" in axes and name.startswith("psum"):
            total, count = total + size(eqn.invars), count + 1
        elif "model" in axes and name.startswith("all_gather"):
            total, count = total + size(eqn.outvars) / 2, count + 1
        else:
            for b, n in map(_collectives, _subjaxprs(eqn.params)):
                total, count = total + b, count + n
    return total, count


def _traced(layer, x, drop, diff_inputs: bool, train: bool):
    """At the current degree: (residual bytes, forward dot/conv FLOPs, forward and
    backward bytes all-reduced over "model") of the layer on abstract input x."""
    import jax

    from jaxhybrid import tensor_parallel
    from jaxhybrid.layers import init_layer
    from jaxhybrid.models.spec import _jaxpr_flops
    from jaxhybrid.plan.costs import _forward_vjp
    from jaxhybrid.plan.residuals import stashed_bytes

    lvars = tensor_parallel.eval_shape(
        lambda k, xx: init_layer(layer, k, xx, train=train)[0], jax.random.key(0), x)
    params = lvars.get("params", {})
    state = {k: v for k, v in lvars.items() if k != "params"}
    forward_vjp, xf, leaves, traced = _forward_vjp(layer, x, drop, diff_inputs, train)
    fwd = tensor_parallel.make_jaxpr(forward_vjp)(params, xf, state, leaves)
    yf, vjp_fn = tensor_parallel.eval_shape(forward_vjp, params, xf, state, leaves)
    bwd = (0.0, 0)
    if yf:
        bwd = _collectives(tensor_parallel.make_jaxpr(lambda vf, c: vf(c))(vjp_fn, yf).jaxpr)
    stashed = stashed_bytes(fwd, len(jax.tree.leaves(yf)), traced["kept"])["bytes"]
    return float(stashed), _jaxpr_flops(fwd.jaxpr), _collectives(fwd.jaxpr), bwd


def model_terms(layer, x, drop, diff_inputs: bool, *, train: bool, saved_bytes: int,
                boxed_params=None, asks_degree: bool = False) -> dict:
    """The LayerCost model fields of `layer` on input x (see the module docstring); all 0
    for a layer with no parameter split over "model". `boxed_params`: the layer's boxed
    abstract "params" when the caller has traced its initialiser already, and
    `asks_degree` whether the layer asked for the model degree in the caller's traces
    (`tensor_parallel.watch`: written for tensor parallelism whatever its names)."""
    import flax.linen as nn
    import jax

    from jaxhybrid import tensor_parallel
    from jaxhybrid.sharding import layer_split_dims

    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
    boxed, dims = layer_split_dims(layer, x, train=train, boxed_params=boxed_params,
                                   asks_degree=asks_degree)
    split = sum(_nbytes(leaf) for leaf, d in zip(jax.tree.leaves(nn.meta.unbox(boxed)),
                                                  jax.tree.leaves(dims)) if d >= 0)
    zero = dict(model_param_bytes=0, model_saved_bytes=0, model_flops_fraction=0.0,
                model_fwd_comm_bytes=0, model_bwd_comm_bytes=0, model_fwd_collectives=0,
                model_bwd_collectives=0)
    if not split:
        return zero
    _, flops1, _, _ = _traced(layer, x, drop, diff_inputs, train)
    for t in _TRACE_DEGREES:    # the smallest degree the layer's split dims allow
        try:
            with tensor_parallel.degree(t):
                saved_t, flops_t, fwd_comm, bwd_comm = _traced(layer, x, drop, diff_inputs, train)
        except ValueError:      # e.g. 3 heads at degree 2
            continue
        grow = t / (t - 1)      # R + S at degree 1, R + S / t at degree t
        return dict(model_param_bytes=int(split),
                    model_saved_bytes=int(min(max(grow * (saved_bytes - saved_t), 0), saved_bytes)),
                    model_flops_fraction=float(min(max(grow * (flops1 - flops_t) / flops1, 0.0),
                                                   1.0)) if flops1 else 0.0,
                    model_fwd_comm_bytes=int(fwd_comm[0]), model_bwd_comm_bytes=int(bwd_comm[0]),
                    model_fwd_collectives=fwd_comm[1], model_bwd_collectives=bwd_comm[1])
    return {**zero, "model_param_bytes": int(split)}   # no degree fits: parameters only


def local_cost(c, model: int):
    """One device's share of layer cost `c` at model degree `model`: split parameters,
    residuals and FLOPs (and so times and bytes accessed) / model, the rest whole."""
    if model == 1:
        return c
    if model < 1:
        raise ValueError(f"local_cost: model={model} must be >= 1.")
    off = 1.0 - 1.0 / model
    frac = c.model_param_bytes / c.param_bytes if c.param_bytes else 0.0
    compute = 1.0 - c.model_flops_fraction * off
    return dataclasses.replace(
        c, param_bytes=int(round(c.param_bytes - c.model_param_bytes * off)),
        param_count=int(round(c.param_count * (1.0 - frac * off))),
        saved_bytes=int(round(c.saved_bytes - c.model_saved_bytes * off)),
        **{f: getattr(c, f) * compute for f in ("fwd_flops", "bwd_flops", "fwd_bytes",
                                                 "bwd_bytes", "fwd_time", "bwd_time")})


def model_comm_time(nbytes: float, model: int, bandwidth: float, latency: float,
                    collectives: int = 1) -> float:
    """Seconds of `collectives` ring all-reduces over `model` devices moving `nbytes` per
    device in all: 2 (T-1)/T x bytes / bandwidth + 2 (T-1) latency steps each."""
    if model <= 1 or not nbytes:
        return 0.0
    return 2.0 * (model - 1) / model * nbytes / bandwidth + collectives * 2 * (model - 1) * latency
