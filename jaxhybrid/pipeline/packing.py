"""Packing pytrees into per-dtype buffers that every pipeline stage can share.

Pipeline stages differ in parameter and activation shapes, but SPMD code needs one
shape per value. So the values of all stages (a stage's parameters, a boundary's
activation, a stage's saved residuals) are laid out in one shared set of 1-D buffers,
each stage using its own part, and stacked as [num_stages, length] where needed:

  * whole buffers ("float32#w0", ...): a leaf size that every stage has (the kernels of
    identical blocks, the activation passed between stages) gets buffers of exactly that
    size, one leaf each. Reading such a leaf is a reshape of the buffer, which XLA makes
    a bitcast: a slice of a flat buffer would be copied before every matmul that uses it
    (on XLA CPU those copies cost a third of a pipelined step).
  * the rest buffer ("float32"): all other leaves of a dtype, one after another and
    zero padded to the longest stage.

A `Layout` records, for one pytree structure, the buffer and offset of each leaf.
Buffers are dicts {key: array whose last axis is the packed axis}; a key missing from a
layout's sizes means that stage leaves the buffer unused (zeros).
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
Buffers = dict  # {buffer key: array whose last axis is the packed axis}

# Leaves with at least this many elements may get a whole buffer: below it a slice copy
# is cheaper than the per-buffer work (one more array in every add, ppermute, select).
WHOLE_MIN = 4096


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _dtype_name(dtype) -> str:
    # The dtype jax stores it in: a numpy int64 or float64 leaf (e.g. a Python number
    # a Variable holds) packs into an int32 or float32 buffer unless x64 is on. A typed
    # PRNG key is stored as its key data (uint32).
    if _is_key(dtype):
        return "uint32"
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype)).name


def _stored_shape(leaf) -> tuple:
    """The shape a leaf is stored in: a typed key's data has the impl's trailing axes."""
    if _is_key(leaf.dtype):
        return (*leaf.shape, *leaf.dtype._impl.key_shape)
    return tuple(leaf.shape)


def _key_impls(leaves) -> tuple:
    """((leaf index, key impl), ...) of the typed PRNG keys among `leaves`: a residual of
    a rematerialised dropout (nnx.remat in nnx.scan) is one, and canonicalize_dtype
    refused it."""
    return tuple((i, l.dtype._impl) for i, l in enumerate(leaves) if _is_key(l.dtype))


def _signature(leaf) -> tuple[str, int]:
    """(dtype name, number of elements): what decides which buffers a leaf can share."""
    return _dtype_name(leaf.dtype), math.prod(_stored_shape(leaf))


def dtype_of(key: str) -> str:
    """The dtype of a buffer key: "float32" (rest buffer) or "float32#w3" (whole buffer)."""
    return key.split("#")[0]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of one pytree structure lives in the shared buffers."""
    treedef: Any
    shapes: tuple
    dtypes: tuple          # dtype name per leaf
    keys: tuple            # buffer key per leaf
    offsets: tuple         # offset of each leaf inside its buffer
    sizes: tuple           # ((buffer key, elements used), ...) sorted by key
    key_impls: tuple = ()  # ((leaf index, PRNG impl), ...): typed keys, stored as data

    @property
    def size_of(self) -> dict:
        return dict(self.sizes)

    def nbytes(self) -> int:
        return sum(n * np.dtype(dtype_of(k)).itemsize for k, n in self.sizes)


# A leaf size gets whole buffers for as many of its leaves as the stage with the most of
# them has, unless the stages with fewer would leave so much unused that the buffers per
# device grow by more than this fraction; then fewer.
WHOLE_TOLERANCE = 0.02


def _whole_counts(flat: list, whole_min: int | None) -> dict:
    """{(dtype, size): number of whole buffers of that size}."""
    if whole_min is None:
        return {}
    counts = [collections.Counter(_signature(l) for l in leaves) for leaves, _ in flat]
    big = sorted({dn for c in counts for dn in c if dn[1] >= whole_min},
                 key=lambda dn: (-dn[1], dn[0]))

    def nbytes(k: dict) -> int:
        """Bytes per device: the whole buffers plus each dtype's longest rest."""
        rest = collections.Counter()
        for c in counts:
            mine = collections.Counter()
            for (dtype, n), cnt in c.items():
                mine[dtype] += (cnt - min(cnt, k.get((dtype, n), 0))) * n
            for dtype, n in mine.items():
                rest[dtype] = max(rest[dtype], n)
        whole = sum(cnt * n * np.dtype(d).itemsize for (d, n), cnt in k.items())
        return whole + sum(n * np.dtype(d).itemsize for d, n in rest.items())

    k = {dn: min(c[dn] for c in counts) for dn in big}
    for dn in big:
        base = nbytes(k)
        for more in range(max(c[dn] for c in counts), k[dn], -1):
            if nbytes({**k, dn: more}) <= base * (1 + WHOLE_TOLERANCE):
                k[dn] = more
                break
    return {dn: cnt for dn, cnt in k.items() if cnt}


def shared_layouts(trees: Sequence[PyTree], whole_min: int | None = WHOLE_MIN
                   ) -> tuple[list, dict]:
    """Layouts of several pytrees (one per stage or boundary) over one set of buffers.

    Returns (layouts, lengths {buffer key: length}). Big leaf sizes get whole buffers
    (see `_whole_counts`); the other leaves fill the rest buffer of their dtype, padded
    to the longest tree. whole_min=None: rest buffers only, one per dtype (for values
    that travel: each buffer is one more collective per tick, while a single-leaf rest
    buffer is still read without a slice)."""
    flat = [jax.tree.flatten(t) for t in trees]
    whole, lengths, used = {}, {}, collections.Counter()
    for (dtype, n), cnt in sorted(_whole_counts(flat, whole_min).items(),
                                  key=lambda kv: (kv[0][0], -kv[0][1])):
        whole[(dtype, n)] = []
        for _ in range(cnt):
            key = f"{dtype}#w{used[dtype]}"
            used[dtype] += 1
            whole[(dtype, n)].append(key)
            lengths[key] = n
    layouts, rest_len = [], collections.Counter()
    for leaves, treedef in flat:
        taken, rest = collections.Counter(), collections.Counter()
        keys, offsets = [], []
        for leaf in leaves:
            dn = _signature(leaf)
            if taken[dn] < len(whole.get(dn, ())):
                keys.append(whole[dn][taken[dn]])
                offsets.append(0)
                taken[dn] += 1
            else:
                keys.append(dn[0])
                offsets.append(rest[dn[0]])
                rest[dn[0]] += dn[1]
        sizes = collections.Counter()
        for key, leaf in zip(keys, leaves):
            sizes[key] += math.prod(_stored_shape(leaf))
        for dtype, n in rest.items():
            rest_len[dtype] = max(rest_len[dtype], n)
        layouts.append(Layout(treedef, tuple(_stored_shape(l) for l in leaves),
                              tuple(_dtype_name(l.dtype) for l in leaves), tuple(keys),
                              tuple(offsets), tuple(sorted(sizes.items())),
                              _key_impls(leaves)))
    lengths.update({d: n for d, n in rest_len.items() if n})
    return layouts, dict(sorted(lengths.items()))


def layout_of(tree: PyTree) -> Layout:
    """Layout of one pytree of arrays (or ShapeDtypeStructs) on buffers of its own."""
    return shared_layouts([tree])[0][0]


def _check_fits(layout: Layout, lengths: Mapping[str, int]) -> None:
    for key, n in layout.sizes:
        if n > lengths.get(key, 0):
            raise ValueError(f"pack: {n} values of buffer {key!r} do not fit a buffer of "
                             f"{lengths.get(key, 0)}")


def _whole(layout: Layout, i: int, length: int) -> bool:
    return layout.offsets[i] == 0 and math.prod(layout.shapes[i]) == length


def pack(layout: Layout, tree: PyTree, lengths: Mapping[str, int],
         dtypes: Mapping[str, Any] | None = None) -> Buffers:
    """Packs a pytree (or the list of its flat leaves) into {key: 1-D array of
    lengths[key]}, zero padded; each buffer in its key's dtype, or dtypes[key] (an
    optimizer slot kept in another dtype than its parameters, e.g. adam's mu_dtype)."""
    leaves = _key_data(layout, jax.tree.leaves(tree))
    if len(leaves) != len(layout.shapes):
        raise ValueError(f"pack: got {len(leaves)} leaves, layout has {len(layout.shapes)}")
    _check_fits(layout, lengths)
    out = {}
    for key, total in lengths.items():
        dtype = dtype_of(key) if dtypes is None else dtypes[key]
        mine = [i for i, k in enumerate(layout.keys) if k == key]
        if len(mine) == 1 and _whole(layout, mine[0], total):
            out[key] = jnp.reshape(leaves[mine[0]], (-1,)).astype(dtype)
            continue
        # Written leaf by leaf into a fresh zero buffer (in-place dynamic_update_slice at
        # static offsets) rather than with one concatenate: XLA CPU emits a fused
        # concatenate as a per-element loop over all operands, which is slow.
        buf = jnp.zeros((total,), dtype)
        for i in mine:
            flat = jnp.reshape(leaves[i], (-1,)).astype(dtype)
            buf = jax.lax.dynamic_update_slice_in_dim(buf, flat, layout.offsets[i], 0)
        out[key] = buf
    return out


def _key_data(layout: Layout, leaves: list) -> list:
    if not layout.key_impls:
        return leaves
    leaves = list(leaves)
    for i, _ in layout.key_impls:
        leaves[i] = jax.random.key_data(leaves[i])
    return leaves


def unpack_leaves(layout: Layout, buffers: Mapping[str, jax.Array]) -> list:
    """Inverse of `pack`: the flat leaves of the layout's pytree."""
    leaves = []
    for i, (shape, key, off) in enumerate(zip(layout.shapes, layout.keys, layout.offsets)):
        n = math.prod(shape)
        buf = buffers[key]
        # Leading axes of the buffer (e.g. microbatches) stay in front of the leaf's shape.
        if not _whole(layout, i, buf.shape[-1]):
            buf = jax.lax.slice_in_dim(buf, off, off + n, axis=-1)
        leaves.append(jnp.reshape(buf, (*buf.shape[:-1], *shape)))
    for i, impl in layout.key_impls:
        leaves[i] = jax.random.wrap_key_data(leaves[i], impl=impl)
    return leaves


def unpack(layout: Layout, buffers: Mapping[str, jax.Array]) -> PyTree:
    return jax.tree.unflatten(layout.treedef, unpack_leaves(layout, buffers))


def unpack_numpy(layout: Layout, buffers: Mapping[str, np.ndarray]) -> PyTree:
    """Host-side `unpack` (numpy in, numpy out)."""
    leaves = []
    for shape, key, off in zip(layout.shapes, layout.keys, layout.offsets):
        n = math.prod(shape)
        leaves.append(np.asarray(buffers[key][off:off + n]).reshape(shape))
    for i, impl in layout.key_impls:
        leaves[i] = jax.random.wrap_key_data(leaves[i], impl=impl)
    return jax.tree.unflatten(layout.treedef, leaves)


def pack_numpy(layout: Layout, tree: PyTree, lengths: Mapping[str, int],
               dtypes: Mapping[str, Any] | None = None) -> dict:
    """Host-side `pack` (numpy in, numpy out)."""
    leaves = _key_data(layout, jax.tree.leaves(tree))
    if len(leaves) != len(layout.shapes):
        raise ValueError(f"pack: got {len(leaves)} leaves, layout has {len(layout.shapes)}")
    _check_fits(layout, lengths)
    out = {key: np.zeros((total,), dtype_of(key) if dtypes is None else dtypes[key])
           for key, total in lengths.items()}
    for leaf, shape, key, off in zip(leaves, layout.shapes, layout.keys, layout.offsets):
        arr = np.asarray(leaf)
        if arr.shape != shape:
            raise ValueError(f"pack: leaf of shape {arr.shape} where the layout expects {shape}")
        out[key][off:off + arr.size] = arr.reshape(-1)
    return out


def zeros(lengths: Mapping[str, int], lead: Sequence[int] = ()) -> Buffers:
    return {key: jnp.zeros((*lead, n), dtype_of(key)) for key, n in lengths.items()}


def pack_into(layout: Layout, tree: PyTree, buffers: Buffers) -> Buffers:
    """Writes a pytree's leaves into existing buffers at the layout's places (the other
    contents stay): how one of a device's several stages updates its part."""
    leaves = _key_data(layout, jax.tree.leaves(tree))
    if len(leaves) != len(layout.shapes):
        raise ValueError(f"pack: got {len(leaves)} leaves, layout has {len(layout.shapes)}")
    out = dict(buffers)
    for leaf, key, off in zip(leaves, layout.keys, layout.offsets):
        flat = jnp.reshape(leaf, (-1,)).astype(dtype_of(key))
        if off == 0 and flat.shape[0] == out[key].shape[-1]:
            out[key] = flat
        else:
            out[key] = jax.lax.dynamic_update_slice_in_dim(out[key], flat, off, 0)
    return out


def place_in_free_space(layout: Layout, lengths: Mapping[str, int], live: Sequence[bool],
                        avals: Sequence) -> tuple[Layout, list]:
    """Places the leaves `avals` in the part of one row of buffers (`lengths`) that the
    layout's live leaves (`live[i]`) leave free: the space of its dead leaves and the
    padding beyond them. Largest leaf first, into a free whole buffer of exactly its size
    where one is (read back without a slice), else first fit in its dtype's buffers.
    Returns (the Layout of the placed leaves, in their order; the indices of the leaves
    that did not fit)."""
    free = {key: [(0, n)] for key, n in lengths.items()}
    for key, off, shape, alive in zip(layout.keys, layout.offsets, layout.shapes, live):
        if alive:   # cut [off, off + n) out of the key's free intervals
            end = off + math.prod(shape)
            free[key] = [piece for a, b in free[key]
                         for piece in ((a, min(b, off)), (max(a, end), b)) if piece[1] > piece[0]]
    where, overflow = {}, []
    order = sorted(range(len(avals)), key=lambda i: -math.prod(avals[i].shape))
    for i in order:
        n, dtype = math.prod(_stored_shape(avals[i])), _dtype_name(avals[i].dtype)
        keys = [k for k in free if dtype_of(k) == dtype]
        exact = [k for k in keys if free[k] == [(0, n)] and lengths[k] == n]
        fits = exact or [k for k in keys if any(b - a >= n for a, b in free[k])]
        if not fits:
            overflow.append(i)
            continue
        key = fits[0]
        j = next(j for j, (a, b) in enumerate(free[key]) if b - a >= n)
        a, b = free[key][j]
        where[i] = (key, a)
        free[key][j:j + 1] = [(a + n, b)] if b > a + n else []
    placed = [i for i in range(len(avals)) if i in where]
    sizes = collections.Counter()
    for i in placed:
        sizes[where[i][0]] += math.prod(_stored_shape(avals[i]))
    return Layout(jax.tree.structure([0] * len(placed)),
                  tuple(_stored_shape(avals[i]) for i in placed),
                  tuple(_dtype_name(avals[i].dtype) for i in placed),
                  tuple(where[i][0] for i in placed), tuple(where[i][1] for i in placed),
                  tuple(sorted(sizes.items())),
                  _key_impls([avals[i] for i in placed])), sorted(overflow)


def split_layout(layout: Layout, trees: Sequence[PyTree]) -> list[Layout]:
    """The layout of a tuple of trees, cut into one layout per tree (e.g. a device's
    buffers holding several pipeline stages: each stage reads only its own leaves)."""
    out, start = [], 0
    for tree in trees:
        leaves, treedef = jax.tree.flatten(tree)
        end = start + len(leaves)
        keys = layout.keys[start:end]
        sizes = collections.Counter()
        for key, shape in zip(keys, layout.shapes[start:end]):
            sizes[key] += math.prod(shape)
        out.append(Layout(treedef, layout.shapes[start:end], layout.dtypes[start:end], keys,
                          layout.offsets[start:end], tuple(sorted(sizes.items())),
                          tuple((i - start, impl) for i, impl in layout.key_impls
                                if start <= i < end)))
        start = end
    return out


def grouped_layouts(trees: Sequence[PyTree], groups: Sequence[Sequence[int]],
                    whole_min: int | None = WHOLE_MIN) -> tuple[list, dict]:
    """Layouts of `trees` where the trees of one group share one row of buffers (a device
    holding several stages): returns (one Layout per tree, lengths)."""
    rows, lengths = shared_layouts([tuple(trees[i] for i in g) for g in groups], whole_min)
    out = [None] * len(trees)
    for g, row in zip(groups, rows):
        for i, lay in zip(g, split_layout(row, [trees[i] for i in g])):
            out[i] = lay
    return out, lengths


def check_packed(variables, expected: Mapping[str, Mapping[str, Any]], who: str) -> None:
    """A ValueError naming the fix unless `variables` has the collections, buffer keys and
    shapes of `expected` (a pipeline's `abstract_variables`): per-layer dicts, gradients
    or another pipeline's buffers otherwise failed with a KeyError or a slice error."""
    def show(tree):
        return {k: tuple(np.shape(v)) for k, v in tree.items()} if isinstance(tree, Mapping) else type(tree).__name__
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise ValueError(f"Pipeline.{who}: variables must be the packed dict of pipe.init / "
                         f"pipe.pack ({{'params': {{buffer: [rows, length]}}, ...}}), got "
                         f"{show(variables)}; pack per-layer variables with pipe.pack(per_layer).")
    for c, bufs in expected.items():
        got = variables.get(c)
        if show(got) != {k: tuple(b.shape) for k, b in bufs.items()}:
            raise ValueError(f"Pipeline.{who}: variables[{c!r}] has buffers {show(got)}, this "
                             f"pipeline's layout is {show(bufs)}: they were packed by another "
                             f"pipeline or before a pipe.init on inputs of other shapes; repack them with "
                             f"this one: pipe.pack(other_pipe.unpack(variables)).")
    check_not_donated(variables, f"Pipeline.{who}: variables")


def check_donatable(variables, opt_state, who: str) -> None:
    """A ValueError naming the fix where a donating step would be handed one array twice
    (an optimizer state holding the parameter arrays themselves): XLA's "Attempt to
    donate the same buffer twice" ended the process."""
    seen: set = set()
    for a in _concrete_arrays((variables, opt_state)):
        if id(a) in seen:
            raise ValueError(f"{who}: opt_state holds arrays of variables (or one array "
                             f"twice), which donate=True would hand over twice; make it "
                             f"with pipe.init_optimizer, or copy them "
                             f"(jax.tree.map(jnp.copy, opt_state)).")
        seen.add(id(a))


def check_not_donated(tree, what: str) -> None:
    """A ValueError naming the fix where `tree` holds arrays a donating step took over
    (`train_step(..., donate=True)`): jax's own error ("Buffer has been deleted or
    donated") came from deep inside the call."""
    if any(a.is_deleted() for a in _concrete_arrays(tree)):
        raise ValueError(f"{what}: some arrays were donated to a step "
                         f"(train_step(..., donate=True) takes them over); pass the new "
                         f"variables and optimizer state that step returned.")


def _concrete_arrays(tree):
    """The jax arrays of `tree` that hold buffers (not tracers: under an outer jit there
    is nothing to donate twice or to find deleted)."""
    return (a for a in jax.tree.leaves(tree)
            if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer))
