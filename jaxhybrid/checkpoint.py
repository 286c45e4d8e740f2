"""Checkpoints that do not depend on the device layout.

The pipeline keeps parameters packed per stage ({buffer key: [pipe, length]} buffers whose
contents depend on the stage boundaries), and the optimizer runs on those buffers, so
its moment estimates are packed the same way. A checkpoint stores neither: it stores,
for every layer, that layer's flax variables and its share of every parameter-shaped
optimizer slot (Adam's mu and nu, SGD's momentum trace), plus the optimizer's other
leaves (step counts). Restoring packs them again for whatever mesh and boundaries the
new run uses, so a run saved on (data=2, pipe=4) continues on (4, 2) or (1, 1) with the
very same numbers.

On disk (orbax CheckpointManager; a step directory appears only once fully written):

    <directory>/<step>/state   {"layers": [{"variables": {...}, "opt": [slot, ...]}, ...],
                                "opt_rest": [non-parameter optimizer leaves]}
    <directory>/<step>/meta    JSON: step, rng (key data), data_position, layout

The format is single-process: every array is gathered to the host before saving.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid.mesh import PIPE
from jaxhybrid.pipeline import packing

PyTree = Any


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit the model or optimizer restoring it."""


# --- parameter-shaped trees <-> per layer -------------------------------------------
def _param_slot_test(params: dict):
    """Predicate: is a node of an optimizer state shaped like the packed params (a dict
    {buffer key: [pipe, length]} with the params' keys and shapes)?"""
    shapes = {k: tuple(np.shape(v)) for k, v in params.items()}

    def is_slot(node) -> bool:
        return (isinstance(node, dict) and set(node) == set(shapes)
                and all(tuple(np.shape(node[k])) == s for k, s in shapes.items()))
    return is_slot


def unpack_like_params(pipe, buffers: dict) -> list:
    """Packed buffers laid out like variables["params"] -> one numpy tree per layer."""
    host = jax.device_get(buffers)
    out = [None] * len(pipe.layers)
    for s, (a, b) in enumerate(pipe.ranges):
        row = {k: np.asarray(v[s]) for k, v in host.items()}
        for k, tree in enumerate(packing.unpack_numpy(pipe.param_layouts[s]["params"], row)):
            out[a + k] = tree
    return out


def pack_like_params(pipe, per_layer: list) -> dict:
    """One tree per layer, shaped like that layer's params -> packed buffers like
    variables["params"], sharded over "pipe"."""
    rows = [packing.pack_numpy(pipe.param_layouts[s]["params"],
                               [per_layer[i] for i in range(a, b)], pipe.param_len)
            for s, (a, b) in enumerate(pipe.ranges)]
    sharding = NamedSharding(pipe.mesh, P(PIPE))
    return {k: jax.device_put(np.stack([r[k] for r in rows]), sharding) for k in pipe.param_len}


def opt_state_shardings(pipe, opt_state: PyTree, params: dict) -> PyTree:
    """Shardings for an (abstract) optimizer state: parameter-shaped slots like the
    params (over "pipe"), everything else (counts) replicated."""
    is_slot = _param_slot_test(params)
    stage, replicated = NamedSharding(pipe.mesh, P(PIPE)), NamedSharding(pipe.mesh, P())
    return jax.tree.map(lambda node: (jax.tree.map(lambda _: stage, node) if is_slot(node)
                                      else replicated), opt_state, is_leaf=is_slot)


# --- train state <-> portable -------------------------------------------------------
def to_portable(pipe, state: dict) -> dict:
    """{"variables": packed, "opt_state": optax state on packed params} -> per-layer
    numpy tree (the checkpoint format above)."""
    variables = state["variables"]
    layers = [{"variables": v, "opt": []} for v in pipe.unpack(variables)]
    is_slot = _param_slot_test(variables["params"])
    rest = []
    for node in jax.tree.leaves(state["opt_state"], is_leaf=is_slot):
        if is_slot(node):
            for layer, tree in zip(layers, unpack_like_params(pipe, node)):
                layer["opt"].append(tree)
        else:
            rest.append(np.asarray(jax.device_get(node)))
    return {"layers": layers, "opt_rest": rest}


def from_portable(pipe, portable: dict, template: dict) -> dict:
    """Inverse of `to_portable` for this pipeline's layout; `template` is a train state
    of this pipeline (its optimizer state gives the structure and shardings)."""
    variables = pipe.pack([layer["variables"] for layer in portable["layers"]])
    is_slot = _param_slot_test(template["variables"]["params"])
    nodes, treedef = jax.tree.flatten(template["opt_state"], is_leaf=is_slot)
    replicated = NamedSharding(pipe.mesh, P())
    slot, rest, out = 0, iter(portable["opt_rest"]), []
    for node in nodes:
        if is_slot(node):
            out.append(pack_like_params(pipe, [layer["opt"][slot] for layer in portable["layers"]]))
            slot += 1
        else:
            out.append(jax.device_put(np.asarray(next(rest), dtype=np.asarray(node).dtype),
                                      replicated))
    return {"variables": variables, "opt_state": jax.tree.unflatten(treedef, out)}


def _shapes(tree: PyTree) -> list:
    return [tuple(np.shape(x)) for x in jax.tree.leaves(tree)]


class Checkpointer:
    """Saves and restores train states in the per-layer format, under `directory`
    (keeps the newest `keep` steps). Orbax writes each step into a temporary directory
    and renames it when complete, so a crash never leaves a half-written step."""

    def __init__(self, directory: str | os.PathLike, *, keep: int):
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, pipe, state: dict, meta: dict) -> None:
        """Saves `state` (gathered to the host, per layer) and JSON-able `meta` as step
        `step`. Asynchronous: the write finishes in the background (see `wait`)."""
        portable = to_portable(pipe, state)
        meta = {**meta, "step": int(step),
                "layout": {"data": pipe.data, "pipe": pipe.num_stages,
                           "boundaries": [int(b) for b in pipe.boundaries]}}
        self._manager.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(portable), meta=ocp.args.JsonSave(meta)))

    def restore(self, pipe, template: dict, step: int | None = None) -> tuple[dict, dict]:
        """(train state packed for `pipe`, meta) of `step` (default: the latest).
        A checkpoint from another model or optimizer -> CheckpointMismatch saying so."""
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise ValueError(f"checkpoint: no checkpoint in {self.directory}.")
        target = to_portable(pipe, template)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointMismatch(self._mismatch(step, str(e).splitlines()[0])) from None
        if _shapes(restored["state"]) != _shapes(target):
            raise CheckpointMismatch(self._mismatch(step, "parameter shapes differ"))
        return from_portable(pipe, restored["state"], template), dict(restored["meta"])

    def _mismatch(self, step, why):
        return (f"checkpoint: step {step} in {self.directory} does not fit this model and "
                f"optimizer ({why}); resume with the config it was saved with, or use a "
                f"fresh workdir.")

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
