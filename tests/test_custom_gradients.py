"""Custom gradients and gradients through the pipeline, against jax.grad of the plain
model on one device (a fifth probe, 2026-11-27): backward rules not linear in their
cotangent under data parallelism, callbacks inside backward rules under the split
(zero-bubble) backward, and jax.grad through `pipe.apply` of a model with tied weights."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from test_model_features import D, _batch, _microbatch_reference, _split_step_matches
from test_splitter import _close, mse

CLIP = 1e-3


@jax.custom_vjp
def clip_gradient(x):
    """Identity forward; the backward clips the cotangent (rlax's clip_gradient)."""
    return x


clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -CLIP, CLIP),))


class ClippedBackward(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jp.stage_boundary(jnp.tanh(clip_gradient(nn.Dense(D)(x))))
        return nn.Dense(D)(h)


@pytest.mark.parametrize("data,pipe,schedule", [(2, 2, "1f1b"), (2, 2, "zb-h1"),
                                                (4, 1, "1f1b")])
def test_a_backward_rule_sees_jax_grads_cotangent_under_data_parallelism(data, pipe, schedule):
    # Seeded with 1/M and averaged over "data" after, each replica's backward saw `data`
    # times jax.grad's cotangent: this clipping rule gave gradients 0.5x (data 2) and
    # 0.23x (data 4) the reference, silently; the loss was exact.
    model, (x, t) = ClippedBackward(), _batch()
    variables = model.init(jax.random.key(2), x)
    _split_step_matches(model, variables, x, t, mesh=jh.make_mesh(data=data, pipe=pipe),
                        schedule=schedule)


def test_train_step_with_zero_sees_the_global_mean_gradient():
    model, (x, t) = ClippedBackward(), _batch()
    variables = model.init(jax.random.key(2), x)
    pipe = jp.Pipeline(model, mesh=jh.make_mesh(data=2, pipe=2), num_microbatches=2, zero=1)
    pipe.init(jax.random.key(1), x)
    packed, tx = pipe.pack(variables), optax.sgd(1.0)
    _, _, new, _ = pipe.train_step(mse, tx)(packed, pipe.init_optimizer(tx, packed), x, t)
    _, want = _microbatch_reference(model, variables, x, t, 4)
    step = jax.tree.map(lambda a, b: a - b, variables["params"], pipe.unpack(new)["params"])
    _close(step, want, "sgd(1.0) step against jax.grad")


CALLS = []


@jax.custom_vjp
def log_gradient(x):
    return x


def _log_backward(_, g):
    jax.debug.callback(lambda g: CALLS.append(float(np.linalg.norm(g))), g)
    return (g,)


log_gradient.defvjp(lambda x: (x, None), _log_backward)


class Logged(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(log_gradient(nn.Dense(D)(x)))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv"])
def test_a_callback_in_a_backward_rule_runs_once_per_microbatch(schedule):
    # The split backward (B and W halves) kept only the equations the gradients need:
    # a gradient hook fired 0 times under zb-h1 and zbv (8 under 1f1b), silently.
    x, t = _batch()
    layers = [Logged() for _ in range(4)]
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=4,
                       schedule=schedule, boundaries=[1, 2, 3] if schedule == "zbv" else [2])
    variables = pipe.init(jax.random.key(0), x)
    CALLS.clear()
    jax.block_until_ready(pipe.value_and_grad(mse)(variables, x, t))
    jax.effects_barrier()
    assert len(CALLS) == 4 * len(layers)


class Tied(nn.Module):
    """One Dense at both ends: its kernel is held by the first and the last stage."""
    @nn.compact
    def __call__(self, x):
        shared = nn.Dense(D, name="shared")
        h = jp.stage_boundary(jnp.tanh(shared(x)))
        return shared(h)


def test_jax_grad_through_apply_sums_the_copies_of_a_tied_variable():
    # Each copy got its own part: pipe.unpack showed one part (0.71 off jax.grad), and a
    # step with that gradient left the copies apart (apply then differed from the model).
    model, (x, t) = Tied(), _batch()
    variables = model.init(jax.random.key(2), x)
    pipe = jp.Pipeline(model, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2)
    pipe.init(jax.random.key(1), x)
    packed = pipe.pack(variables)
    loss = lambda p: mse(pipe.apply({**packed, "params": p}, x), t)
    grads = jax.grad(loss)(packed["params"])
    want = jax.grad(lambda p: mse(model.apply({"params": p}, x), t))(variables["params"])
    _close(pipe.unpack({**packed, "params": grads})["params"], want, "grad through apply")
    stepped = {**packed, "params": jax.tree.map(lambda p, g: p - 0.5 * g, packed["params"], grads)}
    _close(pipe.apply(stepped, x), model.apply(pipe.unpack(stepped), x), "apply after a step")
