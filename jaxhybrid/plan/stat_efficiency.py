"""Statistical efficiency: training steps (and epochs) to a target quality vs global batch.

Parametric form (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"):

    S(B) = S_min * (1 + B_noise / B)         steps to target at global batch B
    E(B) = S(B) * B / D = E_min * (1 + B / B_noise),   E_min = S_min * B_noise / D

B_noise is the gradient noise scale: well below it doubling the batch halves the steps
(perfect scaling, constant epochs); well above it steps approach S_min and epochs grow
linearly with B. Optionally a *critical batch* `max_batch`: beyond it larger batches give
no fewer steps at all, S(B) = S(max_batch) (the "maximal data parallelism" regime of
Shallue et al. 2018, where the measured steps-to-result curves go flat).

`fit(points)` estimates (S_min, B_noise) from measured (batch, steps-to-target) points by
least squares in the linear form steps = S_min + (S_min * B_noise) * (1 / B), on relative
residuals (steps-to-target noise is proportional to the steps: with absolute residuals a
10% error in the smallest-batch point, the one with the most steps, moved the fitted
B_noise by 36%; relative: 5%).

Per-model defaults (`MODEL_DEFAULTS`) for the three models of Pal et al. 2019; each says
where its numbers come from (and where they are an assumption).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class StatEfficiency:
    """S(B) = s_min * (1 + b_noise / min(B, max_batch)); epochs need `dataset_size` (D,
    examples per epoch)."""
    s_min: float
    b_noise: float
    dataset_size: float | None = None
    max_batch: float | None = None
    name: str = ""
    source: str = ""

    def __post_init__(self):
        if not (self.s_min > 0 and math.isfinite(self.s_min)):
            raise ValueError(f"StatEfficiency: s_min={self.s_min} must be a finite number > 0.")
        if not (self.b_noise >= 0 and math.isfinite(self.b_noise)):
            raise ValueError(f"StatEfficiency: b_noise={self.b_noise} must be a finite number >= 0.")
        if self.dataset_size is not None and not 0 < self.dataset_size < math.inf:
            raise ValueError(f"StatEfficiency: dataset_size={self.dataset_size} must be a finite "
                             f"number > 0.")
        if self.max_batch is not None and not 0 < self.max_batch < math.inf:
            raise ValueError(f"StatEfficiency: max_batch={self.max_batch} must be a finite number "
                             f"> 0, or None for no cap.")

    @classmethod
    def from_epochs(cls, e_min: float, b_noise: float, dataset_size: float, **kw) -> "StatEfficiency":
        """From the small-batch epoch count E_min (epochs to target as B -> 0) and B_noise."""
        if not (e_min > 0 and b_noise > 0 and dataset_size > 0):
            raise ValueError(f"StatEfficiency.from_epochs: e_min={e_min}, b_noise={b_noise}, "
                             f"dataset_size={dataset_size} must all be > 0.")
        return cls(s_min=e_min * dataset_size / b_noise, b_noise=b_noise,
                   dataset_size=dataset_size, **kw)

    # --- curves -----------------------------------------------------------------------
    def _b(self, batch) -> np.ndarray:
        b = np.asarray(batch, float)
        if (b <= 0).any():
            raise ValueError(f"StatEfficiency: global batch must be > 0, got {batch}.")
        return b if self.max_batch is None else np.minimum(b, self.max_batch)

    def steps(self, batch):
        """Steps to target at global batch `batch` (scalar or array)."""
        out = self.s_min * (1.0 + self.b_noise / self._b(batch))
        return float(out) if np.ndim(out) == 0 else out

    def samples(self, batch):
        """Examples processed to reach the target: S(B) * B."""
        out = np.asarray(self.steps(batch)) * np.asarray(batch, float)
        return float(out) if np.ndim(out) == 0 else out

    def epochs(self, batch):
        """Epochs to target: S(B) * B / D."""
        if self.dataset_size is None:
            raise ValueError("StatEfficiency.epochs needs dataset_size (examples per epoch).")
        out = np.asarray(self.samples(batch)) / self.dataset_size
        return float(out) if np.ndim(out) == 0 else out

    @property
    def e_min(self) -> float:
        """Epochs to target in the small-batch limit."""
        return self.s_min * self.b_noise / self.dataset_size if self.dataset_size else float("nan")

    def describe(self) -> str:
        cap = f", max_batch={self.max_batch:g}" if self.max_batch else ""
        d = f", D={self.dataset_size:.4g}, E_min={self.e_min:.3g}" if self.dataset_size else ""
        return f"S(B) = {self.s_min:.4g} * (1 + {self.b_noise:.4g} / B){cap}{d}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def fit(points: Iterable[Sequence[float]], *, dataset_size: float | None = None,
        max_batch: float | str | None = None, kind: str = "steps", name: str = "fit") -> StatEfficiency:
    """Least-squares fit of S(B) = S_min (1 + B_noise / B) to measured points (relative
    residuals, see the module docstring).

    points: (global batch, steps to target) pairs, or (batch, epochs) with kind="epochs"
      (then dataset_size is required to convert).
    max_batch: None (no cap), a number (critical batch: S constant beyond it), or "auto":
      also try a cap at each measured batch and keep the one with the smallest squared
      relative error (no cap wins ties), for data whose steps stop falling at large batch.
    """
    pts = np.asarray(list(points), float)
    if pts.ndim != 2 or pts.shape[1] != 2:
        raise ValueError("fit: points must be (batch, steps) pairs.")
    if kind not in ("steps", "epochs"):
        raise ValueError(f"fit: kind={kind!r} must be 'steps' or 'epochs'.")
    if (pts <= 0).any() or not np.isfinite(pts).all():
        raise ValueError("fit: every batch and steps/epochs value must be a finite number > 0.")
    batch, y = pts[:, 0], pts[:, 1]
    if kind == "epochs":
        if dataset_size is None:
            raise ValueError("fit: kind='epochs' needs dataset_size to convert epochs to steps.")
        y = y * dataset_size / batch
    if len(np.unique(batch)) < 2:
        raise ValueError("fit: need points at two or more different batch sizes.")

    def solve(cap):
        x = 1.0 / (batch if cap is None else np.minimum(batch, cap))
        A = np.stack([np.ones_like(x), x], axis=1)
        if np.linalg.matrix_rank(A) < 2:
            return None
        (a, c), *_ = np.linalg.lstsq(A / y[:, None], np.ones_like(y), rcond=None)  # relative
        # Rounding: steps that do not fall at all give S_min B_noise = +-1e-12, not 0.
        c = 0.0 if abs(c) < 1e-9 * y.max() * batch.min() else c
        sse = float((((A @ [a, c] - y) / y) ** 2).sum())
        return a, c, sse

    if max_batch == "auto":
        candidates = [None] + sorted(set(batch.tolist()))
    elif max_batch is None or (isinstance(max_batch, (int, float, np.number))
                               and not isinstance(max_batch, (bool, np.bool_))
                               and max_batch > 0 and math.isfinite(max_batch)):
        candidates = [max_batch]
        if max_batch is not None and max_batch <= batch.min():
            raise ValueError(f"fit: max_batch={max_batch:g} is at or below every measured batch "
                             f"(smallest {batch.min():g}): all points sit past the cap, nothing "
                             f"to fit; give a larger max_batch, 'auto' or None.")
    else:
        raise ValueError(f"fit: max_batch={max_batch!r} must be None, a number > 0 or 'auto'.")
    best = None
    for cap in candidates:
        r = solve(cap)
        if r is None or r[0] <= 1e-9 * y.max() or r[1] < 0:
            continue
        if best is None or r[2] < best[1][2] * (1 - 1e-9) - 1e-12:
            best = (cap, r)
    if best is None:
        a, c, _ = solve(candidates[0]) or (float("nan"), float("nan"), 0)
        if c > 0 and a <= 1e-9 * y.max():
            raise ValueError(f"fit: steps fall as fast as 1 / B or faster over the measured "
                             f"batches (fitted S_min={a:.4g} <= 0): they do not bound B_noise; "
                             f"add a point at a larger batch, where steps stop halving, or set "
                             f"B_noise yourself (StatEfficiency.from_epochs, --b_noise).")
        raise ValueError(f"fit: points do not follow steps = S_min (1 + B_noise / B) "
                         f"(fitted S_min={a:.4g}, S_min*B_noise={c:.4g}; both must be >= 0 "
                         f"and S_min > 0): steps should fall as the batch grows.")
    cap, (a, c, _) = best
    return StatEfficiency(s_min=float(a), b_noise=float(c / a), dataset_size=dataset_size,
                          max_batch=cap, name=name, source=f"fit to {len(pts)} points")


# --- per-model defaults (Pal et al. 2019's three workloads) ---------------------------
# Each is E(B) = E_min (1 + B / B_noise) with D in the model's training examples. Pal et
# al. measured their own epochs-vs-batch curves but did not publish the numbers in a form
# we could read, so these are assumptions chosen to match published large-batch results:
IMAGENET_TRAIN = 1_281_167          # ILSVRC-2012 training images
WMT16_EN_DE_PAIRS = 4_500_000       # WMT16 English-German training sentence pairs (~4.5M)
LM1B_SEQUENCES = 40_000_000         # 1B Word Benchmark: ~0.8B training tokens / 20-token unrolls

MODEL_DEFAULTS: dict[str, StatEfficiency] = {
    # Goyal et al. 2017: ResNet-50 reaches its accuracy in 90 epochs at every batch up to
    # 8k and needs more beyond; Shallue et al. 2018: ImageNet steps-to-result scale
    # perfectly to ~2^13 and show diminishing returns after. B_noise = 16384 with E_min =
    # 60 gives E(8192) = 90 epochs and E(65536) = 300. ASSUMPTION: Inception-V3 follows
    # the ResNet-50 curve (same dataset, similar recipe; Szegedy et al. trained it ~100
    # epochs at small batch).
    "inception_v3": StatEfficiency.from_epochs(
        60.0, 16384.0, IMAGENET_TRAIN, name="inception_v3/ImageNet",
        source="assumed; anchored on Goyal et al. 2017 (90 epochs up to 8k) and Shallue "
               "et al. 2018 (diminishing returns past ~2^13)"),
    # MLPerf GNMT (v0.5/v0.6) reaches its BLEU target in roughly 3-5 epochs at global
    # batches of 1k-8k sentence pairs. ASSUMPTION: E_min = 3, B_noise = 16384 sentences
    # (~0.4M tokens), i.e. E(8192) = 4.5 epochs.
    "gnmt": StatEfficiency.from_epochs(
        3.0, 16384.0, WMT16_EN_DE_PAIRS, name="gnmt/WMT16 en-de",
        source="assumed; anchored on MLPerf GNMT recipes (~3-5 epochs at 1k-8k batch)"),
    # Jozefowicz et al. 2016 / Kuchaiev & Ginsburg 2017 train BigLSTM at 128 sequences x
    # 20 steps per GPU on 8-32 GPUs (global 1k-4k sequences) for a few epochs.
    # ASSUMPTION: E_min = 2 epochs and B_noise = 8192 sequences (~164k tokens), in the
    # range of the language-model noise scales McCandlish et al. report.
    "biglstm": StatEfficiency.from_epochs(
        2.0, 8192.0, LM1B_SEQUENCES, name="biglstm/LM1B",
        source="assumed; anchored on the BigLSTM recipes (1k-4k sequences, a few epochs) "
               "and McCandlish et al. 2018's language-model noise scales"),
}


def default_for(model: str) -> StatEfficiency:
    """The documented default curve of a model (see MODEL_DEFAULTS)."""
    if model not in MODEL_DEFAULTS:
        raise ValueError(f"no statistical-efficiency default for {model!r}; known: "
                         f"{', '.join(MODEL_DEFAULTS)}. Pass StatEfficiency(...) or fit(points).")
    return MODEL_DEFAULTS[model]
