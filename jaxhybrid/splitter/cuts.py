"""Where a traced program is cut, and what each piece then computes, reads and passes on.

Candidate cuts: before any top-level operation, and between two iterations of a
(forward) scan. A cut is never placed between the first read of a state variable
(BatchNorm statistics) and the operation computing its new value, so each state variable
is read and written by one piece. Pieces are chosen greedily by estimated cost: each
piece takes about 1/max_pieces of the total, cut where the fewest bytes cross (values
defined before and used after: module boundaries carry only the residual stream, the
middle of an attention block carries q, k and v). Forced cuts (`stage_boundary`) always
stay.

Segments: the ops a piece runs (scan chunks sliced to their iterations), the variables it
reads (a scan split across pieces reads its stacked variables as slices [a:b]), the values
it receives (`live_in`) and sends (`live_out`: anything used later, a skip connection
crossing several pieces included), and the state leaves it writes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.core import ShapedArray

from jaxhybrid.splitter.program import Op, Program, run_op, scan_layout

Cut = tuple  # (op index, iteration): before op i when 0, else inside scan op i


@dataclasses.dataclass
class Traced:
    """A program with its meaning: which ids are variables, inputs, outputs."""
    prog: Program
    var_of_id: dict       # id -> variable leaf index (whole variables)
    id_of_var: dict       # variable leaf index -> id
    x_ids: list
    key_id: int
    y_ids: list
    y_tree: Any
    state_out: list       # (variable leaf index, id of its new value)

    def is_value(self, i: int) -> bool:
        """A value that travels between pieces (not a variable, not a constant)."""
        return i not in self.var_of_id and i not in self.prog.consts


@dataclasses.dataclass
class Unit:
    op: Op
    ins: list
    outs: list
    length: int | None = None     # a scan chunk of this many iterations
    start: int = 0
    slice_at: tuple = ()          # positions in ins of non-variable xs to slice
    concat: list = dataclasses.field(default_factory=list)   # (out id, [chunk ys ids])

    def run(self, env: dict) -> None:
        args = [env[i] for i in self.ins]
        for k in self.slice_at:
            args[k] = jax.lax.slice_in_dim(args[k], self.start, self.start + self.length, axis=0)
        for i, v in zip(self.outs, run_op(self.op, args, self.length)):
            env[i] = v
        for out, chunks in self.concat:
            env[out] = jax.numpy.concatenate([env[c] for c in chunks], axis=0)


def without_gradient(prog, segs, outputs) -> frozenset:
    """Ids of the float values the pieces make (`segs`, in order) that take no part in
    the gradient: none can reach them (made from no value that depends on the model's
    inputs or variables, or only through `stop_gradient`), or none can leave them (every
    path from them to the model's `outputs` goes through `stop_gradient`). Such a value
    crossing a cut is stop_gradient'ed where a piece makes it and where one receives it:
    a stop_gradient'ed power iteration's carry, or a `while_loop` result used only under
    `stop_gradient` further on, was differentiated as a plain input or output of a piece,
    into the `while_loop`, which jax cannot differentiate. Values of unknown origin or use
    are taken as taking part."""
    floating = lambda i: jax.numpy.issubdtype(prog.avals[i].dtype, jax.numpy.inexact)  # noqa: E731
    units = [u for seg in segs for u in seg.units]
    reached = set(prog.invars)
    for seg in segs:
        reached.update(seg.reads.values())
    made, unreached = set(), set()
    for u in units:
        part = u.op.name != "stop_gradient" and any(i in reached for i in u.ins)
        (reached if part else unreached).update(o for o in u.outs if floating(o))
        made.update(u.outs)
        for out, chunks in u.concat:
            (reached if any(c in reached for c in chunks) else unreached).add(out)
            made.add(out)
    leaves = set(outputs)   # values a cotangent comes back to
    for u in reversed(units):
        for out, chunks in u.concat:
            if out in leaves:
                leaves.update(chunks)
        if u.op.name != "stop_gradient" and any(o in leaves for o in u.outs):
            leaves.update(u.ins)
    unused = {i for i in made if floating(i) and i not in leaves}
    return frozenset((unreached - reached) | unused)


@dataclasses.dataclass
class Segment:
    units: list
    reads: dict           # variable key (leaf, a, b) -> id
    live_in: list
    live_out: list
    writes: list          # (variable leaf index, id)
    needs_key: bool = False


# --- candidate cuts -----------------------------------------------------------------
def _defs_and_uses(t: Traced):
    prog, n = t.prog, len(t.prog.ops)
    d = {i: -1 for i in t.x_ids + [t.key_id]}
    last: dict = {}
    for k, op in enumerate(prog.ops):
        for i in op.ins:
            last[i] = k
        for o in op.outs:
            d[o] = k
    for i in t.y_ids + [i for _, i in t.state_out]:
        last[i] = n
    return d, last


def candidates(t: Traced) -> list[tuple[Cut, float, float]]:
    """Allowed cuts as (cut, estimated cost before it, bytes crossing it), in order."""
    prog, n = t.prog, len(t.prog.ops)
    d, last = _defs_and_uses(t)
    live = np.zeros(n + 2)
    across = np.zeros(n + 2)
    for i, di in d.items():
        if i in last and t.is_value(i) and last[i] > di:
            b = prog.nbytes(i)
            live[di + 1] += b
            live[last[i] + 1] -= b
            across[di + 1] += b
            across[last[i]] -= b
    live, across = np.cumsum(live), np.cumsum(across)
    cost = np.concatenate([[0.0], np.cumsum([op.cost for op in prog.ops])])
    banned = np.zeros(n + 1, bool)       # cut before op i
    banned_in = np.zeros(n + 1, bool)    # cut inside op i
    first_read = {}
    for k, op in enumerate(prog.ops):
        for i in op.ins:
            first_read.setdefault(i, k)
    for j, new in t.state_out:
        w = d.get(new)
        if w is None or w < 0:
            continue
        r = min(first_read.get(t.id_of_var[j], w), w)
        banned[r + 1:w + 1] = True
        banned_in[r:w + 1] = True
    out = []
    for i in range(n):
        if i > 0 and not banned[i]:
            out.append(((i, 0), float(cost[i]), float(live[i])))
        op = prog.ops[i]
        if op.iters > 1 and not banned_in[i]:
            nc, ncarry = scan_layout(op)
            carry = sum(prog.nbytes(c) for c in op.outs[:ncarry])
            xs = sum(prog.nbytes(x) for x in op.ins[nc + ncarry:] if t.is_value(x))
            for it in range(1, op.iters):
                out.append(((i, it), float(cost[i] + op.cost * it / op.iters),
                            float(across[i] + carry + xs)))
    return out


def choose_cuts(t: Traced, max_pieces: int, min_pieces: int) -> list[Cut]:
    """Cuts making at most max_pieces pieces of about equal estimated cost, each where
    few bytes cross; forced cuts kept; at least min_pieces pieces when there are enough
    candidates (the caller reports when there are not)."""
    cands = candidates(t)
    n = len(t.prog.ops)
    total = float(sum(op.cost for op in t.prog.ops)) or 1.0
    forced = sorted((f, 0) for f in t.prog.forced if 0 < f < n)
    target = total / max(1, max_pieces)
    chosen = set(forced)
    edges = [None, *forced, None]
    for lo, hi in zip(edges, edges[1:]):
        span = [c for c in cands if (lo is None or c[0] > lo) and (hi is None or c[0] < hi)]
        start = 0.0 if lo is None else next((c[1] for c in cands if c[0] == lo), 0.0)
        end = total if hi is None else next((c[1] for c in cands if c[0] == hi), total)
        while True:
            if end - start < 1.5 * target:
                break
            goal = start + target
            window = [c for c in span if start + 0.5 * target <= c[1] <= start + 1.5 * target]
            if window:
                best = min(window, key=lambda c: (c[2] * (1 + abs(c[1] - goal) / target), c[0]))
            else:
                later = [c for c in span if c[1] >= start + 0.5 * target]
                if not later:
                    break
                best = later[0]
            chosen.add(best[0])
            start = best[1]
    if len(chosen) + 1 < min_pieces:
        free = [c for c in cands if c[0] not in chosen]
        for q in range(1, min_pieces):
            if len(chosen) + 1 >= min_pieces or not free:
                break
            near = min(free, key=lambda c: abs(c[1] - total * q / min_pieces))
            chosen.add(near[0])
            free.remove(near)
    return sorted(chosen)


# --- segments -----------------------------------------------------------------------
def assign_from_cuts(prog: Program, cuts: list[Cut]) -> list[list[tuple[int, int, int]]]:
    """Per op: [(piece, first iteration, stop iteration)]."""
    out = []
    for i, op in enumerate(prog.ops):
        p0 = sum(1 for c in cuts if c[0] < i or c == (i, 0))
        inner = sorted(c[1] for c in cuts if c[0] == i and c[1] > 0)
        bounds = [0, *inner, op.iters]
        out.append([(p0 + m, bounds[m], bounds[m + 1]) for m in range(len(bounds) - 1)])
    return out


def assign_by_placement(t: Traced, owners: dict, num_pieces: int):
    """Places each op of `t` (e.g. the eval-mode program, whose ops differ from the
    training program's) in the earliest piece that holds its variables and follows its
    inputs; a variable missing there gets one more copy (owners is updated)."""
    defp = {i: 0 for i in t.x_ids + [t.key_id]}
    assign = []

    def place(p_in: int, keys) -> int:
        p = p_in
        for key in keys:
            cands = [q for q in owners.get(key, ()) if q >= p_in]
            if cands:
                p = max(p, min(cands))
        p = min(p, num_pieces - 1)
        for key in keys:
            owners.setdefault(key, set()).add(p)
        return p

    for op in t.prog.ops:
        vals = [defp[i] for i in op.ins if t.is_value(i)]
        p_in = max(vals, default=0)
        whole = [(t.var_of_id[i], None, None) for i in op.ins if i in t.var_of_id]
        chunks = None
        if op.iters > 1:
            nc, ncarry = scan_layout(op)
            xs_vars = [t.var_of_id[i] for i in op.ins[nc + ncarry:] if i in t.var_of_id]
            sliced = [j for j in xs_vars if (j, None, None) not in owners
                      and any(k[0] == j for k in owners)]
            if sliced:
                bounds = sorted({e for k in owners if k[0] in sliced for e in k[1:]} |
                                {0, op.iters})
                heads = [(t.var_of_id[i], None, None) for i in op.ins[:nc + ncarry]
                         if i in t.var_of_id]
                chunks, p = [], p_in
                for a, b in zip(bounds, bounds[1:]):
                    p = place(p, heads + [(j, a, b) if j in sliced else (j, None, None)
                                          for j in xs_vars])
                    chunks.append((p, a, b))
        if chunks is None:
            chunks = [(place(p_in, whole), 0, op.iters)]
        assign.append(chunks)
        for o in op.outs:
            defp[o] = chunks[-1][0]
    return assign


def build_segments(t: Traced, assign, num_pieces: int) -> list[Segment]:
    prog = t.prog
    units = [[] for _ in range(num_pieces)]
    slice_ids: dict = {}
    var_key_of: dict = {i: (j, None, None) for i, j in t.var_of_id.items()}

    def var_slice(j: int, a: int, b: int) -> int:
        key = (j, a, b)
        if key not in slice_ids:
            whole = prog.avals[t.id_of_var[j]]
            i = prog.new(ShapedArray((b - a, *whole.shape[1:]), whole.dtype))
            slice_ids[key], var_key_of[i] = i, key
        return slice_ids[key]

    for op, chunks in zip(prog.ops, assign):
        if len(chunks) == 1:
            units[chunks[0][0]].append(Unit(op, list(op.ins), list(op.outs)))
            continue
        nc, ncarry = scan_layout(op)
        consts, carry, xs = op.ins[:nc], op.ins[nc:nc + ncarry], op.ins[nc + ncarry:]
        carry_out, ys = op.outs[:ncarry], op.outs[ncarry:]
        ys_chunks = [[] for _ in ys]
        for m, (p, a, b) in enumerate(chunks):
            xs_in, slice_at = [], []
            for x in xs:
                if x in t.var_of_id:
                    xs_in.append(var_slice(t.var_of_id[x], a, b))
                else:
                    slice_at.append(nc + ncarry + len(xs_in))
                    xs_in.append(x)
            lastc = m == len(chunks) - 1
            c_out = carry_out if lastc else [prog.new(prog.avals[c]) for c in carry_out]
            y_out = [prog.new(ShapedArray((b - a, *prog.avals[y].shape[1:]), prog.avals[y].dtype))
                     for y in ys]
            for k, y in enumerate(y_out):
                ys_chunks[k].append(y)
            unit = Unit(op, [*consts, *carry, *xs_in], [*c_out, *y_out], b - a, a, tuple(slice_at))
            if lastc:
                unit.concat = list(zip(ys, ys_chunks))
            units[p].append(unit)
            carry = c_out

    defp = {i: 0 for i in t.x_ids + [t.key_id]}
    uses = [set() for _ in range(num_pieces)]
    reads = [dict() for _ in range(num_pieces)]
    for p, us in enumerate(units):
        for u in us:
            for i in u.ins:
                if i in var_key_of:
                    reads[p][var_key_of[i]] = i
                elif i not in prog.consts:
                    uses[p].add(i)
            for _, chunks in u.concat:
                uses[p].update(chunks)
            for o in [*u.outs, *(o for o, _ in u.concat)]:
                defp[o] = p
    uses[-1].update(i for i in t.y_ids if t.is_value(i))
    for i in t.y_ids:   # a variable that is itself an output (a learned noise scale)
        if i in var_key_of:
            reads[-1][var_key_of[i]] = i
    writes = [[] for _ in range(num_pieces)]
    for j, new in t.state_out:
        if new == t.id_of_var.get(j):
            continue
        p = defp.get(new, 0)
        writes[p].append((j, new))
        reads[p].setdefault((j, None, None), t.id_of_var[j])
        if new in var_key_of:
            reads[p][var_key_of[new]] = new
        elif new not in prog.consts:
            uses[p].add(new)
    maxuse = {}
    for p, us in enumerate(uses):
        for i in us:
            maxuse[i] = max(maxuse.get(i, -1), p)
    segs = []
    needs_key = any(t.key_id in us for us in uses)
    for p in range(num_pieces):
        live_out = sorted(i for i, q in maxuse.items() if defp.get(i, 0) <= p < q)
        live_in = segs[-1].live_out if p else [*t.x_ids, t.key_id]
        segs.append(Segment(units[p], reads[p], live_in, live_out, writes[p],
                            needs_key and p == 0))
    return segs
