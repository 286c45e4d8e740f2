"""Checkpoints that do not depend on the device layout or the number of processes.

The pipeline keeps parameters packed per stage ({buffer key: [pipe, length]} buffers whose
contents depend on the stage boundaries), and the optimizer runs on those buffers, so
its moment estimates are packed the same way. A checkpoint stores neither: it stores,
for every layer, that layer's flax variables and its share of every parameter-shaped
optimizer slot (Adam's mu and nu, SGD's momentum trace), plus the optimizer's other
leaves (step counts). Restoring packs them again for whatever mesh and boundaries the
new run uses, so a run saved on (data=2, pipe=4) continues on (4, 2) or (1, 1), with one
process or several, with the very same numbers. With a tensor-parallel "model" axis the
stage buffers hold one row per (pipe device, model shard); a checkpoint stores each
layer's whole variables (its model shards joined), so a model=2 run restores into model=1
and back.

On disk (orbax CheckpointManager; a step directory appears only once every process has
finished writing it):

    <directory>/<step>/state   {"layers": [{"variables": {...}, "opt": [slot, ...]}, ...],
                                "opt_rest": [non-parameter optimizer leaves]}
    <directory>/<step>/meta    JSON: step, rng (key data), data_position, loss_window (the
                               losses since the last record), layout (with the schedule
                               and optimizer updates per step), shapes ({leaf path: shape}
                               of "state", checked before a restore), checksums (per
                               leaf, checked after: `checkpoint_meta`)

A model given to the pipeline as one linen module (split by `jaxhybrid.splitter`) is
saved as one "layer" holding the model's own variable tree (as `model.init` returns it)
and optimizer slots shaped like its "params", so the checkpoint does not depend on the
cuts either, and the model's own code can read it.

Every layer's leaf is saved spread over all devices of the mesh (split along its first
axis that the device count divides; small leaves that no axis fits stay replicated), so
every process writes only the shards on its own devices (orbax/tensorstore, one file set
per process), about 1/processes of the bytes; nothing is gathered to one host. When
every process holds every stage (one process, or "data" across processes) the leaves
are cut from the process's own rows on the host, and a restore reads whole leaves into
each process and packs them on the host. Otherwise one jitted program cuts and spreads
them (XLA moves the rows between processes; it compiles slowly for models with many
leaves), and its inverse packs the restored shards.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import threading
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid.checkpoint_meta import (checksum_difference, checksums, difference, layout_of,
                                       leaf_shapes, schedule_note, shapes, updates_difference)
from jaxhybrid.mesh import DATA, PIPE
from jaxhybrid.pipeline import model_shards, packing
from jaxhybrid.pipeline.arguments import outside_context_mesh
from jaxhybrid.splitter.pipeline_hooks import (from_model_entries, holds_model_tree,
                                               to_model_entries)

PyTree = Any


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit the model or optimizer restoring it."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (a full disk, no permission); names the directory."""


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


def _short(error, limit: int = 160) -> str:
    """An orbax / tensorstore error in a few words: its first line, without the
    tensorstore spec (a page of JSON) that follows."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    for cut in (" [tensorstore_spec=", ". See full TensorStore details"):
        text = text.split(cut)[0]
    return text if len(text) <= limit else text[:limit] + "..."


def _finish_at_exit(checkpointer: "Checkpointer") -> None:
    """Finishes `checkpointer`'s pending asynchronous save when the program ends: a
    script that saved and returned without `wait` / `close` exited 0 with only a
    temporary step directory (orbax's commit cannot start once the interpreter shuts its
    thread pools down). threading's exit hooks run newest first, before those pools shut
    down; atexit's would run after them. One process only: on several, the save's
    commit waits for the others, which may be gone (`close` there)."""
    if jax.process_count() > 1:
        return
    ref = weakref.ref(checkpointer)

    def finish():
        ck = ref()
        if ck is not None and not ck._closed:
            ck.wait()

    register = getattr(threading, "_register_atexit", None) or atexit.register
    register(finish)


class Checkpointer:
    """Saves and restores train states in the per-layer format, under `directory`
    (keeps the newest `keep` steps). Orbax writes each step into a temporary directory
    and renames it when complete, so a crash never leaves a half-written step."""

    def __init__(self, directory: str | os.PathLike, *, keep: int):
        self.directory = os.path.abspath(os.fspath(directory))
        # Handlers named up front: `check` reads a step's metadata before any restore.
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})
        self._closed = False
        _finish_at_exit(self)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    @outside_context_mesh()   # under a user's jax.set_mesh, restore's sums failed
    def save(self, step: int, pipe, state: dict, meta: dict) -> None:
        """Saves `state` (per layer; each process writes the shards on its devices) and
        JSON-able `meta` as step `step`. Every process calls this. Asynchronous: the
        write finishes in the background (see `wait`)."""
        if not isinstance(state, dict) or set(state) != {"variables", "opt_state"}:
            raise ValueError(f"Checkpointer.save: state must be {{'variables': packed "
                             f"variables, 'opt_state': the optimizer state (or ())}}, got "
                             f"{sorted(state) if isinstance(state, dict) else type(state).__name__}.")
        newest = self.latest_step()
        if newest is not None and int(step) <= newest:
            # Orbax skips a step at or below its newest one without a word: a loop resumed
            # from an older step lost every save up to the old newest.
            raise CheckpointWriteError(
                f"checkpoint: cannot save step {int(step)} in {self.directory}: step "
                f"{newest} is there already and steps are kept in increasing order; save into "
                f"a fresh directory, or move the steps from {int(step)} on away first.")
        portable = to_portable(pipe, state)
        meta = {**meta, "step": int(step), "processes": jax.process_count(),
                "shapes": {p: list(shape) for p, shape in leaf_shapes(portable).items()},
                "checksums": checksums(portable), "layout": layout_of(pipe)}
        with self._writing():     # also reports a failure of the previous (async) save
            self._manager.save(int(step), args=ocp.args.Composite(
                state=ocp.args.StandardSave(portable), meta=ocp.args.JsonSave(meta)))

    def check(self, pipe, template: dict, step: int | None = None) -> None:
        """Does `step` (default: the latest) fit `pipe` and the optimizer state of
        `template` (arrays or jax.ShapeDtypeStructs)? Reads only the step's metadata, so
        it runs before anything is compiled; a mismatch -> CheckpointMismatch naming the
        first differing layer leaf, or the layer / optimizer-slot counts."""
        step = self.latest_step() if step is None else int(step)
        if step is None:
            return
        try:
            saved, layout = self._saved_shapes_and_layout(step)
        except Exception as e:  # noqa: BLE001 (orbax/tensorstore raise plain Exceptions)
            raise CheckpointMismatch(self._damaged(step, e)) from None
        if not saved:
            raise CheckpointMismatch(self._damaged(step, "no arrays in its state"))
        why = difference(saved, leaf_shapes(jax.eval_shape(
            functools.partial(_portable, pipe), template)), schedule_note(layout, pipe))
        if not why and jax.tree.leaves(template.get("opt_state")):
            why = updates_difference(layout, pipe)
        if why:
            raise CheckpointMismatch(self._mismatch(step, why))

    def _saved_shapes_and_layout(self, step: int) -> tuple[dict, dict | None]:
        """({leaf path: shape} of a step's portable tree, its saved layout): from its
        meta JSON (one small file), or from orbax's array metadata for checkpoints
        written before it was kept there."""
        meta = self._manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]
        if isinstance(meta, dict) and isinstance(meta.get("shapes"), dict):
            return ({p: tuple(shape) for p, shape in meta["shapes"].items()},
                    meta.get("layout"))
        return leaf_shapes(self._manager.item_metadata(step)["state"]), None

    @outside_context_mesh()
    def restore(self, pipe, template: dict, step: int | None = None) -> tuple[dict, dict]:
        """(train state packed for `pipe`, meta) of `step` (default: the latest).
        A checkpoint from another model or optimizer -> CheckpointMismatch naming the
        difference; a damaged one -> CheckpointMismatch naming the step to resume from."""
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise ValueError(f"checkpoint: no checkpoint in {self.directory}.")
        self.check(pipe, template, step)
        target = abstract_portable(pipe, template)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
            meta = restored["meta"]
            # Only "step" is the Checkpointer's own: a meta of a user's without "rng"
            # (train.py's) was saved and then refused as damaged.
            if not isinstance(meta, dict) or "step" not in meta:
                raise ValueError("its meta JSON has no step")
        except Exception as e:  # noqa: BLE001 (a truncated file: tensorstore's Exception)
            # A truncated or missing data file raised a plain Exception (a traceback with
            # pages of tensorstore spec), or "does not fit this model" for a damaged file.
            raise CheckpointMismatch(self._damaged(step, e)) from None
        if shapes(restored["state"]) != shapes(target):
            raise CheckpointMismatch(self._mismatch(step, "parameter shapes differ"))
        bad = checksum_difference(meta.get("checksums"), restored["state"])
        if bad:
            raise CheckpointMismatch(self._damaged(step, bad))
        return from_portable(pipe, restored["state"], template), dict(meta)

    def _older(self, step) -> str:
        older = [s for s in self.all_steps() if s < step]
        return f" to resume from step {older[-1]}." if older else "."

    def _mismatch(self, step, why):
        # Names the older steps too: they are still there to resume from.
        return (f"checkpoint: step {step} in {self.directory} does not fit this model and "
                f"optimizer ({why}); resume with the config it was saved with, or use a "
                f"fresh workdir; if that step directory is incomplete or damaged, move it "
                f"away" + self._older(step))

    def _damaged(self, step, error) -> str:
        return (f"checkpoint: step {step} in {self.directory} cannot be read "
                f"({_short(error)}): it is incomplete or damaged; move it away"
                + self._older(step))

    @contextlib.contextmanager
    def _writing(self):
        """A failed write (orbax raises it at the next save or wait, as a ValueError
        "RESOURCE_EXHAUSTED ..." or an OSError, with pages of traceback) ->
        CheckpointWriteError in one line."""
        try:
            yield
        except (OSError, ValueError) as e:
            self._manager.reload()                     # steps on disk, not those begun
            last = self.latest_step()
            raise CheckpointWriteError(
                f"checkpoint: writing to {self.directory} failed ({_short(e)}); free space "
                f"there or use another --workdir (last complete checkpoint: "
                f"{'none' if last is None else f'step {last}'}).") from None

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are on disk."""
        with self._writing():
            self._manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._closed = True
            self._manager.close()
