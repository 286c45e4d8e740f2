"""Tensor-parallel layers checked against themselves at model degree 1 before training.

The pipeline splits a variable that a layer builds at 1 / T of one dimension into T
contiguous blocks (`model_shards`), and what is split is learnt from shapes alone. A
layer can be built with the right shapes and still compute another function on its
shard: a fused qkv kernel laid out [q | k | v] (shard 0 gets all of q and part of k and
reads them as its own q, k, v), a LayerNorm over split features (it normalises over a
slice), a bias added before the row-parallel sum (added T times). The step then trains
another model, silently, and a checkpoint moved to another model degree means yet
another one. So on the first `pack` each layer that holds a split variable or gets a
split input runs once on a couple of examples at degree T, in a shard_map over "model",
on its degree-1 input and variables cut as the pipeline cuts them, and its output is
compared with the layer at degree 1 (evaluation mode: no dropout, running averages).
Parameters and sample leaves whose entries are all equal (zero biases, ReZero gates, a
sample of zeros) are drawn at random for the check: a wrong layer would look right on
them.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxhybrid import tensor_parallel
from jaxhybrid.layers import apply_layer
from jaxhybrid.pipeline import model_shards

PyTree = Any
EXAMPLES = 2


def check_layers(layers: Sequence, per_layer: Sequence[dict], dims: Sequence[dict],
                 sample: PyTree, model: int, devices: Sequence) -> None:
    """Raises ValueError naming the first layer whose output, or gradients (of its
    parameters and float inputs, for one fixed output cotangent), at degree `model`
    differ from the layer's at degree 1. `dims[i]`: layer i's {collection: tree of the
    dim split over "model"}; `sample`: inputs of the first layer (a few examples are
    used); `devices`: at least `model` local devices (else nothing is checked)."""
    if model < 2 or len(devices) < model:
        return
    mesh = Mesh(np.array(devices[:model]), (tensor_parallel.MODEL,))
    # A constant sample (pipe.init(key, jnp.zeros(...))) makes a first layer without a
    # bias output zeros at any degree: its float leaves are drawn at random instead.
    x = _varied_leaves(jax.tree.map(lambda a: np.asarray(a)[:EXAMPLES], sample), -1)
    in_dims = jax.tree.map(lambda _: -1, x)
    for i, (layer, v) in enumerate(zip(layers, per_layer)):
        v = {**v, "params": _varied_leaves(v["params"], i)} if "params" in v else v
        split = [d for c in v for d in jax.tree.leaves(dims[i].get(c) or {})]
        takes_split = any(d >= 0 for d in [*split, *jax.tree.leaves(in_dims)])
        try:
            # Traced once: the output's shapes and the precision the layer computes in.
            jaxpr, y_shapes = jax.make_jaxpr(_forward(layer), return_shape=True)(v, x)
        except flax.errors.InvalidRngError:   # draws in evaluation too (a VAE's sampler)
            # Not compared (its shards draw their own numbers), but the layers after it
            # are: they get its degree-1 output, split as its shards' would be.
            key = jax.random.key(0)
            y = jax.tree.map(np.asarray, _forward(layer, key)(v, x))
            if takes_split:
                with tensor_parallel.degree(model):
                    y_t = tensor_parallel.eval_shape(
                        _forward(layer, key),
                        *_shard_vars_and_input(layer, v, dims[i], x, in_dims, model, 0))
                in_dims = jax.tree.map(_split_dim, y, y_t)
            x = y
            continue
        if not takes_split:
            x = jax.tree.map(np.asarray, _program(_forward, layer)(v, x))
            continue
        ct = jax.tree.map(lambda a: np.random.default_rng(i).normal(size=a.shape).astype(
            a.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else None, y_shapes)
        grads = _differentiable(x, y_shapes)
        y, *want_grads = jax.tree.map(np.asarray, _program(_forward_and_pull, layer)(v, x, ct)
                                      if grads else (_program(_forward, layer)(v, x),))
        got = _at_degree(layer, v, dims[i], x, in_dims, ct, grads, model, mesh)
        out_dims = jax.tree.map(_split_dim, y, jax.tree.map(lambda a: a[0], got[0]))
        want, dims_of = [y], [out_dims]
        if grads:
            want += want_grads
            dims_of += [dims[i].get("params") or None, in_dims]   # None: nothing split
        bits = _least_float_bits(jaxpr)
        # The first layer's input gradient is never used (its input is the data).
        for what, w_tree, d_tree, g_tree in list(zip(("outputs", "parameter gradients",
                                                       "input gradients"), want, dims_of,
                                                      got))[:3 if i else 2]:
            for j in range(model):
                _compare(i, layer, what, jax.tree.map(lambda a: a[j], g_tree),
                         _shard(w_tree, d_tree, model, j, layer), model, bits)
        x, in_dims = y, out_dims


def _varied_leaves(tree, seed: int):
    """tree with each floating leaf whose entries are all equal (a zero-initialised bias,
    a LayerNorm's ones, a ReZero gate, a sample of zeros) drawn at random around its
    value: a bias added before the row-parallel sum is added T times, which zeros cannot
    show."""
    rng = np.random.default_rng(seed + 1)

    def vary(a):
        a = np.asarray(a)
        if not jnp.issubdtype(a.dtype, jnp.floating) or a.size == 0 or np.any(a != a.flat[0]):
            return a
        scale = 0.5 * max(1.0, abs(float(a.flat[0])))
        return (a + rng.normal(scale=scale, size=a.shape)).astype(a.dtype)
    return jax.tree.map(vary, tree)


def _forward(layer, rng=None):
    return lambda v, x: apply_layer(layer, v, x, train=False, rng=rng)[0]


def _forward_and_pull(layer):
    """(output, parameter gradients, input gradients) of the layer at x for output
    cotangent ct."""
    def run(v, x, ct):
        f = lambda p, xx: apply_layer(layer, {**v, "params": p}, xx, train=False)[0]
        y, pull = jax.vjp(f, v.get("params", {}), x)
        return (y, *pull(ct))
    return run


def _program(make, layer, *args):
    """`make(layer, *args)` jitted, one per equal layer (a model's repeated blocks compile
    once; run op by op, a transformer block's check took seconds)."""
    try:
        return _cached_program(make, layer, *args)
    except TypeError:   # a layer with unhashable fields
        return jax.jit(make(layer, *args))


@functools.lru_cache(maxsize=64)
def _cached_program(make, layer, *args):
    return jax.jit(make(layer, *args))


def _least_float_bits(jaxpr) -> int:
    """The fewest bits of any floating value a layer's forward `jaxpr` computes (16 for a
    float32 layer that runs its matmuls in bfloat16: `nn.Dense(dtype=jnp.bfloat16)`)."""
    avals = [o.aval for e in jaxpr.jaxpr.eqns for o in e.outvars]
    return min([jnp.finfo(a.dtype).bits for a in avals
                if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)], default=32)


def _differentiable(x, y) -> bool:
    """Gradients are compared where every input and output leaf is floating."""
    return all(jnp.issubdtype(a.dtype, jnp.floating) for a in jax.tree.leaves((x, y)))


def _at_degree(layer, v, dims: dict, x, in_dims, ct, grads: bool, model: int, mesh: Mesh):
    """On every model shard (stacked: [model, ...] per leaf) the layer's output and, with
    `grads`, its parameter and input gradients for the shard's part of `ct`."""
    shards, xs = zip(*[_shard_vars_and_input(layer, v, dims, x, in_dims, model, j)
                       for j in range(model)])
    stack = lambda trees: jax.tree.map(lambda *a: np.stack(a), *trees)
    with tensor_parallel.degree(model):   # the shapes of a shard's output
        y_t = tensor_parallel.eval_shape(_forward(layer), shards[0], xs[0])
    cts = [_shard(ct, jax.tree.map(_split_dim, ct, y_t), model, j, layer)
           for j in range(model)] if grads else [0] * model

    run = _program(_sharded, layer, grads, mesh)
    with jax.threefry_partitionable(False):
        return jax.tree.map(np.asarray, run(stack(shards), stack(xs), stack(cts)))


def _shard_vars_and_input(layer, v, dims: dict, x, in_dims, model: int, j: int):
    """Model shard j's variables and input, cut as the pipeline cuts them."""
    return ({c: _shard(tree, dims.get(c), model, j, layer) for c, tree in v.items()},
            _shard(x, in_dims, model, j, layer))


def _sharded(layer, grads: bool, mesh: Mesh):
    """The layer at degree mesh.size in a shard_map over "model": (output, and with
    `grads` parameter and input gradients) per shard, stacked."""
    model = mesh.size

    def body(v, x, ct):
        v, x, ct = jax.tree.map(lambda a: a[0], (v, x, ct))
        with tensor_parallel.degree(model):
            out = _forward_and_pull(layer)(v, x, ct) if grads else (_forward(layer)(v, x),)
        return jax.tree.map(lambda a: a[None], out)

    return jax.shard_map(body, mesh=mesh, in_specs=P(tensor_parallel.MODEL),
                         out_specs=P(tensor_parallel.MODEL), check_vma=False)


def _split_dim(whole, part) -> int:
    """The dimension a shard's output is split along (-1: whole)."""
    diff = [k for k, (a, b) in enumerate(zip(np.shape(whole), np.shape(part))) if a != b]
    return diff[0] if diff else -1


def _shard(tree, dims, model: int, j: int, layer):
    """Model shard j of a tree cut as the pipeline cuts variables (`model_shards.shard`)."""
    return model_shards.shard(tree, dims, model, j, type(layer).__name__)


def _compare(i: int, layer, what: str, got, want, model: int, bits: int) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if not jnp.issubdtype(w.dtype, jnp.floating) or not w.size:
            continue
        low = min(bits, jnp.finfo(w.dtype).bits) < 32
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            raise ValueError(f"Pipeline: layer {i} ({type(layer).__name__}) gives outputs of "
                             f"shape {g.shape} on a model shard where its degree-1 output's "
                             f"block is {w.shape}; split outputs in equal blocks.")
        # Entries not finite at degree 1 (a layer's log of the random sample) say nothing.
        finite = np.isfinite(w)
        if not finite.any():
            continue
        g, w = g[finite], w[finite]
        # Rounding differs with the summation order: float32 ~1e-6, bfloat16 ~1e-2.
        tol = (2e-2 if low else 1e-4) * max(1.0, float(np.max(np.abs(w))))
        err = float(np.max(np.abs(g - w)))
        if not err <= tol:
            raise ValueError(
                f"Pipeline: layer {i} ({type(layer).__name__}) computes another function at "
                f"model={model} than at model=1 ({what} differ by up to {err:.3g} on the "
                f"sample); the pipeline cuts each split dimension into {model} contiguous "
                f"blocks, so lay fused dimensions out shard-major (q, k, v as (heads, 3, "
                f"head_dim) or nn.DenseGeneral(features=(3, heads, head_dim)), not [q | k | "
                f"v]), normalise only over whole features, gather a split input before a "
                f"layer that mixes features (gather_from_model), add a row-parallel bias "
                f"after reduce_from_model, and pass a column-parallel layer's input and a "
                f"whole parameter used on split features through copy_to_model "
                f"(docs/pipeline.md, 'Rules a tensor-parallel layer must keep').")
