"""The burst executor's argument checks: the program's layers, widths and batch size,
the rows of a batch or of per-device state, and an optimizer that must act layer by
layer (`pipeline.optimizer_checks.check_layer_by_layer`)."""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import numpy as np

from jaxhybrid.checks import is_int

PyTree = Any


def check_program(layers: Sequence, widths: Sequence, batch_size) -> None:
    """What `check_widths` cannot see: no layers (an IndexError in the first step), a
    batch size of 0 (a multiple of every device count) or not a whole number, a width
    such as 2.7 (truncated to 2 by int(), silently)."""
    if not layers:
        raise ValueError("BurstProgram: no layers; pass the model's list of flax Modules.")
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"BurstProgram: batch_size={batch_size!r} must be an int >= 1 (the "
                         f"global batch).")
    odd = [w for w in widths if not is_int(w)]
    if odd:
        raise ValueError(f"BurstProgram: widths must be whole numbers of devices, got "
                         f"{odd[0]!r}.")


def check_widths(widths: Sequence[int], num_layers: int, G: int, batch_size: int) -> None:
    if len(widths) != num_layers:
        raise ValueError(f"burst: {len(widths)} widths for {num_layers} layers; give one per layer.")
    if batch_size % G:
        raise ValueError(f"burst: batch_size={batch_size} must be a multiple of the {G} devices "
                         f"of the data axis.")
    for l, g in enumerate(widths):
        # A width that does not divide G (4 of 6 devices) broke the relayouts with a shape
        # error; G itself (6) is plain data parallelism, power of two or not.
        if g < 1 or g > G or G % g or (g & (g - 1) and g != G):
            raise ValueError(f"burst: width {g} of layer {l} must be a power of two dividing "
                             f"the {G} devices of the data axis, or {G}.")


def check_rows(what: str, tree: PyTree, rows: int, fix: str) -> None:
    """Every leaf of `tree` has `rows` as its leading dimension (traced shapes are
    static: checked while the step is traced)."""
    for path, a in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = np.shape(a)
        if not shape or shape[0] != rows:
            raise ValueError(f"burst: {what}{jax.tree_util.keystr(path)} has shape "
                             f"{tuple(shape)}; its leading dimension must be {rows}: {fix}")


def check_batch(program, inputs, targets) -> None:
    """The global batch must have the program's batch_size rows (other row counts were
    split over the devices anyway and failed deep inside a layer or the loss)."""
    B = program.batch_size
    fix = f"the program was built with batch_size={B} (BurstProgram(..., batch_size))."
    check_rows("inputs", inputs, B, fix)
    check_rows("targets", targets, B, fix)


def check_stacked(what: str, tree: PyTree, G: int) -> None:
    check_rows(what, tree, G, "state is kept per device: pass burst.replicate(variables, "
                              "mesh) or burst.init_train_state(optimizer, variables, mesh).")


def _once_per_optimizer(fn):
    """`fn(optimizer, *args)`, computed once per optimizer and arguments (an optax
    optimizer is a hashable tuple of functions; anything unhashable is computed at every
    call): `train_step` checks at every step."""
    cached = functools.lru_cache(maxsize=32)(fn)

    def call(*args):
        try:
            hash(args)
        except TypeError:
            return fn(*args)
        return cached(*args)
    return call


@_once_per_optimizer
def checked_optimizer(optimizer, who: str) -> None:
    """`optimizer_checks.check_layer_by_layer` (imported here: it pulls in the pipeline
    package, which burst programs need not load)."""
    from jaxhybrid.pipeline.optimizer_checks import check_layer_by_layer
    check_layer_by_layer(optimizer, who)


@_once_per_optimizer
def _init_structure(optimizer, treedef, avals):
    """The tree structure of `optimizer.init` on parameters of these shapes and dtypes."""
    return jax.tree.structure(jax.eval_shape(optimizer.init, jax.tree.unflatten(treedef, avals)))


def check_opt_state(optimizer, train_state, who: str) -> None:
    """The train state's optimizer state is the one `optimizer` makes (a state built for
    SGD stepped with Adam failed inside the step: "'TraceState' object has no attribute
    'mu'"). Traced once per optimizer and parameter shapes (2.5 ms a step on ten layers)."""
    leaves, treedef = jax.tree.flatten(train_state["params"])
    want = _init_structure(optimizer, treedef,
                           tuple(jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in leaves))
    if want != jax.tree.structure(train_state["opt_state"]):
        raise ValueError(f"{who}: train_state's opt_state was made by another optimizer than "
                         f"the one given; build the state with burst.init_train_state(this "
                         f"optimizer, variables, mesh), or pass the optimizer it was made with.")
