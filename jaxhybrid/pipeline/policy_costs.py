"""What a stage run under a jax.checkpoint policy stashes and runs again, for the plan.

`remat="dots_saveable"` (or any `jax.checkpoint_policies` name, per stage or for all)
runs a stage's layers inside one `jax.checkpoint(policy=...)`: its backward keeps what the
policy saves (the stage's input, and e.g. the outputs of its matmuls) and recomputes the
rest. Which values those are depends on the layers' programs, not on per-layer profiles,
so they are traced here by the runtime's own stage forward (`layouts.stage_forward`:
`StageProgram.apply` under `jax.vjp`, the `Residuals` split, then the `Derivation` of what
is cheap to recompute; abstractly, nothing runs) and handed to the memory model
(`plan.memory_model.spmd_memory(policy_kept=...)`). What its backward runs again is
the FLOPs of the stage's forward and backward under the policy less those with nothing
recomputed, over the forward's (XLA's cost analysis of the lowered programs: compiled as
one program, XLA would share the recomputation with the forward, as the pipeline, whose
forward and backward run in different ticks, cannot), handed to the plan's stage times
(`plan.make_plan(policy_recompute=...)`).
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxhybrid.layers import init_layer
from jaxhybrid.pipeline.backward import Residuals
from jaxhybrid.pipeline.layouts import stage_forward
from jaxhybrid.pipeline.runtime import Stage
from jaxhybrid.pipeline.stages import StageProgram, merge_float, split_float
from jaxhybrid.plan.costs import lowered_cost
from jaxhybrid.plan.residuals import bytes_by_dtype


def layer_chain(layers: Sequence, sample) -> tuple[list, list]:
    """(per layer its variables, per layer its input; then the model's output), all as
    ShapeDtypeStructs, from `sample` (one microbatch) in training mode."""
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), sample)
    per_layer, inputs = [], [x]
    for i, layer in enumerate(layers):
        v, x = jax.eval_shape(functools.partial(init_layer, layer, train=True),
                              jax.random.key(i), x)
        per_layer.append(v)
        inputs.append(x)
    return per_layer, inputs


def _stage_variables(per_layer: Sequence[dict], start: int, stop: int) -> tuple[list, list]:
    """(per layer its params, per layer its other collections) of layers [start, stop)."""
    params = [dict(v).get("params", {}) for v in per_layer[start:stop]]
    state = [{c: t for c, t in dict(v).items() if c != "params"} for v in per_layer[start:stop]]
    return params, state


_KEY = jax.ShapeDtypeStruct((2,), jnp.uint32)


def policy_stage_kept(layers: Sequence, per_layer: Sequence[dict], x, start: int, stop: int,
                      policy: str) -> dict:
    """Bytes by dtype the engine stashes for stage [start, stop) run under `policy` on
    input `x` (abstract per-layer variables `per_layer`, all layers'): its kept
    residuals, less the parameters (re-read from the stage buffers) and what the backward
    recomputes cheaply, as `pipeline.layouts.stage_layouts` finds them (the first stage's
    input gets no gradient; the loss's residuals are the memory model's to add)."""
    program = StageProgram(index=0, start=start, stop=stop, stage_remat=policy)
    params, state = _stage_variables(per_layer, start, stop)
    stage = Stage(apply=functools.partial(program.apply, layers), params=None, state={},
                  abstract_params=params, abstract_state=state)
    residuals = Residuals()

    def run(p, st, x, key):
        out, kept, _, _ = stage_forward(stage, start, False, p, st, x, None, key, 0, None, 1,
                                        True, residuals)
        return out, kept

    closed, (out, kept) = jax.make_jaxpr(run, return_shape=True)(params, state, x, _KEY)
    n = len(jax.tree.leaves(out))
    stash = residuals.derive(start, closed, closed.jaxpr.outvars[n:n + len(kept)]).stash
    return bytes_by_dtype([kept[i] for i in stash])


def _stage_flops(layers: Sequence, params, state, x, start: int, stop: int, remat: str,
                 backward: bool) -> float:
    """FLOPs of the lowered stage [start, stop) under `remat` (`plan.costs.lowered_cost`;
    on GPUs, where jax analyses no lowered module, every stage was priced as recomputing
    nothing): its forward, or its forward and backward (w.r.t. its float parameters and
    inputs) with the forward's output kept, as the pipeline sends it on (dropped, the
    forward was dead code and a stage recomputed whole cost what one recomputing nothing
    does)."""
    program = StageProgram(index=0, start=start, stop=stop, stage_remat=remat)
    floats, others, mask = split_float((params, x))
    treedef = jax.tree.structure((params, x))

    def forward(fl, rest, st, key):
        p, xx = merge_float(treedef, mask, fl, rest)
        out, _ = program.apply(layers, p, st, xx, train=True, rng=key, microbatch=0)
        return split_float(out)[0]

    def forward_backward(fl, rest, st, key):
        out, pull = jax.vjp(lambda f: forward(f, rest, st, key), fl)
        return out, pull([jnp.ones_like(o) for o in out])

    return lowered_cost(forward_backward if backward else forward, floats, others, state,
                        _KEY)[0]


def policy_stage_recompute(layers: Sequence, per_layer: Sequence[dict], x, start: int,
                           stop: int, policy: str) -> float:
    """The share of stage [start, stop)'s forward that its backward runs again under
    `policy` (0: nothing, 1: all of it, as remat="full"): the FLOPs its forward and
    backward take under the policy less those with nothing recomputed, over its
    forward's (elementwise work counted as XLA counts it, a FLOP an element)."""
    params, state = _stage_variables(per_layer, start, stop)
    fwd = _stage_flops(layers, params, state, x, start, stop, "none", False)
    if fwd <= 0:
        return 0.0
    run = functools.partial(_stage_flops, layers, params, state, x, start, stop, backward=True)
    return float(min(max((run(policy) - run("none")) / fwd, 0.0), 1.0))


def policy_costs(layers: Sequence, sample, ranges: Sequence[tuple[int, int]],
                 policies: Sequence[str | None]) -> tuple[list | None, list | None]:
    """Per stage (`ranges`), (its kept residuals under its policy, `policy_stage_kept`;
    the share of its forward it runs again, `policy_stage_recompute`), each None for a
    stage without a policy; (None, None) when no stage has one."""
    if not any(policies):
        return None, None
    per_layer, inputs = layer_chain(layers, sample)
    kept = [policy_stage_kept(layers, per_layer, inputs[a], a, b, name) if name else None
            for (a, b), name in zip(ranges, policies)]
    again = [policy_stage_recompute(layers, per_layer, inputs[a], a, b, name) if name else None
             for (a, b), name in zip(ranges, policies)]
    return kept, again
