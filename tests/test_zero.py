"""ZeRO over "data" (zero=1): the optimizer state sharded over the data replicas gives the
replicated update's numbers, and each device holds 1 / (pipe x data) of it."""

import jax
import numpy as np
import optax
import pytest

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from jaxhybrid.pipeline import zero
from jaxhybrid.pipeline.stages import even_boundaries
from jaxhybrid.schedules import make_schedule

import mixed_model as mm

LAYERS = mm.make_layers()
RNG = jax.random.key(3)


def _pipeline(schedule, data, pipe_size, M, zero_level):
    stages = make_schedule(schedule, pipe_size, M).num_stages
    return jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=data, pipe=pipe_size), num_microbatches=M,
                       schedule=schedule, boundaries=even_boundaries(len(LAYERS), stages),
                       remat="none", zero=zero_level)


def _steps(pipe, tx, n, data, M):
    variables = pipe.pack(mm.initial_per_layer())
    opt = pipe.init_optimizer(tx, variables)
    step = pipe.train_step(mm.loss_fn, tx)
    losses = []
    for i in range(n):
        inputs, labels = mm.make_batch(data * M * 2, seed=10 + i)
        loss, _, variables, opt = step(variables, opt, inputs, labels, RNG)
        losses.append(float(loss))
    return losses, pipe.unpack(variables), opt


@pytest.mark.parametrize("schedule,data,pipe_size", [("zbv", 2, 2), ("gpipe", 4, 2)])
def test_zero_equals_replicated_update(schedule, data, pipe_size):
    M, tx = 2, optax.adamw(1e-2, weight_decay=1e-3)
    ref_losses, ref_vars, ref_opt = _steps(_pipeline(schedule, data, pipe_size, M, 0), tx, 2,
                                           data, M)
    pipe = _pipeline(schedule, data, pipe_size, M, 1)
    losses, new_vars, opt = _steps(pipe, tx, 2, data, M)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new_vars), jax.tree.leaves(ref_vars)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # The same moments, now in data shards: unpad and compare slot by slot.
    for a, b in zip(jax.tree.leaves(opt), jax.tree.leaves(ref_opt)):
        a_ = np.asarray(a)[..., :np.shape(b)[-1]] if np.ndim(b) else np.asarray(a)
        np.testing.assert_allclose(a_, np.asarray(b), rtol=1e-5, atol=1e-6)
        if np.ndim(a):   # each device holds one (pipe, data) block of every slot
            shard = a.addressable_shards[0].data.shape
            assert shard == (1, zero.padded_length(np.shape(b)[-1], data) // data), shard
    # Rest buffers are laid out in whole data shards (no padding at update time).
    assert all(n % data == 0 for k, n in pipe.param_len.items() if "#" not in k)


@pytest.mark.parametrize("zero_level", [0, 1])
def test_optimizer_state_is_made_where_the_step_keeps_it(zero_level):
    # zero=0 made every slot whole on device 0 (zeros_like is a constant), and the step
    # compiled a second time when its output slots came back sharded over "pipe".
    pipe = _pipeline("1f1b", 2, 2, 2, zero_level)
    variables = pipe.pack(mm.initial_per_layer())
    tx = optax.adam(1e-3)
    opt = pipe.init_optimizer(tx, variables)
    inputs, labels = mm.make_batch(8, seed=10)
    _, _, _, after = pipe.train_step(mm.loss_fn, tx)(variables, opt, inputs, labels, RNG)
    for a, b in zip(jax.tree.leaves(opt), jax.tree.leaves(after)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
        assert a.sharding.device_set == set(pipe.mesh.devices.flat)   # not device 0 alone
    mu = opt[0].mu
    for name, slot in mu.items():
        assert slot.sharding.is_equivalent_to(
            variables["params"][name].sharding, slot.ndim) or zero_level, name


def test_zero_rejects_a_bad_level():
    with pytest.raises(ValueError, match="zero=2 must be 0"):
        _pipeline("1f1b", 2, 2, 2, 2)


def test_train_zero_follows_the_replicated_run(tmp_path):
    """scripts/train.py's loop (optimizer at jit level, global-norm clip on) with
    train.zero=1: the same losses, with every Adam slot sharded over "data"."""
    from jaxhybrid import optim, portable, train
    from test_train import gpt_config, losses
    common = {"train.steps": 3, "checkpoint.every": 0, "train.eval_steps": 1}
    train.train_and_evaluate(gpt_config(4, 2, **common), tmp_path / "replicated")
    config = gpt_config(4, 2, **{**common, "train.zero": 1})
    train.train_and_evaluate(config, tmp_path / "zero")
    a, b = losses(tmp_path / "replicated"), losses(tmp_path / "zero")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=1e-5)
    run = train.prepare(config)
    assert run.pipe.zero
    params = run.pipe.init(jax.random.key(0), run.sample_inputs)["params"]
    opt = jax.eval_shape(optim.make_optimizer(config.train).init, params)
    specs = [s.spec for s in jax.tree.leaves(
        portable.opt_state_shardings(run.pipe, opt, params, zero=True))]
    assert specs.count(jax.sharding.PartitionSpec("pipe", "data")) == 2 * len(params), specs
