"""Wide ResNet (Zagoruyko & Komodakis 2016) in torchvision's ImageNet form
(`wide_resnet101_2`: ResNet-101 bottlenecks whose inner 3x3 width is doubled), the WRN
DeepPool evaluates, as a flat list of layers.

Layers: the stem (7x7/2 conv -> BatchNorm -> ReLU -> 3x3/2 max-pool), one layer per
bottleneck block (1x1 -> 3x3 (stride on the 3x3, as torchvision) -> 1x1, each with
BatchNorm, projection shortcut on the first block of a stage, ReLU after the sum), and
global average pool + classifier. Stages have `blocks` blocks of 64, 128, 256, 512 base
channels (x4 out), inner width base x `widen`. At full size (blocks 3-4-23-3, widen 2,
224 px, 1000 classes) the parameter count is torchvision's 126,886,696.

`width` scales every channel count; BatchNorm statistics are the "batch_stats"
collection (eps 1e-5, momentum 0.9), updated in training.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxhybrid.models.spec import image_sample_batch
from jaxhybrid.models.spec import (ModelSpec, check_overrides, classification_loss,
                                   classification_metrics, dense_init, logical, ones_init,
                                   zeros_init)

SIZES = {
    "tiny": dict(blocks=(1, 1, 1, 1), width=0.0625, image_size=32, num_classes=10),
    "small": dict(blocks=(2, 2, 2, 2), width=0.25, image_size=64, num_classes=10),
    "full": dict(blocks=(3, 4, 23, 3), width=1.0, image_size=224, num_classes=1000),
}
DEFAULTS = dict(blocks=(3, 4, 23, 3), width=1.0, widen=2, image_size=224, num_classes=1000,
                bn_momentum=0.9, dtype="float32")
BASE = (64, 128, 256, 512)


def _c(n: int, width: float) -> int:
    return max(1, int(round(n * width)))


class ConvBN(nn.Module):
    """conv (no bias) -> BatchNorm (-> ReLU if `relu`)."""
    features: int
    kernel: int = 1
    strides: int = 1
    relu: bool = True
    bn_momentum: float = 0.9
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        k = self.kernel
        x = nn.Conv(self.features, (k, k), strides=self.strides, padding=k // 2, use_bias=False,
                    dtype=self.dtype,
                    kernel_init=logical(nn.initializers.kaiming_normal(), "conv_height",
                                        "conv_width", "conv_in", "conv_out"))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=self.bn_momentum, epsilon=1e-5,
                         dtype=self.dtype, bias_init=zeros_init("conv_out"),
                         scale_init=ones_init("conv_out"))(x)
        return nn.relu(x) if self.relu else x


class Stem(nn.Module):
    features: int
    bn_momentum: float = 0.9
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = ConvBN(self.features, 7, 2, bn_momentum=self.bn_momentum, dtype=self.dtype)(x, train)
        return nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))


class Bottleneck(nn.Module):
    inner: int
    out: int
    strides: int = 1
    project: bool = False
    bn_momentum: float = 0.9
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        kw = dict(bn_momentum=self.bn_momentum, dtype=self.dtype)
        y = ConvBN(self.inner, 1, **kw)(x, train)
        y = ConvBN(self.inner, 3, self.strides, **kw)(y, train)
        y = ConvBN(self.out, 1, relu=False, **kw)(y, train)
        if self.project:
            x = ConvBN(self.out, 1, self.strides, relu=False, **kw)(x, train)
        return nn.relu(x + y)


class Head(nn.Module):
    num_classes: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype,
                        kernel_init=dense_init("embed", "classes"),
                        bias_init=zeros_init("classes"))(x).astype(jnp.float32)


def make_layers(cfg: dict) -> list[nn.Module]:
    w, kw = cfg["width"], dict(bn_momentum=cfg["bn_momentum"], dtype=jnp.dtype(cfg["dtype"]))
    layers: list[nn.Module] = [Stem(_c(64, w), **kw)]
    for stage, (base, n) in enumerate(zip(BASE, cfg["blocks"])):
        for i in range(n):
            layers.append(Bottleneck(_c(base * cfg["widen"], w), _c(base * 4, w),
                                     strides=2 if (i == 0 and stage > 0) else 1,
                                     project=i == 0, **kw))
    layers.append(Head(cfg["num_classes"], kw["dtype"]))
    return layers


def build(size: str, **overrides) -> ModelSpec:
    cfg = check_overrides("wrn", DEFAULTS, {**SIZES[size], **overrides})
    cfg["blocks"] = tuple(int(b) for b in cfg["blocks"])
    if len(cfg["blocks"]) != 4 or min(cfg["blocks"]) < 1:
        raise ValueError(f"wrn: blocks={cfg['blocks']} must be four positive counts.")
    if cfg["image_size"] < 32:
        raise ValueError(f"wrn: image_size={cfg['image_size']} must be >= 32.")
    return ModelSpec(name="wrn", size=size, config=cfg, layers=make_layers(cfg),
                     loss_fn=classification_loss, metrics_fn=classification_metrics,
                     task="classification", sample_batch=functools.partial(image_sample_batch, cfg))
