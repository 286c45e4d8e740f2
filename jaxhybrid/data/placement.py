"""Moving host batches onto the ("data", "pipe") mesh.

A batch's leading (example) dimension is split over "data" and replicated over "pipe":
every pipeline stage of a data replica sees that replica's examples (the first stage
reads the inputs, the last the targets). Meshes from `jaxhybrid.make_mesh` have Auto
axes, but Explicit-axis meshes need their inputs already sharded the same way, so
placing every leaf with NamedSharding(mesh, P("data")) suits both.
"""
from __future__ import annotations

import collections
import itertools
from typing import Any, Iterable, Iterator

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid.mesh import DATA

PyTree = Any


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading dim over "data", everything else (and "pipe") replicated."""
    return NamedSharding(mesh, P(DATA))


def process_rows(mesh: Mesh, batch_size: int) -> slice:
    """The rows of every global batch of `batch_size` that this process loads: those of
    the data replicas on its devices (all rows with one process, or when "data" does not
    cross processes). `place_batch` assembles the processes' rows into global arrays."""
    if batch_size % mesh.shape[DATA]:
        raise ValueError(f"process_rows: batch size {batch_size} is not divisible by the "
                         f"mesh's data axis ({mesh.shape[DATA]}); use a multiple of it.")
    index = batch_sharding(mesh).addressable_devices_indices_map((batch_size,))
    if not index:
        raise ValueError(f"process_rows: process {jax.process_index()} has no device in the "
                         f"mesh; build the mesh over all {jax.device_count()} devices.")
    spans = sorted({idx[0].indices(batch_size)[:2] for idx in index.values()})
    lo, hi = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != hi - lo:
        raise ValueError(f"process_rows: the data replicas of process {jax.process_index()} "
                         f"hold rows {spans}, not one block; order the mesh devices by "
                         f"process (jaxhybrid.make_mesh does).")
    return slice(lo, hi)


def place_batch(batch: PyTree, mesh: Mesh) -> PyTree:
    """Every leaf of `batch` (numpy or jax arrays, leading dim = examples) as a jax.Array
    sharded P("data") on `mesh`. On several processes each passes its own part of the
    global batch (jax.make_array_from_process_local_data assembles them)."""
    if DATA not in mesh.axis_names:
        raise ValueError(f"place_batch: mesh axes {mesh.axis_names} lack {DATA!r}; build "
                         f"the mesh with jaxhybrid.make_mesh(data=..., pipe=...).")
    sharding = batch_sharding(mesh)
    data_size = mesh.shape[DATA]
    multi_process = jax.process_count() > 1
    # The data replicas this process holds (a process may hold parts of several when
    # "pipe" crosses processes, e.g. 3 processes x 2 devices on data=2 x pipe=3): its rows
    # are that share of the batch. The global shape is given, not inferred: jax infers it
    # only when every process holds as many rows ("non-uniform sharding" otherwise).
    replicas = len({index[0] for index, d in np.ndenumerate(mesh.devices)
                    if d.process_index == jax.process_index()})

    def put(x):
        shape = np.shape(x)
        if not shape:
            raise ValueError("place_batch: a batch leaf is a scalar; every leaf needs a "
                             "leading batch dimension.")
        if multi_process:
            return jax.make_array_from_process_local_data(
                sharding, np.asarray(x), (shape[0] * data_size // replicas, *shape[1:]))
        if shape[0] % data_size:
            raise ValueError(f"place_batch: batch dimension {shape[0]} is not divisible by "
                             f"the mesh's data axis ({data_size}); use a batch size that "
                             f"is a multiple of {data_size}.")
        return jax.device_put(x, sharding)

    return jax.tree.map(put, batch)


def prefetch_to_mesh(iterator: Iterable[PyTree], mesh: Mesh, size: int = 2) -> Iterator[PyTree]:
    """Yields the batches of `iterator` placed on `mesh`, keeping `size` of them already
    placed ahead. jax.device_put returns at once and copies in the background, so the
    host->device transfer of the next batches overlaps the current step's compute."""
    if not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"prefetch_to_mesh: size={size!r} must be a positive int.")
    it = iter(iterator)
    queue: collections.deque = collections.deque()

    def enqueue(n):
        for batch in itertools.islice(it, n):
            queue.append(place_batch(batch, mesh))

    enqueue(size)
    while queue:
        yield queue.popleft()
        enqueue(1)
