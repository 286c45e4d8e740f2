"""Layers -> pipeline stages: boundaries, remat choices and the stage forward function."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxhybrid.boundaries import check_boundaries, even_boundaries, stage_ranges  # noqa: F401 (re-exported)
from jaxhybrid.checks import differentiable, is_float  # noqa: F401 (re-exported)
from jaxhybrid.layers import apply_layer, layer_rng, scalar_loss

PyTree = Any

# A stage's remat setting: "none" | "full" | a jax.checkpoint_policies name.
STAGE_REMAT_CHOICES = ("none", "full")


def _is_policy(policy) -> bool:
    """A policy answers whether a primitive's output is saved; a policy factory
    (save_only_these_names, offload_dot_with_no_batch_dims, ...) makes one from names."""
    try:
        return isinstance(policy(jax.lax.add_p), bool)
    except TypeError:
        return False


def _policy(name: str):
    if name == "auto":
        raise ValueError("remat 'auto' is for the whole pipeline (remat='auto' with a "
                         "memory_budget: the planner chooses every stage's recompute), not "
                         "for one stage; per stage give 'none', 'full', a "
                         "jax.checkpoint_policies name or that stage's bools, one per layer.")
    policy = getattr(jax.checkpoint_policies, name, None) if isinstance(name, str) else None
    if policy is None or name.startswith("_") or not _is_policy(policy):
        names = [n for n in dir(jax.checkpoint_policies)
                 if not n.startswith("_") and _is_policy(getattr(jax.checkpoint_policies, n))]
        made = (f" ({name} makes a policy from names: apply jax.checkpoint with it inside "
                f"the layer)" if policy is not None else "")
        raise ValueError(f"remat {name!r} is neither 'none', 'full', 'auto' nor a "
                         f"jax.checkpoint_policies policy{made}; the policies: "
                         f"{', '.join(names)}.")
    return policy


def policy_by_name(remat):
    """`remat` with a jax.checkpoint_policies policy given as the object
    (`jax.checkpoint_policies.dots_saveable`) replaced by its name, as a stage's setting
    and a plan hold it; anything else unchanged. A policy of the user's own (made from
    names, or a function) cannot be saved in a plan: refused, naming what to do."""
    if isinstance(remat, (str, bool, np.bool_)) or not callable(remat):
        return remat
    names = [n for n in dir(jax.checkpoint_policies)
             if not n.startswith("_") and getattr(jax.checkpoint_policies, n) is remat]
    if names:   # the documented name before an old alias (checkpoint_dots = dots_saveable)
        return min(names, key=lambda n: (n.startswith("checkpoint_"), n))
    raise ValueError(f"remat {remat!r} is a policy the pipeline cannot name (a plan saves "
                     f"a stage's policy by its jax.checkpoint_policies name); give a name "
                     f"such as 'dots_saveable', or apply jax.checkpoint with your policy "
                     f"inside the layer.")


def check_stage_remat(choice: str) -> str:
    if choice not in STAGE_REMAT_CHOICES:
        _policy(choice)
    return choice


def is_layer_flags(r) -> bool:
    """Whether a per-stage remat entry is that stage's per-layer recompute flags."""
    return isinstance(r, (list, tuple)) and all(isinstance(f, (bool, np.bool_)) for f in r)


@dataclasses.dataclass(frozen=True)
class StageProgram:
    """How one stage computes: its layers [start, stop), a stage-wide remat setting, and
    per-layer recompute flags (a plan's choice)."""
    index: int
    start: int
    stop: int
    stage_remat: str = "none"
    layer_remat: tuple = ()          # bool per layer of the stage

    def apply(self, layers: Sequence, params: list, state: list, x: PyTree, *, train: bool,
              rng: jax.Array | None, microbatch) -> tuple[PyTree, list]:
        """Runs the stage's layers. params/state: per-layer lists (state: dict of the
        layer's non-params collections). Returns (output, new per-layer state)."""

        def run(params, state, x, rng):
            new_state = []
            for k, i in enumerate(range(self.start, self.stop)):
                key = layer_rng(rng, microbatch, i) if rng is not None else None

                def one(p, st, x, key, layer=layers[i]):
                    return apply_layer(layer, {"params": p, **st}, x, train=train, rng=key)

                if self.layer_remat and self.layer_remat[k]:
                    one = jax.checkpoint(one)
                x, st = one(params[k], state[k], x, key)
                new_state.append(st)
            return x, new_state

        if self.stage_remat == "full":
            run = jax.checkpoint(run)
        elif self.stage_remat != "none":
            run = jax.checkpoint(run, policy=_policy(self.stage_remat))
        return run(params, state, x, rng)


def split_float(tree: PyTree) -> tuple[list, list, list]:
    """(float leaves, other leaves, is-float mask) of a pytree."""
    leaves = jax.tree.leaves(tree)
    mask = [is_float(l) for l in leaves]
    return ([l for l, m in zip(leaves, mask) if m], [l for l, m in zip(leaves, mask) if not m], mask)


def merge_float(treedef, mask: Sequence[bool], floats: Sequence, others: Sequence) -> PyTree:
    f, o = iter(floats), iter(others)
    return jax.tree.unflatten(treedef, [next(f) if m else next(o) for m in mask])


Loss = Callable[[PyTree, PyTree], jax.Array]


def microbatch_loss(loss_fn: Loss, outputs: PyTree, targets: PyTree, global_microbatches: int):
    """loss_fn(outputs, targets) / (data x M), the microbatch's share of the global mean, as
    a scalar of `layers.loss_dtype()` (`layers.scalar_loss`: a loss that is not a scalar
    surfaced as "switch branches must have equal output types"). Scaled by the data
    replicas too, and summed over them after: seeded with 1 / M and averaged over "data"
    after, every backward rule saw a cotangent `data` times jax.grad's, and one not linear
    in it (a custom_vjp clipping its gradient) gave gradients that hung on the layout."""
    return scalar_loss(loss_fn, outputs, targets, "Pipeline",
                       "the mean loss of one microbatch") / global_microbatches
