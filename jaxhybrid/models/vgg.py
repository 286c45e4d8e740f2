"""VGG-16 (Simonyan & Zisserman 2015, configuration D) as a flat list of layers.

Layout follows torchvision's `vgg16` (no BatchNorm): thirteen 3x3 convolutions with bias
and ReLU in five blocks (64, 128, 256, 512, 512 channels), a 2x2/2 max-pool closing each
block (folded into the block's last convolution layer), then three fully connected
layers (4096, 4096, classes) with ReLU and dropout 0.5 between them. At width 1.0,
224x224 and 1000 classes the parameter count is torchvision's 138,357,544. Each
convolution is one layer, the first Dense (with the flatten) another: 16 layers.

`width` scales every convolution and the hidden Dense widths; `image_size` must be a
multiple of 32 (five halvings). torchvision's adaptive average pool to 7x7 is the identity
at 224 px; at other sizes the final grid is flattened as it is.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxhybrid.models.spec import image_sample_batch
from jaxhybrid.models.spec import (ModelSpec, check_overrides, classification_loss,
                                   classification_metrics, dense_init, logical, zeros_init)

SIZES = {
    "tiny": dict(width=0.0625, image_size=32, num_classes=10),
    "small": dict(width=0.25, image_size=64, num_classes=10),
    "full": dict(width=1.0, image_size=224, num_classes=1000),
}
DEFAULTS = dict(width=1.0, image_size=224, num_classes=1000, dropout_rate=0.5, dtype="float32")
BLOCKS = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))


def _c(n: int, width: float) -> int:
    return max(1, int(round(n * width)))


class Conv3x3(nn.Module):
    """3x3 convolution (same padding, bias) -> ReLU, then a 2x2/2 max-pool if `pool`."""
    features: int
    pool: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.features, (3, 3), padding=1, dtype=self.dtype,
                    kernel_init=logical(nn.initializers.kaiming_normal(), "conv_height",
                                        "conv_width", "conv_in", "conv_out"),
                    bias_init=zeros_init("conv_out"))(x)
        x = nn.relu(x)
        return nn.max_pool(x, (2, 2), strides=(2, 2)) if self.pool else x


class FullyConnected(nn.Module):
    """(flatten) -> Dense -> ReLU -> dropout, or the final Dense to logits (`last`)."""
    features: int
    last: bool = False
    dropout_rate: float = 0.5
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape(x.shape[0], -1)
        x = nn.Dense(self.features, dtype=self.dtype,
                     kernel_init=dense_init("embed", "mlp" if not self.last else "classes"),
                     bias_init=zeros_init("mlp" if not self.last else "classes"))(x)
        if self.last:
            return x.astype(jnp.float32)
        return nn.Dropout(self.dropout_rate, deterministic=not train)(nn.relu(x))


def make_layers(cfg: dict) -> list[nn.Module]:
    dtype, w = jnp.dtype(cfg["dtype"]), cfg["width"]
    layers: list[nn.Module] = []
    for block in BLOCKS:
        for i, n in enumerate(block):
            layers.append(Conv3x3(_c(n, w), pool=i == len(block) - 1, dtype=dtype))
    hidden = _c(4096, w)
    layers += [FullyConnected(hidden, dropout_rate=cfg["dropout_rate"], dtype=dtype),
               FullyConnected(hidden, dropout_rate=cfg["dropout_rate"], dtype=dtype),
               FullyConnected(cfg["num_classes"], last=True, dtype=dtype)]
    return layers


def build(size: str, **overrides) -> ModelSpec:
    cfg = check_overrides("vgg16", DEFAULTS, {**SIZES[size], **overrides})
    if cfg["image_size"] % 32 or cfg["image_size"] < 32:
        raise ValueError(f"vgg16: image_size={cfg['image_size']} must be a positive multiple "
                         f"of 32 (five 2x2 max-pools).")
    return ModelSpec(name="vgg16", size=size, config=cfg, layers=make_layers(cfg),
                     loss_fn=classification_loss, metrics_fn=classification_metrics,
                     task="classification", sample_batch=functools.partial(image_sample_batch, cfg))
