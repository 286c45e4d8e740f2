"""The benchmarks' stand-in model: residual Dense blocks and a classifier head, as
separate pipeline layers (identical blocks, so stage splits are easy to reason about)."""
import flax.linen as nn
import jax
import jax.numpy as jnp


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(self.width)(x)) + x


class Head(nn.Module):
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.classes)(x)


def xent(logits, labels):
    """Mean softmax cross-entropy of integer labels."""
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))
