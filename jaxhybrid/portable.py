"""A training state in a form that does not depend on the device layout: per layer.

The pipeline keeps parameters packed per stage ({buffer key: [pipe, length]} buffers whose
contents depend on the stage boundaries), and the optimizer runs on those buffers, so
its moment estimates are packed the same way. The portable form stores neither: for
every layer, that layer's flax variables and its share of every parameter-shaped
optimizer slot (Adam's mu and nu, SGD's momentum trace), plus the optimizer's other
leaves (step counts). Packing them again for another mesh and boundaries continues a run
saved on (data=2, pipe=4) on (4, 2) or (1, 1), with one process or several, with the very
same numbers. With a tensor-parallel "model" axis the stage buffers hold one row per
(pipe device, model shard); the portable form holds each layer's whole variables (its
model shards joined), so a model=2 run restores into model=1 and back. A model given as
one linen module (split by `jaxhybrid.splitter`) is one "layer" holding the model's own
variable tree (as `model.init` returns it) and slots shaped like its "params".

Every leaf is spread over all devices of the mesh (split along its first axis that the
device count divides; small leaves that no axis fits stay replicated), so every process
writes only the shards on its own devices. When every process holds every stage (one
process, or "data" across processes) the leaves are cut from the process's own rows on
the host, and a restore packs whole leaves on the host. Otherwise one jitted program cuts
and spreads them (XLA moves the rows between processes; it compiles slowly for models
with many leaves), and its inverse packs the restored shards. `jaxhybrid.checkpoint`
writes and reads this form.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid.mesh import DATA, PIPE
from jaxhybrid.pipeline import model_shards, packing
from jaxhybrid.splitter.pipeline_hooks import (from_model_entries, holds_model_tree,
                                               to_model_entries)

PyTree = Any


# --- parameter-shaped trees <-> per layer -------------------------------------------
def _param_slot_test(params: dict):
    """Predicate: is a node of an optimizer state shaped like the packed params: a dict
    with the params' buffer keys whose values are arrays of the buffers' shapes (Adam's
    mu), or the same container of such arrays under every key (a state made by
    `jax.tree.map(lambda p: {"m": ..., "v": ...}, params)`: one slot per array in it,
    `_slots`)?"""
    shapes = {k: tuple(np.shape(v)) for k, v in params.items()}

    def is_slot(node) -> bool:
        if not (isinstance(node, dict) and set(node) == set(shapes)):
            return False
        structure = None
        for k, s in shapes.items():
            leaves, treedef = jax.tree.flatten(node[k])
            if not leaves or any(not hasattr(l, "shape") or tuple(l.shape) != s for l in leaves):
                return False
            if structure is not None and structure != treedef:   # another container
                return False
            structure = treedef
        return True
    return is_slot


def _slots(node: dict) -> list[dict]:
    """A parameter-shaped node (`_param_slot_test`) as its slots, {buffer key: array}
    each: itself, or one per array of the container under each key."""
    flat = {k: jax.tree.leaves(v) for k, v in node.items()}
    return [{k: leaves[i] for k, leaves in flat.items()}
            for i in range(len(next(iter(flat.values()))))]


def _from_slots(template: dict, slots: list[dict]) -> dict:
    """`_slots`' inverse: the slots put back into `template`'s containers."""
    return {k: jax.tree.unflatten(jax.tree.structure(v), [slot[k] for slot in slots])
            for k, v in template.items()}


def leaf_sharding(mesh, shape) -> NamedSharding:
    """Where a per-layer leaf lives in the portable format: split over every device of
    `mesh` along its first axis that the device count divides, else replicated."""
    n = mesh.size
    for axis, size in enumerate(shape):
        if size % n == 0:
            return NamedSharding(mesh, P(*([None] * axis), (DATA, PIPE)))
    return NamedSharding(mesh, P())


def _dims(pipe, i: int, collection: str):
    """Layer i's tree of dims split over "model" (None: nothing is split)."""
    return pipe._dims(i, collection)


def _unpack_rows(pipe, collection: str, rows: dict, unpack, xp) -> list:
    """Stacked {key: [S x T, length]} rows -> one whole tree per layer, with `unpack`
    (traced or numpy; `xp` its array module). A device's row holds its stages' layers
    (several with virtual stages); with a "model" axis of T, pipe device d has rows
    d * T + j, one per model shard j, joined back here (layout-independent checkpoints)."""
    T = pipe.model
    out = [None] * len(pipe.layers)
    for s, layers in enumerate(pipe.device_layers):
        shards = [unpack(pipe.param_layouts[s][collection],
                         {k: v[s * T + j] for k, v in rows.items()}) for j in range(T)]
        for n, i in enumerate(layers):
            out[i] = model_shards.merge(_dims(pipe, i, collection), [t[n] for t in shards], xp)
    return out


def _pack_rows(pipe, collection: str, per_layer: list, lengths: dict, pack, stack, xp,
               dtypes=None) -> dict:
    """Inverse of `_unpack_rows` with `pack` and `stack` (traced or numpy); buffers in
    `dtypes` where given (see `packing.pack`)."""
    rows = [pack(pipe.param_layouts[s][collection],
                 [model_shards.shard(per_layer[i], _dims(pipe, i, collection), pipe.model, j,
                                     f"layer {i}", xp) for i in layers], lengths, dtypes)
            for s, layers in enumerate(pipe.device_layers) for j in range(pipe.model)]
    return {k: stack([r[k] for r in rows]) for k in lengths}


def _unpack_collection(pipe, collection: str, buffers: dict) -> list:
    """(Traced) packed {key: [S, length]} buffers -> one tree per layer."""
    return _unpack_rows(pipe, collection, buffers, packing.unpack, jnp)


def _pack_collection(pipe, collection: str, per_layer: list, lengths: dict, dtypes=None):
    """(Traced) inverse of `_unpack_collection`: stacked [S, length] buffers."""
    return _pack_rows(pipe, collection, per_layer, lengths, packing.pack, jnp.stack, jnp, dtypes)


def _stage_spec(pipe) -> P:
    return pipe.stage_spec


def holds_every_stage(mesh) -> bool:
    """Does every process hold a device of every pipeline stage (always with one
    process; with several when "data" crosses processes)? Then checkpoints are cut and
    packed on the host, with no collective and no compilation."""
    stages: dict = {}
    for index, device in np.ndenumerate(mesh.devices):   # (data, pipe[, model])
        stages.setdefault(device.process_index, set()).add(index[1])
    return all(len(v) == mesh.shape[PIPE] for v in stages.values())


def _local_rows(buffers: dict) -> dict:
    """{key: numpy [S, length]} from this process's shards of stage buffers (rows over
    "pipe", or ("pipe", "model"))."""
    out = {}
    for k, v in buffers.items():
        rows = {}
        for shard in v.addressable_shards:
            rows.setdefault(shard.index[0].indices(v.shape[0])[0], shard.data)
        out[k] = np.concatenate([np.asarray(rows[s]) for s in range(v.shape[0])])
    return out


def _unpack_host(pipe, collection: str, buffers: dict) -> list:
    """`_unpack_collection` on the host (numpy trees), from this process's shards."""
    return _unpack_rows(pipe, collection, _local_rows(buffers), packing.unpack_numpy, np)


def _pack_host(pipe, collection: str, per_layer: list, lengths: dict, dtypes=None) -> dict:
    """`_pack_collection` on the host (numpy)."""
    return _pack_rows(pipe, collection, per_layer, lengths, packing.pack_numpy, np.stack, np,
                      dtypes)


def _host_value(leaf) -> np.ndarray:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return np.asarray(leaf.addressable_shards[0].data)   # fully replicated (restore)
    return np.asarray(leaf)


def _spread(pipe, fn):
    """jit(fn) whose outputs are laid out by `leaf_sharding` on pipe.mesh."""
    def run(*args):
        shapes = jax.eval_shape(fn, *args)
        shardings = jax.tree.map(lambda a: leaf_sharding(pipe.mesh, a.shape), shapes)
        return jax.jit(fn, out_shardings=shardings)(*args)
    return run


def unpack_like_params(pipe, buffers: dict) -> list:
    """Packed buffers laid out like variables["params"] -> one tree per layer (global
    arrays spread over the mesh; on one process np.asarray reads them)."""
    return _spread(pipe, functools.partial(_unpack_collection, pipe, "params"))(buffers)


def whole_from_shard(pipe, per_layer: list) -> list:
    """Per-layer "params" trees at one model shard's shapes (`pipe.layer_shapes`) -> the
    whole trees, each shard's copy joined along the dims split over "model" (for values
    that are the same in every shard, e.g. masks)."""
    return [model_shards.merge(_dims(pipe, i, "params"), [tree] * pipe.model)
            for i, tree in enumerate(per_layer)]


def pack_like_params(pipe, per_layer: list) -> dict:
    """One numpy tree per layer, shaped like that layer's params (the same on every
    process) -> packed buffers like variables["params"], sharded like the stage buffers
    (over "pipe", and "model" with one row per model shard)."""
    sharding = NamedSharding(pipe.mesh, _stage_spec(pipe))
    host = _pack_host(pipe, "params", per_layer, pipe.param_len)
    return {k: jax.device_put(v, sharding) for k, v in host.items()}


def opt_state_shardings(pipe, opt_state: PyTree, params: dict, zero: bool = False) -> PyTree:
    """Shardings for an (abstract) optimizer state: parameter-shaped slots like the
    params (over "pipe"; with zero also over "data"), everything else (counts) replicated."""
    is_slot = _param_slot_test(params)
    if zero:
        from jaxhybrid.pipeline import zero as zero_
        return zero_.opt_state_shardings(pipe.mesh, opt_state, params, is_slot,
                                         _stage_spec(pipe))
    stage, replicated = NamedSharding(pipe.mesh, _stage_spec(pipe)), NamedSharding(pipe.mesh, P())
    return jax.tree.map(lambda node: (jax.tree.map(lambda _: stage, node) if is_slot(node)
                                      else replicated), opt_state, is_leaf=is_slot)


# --- train state <-> portable -------------------------------------------------------
def _collections(pipe) -> list[str]:
    return ["params", *pipe.state_collections]


def _portable(pipe, state: dict, host: bool = False) -> dict:
    """(Traced, or on the host with numpy) train state -> the per-layer checkpoint tree."""
    unpack = _unpack_host if host else _unpack_collection
    variables = state["variables"]
    layers = [{"variables": {}, "opt": []} for _ in pipe.layers]
    for c in _collections(pipe):
        for layer, tree in zip(layers, unpack(pipe, c, variables[c])):
            if jax.tree.leaves(tree):            # layers without this collection: none
                layer["variables"][c] = tree
    is_slot = _param_slot_test(variables["params"])
    rest = []
    for node in jax.tree.leaves(state["opt_state"], is_leaf=is_slot):
        if is_slot(node):
            for slot in _slots(node):
                for layer, tree in zip(layers, unpack(pipe, "params", slot)):
                    layer["opt"].append(tree)
        else:
            rest.append(np.asarray(node) if host else node)
    if holds_model_tree(pipe):      # one split model: its own tree, whatever the cuts
        layers = to_model_entries(pipe, layers)
    return {"layers": layers, "opt_rest": rest}


def _from_portable(pipe, template: dict, portable: dict, host: bool = False) -> dict:
    """(Traced, or on the host) inverse of `_portable` for this pipeline's layout;
    `template` gives the optimizer state's structure (its values are not read)."""
    pack, asarray = (_pack_host, np.asarray) if host else (_pack_collection, jnp.asarray)
    layers = portable["layers"]
    if holds_model_tree(pipe):
        layers = from_model_entries(pipe, layers)
    variables = {}
    for c in _collections(pipe):
        lengths = pipe.param_len if c == "params" else pipe.state_len[c]
        per_layer = [layer["variables"].get(c, {}) for layer in layers]
        variables[c] = pack(pipe, c, per_layer, lengths)
    is_slot = _param_slot_test(template["variables"]["params"])
    nodes, treedef = jax.tree.flatten(template["opt_state"], is_leaf=is_slot)
    slot, rest, out = 0, iter(portable["opt_rest"]), []
    for node in nodes:
        if is_slot(node):
            # In the slot's own dtype (adam's mu_dtype): packed like the parameters, a
            # bf16 mu came back float32 and the next step failed; a float32 one beside
            # bf16 parameters was rounded to bf16.
            packed = []
            for like in _slots(node):
                packed.append(pack(pipe, "params", [layer["opt"][slot] for layer in layers],
                                   pipe.param_len, {k: like[k].dtype for k in pipe.param_len}))
                slot += 1
            out.append(_from_slots(node, packed))
        else:
            out.append(asarray(next(rest), dtype=node.dtype))
    return {"variables": variables, "opt_state": jax.tree.unflatten(treedef, out)}


def to_portable(pipe, state: dict) -> dict:
    """{"variables": packed, "opt_state": optax state on packed params} -> the per-layer
    checkpoint tree (global arrays spread over the mesh, see `leaf_sharding`)."""
    if getattr(pipe, "zero", False):   # ZeRO slots are split over "data": whole rows first
        params = state["variables"]["params"]
        state = {**state, "opt_state": jax.jit(lambda o: o, out_shardings=opt_state_shardings(
            pipe, jax.eval_shape(lambda o: o, state["opt_state"]), params))(state["opt_state"])}
    if not holds_every_stage(pipe.mesh):       # some stages are only on other processes
        return _spread(pipe, functools.partial(_portable, pipe))(state)
    return jax.tree.map(lambda a: jax.make_array_from_callback(
        a.shape, leaf_sharding(pipe.mesh, a.shape), lambda index: np.asarray(a[index])),
        _portable(pipe, state, host=True))


def _restore_sharding(mesh, shape) -> NamedSharding:
    """Where a restored leaf lands: spread like `leaf_sharding` for the jitted packing,
    or whole on one device of every process for packing on the host."""
    if not holds_every_stage(mesh):
        return leaf_sharding(mesh, shape)
    firsts = {}
    for device in mesh.devices.flat:
        firsts.setdefault(device.process_index, device)
    return NamedSharding(jax.sharding.Mesh(np.array(list(firsts.values())), ("p",)), P())


def abstract_portable(pipe, state: dict) -> dict:
    """`to_portable`'s result as jax.ShapeDtypeStructs with shardings (restore targets)."""
    shapes = jax.eval_shape(functools.partial(_portable, pipe), state)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=_restore_sharding(pipe.mesh, a.shape)), shapes)


def from_portable(pipe, portable: dict, template: dict) -> dict:
    """Inverse of `to_portable` for this pipeline's layout; `template` is a train state
    of this pipeline (structure and shardings of the result)."""
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), template)
    params = abstract["variables"]["params"]
    stage = NamedSharding(pipe.mesh, _stage_spec(pipe))
    shardings = {"variables": jax.tree.map(lambda _: stage, abstract["variables"]),
                 "opt_state": opt_state_shardings(pipe, abstract["opt_state"], params,
                                                    zero=getattr(pipe, "zero", False))}
    if holds_every_stage(pipe.mesh):
        host = _from_portable(pipe, abstract, jax.tree.map(_host_value, portable), host=True)
        return jax.tree.map(jax.device_put, host, shardings)
    return jax.jit(functools.partial(_from_portable, pipe, abstract),
                   out_shardings=shardings)(portable)
