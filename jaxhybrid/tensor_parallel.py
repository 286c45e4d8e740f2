"""Tensor parallelism over the "model" mesh axis, written into the layers (Megatron-LM).

A layer that supports tensor parallelism asks `size()` for the model degree T and builds
its parameters at their local (1 / T) shapes along the dimensions whose logical names
the rules map to "model" (`jaxhybrid.sharding.TENSOR_PARALLEL_AXES`). It then computes
on its shard and joins the group with explicit collectives over "model" only:

* `copy_to_model(x)` (Megatron's f): identity forward, psum of the gradient backward —
  before a column-parallel matmul, whose input gradient is a partial sum per shard;
* `reduce_from_model(x)` (Megatron's g): psum forward, identity backward — after a
  row-parallel matmul, whose outputs are partial sums;
* `gather_from_model(x, axis)`: all-gather of a column-parallel output along `axis`
  forward, this shard's slice of the gradient backward.

Both directions are custom VJPs, so the gradients are right under the pipeline's
`shard_map(check_vma=False)` (where psum's own transpose would psum again).

Why no deadlock: the pipeline's stage branch is chosen by the pipe index and the
schedule's table row, which every device of one "model" group shares (same data index,
same pipe index, same table); the collectives' groups are exactly those devices
(`axis_name="model"`). So every participant of each collective takes the branch that
issues it (../shared/DESIGN.md: "No collective inside a branch unless every participant
takes that branch"); tests/test_tensor_parallel.py runs hundreds of steps at 8 devices.

Outside the pipeline's program (initialisation, the single-device reference, profiling)
the degree is 1 and every helper is the identity. The pipeline's abstract evaluations
(boundary layouts, the B/W split's jaxpr) run at degree T outside the shard_map, with
"model" bound by `make_jaxpr(axis_env=...)` (`eval_shape`, `make_jaxpr` below), so they
see the very collectives the program runs.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Iterator

import jax
from jax import lax

MODEL = "model"

_DEGREE: contextvars.ContextVar = contextvars.ContextVar("jaxhybrid_tp", default=(1, False))
_ASKED: contextvars.ContextVar = contextvars.ContextVar("jaxhybrid_tp_asked", default=None)


@contextlib.contextmanager
def degree(size: int) -> Iterator[None]:
    """Layers traced inside see model degree `size` (and, if > 1, join the "model"
    collectives: trace them inside a shard_map over "model", or with `make_jaxpr`)."""
    token = _DEGREE.set((int(size), int(size) > 1))
    try:
        yield
    finally:
        _DEGREE.reset(token)


def size() -> int:
    """The model degree T of the layers being traced (1 outside a tensor-parallel run)."""
    asked = _ASKED.get()
    if asked is not None:
        asked.append(True)
    return _DEGREE.get()[0]


@contextlib.contextmanager
def watch() -> Iterator[list]:
    """`with watch() as asked:` — `asked` is non-empty after the block if a layer traced
    inside asked for the model degree or joined the model group (`size`, `local`, the
    collectives): it is written for tensor parallelism, whatever names its parameters
    carry (a row-parallel layer may build its kernel from its split input alone)."""
    asked: list = []
    token = _ASKED.set(asked)
    try:
        yield asked
    finally:
        _ASKED.reset(token)


def local(n: int, what: str) -> int:
    """n / T: the local width of a dimension split over "model"."""
    t = size()
    if n % t:
        raise ValueError(f"tensor parallel: {what}={n} is not divisible by the model degree "
                         f"{t}; choose mesh model= from the divisors of {n}.")
    return n // t


def _active() -> bool:
    """Whether the layer being traced joins a model group (and noted for `watch`)."""
    asked = _ASKED.get()
    if asked is not None:   # a layer that joins the model group is written for it
        asked.append(True)
    return _bound()


def _bound() -> bool:
    return _DEGREE.get()[1]


@jax.custom_vjp
def _f(x):
    return x


_f.defvjp(lambda x: (x, None), lambda _, g: (lax.psum(g, MODEL),))


@jax.custom_vjp
def _g(x):
    return lax.psum(x, MODEL)


_g.defvjp(lambda x: (lax.psum(x, MODEL), None), lambda _, g: (g,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather(x, axis):
    return lax.all_gather(x, MODEL, axis=axis, tiled=True)


def _gather_bwd(axis, _, g):
    n = g.shape[axis] // lax.axis_size(MODEL)
    return (lax.dynamic_slice_in_dim(g, lax.axis_index(MODEL) * n, n, axis),)


_gather.defvjp(lambda x, axis: (_gather(x, axis), None), _gather_bwd)


def copy_to_model(x):
    """Megatron's f: x unchanged; its gradient summed over the model group."""
    return jax.tree.map(_f, x) if _active() else x


def reduce_from_model(x):
    """Megatron's g: the sum over the model group; its gradient passed through."""
    return jax.tree.map(_g, x) if _active() else x


def gather_from_model(x, axis: int = -1):
    """The model group's shards of x concatenated along `axis`."""
    return _gather(x, axis % x.ndim) if _active() else x


def make_jaxpr(fn, **kwargs):
    """jax.make_jaxpr with "model" bound to the current degree (outside a shard_map)."""
    env = [(MODEL, _DEGREE.get()[0])] if _bound() else []
    return jax.make_jaxpr(fn, axis_env=env, **kwargs)


def eval_shape(fn, *args):
    """jax.eval_shape that also works on functions with "model" collectives."""
    if not _bound():
        return jax.eval_shape(fn, *args)
    return make_jaxpr(fn, return_shape=True)(*args)[1]


def shard_index():
    """This device's index in its model group (0 outside a tensor-parallel run)."""
    return lax.axis_index(MODEL) if _active() else 0
