"""A small heterogeneous model for pipeline tests: Dense, Conv, LayerNorm, BatchNorm,
dropout, and dict / tuple activations that carry an integer array beside floats."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class ConvIn(nn.Module):
    """image -> {"img": features, "ids": int tokens carried along}"""
    @nn.compact
    def __call__(self, x, train: bool = False):
        img, ids = x
        y = nn.Conv(6, (3, 3))(img)
        y = nn.BatchNorm(use_running_average=not train, momentum=0.9)(y)
        return {"img": nn.relu(y), "ids": ids}


class ConvBlock(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = nn.Conv(self.features, (3, 3), strides=2)(x["img"])
        y = nn.BatchNorm(use_running_average=not train, momentum=0.8)(y)
        return {"img": nn.gelu(y), "ids": x["ids"]}


class Flatten(nn.Module):
    """dict -> tuple(features, token embedding sum)"""
    @nn.compact
    def __call__(self, x):
        emb = nn.Embed(11, 7)(x["ids"]).sum(axis=1)
        return (x["img"].reshape(x["img"].shape[0], -1), emb)


class Mix(nn.Module):
    features: int
    rate: float = 0.2

    @nn.compact
    def __call__(self, x, train: bool = False):
        h, e = x
        h = nn.Dense(self.features)(jnp.concatenate([h, e], -1) if h.shape[-1] != self.features else h + e.sum(-1, keepdims=True))
        h = nn.LayerNorm()(h)
        h = nn.Dropout(self.rate, deterministic=not train)(nn.tanh(h))
        return (h, e)


class Head(nn.Module):
    classes: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.classes)(x[0])


def make_layers(num_mix: int = 4):
    return [ConvIn(), ConvBlock(8), Flatten(), *[Mix(24) for _ in range(num_mix)], Head(5)]


@functools.lru_cache(maxsize=None)
def initial_per_layer() -> list:
    """Per-layer variables of `make_layers()` from key 0 (one set shared by the tests)."""
    import jaxhybrid as jh
    from jaxhybrid import pipeline as jp
    pipe = jp.Pipeline(make_layers(), mesh=jh.make_mesh(data=1, pipe=1))
    return pipe.unpack(pipe.init(jax.random.key(0), make_batch(2)[0]))


def loss_fn(logits, labels):
    logp = logits - jnp.log(jnp.sum(jnp.exp(logits - logits.max(-1, keepdims=True)), -1,
                                    keepdims=True)) - logits.max(-1, keepdims=True)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def make_batch(batch: int, seed: int = 0):
    r = np.random.RandomState(seed)
    img = r.randn(batch, 8, 8, 3).astype(np.float32)
    ids = r.randint(0, 11, size=(batch, 4)).astype(np.int32)
    labels = r.randint(0, 5, size=(batch,)).astype(np.int32)
    return (img, ids), labels
