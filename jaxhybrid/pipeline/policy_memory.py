"""What a stage run under a jax.checkpoint policy stashes, for the memory model.

`remat="dots_saveable"` (or any `jax.checkpoint_policies` name, per stage or for all)
runs a stage's layers inside one `jax.checkpoint(policy=...)`: its backward keeps what the
policy saves (the stage's input, and e.g. the outputs of its matmuls) and recomputes the
rest. Which values those are depends on the layers' programs, not on per-layer profiles,
so they are traced here as the runtime traces the stage (`StageProgram.apply` under
`jax.vjp`, the same `Residuals` split and `Derivation` of what is cheap to recompute;
abstractly, nothing runs) and handed to the memory model
(`plan.memory_model.spmd_memory(policy_kept=...)`).
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxhybrid.layers import init_layer
from jaxhybrid.pipeline.backward import Residuals
from jaxhybrid.pipeline.stages import StageProgram, merge_float, split_float
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


def policy_stage_kept(layers: Sequence, per_layer: Sequence[dict], x, start: int, stop: int,
                      policy: str) -> dict:
    """Bytes by dtype the engine stashes for stage [start, stop) run under `policy` on
    input `x` (abstract per-layer variables `per_layer`, all layers'): its kept
    residuals, less the parameters (re-read from the stage buffers) and what the backward
    recomputes cheaply, as `pipeline.layouts.stage_layouts` finds them. The first
    stage's input gets no gradient, as in the runtime."""
    program = StageProgram(index=0, start=start, stop=stop, stage_remat=policy)
    params = [dict(v).get("params", {}) for v in per_layer[start:stop]]
    state = [{c: t for c, t in dict(v).items() if c != "params"} for v in per_layer[start:stop]]
    residuals = Residuals()

    def run(p, st, x, key):
        xf, xi, mask = split_float(x)
        xdef = jax.tree.structure(x)

        def f(p, xf):
            y, _ = program.apply(layers, p, st, merge_float(xdef, mask, xf, xi), train=True,
                                 rng=key, microbatch=0)
            return split_float(y)[0]

        if start == 0:
            out, vjp_fn = jax.vjp(lambda p: f(p, xf), p)
        else:
            out, vjp_fn = jax.vjp(f, p, xf)
        return out, residuals.split(0, vjp_fn, p)

    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    closed, (out, kept) = jax.make_jaxpr(run, return_shape=True)(params, state, x, key)
    n = len(jax.tree.leaves(out))
    stash = residuals.derive(0, closed, closed.jaxpr.outvars[n:n + len(kept)]).stash
    return bytes_by_dtype([kept[i] for i in stash])


def policy_kept(layers: Sequence, sample, ranges: Sequence[tuple[int, int]],
                policies: Sequence[str | None]) -> list | None:
    """Per stage (`ranges`), its kept residuals under its policy (`policy_stage_kept`), or
    None for a stage without one; None when no stage has one."""
    if not any(policies):
        return None
    per_layer, inputs = layer_chain(layers, sample)
    return [policy_stage_kept(layers, per_layer, inputs[a], a, b, name) if name else None
            for (a, b), name in zip(ranges, policies)]
