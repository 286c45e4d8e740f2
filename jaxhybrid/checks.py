"""Predicates the argument checks of every module share."""
from __future__ import annotations

import numpy as np


def is_int(value) -> bool:
    """A whole number given as one: Python or numpy int, not a bool (True is an int to
    Python, but no count or index) and not a float such as 2.0."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
