"""The pipeline equals the sequential single-device reference (loss, grads, batch_stats)."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from jaxhybrid.layers import apply_layer
from jaxhybrid.pipeline.stages import even_boundaries
from jaxhybrid.schedules import SCHEDULES, asynchronous, make_schedule

import mixed_model as mm

LAYERS = mm.make_layers()  # 8 layers: conv+BN, conv+BN, flatten/embed, 4 x (dense, LN, dropout), head
RNG = jax.random.key(42)
MESHES = [(1, 1), (1, 2), (2, 2), (1, 4), (2, 4), (4, 2), (1, 8), (8, 1)]
# The meshes every schedule is checked on (besides the two-stage ones above).
SCHEDULE_MESHES = [(1, 2), (2, 2), (1, 4), (2, 4), (1, 8)]
# Asynchronous schedules run 1F1B's table for value_and_grad (tests/test_async.py).
SYNC_SCHEDULES = sorted(n for n in SCHEDULES
                        if not asynchronous.is_asynchronous(make_schedule(n, 2, 4)))


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# 8 layers: 2 virtual stages per device need 2 x pipe <= 8 layers; at pipe = 8 the
# V-shape and interleaved schedules run a longer stack (16 stages).
WIDE = mm.make_layers(num_mix=12)


@functools.lru_cache(maxsize=None)
def _case(data, M, mb=2, wide=False):
    inputs, labels = mm.make_batch(data * M * mb, seed=data * 100 + M)
    per_layer = _initial_vars(wide)
    ref = jp.reference_value_and_grad(WIDE if wide else LAYERS, per_layer, mm.loss_fn, inputs,
                                      labels, data=data, num_microbatches=M, rng=RNG)
    return inputs, labels, ref


@functools.lru_cache(maxsize=None)
def _initial_vars(wide=False):
    pipe = jp.Pipeline(WIDE if wide else LAYERS, mesh=jh.make_mesh(data=1, pipe=1))
    variables = pipe.init(jax.random.key(0), mm.make_batch(2)[0])
    per_layer = pipe.unpack(variables)
    # Non-trivial batch statistics so that their update is checked too.
    for v in per_layer:
        if "batch_stats" in v:
            v["batch_stats"] = jax.tree.map(lambda a: a + 0.3, v["batch_stats"])
    return per_layer


def _check(data, pipe_size, schedule, M, boundaries=None, remat="none", wide=False):
    inputs, labels, (ref_loss, ref_grads, ref_vars) = _case(data, M, wide=wide)
    layers = WIDE if wide else LAYERS
    mesh = jh.make_mesh(data=data, pipe=pipe_size)
    stages = make_schedule(schedule, pipe_size, M).num_stages
    if boundaries is None:   # the planner's choice is tested in test_planned_pipeline.py
        boundaries = even_boundaries(len(layers), stages)
    pipe = jp.Pipeline(layers, mesh=mesh, num_microbatches=M, schedule=schedule,
                       boundaries=boundaries, remat=remat)
    variables = pipe.pack(_initial_vars(wide))
    loss, grads, new_vars = pipe.value_and_grad(mm.loss_fn)(variables, inputs, labels, RNG)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    got = pipe.unpack({**variables, "params": grads})
    for g, r in zip(_leaves([v["params"] for v in got]), _leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    new = pipe.unpack(new_vars)
    for g, r in zip(_leaves([v.get("batch_stats", {}) for v in new]),
                    _leaves([v.get("batch_stats", {}) for v in ref_vars])):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    # Gradients live where the parameters live: one row per "pipe" position.
    assert grads["float32"].sharding.spec == jax.sharding.PartitionSpec("pipe")
    return pipe


@pytest.mark.parametrize("data,pipe_size", [m for m in MESHES if m not in SCHEDULE_MESHES])
def test_1f1b_matches_reference_on_other_meshes(data, pipe_size):
    for M in sorted({1, pipe_size, 2 * pipe_size + 1}):
        if data * M * 2 <= 64:
            _check(data, pipe_size, "1f1b", M)


@pytest.mark.parametrize("schedule", SYNC_SCHEDULES)
@pytest.mark.parametrize("data,pipe_size", SCHEDULE_MESHES)
def test_every_schedule_matches_reference(data, pipe_size, schedule):
    # M in {1, S, 2S+1}; every schedule takes every M >= 1.
    for M in sorted({1, pipe_size, 2 * pipe_size + 1}):
        stages = make_schedule(schedule, pipe_size, M).num_stages
        _check(data, pipe_size, schedule, M, wide=stages > len(LAYERS))


def test_uneven_boundaries_and_remat():
    # 8 layers on 3 stages, unevenly; per-stage remat settings and a per-layer plan.
    _check(1, 4, "1f1b", 3, boundaries=[1, 2, 7], remat=["full", "none", "dots_saveable", "none"])
    _check(2, 2, "gpipe", 2, boundaries=[5], remat="full")
    _check(1, 2, "1f1b", 2, remat=[i % 2 == 0 for i in range(len(LAYERS))])
    # Recomputation inside split backwards and virtual stages.
    _check(1, 2, "zb-h1", 3, remat="full")
    _check(2, 2, "interleaved", 3, boundaries=[1, 3, 7], remat=[True, False] * 4)


@pytest.mark.parametrize("schedule", SYNC_SCHEDULES)
def test_apply_on_every_stage_map(schedule):
    inputs, _ = mm.make_batch(12)
    x = inputs
    for layer, v in zip(LAYERS, _initial_vars()):
        x, _ = apply_layer(layer, v, x, train=False)
    stages = make_schedule(schedule, 2, 3).num_stages
    pipe = jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=2, pipe=2), num_microbatches=3,
                       schedule=schedule, boundaries=even_boundaries(len(LAYERS), stages))
    out = pipe.apply(pipe.pack(_initial_vars()), inputs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x), rtol=1e-5, atol=1e-6)


def test_apply_matches_sequential_eval():
    inputs, _ = mm.make_batch(16)
    per_layer = _initial_vars()
    x = inputs
    for layer, v in zip(LAYERS, per_layer):
        x, _ = apply_layer(layer, v, x, train=False)
    pipe = jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=2, pipe=4), num_microbatches=2,
                       boundaries=[2, 4, 6])
    out = pipe.apply(pipe.pack(per_layer), inputs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x), rtol=1e-5, atol=1e-6)



class _AuxHead(nn.Module):
    """Logits, a scalar per call (an auxiliary loss) and a parameter (a noise scale)."""
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = x[0]                      # the mixed model's (activation, aux) carry
        return nn.Dense(3)(h), jnp.mean(h ** 2), self.param("scale", nn.initializers.ones, (5,))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_apply_returns_non_batch_outputs_once_per_microbatch(schedule):
    """Batch-major leaves come back as one batch; a scalar or a returned parameter once per
    microbatch, in batch order (data x M of them), equal to the model on that microbatch."""
    layers = LAYERS[:-1] + [_AuxHead()]
    data, M, mb = 2, 3, 2
    inputs, _ = mm.make_batch(data * M * mb)
    per_layer = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=1)).init_layers(
        jax.random.key(1), inputs)

    def model(x):
        for layer, v in zip(layers, per_layer):
            x, _ = apply_layer(layer, v, x, train=False)
        return x
    stages = make_schedule(schedule, 2, M).num_stages
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=data, pipe=2), num_microbatches=M,
                       schedule=schedule, boundaries=even_boundaries(len(layers), stages))
    logits, aux, scale = pipe.apply(pipe.pack(per_layer), inputs)
    want = [model(jax.tree.map(lambda a: a[i * mb:(i + 1) * mb], inputs)) for i in range(data * M)]
    np.testing.assert_allclose(np.asarray(logits), np.concatenate([w[0] for w in want]),
                               rtol=1e-5, atol=1e-6)
    assert aux.shape == (data * M,) and scale.shape == (data * M, 5)
    np.testing.assert_allclose(np.asarray(aux), [float(w[1]) for w in want], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(scale), np.stack([w[2] for w in want]), rtol=1e-6)


def test_reference_loss_is_value_and_grads_loss_and_state():
    # The forward-only reference (tests that need no gradients use it: it compiles in a
    # third of the time) gives the same loss and new batch statistics.
    inputs, labels, (ref_loss, _, ref_vars) = _case(2, 2)
    loss, new_vars = jp.reference_loss(LAYERS, _initial_vars(), mm.loss_fn, inputs, labels,
                                       data=2, num_microbatches=2, rng=RNG)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for g, r in zip(_leaves(new_vars), _leaves(ref_vars)):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7)


def test_dropout_depends_on_rng_and_is_reproducible():
    inputs, labels = mm.make_batch(8)
    pipe = jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=2, pipe=2), num_microbatches=2,
                       boundaries=[4])
    variables = pipe.pack(_initial_vars())
    f = pipe.value_and_grad(mm.loss_fn)
    a = f(variables, inputs, labels, jax.random.key(1))[0]
    b = f(variables, inputs, labels, jax.random.key(1))[0]
    c = f(variables, inputs, labels, jax.random.key(2))[0]
    assert float(a) == float(b) and float(a) != float(c)
    with pytest.raises(ValueError, match="pass rng="):
        f(variables, inputs, labels)   # dropout layers need a key while training


def test_pack_unpack_round_trip():
    pipe = jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=2, pipe=4), boundaries=[2, 3, 6])
    per_layer = _initial_vars()
    back = pipe.unpack(pipe.pack(per_layer))
    assert jax.tree.structure(back) == jax.tree.structure(per_layer)
    for a, b in zip(_leaves(back), _leaves(per_layer)):
        np.testing.assert_array_equal(a, b)
    # Stage buffers are sharded over "pipe" and replicated over "data".
    buf = pipe.pack(per_layer)["params"]["float32"]
    assert buf.shape[0] == 4 and buf.sharding.spec == jax.sharding.PartitionSpec("pipe")
    assert len(buf.addressable_shards) == 8
    stats = pipe.padding_stats()
    assert stats["total_params"] == sum(a.size for v in per_layer for a in _leaves(v["params"]))


def test_a_model_without_parameters_unpacks_its_empty_gradients():
    # Its gradients are {}: unpack refused them, telling the user to pass packed gradients.
    layers = [nn.Sequential([jnp.tanh]), nn.Sequential([jnp.sin])]
    x = jnp.ones((4, 3))
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2,
                       boundaries=[1])
    v = pipe.init(jax.random.key(0), x)
    loss, grads, _ = pipe.value_and_grad(lambda o, t: jnp.mean((o - t) ** 2))(v, x, x * 0, None)
    np.testing.assert_allclose(loss, jnp.mean(jnp.sin(jnp.tanh(x)) ** 2), rtol=1e-6)
    assert grads == {} and pipe.unpack(grads) == [{}, {}] == pipe.unpack(v)
    with pytest.raises(ValueError, match=r"Pipeline.unpack: got a tree with keys \['x'\]"):
        pipe.unpack({"x": 1})


def test_errors():
    mesh = jh.make_mesh(data=2, pipe=4)
    with pytest.raises(ValueError, match="4 stages but only 3 layers"):
        jp.Pipeline(LAYERS[:3], mesh=mesh)
    with pytest.raises(ValueError, match=r"8 stages \(4 devices x 2 virtual\) but only 6"):
        jp.Pipeline(LAYERS[:6], mesh=mesh, schedule="interleaved", virtual_stages=2)
    with pytest.raises(ValueError, match="virtual_stages is an option of schedule='interleaved'"):
        jp.Pipeline(LAYERS, mesh=mesh, schedule="1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="strictly increasing"):
        jp.Pipeline(LAYERS, mesh=mesh, boundaries=[3, 2, 5])
    with pytest.raises(ValueError, match="out of range"):
        jp.Pipeline(LAYERS, mesh=mesh, boundaries=[0, 2, 5])
    with pytest.raises(ValueError, match="needs 3"):
        jp.Pipeline(LAYERS, mesh=mesh, boundaries=[2, 5])
    with pytest.raises(ValueError, match="axes"):
        jp.Pipeline(LAYERS, mesh=jax.make_mesh((8,), ("x",)))
    with pytest.raises(ValueError, match="unknown schedule"):
        jp.Pipeline(LAYERS, mesh=mesh, schedule="zigzag")
    with pytest.raises(ValueError, match="remat"):
        jp.Pipeline(LAYERS, mesh=mesh, remat="sometimes")
    with pytest.raises(ValueError, match="call pipe.init"):
        jp.Pipeline(LAYERS, mesh=mesh).pack(_initial_vars())   # planner has not run yet
    # ... and apply before init names init only: it offered pack, which is refused then.
    with pytest.raises(ValueError, match=r"call pipe.init\(rng, sample_inputs\) first\.$"):
        jp.Pipeline(LAYERS, mesh=mesh).apply({}, mm.make_batch(8)[0])
    with pytest.raises(ValueError, match=r"or pipe.pack\(per_layer\) first"):
        jp.Pipeline(LAYERS, mesh=mesh, boundaries=[2, 4, 6]).apply({}, mm.make_batch(8)[0])
    with pytest.raises(ValueError, match="memory_budget needs remat='auto'"):
        jp.Pipeline(LAYERS, mesh=mesh, remat="full", memory_budget="1GB")
    pipe = jp.Pipeline(LAYERS, mesh=mesh, num_microbatches=3, boundaries=[2, 4, 6])
    variables = pipe.pack(_initial_vars())
    inputs, labels = mm.make_batch(8)
    with pytest.raises(ValueError, match="not divisible by data x num_microbatches = 2 x 3"):
        pipe.value_and_grad(mm.loss_fn)(variables, inputs, labels, RNG)


def test_mesh_errors():
    with pytest.raises(ValueError, match="only 8 are available"):
        jh.make_mesh(data=4, pipe=4)
    with pytest.raises(ValueError, match="does not divide"):
        jh.make_mesh(data=-1, pipe=3)
    mesh = jh.make_mesh(data=-1, pipe=2)
    assert dict(mesh.shape) == {"data": 4, "pipe": 2}


def test_one_replica_programs_do_not_all_reduce_gradients():
    # A mean over a one-device "data" axis would still copy every gradient (XLA keeps
    # the all-reduce); with data = 1 the step has none, or only the pipe loss sum.
    inputs, labels = mm.make_batch(8)
    for pipe_size in (1, 4):
        pipe = jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=1, pipe=pipe_size),
                           num_microbatches=2, remat="none",
                           boundaries=even_boundaries(len(LAYERS), pipe_size))
        variables = pipe.pack(_initial_vars())
        hlo = pipe.value_and_grad(mm.loss_fn).lower(variables, inputs, labels, RNG).as_text()
        # pipe = 4: the one all-reduce is the loss summed over stages.
        assert hlo.count("stablehlo.all_reduce") == (pipe_size > 1)
