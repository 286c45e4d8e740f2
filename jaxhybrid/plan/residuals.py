"""The residuals the engine stashes for one traced layer or piece (`plan.costs.profile`
and `splitter.costs.piece_costs` share it): the vjp's kept leaves less what the backward
recomputes cheaply (`pipeline.backward.Derivation`), which of them are the layer's own
inputs or outputs (a neighbour may stash the same value), and a split backward's
crossing values (zb-h1, zbv)."""
from __future__ import annotations

import numpy as np


def dtype_and_bytes(aval) -> tuple[str, int]:
    """(dtype name, bytes) of a value as the engine stashes it: a typed PRNG key as its
    key data (uint32 words; a rematerialised dropout key is a residual)."""
    import jax
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        aval = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    return np.dtype(aval.dtype).name, int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def stashed_bytes(closed, num_outputs: int, kept: list) -> dict:
    """{"bytes", "by_dtype", "largest", "vars"} of the residuals the engine stashes, from
    the jaxpr of forward_vjp (outputs: the float outputs, then the vjp function's leaves) and the
    indices of its kept (non-variable) leaves: `backward.Derivation` drops those the
    backward recomputes cheaply from the others, as the pipeline runtime does. "largest":
    by dtype, the largest one's bytes; "vars": the stashed values' jaxpr variables."""
    from jaxhybrid.pipeline.backward import Derivation

    out = closed.jaxpr.outvars
    leaves = [out[num_outputs + i] for i in kept]
    stashed = [leaves[i] for i in Derivation.of(closed, leaves).stash]
    by_dtype = bytes_by_dtype([v.aval for v in stashed])
    largest: dict = {}
    for d, n in whole_values([v.aval for v in stashed]):
        largest.setdefault(d, n)
    return {"bytes": sum(by_dtype.values()), "by_dtype": by_dtype, "largest": largest,
            "vars": stashed}


def stashed_io(closed, stashed: list, inputs: list, outputs: list) -> dict:
    """Which stashed values (`stashed_bytes`'s "vars") are the layer's own input or
    output leaves, unchanged: {"in" | "out": {leaf index: [dtype name, bytes]}}.
    `inputs`: (jaxpr input position, input leaf index) pairs; `outputs`: the output leaf
    index of each of the jaxpr's first outputs. A tanh layer stashes its output and the
    matmul after it its input: one value, which a stage holding both stashes once."""
    ins = {id(closed.jaxpr.invars[j]): k for j, k in inputs}
    outs = {id(v): k for v, k in zip(closed.jaxpr.outvars, outputs)}
    io: dict = {"in": {}, "out": {}}
    for v in stashed:
        rec = list(dtype_and_bytes(v.aval))
        if id(v) in ins:
            io["in"][ins[id(v)]] = rec
        if id(v) in outs:
            io["out"][outs[id(v)]] = rec
    return io


def shared_with_previous(io_before: dict | None, io: dict) -> list:
    """`LayerCost.shared_residuals` of a layer from its `stashed_io` and the layer
    before's (whose output is its input): the input leaves both stash."""
    if not io_before:
        return []
    return [[1, *io["in"][k]] for k in sorted(io["in"]) if k in io_before["out"]]


def split_backward_bytes(forward_vjp, args) -> dict:
    """{"cross", "weight_saved", "cross_values"}: by dtype, the crossing values of the
    layer's backward split into B and W as the engine splits a stage's (its stashed
    residuals from `Residuals` and `Derivation`, `SplitBackward` over them), and the
    stashed residuals W reads; the crossing values one by one (`whole_values`). Traced
    abstractly. {} when the backward cannot be split (a schedule with
    a split backward then fails in the pipeline itself, with its own message)."""
    import jax

    from jaxhybrid.pipeline.backward import Residuals, SplitBackward

    residuals = Residuals()

    def forward(p, *rest):
        yf, vjp_fn = forward_vjp(p, *rest)
        return yf, residuals.split(0, vjp_fn, p)

    try:
        closed, (yf, kept) = jax.make_jaxpr(forward, return_shape=True)(*args)
        n = len(jax.tree.leaves(yf))
        kept = [kept[i] for i in residuals.derive(0, closed, closed.jaxpr.outvars[
            n:n + len(kept)]).stash]
        split = SplitBackward(lambda p, res, ct: residuals.rebuild(0, res, p)(ct), args[0],
                              kept, list(yf), len(jax.tree.leaves(args[0])))
    except Exception:   # noqa: BLE001  (only split schedules' memory estimate is lost)
        return {}
    live = [a for a, w in zip(kept, split.weight_reads_residual) if w]
    return {"cross": bytes_by_dtype(split.crossing_avals), "weight_saved": bytes_by_dtype(live),
            "cross_values": whole_values(split.crossing_avals)}


def whole_values(avals) -> list:
    """[[dtype name, bytes], ...] of each value, largest first (`LayerCost.cross_values`,
    `param_values`)."""
    return sorted((list(dtype_and_bytes(a)) for a in avals), key=lambda v: -v[1])


def bytes_by_dtype(avals) -> dict:
    out: dict = {}
    for a in avals:
        name, n = dtype_and_bytes(a)
        out[name] = out.get(name, 0) + n
    return out
