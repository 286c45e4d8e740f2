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
  saved_bytes        the vjp residuals that are not parameters (or other variables), less
                     those the backward recomputes cheaply from the others
                     (`pipeline.backward.Derivation`): what a stage stashes per in-flight
                     microbatch without recomputation;
  saved_bytes_remat  the layer's input bytes: all `jax.checkpoint` keeps, the rest is
                     recomputed by an extra forward in the backward pass.
Both equal the output bytes that XLA's `memory_analysis()` reports for a compiled function
returning those residuals (plain / under `jax.checkpoint`; tests/test_costs.py checks it).
  saved_by_dtype     saved_bytes by dtype name: the engine stashes residuals in one buffer
                     per dtype, each padded to the stage with the most of that dtype;
  bwd_temp_bytes     the temporaries of the layer's compiled backward (`memory_analysis()`
                     temp bytes: intermediate cotangents, a scan's gradient accumulators),
                     held by the backward slot beside the residuals it reads;
  cross_by_dtype     with the backward split as the engine splits it (zb-h1, zbv:
                     `pipeline.backward.SplitBackward` over the stashed residuals), what
                     the input half B hands to the weight half W (the crossing values);
  weight_saved_by_dtype  the stashed residuals W still reads once B has run (the rest of
                     the row is free for crossing values);
  shared_residuals   what the layer stashes that the layer before it stashes too: its
                     input leaves that the layer before stashes as its output (a tanh
                     layer keeps its output, the matmul layer after it its input: one
                     value in a stage holding both).

Times: measured (median, or minimum, of `repeats` runs after a warm-up,
`block_until_ready`, less the same figure for a compiled no-op taking the same arguments:
the per-call overhead a layer inside a stage does not pay) when `measure=True`; otherwise a roofline estimate on the local device,
    time = max(flops / peak_flops, bytes_accessed / memory_bandwidth),
with the peak numbers of `device_peak()` (a table by device kind; override with
`peak_flops=` / `memory_bandwidth=`). The estimate ignores launch overheads and fusion
quality; it ranks layers, it does not predict wall time to better than ~2x.

The record itself (`LayerCost`, `cost_arrays`, `layer_times`, the roofline and the device
peaks) lives in `plan.layer_cost`, re-exported here.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Sequence

import numpy as np

from jaxhybrid.checks import is_float
from jaxhybrid.plan import cost_cache
from jaxhybrid.plan.cost_cache import layer_signature, set_cache_dir  # noqa: F401
from jaxhybrid.plan.layer_cost import (COST_FIELDS, LayerCost, cost_arrays, device_peak,  # noqa: F401
                                      layer_times, roofline_time)
from jaxhybrid.plan.layer_timing import layer_time
from jaxhybrid.plan.residuals import (shared_with_previous, split_backward_bytes, whole_values,  # noqa: F401
                                     stashed_bytes, stashed_io)

PyTree = Any


def _nbytes(tree) -> int:
    import jax
    return int(sum(int(np.prod(np.shape(l))) * np.dtype(l.dtype).itemsize
                   for l in jax.tree.leaves(tree)))


def float_bytes_by_dtype(tree) -> dict:
    """{dtype name: bytes} of the floating (differentiable, `is_float`) leaves of `tree`."""
    import jax
    out: dict = {}
    for leaf in filter(is_float, jax.tree.leaves(tree)):
        name = np.dtype(leaf.dtype).name
        out[name] = out.get(name, 0) + _nbytes(leaf)
    return out


def _count(tree) -> int:
    import jax
    return int(sum(int(np.prod(np.shape(l))) for l in jax.tree.leaves(tree)))


def xla_cost(compiled) -> tuple[float, float]:
    """(FLOPs, bytes accessed) of XLA's cost analysis of a compiled or lowered function
    (lowered: before XLA's passes, so a jax.checkpoint's recomputation is still there)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):   # older jax returned one dict per computation
        ca = ca[0] if ca else {}
    ca = ca or {}
    return float(max(ca.get("flops", 0.0), 0.0)), float(max(ca.get("bytes accessed", 0.0), 0.0))


# Compiled only to read XLA's cost analysis (after its HLO passes, fusion included): the
# backend's code generation may skip its optimisations, which halves the compile time on
# CPU and leaves FLOPs and bytes unchanged; on GPUs no autotuning (of cuDNN convolutions,
# GEMMs): it timed kernels for every layer, and planning the default Inception-V3 job
# took 67 s on an H200.
_COST_ONLY = {"xla_backend_optimization_level": 0, "xla_gpu_autotune_level": 0}


def flops_and_bytes(traced, compiled) -> tuple[float, float]:
    """(FLOPs, bytes accessed) of a layer's function (`traced`, `compiled`): XLA's cost
    analysis of the compiled module (bytes after its fusion), corrected where it counts
    short. It counts a loop's body once: a layer that scans over time (an LSTM) gets
    its scans' other iterations' matmuls from the jaxpr. And a GPU's compiled module
    hands convolutions to cuDNN as custom calls whose FLOPs it leaves out (an H200
    profiled the Inception-V3 step at 1/22 of its FLOPs; jax analyses no lowered module
    on GPUs): there the FLOPs are at least the jaxpr's matmuls and convolutions."""
    from jaxhybrid.models.spec import _jaxpr_flops
    flops, nbytes = xla_cost(compiled)
    jaxpr = traced.jaxpr.jaxpr
    counted = _jaxpr_flops(jaxpr)
    flops += counted - _jaxpr_flops(jaxpr, loops_once=True)
    if _platform(compiled) != "cpu":
        flops = max(flops, counted)
    return flops, nbytes


def lowered_cost(fn, *args) -> tuple[float, float]:
    """(FLOPs, bytes accessed) of `fn` jitted and lowered on `args` (arrays or
    ShapeDtypeStructs), nothing compiled: XLA's analysis of the lowered module (before its
    passes: a jax.checkpoint's recomputation still there), with `flops_and_bytes`'
    corrections (on GPUs jax analyses no lowered module: the jaxpr's count)."""
    import jax
    traced = jax.jit(fn).trace(*args)
    return flops_and_bytes(traced, traced.lower())


def _platform(compiled) -> str:
    try:
        return compiled.runtime_executable().client.platform
    except Exception:   # no such attribute in this jax: the default backend's
        import jax
        return jax.default_backend()


def _compile(lowered, run: bool):
    """`lowered` compiled; optimised machine code only when it will `run`."""
    if run:
        return lowered.compile()
    try:
        return lowered.compile(compiler_options=_COST_ONLY)
    except Exception:   # a backend without that option: the ordinary compile
        return lowered.compile()


def _temp_bytes(compiled) -> int:
    """XLA's temp bytes of a compiled function (0 where the backend does not say)."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:   # no memory analysis on this backend
        return 0


def _variable_bytes(layers, x, train: bool, variables) -> int:
    """Bytes of all the layers' variables (`variables`, or abstractly initialised ones):
    what passes through the caches between two applications of one layer in a step."""
    import jax

    from jaxhybrid.layers import init_layer
    if variables is not None:
        return _nbytes(list(variables))
    total, key = 0, jax.ShapeDtypeStruct((2,), np.uint32)
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), x)
    for layer in layers:
        lvars, x = jax.eval_shape(functools.partial(init_layer, layer, train=train), key, x)
        total += _nbytes(lvars)
    return total


# --- profiling -----------------------------------------------------------------------
def profile(layers: Sequence, sample_inputs: PyTree, *, train: bool = True, measure: bool = False,
            repeats: int = 5, rng=None, variables: Sequence[dict] | None = None,
            names: Sequence[str] | None = None, peak_flops: float | None = None,
            memory_bandwidth: float | None = None,
            cache_dir: str | os.PathLike | None | bool = True,
            reduce: str = "median", timing: str = "alone") -> list[LayerCost]:
    """Runs `layers` in order on `sample_inputs` (e.g. one microbatch) and returns one
    LayerCost per layer (see the module docstring for what each number means).

    variables: per-layer variable dicts to use instead of fresh `init_layer` ones.
    rng: key for init and dropout (default PRNGKey(0)).
    timing: how a measured layer is timed: "alone" (its compiled forward / backward
      called on its own, less a compiled no-op's call) or "loop" (one application of
      many inside one compiled loop, its arguments cycled through copies as large as the
      model: `layer_timing.timed_in_loop`).
    reduce: "median" or "min" of the `repeats` timed runs (min: steadier on a busy host,
      where other processes only ever add time).
    cache_dir: directory of the on-disk cache (True: `cache_dir()`, the one set by
      `set_cache_dir`; None/False: none). Entries are keyed by every layer's
      `layer_signature`, the input shapes and dtypes, the options, the device kind and the
      jax version.

    Without `measure` nothing runs: layers are initialised and differentiated abstractly
    (`jax.eval_shape`) and only compiled for XLA's cost analysis, once per distinct
    (layer signature, input shapes) pair.
    """
    import jax
    import jax.numpy as jnp

    layers = list(layers)
    if not layers:
        raise ValueError("profile: layers is empty; pass the model's list of flax Modules.")
    if variables is not None and len(variables) != len(layers):
        raise ValueError(f"profile: {len(variables)} variable dicts for {len(layers)} layers.")
    if names is not None and len(names) != len(layers):
        raise ValueError(f"profile: {len(names)} names for {len(layers)} layers.")
    if reduce not in ("median", "min"):
        raise ValueError(f"profile: reduce={reduce!r}; use 'median' or 'min'.")
    if timing not in ("alone", "loop"):
        raise ValueError(f"profile: timing={timing!r}; use 'alone' or 'loop'.")
    if peak_flops is None or memory_bandwidth is None:
        pf, mb = device_peak()
        peak_flops, memory_bandwidth = peak_flops or pf, memory_bandwidth or mb
    x = jax.tree.map(jnp.asarray, sample_inputs)
    first = jax.tree.leaves(x)
    if not first or np.ndim(first[0]) == 0:
        raise ValueError("profile: sample_inputs needs at least one array with a batch dimension.")
    names = list(names) if names is not None else [f"{type(l).__name__}_{i}"
                                                   for i, l in enumerate(layers)]
    directory = cost_cache.cache_dir() if cache_dir is True else (cache_dir or None)
    path = None
    if directory is not None and variables is None and rng is None:
        path = cost_cache.cache_path(os.fspath(directory), [
            [layer_signature(l) for l in layers], cost_cache.avals_text(x), train, measure,
            [repeats, reduce] + ([] if timing == "alone" else [timing]) if measure else 0,
            peak_flops, memory_bandwidth])
        cached = cost_cache.read_cache(path)
        if cached is not None and len(cached) == len(layers):
            return [dataclasses.replace(c, name=n) for c, n in zip(cached, names)]
    context = _variable_bytes(layers, x, train, variables) if measure and timing == "loop" else 0
    out = _profile(layers, x, train=train, measure=measure,
                   timing=(repeats, reduce, timing, context), rng=rng,
                   variables=variables, names=names, peaks=(peak_flops, memory_bandwidth))
    if path is not None:
        cost_cache.write_cache(path, out)
    return out


# Threads that compile the profiled layers' programs (cost analysis only, nothing runs):
# XLA releases the GIL, so one layer compiles while the next is traced, and two compiles
# share the cores that one compile's serial passes leave idle. 0: compile in line.
COMPILE_THREADS = 2


def _profile(layers, x, *, train, measure, timing, rng, variables, names, peaks) -> list[LayerCost]:
    import concurrent.futures

    import flax.linen as nn
    import jax

    from jaxhybrid.layers import init_layer, layer_rng

    rng = jax.random.PRNGKey(0) if rng is None else rng
    init_key, drop_key = jax.random.split(rng)
    batch = int(np.shape(jax.tree.leaves(x)[0])[0])
    if not measure:   # shapes suffice: nothing is initialised or run
        x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), x)
    # Measured times need the host to themselves: compile in the background only when
    # nothing is timed.
    pool = None if measure or COMPILE_THREADS < 1 else concurrent.futures.ThreadPoolExecutor(
        COMPILE_THREADS, thread_name_prefix="profile-compile")
    seen: dict = {}
    per_layer = []
    try:
        for i, layer in enumerate(layers):
            init = functools.partial(init_layer, layer, train=train)
            boxed = None   # the abstract init's boxed params: the "model" split dims
            if variables is not None:
                lvars = dict(variables[i])
                if not measure:
                    lvars = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), lvars)
            elif measure:
                lvars, _ = jax.jit(init)(jax.random.fold_in(init_key, i), x)
            else:
                boxed, _ = jax.eval_shape(functools.partial(init, boxed=True),
                                          jax.random.fold_in(init_key, i), x)
                lvars, boxed = nn.meta.unbox(boxed), boxed.get("params", {})
            sig = (layer_signature(layer), cost_cache.avals_text(x), cost_cache.avals_text(lvars), i > 0)
            if measure or sig not in seen:
                seen[sig] = _layer_cost(layer, lvars, x, layer_rng(drop_key, 0, i), i > 0,
                                        train=train, measure=measure, timing=timing,
                                        peaks=peaks, pool=pool, boxed_params=boxed)
            fields, y = seen[sig]
            per_layer.append(fields)
            x = y
    except BaseException:
        if pool is not None:   # what was not started is dropped
            pool.shutdown(cancel_futures=True)
        raise
    if pool is not None:
        pool.shutdown()
    out, io_before = [], None
    for i, f in enumerate(per_layer):
        fields = dict(f.result() if isinstance(f, concurrent.futures.Future) else f)
        io = fields.pop("stashed_io")
        out.append(LayerCost(name=names[i], batch_size=batch, measured=bool(measure),
                             shared_residuals=shared_with_previous(io_before, io), **fields))
        io_before = io
    return out


def _layer_cost(layer, lvars, x, drop, diff_inputs: bool, *, train, measure, timing, peaks,
                pool=None, boxed_params=None):
    """(LayerCost fields but name/batch_size/measured, the layer's output) of one layer on
    `x` with variables `lvars` (arrays when measuring, else ShapeDtypeStructs). With a
    thread `pool`, the fields are a Future: the layer is traced and lowered here, its
    programs compiled (for XLA's cost analysis) on the pool. `boxed_params`: the
    abstract init's boxed "params", when the caller has them (`model_terms` then need not
    trace the initialiser again)."""
    import jax
    import jax.numpy as jnp

    from jaxhybrid import tensor_parallel
    from jaxhybrid.layers import apply_layer
    from jaxhybrid.plan.model_axis import model_terms

    params = lvars.get("params", {})
    state = {k: v for k, v in lvars.items() if k != "params"}

    def fwd(v, xx):
        return apply_layer(layer, v, xx, train=train, rng=drop)

    with tensor_parallel.watch() as asked:   # a layer written for tensor parallelism asks
        fwd_traced = jax.jit(fwd).trace(lvars, x)
        fwd_lowered = fwd_traced.lower()
    fwd_c = _compile(fwd_lowered, True) if measure else None
    y = fwd_c(lvars, x)[0] if measure else jax.eval_shape(fwd, lvars, x)[0]

    forward_vjp, xf, x_leaves, traced = _forward_vjp(layer, x, drop, diff_inputs, train)

    # Abstract (or, when measuring, jitted) forward + vjp: the pullback's residuals, of
    # which the engine stashes what its backward cannot recompute cheaply.
    closed, (yf, vjp_fn) = jax.make_jaxpr(forward_vjp, return_shape=True)(
        params, xf, state, x_leaves)
    if measure:
        yf, vjp_fn = jax.jit(forward_vjp)(params, xf, state, x_leaves)
    saved = stashed_bytes(closed, len(jax.tree.leaves(yf)), traced["kept"])
    # jaxpr inputs: params, float inputs (leaves `fidx`), state, every input leaf.
    n_p, n_s = len(jax.tree.leaves(params)), len(jax.tree.leaves(state))
    fidx = traced["float_inputs"]
    y_float = [k for k, l in enumerate(jax.tree.leaves(y)) if is_float(l)]
    io = stashed_io(closed, saved["vars"],
                     [(n_p + j, k) for j, k in enumerate(fidx)]
                     + [(n_p + len(fidx) + n_s + k, k) for k in range(len(x_leaves))], y_float)
    split = split_backward_bytes(forward_vjp, (params, xf, state, x_leaves)) if yf else {}
    bwd_lowered = bwd_traced = ct = None
    if yf:
        ct = [jnp.ones(l.shape, l.dtype) if measure else l for l in yf]
        bwd_traced = jax.jit(lambda vf, c: vf(c)).trace(vjp_fn, ct)
        bwd_lowered = bwd_traced.lower()
    shapes = dict(param_bytes=_nbytes(params), param_count=_count(params),
                  in_bytes=_nbytes(x), out_bytes=_nbytes(y),
                  saved_bytes=int(saved.get("bytes", 0)), saved_bytes_remat=_nbytes(x),
                  state_bytes=_nbytes(state), saved_by_dtype=dict(saved.get("by_dtype", {})),
                  cross_by_dtype=split.get("cross", {}),
                  param_by_dtype=float_bytes_by_dtype(params),
                  cross_values=split.get("cross_values", []),
                  largest_saved_by_dtype=dict(saved.get("largest", {})),
                  param_values=whole_values(filter(is_float, jax.tree.leaves(params))),
                  weight_saved_by_dtype=split.get("weight_saved", {}), stashed_io=io,
                  **model_terms(layer, x, drop, diff_inputs, train=train,
                                saved_bytes=int(saved.get("bytes", 0)),
                                boxed_params=boxed_params, asks_degree=bool(asked)))

    def compiled_costs() -> dict:
        fwd_flops, fwd_bytes = flops_and_bytes(fwd_traced, fwd_c or _compile(fwd_lowered, False))
        bwd_flops = bwd_bytes = bwd_time = 0.0
        bwd_temp, fwd_threads, bwd_threads = 0, 1.0, 1.0
        if bwd_lowered is not None:
            bwd_c = _compile(bwd_lowered, measure)
            bwd_flops, bwd_bytes = flops_and_bytes(bwd_traced, bwd_c)
            bwd_temp = _temp_bytes(bwd_c)
            if measure:
                bwd_time, bwd_threads = layer_time(
                    timing, bwd_c, lambda vf, c: vf(c), (vjp_fn, ct),
                    roofline_time(bwd_flops, bwd_bytes, *peaks))
        if measure:
            fwd_time, fwd_threads = layer_time(timing, fwd_c, fwd, (lvars, x),
                                               roofline_time(fwd_flops, fwd_bytes, *peaks))
        else:
            fwd_time = roofline_time(fwd_flops, fwd_bytes, *peaks)
            bwd_time = roofline_time(bwd_flops, bwd_bytes, *peaks)
        return dict(fwd_flops=fwd_flops, bwd_flops=bwd_flops, fwd_bytes=fwd_bytes,
                    bwd_bytes=bwd_bytes, fwd_time=fwd_time, bwd_time=bwd_time,
                    fwd_threads=fwd_threads, bwd_threads=bwd_threads,
                    bwd_temp_bytes=bwd_temp, **shapes)

    return (compiled_costs() if pool is None else pool.submit(compiled_costs)), y


def _forward_vjp(layer, x, drop, diff_inputs: bool, train: bool):
    """(forward_vjp(params, float inputs, state, input leaves) -> (float outputs, vjp fn),
    the float inputs, the input leaves, {"float_inputs": their leaf indices, "kept":
    indices of the vjp function's leaves that are residuals, not variables, filled when
    it is traced}). Gradients w.r.t.
    params and, if `diff_inputs`, the float inputs."""
    import jax

    from jaxhybrid.layers import apply_layer

    # The function we differentiate: float outputs of the layer as a function of its
    # params and float inputs; integer leaves ride along as constants.
    x_leaves, x_def = jax.tree.flatten(x)
    fidx = [k for k, l in enumerate(x_leaves) if is_float(l)] if diff_inputs else []

    def f(p, xf, st, leaves):
        leaves = list(leaves)
        for k, v in zip(fidx, xf):
            leaves[k] = v
        yy, new_st = apply_layer(layer, {"params": p, **st}, jax.tree.unflatten(x_def, leaves),
                                 train=train, rng=drop)
        return [l for l in jax.tree.leaves(yy) if is_float(l)], new_st

    traced = {"float_inputs": fidx}

    def forward_vjp(p, xf_, st, leaves):
        yf, vjp_fn, _ = jax.vjp(lambda a, b: f(a, b, st, leaves), p, xf_, has_aux=True)
        # Traced, so parameter/state leaves are tracers and can be told apart from
        # true residuals by identity.
        known = jax.tree.leaves((p, st))
        traced["kept"] = [i for i, l in enumerate(jax.tree.leaves(vjp_fn))
                         if not any(l is q for q in known)]
        return yf, vjp_fn

    return forward_vjp, [x_leaves[k] for k in fidx], x_leaves, traced
