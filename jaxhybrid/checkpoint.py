"""Checkpoints that do not depend on the device layout or the number of processes.

A checkpoint stores the training state in its portable form (`jaxhybrid.portable`: per
layer, each layer's variables and its share of every parameter-shaped optimizer slot,
plus the optimizer's other leaves), never the packed per-stage buffers; restoring packs
it again for whatever mesh and boundaries the new run uses, so a run saved on (data=2,
pipe=4) continues on (4, 2), (1, 1) or another model-axis size, with one process or
several, with the very same numbers. A model split by `jaxhybrid.splitter` is saved as
its own variable tree, which the model's own code can read. Every process writes only
the shards on its own devices (orbax/tensorstore, one file set per process); nothing is
gathered to one host.

On disk (orbax CheckpointManager; a step directory appears only once every process has
finished writing it):

    <directory>/<step>/state   {"layers": [{"variables": {...}, "opt": [slot, ...]}, ...],
                                "opt_rest": [non-parameter optimizer leaves]}
    <directory>/<step>/meta    JSON: step, rng (key data), data_position, loss_window (the
                               losses since the last record), layout (with the schedule
                               and optimizer updates per step), shapes ({leaf path: shape}
                               of "state", checked before a restore), checksums (per
                               leaf, checked after: `checkpoint_meta`)
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
import orbax.checkpoint as ocp

from jaxhybrid.checkpoint_meta import (checksum_difference, checksums, difference, layout_of,
                                       leaf_shapes, schedule_note, shapes, updates_difference)
from jaxhybrid.pipeline.arguments import outside_context_mesh
from jaxhybrid.portable import _portable, abstract_portable, from_portable, to_portable

PyTree = Any


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit the model or optimizer restoring it."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (a full disk, no permission); names the directory."""


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
