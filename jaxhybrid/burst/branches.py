"""Per-branch costs of layers made of parallel branches (Inception blocks), for the burst
planner's branch mode (`jaxhybrid.plan.burst.plan_burst(branches=...)`).

A layer whose output is one `concatenate` of several operands has parallel branches: the
operands. Tracing the layer's forward to a jaxpr (shapes only, nothing computed), each
branch is the backward cone of its operand; its FLOPs are those of the matmuls and
convolutions in the cone (`models.spec._jaxpr_flops`, the model zoo's counter), its
parameters the "params" leaves the cone reads, its bytes the values it writes. Work
shared by several branches (e.g. a pool before the block) is counted in none: it has no
matmul FLOPs in Inception, and its bytes are small.
"""
from __future__ import annotations

import types
from typing import Sequence

import jax
import numpy as np
from jax.extend.core import Literal

from jaxhybrid.layers import apply_layer
from jaxhybrid.models.spec import _abstract, _jaxpr_flops, abstract_variables
from jaxhybrid.plan.costs import LayerCost

F32 = 4


def _literal(v) -> bool:
    return isinstance(v, Literal)


def _size(aval) -> int:
    return int(np.prod(aval.shape)) if aval.shape else 1


def branch_costs(layer, variables, x, name: str = "") -> list[LayerCost] | None:
    """LayerCosts (at the batch of `x`) of the layer's parallel branches, or None if its
    output is not a concatenation of several values."""
    closed = jax.make_jaxpr(lambda v, h: apply_layer(layer, v, h, train=False)[0])(variables, x)
    jaxpr = closed.jaxpr
    producer = {o: e for e in jaxpr.eqns for o in e.outvars}
    out = producer.get(jaxpr.outvars[0]) if len(jaxpr.outvars) == 1 else None
    if out is None or out.primitive.name != "concatenate" or len(out.invars) < 2:
        return None
    leaves = jax.tree_util.tree_flatten_with_path((variables, x))[0]
    is_param = {v: "params" in jax.tree_util.keystr(p)
                for v, (p, _) in zip(jaxpr.invars, leaves)}
    batch = int(np.shape(jax.tree.leaves(x)[0])[0])
    in_bytes = sum(_size(v.aval) for v, (p, _) in zip(jaxpr.invars, leaves)
                   if "params" not in jax.tree_util.keystr(p) and p and p[0].idx == 1) * F32
    cones = []
    for operand in out.invars:
        cone, stack = [], [operand]
        seen = set()
        while stack:
            v = stack.pop()
            e = producer.get(v) if not _literal(v) else None
            if e is None or id(e) in seen:
                continue
            seen.add(id(e))
            cone.append(e)
            stack.extend(e.invars)
        cones.append((operand, cone))
    counts = {}
    for _, cone in cones:
        for e in cone:
            counts[id(e)] = counts.get(id(e), 0) + 1
    result = []
    for k, (operand, cone) in enumerate(cones):
        own = [e for e in cone if counts[id(e)] == 1]
        flops = _jaxpr_flops(types.SimpleNamespace(eqns=own))
        params = {v for e in own for v in e.invars
                  if not _literal(v) and is_param.get(v, False)}
        pcount = sum(_size(v.aval) for v in params)
        act = sum(_size(o.aval) for e in own for o in e.outvars) * F32
        result.append(LayerCost(
            name=f"{name}/branch{k}", batch_size=batch, fwd_flops=flops, bwd_flops=2 * flops,
            fwd_bytes=2 * act + pcount * F32, bwd_bytes=4 * act + 3 * pcount * F32,
            param_bytes=pcount * F32, param_count=pcount, in_bytes=in_bytes,
            out_bytes=_size(operand.aval) * F32, saved_bytes=act, saved_bytes_remat=in_bytes,
            fwd_time=0.0, bwd_time=0.0))
    return result


def model_branch_costs(layers: Sequence, sample_inputs, names: Sequence[str] | None = None
                       ) -> dict[int, list[LayerCost]]:
    """{layer index: branch costs} for every layer of the model with parallel branches."""
    variables = abstract_variables(layers, sample_inputs)
    h = _abstract(sample_inputs)
    out = {}
    for l, (layer, v) in enumerate(zip(layers, variables)):
        found = branch_costs(layer, v, h, names[l] if names else f"layer{l}")
        if found:
            out[l] = found
        h = jax.eval_shape(lambda vv, hh, _layer=layer: apply_layer(_layer, vv, hh, train=False)[0],
                           v, h)
    return out
