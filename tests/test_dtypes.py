"""Numeric types through the pipeline, against the plain model on one device (a probe
of dtypes and precision, 2026-11-27): narrow integer and float16 state averaged over
data replicas, float64 models under jax_enable_x64, a Python number among a layer's
outputs, optimizer slots kept in another dtype than their parameters across a
checkpoint, and an optimizer whose state changes dtype in its update."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from jaxhybrid.checkpoint import Checkpointer
from test_splitter import _close, mse


class Counter(nn.Module):
    """A state leaf of a narrow dtype that every data replica sets to the same value."""
    dtype: str
    value: float

    @nn.compact
    def __call__(self, x):
        c = self.variable("stats", "v", lambda: jnp.zeros((), self.dtype))
        if not self.is_initializing():
            c.value = jnp.asarray(self.value, self.dtype)
        return jnp.tanh(nn.Dense(4)(x))


@pytest.mark.parametrize("dtype,value", [("uint8", 150), ("int8", 110), ("float16", 40000.0)])
def test_state_of_a_narrow_dtype_is_averaged_over_data_without_overflow(dtype, value):
    # Summed in its own dtype before dividing: uint8 150 came back 22, int8 110 -18 and
    # float16 40000 inf, silently.
    layers = [Counter(dtype, value), Counter(dtype, value)]
    x, t = jnp.ones((8, 4)), jnp.zeros((8, 4))
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=2, pipe=2), num_microbatches=2,
                       boundaries=[1])
    variables = pipe.init(jax.random.key(0), x)
    _, _, new = pipe.value_and_grad(mse)(variables, x, t)
    for layer in pipe.unpack(new):
        assert layer["stats"]["v"].dtype == jnp.dtype(dtype)
        assert float(layer["stats"]["v"]) == value


class Dense64(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(4, dtype=jnp.float64, param_dtype=jnp.float64)(x))


@pytest.mark.parametrize("data,M", [(1, 3), (2, 3)])
def test_a_float64_model_keeps_float64_losses_and_gradients(data, M):
    # The loss was cast to float32: it came back float32, and every gradient was 3e-8
    # off where 1 / (data x M) is not a power of two.
    with jax.enable_x64(True):
        layers = [Dense64() for _ in range(4)]
        x = jax.random.normal(jax.random.key(0), (6 * data, 4), jnp.float64)
        t = jax.random.normal(jax.random.key(1), (6 * data, 4), jnp.float64)
        per = [l.init(jax.random.key(i), x) for i, l in enumerate(layers)]

        def total(params):
            h = x
            for layer, p in zip(layers, params):
                h = layer.apply({"params": p}, h)
            return mse(h, t)
        want_loss, want = jax.value_and_grad(total)([v["params"] for v in per])
        pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=data, pipe=2), num_microbatches=M,
                           boundaries=[2])
        pipe.init(jax.random.key(0), x)
        packed = pipe.pack(per)
        loss, grads, _ = pipe.value_and_grad(mse)(packed, x, t)
        assert loss.dtype == jnp.float64
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-13)
        got = [v["params"] for v in pipe.unpack({**packed, "params": grads})]
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert a.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-15)


class WithTemperature(nn.Module):
    @nn.compact
    def __call__(self, x):
        return {"h": nn.Dense(4)(x), "temperature": 2.0}   # a Python number


class Scaled(nn.Module):
    @nn.compact
    def __call__(self, s):
        return nn.Dense(4)(s["h"]) * s["temperature"]


def test_a_python_number_among_a_layers_outputs_crosses_a_cut():
    # "'float' object has no attribute 'dtype'" when the step was traced.
    layers, x, t = [WithTemperature(), Scaled()], jnp.ones((4, 4)), jnp.zeros((4, 4))
    v0 = layers[0].init(jax.random.key(0), x)
    v1 = layers[1].init(jax.random.key(1), layers[0].apply(v0, x))
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2,
                       boundaries=[1], schedule="zb-h1")
    pipe.init(jax.random.key(0), x)
    packed = pipe.pack([v0, v1])
    loss, grads, _ = pipe.value_and_grad(mse)(packed, x, t)
    want_loss, want, _ = jp.reference_value_and_grad(layers, [v0, v1], mse, x, t,
                                                     num_microbatches=2)
    _close(loss, want_loss, "loss")
    _close([v["params"] for v in pipe.unpack({**packed, "params": grads})], want, "gradients")


@pytest.mark.parametrize("how", [dict(), dict(boundaries=[1], remat="auto", memory_budget="1GB")])
def test_the_planner_profiles_a_layer_whose_outputs_hold_a_python_number(how):
    # The planner's profile read .dtype of every output leaf: the default (planned cuts)
    # and remat="auto" failed in init with "'float' object has no attribute 'dtype'".
    layers, x = [WithTemperature(), Scaled()], jnp.ones((4, 4))
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2, **how)
    packed = pipe.init(jax.random.key(0), x)
    assert pipe.plan.boundaries == [1]
    loss, _, _ = pipe.value_and_grad(mse)(packed, x, jnp.zeros((4, 4)))
    want_loss, _, _ = jp.reference_value_and_grad(layers, pipe.unpack(packed), mse, x,
                                                  jnp.zeros((4, 4)), num_microbatches=2)
    _close(loss, want_loss, "loss")


class DenseOf(nn.Module):
    param_dtype: str

    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(4, param_dtype=self.param_dtype)(x)).astype(jnp.float32)


@pytest.mark.parametrize("param_dtype,mu_dtype", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_a_checkpoint_keeps_optimizer_slots_in_their_own_dtype(tmp_path, param_dtype, mu_dtype):
    # Packed like the parameters: a bf16 mu came back float32 (the next step failed in a
    # cond), a float32 mu beside bf16 parameters was rounded to bf16.
    layers = [DenseOf(param_dtype) for _ in range(4)]
    x = jax.random.normal(jax.random.key(0), (8, 4))
    t = jax.random.normal(jax.random.key(1), (8, 4))
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=2, pipe=2), num_microbatches=2,
                       boundaries=[2])
    variables = pipe.init(jax.random.key(2), x)
    tx = optax.adam(1e-2, mu_dtype=mu_dtype)
    step = pipe.train_step(mse, tx)
    _, _, variables, opt = step(variables, pipe.init_optimizer(tx, variables), x, t)
    checkpointer = Checkpointer(str(tmp_path), keep=1)
    state = {"variables": variables, "opt_state": opt}
    checkpointer.save(1, pipe, state, {"rng": [0, 0], "data_position": 1})
    checkpointer.wait()
    restored, _ = checkpointer.restore(pipe, state)
    for a, b in zip(jax.tree.leaves(restored["opt_state"]), jax.tree.leaves(opt)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))
    step(restored["variables"], restored["opt_state"], x, t)   # it steps on


class IntegerParam(nn.Module):
    @nn.compact
    def __call__(self, x):
        order = self.param("order", lambda key: jnp.arange(4)[::-1].astype(jnp.int32))
        return jnp.tanh(nn.Dense(4)(x))[:, order]


def test_an_optimizer_whose_state_changes_dtype_is_refused_by_name():
    # adam's moments of an integer parameter: zeros_like (int32), then floats; the step
    # failed with "cond branches must have equal output types".
    layers, x = [IntegerParam(), IntegerParam()], jnp.ones((4, 4))
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=2), boundaries=[1])
    pipe.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"changes its state's dtypes \(int32 -> float32\)"):
        pipe.train_step(mse, optax.adam(1e-3))


def test_optimizer_state_of_another_dtype_is_refused_by_name():
    layers, x = [DenseOf("float32"), DenseOf("float32")], jnp.ones((4, 4))
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=2), boundaries=[1])
    variables, tx = pipe.init(jax.random.key(0), x), optax.adam(1e-3)
    cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a,
                        pipe.init_optimizer(tx, variables))
    with pytest.raises(ValueError, match=r"slot of dtype bfloat16 where this optimizer keeps "
                                         r"float32"):
        pipe.train_step(mse, tx)(variables, cast, x, x)


class Keep(nn.Module):
    """Scores and a bool mask of the rows to keep."""
    @nn.compact
    def __call__(self, x):
        s = nn.Dense(4)(x)
        return s, s.max(-1) > 0


@pytest.mark.parametrize("pipe_size", [1, 2])
def test_apply_returns_bool_outputs_as_bool(pipe_size):
    # The outputs' psum over "pipe" made a bool mask int32: `x[keep]` then gathered rows 0
    # and 1 instead of masking, and `~keep` gave -1 / -2.
    layers = [DenseOf("float32"), Keep()]
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=pipe_size), num_microbatches=2,
                       boundaries=[1] if pipe_size == 2 else [], remat="none")
    x = jnp.asarray(np.random.RandomState(1).randn(8, 3), jnp.float32)
    v = pipe.init(jax.random.key(0), x)
    scores, keep = pipe.apply(v, x)
    h = x
    for layer, var in zip(layers, pipe.unpack(v)):
        h = layer.apply(var, h)
    assert keep.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(h[1]))
    np.testing.assert_allclose(np.asarray(scores), np.asarray(h[0]), rtol=1e-5, atol=1e-6)
