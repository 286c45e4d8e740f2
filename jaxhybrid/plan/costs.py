"""Per-layer costs: FLOPs, bytes, activation sizes, residual memory and times.

`profile` is the only part of `jaxhybrid.plan` that runs JAX. It calls each layer
exactly as the pipeline does (`jaxhybrid.layers.init_layer` / `apply_layer` with the
`train` keyword and a per-layer dropout key from `layer_rng`), jits the layer's forward
and its backward on its own, and reads XLA's own cost analysis of both executables.

Backward = applying the `jax.vjp` function to an all-ones cotangent, compiled with the
residuals as inputs, so its FLOPs/bytes are those of the backward alone (the forward that
produced the residuals is not counted twice). Gradients are taken w.r.t. the layer's
params and its floating-point inputs (integer inputs such as token ids have none); the
first layer's inputs are the model inputs, whose gradient no one needs, so layer 0 is
differentiated w.r.t. its params only.

Memory kept for backward, per microbatch:
  saved_bytes        the vjp residuals that are not parameters (or other variables): what a
                     stage stashes per in-flight microbatch without recomputation;
  saved_bytes_remat  the layer's input bytes: all `jax.checkpoint` keeps, the rest is
                     recomputed by an extra forward in the backward pass.
Both equal the output bytes that XLA's `memory_analysis()` reports for a compiled function
returning those residuals (plain / under `jax.checkpoint`; tests/test_costs.py checks it).

Times: measured (median of `repeats` runs after a warm-up, `block_until_ready`) when
`measure=True`; otherwise a roofline estimate on the local device,
    time = max(flops / peak_flops, bytes_accessed / memory_bandwidth),
with the peak numbers of `device_peak()` (a table by device kind; override with
`peak_flops=` / `memory_bandwidth=`). The estimate ignores launch overheads and fusion
quality; it ranks layers, it does not predict wall time to better than ~2x.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Sequence

import numpy as np

PyTree = Any

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
    state_bytes: int = 0   # non-param variables (e.g. batch_stats): kept, no grads/moments

    def scaled(self, batch_size: int) -> "LayerCost":
        """Costs at another microbatch size: everything per-example scales linearly,
        parameter sizes stay."""
        if batch_size < 1:
            raise ValueError(f"LayerCost.scaled: batch_size={batch_size} must be >= 1.")
        r = batch_size / self.batch_size
        lin = {f: getattr(self, f) * r for f in ("fwd_flops", "bwd_flops", "fwd_bytes",
                                                  "bwd_bytes", "fwd_time", "bwd_time")}
        ints = {f: int(round(getattr(self, f) * r)) for f in ("in_bytes", "out_bytes", "saved_bytes",
                                                              "saved_bytes_remat")}
        return dataclasses.replace(self, batch_size=int(batch_size), **lin, **ints)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LayerCost":
        return cls(**d)


COST_FIELDS = tuple(f.name for f in dataclasses.fields(LayerCost) if f.name != "name")


def cost_arrays(costs: Sequence[LayerCost]) -> dict[str, np.ndarray]:
    """{field: numpy array over layers} for every numeric LayerCost field, plus
    "time" = fwd_time + bwd_time."""
    out = {f: np.array([getattr(c, f) for c in costs], dtype=float) for f in COST_FIELDS}
    out["time"] = out["fwd_time"] + out["bwd_time"]
    return out


def layer_times(costs: Sequence[LayerCost]) -> np.ndarray:
    """fwd + bwd time per layer (the partition's input)."""
    return np.array([c.fwd_time + c.bwd_time for c in costs], dtype=float)


def _nbytes(tree) -> int:
    import jax
    return int(sum(int(np.prod(np.shape(l))) * np.dtype(l.dtype).itemsize
                   for l in jax.tree.leaves(tree)))


def _count(tree) -> int:
    import jax
    return int(sum(int(np.prod(np.shape(l))) for l in jax.tree.leaves(tree)))


def _is_float(x) -> bool:
    import jax.numpy as jnp
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _xla_cost(compiled) -> tuple[float, float]:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):   # older jax returned one dict per computation
        ca = ca[0] if ca else {}
    ca = ca or {}
    return float(max(ca.get("flops", 0.0), 0.0)), float(max(ca.get("bytes accessed", 0.0), 0.0))


def _timed(fn, args, repeats: int) -> float:
    import jax
    jax.block_until_ready(fn(*args))   # warm-up (and any lazy allocation)
    runs = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - t0)
    return float(statistics.median(runs))


def profile(layers: Sequence, sample_inputs: PyTree, *, train: bool = True, measure: bool = False,
            repeats: int = 5, rng=None, variables: Sequence[dict] | None = None,
            names: Sequence[str] | None = None, peak_flops: float | None = None,
            memory_bandwidth: float | None = None) -> list[LayerCost]:
    """Runs `layers` in order on `sample_inputs` (e.g. one microbatch) and returns one
    LayerCost per layer (see the module docstring for what each number means).

    variables: per-layer variable dicts to use instead of fresh `init_layer` ones.
    rng: key for init and dropout (default PRNGKey(0)).
    """
    import jax
    import jax.numpy as jnp

    from jaxhybrid.layers import apply_layer, init_layer, layer_rng

    layers = list(layers)
    if not layers:
        raise ValueError("profile: layers is empty; pass the model's list of flax Modules.")
    if variables is not None and len(variables) != len(layers):
        raise ValueError(f"profile: {len(variables)} variable dicts for {len(layers)} layers.")
    if names is not None and len(names) != len(layers):
        raise ValueError(f"profile: {len(names)} names for {len(layers)} layers.")
    if peak_flops is None or memory_bandwidth is None:
        pf, mb = device_peak()
        peak_flops, memory_bandwidth = peak_flops or pf, memory_bandwidth or mb
    rng = jax.random.PRNGKey(0) if rng is None else rng
    init_key, drop_key = jax.random.split(rng)
    x = jax.tree.map(jnp.asarray, sample_inputs)
    first = jax.tree.leaves(x)
    if not first or np.ndim(first[0]) == 0:
        raise ValueError("profile: sample_inputs needs at least one array with a batch dimension.")
    batch = int(np.shape(first[0])[0])

    out: list[LayerCost] = []
    for i, layer in enumerate(layers):
        if variables is None:
            lvars, _ = init_layer(layer, jax.random.fold_in(init_key, i), x, train=train)
        else:
            lvars = dict(variables[i])
        drop = layer_rng(drop_key, 0, i)
        params = lvars.get("params", {})
        state = {k: v for k, v in lvars.items() if k != "params"}

        def fwd(v, xx, _layer=layer, _drop=drop):
            return apply_layer(_layer, v, xx, train=train, rng=_drop)

        fwd_c = jax.jit(fwd).lower(lvars, x).compile()
        fwd_flops, fwd_bytes = _xla_cost(fwd_c)
        y, _ = fwd_c(lvars, x)

        # The function we differentiate: float outputs of the layer as a function of its
        # params and float inputs; integer leaves ride along as constants.
        x_leaves, x_def = jax.tree.flatten(x)
        fidx = [k for k, l in enumerate(x_leaves) if _is_float(l)] if i > 0 else []

        def f(p, xf, st, _layer=layer, _drop=drop, _leaves=x_leaves, _def=x_def, _fidx=fidx):
            leaves = list(_leaves)
            for k, v in zip(_fidx, xf):
                leaves[k] = v
            yy, new_st = apply_layer(_layer, {"params": p, **st}, jax.tree.unflatten(_def, leaves),
                                     train=train, rng=_drop)
            return [l for l in jax.tree.leaves(yy) if _is_float(l)], new_st

        xf = [x_leaves[k] for k in fidx]
        saved = {}

        def residuals(p, xf_, st, _f=f):
            # Traced (eval_shape), so parameter/state leaves are tracers and can be told
            # apart from true residuals by identity.
            yf, vjp_fn, _ = jax.vjp(lambda a, b: _f(a, b, st), p, xf_, has_aux=True)
            known = jax.tree.leaves((p, st))
            saved["bytes"] = sum(_nbytes(l) for l in jax.tree.leaves(vjp_fn)
                                 if not any(l is q for q in known))
            return yf

        yf_shape = jax.eval_shape(residuals, params, xf, state)
        bwd_flops = bwd_bytes = bwd_time = 0.0
        if yf_shape:
            yf, vjp_fn, _ = jax.vjp(lambda a, b: f(a, b, state), params, xf, has_aux=True)
            ct = [jnp.ones_like(l) for l in yf]
            bwd_c = jax.jit(lambda vf, c: vf(c)).lower(vjp_fn, ct).compile()
            bwd_flops, bwd_bytes = _xla_cost(bwd_c)
            if measure:
                bwd_time = _timed(bwd_c, (vjp_fn, ct), repeats)
        if measure:
            fwd_time = _timed(fwd_c, (lvars, x), repeats)
        else:
            fwd_time = roofline_time(fwd_flops, fwd_bytes, peak_flops, memory_bandwidth)
            bwd_time = roofline_time(bwd_flops, bwd_bytes, peak_flops, memory_bandwidth)

        out.append(LayerCost(
            name=names[i] if names is not None else f"{type(layer).__name__}_{i}",
            batch_size=batch, fwd_flops=fwd_flops, bwd_flops=bwd_flops, fwd_bytes=fwd_bytes,
            bwd_bytes=bwd_bytes, param_bytes=_nbytes(params), param_count=_count(params),
            in_bytes=_nbytes(x), out_bytes=_nbytes(y), saved_bytes=int(saved.get("bytes", 0)),
            saved_bytes_remat=_nbytes(x), fwd_time=fwd_time, bwd_time=bwd_time,
            measured=bool(measure), state_bytes=_nbytes(state)))
        x = y
    return out
