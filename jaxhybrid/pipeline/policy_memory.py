"""What a stage run under a jax.checkpoint policy stashes, for the memory model.

`remat="dots_saveable"` (or any `jax.checkpoint_policies` name, per stage or for all)
runs a stage's layers inside one `jax.checkpoint(policy=...)`: its backward keeps what the
policy saves (the stage's input, and e.g. the outputs of its matmuls) and recomputes the
rest. Which values those are depends on the layers' programs, not on per-layer profiles,
so they are traced here by the runtime's own stage forward (`layouts.stage_forward`:
`StageProgram.apply` under `jax.vjp`, the `Residuals` split, then the `Derivation` of what
is cheap to recompute; abstractly, nothing runs) and handed to the memory model
(`plan.memory_model.spmd_memory(policy_kept=...)`).
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
from jaxhybrid.pipeline.stages import StageProgram
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
    recomputes cheaply, as `pipeline.layouts.stage_layouts` finds them (the first stage's
    input gets no gradient; the loss's residuals are the memory model's to add)."""
    program = StageProgram(index=0, start=start, stop=stop, stage_remat=policy)
    params = [dict(v).get("params", {}) for v in per_layer[start:stop]]
    state = [{c: t for c, t in dict(v).items() if c != "params"} for v in per_layer[start:stop]]
    stage = Stage(apply=functools.partial(program.apply, layers), params=None, state={},
                  abstract_params=params, abstract_state=state)
    residuals = Residuals()

    def run(p, st, x, key):
        out, kept, _, _ = stage_forward(stage, start, False, p, st, x, None, key, 0, None, 1,
                                        True, residuals)
        return out, kept

    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    closed, (out, kept) = jax.make_jaxpr(run, return_shape=True)(params, state, x, key)
    n = len(jax.tree.leaves(out))
    stash = residuals.derive(start, closed, closed.jaxpr.outvars[n:n + len(kept)]).stash
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
