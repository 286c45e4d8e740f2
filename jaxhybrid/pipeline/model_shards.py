"""A layer's variables cut into "model" shards (tensor parallelism) and joined back.

A variable (parameter or state) that its layer builds at 1 / T of one dimension's width
at model degree T (`sharding.variable_split_dims`) is split evenly along that dimension:
shard j of T holds slice j. The pipeline packs each shard into
its own row of stage buffers (rows stacked over ("pipe", "model")), so packing never
flattens a "model"-split dimension away; every other leaf is copied to every shard.
Dims are given per leaf as an int (-1: not split).
"""
from __future__ import annotations

import warnings
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from jaxhybrid.sharding import model_split_dims, variable_split_dims

PyTree = Any


def split_dims(layer: nn.Module, x: PyTree, model: int, x_local: PyTree) -> PyTree:
    """Per collection, the layer's tree of dims split over "model", from its abstract init
    on input x (`sharding.variable_split_dims`: what the layer builds at degree `model`
    on its input there, `x_local`, decides; no FLOPs). Leaves whose names put a dim on "model" but that the layer builds whole
    are kept whole, and the user is told once (they cost memory and compute on every
    model shard)."""
    boxed, dims = variable_split_dims(layer, x, at=(model, x_local))
    flat = jax.tree_util.tree_flatten_with_path(model_split_dims(boxed))[0]
    whole = [jax.tree_util.keystr(p) for (p, named), d in zip(flat, jax.tree.leaves(dims))
             if named >= 0 and d < 0]
    if whole:
        warnings.warn(f"Pipeline: {type(layer).__name__} names a dimension 'heads' or 'mlp' "
                      f"for 'model' but builds {', '.join(whole[:4])}"
                      f"{' ...' if len(whole) > 4 else ''} whole at model degree > 1, so it "
                      "runs replicated in its model group; to split it, build it with "
                      "jaxhybrid.tensor_parallel.local and join with its collectives.",
                      stacklevel=4)
    return dims


def shard(tree: PyTree, dims: PyTree | None, model: int, j: int, what: str, xp=np) -> PyTree:
    """Shard j of `model` of a (numpy, or with xp=jax.numpy traced) tree; dims None:
    nothing is split."""
    if dims is None:
        return tree

    def one(a, dim):
        if dim < 0:
            return a
        if np.shape(a)[dim] % model:
            raise ValueError(f"Pipeline: {what} has a parameter of shape {np.shape(a)} whose "
                             f"dimension {dim} (split over 'model') is not divisible by "
                             f"model={model}; choose model from its divisors.")
        return xp.split(xp.asarray(a), model, axis=dim)[j]
    return jax.tree.map(one, tree, dims)


def merge(dims: PyTree | None, shards: list, xp=np) -> PyTree:
    """Inverse of `shard`: the trees of all shards joined (numpy, or `xp`)."""
    if dims is None:
        return shards[0]
    return jax.tree.map(lambda dim, *parts: parts[0] if dim < 0 else xp.concatenate(
        parts, axis=dim), dims, *shards)
