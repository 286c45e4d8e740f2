"""What a checkpoint's meta JSON records beside the arrays, and the checks a restore
makes from it before anything is compiled or read: the leaves' shapes (another model or
optimizer), the layout it was saved on, and how many optimizer updates made one step;
and after reading, each leaf's checksum.

Orbax's chunks carry no checksum: one flipped byte in a data file (bit rot, a bad copy)
restored silently, a kernel 0.019 off. `checksums` is a position-weighted sum of each
leaf's bit patterns modulo 2**32 (odd weights: any change of one word changes it),
computed on the devices where the leaf lies; integer sums do not depend on the order of
addition, so the figure is the same however the leaf is sharded or laid out.

The optimizer's step counts (Adam's bias correction, a learning-rate schedule's position)
count updates, and an asynchronous schedule applies several per training step (its U
tasks, `asynchronous.updates_per_call`, which grows with the number of microbatches). A
run restored with another count per step silently took its learning rates from another
point of the schedule (a PipeDream run resumed as 1F1B applied rate 0: the weights froze),
so such a restore is refused, naming the fields to keep.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxhybrid.schedules.asynchronous import updates_per_call

PyTree = Any


def layout_of(pipe) -> dict:
    """The meta's "layout": where and how the run was laid out (JSON)."""
    return {"data": pipe.data, "pipe": pipe.pipe_size, "model": pipe.model,
            "boundaries": [int(b) for b in pipe.boundaries],
            "schedule": pipe.schedule.name, "num_microbatches": pipe.num_microbatches,
            "updates_per_step": updates_per_call(pipe.schedule)}


def updates_difference(saved_layout, pipe) -> str | None:
    """Why the saved optimizer counts would be misread by `pipe` (None: they fit, or the
    checkpoint predates the record)."""
    saved = (saved_layout or {}).get("updates_per_step")
    now = updates_per_call(pipe.schedule)
    if saved is None or int(saved) == now:
        return None
    return (f"it was saved by schedule {saved_layout.get('schedule')} with "
            f"{saved_layout.get('num_microbatches')} microbatches, {saved} optimizer "
            f"updates per step; this run, schedule {pipe.schedule.name} with "
            f"{pipe.num_microbatches} microbatches, makes {now}, so the optimizer's step "
            f"counts (its learning-rate schedule, Adam's bias correction) would be misread: "
            f"keep pipeline.schedule and pipeline.num_microbatches")


def schedule_note(saved_layout, pipe) -> str:
    """' (saved with schedule X, this run uses Y)' where they differ: asynchronous
    schedules keep other optimizer slots (spectrain's last update)."""
    saved = (saved_layout or {}).get("schedule")
    return ("" if saved in (None, pipe.schedule.name) else
            f" (saved with schedule {saved}, this run uses {pipe.schedule.name})")


def shapes(tree: PyTree) -> list:
    return [tuple(np.shape(x)) for x in jax.tree.leaves(tree)]


def _path(keys) -> str:
    """A leaf's key path as "layers/0/variables/params/wte/embedding"."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)


def leaf_shapes(tree: PyTree) -> dict:
    """{leaf path: shape} of a portable tree (arrays, shape structs or orbax metadata)."""
    return {_path(p): tuple(a.shape) for p, a in jax.tree_util.tree_leaves_with_path(
        tree, is_leaf=lambda x: hasattr(x, "shape"))}


def _counts(paths, part: str) -> dict:
    """{layer index: number of distinct `part` entries} ("opt": optimizer slots)."""
    out: dict = {}
    for p in paths:
        keys = p.split("/")
        if keys[0] == "layers" and len(keys) > 3 and keys[2] == part:
            out.setdefault(keys[1], set()).add(keys[3])
    return {k: len(v) for k, v in out.items()}


def difference(saved: dict, wanted: dict, note: str = "") -> str | None:
    """What differs between two {leaf path: shape} of the portable format (None: they
    fit); `note` follows a difference in optimizer slots (`schedule_note`)."""
    layers = lambda d: len({p.split("/")[1] for p in d if p.startswith("layers/")})
    if layers(saved) != layers(wanted):
        return f"the checkpoint has {layers(saved)} layers, this model {layers(wanted)}"
    slots = lambda d: max(_counts(d, "opt").values(), default=0)
    if slots(saved) != slots(wanted):
        return (f"the checkpoint has {slots(saved)} optimizer slots per parameter, this "
                f"optimizer {slots(wanted)}{note}: another "
                + ("pipeline.schedule" if note else "train.optimizer or train.momentum"))
    for p in sorted(set(saved) | set(wanted)):
        if p not in wanted:
            return f"{p} is saved but not in this model"
        if p not in saved:
            return f"{p} is in this model but not saved"
        if saved[p] != wanted[p]:
            return f"{p} was saved with shape {saved[p]}, this model has {wanted[p]}"
    return None


def _leaf_sum(a: jax.Array) -> jax.Array:
    """Sum over elements of (bit pattern as uint32) x (2 x linear index + 1), mod 2**32."""
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        a = jnp.stack([a.real, a.imag], -1)
    if a.dtype == jnp.bool_:
        a = a.astype(jnp.uint8)
    bits = a.dtype.itemsize * 8
    w = lax.bitcast_convert_type(a, jnp.dtype(f"uint{min(bits, 32)}")).astype(jnp.uint32)
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(w.ndim)):
        index = index + lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride % 2**32)
        stride *= w.shape[d]
    return jnp.sum(w * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


_tree_sums = jax.jit(lambda leaves: [_leaf_sum(a) for a in leaves])


def _host_leaf_sum(a: np.ndarray) -> int:
    """`_leaf_sum` in numpy (uint32 products and sums wrap mod 2**32 as XLA's do)."""
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    if np.iscomplexobj(a):
        a = np.stack([a.real, a.imag], -1)
    a = np.ascontiguousarray(a)
    # Row-major words: a 64-bit element is two uint32 words, low first, as XLA's
    # bitcast to a narrower type appends them in a last dimension.
    w = a.reshape(-1).view(f"uint{min(a.dtype.itemsize * 8, 32)}").astype(np.uint32)
    index = np.arange(w.size, dtype=np.uint64).astype(np.uint32)   # mod 2**32
    return int(np.sum(w * (index * np.uint32(2) + np.uint32(1)), dtype=np.uint32))


def _on_host(leaf) -> np.ndarray | None:
    """The leaf's value in numpy where it is cheap to read whole (a host-CPU array held by
    this process), else None."""
    if isinstance(leaf, np.ndarray):
        return leaf
    if isinstance(leaf, jax.Array) and leaf.is_fully_addressable and all(
            d.platform == "cpu" for d in leaf.sharding.device_set):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        return np.asarray(leaf)
    return None


def checksums(tree: PyTree) -> dict:
    """{leaf path: checksum} of a portable tree of jax arrays (every process calls it).
    Computed in numpy when every leaf is a host-CPU array this process holds whole:
    jitted, XLA CPU compiled one reduction per leaf (Inception-V3 tiny with Adam, ~1,400
    leaves: 13.5 s at a run's first checkpoint, on 2 cores); else on the devices."""
    flat = jax.tree_util.tree_leaves_with_path(tree)
    host = [_on_host(a) for _, a in flat]
    if all(h is not None for h in host):
        return {_path(p): _host_leaf_sum(h) for (p, _), h in zip(flat, host)}
    sums = _tree_sums([a for _, a in flat])
    return {_path(p): int(np.asarray(s.addressable_data(0))) for (p, _), s in zip(flat, sums)}


def checksum_difference(saved, restored: PyTree) -> str | None:
    """The first leaf whose restored bits differ from those saved (None: all agree, or
    the checkpoint predates checksums)."""
    if not isinstance(saved, dict):
        return None
    for p, got in checksums(restored).items():
        if p in saved and int(saved[p]) != got:
            return f"{p} differs from what was saved (checksum {got}, saved {saved[p]})"
    return None
