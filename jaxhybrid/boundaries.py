"""Stage boundaries and stage ranges: the one place that converts between them.

A partition of L layers into S stages is written as `boundaries`: the first layer index
of stages 1..S-1 (strictly increasing, in [1, L-1]); stage s holds layers
[ranges[s][0], ranges[s][1]). The planner (`jaxhybrid.plan`), the pipeline and the
reports all use these functions; this module imports nothing of the project.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxhybrid.checks import is_int


def even_boundaries(num_layers: int, num_stages: int) -> list[int]:
    """The equal-layer-count split: stages of floor(L/S) or ceil(L/S) layers, the extra
    layers on the earlier stages (10 layers on 4 stages: [3, 6, 8]). The planner's
    baseline and the pipeline's layout before it is planned."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"even_boundaries: need 1 <= num_stages <= num_layers, got "
                         f"num_stages={num_stages}, num_layers={num_layers}.")
    base, extra = divmod(int(num_layers), int(num_stages))
    sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    return [int(b) for b in np.cumsum(sizes)[:-1]]


def check_boundaries(boundaries: Sequence[int], num_layers: int,
                     num_stages: int | None = None) -> list[int]:
    """`boundaries` as a list of ints, or a ValueError naming what is wrong with them
    (count, when `num_stages` is given; range; order)."""
    if np.ndim(np.asarray(boundaries, object)) != 1:
        raise TypeError(f"boundaries={boundaries!r} must be a list of layer indices (the first "
                        f"layer of stages 1..S-1), e.g. [4, 9].")
    b = [_layer_index(x, boundaries) for x in boundaries]
    if num_stages is not None and len(b) != num_stages - 1:
        raise ValueError(f"boundaries={b} has {len(b)} entries; a {num_stages}-stage pipeline needs "
                         f"{num_stages - 1} (the first layer index of stages 1..{num_stages - 1}).")
    if any(x < 1 or x > num_layers - 1 for x in b):
        raise ValueError(f"boundaries={b} out of range: each must be in [1, {num_layers - 1}] "
                         f"for {num_layers} layers.")
    if any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(f"boundaries={b} must be strictly increasing (every stage needs >= 1 layer).")
    return b


def _layer_index(x, boundaries) -> int:
    # int() truncated 1.5 to 1 silently and failed on "a" with an int-parsing message.
    if is_int(x):
        return int(x)
    if isinstance(x, (float, np.floating)) and float(x).is_integer():
        return int(x)
    raise TypeError(f"boundaries={boundaries!r}: {x!r} is not a layer index; pass ints, the "
                    f"first layer of stages 1..S-1, e.g. [4, 9].")


def stage_ranges(boundaries: Sequence[int], num_layers: int) -> list[tuple[int, int]]:
    """[(first layer, one past the last layer)] of every stage."""
    edges = [0, *check_boundaries(boundaries, num_layers), int(num_layers)]
    return [(edges[i], edges[i + 1]) for i in range(len(edges) - 1)]


def stage_sums(per_layer, boundaries: Sequence[int]) -> np.ndarray:
    """Per-stage sums of a per-layer quantity (a sequence of numbers)."""
    values = np.asarray(per_layer, float)
    return np.array([values[a:b].sum() for a, b in stage_ranges(boundaries, values.size)])
