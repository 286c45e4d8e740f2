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
