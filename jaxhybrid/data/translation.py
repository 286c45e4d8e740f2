"""A deterministic synthetic translation task for GNMT: the target sentence is the
source sentence reversed, each token mapped to another by a fixed cyclic shift. Solving
it needs the attention to look at the far end of the source, so a model that learns it
really uses its encoder-decoder path, and accuracy near 100% is reachable.

Token ids follow GNMT's defaults: pad 0, bos 1, eos 2, words from 3 to vocab_size-1.
Per example (lengths uniform in [min_len, min(src_len, tgt_len - 1)]):

    src     = w_1 .. w_n                    pad...   [src_len]
    tgt_out = f(w_n) .. f(w_1) eos          pad...   [tgt_len]   (the targets)
    tgt_in  = bos f(w_n) .. f(w_1)          pad...   [tgt_len]   (decoder input)

with f(w) = 3 + (w - 3 + shift) mod (vocab_size - 3). Inputs are (src, tgt_in), as
`jaxhybrid.models.gnmt` expects; padded evaluation rows are all pad (ignored by
`TokenLoss(pad_id)`). The examples of a split come from a fixed generator seed per
split (train and test differ; `seed` only shuffles batches); short sentences can occur
in both splits, as they would in a real corpus.
"""
from __future__ import annotations

import functools

import numpy as np

from jaxhybrid.data.dataset import Dataset, check_options

DEFAULTS = dict(src_len=8, tgt_len=8, vocab_size=32, num_train=8192, num_test=1024,
                min_len=1, shift=1, pad_id=0, bos_id=1, eos_id=2)
_SPLIT_SEEDS = {"train": 1234, "test": 5678}


def map_tokens(tokens: np.ndarray, first: int, vocab_size: int, shift: int) -> np.ndarray:
    return first + (tokens - first + shift) % (vocab_size - first)


@functools.lru_cache(maxsize=4)
def make_examples(split: str, num: int, src_len: int, tgt_len: int, vocab_size: int,
                  min_len: int, shift: int, pad_id: int, bos_id: int, eos_id: int):
    """((src [N, src_len], tgt_in [N, tgt_len]), tgt_out [N, tgt_len]) int32, read-only."""
    r = np.random.RandomState(_SPLIT_SEEDS[split])
    first = max(pad_id, bos_id, eos_id) + 1
    max_len = min(src_len, tgt_len - 1)
    lengths = r.randint(min_len, max_len + 1, size=num)
    words = r.randint(first, vocab_size, size=(num, max_len))
    src = np.full((num, src_len), pad_id, np.int32)
    tgt_out = np.full((num, tgt_len), pad_id, np.int32)
    for i, n in enumerate(lengths):
        w = words[i, :n]
        src[i, :n] = w
        tgt_out[i, :n] = map_tokens(w[::-1], first, vocab_size, shift)
        tgt_out[i, n] = eos_id
    tgt_in = np.concatenate([np.full((num, 1), bos_id, np.int32), tgt_out[:, :-1]], 1)
    tgt_in[tgt_in == eos_id] = pad_id       # the decoder never reads eos as input
    for a in (src, tgt_in, tgt_out):
        a.flags.writeable = False
    return (src, tgt_in), tgt_out


def load(split: str, *, batch_size: int, seed: int = 0, **options) -> Dataset:
    cfg = check_options("translation", DEFAULTS, options)
    if split not in _SPLIT_SEEDS:
        raise ValueError(f"translation: unknown split {split!r}; choose one of "
                         f"{tuple(_SPLIT_SEEDS)}.")
    specials = {cfg["pad_id"], cfg["bos_id"], cfg["eos_id"]}
    if len(specials) != 3 or min(specials) < 0:
        raise ValueError(f"translation: pad_id, bos_id, eos_id must be three distinct ids "
                         f">= 0, got {cfg['pad_id']}, {cfg['bos_id']}, {cfg['eos_id']}.")
    first = max(specials) + 1
    if cfg["vocab_size"] < first + 2:
        raise ValueError(f"translation: vocab_size={cfg['vocab_size']} leaves fewer than 2 "
                         f"word ids after the specials; use vocab_size >= {first + 2}.")
    if cfg["src_len"] < 1 or cfg["tgt_len"] < 2:
        raise ValueError(f"translation: need src_len >= 1 and tgt_len >= 2 (room for eos), "
                         f"got src_len={cfg['src_len']}, tgt_len={cfg['tgt_len']}.")
    max_len = min(cfg["src_len"], cfg["tgt_len"] - 1)
    if not 1 <= cfg["min_len"] <= max_len:
        raise ValueError(f"translation: min_len={cfg['min_len']} must be in [1, {max_len}] "
                         f"(= min(src_len, tgt_len - 1)).")
    num = cfg["num_train"] if split == "train" else cfg["num_test"]
    if num < 1:
        raise ValueError(f"translation: num_{split}={num} must be >= 1.")
    examples = make_examples(split, int(num), int(cfg["src_len"]), int(cfg["tgt_len"]),
                             int(cfg["vocab_size"]), int(cfg["min_len"]), int(cfg["shift"]),
                             int(cfg["pad_id"]), int(cfg["bos_id"]), int(cfg["eos_id"]))
    pad = cfg["pad_id"]
    return Dataset("translation", split, examples, batch_size=batch_size, seed=seed,
                   pad_values=((pad, pad), pad),
                   info=dict(vocab_size=cfg["vocab_size"], pad_id=pad, bos_id=cfg["bos_id"],
                             eos_id=cfg["eos_id"], src_len=cfg["src_len"],
                             tgt_len=cfg["tgt_len"]))
