"""`Dataset`: a fixed set of examples held in host memory as numpy arrays, served as
fixed-size batches for training and as padded, masked batches for evaluation.

Every loader (digits, stdlib_text, translation) builds one of these, so batching,
shuffling and eval padding behave identically for all of them.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

import jax
import numpy as np

# The models' option check: unknown option -> ValueError naming the valid ones.
from jaxhybrid.models.spec import check_overrides as check_options  # noqa: F401

PyTree = Any
SPLITS = ("train", "test")


class Dataset:
    """Examples as a pytree `(inputs, targets)` of numpy arrays sharing a leading
    dimension N, served in batches of exactly `batch_size`.

    pad_values: same structure as the examples, one scalar per leaf: what padded rows
      of the last evaluation batch hold (e.g. -1 labels, the model's pad token), so
      that a loss that ignores padding ignores them even without the mask.
    postprocess(inputs, targets) -> (inputs, targets): applied to every gathered batch
      (e.g. replicating a grey channel to RGB), so the stored arrays can stay compact.
    info: description of the data (num_classes, vocab_size, pad_id, ...); its keys are
      also readable as attributes (`ds.vocab_size`).
    """

    def __init__(self, name: str, split: str, examples: tuple, *, batch_size: int,
                 seed: int = 0, pad_values: tuple, info: dict | None = None,
                 postprocess: Callable | None = None):
        if split not in SPLITS:
            raise ValueError(f"{name}: unknown split {split!r}; choose one of {SPLITS}.")
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"{name}: batch_size={batch_size!r} must be a positive int.")
        sizes = {np.shape(leaf)[0] for leaf in jax.tree.leaves(examples)}
        if len(sizes) != 1:
            raise ValueError(f"{name}: example arrays disagree on the number of examples "
                             f"{sorted(sizes)}; give every array the same leading dimension.")
        self.name, self.split = name, split
        self.batch_size, self.seed = int(batch_size), int(seed)
        self.examples, self.pad_values = examples, pad_values
        self.info = dict(info or {})
        self.postprocess = postprocess
        self._num_examples = sizes.pop()

    def __getattr__(self, key):
        # Only reached when normal lookup fails: exposes info entries as attributes.
        info = self.__dict__.get("info", {})
        if key in info:
            return info[key]
        raise AttributeError(f"{type(self).__name__} {self.__dict__.get('name')!r} has no "
                             f"attribute {key!r} (info keys: {sorted(info)})")

    def __repr__(self):
        return (f"Dataset({self.name!r}, split={self.split!r}, num_examples="
                f"{self.num_examples}, batch_size={self.batch_size}, info={self.info})")

    @property
    def num_examples(self) -> int:
        return self._num_examples

    @property
    def steps_per_epoch(self) -> int:
        """Training batches per epoch (the remainder is dropped)."""
        return self.num_examples // self.batch_size

    @property
    def eval_steps(self) -> int:
        """Evaluation batches (the last one padded)."""
        return -(-self.num_examples // self.batch_size)

    @property
    def element_spec(self):
        """(inputs, targets) as a pytree of jax.ShapeDtypeStruct with the batch dim."""
        inputs, targets = self._gather(np.zeros(1, np.int64))   # one example suffices
        spec = lambda a: jax.ShapeDtypeStruct((self.batch_size, *a.shape[1:]), a.dtype)
        return jax.tree.map(spec, inputs), jax.tree.map(spec, targets)

    def _gather(self, idx: np.ndarray):
        inputs, targets = jax.tree.map(lambda a: a[idx], self.examples)
        if self.postprocess is not None:
            inputs, targets = self.postprocess(inputs, targets)
        return inputs, targets

    def batches(self, epochs: int | None = None, shuffle: bool = True,
                start: int = 0, rows: slice = slice(None)) -> Iterator[tuple]:
        """(inputs, targets) batches of exactly `batch_size`, the remainder of each epoch
        dropped; forever if `epochs` is None. The order of epoch e is a permutation drawn
        from (seed, e), so it is reproducible and differs between epochs. `start=k`
        begins at batch k of that stream without building the k batches before it (to
        resume training). `rows` keeps only those rows of every batch, and only they are
        loaded (a process's share, `data.process_rows`): the stream is the same for
        every split of the rows."""
        if self.steps_per_epoch == 0:
            raise ValueError(f"{self.name}: batch_size={self.batch_size} exceeds the "
                             f"{self.num_examples} examples of split {self.split!r}; "
                             f"use batch_size <= {self.num_examples}.")
        if epochs is not None and (not isinstance(epochs, (int, np.integer)) or epochs < 0):
            raise ValueError(f"{self.name}: epochs={epochs!r} must be None or an int >= 0.")
        if not isinstance(start, (int, np.integer)) or start < 0:
            raise ValueError(f"{self.name}: start={start!r} must be an int >= 0.")
        return self._batches(epochs, shuffle, int(start), _check_rows(rows, self.batch_size))

    def _batches(self, epochs, shuffle, start, rows):
        n, b = self.num_examples, self.batch_size
        first_epoch, first_step = divmod(start, n // b)
        for epoch in (itertools.count(first_epoch) if epochs is None
                      else range(first_epoch, epochs)):
            order = (np.random.default_rng([self.seed, epoch]).permutation(n) if shuffle
                     else np.arange(n))
            for step in range(first_step if epoch == first_epoch else 0, n // b):
                yield self._gather(order[step * b:(step + 1) * b][rows])

    def eval_batches(self, rows: slice = slice(None)) -> Iterator[tuple]:
        """(inputs, targets, mask) over every example exactly once, in order; the last
        batch is padded to `batch_size` with `pad_values` and mask (bool [batch_size])
        is False on the padding. `rows`: only those rows of every batch (see `batches`)."""
        n, b = self.num_examples, self.batch_size
        rows = _check_rows(rows, b)
        for start in range(0, n, b):
            real = min(b, n - start)
            # Padded rows first gather example 0 (right shapes/dtypes), then get pad values.
            idx = np.concatenate([np.arange(start, start + real),
                                  np.zeros(b - real, np.int64)])[rows]
            mask = (np.arange(b) < real)[rows]
            raw = jax.tree.map(lambda a: a[idx], self.examples)
            if not mask.all():
                def fill(a, value):          # `a` is a fresh copy (fancy indexing)
                    a[~mask] = value
                    return a
                raw = jax.tree.map(fill, raw, self.pad_values)
            inputs, targets = (raw if self.postprocess is None else self.postprocess(*raw))
            yield inputs, targets, mask


def _check_rows(rows, batch_size: int) -> slice:
    if not isinstance(rows, slice) or rows.step not in (None, 1):
        raise ValueError(f"rows={rows!r} must be a slice of consecutive batch rows, e.g. "
                         f"slice(0, {batch_size // 2}).")
    if len(range(*rows.indices(batch_size))) == 0:
        raise ValueError(f"rows={rows!r} selects no row of a batch of {batch_size}.")
    return rows
