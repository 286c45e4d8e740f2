"""Packing pytrees into flat, padded per-dtype buffers.

Pipeline stages differ in parameter and activation shapes, but SPMD code needs one
shape per value: a stage's parameters become one 1-D buffer per dtype, padded to the
largest stage and stacked as [num_stages, length]; a boundary activation (any pytree)
or a stage's saved residuals become 1-D buffers padded to the largest over stages, so
`ppermute` and a ring buffer of stashed residuals can hold any stage's values.

A `Layout` records, for one pytree structure, where each leaf lives: its dtype buffer
and offset. Buffers are dicts {dtype name: 1-D array}; a missing dtype means length 0.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
Buffers = dict  # {dtype name: array whose last axis is the packed axis}


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of one pytree structure lives in per-dtype flat buffers."""
    treedef: Any
    shapes: tuple
    dtypes: tuple          # dtype name per leaf
    offsets: tuple         # offset of each leaf inside its dtype's buffer
    sizes: tuple           # ((dtype name, total length), ...) sorted by name

    @property
    def size_of(self) -> dict:
        return dict(self.sizes)

    def nbytes(self) -> int:
        return sum(n * np.dtype(d).itemsize for d, n in self.sizes)


def layout_of(tree: PyTree) -> Layout:
    """Layout of a pytree of arrays (or ShapeDtypeStructs)."""
    leaves, treedef = jax.tree.flatten(tree)
    sizes: dict = {}
    shapes, dtypes, offsets = [], [], []
    for leaf in leaves:
        name = _dtype_name(leaf.dtype)
        n = math.prod(leaf.shape)
        shapes.append(tuple(leaf.shape))
        dtypes.append(name)
        offsets.append(sizes.get(name, 0))
        sizes[name] = sizes.get(name, 0) + n
    return Layout(treedef, tuple(shapes), tuple(dtypes), tuple(offsets),
                  tuple(sorted(sizes.items())))


def max_sizes(layouts: Iterable[Layout]) -> dict:
    """Per-dtype padded length that fits every layout."""
    out: dict = {}
    for lay in layouts:
        for name, n in lay.sizes:
            out[name] = max(out.get(name, 0), n)
    return dict(sorted(out.items()))


def pack(layout: Layout, tree: PyTree, lengths: Mapping[str, int]) -> Buffers:
    """Packs a pytree (or the list of its flat leaves) into {dtype: 1-D array of
    lengths[dtype]}, zero padded."""
    leaves = jax.tree.leaves(tree)
    if len(leaves) != len(layout.shapes):
        raise ValueError(f"pack: got {len(leaves)} leaves, layout has {len(layout.shapes)}")
    # Written leaf by leaf into a fresh zero buffer (in-place dynamic_update_slice at static
    # offsets) rather than with one concatenate: XLA CPU emits a fused concatenate as a
    # per-element loop over all operands, which cost more than the stage's own matmuls.
    out = {}
    for name, total in lengths.items():
        used = sum(math.prod(sh) for sh, d in zip(layout.shapes, layout.dtypes) if d == name)
        if used > total:
            raise ValueError(f"pack: {used} {name} values do not fit a buffer of {total}")
        buf = jnp.zeros((total,), name)
        for leaf, d, off in zip(leaves, layout.dtypes, layout.offsets):
            if d == name:
                flat = jnp.reshape(leaf, (-1,)).astype(name)
                buf = jax.lax.dynamic_update_slice_in_dim(buf, flat, off, 0)
        out[name] = buf
    return out


def unpack_leaves(layout: Layout, buffers: Mapping[str, jax.Array]) -> list:
    """Inverse of `pack`: the flat leaves of the layout's pytree."""
    leaves = []
    for shape, name, off in zip(layout.shapes, layout.dtypes, layout.offsets):
        n = math.prod(shape)
        buf = buffers[name]
        # Leading axes of the buffer (e.g. microbatches) stay in front of the leaf's shape.
        leaves.append(jnp.reshape(jax.lax.slice_in_dim(buf, off, off + n, axis=-1),
                                  (*buf.shape[:-1], *shape)))
    return leaves


def unpack(layout: Layout, buffers: Mapping[str, jax.Array]) -> PyTree:
    return jax.tree.unflatten(layout.treedef, unpack_leaves(layout, buffers))


def unpack_numpy(layout: Layout, buffers: Mapping[str, np.ndarray]) -> PyTree:
    """Host-side `unpack` (numpy in, numpy out)."""
    leaves = []
    for shape, name, off in zip(layout.shapes, layout.dtypes, layout.offsets):
        n = math.prod(shape)
        leaves.append(np.asarray(buffers[name][off:off + n]).reshape(shape))
    return jax.tree.unflatten(layout.treedef, leaves)


def pack_numpy(layout: Layout, tree: PyTree, lengths: Mapping[str, int]) -> dict:
    """Host-side `pack` (numpy in, numpy out)."""
    leaves = jax.tree.leaves(tree)
    out = {name: np.zeros((total,), name) for name, total in lengths.items()}
    for leaf, shape, name, off in zip(leaves, layout.shapes, layout.dtypes, layout.offsets):
        arr = np.asarray(leaf)
        if arr.shape != shape:
            raise ValueError(f"pack: leaf of shape {arr.shape} where the layout expects {shape}")
        out[name][off:off + arr.size] = arr.reshape(-1)
    return out


def zeros(lengths: Mapping[str, int], lead: Sequence[int] = ()) -> Buffers:
    return {name: jnp.zeros((*lead, n), name) for name, n in lengths.items()}
