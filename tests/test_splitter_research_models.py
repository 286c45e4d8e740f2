"""Researchers' models that once failed to split: pieces with the same operations wired
to different outputs (a ViT with a padding mask: one piece's cost record, reused for
another, indexed outputs it did not have), and a value crossing a cut after
`stop_gradient` into a `while_loop`, or out of a `while_loop` into `stop_gradient`
(reverse-mode differentiation of the loop failed)."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhybrid as jh
import jaxhybrid.pipeline as jp


class EncoderBlock(nn.Module):
    d: int

    @nn.compact
    def __call__(self, h, mask):
        a = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=self.d)(
            nn.LayerNorm()(h), nn.LayerNorm()(h), mask=mask)
        h = h + a
        return h + nn.Dense(self.d)(nn.gelu(nn.Dense(2 * self.d)(nn.LayerNorm()(h))))


class MaskedViT(nn.Module):
    d: int = 16

    @nn.compact
    def __call__(self, inputs):
        img, keep = inputs                  # [B, H, W, C], [B, patches] bool
        p = nn.Conv(self.d, (4, 4), strides=4)(img)
        b = p.shape[0]
        p = p.reshape(b, -1, self.d)
        cls = self.param("cls", nn.initializers.normal(0.02), (1, 1, self.d))
        h = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.d)), p], 1)
        h = h + self.param("pos", nn.initializers.normal(0.02), (1, h.shape[1], self.d))
        keep = jnp.concatenate([jnp.ones((b, 1), bool), keep], 1)
        mask = nn.make_attention_mask(keep, keep)
        for _ in range(3):
            h = EncoderBlock(self.d)(h, mask)
        return nn.Dense(5)(nn.LayerNorm()(h[:, 0]))


class PowerIteration(nn.Module):
    """A while_loop over stop_gradient'ed values scales a later layer."""
    @nn.compact
    def __call__(self, x):
        z = nn.Dense(8)(x)
        u = jax.lax.stop_gradient(self.param("u", nn.initializers.orthogonal(), (8, 8)))
        _, z2 = jax.lax.while_loop(lambda c: c[0] < 4,
                                   lambda c: (c[0] + 1, 0.5 * c[1] + jnp.sin(c[1] @ u)),
                                   (0, jax.lax.stop_gradient(z)))
        z = nn.Dense(8)(z) * (1 + jnp.tanh(z2)) + z
        return nn.Dense(3)(nn.relu(nn.Dense(8)(z)))


class LoopBody(nn.Module):
    @nn.compact
    def __call__(self, c):
        i, h = c
        return i + 1, jnp.tanh(nn.Dense(8, name="loopdense")(h))


class StoppedLoop(nn.Module):
    """A while_loop reading parameters whose result is used only under stop_gradient."""
    def setup(self):
        self.d0, self.body, self.d1 = nn.Dense(8), LoopBody(), nn.Dense(4)

    def __call__(self, x):
        h = self.d0(x)
        if self.is_initializing():
            self.body((0, h))
        _, looped = nn.while_loop(lambda m, c: c[0] < 3, lambda m, c: m.body(c), self,
                                  (jnp.int32(0), h))
        return self.d1(h + jax.lax.stop_gradient(looped))


def xent(logits, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], -1))


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def _check(pipe, model, native, inputs, targets, loss_fn):
    pipe.init(jax.random.key(1), inputs)
    variables = pipe.pack(native)
    loss, grads, _ = pipe.value_and_grad(loss_fn)(variables, inputs, targets)
    ref_loss, ref_grads = jax.value_and_grad(
        lambda p: loss_fn(model.apply({"params": p}, inputs), targets))(native["params"])
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    got = pipe.unpack({**variables, "params": grads})["params"]
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(r).max())))


def test_a_masked_vit_with_two_rows_per_microbatch_is_planned_and_exact():
    img = jax.random.normal(jax.random.key(0), (8, 8, 8, 3))
    keep = jax.random.bernoulli(jax.random.key(2), 0.7, (8, 4))
    y = jax.random.randint(jax.random.key(1), (8,), 0, 5)
    model = MaskedViT()
    native = model.init(jax.random.key(5), (img, keep))
    pipe = jp.Pipeline(model, mesh=jh.make_mesh(data=2, pipe=2), num_microbatches=2,
                       remat="none")
    _check(pipe, model, native, (img, keep), y, xent)


@pytest.mark.parametrize("boundaries", [None, [3]])
def test_a_stop_gradient_value_crossing_a_cut_into_a_while_loop(boundaries):
    x = jax.random.normal(jax.random.key(0), (8, 4))
    t = jax.random.normal(jax.random.key(1), (8, 3))
    model = PowerIteration()
    native = model.init(jax.random.key(5), x)
    pipe = jp.Pipeline(model, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2,
                       boundaries=boundaries, sample_inputs=x if boundaries else None,
                       remat="none")
    _check(pipe, model, native, x, t, mse)


def test_every_cut_of_a_while_loop_used_only_under_stop_gradient():
    x = jax.random.normal(jax.random.key(0), (8, 6))
    t = jax.random.normal(jax.random.key(1), (8, 4))
    model = StoppedLoop()
    native = model.init(jax.random.key(5), x)
    split = jp.Pipeline(model, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2,
                        sample_inputs=x).splitter.split
    for boundaries in [None] + [[k] for k in range(1, split.num_pieces)]:
        pipe = jp.Pipeline(model, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2,
                           boundaries=boundaries, sample_inputs=x, remat="none")
        _check(pipe, model, native, x, t, mse)
