"""Rng streams other than "dropout": a linen layer or model that draws from its own named
streams (a VAE's `make_rng("noise")`, a second stream "sample") trains and evaluates
through the pipeline exactly as the sequential reference, with a key per microbatch and
per layer, as dropout's (`jaxhybrid.layers.call_rngs`)."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhybrid as jh
import jaxhybrid.pipeline as jp
from jaxhybrid.layers import apply_layer, call_rngs, init_layer

RNG = jax.random.key(7)


class NoisyEncoder(nn.Module):
    """Reparameterised latent: its noise from "noise", a second draw from "sample"."""
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(8)(x))
        mu, logvar = nn.Dense(6)(h), nn.Dense(6)(h)
        z = mu + jnp.exp(0.5 * logvar) * jax.random.normal(self.make_rng("noise"), mu.shape)
        return z + 0.1 * jax.random.uniform(self.make_rng("sample"), z.shape)


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, z):
        return nn.Dense(5)(jnp.tanh(nn.Dense(8)(z)))


class VAE(nn.Module):
    """One model: encoder, dropout, decoder (split by the splitter)."""
    @nn.compact
    def __call__(self, x, train: bool = False):
        z = NoisyEncoder()(x)
        z = nn.Dropout(0.2, deterministic=not train)(z)
        return Decoder()(z)


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def _batch(n, seed=0):
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.normal(size=(n, 4)), jnp.float32),
            jnp.asarray(r.normal(size=(n, 5)), jnp.float32))


def _close(a, b, what):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6,
                                   err_msg=what)


def _split_matches_reference(model, native, x, t):
    """A 2 x 2 pipeline of `model` (cut by the splitter) with `native` variables: its
    loss and gradients equal the sequential reference's. Returns (pipe, packed, loss)."""
    pipe = jp.Pipeline(model, mesh=jh.make_mesh(data=2, pipe=2), num_microbatches=2)
    pipe.init(jax.random.key(0), x)
    packed = pipe.pack(native)
    loss, grads, _ = pipe.value_and_grad(mse)(packed, x, t, RNG)
    ref_loss, ref_grads, _ = jp.reference_value_and_grad(
        [model], [native], mse, x, t, data=2, num_microbatches=2, rng=RNG)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    _close(pipe.unpack({**packed, "params": grads})["params"], ref_grads[0], "grads")
    return pipe, packed, loss


def test_named_streams_of_one_layer_get_distinct_keys_and_none_without_a_key():
    layer = NoisyEncoder()
    x = jnp.ones((3, 4))
    v, _ = init_layer(layer, jax.random.key(0), x)
    a, _ = apply_layer(layer, v, x, train=True, rng=jax.random.key_data(jax.random.key(1)))
    b, _ = apply_layer(layer, v, x, train=True, rng=jax.random.key_data(jax.random.key(2)))
    assert not np.allclose(a, b)          # the draws follow the layer's key
    assert call_rngs(None) == {}
    with pytest.raises(Exception, match="noise"):
        apply_layer(layer, v, x, train=True)   # no key: no stream is invented


@pytest.mark.parametrize("data,pipe_size,M,schedule", [(2, 2, 2, "1f1b"), (1, 4, 4, "gpipe")])
def test_layers_drawing_named_streams_match_the_reference(data, pipe_size, M, schedule):
    layers = [NoisyEncoder(), nn.Dense(8), Decoder(), nn.Dense(5)]
    x, t = _batch(data * M * 2)
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=data, pipe=pipe_size),
                       num_microbatches=M, schedule=schedule,
                       boundaries=jp.even_boundaries(len(layers), pipe_size))
    variables = pipe.init(jax.random.key(0), x)
    loss, grads, _ = pipe.value_and_grad(mse)(variables, x, t, RNG)
    per_layer = pipe.unpack(variables)
    ref_loss, ref_grads, _ = jp.reference_value_and_grad(
        layers, per_layer, mse, x, t, data=data, num_microbatches=M, rng=RNG)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    _close([g["params"] for g in pipe.unpack({**variables, "params": grads})],
           ref_grads, "grads")
    # The noise is drawn: another key, another loss.
    other = pipe.value_and_grad(mse)(variables, x, t, jax.random.key(8))[0]
    assert float(other) != float(loss)


def test_a_split_model_drawing_named_streams_matches_the_reference_and_samples_in_apply():
    model = VAE()
    x, t = _batch(16, seed=1)
    native = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x[:2])
    pipe, variables, _ = _split_matches_reference(model, native, x, t)
    # Evaluation samples too: with rng= it runs (and follows the key), without it the
    # message names the fix.
    y1 = pipe.apply(variables, x, rng=jax.random.key(1))
    y2 = pipe.apply(variables, x, rng=jax.random.key(2))
    assert y1.shape == (16, 5) and not np.allclose(y1, y2)
    with pytest.raises(ValueError, match=r"pass rng=: pipe\.apply"):
        pipe.apply(variables, x)


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        n = jax.random.normal(self.make_rng("noise"), c.shape)
        return jnp.tanh(nn.Dense(c.shape[-1])(c)) + 0.1 * n, n


class SharedWeightsFreshNoise(nn.Module):
    """Weights broadcast over the scan, noise split per iteration."""
    @nn.compact
    def __call__(self, x):
        return nn.scan(ScanBlock, variable_broadcast="params",
                       split_rngs={"params": False, "noise": True}, length=3)()(x, None)


class EnsembleSharedNoise(nn.Module):
    """Members with their own weights drawing one noise."""
    @nn.compact
    def __call__(self, x):
        return nn.vmap(ScanBlock, variable_axes={"params": 0},
                       split_rngs={"params": True, "noise": False}, in_axes=(None, None),
                       out_axes=0, axis_size=3)()(x, None)


@pytest.mark.parametrize("model,shared", [(SharedWeightsFreshNoise(), False),
                                          (EnsembleSharedNoise(), True)])
def test_a_named_stream_is_split_or_broadcast_as_its_own_split_rngs_says(model, shared):
    # Served from another stream ("params"), the noise followed that stream's setting:
    # every iteration of the first drew the same noise, the ensemble's members differed.
    x = jnp.ones((2, 4))
    v, _ = init_layer(model, jax.random.key(0), x)
    (_, noise), _ = apply_layer(model, v, x, train=True,
                                rng=jax.random.key_data(jax.random.key(3)))
    assert all(np.allclose(noise[0], n) == shared for n in noise[1:])
    # So through the pipeline (split into pieces, evaluated with rng=; one microbatch:
    # the per-member leaf comes back once per microbatch).
    pipe = jp.Pipeline(model, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=1)
    xs = jnp.ones((4, 4))
    pipe.init(jax.random.key(0), xs)
    _, noise = pipe.apply(pipe.pack(v), xs, rng=jax.random.key(3))
    assert all(np.allclose(noise[0], n) == shared for n in noise[1:])


def test_a_split_model_without_rng_is_told_to_pass_one_not_named_a_stream_it_never_draws():
    pipe = jp.Pipeline(VAE(), mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=1)
    x = _batch(2)[0]
    variables = pipe.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"pass rng=: pipe\.apply") as e:
        pipe.apply(variables, x)
    assert '"dropout"' not in str(e.value)


class DropPath(nn.Module):
    """Stochastic depth that draws only when its stream is there (`has_rng`)."""
    @nn.compact
    def __call__(self, x):
        y = jnp.tanh(nn.Dense(x.shape[-1])(x))
        if self.has_rng("droppath"):
            keep = jax.random.bernoulli(self.make_rng("droppath"), 0.5, (x.shape[0], 1))
            y = y * keep / 0.5
        return x + y


class DropPathNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(5)(DropPath()(DropPath()(nn.Dense(6)(x))))


def test_a_stream_only_looked_for_is_given_once_declared():
    """`has_rng`-gated draws never ran: the stream is never asked for, so it was never
    found. Declared (`layers.declare_rng_streams`), the layers and a split model draw it,
    as the sequential reference does, on a 2 x 2 mesh."""
    from jaxhybrid.layers import declare_rng_streams
    x, t = _batch(8, seed=2)
    layers = [nn.Dense(6), DropPath(), DropPath(), nn.Dense(5)]
    mesh = jh.make_mesh(data=2, pipe=2)
    pipe = jp.Pipeline(layers, mesh=mesh, num_microbatches=2, boundaries=[2])
    variables = pipe.init(jax.random.key(0), x)
    quiet = pipe.value_and_grad(mse)(variables, x, t, RNG)[0]
    assert float(quiet) == float(pipe.value_and_grad(mse)(variables, x, t, jax.random.key(8))[0])
    for layer in layers[1:3]:
        assert declare_rng_streams(layer, "droppath") is layer
    per_layer = pipe.unpack(variables)
    pipe = jp.Pipeline(layers, mesh=mesh, num_microbatches=2, boundaries=[2])
    variables = pipe.pack(per_layer)
    loss, grads, _ = pipe.value_and_grad(mse)(variables, x, t, RNG)
    ref_loss, ref_grads, _ = jp.reference_value_and_grad(
        layers, pipe.unpack(variables), mse, x, t, data=2, num_microbatches=2, rng=RNG)
    assert float(loss) != float(quiet)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    _close([g["params"] for g in pipe.unpack({**variables, "params": grads})], ref_grads, "grads")
    # One model through the splitter: declared on the model it is given.
    model = declare_rng_streams(DropPathNet(), "droppath")
    split, packed, loss = _split_matches_reference(model, model.init(jax.random.key(0), x[:2]),
                                                   x, t)
    assert float(loss) != float(split.value_and_grad(mse)(packed, x, t, jax.random.key(8))[0])
    with pytest.raises(ValueError, match="stream names are non-empty strings"):
        declare_rng_streams(model, "")
