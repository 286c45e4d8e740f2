"""Burst parallelism executor: one SPMD program over the mesh's `data` axis (pipe = 1).

Layer l runs on the first g_l devices of the data axis (`widths[l]`, a power of two
dividing the device count G); each of them takes B / g_l examples of the global batch B,
in order (device d holds rows d*B/g_l .. (d+1)*B/g_l). Devices d >= g_l skip the layer
through a `lax.cond` whose other branch computes nothing (it only fills zeros, or, when
multiplexing, runs background work: `jaxhybrid.burst.multiplex`).

Width changes move the batch with `ppermute`s at top level — never inside a cond branch:
every device issues the same collectives in the same order (a collective inside a branch
that only some devices take deadlocks). Narrowing from g to g/r devices takes r
permutations (device j receives the blocks of j*r .. j*r+r-1, one per permutation),
widening the reverse; only the rows that change device move. Their transposes (the
reverse permutations) carry the cotangents back in the backward pass, also at top level.

Gradients are taken inside the program w.r.t. each device's own copy of the parameters;
layer l's gradient is then all-reduced over its g_l devices only (`psum` with
`axis_index_groups`: G / g_l groups of g_l consecutive devices; the other groups sum
zeros). State is therefore kept per device, stacked over the data axis (leading dim G,
`PartitionSpec("data")`): device d's copy of layer l is maintained iff d < g_l, the way
DeepPool keeps layer l's parameters on its g_l devices only. Device 0 takes part in every
layer, so `first_copy` (index 0) is the model. Batch statistics (BatchNorm) are computed
per device over its B / g_l examples and averaged over the g_l devices (ghost batch
norm, as data parallelism does); `jaxhybrid.burst.reference` is the single-device program
with the same semantics.

Dropout: layer l on device d draws from `layer_rng(rng, d, l)` (chunk d of the batch at
that layer); with every width 1 this is `ModelSpec.apply`'s stream.
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid import distributed
from jaxhybrid.burst.checks import (check_batch, check_opt_state, check_program,  # noqa: F401
                                    check_rows, check_stacked, check_widths, checked_optimizer)
from jaxhybrid.layers import apply_layer, check_loss_fn, layer_rng, loss_dtype, scalar_loss
from jaxhybrid.mesh import DATA, PIPE

PyTree = Any


@dataclasses.dataclass(frozen=True, eq=False)
class BurstProgram:
    """What the executor runs: `layers` (flax Modules in order), `loss_fn(outputs,
    targets)` (mean loss of one chunk), per-layer `widths`, the `mesh` (data x pipe=1)
    and the global `batch_size`. Hashed by identity (a static jit argument)."""
    layers: tuple
    loss_fn: Callable
    widths: tuple
    mesh: Mesh
    batch_size: int

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        check_program(self.layers, self.widths, self.batch_size)
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        check_loss_fn(self.loss_fn, "BurstProgram")
        check_widths(self.widths, len(self.layers), self.num_devices, self.batch_size)
        pipe = dict(self.mesh.shape).get(PIPE, 1)
        if pipe != 1:
            raise ValueError(f"BurstProgram: the mesh has pipe={pipe}; burst parallelism runs "
                             f"over the data axis only: use jaxhybrid.make_mesh(data=N, pipe=1).")

    @property
    def num_devices(self) -> int:
        return int(dict(self.mesh.shape)[DATA])


def chunk_loss(program: "BurstProgram", y, t):
    """loss_fn on one device's chunk, as a float32 scalar."""
    return scalar_loss(program.loss_fn, y, t, "burst", "the chunk's mean loss")


def weighed(program: "BurstProgram", targets):
    """(program, targets) of a step on the global batch `targets`: a `jp.WeightedMean`
    loss becomes each chunk's share of the whole batch's weighted mean (its total over
    the batch's weight, computed here before the batch is split, times the last layer's
    width, which the step divides by), so a mean per token does not move with the
    widths; any other loss as it is (the mean of the chunks' losses)."""
    from jaxhybrid.weighted_loss import per_part
    loss, targets = per_part(program.loss_fn, targets, program.widths[-1])
    if loss is program.loss_fn:
        return program, targets
    return dataclasses.replace(program, loss_fn=loss), targets


def _relayout(x: PyTree, g_from: int, g_to: int, batch: int, what: str = "activation") -> PyTree:
    """Local chunk of the batch laid out over g_from devices -> over g_to devices.
    Top level only (it is a collective)."""
    if g_from == g_to:
        return x
    rows = batch // g_from
    for path, a in jax.tree_util.tree_flatten_with_path(x)[0]:
        # A leaf without the batch axis (a per-layer constant in a dict) was concatenated
        # or split as if it were rows: a broadcasting error in the next layer.
        if not np.shape(a) or np.shape(a)[0] != rows:
            raise ValueError(
                f"burst: {what}{jax.tree_util.keystr(path)} has shape {tuple(np.shape(a))}; at "
                f"a width change ({g_from} -> {g_to} devices) every leaf must have the batch "
                f"as its leading dimension ({rows} rows per device): batch such values, or "
                f"keep the two layers at the same width.")
    leaves, treedef = jax.tree.flatten(x)
    empty = [getattr(a, "dtype", None) == jax.dtypes.float0 for a in leaves]
    if any(empty):
        # An integer leaf's cotangent (float0) has nothing to move, and "out + part"
        # below cannot add it: zeros of the new row count in its place.
        moved = iter(_relayout([a for a, e in zip(leaves, empty) if not e], g_from, g_to,
                               batch, what))
        return jax.tree.unflatten(treedef, [
            np.zeros((batch // g_to, *np.shape(a)[1:]), jax.dtypes.float0) if e else next(moved)
            for a, e in zip(leaves, empty)])
    if g_from > g_to:          # narrowing: device j gathers the blocks of j*r .. j*r+r-1
        r = g_from // g_to

        def one(a):
            parts = []
            for k in range(r):
                pairs = [(j * r + k, j) for j in range(g_to)]
                parts.append(a if pairs == [(0, 0)] else _permute(a, pairs))
            return jnp.concatenate(parts, axis=0)
        return jax.tree.map(one, x)
    r = g_to // g_from         # widening: device i scatters its rows to i*r .. i*r+r-1
    n = batch // g_to

    def one(a):
        out = None
        for k in range(r):
            pairs = [(i, i * r + k) for i in range(g_from)]
            part = a[k * n:(k + 1) * n]
            part = part if pairs == [(0, 0)] else _permute(part, pairs)
            out = part if out is None else out + part   # receivers get exactly one part
        return out
    return jax.tree.map(one, x)


def _permute(a, pairs):
    """ppermute over the data axis; a device's own block (i -> i) is kept in place,
    devices that receive nothing get zeros."""
    moving = [(s, t) for s, t in pairs if s != t]
    stay = [s for s, t in pairs if s == t]
    out = jax.lax.ppermute(a, DATA, moving) if moving else jnp.zeros_like(a)
    if stay:
        d = jax.lax.axis_index(DATA)
        keep = functools.reduce(jnp.logical_or, [d == s for s in stay])
        out = jnp.where(keep, a, out)
    return out


def _entering(program: "BurstProgram", l: int) -> str:
    if l == 0:
        return "inputs"
    return f"the output of layer {l - 1} ({type(program.layers[l - 1]).__name__})"


def groups(g: int, G: int):
    """`axis_index_groups` for an all-reduce over the first g devices (None: all)."""
    if g == G:
        return None
    return [list(range(k, k + g)) for k in range(0, G, g)]


def _unbox_like(tree, like):
    """`tree`'s leaves in the structure and dtypes of `like` (the state a layer was
    given): under x64, float64 inputs gave float32 batch statistics back as float64, and
    the skipping branch's float32 failed the cond ("branches must have equal output
    types")."""
    return jax.tree.unflatten(jax.tree.structure(like), [
        n.astype(o.dtype) if hasattr(o, "dtype") else n
        for n, o in zip(jax.tree.leaves(tree), jax.tree.leaves(like))])


def layer_cond(layer, index: int, width: int, params, state, x, rng, idle=None, idle_carry=None):
    """Runs `layer` on devices < width; the others run `idle(idle_carry)` (default:
    nothing). Returns (y, new_state, idle_carry)."""
    d = jax.lax.axis_index(DATA)
    key = layer_rng(rng, d, index) if rng is not None else None

    def run(p, st, xx, c):
        y, st2 = apply_layer(layer, {"params": p, **st}, xx, train=True, rng=key)
        return y, _unbox_like(st2, st), c

    shapes = jax.eval_shape(run, params, state, x, idle_carry)

    def skip(p, st, xx, c):
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[0])
        return zeros, st, (idle(c) if idle is not None else c)

    return jax.lax.cond(d < width, run, skip, params, state, x, idle_carry)


def forward_objective(program: BurstProgram, params, states, x, t, rng, idle=None, carry=None):
    """This device's share of the loss (loss of its chunk / g_L on active devices, 0
    elsewhere) and the new per-layer states. `idle(l, carry)` runs in layer l's skip
    branch (background work); returns (objective, (states, carry))."""
    G, B = program.num_devices, program.batch_size
    d = jax.lax.axis_index(DATA)
    g_prev, new_states = G, []
    for l, (layer, g) in enumerate(zip(program.layers, program.widths)):
        x = _relayout(x, g_prev, g, B, _entering(program, l))
        fn = functools.partial(idle, l) if idle is not None else None
        x, st, carry = layer_cond(layer, l, g, params[l], states[l], x, rng, fn, carry)
        new_states.append(st)
        g_prev = g
    t = _relayout(t, G, g_prev, B, "targets")
    obj = jax.lax.cond(d < g_prev,
                       lambda y, tt: chunk_loss(program, y, tt) / g_prev,
                       lambda y, tt: jnp.zeros((), loss_dtype()), x, t)
    return obj, (new_states, carry)


def reduce_grads(program: BurstProgram, grads, states, new_states):
    """Layer l's gradients summed over its g_l devices; its state averaged over them
    (devices outside keep their stale copy)."""
    G = program.num_devices
    d = jax.lax.axis_index(DATA)
    out_g, out_s = [], []
    for g, gr, st, nst in zip(program.widths, grads, states, new_states):
        if g > 1:
            gr = jax.lax.psum(gr, DATA, axis_index_groups=groups(g, G))
            if jax.tree.leaves(nst):
                mean = jax.lax.psum(nst, DATA, axis_index_groups=groups(g, G))
                nst = jax.tree.map(lambda m, o: jnp.where(d < g, m / g, o), mean, st)
        out_g.append(gr)
        out_s.append(nst)
    return out_g, out_s


def split_variables(variables: Sequence[dict]):
    params = [dict(v).get("params", {}) for v in variables]
    states = [{c: t for c, t in dict(v).items() if c != "params"} for v in variables]
    return params, states


def _squeeze(tree):
    return jax.tree.map(lambda a: a[0], tree)


def _stack(tree):
    return jax.tree.map(lambda a: a[None], tree)


def local_value_and_grad(program, params, states, x, t, rng, idle=None, carry=None):
    """Inside the program: (global loss, reduced grads, new states, idle carry)."""
    (obj, (new_states, carry)), grads = jax.value_and_grad(
        lambda p: forward_objective(program, p, states, x, t, rng, idle, carry),
        has_aux=True)(params)
    loss = jax.lax.psum(obj, DATA)
    grads, new_states = reduce_grads(program, grads, states, new_states)
    return loss, grads, new_states, carry


def _zeros(shapes):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def explicit_value_and_grad(program: BurstProgram, params, states, x, t, rng, idle, carry):
    """`local_value_and_grad` with the backward pass written out layer by layer, so that
    idle devices can work in the backward too: `idle(slot, carry)` runs in the skip
    branch of forward layer l (slot l) and of backward layer l (slot 2L-1-l). Each
    layer's `jax.vjp` residuals leave its forward cond as flat leaves (zeros on skipping
    devices) and feed its backward cond: no recompute. The cotangent goes back through
    the reverse relayouts (a relayout only permutes rows). Same math as autodiff;
    float rounding may differ."""
    G, B, L = program.num_devices, program.batch_size, len(program.layers)
    d = jax.lax.axis_index(DATA)
    widths, layers = program.widths, program.layers
    treedefs: dict = {}
    residuals, new_states, g_prev = [], [], G
    for l, (layer, g) in enumerate(zip(layers, widths)):
        x = _relayout(x, g_prev, g, B, _entering(program, l))
        key = layer_rng(rng, d, l) if rng is not None else None

        def run(p, st, xx, c, _l=l, _layer=layer, _key=key):
            def f(pp, *xs):
                return apply_layer(_layer, {"params": pp, **st}, xs[0] if xs else xx, train=True,
                                   rng=_key)
            args = (p,) if _l == 0 else (p, xx)      # the model inputs need no gradient
            y, vjp_fn, st2 = jax.vjp(f, *args, has_aux=True)
            leaves, treedefs[_l] = jax.tree.flatten(vjp_fn)
            return y, leaves, _unbox_like(st2, st), c

        shapes = jax.eval_shape(run, params[l], states[l], x, carry)

        def skip(p, st, xx, c, _l=l, _shapes=shapes):
            return _zeros(_shapes[0]), _zeros(_shapes[1]), st, idle(_l, c)

        x, res, st, carry = jax.lax.cond(d < g, run, skip, params[l], states[l], x, carry)
        residuals.append(res)
        new_states.append(st)
        g_prev = g
    t = _relayout(t, G, g_prev, B, "targets")

    def loss_run(y, tt):
        return jax.value_and_grad(
            lambda yy: chunk_loss(program, yy, tt) / g_prev)(y)
    obj, ct = jax.lax.cond(d < g_prev, loss_run,
                           lambda y, tt: (jnp.zeros((), loss_dtype()), jnp.zeros_like(y)), x, t)
    grads = [None] * L
    for l in reversed(range(L)):
        g = widths[l]

        def brun(res, ct_, c, _l=l):
            out = jax.tree.unflatten(treedefs[_l], res)(ct_)
            return out[0], (out[1] if _l else None), c

        shapes = jax.eval_shape(brun, residuals[l], ct, carry)

        def bskip(res, ct_, c, _l=l, _shapes=shapes):
            return _zeros(_shapes[0]), _zeros(_shapes[1]), idle(2 * L - 1 - _l, c)

        grads[l], ct, carry = jax.lax.cond(d < g, brun, bskip, residuals[l], ct, carry)
        if l:
            ct = _relayout(ct, g, widths[l - 1], B)
    loss = jax.lax.psum(obj, DATA)
    grads, new_states = reduce_grads(program, grads, states, new_states)
    return loss, grads, new_states, carry


def shard(program, body, out_specs, n_stacked: int = 1, n_batches: int = 2, n_keys: int = 1):
    """shard_map of `body(stacked..., batch..., keys...)` over the data axis: per-device
    stacked trees and batches split over it, rng keys replicated."""
    in_specs = (P(DATA),) * (n_stacked + n_batches) + (P(),) * n_keys
    return jax.shard_map(body, mesh=program.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


# Per program (weakly: a new program at a freed one's id must be compared too), the
# calls compared across processes already.
_AGREED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def on_every_process(program: BurstProgram, call: str, inputs, targets, rng):
    """With several processes: the programs compared once (widths, batch size, argument
    shapes; `plan_burst` from measured costs gave other widths per process, and the
    mismatched programs ran to the end with a wrong loss or hung in gloo), numpy batches
    and keys placed as global arrays (jax checks they are the same on every process: a
    process's own batch or key was read as its own value and trained on a mix)."""
    if jax.process_count() == 1 or any(isinstance(a, jax.core.Tracer)
                                       for a in jax.tree.leaves((inputs, targets, rng))):
        return inputs, targets, rng
    agreed = _AGREED.setdefault(program, set())
    if call not in agreed:
        distributed.check_same_everywhere(
            {"widths": list(program.widths), "batch_size": program.batch_size,
             "devices": program.num_devices, "layers": len(program.layers),
             "arguments": distributed.argument_shapes((inputs, targets))},
            seen=f"built its BurstProgram or called burst.{call} with",
            fix="plan once and build the program with the same widths on every process "
                "(plan on process 0 and share its widths: jaxhybrid.distributed.broadcast_json)")
        agreed.add(call)
    batch = NamedSharding(program.mesh, P(DATA))
    inputs, targets = jax.tree.map(lambda a: distributed.place_everywhere(
        a, batch, f"burst.{call}: a numpy batch"), (inputs, targets))
    return inputs, targets, distributed.place_key_everywhere(rng, program.mesh,
                                                             f"burst.{call}: rng")


def value_and_grad(program: BurstProgram, variables, inputs, targets, rng):
    """(loss, grads, new_variables) of one burst step. `variables`: per-layer dicts
    stacked per device (`replicate`); inputs/targets: the global batch (rows split over
    the data axis). grads and new_variables come back stacked per device."""
    inputs, targets, rng = on_every_process(program, "value_and_grad", inputs, targets, rng)
    return _value_and_grad(program, variables, inputs, targets, rng)


@functools.partial(jax.jit, static_argnums=0)
def _value_and_grad(program: BurstProgram, variables, inputs, targets, rng):
    def body(v, x, t, key):
        params, states = split_variables(_squeeze(v))
        loss, grads, new_states, _ = local_value_and_grad(program, params, states, x, t, key)
        new_vars = [{"params": p, **s} for p, s in zip(params, new_states)]
        return loss, _stack(grads), _stack(new_vars)

    check_batch(program, inputs, targets)
    check_stacked("variables", variables, program.num_devices)
    program, targets = weighed(program, targets)
    return shard(program, body, (P(), P(DATA), P(DATA)))(variables, inputs, targets, rng)


def apply_update(optimizer, params, opt_state, grads):
    import optax
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


class TrainState(dict):
    """A burst train state, {"params", "states", "opt_state"} stacked per device, and the
    per-layer widths its copies are current for: device d's copy of layer l is current
    iff d < widths[l] (None: unknown, e.g. a plain dict, a copy or a restored
    checkpoint). The widths travel in the tree's structure, so reading them costs no
    device round trip; checkpoints do not keep them."""

    def __init__(self, tree=(), widths=None):
        super().__init__(tree)
        self.widths = None if widths is None else tuple(widths)


jax.tree_util.register_pytree_with_keys(   # keys: orbax saves "params", not "1"
    TrainState,
    lambda s: (tuple((jax.tree_util.DictKey(k), s[k]) for k in sorted(s)),
               (tuple(sorted(s)), s.widths)),
    lambda aux, children: TrainState(zip(aux[0], children), aux[1]),
    flatten_func=lambda s: (tuple(s[k] for k in sorted(s)), (tuple(sorted(s)), s.widths)))


def current_for(program: BurstProgram, train_state):
    """`train_state` with every copy the program's layers run on current. Devices outside
    a layer's width skip it and keep stale copies, so a state trained under other widths
    (a new `plan_burst`) gave a wider layer stale parameters, optimizer state and batch
    statistics, and wrong gradients, silently; when a layer widens, or the widths are
    unknown (a restored checkpoint, a dict copy), device 0's copy (it runs every layer:
    the model) goes to every device first. Jitted steps take it as a plain dict: the
    widths in its structure made the second step compile again."""
    widths = getattr(train_state, "widths", None)
    if (any(g > 1 for g in program.widths) if widths is None
            else any(g > w for g, w in zip(program.widths, widths))):
        G = program.num_devices
        return TrainState(replicate(first_copy(dict(train_state)), program.mesh),
                          (G,) * len(program.widths))
    return train_state


def init_train_state(optimizer, variables: Sequence[dict], mesh: Mesh) -> TrainState:
    """{"params", "states", "opt_state"} stacked per device of the data axis."""
    params, states = split_variables(variables)
    # Widths unknown, not "all current": a state restored into this one as orbax's
    # target keeps its structure, and with it what it says of its copies.
    return TrainState(replicate({"params": params, "states": states,
                                 "opt_state": optimizer.init(params)}, mesh))


def train_step(program: BurstProgram, optimizer, train_state, inputs, targets, rng):
    """One burst step plus the optimizer update on every device's copy. Returns
    (loss, new train state: current for the program's widths)."""
    check_stacked("train_state", train_state, program.num_devices)
    checked_optimizer(optimizer, "burst.train_step")
    check_opt_state(optimizer, train_state, "burst.train_step")
    inputs, targets, rng = on_every_process(program, "train_step", inputs, targets, rng)
    loss, new = _train_step(program, optimizer, dict(current_for(program, train_state)),
                            inputs, targets, rng)
    return loss, TrainState(new, program.widths)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _train_step(program: BurstProgram, optimizer, train_state, inputs, targets, rng):
    def body(ts, x, t, key):
        ts = _squeeze(ts)
        loss, grads, new_states, _ = local_value_and_grad(program, ts["params"], ts["states"],
                                                          x, t, key)
        params, opt_state = apply_update(optimizer, ts["params"], ts["opt_state"], grads)
        return loss, _stack({"params": params, "states": new_states, "opt_state": opt_state})

    check_batch(program, inputs, targets)
    check_stacked("train_state", train_state, program.num_devices)
    program, targets = weighed(program, targets)
    return shard(program, body, (P(), P(DATA)))(train_state, inputs, targets, rng)


def replicate(tree: PyTree, mesh: Mesh) -> PyTree:
    """One copy of `tree` per device of the data axis: leading dim G, sharded over it."""
    G = int(dict(mesh.shape)[DATA])
    sharding = NamedSharding(mesh, P(DATA))
    return jax.tree.map(
        lambda a: jax.device_put(jnp.broadcast_to(jnp.asarray(a)[None], (G, *np.shape(a))),
                                 sharding), tree)


def first_copy(tree: PyTree) -> PyTree:
    """Device 0's copy of a stacked tree (device 0 runs every layer)."""
    return jax.tree.map(lambda a: a[0], tree)


def data_parallel_widths(num_layers: int, mesh: Mesh) -> tuple:
    """Every layer on every device: plain data parallelism, as a burst plan."""
    return (int(dict(mesh.shape)[DATA]),) * num_layers
