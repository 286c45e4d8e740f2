"""The asynchronous schedules on layers nobody here wrote (LayerNorm, BatchNorm with
batch_stats, dropout, dict activations, layers without parameters), meshes (1,2) to
(2,4), microbatch counts 1, S, 2S+1 and odd microbatch sizes, optax optimizers beyond
sgd/adam, bf16, and wrong inputs. References: the single-device simulation of
tests/async_sim.py (the documented semantics), the synchronous step where nothing is
stale (one stage; one microbatch), and plain flax for one stage."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from jaxhybrid.schedules import make_schedule

from async_sim import simulate

W = 6


class Norm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.LayerNorm()(jnp.tanh(nn.Dense(W)(x)))


class ToDict(nn.Module):
    @nn.compact
    def __call__(self, x):
        return {"a": nn.Dense(W)(x), "b": jnp.sin(x)}


class FromDictBN(nn.Module):
    @nn.compact
    def __call__(self, d, train=False):
        y = nn.Dense(W)(d["a"]) * d["b"]
        return nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.8)(y))


class NoParams(nn.Module):
    @nn.compact
    def __call__(self, x):
        return 0.5 * jnp.tanh(x)


class Drop(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dropout(0.3, deterministic=not train)(nn.Dense(W)(x))


class Out(nn.Module):
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, param_dtype=self.dtype, dtype=self.dtype)(x)


MODEL = [Norm(), ToDict(), FromDictBN(), NoParams(), Drop(), Out()]


def mse(y, t):
    return jnp.mean((y - t.astype(y.dtype)) ** 2)


def _batches(calls, n, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(n, W)).astype(np.float32),
             rng.normal(size=(n, 2)).astype(np.float32)) for _ in range(calls)]


def _pipe(layers, data, pipe, M, schedule, bounds, remat="none"):
    return jp.Pipeline(layers, mesh=jh.make_mesh(data=data, pipe=pipe), num_microbatches=M,
                       schedule=schedule, boundaries=bounds, remat=remat)


def _train(pipe, tx, batches, rng=None):
    v = pipe.init(jax.random.key(0), batches[0][0])
    start, opt, step = pipe.unpack(v), pipe.init_optimizer(tx, v), pipe.train_step(mse, tx)
    losses = []
    for x, t in batches:
        loss, grads, v, opt = step(v, opt, x, t, rng)
        losses.append(float(loss))
    pipe.last_grads = pipe.unpack(grads)
    return start, losses, pipe.unpack(v)


def _close(got, want, rtol=1e-5, atol=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=rtol, atol=atol)


# (mesh, M, schedule, policy, window, rows per microbatch, optimizer)
CASES = [
    ((2, 2), 5, "pipedream", "stash", 1, 8, optax.adam(0.01)),
    ((1, 4), 9, "spectrain", "predict-v2", 1, 8, optax.sgd(0.05, momentum=0.9)),
    # M < 2S-1: the prediction distance is the call's staleness, min(M-1, 2(S-1-k))
    ((1, 4), 4, "spectrain", "predict-v2", 1, 8, optax.sgd(0.05, momentum=0.9)),
    ((2, 2), 3, "spectrain-1t", "predict-v2", 1, 8, optax.adamw(0.01, weight_decay=0.1)),
    # a window below 2S-1 that two buffers allow (2(S-1)); odd microbatches of 3 rows
    ((2, 2), 6, make_schedule("2bw", 2, 6, window=2), "two-buffer", 2, 3,
     optax.chain(optax.clip(1.0), optax.scale_by_adam(), optax.scale(-0.01))),
]


@pytest.mark.parametrize("mesh,M,schedule,policy,window,rows,tx", CASES)
def test_unseen_model_matches_simulation(mesh, M, schedule, policy, window, rows, tx):
    data, S = mesh
    bounds = [3] if S == 2 else [1, 2, 4]
    pipe = _pipe(MODEL, data, S, M, schedule, bounds)
    batches, key = _batches(2, data * M * rows), jax.random.key(3)
    start, losses, got = _train(pipe, tx, batches, key)
    one_task = isinstance(schedule, str) and schedule.endswith("-1t")
    ref_losses, ref_params, ref_state = simulate(
        MODEL, pipe.ranges, start, tx, batches, M, policy=policy, window=window, data=data,
        one_task=one_task, loss_fn=mse, rng=jax.random.key_data(key))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _close([g.get("params", {}) for g in got], ref_params)
    _close([{c: v for c, v in g.items() if c != "params"} for g in got], ref_state)


def test_one_microbatch_per_call_is_the_synchronous_step():
    # Nothing is in flight: each call is one update, as a synchronous step of one
    # microbatch (SpecTrain predicts over the call's staleness, 0 here).
    layers, batches = [Norm(), NoParams(), Norm(), Out()], _batches(2, 4)
    tx = optax.sgd(0.1, momentum=0.9)
    _, ref_losses, ref = _train(_pipe(layers, 1, 2, 1, "1f1b", [2]), tx, batches)
    for schedule in ("async", "pipedream", "spectrain"):
        _, losses, got = _train(_pipe(layers, 1, 2, 1, schedule, [2]), tx, batches)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, err_msg=schedule)
        _close(got, ref, rtol=1e-6, atol=1e-7)


def test_one_stage_is_sequential_updates_of_plain_flax():
    # pipe=1: M updates per call, one per microbatch, with a schedule counted in updates.
    layers, M = [Norm(), NoParams(), Out()], 3
    tx = optax.adamw(optax.linear_schedule(0.02, 0.005, 4), weight_decay=0.1)
    (x, t), = _batches(1, 3 * M)
    pipe = _pipe(layers, 1, 1, M, "async", [])
    start, (loss,), got = _train(pipe, tx, [(x, t)])
    params = [v.get("params", {}) for v in start]
    opt = tx.init(params)

    def f(ps, xb, tb):
        for layer, p in zip(layers, ps):
            xb = layer.apply({"params": p}, xb)
        return mse(xb, tb)
    ref, grads = [], []
    for m in range(M):
        l, g = jax.value_and_grad(f)(params, x[3 * m:3 * m + 3], t[3 * m:3 * m + 3])
        u, opt = tx.update(g, opt, params)
        params, ref, grads = optax.apply_updates(params, u), ref + [float(l)], grads + [g]
    np.testing.assert_allclose(loss, np.mean(ref), rtol=1e-6)
    _close([v.get("params", {}) for v in got], params, rtol=1e-5, atol=1e-6)
    # grads: the mean of the gradients the call applied
    _close([v.get("params", {}) for v in pipe.last_grads],
           jax.tree.map(lambda *g: sum(g) / M, *grads), rtol=1e-5, atol=1e-6)


def test_bf16_spectrain_with_a_float32_rate():
    # inject_hyperparams keeps a scheduled rate in float32, so updates of bf16 parameters
    # come back float32; the recorded last update stays bf16 (was: "cond branches must
    # have equal output types"), and the run agrees with optax.sgd's bf16 updates.
    layers = [Out(jnp.bfloat16), NoParams(), Out(jnp.bfloat16)]
    rate = optax.linear_schedule(0.1, 0.05, 4)
    batches, out = _batches(2, 8), {}
    for name, tx in [("inject", optax.inject_hyperparams(optax.sgd)(learning_rate=rate)),
                     ("plain", optax.sgd(rate))]:
        _, out[name], final = _train(_pipe(layers, 1, 2, 4, "spectrain", [2]), tx, batches)
        assert jax.tree.leaves(final[0]["params"])[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(out["inject"], out["plain"], rtol=2e-2)


def test_spectrain_version_must_be_the_int_1_or_2():
    # version=2.0 / True named the policy "predict-v2.0": it silently ran naive async.
    for bad in (2.0, True):
        with pytest.raises(ValueError, match="must be the int 1 or 2"):
            make_schedule("spectrain", 2, 4, version=bad)
    with pytest.raises(ValueError, match="tasks_per_tick=True"):
        make_schedule("pipedream", 2, 4, tasks_per_tick=True)   # ran as 1 task per tick
    with pytest.raises(ValueError, match="whole numbers"):
        make_schedule("pipedream", 2, 2.5)      # ran as 2 microbatches


def test_a_schedule_of_unknown_weights_is_refused():
    # A user's Schedule with a misspelt policy ran as naive async; one with a split
    # backward ran its W halves on the live weights.
    with pytest.raises(ValueError, match=r"weights='stashed' must be one of"):
        dataclasses.replace(make_schedule("1f1b", 2, 4), weights="stashed").validate()
    with pytest.raises(ValueError, match="one stage per device and whole backwards"):
        dataclasses.replace(make_schedule("zb-h1", 2, 4), weights="stash").validate()


def test_wrong_options_name_what_the_schedule_takes():
    with pytest.raises(ValueError, match=r"'pipedream-1t' is 'pipedream' with tasks_per_tick=1"):
        make_schedule("pipedream-1t", 4, 8, tasks_per_tick=2)
    with pytest.raises(ValueError, match=r"\['window'\] \(it takes tasks_per_tick\)"):
        make_schedule("pipedream", 4, 8, window=2)
    with pytest.raises(ValueError, match="unknown schedule 'spectrain_v1'"):
        make_schedule("spectrain_v1", 2, 4)
    # 2bw: two buffers need a window of at least stage 0's staleness 2(S-1), not 2S-1.
    assert make_schedule("2bw", 4, 24, window=6).name == "2bw"
    with pytest.raises(ValueError, match="window of at least 6 .* divides M=24"):
        make_schedule("2bw", 4, 24, window=4)


LAYERS = [Norm(), NoParams(), Out()]


def test_remat_is_refused_where_it_would_change_the_algorithm():
    # remat recomputes the forward in the backward with the backward's weights: for
    # async / spectrain v1 not the activations the forward saw (silently other numbers).
    x = np.ones((4, W), np.float32)
    for schedule in ("async", "spectrain-v1"):
        pipe = _pipe(LAYERS, 1, 2, 2, schedule, [2], remat="full")
        pipe.init(jax.random.key(0), x)
        with pytest.raises(ValueError, match="use remat='none', or a schedule whose"):
            pipe.train_step(mse, optax.sgd(0.1))
    pipe = _pipe(LAYERS, 1, 2, 2, "pipedream", [2], remat=[False, True, False])
    pipe.init(jax.random.key(0), x)
    pipe.train_step(mse, optax.sgd(0.1))        # stashed weights: remat changes nothing
    # nothing stale (the last stage; one microbatch per call): the weights are the same
    for M, remat in ((2, ["none", "full"]), (1, "full")):
        pipe = _pipe(LAYERS, 1, 2, M, "async", [2], remat=remat)
        pipe.init(jax.random.key(0), x)
        pipe.train_step(mse, optax.sgd(0.1))


def test_optimizers_train_step_cannot_run_are_refused():
    with pytest.raises(ValueError, match="call pipe.init"):
        _pipe(LAYERS, 1, 2, 2, "async", [2]).init_optimizer(optax.sgd(0.1), None)
    pipe = _pipe(LAYERS, 1, 2, 2, "spectrain", [2])
    pipe.init(jax.random.key(0), np.ones((4, W), np.float32))
    with pytest.raises(ValueError, match="optax.GradientTransformation"):
        pipe.train_step(mse, None)
    with pytest.raises(ValueError, match="needs extra arguments .*value_and_grad"):
        pipe.train_step(mse, optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau()))
    with pytest.raises(ValueError, match="does not act per element"):
        pipe.train_step(mse, optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)))
    # The usual "no decay on biases" mask saw packed rows and decayed nothing, silently.
    by_rank = optax.adamw(1e-2, weight_decay=0.5,
                          mask=lambda p: jax.tree.map(lambda a: a.ndim > 1, p))
    with pytest.raises(ValueError, match=r"acts by the parameters' shapes .*pipe.unpack\(grads\)"):
        pipe.train_step(mse, by_rank)
    pipe.train_step(mse, optax.adamw(1e-2, weight_decay=0.5))      # no mask: per element
    with pytest.raises(ValueError, match="zero=1 shards a synchronous"):
        jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=2, pipe=2), num_microbatches=2,
                    schedule="2bw", zero=1)


def test_an_optimizer_state_of_another_split_is_refused():
    # Was "add got incompatible shapes" (same depth) or a shard_map error (other depth).
    x, t, tx = np.ones((4, W), np.float32), np.ones((4, W), np.float32), optax.sgd(0.1)
    layers = [Norm(), Out(), Norm()]    # packed lengths 54 and 68 per device
    a, b = (_pipe(layers, 1, 2, 2, "spectrain", cut) for cut in ([1], [2]))
    va, vb = a.init(jax.random.key(0), x), b.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="made for another split or mesh"):
        b.train_step(mse, tx)(vb, a.init_optimizer(tx, va), x, t)


class Tanh(nn.Module):
    """Dense + tanh; `recompute`: the tanh under jax.checkpoint (of values, not weights)."""
    recompute: bool = False
    features: int = 4

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(self.features)(x)
        return jax.checkpoint(jnp.tanh)(y) if self.recompute else jnp.tanh(y)


@pytest.mark.parametrize("schedule", ["async", "spectrain-v1"])
def test_a_layers_own_remat_of_its_weights_is_refused_where_the_backward_has_others(schedule):
    # The backward replaces stashed parameter arrays by its own (newer) weights, and a
    # layer's nn.remat recomputed its forward from them: parameters 2.7e-2 off after three
    # steps, silently. A checkpoint of values (the tanh of the forward's y) stays right.
    sched = (make_schedule("spectrain", 4, 4, version=1) if schedule == "spectrain-v1"
             else schedule)
    x = jnp.asarray(np.random.RandomState(0).randn(16, 4), jnp.float32)
    y = jnp.asarray(np.random.RandomState(1).randn(16, 4), jnp.float32)
    mse = lambda o, t: jnp.mean((o - t) ** 2)
    tx = optax.sgd(0.1, momentum=0.9)

    def run(layers):
        pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=4), num_microbatches=4,
                           schedule=sched, boundaries=[1, 2, 3], remat="none")
        v = pipe.init(jax.random.key(0), x)
        v = pipe.pack(plain_pipe_vars)          # the same weights in every run
        opt, step, losses = pipe.init_optimizer(tx, v), pipe.train_step(mse, tx), []
        for _ in range(3):
            loss, _, v, opt = step(v, opt, x, y)
            losses.append(float(loss))
        return losses, pipe.unpack(v)

    plain = [Tanh() for _ in range(4)]
    base = jp.Pipeline(plain, mesh=jh.make_mesh(data=1, pipe=4), num_microbatches=4,
                       schedule=sched, boundaries=[1, 2, 3], remat="none")
    plain_pipe_vars = base.unpack(base.init(jax.random.key(0), x))
    want, want_vars = run(plain)
    got, got_vars = run([Tanh(recompute=True) for _ in range(4)])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got_vars), jax.tree.leaves(want_vars)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="stage 0 recomputes its forward itself.*pipedream"):
        run([nn.remat(Tanh)() for _ in range(4)])


def test_a_budget_that_needs_recomputation_is_refused_at_planning_for_async():
    # remat="auto" planned recomputation on stale stages, then train_step refused it
    # ("use remat='none'"), though the user had not asked for remat.
    layers = [Tanh(features=8) for _ in range(5)] + [nn.Dense(3)]
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=4), num_microbatches=4,
                       schedule="async", boundaries=[1, 3, 5], remat="auto",
                       memory_budget="33KB")
    with pytest.raises(ValueError, match=r"memory_budget='33KB' needs recomputation .* "
                                         r"schedule 'async' cannot use"):
        pipe.init(jax.random.key(0), np.ones((128, 8), np.float32))
