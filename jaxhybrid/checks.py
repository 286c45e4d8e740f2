"""Predicates the argument checks of every module share."""
from __future__ import annotations

import numpy as np


def is_int(value) -> bool:
    """A whole number given as one: Python or numpy int, not a bool (True is an int to
    Python, but no count or index) and not a float such as 2.0."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def differentiable(dtype) -> bool:
    """Whether values of `dtype` carry gradients: floating and complex ones. (Complex
    activations once counted as constants: everything before a complex value crossing a
    cut got a zero gradient, silently.)"""
    import jax.numpy as jnp
    return jnp.issubdtype(dtype, jnp.inexact)


def is_float(x) -> bool:
    """Whether a leaf (an array, an abstract value or a Python number) carries gradients.
    jnp.result_type: a Python number among a layer's outputs has no .dtype (the engine,
    then the planner's profile, failed on one as "'float' object has no attribute
    'dtype'")."""
    import jax.numpy as jnp
    return differentiable(jnp.result_type(x))


class _ById:
    """An unhashable object as a cache key: equal only to itself (and kept alive by the
    key, so its id cannot be reused while the key exists)."""

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other) -> bool:
        return isinstance(other, _ById) and other.obj is self.obj


def hashable(obj):
    """`obj` as a cache key: itself where it hashes, else by identity. A loss may be an
    ordinary dataclass (`__hash__ = None`) or a flax.struct holding arrays: keyed by
    value they failed as "unhashable type" inside the split model's checks."""
    try:
        hash(obj)
    except TypeError:
        return _ById(obj)
    return obj


def batch_size_of(tree, what: str, who: str = "Pipeline") -> int:
    """The leading (batch) dimension that every leaf of `tree` shares, else a ValueError
    from `who` naming the fix: a step cuts each leaf into microbatches along it (the
    pipeline's inputs and targets, a `WeightedMean`'s targets)."""
    import jax
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise ValueError(f"{who}: {what} is empty (None, or a tree without arrays); "
                         f"pass per-example arrays (a loss that ignores its targets: any "
                         f"array with the batch's rows, e.g. np.zeros(batch_size)).")
    if isinstance(tree, (list, tuple)) and all(isinstance(l, (bool, int, float, complex))
                                               for l in leaves):
        # To jax a nested list is a tree of scalars: "got ['None']" named no fix.
        raise ValueError(f"{who}: {what} is a Python list of numbers; pass an array, "
                         f"e.g. np.asarray({what}).")
    batch = {np.shape(l)[0] if np.ndim(l) else None for l in leaves}
    if len(batch) != 1 or None in batch:
        raise ValueError(
            f"{who}: every leaf of {what} needs the same leading batch dimension (it is "
            f"cut into microbatches along it), got {sorted(map(str, batch))}; pass a value "
            f"that is not per-example (a temperature, a table) as a constant"
            + (" (the loss's: in loss_fn itself)" if what == "targets" else
               ", e.g. in call_kwargs=") + ", or tile it to the batch.")
    return batch.pop()
