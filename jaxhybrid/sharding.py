"""Logical axis names of model parameters/activations, and the rules that map them onto
the ("data", "pipe") mesh.

Every parameter of every jaxhybrid model is created through
`nn.with_logical_partitioning(init, names)` with names from `LOGICAL_AXES`, so a model
says *what* each dimension is, and the rules below say *where* it lives. On the
("data", "pipe") mesh:

* "batch" -> "data": activations and input batches are split over data replicas;
* every weight dimension -> None: weights are replicated within a stage (data
  parallelism keeps a full copy per replica);
* "pipe" is never named by a rule: the pipeline alone owns that axis (it stacks stage
  parameter buffers along it). A layer that named "pipe" would make XLA insert
  collectives inside one stage's branch, which deadlocks (see DESIGN.md).

With tensor parallelism (a "model" mesh axis, `make_mesh(model=T)`), the names in
`TENSOR_PARALLEL_AXES` map to "model": the pipeline packs each stage's parameters per
model shard, split along the dimensions their layers build at 1 / T
(`variable_split_dims`; what is built decides, the names only say what is meant), and
the layers compute on their shard with explicit collectives over "model"
(`jaxhybrid.tensor_parallel`). Only
names whose layers are written for it are mapped: "heads" and "mlp" (GPT blocks,
Megatron column/row-parallel). Others stay replicated over "model": "vocab" too, since
common vocabularies (257, 50257) are odd; a layer without them (convolutions, LSTMs,
the heterogeneous test model) runs replicated within its model group.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P

from jaxhybrid.mesh import DATA, MODEL

# What each logical name means (documentation and the set the tests check against).
LOGICAL_AXES: dict[str, str] = {
    "batch": "examples of a batch (activations, inputs, targets)",
    "length": "time / sequence position",
    "vocab": "token vocabulary (embedding rows, softmax columns)",
    "embed": "model / embedding width (GPT d_model, LSTM projection or input width)",
    "positions": "learned position-embedding rows",
    "heads": "attention heads",
    "kv": "per-head feature width",
    "qkv": "the query/key/value triple of a fused attention projection",
    "mlp": "transformer feed-forward hidden width",
    "lstm_in": "input width of an LSTM layer",
    "lstm_hidden": "LSTM cell / hidden width",
    "lstm_gates": "the 4 x hidden gate pre-activations of an LSTM",
    "attention": "additive-attention hidden width (GNMT)",
    "conv_height": "convolution kernel height",
    "conv_width": "convolution kernel width",
    "conv_in": "convolution input channels",
    "conv_out": "convolution output channels (also BatchNorm features)",
    "classes": "classifier outputs",
}

# Rules for the ("data", "pipe") mesh: only the batch is split; weights replicated.
DATA_PIPE_RULES: tuple[tuple[str, Any], ...] = (("batch", DATA),) + tuple(
    (name, None) for name in LOGICAL_AXES if name != "batch")


# Logical names split over "model" on a mesh with a "model" axis.
TENSOR_PARALLEL_AXES: tuple[str, ...] = ("heads", "mlp")
MODEL_RULES: tuple[tuple[str, Any], ...] = tuple(
    (name, MODEL if name in TENSOR_PARALLEL_AXES else axis) for name, axis in DATA_PIPE_RULES)


def logical_axis_rules(model: bool = False) -> tuple[tuple[str, Any], ...]:
    """The (logical name, mesh axis or None) rules for the ("data", "pipe") mesh, or with
    model=True for ("data", "pipe", "model")."""
    return MODEL_RULES if model else DATA_PIPE_RULES


def model_split_dims(boxed: Any) -> Any:
    """Boxed flax variables -> the same tree with, per leaf, the dimension split over
    "model" by `MODEL_RULES` (-1: replicated; also for unannotated leaves)."""
    def dim(leaf):
        # With two names on "model" (GSPMD's ("mlp", "heads") kernel) the first: only a
        # guess, which what the layer builds replaces (`variable_split_dims`); it was
        # refused, though a layer that builds such a leaf whole runs replicated.
        names = leaf.names if isinstance(leaf, nn.LogicallyPartitioned) else ()
        split = [i for i, n in enumerate(names) if n in TENSOR_PARALLEL_AXES]
        return split[0] if split else -1
    return jax.tree.map(dim, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def layer_split_dims(layer: nn.Module, x: Any, *, train: bool = False,
                     boxed_params: Any = None, asks_degree: bool = False) -> tuple[Any, Any]:
    """(the layer's boxed abstract "params" from `init` on input x, or `boxed_params` when
    the caller traced them already; its tree of dims split over "model"): the "params"
    part of `variable_split_dims`."""
    boxed, dims = variable_split_dims(
        layer, x, train=train, boxed=None if boxed_params is None else {"params": boxed_params},
        asks_degree=asks_degree)
    return boxed.get("params", {}), dims.get("params", {})


def variable_split_dims(layer: nn.Module, x: Any, *, train: bool = False,
                        boxed: Any = None, asks_degree: bool = False,
                        at: tuple[int, Any] | None = None) -> tuple[Any, Any]:
    """(the layer's boxed abstract variables from `init` on input x, or `boxed` when the
    caller traced them already; per collection, its tree of dims split over "model").
    What the layer builds decides, leaf by leaf: a leaf (a parameter, or state such as
    the batch statistics of features split over "model") is split along the dimension
    it builds at 1 / T of its width at model degree T (`jaxhybrid.tensor_parallel.local`),
    whatever its logical names; a leaf built whole is kept whole and runs replicated in
    its model group, even if its names put a dimension on "model" (any Flax layer
    annotated with "mlp" or "heads" for GSPMD-style sharding: it would compute wrongly
    on a slice). `asks_degree`: the caller saw the layer ask for the model degree
    (`tensor_parallel.watch`) while tracing it, else `boxed` is traced anew under a watch.
    `at`: (the degree T the pipeline runs, the layer's input at that degree: a layer
    after a column-parallel one gets a split input and builds its kernel from it), else
    the smallest degree the layer accepts, on x. No FLOPs, nothing allocated."""
    asked = [True] if asks_degree else []
    if boxed is None:
        from jaxhybrid import tensor_parallel
        with tensor_parallel.watch() as asked:
            boxed = _abstract_init(layer, x, train)
    dims = model_split_dims(boxed)
    split_input = at is not None and _avals(at[1]) != _avals(x)
    if asked or split_input or any(d >= 0 for d in jax.tree.leaves(dims)):
        dims = _local_dims(layer, x, train, boxed, dims, at)
    return boxed, dims


def _avals(tree: Any) -> list:
    return [(tuple(a.shape), a.dtype) for a in jax.tree.leaves(tree)]


def _abstract_init(layer: nn.Module, x: Any, train: bool) -> Any:
    from jaxhybrid import tensor_parallel
    from jaxhybrid.layers import mode_kwargs
    kwargs = mode_kwargs(layer, train)
    return tensor_parallel.eval_shape(
        lambda k, x: layer.init({"params": k, "dropout": k}, x, **kwargs), jax.random.key(0), x)


def _local_dims(layer: nn.Module, x: Any, train: bool, variables: Any, dims: Any,
                at: tuple[int, Any] | None) -> Any:
    """Per leaf of `variables` (some of the layer's collections), the dimension `layer`
    builds at 1 / t of its width when traced at model degree t (`at`'s on its input, else
    the smallest divisor t > 1 of its widths that the layer accepts, on x), -1 for a leaf
    built whole; `dims` (from the names) when no degree fits, for `model_shards.shard`
    to name the divisors. A layer that builds split parameters from a split input
    without joining its model group may be right (a per-feature scale, a BatchNorm) or
    wrong (a Dense whose partial sums nobody adds): `pipeline.degree_check` runs it."""
    from jaxhybrid import tensor_parallel
    params = nn.meta.unbox(variables)
    full = jax.tree.leaves(params)
    name = type(layer).__name__
    widths = {n for a in full for n in a.shape}   # a split width divides by t
    degrees = sorted({t for n in widths for t in range(2, n + 1) if n % t == 0})
    for t in degrees if at is None else [at[0]]:
        try:
            with tensor_parallel.degree(t):
                local = nn.meta.unbox(_abstract_init(layer, x if at is None else at[1], train))
        except ValueError:    # e.g. 3 heads at degree 2
            if at is not None:
                raise
            continue
        local = {c: local.get(c) for c in params}
        if jax.tree.structure(local) != jax.tree.structure(params):
            raise ValueError(f"tensor parallel: {name} builds other parameters at model "
                             f"degree {t} than at 1; build the same ones, each dimension at "
                             f"its width / model degree (jaxhybrid.tensor_parallel.local).")
        paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(params)[0]]
        out = [_split_dim(a.shape, b.shape, t, f"{name}{path}")
               for a, b, path in zip(full, jax.tree.leaves(local), paths)]
        return jax.tree.unflatten(jax.tree.structure(dims), out)
    return dims


def _split_dim(full: tuple, local: tuple, t: int, what: str) -> int:
    """The one dimension in which `local` is `full` / t (-1: none)."""
    changed = [i for i, (a, b) in enumerate(zip(full, local)) if a != b]
    if len(full) == len(local) and (not changed or (len(changed) == 1
                                                      and full[changed[0]] == local[changed[0]] * t)):
        return changed[0] if changed else -1
    raise ValueError(f"tensor parallel: {what} has shape {full} at model degree 1 but {local} "
                     f"at degree {t}; split one dimension, to its width / model degree "
                     f"(jaxhybrid.tensor_parallel.local), or none.")


@contextlib.contextmanager
def axis_rules() -> Iterator[None]:
    """`with axis_rules(): ...` — flax's `nn.logical_axis_rules` with jaxhybrid's rules."""
    with nn.logical_axis_rules(DATA_PIPE_RULES):
        yield


def logical_to_mesh_spec(names: tuple[str | None, ...]) -> P:
    """Logical names of one array's dimensions -> its PartitionSpec on the mesh."""
    unknown = [n for n in names if n is not None and n not in LOGICAL_AXES]
    if unknown:
        raise ValueError(f"logical_to_mesh_spec: unknown logical axes {unknown}; "
                         f"known: {sorted(LOGICAL_AXES)}.")
    return nn.logical_to_mesh_axes(names, DATA_PIPE_RULES)


def param_mesh_specs(boxed_variables: Any) -> Any:
    """Boxed (not yet unboxed) flax variables -> tree of PartitionSpecs on the mesh.
    Unannotated leaves get P() (replicated)."""
    logical = nn.get_partition_spec(boxed_variables)
    return jax.tree.map(lambda spec: logical_to_mesh_spec(tuple(spec)), logical,
                        is_leaf=lambda x: isinstance(x, P))


def unannotated_params(boxed_variables: Any) -> list[str]:
    """Paths of "params" leaves that carry no logical axis names (should be empty for
    every jaxhybrid model). Flax boxes annotated leaves in `nn.LogicallyPartitioned`."""
    params = boxed_variables.get("params", {})
    flat = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
    return [jax.tree_util.keystr(path) for path, leaf in flat
            if not isinstance(leaf, nn.LogicallyPartitioned)
            or len(leaf.names) != len(getattr(leaf.value, "shape", ()))]
