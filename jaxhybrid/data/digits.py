"""Handwritten digits: scikit-learn's `load_digits` (1797 grey 8x8 images, 10 classes,
shipped inside scikit-learn, so no download; its CSV is read without importing
sklearn), as images for Inception-V3.

* split: stratified, fixed seed: `test_fraction` of every class goes to "test", the
  rest to "train" (the same split on every machine; `seed` only shuffles batches);
* pixels: 0..16 scaled to [0, 1], bilinearly resized to `image_size` (75 by default,
  Inception-V3's smallest input), normalised with the train split's mean and std;
* inputs: float32 NHWC [B, S, S, channels] (the grey channel replicated); targets:
  int32 labels [B]; padded evaluation rows have label -1, which
  `classification_loss`/`classification_metrics` ignore.

Resizing happens once per (image_size, test_fraction) and is cached; the cache holds
one grey channel (1797 x S x S float32: 40 MB at 75, 640 MB at 299), the channel copies
are made per batch.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np

from jaxhybrid.data.dataset import Dataset, check_options

NUM_CLASSES = 10
DEFAULTS = dict(image_size=75, channels=3, test_fraction=0.2)
_SPLIT_SEED = 0            # fixed: the split must not move with the shuffling seed


def bilinear_matrix(in_size: int, out_size: int) -> np.ndarray:
    """[out_size, in_size] weights of bilinear resampling with half-pixel centres and
    clamped edges (what jax.image.resize "linear" does when upsampling)."""
    pos = (np.arange(out_size) + 0.5) * in_size / out_size - 0.5
    pos = np.clip(pos, 0, in_size - 1)
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, in_size - 1)
    frac = pos - lo
    m = np.zeros((out_size, in_size))
    np.add.at(m, (np.arange(out_size), lo), 1 - frac)
    np.add.at(m, (np.arange(out_size), hi), frac)
    return m


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int = _SPLIT_SEED):
    """(train indices, test indices): round(test_fraction x count) of each class to test."""
    r = np.random.RandomState(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = r.permutation(np.flatnonzero(labels == c))
        k = int(round(test_fraction * len(idx)))
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _raw_digits() -> tuple[np.ndarray, np.ndarray]:
    """(pixels [1797, 8, 8] in 0..16, labels [1797]): the CSV scikit-learn ships, read
    directly (what `load_digits` reads), since importing sklearn takes 1-2 s of the
    start-up; `load_digits` itself where that file is not found."""
    spec = importlib.util.find_spec("sklearn")         # locates the package, runs nothing
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            rows = np.loadtxt(path, delimiter=",", dtype=np.float64)
            return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits
    digits = load_digits()
    return digits.images, digits.target


@functools.lru_cache(maxsize=2)
def _load(image_size: int, test_fraction: float):
    pixels, targets = _raw_digits()
    images = pixels.astype(np.float32) / 16.0                           # [N, 8, 8] in [0, 1]
    labels = targets.astype(np.int32)
    if image_size != images.shape[1]:
        m = bilinear_matrix(images.shape[1], image_size).astype(np.float32)
        images = m @ (images @ m.T)          # rows then columns: two batched matmuls
    train_idx, test_idx = stratified_split(labels, test_fraction)
    # Normalise with train statistics only, so the test split stays unseen.
    mean = images[train_idx].mean(dtype=np.float64)
    std = images[train_idx].std(dtype=np.float64)
    images -= np.float32(mean)
    images /= np.float32(std)
    images = images[..., None]                                          # [N, S, S, 1]
    out = {}
    for split, idx in (("train", train_idx), ("test", test_idx)):
        x, y = images[idx], labels[idx]
        x.flags.writeable = y.flags.writeable = False     # shared by every Dataset
        out[split] = (x, y)
    return out, float(mean), float(std)


def load(split: str, *, batch_size: int, seed: int = 0, **options) -> Dataset:
    cfg = check_options("digits", DEFAULTS, options)
    size, channels, frac = cfg["image_size"], cfg["channels"], cfg["test_fraction"]
    if not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"digits: image_size={size!r} must be a positive int (75 for "
                         f"Inception-V3).")
    if channels not in (1, 3):
        raise ValueError(f"digits: channels={channels!r} must be 1 or 3.")
    if not 0.0 < frac < 1.0:
        raise ValueError(f"digits: test_fraction={frac!r} must be in (0, 1).")
    splits, mean, std = _load(int(size), float(frac))
    if split not in splits:
        raise ValueError(f"digits: unknown split {split!r}; choose one of {tuple(splits)}.")

    def to_channels(x, y):
        return (np.repeat(x, channels, axis=-1) if channels > 1 else x), y

    return Dataset("digits", split, splits[split], batch_size=batch_size, seed=seed,
                   pad_values=(0.0, -1), postprocess=to_channels,
                   info=dict(num_classes=NUM_CLASSES, image_size=int(size),
                             channels=channels, pixel_mean=mean, pixel_std=std))
