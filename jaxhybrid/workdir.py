"""A training run's working directory: the checks that it can take the run, the lock
that keeps a second run out of it, and the cleanup of one refused before its first step.

A second run started in a workdir in use (the same command twice, or a resume started
while the first still ran) wrote the same checkpoint steps and appended to the same
metrics.jsonl (278 records for 150 steps, out of order), or failed at its first save with
orbax's traceback. `Lock` holds an exclusive `flock` on `<workdir>/.lock` for the run's
lifetime; the operating system releases it when the process ends however it ends, so no
stale lock is ever left to clear by hand.
"""
from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import socket
import time

from absl import logging

from jaxhybrid.run_setup import ConfigError, require

LOCK_NAME = ".lock"


def cannot_create(path: pathlib.Path, error: OSError) -> ConfigError:
    """The ConfigError for a workdir file or folder that cannot be made."""
    return ConfigError(f"workdir: cannot create {path} ({error.strerror or error}); pass a "
                       f"--workdir this process can write to.")


class Lock:
    """An exclusive lock on `workdir` for this process (process 0 of a run takes it);
    ConfigError naming the holder when another run holds it."""

    def __init__(self, workdir: pathlib.Path):
        self.path = workdir / LOCK_NAME
        try:   # os.access says yes for root where mkdir fails (/proc, some mounts)
            workdir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a+")
        except OSError as e:
            raise cannot_create(self.path, e) from None
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise ConfigError(f"workdir {workdir} is in use by another run ({holder}); stop it "
                             f"first, or pass another --workdir.") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()


def check_writable(workdir: pathlib.Path) -> None:
    """A workdir (or the folder it would be made in) that cannot be written failed with
    an OSError traceback when config.json was written, after planning and compiling."""
    for path in (workdir / "checkpoints", workdir, *workdir.parents):
        if path.exists():
            require(path.is_dir(), f"workdir: {path} is a file, so {workdir} cannot be made "
                                   f"in it; pass a --workdir under a directory.")
            require(os.access(path, os.W_OK | os.X_OK),
                    f"workdir: {path} is not writable (a read-only file system or no "
                    f"permission); pass a --workdir this process can write to.")
            return


def remove_if_empty(workdir: pathlib.Path) -> None:
    """A run refused before its first step leaves no workdir of empty folders behind
    (the checkpoints/ folder orbax made, the lock file)."""
    if all((p.is_dir() and not any(p.iterdir())) or p.name == LOCK_NAME
           for p in workdir.iterdir()):
        shutil.rmtree(workdir, ignore_errors=True)


def close_in_turn(closers, failing: bool) -> None:
    """Calls each of `closers` (falsy ones skipped), all of them even when one raises.
    `failing` (an error is on its way out): their errors are logged, so none replaces it;
    else the first is raised once all have run."""
    first = None
    for close in closers:
        if not close:
            continue
        try:
            close()
        except Exception as e:  # noqa: BLE001 - see the docstring
            if failing:
                logging.warning("while stopping: %s: %s", type(e).__name__, e)
            elif first is None:
                first = e
    if first is not None:
        raise first
