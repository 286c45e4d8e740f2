"""The runtime as plain functions: driven without a `Pipeline` where that is the point,
the B/W split's jaxprs, and U tasks (the optimizer inside the pipeline)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from jaxhybrid.pipeline import backward, layouts, packing, runtime, tables
from jaxhybrid.pipeline.stages import even_boundaries
from jaxhybrid.schedules import TaskType, make_schedule

import mixed_model as mm

LAYERS = mm.make_layers()
RNG = jax.random.key(3)


def test_weight_half_runs_no_forward_and_repeats_no_input_gradient_op():
    # A stage: Dense -> tanh -> Dense. Its backward's weight half may only run the
    # parameter-gradient products: no forward op (tanh, the forward matmuls) and no
    # equation the input half already ran.
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(jnp.tanh(nn.Dense(8)(x)))

    x = jnp.ones((4, 8))
    params = Block().init(jax.random.key(0), x)["params"]
    res = backward.Residuals()
    out, vjp_fn = jax.vjp(lambda p, x: Block().apply({"params": p}, x), params, x)
    kept = res.split(0, vjp_fn, params)
    bwd = lambda p, kept, ct: res.rebuild(0, kept, p)(ct[0])
    sb = backward.SplitBackward(bwd, params, kept, [out], len(jax.tree.leaves(params)))
    w_prims = sb.weight_primitives()
    assert "tanh" not in w_prims and sb.num_weight_eqns > 0
    # W's matmuls are the two kernel gradients only (B has the input-gradient ones).
    assert w_prims.count("dot_general") == 2
    g_x, crossing = sb.input_half(params, kept, [jnp.ones_like(out)])
    g_p = sb.weight_half(params, kept, crossing)
    ref_p, ref_x = vjp_fn(jnp.ones_like(out))
    for a, b in zip(g_p, jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(g_x[0], ref_x, rtol=1e-6)


def test_split_pipeline_weight_branches_run_no_forward_op():
    pipe = jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2,
                       schedule="zb-h1", boundaries=[4], remat="none")
    pipe.pack(mm.initial_per_layer())
    inputs, labels = mm.make_batch(4)
    mb_in = pipe._microbatch(inputs, "inputs")
    mb_tg = pipe._microbatch(labels, "targets")
    lay = layouts.stage_layouts(pipe.engine(), mb_in, mb_tg, mm.loss_fn, True,
                                jax.ShapeDtypeStruct((2,), jnp.uint32), split=True)
    for sb in lay.split:
        # (A conv's kernel gradient is itself a convolution, so conv may appear.)
        prims = set(sb.weight_primitives())
        assert sb.num_weight_eqns and not prims & {"tanh", "exp", "log", "erf", "logistic"}, prims


def test_stage_layouts_read_the_same_boundaries_as_an_abstract_run_of_the_stages():
    # stage_layouts reads each stage's output off its vjp trace; the activation layouts
    # must be those of the stage-by-stage abstract run the eval path uses.
    pipe = jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=1, pipe=4), num_microbatches=2,
                       schedule="1f1b", boundaries=[2, 4, 6], remat="none")
    pipe.pack(mm.initial_per_layer())
    inputs, labels = mm.make_batch(4)
    mb_in, mb_tg = pipe._microbatch(inputs, "inputs"), pipe._microbatch(labels, "targets")
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    eng = pipe.engine()
    trees = layouts.boundary_trees(eng, mb_in, True, key)
    lay = layouts.stage_layouts(eng, mb_in, mb_tg, mm.loss_fn, True, key, split=False)
    K = len(eng.stages)
    internal, _ = packing.shared_layouts(trees[1:K], whole_min=None)
    assert lay.act == [packing.layout_of(trees[0]), *internal, packing.layout_of(trees[K])]


def test_runtime_runs_without_a_pipeline_object():
    # The tick program is built from explicit values: engine, layouts, control table.
    pipe = jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2,
                       schedule="1f1b", boundaries=[4], remat="none")
    variables = pipe.pack(mm.initial_per_layer())
    eng = pipe.engine()
    del pipe   # nothing below reads it
    inputs, labels = mm.make_batch(4)
    mb = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct((2, *a.shape[1:]), a.dtype), t)
    lay = layouts.stage_layouts(eng, mb(inputs), mb(labels), mm.loss_fn, False, None, False)
    job = runtime.Job(eng, lay, mm.loss_fn, False, False, False)
    ctl = tables.control_table(make_schedule("1f1b", 2, 2))
    body = runtime.train_program(job, ctl)
    P = jax.sharding.PartitionSpec
    state = {c: variables[c] for c in variables if c != "params"}
    loss, grads, *_ = jax.jit(jax.shard_map(
        body, mesh=jh.make_mesh(data=1, pipe=2),
        in_specs=(P("pipe"), P("pipe"), P(), P("data"), P("data"), P()),
        out_specs=(P(), P("pipe"), P("pipe"), P("pipe"), P()), check_vma=False))(
        variables["params"], state, None, inputs, labels, jnp.zeros((2,), jnp.uint32))
    ref = jp.reference_value_and_grad(LAYERS, mm.initial_per_layer(), mm.loss_fn, inputs, labels,
                                      num_microbatches=2, train=False)
    np.testing.assert_allclose(float(loss), float(ref[0]), rtol=1e-5)


@pytest.mark.parametrize("schedule,data,pipe_size", [("1f1b", 2, 2), ("zb-h1", 1, 4),
                                                     ("interleaved", 1, 2), ("zbv", 2, 2),
                                                     ("1f1b", 2, 1)])
def test_update_tasks_equal_value_and_grad_then_optax(schedule, data, pipe_size):
    M = 3
    stages = make_schedule(schedule, pipe_size, M).num_stages
    pipe = jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=data, pipe=pipe_size), num_microbatches=M,
                       schedule=schedule, boundaries=even_boundaries(len(LAYERS), stages),
                       remat="none")
    variables = pipe.pack(mm.initial_per_layer())
    # eps well above float32 noise: a few parameters get ~1e-9 gradients, where Adam's
    # m / (sqrt(v) + 1e-8) turns last-bit differences of summation order into O(lr) steps.
    tx = optax.adamw(1e-2, eps=1e-4, weight_decay=1e-3)
    opt = pipe.init_optimizer(tx, variables)
    inputs, labels = mm.make_batch(data * M * 2, seed=5)
    assert any(t.kind == TaskType.U for t in pipe.schedule.with_updates().tasks)
    loss, grads, new_vars, new_opt = pipe.train_step(mm.loss_fn, tx)(
        variables, opt, inputs, labels, RNG)
    ref_loss, ref_grads, ref_vars = pipe.value_and_grad(mm.loss_fn)(variables, inputs, labels, RNG)
    updates, ref_opt = tx.update(ref_grads, opt, variables["params"])
    ref_params = optax.apply_updates(variables["params"], updates)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves((new_vars, new_opt)), jax.tree.leaves(
            ({**ref_vars, "params": ref_params}, ref_opt))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)



def _stack_step(model: str, schedule: str = "zb-h1", width: int = 16, M: int = 4):
    """(the jitted step, its args, the split layouts it ran with) of 3 blocks and a head
    (tanh: Dense+tanh, mlp: residual Dense+relu) on 2 stages, 4 examples a microbatch.
    (Built here: importing the bench module would define its absl flags twice.)"""
    from jaxhybrid.bench.mlp import Block, Head, xent
    from jaxhybrid.models.spec import init_layers
    block = Block(width, "tanh", residual=False) if model == "tanh" else Block(width)
    stack = [block.clone() for _ in range(3)] + [Head()]
    r = np.random.default_rng(0)
    x = r.standard_normal((4 * M, width), np.float32)
    y = r.integers(0, 10, 4 * M).astype(np.int32)
    pipe = jp.Pipeline(stack, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=M,
                       schedule=schedule, boundaries=[2], remat="none")
    variables = pipe.pack(init_layers(stack, jax.random.key(0), x[:1]))
    step = pipe.value_and_grad(xent)
    jax.block_until_ready(step(variables, x, y))
    return step, (variables, x, y), pipe._cache["last_layouts"]


def test_split_backward_hands_w_its_cotangents_in_the_stash_space_b_frees():
    # Stage 1 = Dense+tanh and the head: W reads the layer inputs; B alone reads the loss's
    # residuals (softmax and labels), whose space (with the row's padding) takes B's
    # cotangents for W where they fit; the rest goes to the cross ring. What neither half
    # reads is not stashed. Stage 0's B has no input gradient to compute, so its W reads
    # the output gradient itself: B hands it over in the cross ring, and the gradient
    # inbox is free after B, as in 1F1B.
    _, _, lay = _stack_step("tanh")
    sb = lay.split[1]
    assert not all(sb.weight_reads_residual)
    placed = [i for i in range(len(sb.crossing_avals)) if i not in lay.overflow[1]]
    assert placed and lay.overflow[1]
    row = sum(n for key, n in lay.res_len.items() if packing.dtype_of(key) == "float32")
    w_reads = sum(int(np.prod(s)) for s, w, d in zip(lay.res[1].shapes, sb.weight_reads_residual,
                                                     lay.res[1].dtypes) if w and d == "float32")
    assert sum(int(np.prod(sb.crossing_avals[i].shape)) for i in placed) <= row - w_reads
    assert lay.overflow[0] == [0] and len(lay.split[0].crossing_avals) == 1
    for k, sb in enumerate(lay.split):
        assert len(lay.res[k].shapes) == sum(sb.reads_residual)
    assert make_schedule("zb-h1", 4, 16).ring_slots()[1]["grad"] == \
        make_schedule("1f1b", 4, 16).ring_slots()[1]["grad"]


def test_residuals_the_backward_can_recompute_cheaply_are_not_stashed():
    # jax's tanh rule keeps y and 1 - y; a layer's output is also the next one's input.
    # Stage 0 (two Dense+tanh) stashes its input and the two outputs, nothing else.
    _, _, lay = _stack_step("tanh", schedule="1f1b")
    assert lay.res[0].shapes == ((4, 16),) * 3
    assert lay.residuals.derived[0].num_recomputed == 2


def test_derivation_recomputes_only_cheap_functions_of_stashed_values():
    # Leaves: x (an input), t = tanh(x @ w), 1 - t, t again, exp(t), a broadcast of the
    # parameter b, and x > 0. Stashed: x, t, exp(t) (transcendental), b's broadcast (a
    # parameter is no root: asynchronous backwards may see other weights); the rest is
    # recomputed, bit for bit.
    def fwd(w, b, x):
        t = jnp.tanh(x @ w)
        return [x, t, 1 - t, t, jnp.exp(t), jnp.broadcast_to(b, x.shape), x > 0]
    args = (np.ones((3, 3), np.float32) / 3, np.arange(3, dtype=np.float32),
            np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3))
    closed = jax.make_jaxpr(fwd)(*args)
    d = backward.Derivation.of(closed, closed.jaxpr.outvars)
    assert d.stash == (0, 1, 4, 5) and d.num_recomputed == 3
    want = fwd(*args)
    for a, b in zip(d.restore([want[i] for i in d.stash]), want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_split_backward_spills_cotangents_that_do_not_fit_to_the_cross_ring():
    # ReLU: B's only residual is a bool mask, too small a space for a float cotangent.
    _, _, lay = _stack_step("mlp")
    assert lay.cross_len and any(lay.overflow)


def test_no_ring_is_copied_whole_in_a_tick():
    # XLA CPU copies a loop-carried ring whole when two separate slices read it before an
    # in-place write, or when a row is written back unchanged: the runtime avoids both
    # (one gather for B's and W's gradient rows; only rows that change are written).
    import re
    step, args, lay = _stack_step("tanh", width=64)
    body = step.lower(*args).compile().as_text().split("\nENTRY ")[0]   # all but the entry
    lengths = {str(n) for bufs in (lay.act_len, lay.grad_len, lay.res_len, lay.cross_len)
               for n in bufs.values()}
    copied = re.findall(r"= [a-z0-9]+\[(\d+),(\d+)\]\{1,0\} copy\(", body)
    assert not [c for c in copied if c[1] in lengths], copied


def _walk(jaxpr, path=()):
    """(equation, its path of cond branch indices) over a jaxpr and every jaxpr nested
    in it."""
    for eqn in jaxpr.eqns:
        yield eqn, path
        for sub in eqn.params.values():
            subs = sub if isinstance(sub, (tuple, list)) else [sub]
            for i, s in enumerate(subs):
                inner = getattr(s, "jaxpr", s)
                if hasattr(inner, "eqns"):
                    yield from _walk(inner, path + (i,) if eqn.primitive.name == "cond" else path)


def test_only_the_first_stage_reads_the_raw_input():
    # The forward switch gets the whole input and inbox and each stage branch reads what
    # it uses: a row read before the switch (in the F slot's busy branch) was a copy in
    # every F on every stage.
    step, (variables, x, y), _ = _stack_step("tanh", schedule="1f1b", width=64)
    jaxpr = jax.make_jaxpr(step)(variables, x, y).jaxpr
    reads = [p for e, p in _walk(jaxpr) if e.primitive.name in ("dynamic_slice", "gather")
             and e.outvars[0].aval.shape in ((4, 64), (1, 4, 64))]
    # busy (branch 1 of cond(k >= 0)), then stage 0 (branch 0 of the switch over stages)
    assert reads and all(p[-2:] == (1, 0) for p in reads), reads
