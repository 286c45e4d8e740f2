"""Per-piece costs for the planner from XLA's cost analysis of the *lowered* pieces.

`jaxhybrid.plan.profile` compiles every layer's forward and backward (right for a few
dozen hand-written layers, ~8 s per piece of a 3,000-equation model on a busy 2-core
CPU). Pieces of a split model are straight-line segments of one program, so here each
piece's forward and forward+vjp are only lowered to HLO, and XLA's HLO cost analysis of
the unoptimised module gives FLOPs and bytes (no compilation for times); backward = the
difference. Residual memory is what the engine stashes for the piece: its forward + vjp
traced (abstractly) as a stage's is, the parameters and what the backward recomputes
cheaply left out (`pipeline.backward.Residuals` / `Derivation`, as in `plan.costs`), with
the split backward's crossing values for zb-h1 / zbv, and the backward's temporaries
(the one compile per distinct piece: its backward alone, unoptimised); the recompute
variant is its inputs. Neighbouring pieces often stash the same value (one's output, the next one's
input): `shared_residuals` records what a piece stashes that an earlier piece stashes
too, which the memory model counts once when both run in one stage (it summed every
value the pieces compute: GPT small as one module, 189MB predicted against 54MB compiled).

With a cache directory set (`plan.costs.set_cache_dir`, as `scripts/train.py` does), each
distinct piece's analysis is kept on disk, keyed by its operations (with their
parameters), shapes and dtypes, the device kind and the jax version: a second run of
the same model analyses nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import json
import re

from jaxhybrid.checks import is_float
from jaxhybrid.plan import cost_cache
from jaxhybrid.plan import costs as plan_costs
from jaxhybrid.plan.costs import LayerCost, device_peak, lowered_cost, roofline_time
from jaxhybrid.plan.residuals import (bytes_by_dtype, dtype_and_bytes, split_backward_bytes,
                                     stashed_bytes, stashed_io, whole_values)


_FORMAT = "piece-5"   # on-disk records: 2 added the stashed residuals, 3 backward temporaries,
#                       4 crossing values one by one, 5 a linear piece's backward in full
# `_residuals`' record of a piece that stashes nothing.
_NO_RESIDUALS = {"saved": {}, "cross": {}, "weight_saved": {}, "cross_values": [], "largest": {},
                 "io": [], "bwd_temp": 0}


def _wiring(prog, units, args, outs) -> tuple:
    """A piece's operations as they are wired, independent of the program's value ids:
    per unit its operation, length, inputs (the piece's argument n, unit u's output m,
    or a constant's shape and dtype), sliced inputs and output shapes; then the piece's
    outputs alike."""
    where = {i: ("arg", n) for n, i in enumerate(args)}
    aval = lambda i: (prog.avals[i].shape, str(prog.avals[i].dtype))  # noqa: E731
    units_sig = []
    for u_n, u in enumerate(units):
        ins = tuple(where.get(i, ("const", *aval(i))) for i in u.ins)
        units_sig.append((u.op.name, u.length, ins, tuple(u.slice_at),
                          tuple(aval(o) for o in u.outs)))
        where.update({o: ("unit", u_n, m) for m, o in enumerate(u.outs)})
        for m, (o, chunks) in enumerate(u.concat):   # a scan's chunks joined
            where[o] = ("concat", u_n, m, tuple(where.get(c) for c in chunks))
    return tuple(units_sig), tuple(where.get(i, ("const", *aval(i))) for i in outs)


def piece_costs(split, sample, *, train: bool = True) -> list[LayerCost]:
    """One LayerCost per piece of `split` on `sample` (one microbatch)."""
    x_abs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.asarray(a).dtype), sample)
    t, segs = split._segments(x_abs, train)
    prog = t.prog
    peak_flops, bandwidth = device_peak()
    batch = int(np.shape(jax.tree.leaves(sample)[0])[0])
    out, seen, stashed_by = [], {}, {}
    none = split.without_gradient(t, segs)
    for k, seg in enumerate(segs):
        var_ids = list(seg.reads.values())
        in_ids = [i for i in seg.live_in if i in prog.avals]
        outs = t.y_ids if k == len(segs) - 1 else seg.live_out
        outs = [i for i in outs if i not in prog.consts]
        args = var_ids + in_ids
        # As the pipeline differentiates the piece: not the model's input, nor a value
        # without part in the gradient (`cuts.without_gradient`; run_piece
        # stop_gradients it where it enters or leaves a piece).
        diff = [n for n, i in enumerate(args) if is_float(prog.avals[i])
                and (k > 0 or i not in t.x_ids) and i not in none]

        def fwd(*vals, _seg=seg, _args=args, _outs=outs):
            env = dict(prog.consts)
            env.update(zip(_args, vals))
            for unit in _seg.units:
                unit.run(env)
            return [jax.lax.stop_gradient(env[i]) if i in none else env[i] for i in _outs]

        def fwd_bwd(*vals, _fwd=fwd, _diff=diff):
            def f(*d):
                full = list(vals)
                for n, v in zip(_diff, d):
                    full[n] = v
                return [y for y in _fwd(*full) if is_float(y)]
            ys, pull = jax.vjp(f, *[vals[n] for n in _diff])
            # The outputs too: a linear piece's backward needs no forward value, jit
            # dropped its forward, and `fwd_bwd - fwd` priced the backward one forward
            # short (GPT tiny split: 1.24 of 2.34 MFLOPs per row).
            return ys, pull([jnp.ones_like(y) for y in ys])

        avals = [jax.ShapeDtypeStruct(prog.avals[i].shape, prog.avals[i].dtype) for i in args]
        # Repeated blocks make pieces with the same operations on the same shapes, wired
        # alike: their costs are analysed once. (Shapes alone matched pieces whose
        # outputs differed: a record's stashed outputs indexed another piece's outputs.)
        sig = (tuple(diff), tuple((a.shape, str(a.dtype)) for a in avals),
               _wiring(prog, seg.units, args, outs))
        disk = None
        if sig not in seen and cost_cache.cache_dir() is not None:
            disk = cost_cache.cache_path(cost_cache.cache_dir(), [_FORMAT, repr(sig), [
                _unit_text(u) for u in seg.units], [(prog.avals[i].shape, str(prog.avals[i].dtype)) for i in outs]])
            try:
                seen[sig] = tuple(json.loads(disk.read_text()))
            except (OSError, ValueError):
                pass
        if sig not in seen:
            f_flops, f_bytes = lowered_cost(fwd, *avals)
            b_flops = b_bytes = 0.0
            if diff and any(is_float(prog.avals[i]) for i in outs):
                t_flops, t_bytes = lowered_cost(fwd_bwd, *avals)
                b_flops, b_bytes = max(t_flops - f_flops, 0.0), max(t_bytes - f_bytes, 0.0)
            seen[sig] = (f_flops, f_bytes, b_flops, b_bytes,
                         _residuals(fwd, avals, diff, len(var_ids), outs, prog))
            if disk is not None:
                cost_cache.write_text(disk, json.dumps(seen[sig]))
        f_flops, f_bytes, b_flops, b_bytes, res = seen[sig]
        if res is None:   # not traceable alone: every float value it makes, an upper bound
            made = [o for u in seg.units for o in u.outs if is_float(prog.avals[o])]
            res = {**_NO_RESIDUALS, "saved": bytes_by_dtype([prog.avals[o] for o in made])}
        # The stashed values that are the piece's inputs or outputs, as program values,
        # and of those, what an earlier piece stashes too (the nearest one).
        io = {(args[n] if where == "in" else outs[n]): nbytes for where, n, nbytes in res["io"]}
        shared = [[k - stashed_by[i], dtype_and_bytes(prog.avals[i])[0], n]
                  for i, n in io.items() if i in stashed_by]
        stashed_by.update(dict.fromkeys(io, k))
        nb = lambda ids: int(sum(prog.nbytes(i) for i in ids))
        # Recomputed, a piece keeps the inputs its operations read; what it only passes
        # on (a residual stream around an attention block) needs no recomputation.
        read = sorted({i for u in seg.units for i in u.ins} & set(in_ids))
        params = [i for key, i in seg.reads.items() if split.var_name(key)[0] == "params"]
        state = [i for key, i in seg.reads.items() if split.var_name(key)[0] != "params"]
        out.append(LayerCost(
            name=f"piece_{k}", batch_size=batch, fwd_flops=f_flops, bwd_flops=b_flops,
            fwd_bytes=f_bytes, bwd_bytes=b_bytes, param_bytes=nb(params),
            param_count=int(sum(np.prod(prog.avals[i].shape) for i in params)),
            in_bytes=nb(in_ids), out_bytes=nb(outs), saved_bytes=int(sum(res["saved"].values())),
            saved_bytes_remat=nb(read), saved_by_dtype=dict(res["saved"]),
            cross_by_dtype=dict(res["cross"]), weight_saved_by_dtype=dict(res["weight_saved"]),
            shared_residuals=shared, bwd_temp_bytes=int(res["bwd_temp"]),
            fwd_time=roofline_time(f_flops, f_bytes, peak_flops, bandwidth),
            bwd_time=roofline_time(b_flops, b_bytes, peak_flops, bandwidth),
            measured=False, state_bytes=nb(state),
            param_by_dtype=plan_costs.float_bytes_by_dtype([prog.avals[i] for i in params]),
            cross_values=[list(v) for v in res["cross_values"]],
            largest_saved_by_dtype=dict(res["largest"]),
            param_values=whole_values(prog.avals[i] for i in params
                                      if is_float(prog.avals[i]))))
    return out


def _unit_text(unit) -> str:
    """A unit's operation with its parameters (sub-programs printed, object addresses
    dropped): part of a piece's on-disk cache key."""
    params = sorted(unit.op.eqn.params.items())
    return f"{unit.op.name}x{unit.length}:" + re.sub(r" at 0x[0-9a-fA-F]+", "", repr(params))


def _residuals(fwd, avals, diff, num_vars: int, outs, prog) -> dict:
    """What the engine stashes for a piece whose forward is `fwd(*args)` (args: its
    `num_vars` variables, then its inputs; `diff`: the float arguments differentiated),
    traced abstractly: {"saved", "cross", "weight_saved"} bytes by dtype, and "io": the
    stashed values that are its arguments or outputs, as ("in", argument index, bytes)
    or ("out", output index, bytes) (what a neighbour may stash too). None when the
    piece cannot be differentiated alone."""
    p_idx = [n for n in diff if n < num_vars]
    x_idx = [n for n in diff if n >= num_vars]
    rest_idx = [n for n in range(len(avals)) if n not in diff]
    float_outs = [m for m, i in enumerate(outs) if is_float(prog.avals[i])]
    traced: dict = {}

    def forward_vjp(p, x, rest):
        def f(pp, xx):
            full = [None] * len(avals)
            for idx, vals in ((p_idx, pp), (x_idx, xx), (rest_idx, rest)):
                for n, v in zip(idx, vals):
                    full[n] = v
            return [y for y in fwd(*full) if is_float(y)]
        ys, pull = jax.vjp(f, list(p), list(x))
        known = list(p) + [v for n, v in zip(rest_idx, rest) if n < num_vars]
        traced["kept"] = [i for i, l in enumerate(jax.tree.leaves(pull))
                          if not any(l is q for q in known)]
        return ys, pull

    args = ([avals[n] for n in p_idx], [avals[n] for n in x_idx], [avals[n] for n in rest_idx])
    if not float_outs:
        return _NO_RESIDUALS
    try:
        closed, (ys, pull) = jax.make_jaxpr(forward_vjp, return_shape=True)(*args)
    except Exception:   # noqa: BLE001  (the caller counts every float value it makes)
        return None
    # The backward alone (residuals in, cotangents out), compiled at the lowest
    # optimisation level for its temporaries: a conv net's pieces held ~1 residual row
    # of them, and without them its split was predicted 12% under the compiled step.
    bwd_temp = plan_costs._temp_bytes(plan_costs._compile(
        jax.jit(lambda vf, c: vf(c)).lower(pull, list(ys)), False))
    saved = stashed_bytes(closed, len(jax.tree.leaves(ys)), traced["kept"])
    # jaxpr inputs are p, x, rest in order (the inputs: argument index >= num_vars); its
    # first outputs the float outputs.
    io = stashed_io(closed, saved["vars"],
                    [(j, n) for j, n in enumerate(p_idx + x_idx + rest_idx) if n >= num_vars],
                    float_outs)
    split = split_backward_bytes(forward_vjp, args)
    return {"saved": saved["by_dtype"], "largest": saved["largest"],
            "cross": split.get("cross", {}), "weight_saved": split.get("weight_saved", {}),
            "cross_values": split.get("cross_values", []),
            "io": [(where, n, rec[1]) for where in ("in", "out") for n, rec in io[where].items()],
            "bwd_temp": bwd_temp}
