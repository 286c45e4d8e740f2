"""The per-layer cost record (`LayerCost`) and what is read off it without JAX: the
arrays over layers, the partition's layer times, and the roofline estimate with its
assumed device peaks. `plan.costs.profile` fills it in (see `plan.costs` for how each
field is measured); the planner, the projection and the reference costs consume it.
`plan.costs` re-exports every name here."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

# (peak FLOP/s, memory bytes/s) by substring of `device.device_kind` (dense bf16 tensor
# core peaks from vendor datasheets; CPU: a few cores' worth of AVX2 fp32 and DRAM).
_PEAKS = (("H200", 989e12, 4.8e12), ("H100", 989e12, 3.35e12), ("A100", 312e12, 2.0e12),
          ("V100", 125e12, 0.9e12), ("L4", 121e12, 0.3e12), ("TPU v4", 275e12, 1.2e12),
          ("TPU v5", 197e12, 0.8e12))
_CPU_PEAK = (100e9, 20e9)
_GPU_FALLBACK = (100e12, 1.0e12)


def device_peak(device=None) -> tuple[float, float]:
    """(peak FLOP/s, memory bandwidth bytes/s) assumed for `device` (default: the first
    local device) by the roofline estimate."""
    import jax
    device = device or jax.devices()[0]
    kind = getattr(device, "device_kind", "")
    for key, flops, bw in _PEAKS:
        if key.lower() in kind.lower():
            return flops, bw
    return _CPU_PEAK if device.platform == "cpu" else _GPU_FALLBACK


def roofline_time(flops: float, nbytes: float, peak_flops: float, memory_bandwidth: float) -> float:
    return max(flops / peak_flops, nbytes / memory_bandwidth)


@dataclasses.dataclass
class LayerCost:
    """Costs of one layer on one microbatch of `batch_size` examples. Bytes are bytes,
    times seconds; `measured` says whether times were timed or roofline estimates."""
    name: str
    batch_size: int
    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float
    bwd_bytes: float
    param_bytes: int
    param_count: int
    in_bytes: int
    out_bytes: int
    saved_bytes: int
    saved_bytes_remat: int
    fwd_time: float
    bwd_time: float
    measured: bool = False
    # Cores the measured forward / backward kept busy on average (process CPU seconds
    # over wall seconds while timed, `layer_timing.threads`; 1: one core, or not
    # measured). Simulated devices sharing a host's cores share them by CPU seconds
    # (`fwd_time * fwd_threads`), which `step_model.lockstep_time` uses.
    fwd_threads: float = 1.0
    bwd_threads: float = 1.0
    state_bytes: int = 0   # non-param variables (e.g. batch_stats): kept, no grads/moments
    # Tensor parallelism over "model" (`jaxhybrid.plan.model_axis`): of the above, what a
    # model degree T divides by T, and the bytes all-reduced over the model group.
    model_param_bytes: int = 0        # params whose logical names the rules put on "model"
    model_saved_bytes: int = 0        # residuals split over "model"
    model_flops_fraction: float = 0.0   # of the matmul FLOPs, the part split over "model"
    model_fwd_comm_bytes: int = 0     # all-reduced over "model" in the forward, per device
    model_bwd_comm_bytes: int = 0     # ... and in the backward
    model_fwd_collectives: int = 0    # how many collectives over "model" forward
    model_bwd_collectives: int = 0    # ... and backward
    bwd_temp_bytes: int = 0    # the compiled backward's temporaries (0: unknown)
    saved_by_dtype: dict = dataclasses.field(default_factory=dict)   # {} : unknown
    # A split backward (zb-h1, zbv) by dtype ({}: unknown): the values its input half B
    # hands to its weight half W (`pipeline.backward.SplitBackward`'s crossing values:
    # intermediate cotangents), and the stashed residuals W still reads after B.
    cross_by_dtype: dict = dataclasses.field(default_factory=dict)
    weight_saved_by_dtype: dict = dataclasses.field(default_factory=dict)
    # The float parameters' bytes by dtype ({}: unknown): a recomputed layer's backward is
    # one jax.checkpoint equation B runs whole, so its parameter gradients cross to W.
    param_by_dtype: dict = dataclasses.field(default_factory=dict)
    # Of the stashed residuals, what an earlier layer stashes too (the same value: one's
    # output is a later one's input), as [distance back to the nearest such layer, dtype
    # name, bytes]: a stage holding both, neither recomputed, stashes it once ([]: none
    # known; pieces of a split model record it).
    shared_residuals: list = dataclasses.field(default_factory=list)
    # The crossing values and the float parameters as whole values, [dtype name, bytes]
    # each, largest first ([]: unknown; the by-dtype bytes then count as divisible): the
    # runtime places whole values into the row's free space (`packing.place_in_free_space`),
    # and a 262KB kernel gradient does not fit into two free pieces of 131KB.
    cross_values: list = dataclasses.field(default_factory=list)
    param_values: list = dataclasses.field(default_factory=list)
    # By dtype, the largest stashed residual ({}: unknown). Large residuals get stash
    # buffers of their own (`packing.shared_layouts`), so a crossing value larger than
    # the largest residual fits into no dead one.
    largest_saved_by_dtype: dict = dataclasses.field(default_factory=dict)

    def scaled(self, batch_size: int) -> "LayerCost":
        """Costs at another microbatch size: everything per-example scales linearly,
        parameter sizes stay."""
        if batch_size < 1:
            raise ValueError(f"LayerCost.scaled: batch_size={batch_size} must be >= 1.")
        r = batch_size / self.batch_size
        lin = {f: getattr(self, f) * r for f in ("fwd_flops", "bwd_flops", "fwd_bytes",
                                                  "bwd_bytes", "fwd_time", "bwd_time")}
        ints = {f: int(round(getattr(self, f) * r)) for f in (
            "in_bytes", "out_bytes", "saved_bytes", "saved_bytes_remat", "model_saved_bytes",
            "model_fwd_comm_bytes", "model_bwd_comm_bytes", "bwd_temp_bytes")}
        per_dtype = {f: {k: int(round(v * r)) for k, v in getattr(self, f).items()}
                     for f in BY_DTYPE_FIELDS}
        shared = [[d, t, int(round(n * r))] for d, t, n in self.shared_residuals]
        cross = [[t, int(round(n * r))] for t, n in self.cross_values]
        return dataclasses.replace(self, batch_size=int(batch_size), **lin, **ints, **per_dtype,
                                   shared_residuals=shared, cross_values=cross)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LayerCost":
        return cls(**d)


BY_DTYPE_FIELDS = ("saved_by_dtype", "cross_by_dtype", "weight_saved_by_dtype",
                   "largest_saved_by_dtype")
COST_FIELDS = tuple(f.name for f in dataclasses.fields(LayerCost)
                    if f.name not in ("name", "param_by_dtype", "shared_residuals", "cross_values",
                                      "param_values", *BY_DTYPE_FIELDS))


def cost_arrays(costs: Sequence[LayerCost]) -> dict[str, np.ndarray]:
    """{field: numpy array over layers} for every numeric LayerCost field, plus
    "time" = fwd_time + bwd_time."""
    out = {f: np.array([getattr(c, f) for c in costs], dtype=float) for f in COST_FIELDS}
    out["time"] = out["fwd_time"] + out["bwd_time"]
    return out


def cpu_seconds(costs: Sequence[LayerCost]) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) CPU seconds per layer: the measured times x the cores each
    kept busy (`fwd_threads`, `bwd_threads`)."""
    return (np.array([c.fwd_time * c.fwd_threads for c in costs], dtype=float),
            np.array([c.bwd_time * c.bwd_threads for c in costs], dtype=float))


def layer_times(costs: Sequence[LayerCost]) -> np.ndarray:
    """fwd + bwd time per layer (the partition's input)."""
    return np.array([c.fwd_time + c.bwd_time for c in costs], dtype=float)
