"""A stage's backward from stashed residuals: whole, or split into B (input gradient) and
W (weight gradient) without recomputing anything.

`Residuals` turns the vjp function of a stage's forward into stashable leaves (parameters
are not stashed: the backward re-reads them from the stage buffers). `SplitBackward`
traces the backward once to a jaxpr and partitions its equations: B gets every equation
the input gradient needs, and those with effects (callbacks); W gets the rest of what the
parameter gradient needs, reading the values B computed that it uses (the intermediate
cotangents) from a stash. So W runs
no forward operation and repeats no B operation (`tests/test_schedules_runtime.py`
checks its jaxpr).
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.extend import core as jcore

from jaxhybrid import tensor_parallel

PyTree = Any


class Residuals:
    """Splits a vjp function into stashable residual leaves and parameters.

    `jax.vjp` returns a pytree (a Partial) whose leaves are the residuals. Leaves that are
    the very parameter arrays passed in are not stashed. The structure is recorded per
    stage when its forward is traced and reused when its backward is traced. Once a
    stage's `Derivation` is registered (`derive`), `split` returns only the leaves it
    stashes and `rebuild` recomputes the others."""

    def __init__(self):
        self.meta: dict = {}
        self.derived: dict = {}

    def split(self, stage: int, vjp_fn, params: PyTree) -> list:
        leaves, treedef = jax.tree.flatten(vjp_fn)
        where = {id(p): i for i, p in enumerate(jax.tree.leaves(params))}
        kinds = tuple(where.get(id(l)) for l in leaves)
        self.meta[stage] = (treedef, kinds)
        kept = [l for l, k in zip(leaves, kinds) if k is None]
        d = self.derived.get(stage)
        return kept if d is None else [kept[i] for i in d.stash]

    def rebuild(self, stage: int, kept: Sequence, params: PyTree):
        if stage in self.derived:
            kept = self.derived[stage].restore(kept)
        treedef, kinds = self.meta[stage]
        p, it = jax.tree.leaves(params), iter(kept)
        return jax.tree.unflatten(treedef, [p[k] if k is not None else next(it) for k in kinds])

    def derive(self, stage: int, closed, leaves: list) -> "Derivation":
        """Registers which of the stage's kept residuals to stash, from `closed`, the jaxpr
        of its forward, and `leaves`, its variables holding them (see `Derivation`)."""
        self.derived[stage] = Derivation.of(closed, leaves)
        return self.derived[stage]


# Primitives whose outputs the backward recomputes instead of reading from the stash when
# their inputs are stashed anyway: elementwise arithmetic and shape changes, each far
# cheaper than writing a row and reading it back (no transcendental, reduction, random
# number or collective). jax's tanh rule, for one, keeps both y and 1 - y.
CHEAP_PRIMITIVES = frozenset({
    "add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "square", "integer_pow",
    "select_n", "convert_element_type", "eq", "ne", "gt", "ge", "lt", "le", "and", "or",
    "not", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy", "copy_p"})


class Derivation:
    """Which residual leaves of a stage are stashed, and how the backward recomputes the
    others from them: a leaf that another leaf duplicates, or that follows from stashed
    leaves and constants by `CHEAP_PRIMITIVES` alone, is not stashed. Parameters are not
    roots: under asynchronous weights the backward's parameters may differ from the
    forward's, so a residual computed from them keeps the forward's value in the stash."""

    def __init__(self, stash: tuple, leaf_vars: list, eqns: list, consts: dict):
        self.stash = stash                 # indices of the stashed leaves, in leaf order
        self._leaf_vars, self._eqns, self._consts = leaf_vars, eqns, consts

    @classmethod
    def of(cls, closed, leaves: list) -> "Derivation":
        jaxpr = closed.jaxpr
        index = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
        made = lambda v: -1 if isinstance(v, jcore.Literal) else index.get(v, -1)
        known = set(jaxpr.constvars)       # what the backward has: consts, stashed and
        stash, recompute = [], set()       # recomputed values
        for i in sorted(range(len(leaves)), key=lambda i: made(leaves[i])):
            v = leaves[i]
            if isinstance(v, jcore.Literal) or v in known:
                continue
            chain = _cheap_chain(jaxpr.eqns, index, v, known)
            if chain is None:
                stash.append(i)
            else:
                recompute |= chain
                known.update(u for j in chain for u in jaxpr.eqns[j].outvars)
            known.add(v)
        eqns = [jaxpr.eqns[j] for j in sorted(recompute)]
        return cls(tuple(sorted(stash)), list(leaves), eqns,
                   dict(zip(jaxpr.constvars, closed.consts)))

    @property
    def num_recomputed(self) -> int:
        return len(self._leaf_vars) - len(self.stash)

    def restore(self, stashed: Sequence) -> list:
        """All kept residual leaves from the stashed ones."""
        env = dict(self._consts)
        env.update((self._leaf_vars[i], v) for i, v in zip(self.stash, stashed))
        _run(self._eqns, env)
        return [_read(env, v) for v in self._leaf_vars]


def _cheap_chain(eqns, index: dict, v, known: set):
    """Indices of the equations that compute `v` from `known` values and literals by cheap
    primitives only, or None if some input needs anything else."""
    chain, stack = set(), [v]
    while stack:
        u = stack.pop()
        if isinstance(u, jcore.Literal) or u in known:
            continue
        i = index.get(u)
        if i is None or eqns[i].primitive.name not in CHEAP_PRIMITIVES:
            return None
        if i not in chain:
            chain.add(i)
            stack.extend(eqns[i].invars)
    return chain


def _read(env: dict, v):
    return v.val if isinstance(v, jcore.Literal) else env[v]


def _run(eqns, env: dict) -> None:
    """Evaluates equations in order into `env` (as jax's own jaxpr interpreter does)."""
    for eqn in eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*(_read(env, v) for v in eqn.invars), **params)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = o


class SplitBackward:
    """bwd(params leaves, residual leaves, cotangent leaves) -> (param grads, input grads),
    split into `input_half` (B) and `weight_half` (W) over one trace.

    input_half(p, res, ct) -> (input grads, crossing values for W)
    weight_half(p, res, crossing) -> param grads (the cotangents W needs are crossing values)
    `crossing_avals` gives the stash layout of the crossing values."""

    def __init__(self, bwd, p_avals: list, res_avals: list, ct_avals: list, num_param_grads: int):
        # "model" bound: a tensor-parallel stage's backward has collectives over it.
        closed = tensor_parallel.make_jaxpr(bwd)(p_avals, res_avals, ct_avals)
        jaxpr = closed.jaxpr
        self._consts = dict(zip(jaxpr.constvars, closed.consts))
        self._invars = list(jaxpr.invars)
        outs = list(jaxpr.outvars)
        self._gp_out, self._gx_out = outs[:num_param_grads], outs[num_param_grads:]
        producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}

        def needed(targets) -> set:
            keep, stack = set(), [v for v in targets if not isinstance(v, jcore.Literal)]
            while stack:
                i = producer.get(stack.pop())
                if i is None or i in keep:
                    continue
                keep.add(i)
                stack.extend(v for v in jaxpr.eqns[i].invars if not isinstance(v, jcore.Literal))
            return keep

        b_idx = needed(self._gx_out)
        # Equations with effects and no output either half reads (a jax.debug.callback
        # in a custom_vjp's backward, logging gradient norms) went into neither half and
        # never ran: B runs them, with what they read.
        for i, e in enumerate(jaxpr.eqns):
            if e.effects and i not in b_idx:
                b_idx |= {i} | needed(e.invars)
        w_idx = needed(self._gp_out) - b_idx
        self._b_eqns = [jaxpr.eqns[i] for i in sorted(b_idx)]
        self._w_eqns = [jaxpr.eqns[i] for i in sorted(w_idx)]
        # W gets what it reads of B's values and of the cotangents through the crossing
        # values, so the gradient inbox is free once B has run (1F1B's inbox lifetime).
        n_p = len(jax.tree.leaves(p_avals))
        ct_vars = set(self._invars[n_p + len(res_avals):])
        made_by_b = {v for e in self._b_eqns for v in e.outvars} | ct_vars
        reads = [v for e in self._w_eqns for v in e.invars] + self._gp_out
        seen, crossing = set(), []
        for v in reads:
            if not isinstance(v, jcore.Literal) and v in made_by_b and v not in seen:
                seen.add(v)
                crossing.append(v)
        self._crossing = crossing
        self.crossing_avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in crossing]
        # Which residual leaves W reads: the others are dead once B has run, so their
        # stash space can hold the crossing values (`packing.place_in_free_space`).
        # Literals are left out, the outputs' too (an input gradient that is a literal
        # zero made this "unhashable type: 'Literal'").
        read_by = lambda eqns, outs: {v for v in [*(v for e in eqns for v in e.invars), *outs]
                                      if not isinstance(v, jcore.Literal)}
        w_reads = read_by(self._w_eqns, self._gp_out)
        b_reads = read_by(self._b_eqns, self._gx_out)
        res_vars = self._invars[n_p:n_p + len(res_avals)]
        self.weight_reads_residual = tuple(v in w_reads for v in res_vars)
        # Residuals neither half reads (jax.vjp keeps some a backward never uses, e.g. a
        # custom_jvp rule's inputs) need no stash row at all.
        self.reads_residual = tuple(v in w_reads or v in b_reads for v in res_vars)
        self.num_weight_eqns = len(self._w_eqns)

    def _env(self, p, res, ct) -> dict:
        env = dict(self._consts)
        env.update(zip(self._invars, [*jax.tree.leaves(p), *res, *ct]))
        return env

    def input_half(self, p, res: list, ct: list) -> tuple[list, list]:
        env = self._env(p, res, ct)
        _run(self._b_eqns, env)
        return [_read(env, v) for v in self._gx_out], [env[v] for v in self._crossing]

    def weight_half(self, p, res: list, crossing: list) -> list:
        env = self._env(p, res, [])   # no cotangent inputs: W's come as crossing values
        env.update(zip(self._crossing, crossing))
        _run(self._w_eqns, env)
        return [_read(env, v) for v in self._gp_out]

    def weight_primitives(self) -> list[str]:
        """Names of the primitives W runs (for tests: no forward op may appear)."""
        return [e.primitive.name for e in self._w_eqns]
