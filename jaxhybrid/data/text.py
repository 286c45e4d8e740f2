"""Byte-level language-model text: the source code of Python's own standard library
(the .py files under `os.path.dirname(os.__file__)`), so real text is available on any
machine with no download.

* corpus: files read in a fixed order (directories and names sorted; site-packages and
  caches skipped) until `max_bytes` are collected; the same Python version gives the
  same bytes everywhere;
* split: by position, the last `test_fraction` of the corpus is "test";
* examples: consecutive, non-overlapping windows: inputs = bytes[t : t+L], targets =
  bytes[t+1 : t+L+1] with L = `seq_len`, both int32 [B, L];
* vocabulary: the 256 byte values plus `pad_id` (default 256, as in the tiny/small GPT
  and BigLSTM presets, whose vocab_size is 257); padded evaluation rows hold pad_id in
  inputs and targets, which `TokenLoss(pad_id)` ignores. With `pad_id=None` the
  vocabulary is 256 and only the evaluation mask marks padding.
* `targets_in_inputs=True`: inputs are (tokens, targets) — what BigLSTM's sampled
  softmax (`num_sampled > 0`) takes.
"""
from __future__ import annotations

import functools
import os

import numpy as np

from jaxhybrid.data.dataset import Dataset, check_options

DEFAULTS = dict(seq_len=64, max_bytes=2_000_000, test_fraction=0.1, pad_id=256,
                targets_in_inputs=False)
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
NUM_BYTES = 256


def stdlib_root() -> str:
    return os.path.dirname(os.__file__)


def stdlib_files(root: str | None = None):
    """Paths of the standard library's .py files, in a deterministic order."""
    root = stdlib_root() if root is None else root
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place makes os.walk descend in sorted order.
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


@functools.lru_cache(maxsize=2)
def stdlib_bytes(max_bytes: int) -> np.ndarray:
    """The first `max_bytes` bytes of the concatenated stdlib sources (uint8, read-only)."""
    chunks, total = [], 0
    for path in stdlib_files():
        with open(path, "rb") as f:
            data = f.read(max_bytes - total)
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    out = np.frombuffer(b"".join(chunks), np.uint8)
    out.flags.writeable = False
    return out


def windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """[N, seq_len + 1] int32: non-overlapping windows (consecutive windows share one
    byte: the last target of one is the first input of the next)."""
    n = (len(stream) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)
    return stream[idx].astype(np.int32)


def load(split: str, *, batch_size: int, seed: int = 0, **options) -> Dataset:
    cfg = check_options("stdlib_text", DEFAULTS, options)
    seq_len, max_bytes, frac, pad_id = (cfg["seq_len"], cfg["max_bytes"],
                                        cfg["test_fraction"], cfg["pad_id"])
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"stdlib_text: seq_len={seq_len!r} must be a positive int.")
    if not 0.0 < frac < 1.0:
        raise ValueError(f"stdlib_text: test_fraction={frac!r} must be in (0, 1).")
    if pad_id is not None and (not isinstance(pad_id, (int, np.integer)) or pad_id < NUM_BYTES):
        raise ValueError(f"stdlib_text: pad_id={pad_id!r} collides with byte values; use "
                         f"None or an id >= {NUM_BYTES} (e.g. 256 with vocab_size 257).")
    if split not in ("train", "test"):
        raise ValueError(f"stdlib_text: unknown split {split!r}; choose one of "
                         f"('train', 'test').")
    corpus = stdlib_bytes(int(max_bytes))
    cut = int(round(len(corpus) * (1.0 - frac)))
    stream = corpus[:cut] if split == "train" else corpus[cut:]
    if len(stream) < seq_len + 1:
        raise ValueError(f"stdlib_text: the {split} split has {len(stream)} bytes, fewer "
                         f"than seq_len + 1 = {seq_len + 1}; raise max_bytes (now "
                         f"{max_bytes}) or lower seq_len.")
    w = windows(stream, int(seq_len))
    pad = 0 if pad_id is None else int(pad_id)

    postprocess = None
    if cfg["targets_in_inputs"]:
        def postprocess(tokens, targets):
            return (tokens, targets), targets

    return Dataset("stdlib_text", split, (w[:, :-1], w[:, 1:]), batch_size=batch_size,
                   seed=seed, pad_values=(pad, pad), postprocess=postprocess,
                   info=dict(vocab_size=NUM_BYTES if pad_id is None else int(pad_id) + 1,
                             pad_id=pad_id, seq_len=int(seq_len), num_bytes=len(stream)))
