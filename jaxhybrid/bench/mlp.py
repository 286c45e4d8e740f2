"""The benchmarks' stand-in models: Dense blocks (residual relu, or plain Dense+tanh as a
new user would stack them) and a classifier head, as separate pipeline layers (identical
blocks, so stage splits are easy to reason about)."""
import flax.linen as nn
import jax
import jax.numpy as jnp


ACTIVATIONS = {"relu": nn.relu, "tanh": jnp.tanh}


class Block(nn.Module):
    width: int
    activation: str = "relu"
    residual: bool = True

    @nn.compact
    def __call__(self, x):
        y = ACTIVATIONS[self.activation](nn.Dense(self.width)(x))
        return y + x if self.residual else y


class Head(nn.Module):
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.classes)(x)


def xent(logits, labels):
    """Mean softmax cross-entropy of integer labels."""
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))
