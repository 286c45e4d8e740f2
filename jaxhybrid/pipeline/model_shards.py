"""A layer's variables cut into "model" shards (tensor parallelism) and joined back.

A parameter whose logical names put one dimension on "model" (`sharding.MODEL_RULES`)
is split evenly along it: shard j of T holds slice j. The pipeline packs each shard into
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

from jaxhybrid.sharding import TENSOR_PARALLEL_AXES, layer_split_dims, model_split_dims

PyTree = Any


def split_dims(layer: nn.Module, x: PyTree) -> PyTree:
    """The layer's "params" tree of dims split over "model", from its abstract init on
    input x (still boxed with the logical names; no FLOPs). A layer whose names put
    dims on "model" but that is not written for tensor parallelism is kept whole, and
    the user is told once (it costs memory and compute on every model shard)."""
    params, dims = layer_split_dims(layer, x)
    named = [d for d in jax.tree.leaves(model_split_dims(params)) if d >= 0]
    if named and all(d < 0 for d in jax.tree.leaves(dims)):
        warnings.warn(f"Pipeline: {type(layer).__name__} names a dimension 'heads' or 'mlp' "
                      "for 'model' but builds them whole at model degree > 1, so it runs "
                      "replicated in its model group; to split it, build them with "
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
