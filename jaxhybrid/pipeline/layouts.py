"""What one stage computes and what travels between stages: a stage's forward under
`jax.vjp` and its backward from stashed residuals (`stage_forward`, `backward_fn`), and
the packed layouts of the boundary activations, gradients, residuals and zero-bubble
crossing values (`StageLayouts`), learnt by running every stage abstractly on one
microbatch (`stage_layouts`, no FLOPs). The executor (`jaxhybrid.pipeline.runtime`)
builds its task branches from these."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxhybrid import tensor_parallel
from jaxhybrid.layers import loss_dtype
from jaxhybrid.pipeline import packing
from jaxhybrid.pipeline.backward import Residuals, SplitBackward
from jaxhybrid.pipeline.stages import (differentiable, merge_float, microbatch_loss,
                                       split_float)

if TYPE_CHECKING:   # the executor imports this module
    from jaxhybrid.pipeline.runtime import Engine, Stage

PyTree = Any


@dataclasses.dataclass(frozen=True)
class TracedForward:
    """A stage's forward traced once to a jaxpr: the program replays it (binding its
    equations) instead of tracing the stage's Flax modules again, which is most of the
    time to trace a step (Inception-V3: ~0.3 s per stage on a 2-core CPU host)."""
    closed: Any          # ClosedJaxpr of stage_forward(params, state, x, tgt, rng, gmb)
    #                      (training), or of the stage's output (`stage_forwards`)
    out_tree: Any        # treedef of its (output, residuals, new state, other leaves)

    def __call__(self, *args):
        flat = jcore.jaxpr_as_fun(self.closed)(*jax.tree.leaves(args))
        return jax.tree.unflatten(self.out_tree, flat)


@dataclasses.dataclass
class StageLayouts:
    """Layouts of what travels or is stashed, for one microbatch shape. act[k] / grad[k]:
    the input of stage k (act[K]: the model output); res[k] residuals; split[k]: the
    stage's SplitBackward (split schedules). What a split B hands to W (the crossing
    values) goes into the stash row's space that only B read (`in_row[k]`: its Layout
    over the stash buffers and which crossing values it holds); the rest into the cross
    ring (cross[k], `overflow[k]`), so zero-bubble costs no stash beyond 1F1B's when the
    residuals only B reads are as big as what W needs (a Dense+tanh layer's output)."""
    act: list
    grad: list
    res: list
    cross: list
    act_len: dict
    grad_len: dict
    res_len: dict
    cross_len: dict
    residuals: Residuals
    split: list
    in_row: list = dataclasses.field(default_factory=list)
    overflow: list = dataclasses.field(default_factory=list)
    # Split stages stash only the residuals B or W reads (res_used[k]: their indices
    # among the forward's kept residuals, res_avals[k]: all of those, for the zeros).
    res_used: list = dataclasses.field(default_factory=list)
    res_avals: list = dataclasses.field(default_factory=list)
    # forwards[k]: stage k's `stage_forward`, traced once here (`TracedForward`).
    forwards: list = dataclasses.field(default_factory=list)

    def forward(self, k: int, params, state, x, tgt, rng, gmb) -> tuple:
        """`stage_forward` of stage k from its jaxpr traced by `stage_layouts`: (output or
        loss, the residuals it stashes, new state, the output's other leaves)."""
        out, kept, new_state, yi = self.forwards[k](params, state, x, tgt, rng, gmb)
        d = self.residuals.derived.get(k)
        return out, (kept if d is None else [kept[i] for i in d.stash]), new_state, yi

    def stashed(self, k: int, kept: list) -> list:
        return kept if not self.res_used else [kept[i] for i in self.res_used[k]]

    def unstashed(self, k: int, res_row: dict) -> list:
        """The kept residuals of stage k from its stash row (zeros where not stashed:
        nothing reads those)."""
        leaves = packing.unpack_leaves(self.res[k], res_row)
        if not self.res_used:
            return leaves
        got = dict(zip(self.res_used[k], leaves))
        return [got[i] if i in got else jnp.zeros(a.shape, a.dtype)
                for i, a in enumerate(self.res_avals[k])]

    @property
    def in_row_keys(self) -> tuple:
        """The stash buffers some stage's B writes crossing values into: only these are
        written back (rewriting a row unchanged costs XLA CPU a copy of the ring)."""
        return tuple(sorted({key for lay in self.in_row for key in lay.size_of}))


def floats(tree: PyTree) -> list:
    return [l for l in jax.tree.leaves(tree) if differentiable(l.dtype)]


# --- one stage's forward and backward ---------------------------------------------------
def stage_forward(stage: Stage, k: int, last: bool, params, state, x, tgt, rng, gmb, loss_fn,
                  global_microbatches: int, train: bool, residuals: Residuals,
                  output_shape: list | None = None):
    """Stage k under jax.vjp. Returns (loss / (data x M) on the last stage, else the
    output's float leaves; kept residuals; new state; the output's other leaves). Appends the stage
    output's abstract tree (even the last stage's, whose loss it returns) to
    `output_shape` when given."""
    xf, xi, xmask = split_float(x)
    xdef = jax.tree.structure(x)

    def f(p, xf):
        y, new_state = stage.apply(p, state, merge_float(xdef, xmask, xf, xi), train=train,
                                   rng=rng, microbatch=gmb)
        if output_shape is not None:
            output_shape.append(jax.tree.map(abstract_value, y))
        if last:
            return microbatch_loss(loss_fn, y, tgt, global_microbatches), (new_state, [])
        yf, yi, _ = split_float(y)
        return yf, (new_state, yi)

    if k == 0:   # the model input needs no gradient
        out, vjp_fn, (new_state, yi) = jax.vjp(lambda p: f(p, xf), params, has_aux=True)
    else:
        out, vjp_fn, (new_state, yi) = jax.vjp(f, params, xf, has_aux=True)
    return out, residuals.split(k, vjp_fn, params), new_state, yi


def backward_fn(residuals: Residuals, k: int, last: bool):
    """(params, kept residuals, cotangent leaves) -> (param grads, input grads), from the
    stashed residuals (the last stage's cotangent is d loss / d loss, a scalar)."""
    def bwd(p, kept, ct):
        return residuals.rebuild(k, kept, p)(ct[0] if last else ct)
    return bwd


def abstract_value(a) -> jax.ShapeDtypeStruct:
    """What `jax.eval_shape` gives for a traced value."""
    aval = jax.typeof(a)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def stage_forwards(eng: Engine, mb_inputs: PyTree, train: bool, rng) -> tuple[list, list]:
    """Every stage's forward, (params, state, x, rng, gmb) -> output, traced in order on
    one microbatch (no FLOPs) at the layers' local shapes (the caller binds the "model"
    degree): (abstract input of every stage and the model's output, [x_0, ..., x_K];
    each stage's `TracedForward`, which forward-only programs replay)."""
    trees, forwards = [mb_inputs], []
    gmb = jax.ShapeDtypeStruct((), jnp.int32)
    for stage in eng.stages:
        def run(params, state, x, key, gmb, stage=stage):
            return stage.apply(params, state, x, train=train, rng=key, microbatch=gmb)[0]
        closed, y = tensor_parallel.make_jaxpr(run, return_shape=True)(
            stage.abstract_params, stage.abstract_state, trees[-1], rng, gmb)
        trees.append(y)
        forwards.append(TracedForward(closed, jax.tree.structure(y)))
    return trees, forwards


def boundary_trees(eng: Engine, mb_inputs: PyTree, train: bool, rng) -> list:
    """Abstract input of every stage and the model's output, [x_0, ..., x_K], for one
    microbatch (no FLOPs)."""
    return stage_forwards(eng, mb_inputs, train, rng)[0]


def stage_layouts(eng: Engine, mb_inputs: PyTree, mb_targets: PyTree, loss_fn, train: bool,
                  rng, split: bool) -> StageLayouts:
    """Abstractly runs every stage in order on one microbatch (no FLOPs) to learn its
    boundary, residual and (split) crossing layouts."""
    K = len(eng.stages)
    # trees[k + 1], stage k's output, is read off stage k's trace (as boundary_trees
    # would compute it, without tracing every stage a second time).
    trees = [mb_inputs]
    kept_trees, residuals, splits, crosses, all_kept = [], Residuals(), [], [], []
    forwards = []
    gmb = jax.ShapeDtypeStruct((), jnp.int32)
    for k, stage in enumerate(eng.stages):
        last, output_shape = k == K - 1, []

        def run(params, state, x, tgt, key, gmb, k=k, stage=stage, last=last,
                output_shape=output_shape):
            return stage_forward(stage, k, last, params, state, x, tgt, key, gmb, loss_fn,
                                 eng.data * eng.num_microbatches, train, residuals,
                                 output_shape)

        closed, shapes = tensor_parallel.make_jaxpr(run, return_shape=True)(
            stage.abstract_params, stage.abstract_state, trees[k], mb_targets, rng, gmb)
        trees.append(output_shape[-1])
        forwards.append(TracedForward(closed, jax.tree.structure(shapes)))
        out, kept = shapes[:2]
        # Residuals the backward can recompute cheaply from the others are not stashed.
        n_out = len(jax.tree.leaves(out))
        d = residuals.derive(k, closed, closed.jaxpr.outvars[n_out:n_out + len(kept)])
        kept = [kept[i] for i in d.stash]
        if split:
            ct = [jax.ShapeDtypeStruct((), loss_dtype())] if last else floats(out)
            sb = SplitBackward(backward_fn(residuals, k, last), stage.abstract_params, kept, ct,
                               len(jax.tree.leaves(stage.abstract_params)))
            splits.append(sb)
            crosses.append(sb.crossing_avals)
            all_kept.append(kept)
            kept = [a for a, read in zip(kept, sb.reads_residual) if read]
        kept_trees.append(kept)
    internal, act_len = packing.shared_layouts(trees[1:K], whole_min=None)
    grads, grad_len = packing.shared_layouts([floats(t) for t in trees[1:K]], whole_min=None)
    res, res_len = packing.shared_layouts(kept_trees)
    in_row, overflow = [], []
    for k, sb in enumerate(splits):
        live = [w for w, read in zip(sb.weight_reads_residual, sb.reads_residual) if read]
        lay, rest = packing.place_in_free_space(res[k], res_len, live, crosses[k])
        in_row.append(lay)
        overflow.append(rest)
    cross, cross_len = (packing.shared_layouts([[c[i] for i in o] for c, o in zip(crosses, overflow)])
                        if split else ([], {}))
    return StageLayouts(
        act=[packing.layout_of(mb_inputs), *internal, packing.layout_of(trees[K])],
        grad=[packing.layout_of(floats(mb_inputs)), *grads], res=res, cross=cross,
        act_len=act_len, grad_len=grad_len, res_len=res_len, cross_len=cross_len,
        residuals=residuals, split=splits, in_row=in_row, overflow=overflow,
        res_used=[tuple(i for i, r in enumerate(sb.reads_residual) if r) for sb in splits],
        res_avals=all_kept, forwards=forwards)


def forward_layouts(eng: Engine, mb_in: PyTree, train: bool, rng) -> StageLayouts:
    """Boundary layouts for forward-only runs (no residuals needed), with each stage's
    forward traced once (`stage_forwards`): the program replays those jaxprs instead of
    tracing every stage's Flax modules a second time (Inception-V3 tiny's evaluation
    step traced in 7.3 s, half of it twice over)."""
    trees, forwards = stage_forwards(eng, mb_in, train, rng)
    internal, act_len = packing.shared_layouts(trees[1:-1], whole_min=None)
    return StageLayouts(
        act=[packing.layout_of(trees[0]), *internal, packing.layout_of(trees[-1])],
        grad=[], res=[], cross=[], act_len=act_len, grad_len={}, res_len={},
        cross_len={}, residuals=None, split=[], forwards=forwards)
