"""Input pipelines: small real data shipped with the dependencies, batched for training
and evaluation, and placement of any batch iterator onto the ("data", "pipe") mesh.

    from jaxhybrid import data, models
    ds = data.get_dataset("digits", "train", batch_size=64, seed=0, image_size=75)
    ds = data.for_model(models.get_model("gpt", "tiny"), "train", batch_size=32)
    for inputs, targets in data.prefetch_to_mesh(ds.batches(epochs=1), mesh):
        ...                                            # arrays sharded P("data")
    test = data.get_dataset("digits", "test", batch_size=64)
    for inputs, targets, mask in test.eval_batches(): ...   # last batch padded, masked

Datasets (`DATASETS`; each takes the options listed in its module):

* "digits": scikit-learn's 8x8 handwritten digits resized for Inception-V3
  (classification; `jaxhybrid.data.digits`);
* "stdlib_text": bytes of Python's standard-library sources for GPT / BigLSTM
  (language modelling; `jaxhybrid.data.text`);
* "translation": synthetic reverse-and-map sentences for GNMT (`jaxhybrid.data.translation`).

A `Dataset` has `num_examples`, `batches(epochs=None, shuffle=True)` (exactly
`batch_size` examples per batch, remainder dropped, reshuffled every epoch from
(seed, epoch)), `eval_batches()` ((inputs, targets, mask); every example exactly once,
the last batch padded and masked), `element_spec`, and `info` (num_classes or
vocab_size/pad_id...), whose keys also read as attributes.

Bringing your own data (grain, tfds, a generator...). Training needs nothing but an
iterator of `(inputs, targets)` numpy batches whose structure matches the model's
`spec.sample_batch` (the same pytree, dtypes and per-example shapes) and whose batch
size is a multiple of the mesh's data size:

    it = ((x, y) for x, y in my_loader)               # e.g. grain/tfds .as_numpy_iterator()
    for inputs, targets in data.prefetch_to_mesh(it, mesh, size=2): ...

On several processes each one loads only its share of every global batch, the rows
`process_rows(mesh, batch_size)` names (`ds.batches(rows=...)`,
`ds.eval_batches(rows=...)`), and `place_batch` assembles the global arrays
(jax.make_array_from_process_local_data); the stream is the same for any number of
processes. (grain's per-process sharding splits the *examples* between processes, which
changes the global batches with the process count, so it is not used here.) For evaluation, pad the last batch yourself
and mark padding the way the model's loss ignores it (label -1 for classifiers, the
model's pad id for token models), or weigh batches by a mask.
"""
from __future__ import annotations

from jaxhybrid.data import digits, text, translation
from jaxhybrid.data.dataset import SPLITS, Dataset, check_options
from jaxhybrid.data.placement import (batch_sharding, place_batch, prefetch_to_mesh,
                                      process_rows)

DATASETS = {
    "digits": digits.load,
    "stdlib_text": text.load,
    "translation": translation.load,
}
TASK_DATASETS = {"classification": "digits", "language_model": "stdlib_text",
                 "translation": "translation"}

__all__ = ["DATASETS", "SPLITS", "Dataset", "batch_sharding", "check_options",
           "for_model", "get_dataset", "place_batch", "prefetch_to_mesh", "process_rows"]


def get_dataset(name: str, split: str, *, batch_size: int, seed: int = 0,
                **options) -> Dataset:
    """The dataset `name` ("digits" | "stdlib_text" | "translation"), split "train" or
    "test", batched by `batch_size`, shuffled from `seed`; `options` are the dataset's
    (e.g. image_size=, seq_len=, src_len=). Unknown name/split/option -> ValueError."""
    if name not in DATASETS:
        raise ValueError(f"get_dataset: unknown dataset {name!r}; choose one of "
                         f"{tuple(DATASETS)}.")
    if split not in SPLITS:
        raise ValueError(f"get_dataset: unknown split {split!r}; choose one of {SPLITS}.")
    return DATASETS[name](split, batch_size=batch_size, seed=seed, **options)


def model_options(spec) -> tuple[str, dict]:
    """(dataset name, options) that produce batches `spec`'s layers accept."""
    cfg = spec.config
    if spec.task not in TASK_DATASETS:
        raise ValueError(f"for_model: no dataset for task {spec.task!r}; tasks with data: "
                         f"{tuple(TASK_DATASETS)} (or bring your own iterator).")
    name = TASK_DATASETS[spec.task]
    if name == "digits":
        if cfg["num_classes"] < digits.NUM_CLASSES:
            raise ValueError(f"for_model: {spec.name} has num_classes={cfg['num_classes']} "
                             f"but digits has {digits.NUM_CLASSES}; build the model with "
                             f"num_classes={digits.NUM_CLASSES}.")
        return name, dict(image_size=cfg["image_size"])
    if name == "stdlib_text":
        pad_id = cfg.get("pad_id")
        needed = text.NUM_BYTES if pad_id is None else max(text.NUM_BYTES, pad_id + 1)
        if (pad_id is not None and pad_id < text.NUM_BYTES) or cfg["vocab_size"] < needed:
            raise ValueError(f"for_model: byte-level text needs vocab_size >= {needed} and "
                             f"pad_id None or >= 256; {spec.name} has vocab_size="
                             f"{cfg['vocab_size']}, pad_id={pad_id} (use vocab_size=257, "
                             f"pad_id=256).")
        return name, dict(seq_len=cfg["seq_len"], pad_id=pad_id,
                          targets_in_inputs=bool(cfg.get("num_sampled", 0)))
    return name, {k: cfg[k] for k in ("src_len", "tgt_len", "vocab_size", "pad_id",
                                      "bos_id", "eos_id")}


def for_model(spec, split: str, *, batch_size: int, seed: int = 0, **options) -> Dataset:
    """The dataset that fits ModelSpec `spec`: classification -> digits at the model's
    image_size; language_model -> stdlib_text at its seq_len and pad_id (inputs
    (tokens, targets) for BigLSTM's sampled softmax); translation -> translation at its
    lengths, vocabulary and special ids. `options` override the derived ones (e.g.
    max_bytes=, num_train=)."""
    name, derived = model_options(spec)
    return get_dataset(name, split, batch_size=batch_size, seed=seed,
                       **{**derived, **options})
