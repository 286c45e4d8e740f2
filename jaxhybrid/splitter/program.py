"""A model's traced forward as a flat straight-line program of cuttable operations.

`flatten` turns a closed jaxpr into a `Program`: nested `jit` calls (`jax.jit`, `nn.jit`,
library helpers) and `jax.checkpoint` regions are inlined, so their equations become
top-level operations and a cut may fall between any two of them; `custom_vjp` /
`custom_jvp` calls stay atomic (inlining would lose their gradient rule); a `scan` stays
one operation that can still be split between iterations (`Op.iters`). A `jit` named
`STAGE_BOUNDARY` (what `stage_boundary` traces to) is an identity that forces a cut.
Dead operations are dropped. Values are integer ids; constants and literals are ids too.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np
from jax.interpreters.partial_eval import dce_jaxpr

STAGE_BOUNDARY = "jaxhybrid_stage_boundary"
_CALLS = {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint"}


def _boundary_identity(*xs):
    return xs


_boundary_identity.__name__ = STAGE_BOUNDARY
_boundary_jit = jax.jit(_boundary_identity)


def stage_boundary(x):
    """Marks a forced pipeline cut after `x` (any pytree) when the model is split;
    an identity everywhere else (under jit, grad and vmap too)."""
    leaves, tree = jax.tree.flatten(x)
    return jax.tree.unflatten(tree, list(_boundary_jit(*leaves)))


@dataclasses.dataclass
class Op:
    """One operation: a jaxpr equation run on value ids. iters > 1: a scan whose
    iterations may be split (`run_op` with a sub-range)."""
    eqn: Any
    ins: list
    outs: list
    cost: float          # estimated seconds (roofline of estimated flops / bytes)
    iters: int = 1

    @property
    def name(self) -> str:
        return self.eqn.primitive.name


@dataclasses.dataclass
class Program:
    avals: dict = dataclasses.field(default_factory=dict)     # id -> ShapedArray
    consts: dict = dataclasses.field(default_factory=dict)    # id -> value
    ops: list = dataclasses.field(default_factory=list)
    invars: list = dataclasses.field(default_factory=list)    # ids of the traced function's inputs
    outvars: list = dataclasses.field(default_factory=list)   # ids of its outputs
    forced: set = dataclasses.field(default_factory=set)      # op indices a cut must precede
    _next: int = 0

    def new(self, aval) -> int:
        i = self._next
        self._next += 1
        self.avals[i] = aval
        return i

    def const(self, value, aval=None) -> int:
        i = self.new(aval if aval is not None else jax.typeof(value))
        self.consts[i] = value
        return i

    def nbytes(self, i: int) -> int:
        a = self.avals[i]
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            return 8 * int(np.prod(a.shape))
        return int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize

    def structure(self) -> tuple:
        """What must stay the same when the model is traced at other input shapes."""
        return tuple((op.name, op.iters, len(op.ins), len(op.outs)) for op in self.ops), \
            tuple(sorted(self.forced))


def flatten(closed: jcore.ClosedJaxpr, peaks: tuple[float, float]) -> Program:
    # jax's own dead-code elimination first: it also prunes what is dead *inside* the
    # operations that stay whole (a scan's unused inputs, e.g. the per-iteration dropout
    # keys that flax's lifted scan splits off even in evaluation mode), so values they
    # no longer read (the dropout key) are not asked for. All inputs are kept.
    jaxpr, _ = dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    prog = Program()
    env: dict = {}
    for v, c in zip(jaxpr.constvars, closed.consts):
        env[v] = prog.const(c)
    for v in jaxpr.invars:
        env[v] = prog.new(v.aval)
    prog.invars = [env[v] for v in jaxpr.invars]
    _inline(prog, jaxpr, env, peaks)
    prog.outvars = [_read(prog, env, v) for v in jaxpr.outvars]
    _dce(prog)
    return prog


def _read(prog: Program, env: dict, v) -> int:
    if isinstance(v, jcore.Literal):
        return prog.const(v.val, v.aval)
    return env[v]


def _inline(prog: Program, jaxpr, env: dict, peaks) -> None:
    for eqn in jaxpr.eqns:
        ins = [_read(prog, env, v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _CALLS:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            if (name in ("jit", "pjit") and eqn.params.get("name") == STAGE_BOUNDARY):
                for o, i in zip(eqn.outvars, ins):
                    env[o] = i
                prog.forced.add(len(prog.ops))
                continue
            consts = list(getattr(inner, "consts", []))
            inner = getattr(inner, "jaxpr", inner)
            sub = {}
            for v, c in zip(inner.constvars, consts):
                sub[v] = prog.const(c)
            for v, i in zip(inner.invars, ins):
                sub[v] = i
            _inline(prog, inner, sub, peaks)
            for o, v in zip(eqn.outvars, inner.outvars):
                env[o] = _read(prog, sub, v)
            continue
        if name == "sharding_constraint":
            # `jax.lax.with_sharding_constraint` names the whole mesh, which is manual
            # inside the pipeline's shard_map ("Mesh for all inputs should be equal"):
            # the pipeline places values itself, so the constraint is an identity here.
            env[eqn.outvars[0]] = ins[0]
            continue
        outs = [prog.new(o.aval) for o in eqn.outvars]
        for o, i in zip(eqn.outvars, outs):
            if not isinstance(o, jcore.DropVar):
                env[o] = i
        iters = int(eqn.params["length"]) if (name == "scan" and not eqn.params["reverse"]
                                             and eqn.params["length"] > 1) else 1
        prog.ops.append(Op(eqn, ins, outs, estimate_time(eqn, peaks), iters))


def _dce(prog: Program) -> None:
    live = set(prog.outvars)
    keep = []
    for op in reversed(prog.ops):
        if op.eqn.effects or any(o in live for o in op.outs):
            keep.append(op)
            live.update(op.ins)
    dropped = len(prog.ops) - len(keep)
    if dropped:
        # Forced cuts are positions in the op list: renumber them over the kept ops.
        old = {id(op): k for k, op in enumerate(prog.ops)}
        kept_pos = sorted(old[id(op)] for op in keep)
        prog.forced = {sum(1 for p in kept_pos if p < f) for f in prog.forced}
    prog.ops = keep[::-1]


# --- cost estimates (used to pick candidate cuts; pieces are then profiled by XLA) ------
def _size(aval) -> int:
    return int(np.prod(getattr(aval, "shape", ()))) if hasattr(aval, "shape") else 1


def _bytes(aval) -> int:
    try:
        return _size(aval) * np.dtype(aval.dtype).itemsize
    except TypeError:
        return 8 * _size(aval)


def estimate_flops(eqn) -> tuple[float, float]:
    """(flops, bytes accessed) of one equation, by shape arithmetic."""
    name = eqn.primitive.name
    outs = [v.aval for v in eqn.outvars]
    ins = [v.aval for v in eqn.invars]
    nbytes = float(sum(_bytes(a) for a in ins + outs))
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        k = int(np.prod([ins[0].shape[d] for d in lc])) if lc else 1
        return 2.0 * _size(outs[0]) * k, nbytes
    if name == "conv_general_dilated":
        rhs = ins[1].shape
        out_feat = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2.0 * _size(outs[0]) * np.prod(rhs) / max(1, out_feat), nbytes
    subs = list(jcore.jaxprs_in_params(eqn.params))
    if subs:
        inner = [sum(estimate_flops(e)[0] for e in j.eqns) for j in subs]
        scale = eqn.params.get("length", 1) if name == "scan" else 1
        return float(scale * (max(inner) if name == "cond" else sum(inner))), nbytes
    return float(sum(_size(a) for a in outs)), nbytes


def estimate_time(eqn, peaks) -> float:
    flops, nbytes = estimate_flops(eqn)
    return max(flops / peaks[0], nbytes / peaks[1])


# --- running operations -------------------------------------------------------------
def run_op(op: Op, args: list, length: int | None = None) -> list:
    """Binds the op's primitive on concrete or traced args; `length` re-sizes a scan
    (the caller passes its xs already sliced)."""
    params = dict(op.eqn.params)
    if length is not None:
        params["length"] = length
    bparams = op.eqn.primitive.get_bind_params(params)
    with op.eqn.ctx.manager:
        out = op.eqn.primitive.bind(*args, **bparams)
    return list(out) if op.eqn.primitive.multiple_results else [out]


def scan_layout(op: Op) -> tuple[int, int]:
    """(num_consts, num_carry) of a scan op."""
    return int(op.eqn.params["num_consts"]), int(op.eqn.params["num_carry"])
