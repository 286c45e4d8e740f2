"""Predicates the argument checks of every module share."""
from __future__ import annotations

import numpy as np


def is_int(value) -> bool:
    """A whole number given as one: Python or numpy int, not a bool (True is an int to
    Python, but no count or index) and not a float such as 2.0."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


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
