"""Inception-V3 (Szegedy et al. 2016) as a flat list of layers.

Architecture and parameter layout follow torchvision's `inception_v3` (conv without
bias -> BatchNorm(eps=1e-3, with scale and bias) -> ReLU), so at width 1.0, 299x299 and
1000 classes the trainable parameter count matches torchvision's 23,834,568 without the
auxiliary head. Layers: 5 stem convolutions (max-pools folded into the conv before
them), Mixed_5b .. Mixed_7c one layer each, optional auxiliary head after Mixed_6e,
and global-average-pool + dropout + classifier as the last layer.

`width` scales every convolution's channel count; the smallest input that reaches a
1x1 grid after Mixed_7a is 75x75 (the auxiliary head needs >= 139).

With `aux_head=True` the activation between Mixed_6e and the classifier is
{"x": features, "aux": aux_logits} and the model outputs {"logits", "aux_logits"};
the loss adds 0.4 x the auxiliary cross-entropy (torchvision's training recipe).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxhybrid.models.spec import image_sample_batch
from jaxhybrid.weighted_loss import WeightedMean
from jaxhybrid.models.spec import (ModelSpec, check_overrides, classification_loss,
                                   classification_metrics, dense_init, logical, normal_init,
                                   ones_init,
                                   zeros_init)

SIZES = {
    "tiny": dict(width=0.125, image_size=75, num_classes=10),
    "small": dict(width=0.25, image_size=75, num_classes=10),
    "full": dict(width=1.0, image_size=299, num_classes=1000),
}
DEFAULTS = dict(width=1.0, image_size=299, num_classes=1000, aux_head=False,
                dropout_rate=0.5, aux_weight=0.4, bn_momentum=0.9, dtype="float32")
MIN_IMAGE_SIZE, MIN_AUX_IMAGE_SIZE = 75, 139


def _split(x):
    """Features and the riders (aux logits) that travel beside them."""
    return (x["x"], x) if isinstance(x, dict) else (x, None)


def _join(y, riders):
    return y if riders is None else {**riders, "x": y}


class ConvBN(nn.Module):
    """conv (no bias) -> BatchNorm -> ReLU: torchvision's BasicConv2d."""
    features: int
    kernel: tuple[int, int] = (1, 1)
    strides: int = 1
    padding: Any = "VALID"
    bn_momentum: float = 0.9
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(self.features, self.kernel, strides=self.strides, padding=self.padding,
                    use_bias=False, dtype=self.dtype,
                    kernel_init=logical(nn.initializers.truncated_normal(0.1), "conv_height",
                                        "conv_width", "conv_in", "conv_out"))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=self.bn_momentum,
                         epsilon=1e-3, dtype=self.dtype, scale_init=ones_init("conv_out"),
                         bias_init=zeros_init("conv_out"))(x)
        return nn.relu(x)


class _Block(nn.Module):
    """Base of Inception layers: `c(n)` is channel count n scaled by the width."""
    width: float = 1.0
    bn_momentum: float = 0.9
    dtype: Any = jnp.float32

    def c(self, n: int) -> int:
        return max(1, int(round(n * self.width)))

    def conv(self, n, kernel=(1, 1), strides=1, padding="VALID", name=None):
        return ConvBN(self.c(n), kernel, strides, padding, self.bn_momentum, self.dtype,
                      name=name)


def _avg3(x):
    return nn.avg_pool(x, (3, 3), strides=(1, 1), padding=((1, 1), (1, 1)))


def _max3s2(x):
    return nn.max_pool(x, (3, 3), strides=(2, 2))


class StemConv(_Block):
    """One stem convolution, optionally preceded by the stem's 3x3/2 max-pool."""
    features: int = 32
    kernel: tuple[int, int] = (3, 3)
    strides: int = 1
    padding: Any = "VALID"
    pool_before: bool = False

    @nn.compact
    def __call__(self, x, train: bool = False):
        if self.pool_before:
            x = _max3s2(x)
        return self.conv(self.features, self.kernel, self.strides, self.padding)(x, train)


class InceptionA(_Block):            # Mixed_5b/c/d, 35x35 grid at 299
    pool_features: int = 32

    @nn.compact
    def __call__(self, x, train: bool = False):
        b1 = self.conv(64)(x, train)
        b5 = self.conv(64, (5, 5), padding=2)(self.conv(48)(x, train), train)
        b3 = self.conv(96, (3, 3), padding=1)(self.conv(64)(x, train), train)
        b3 = self.conv(96, (3, 3), padding=1)(b3, train)
        bp = self.conv(self.pool_features)(_avg3(x), train)
        return jnp.concatenate([b1, b5, b3, bp], -1)


class InceptionB(_Block):            # Mixed_6a: 35 -> 17
    @nn.compact
    def __call__(self, x, train: bool = False):
        b3 = self.conv(384, (3, 3), strides=2)(x, train)
        bd = self.conv(96, (3, 3), padding=1)(self.conv(64)(x, train), train)
        bd = self.conv(96, (3, 3), strides=2)(bd, train)
        return jnp.concatenate([b3, bd, _max3s2(x)], -1)


class InceptionC(_Block):            # Mixed_6b..6e, factorised 7x7
    channels_7x7: int = 128

    @nn.compact
    def __call__(self, x, train: bool = False):
        c7, row, col = self.channels_7x7, (1, 7), (7, 1)
        p_row, p_col = ((0, 0), (3, 3)), ((3, 3), (0, 0))
        b1 = self.conv(192)(x, train)
        b7 = self.conv(c7)(x, train)
        b7 = self.conv(c7, row, padding=p_row)(b7, train)
        b7 = self.conv(192, col, padding=p_col)(b7, train)
        bd = self.conv(c7)(x, train)
        for n, (k, p) in zip((c7, c7, c7, 192), ((col, p_col), (row, p_row)) * 2):
            bd = self.conv(n, k, padding=p)(bd, train)
        bp = self.conv(192)(_avg3(x), train)
        return jnp.concatenate([b1, b7, bd, bp], -1)


class InceptionD(_Block):            # Mixed_7a: 17 -> 8
    @nn.compact
    def __call__(self, x, train: bool = False):
        b3 = self.conv(320, (3, 3), strides=2)(self.conv(192)(x, train), train)
        b7 = self.conv(192)(x, train)
        b7 = self.conv(192, (1, 7), padding=((0, 0), (3, 3)))(b7, train)
        b7 = self.conv(192, (7, 1), padding=((3, 3), (0, 0)))(b7, train)
        b7 = self.conv(192, (3, 3), strides=2)(b7, train)
        return jnp.concatenate([b3, b7, _max3s2(x)], -1)


class InceptionE(_Block):            # Mixed_7b/c, expanded filter bank
    @nn.compact
    def __call__(self, x, train: bool = False):
        row, col, p_row, p_col = (1, 3), (3, 1), ((0, 0), (1, 1)), ((1, 1), (0, 0))
        b1 = self.conv(320)(x, train)
        b3 = self.conv(384)(x, train)
        b3 = jnp.concatenate([self.conv(384, row, padding=p_row)(b3, train),
                              self.conv(384, col, padding=p_col)(b3, train)], -1)
        bd = self.conv(384, (3, 3), padding=1)(self.conv(448)(x, train), train)
        bd = jnp.concatenate([self.conv(384, row, padding=p_row)(bd, train),
                              self.conv(384, col, padding=p_col)(bd, train)], -1)
        bp = self.conv(192)(_avg3(x), train)
        return jnp.concatenate([b1, b3, bd, bp], -1)


class Mixed(nn.Module):
    """One Inception block as a pipeline layer (passes aux logits through)."""
    block: nn.Module

    @nn.compact
    def __call__(self, x, train: bool = False):
        x, riders = _split(x)
        return _join(self.block(x, train), riders)


class AuxHead(_Block):
    """Auxiliary classifier on the 17x17 grid: x -> {"x": x, "aux": logits}."""
    num_classes: int = 1000

    @nn.compact
    def __call__(self, x, train: bool = False):
        a = nn.avg_pool(x, (5, 5), strides=(3, 3))
        a = self.conv(128)(a, train)
        a = self.conv(768, (5, 5))(a, train)      # scaled by the width like every conv
        a = jnp.mean(a, axis=(1, 2))
        logits = nn.Dense(self.num_classes, dtype=self.dtype,
                          kernel_init=normal_init(0.001, "embed", "classes"),
                          bias_init=zeros_init("classes"))(a)
        return {"x": x, "aux": logits.astype(jnp.float32)}


class Classifier(nn.Module):
    """Global average pool -> dropout -> fully connected."""
    num_classes: int
    dropout_rate: float = 0.5
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        x, riders = _split(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        logits = nn.Dense(self.num_classes, dtype=self.dtype,
                          kernel_init=dense_init("embed", "classes"),
                          bias_init=zeros_init("classes"))(x).astype(jnp.float32)
        if riders is None:
            return logits
        return {"logits": logits, "aux_logits": riders["aux"]}


def make_layers(cfg: dict) -> list[nn.Module]:
    common = dict(width=cfg["width"], bn_momentum=cfg["bn_momentum"],
                  dtype=jnp.dtype(cfg["dtype"]))
    stem = [StemConv(features=32, strides=2, **common),                    # Conv2d_1a_3x3
            StemConv(features=32, **common),                               # Conv2d_2a_3x3
            StemConv(features=64, padding=1, **common),                    # Conv2d_2b_3x3
            StemConv(features=80, kernel=(1, 1), pool_before=True, **common),  # Conv2d_3b_1x1
            StemConv(features=192, **common)]                              # Conv2d_4a_3x3
    blocks = [InceptionA(pool_features=32, **common), InceptionA(pool_features=64, **common),
              InceptionA(pool_features=64, **common), InceptionB(**common),
              *[InceptionC(channels_7x7=c, **common) for c in (128, 160, 160, 192)],
              InceptionD(**common), InceptionE(**common), InceptionE(**common)]
    # The stem's second max-pool runs at the start of Mixed_5b.
    layers = stem + [PoolThen(block=blocks[0])] + [Mixed(block=b) for b in blocks[1:]]
    if cfg["aux_head"]:
        layers.insert(len(stem) + 8, AuxHead(num_classes=cfg["num_classes"], **common))
    layers.append(Classifier(cfg["num_classes"], cfg["dropout_rate"], common["dtype"]))
    return layers


class PoolThen(nn.Module):
    """Mixed_5b preceded by the stem's last 3x3/2 max-pool."""
    block: nn.Module

    @nn.compact
    def __call__(self, x, train: bool = False):
        return self.block(_max3s2(x), train)


@dataclasses.dataclass(frozen=True)
class _Loss(WeightedMean):
    """Cross-entropy of the logits plus `aux_weight` x that of the auxiliary head's, per
    labelled example of the whole batch (a WeightedMean, as `classification_loss`)."""
    aux_weight: float

    def total(self, outputs, labels):
        if isinstance(outputs, dict):
            return (classification_loss.total(outputs["logits"], labels)
                    + self.aux_weight * classification_loss.total(outputs["aux_logits"], labels))
        return classification_loss.total(outputs, labels)

    def weight(self, labels):
        return classification_loss.weight(labels)


def _metrics(outputs, labels):
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs
    return classification_metrics(logits, labels)


def build(size: str, **overrides) -> ModelSpec:
    cfg = check_overrides("inception_v3", DEFAULTS, {**SIZES[size], **overrides})
    if cfg["image_size"] < MIN_IMAGE_SIZE:
        raise ValueError(f"inception_v3: image_size={cfg['image_size']} is below the "
                         f"smallest valid input {MIN_IMAGE_SIZE}.")
    if cfg["aux_head"] and cfg["image_size"] < MIN_AUX_IMAGE_SIZE:
        raise ValueError(f"inception_v3: aux_head needs image_size >= {MIN_AUX_IMAGE_SIZE}, "
                         f"got {cfg['image_size']}.")
    return ModelSpec(name="inception_v3", size=size, config=cfg, layers=make_layers(cfg),
                     loss_fn=_Loss(cfg["aux_weight"]), metrics_fn=_metrics,
                     task="classification",
                     sample_batch=functools.partial(image_sample_batch, cfg))
