"""Models as flat lists of Flax layers, ready for the pipeline.

    from jaxhybrid import models
    spec = models.get_model("inception_v3", size="small", num_classes=10)
    spec.layers, spec.loss_fn, spec.metrics_fn, spec.sample_batch(8)
    models.count_params(models.get_model("gpt", size="full"))   # no allocation
    models.module("gpt", "tiny", tied=True)    # ONE flax module: the pipeline splits it

See docs/models.md for the architectures, sizes and how to add a model.
"""
from __future__ import annotations

from jaxhybrid.models import biglstm, gnmt, gpt, inception
from jaxhybrid.models.spec import (ModelSpec, Sequential, count_params, forward_flops,
                                   init_layers)

_BUILDERS = {
    "inception_v3": inception.build,
    "gnmt": gnmt.build,
    "biglstm": biglstm.build,
    "gpt": gpt.build,
}
MODEL_NAMES = tuple(_BUILDERS)
SIZES = ("tiny", "small", "full")

__all__ = ["MODEL_NAMES", "SIZES", "ModelSpec", "Sequential", "count_params",
           "forward_flops", "get_model", "init_layers", "module", "register_model",
           "registered_models"]


def get_model(name: str, size: str = "tiny", **overrides) -> ModelSpec:
    """The model `name` at preset `size` ("tiny" for tests, "small" for CPU training
    runs, "full" for the published architecture), with config `overrides` (e.g.
    num_classes=10, dtype="bfloat16"). Unknown name, size or override -> ValueError."""
    if name not in _BUILDERS:
        raise ValueError(f"get_model: unknown model {name!r}; choose one of "
                         f"{tuple(_BUILDERS)}.")
    if size not in SIZES:
        raise ValueError(f"get_model: unknown size {size!r} for {name!r}; choose one of "
                         f"{SIZES}.")
    return _BUILDERS[name](size, **overrides)


def module(name: str, size: str = "small", **overrides):
    """The model `name` as ONE Flax module, for `jp.Pipeline(model)` or a config's
    `model.module = "jaxhybrid.models:module"` (kwargs: name, size, overrides): the
    pipeline's splitter finds the stages. GPT is its own module (`gpt.GPT`, tied head
    allowed); the others compose their layers (`Sequential`), with no cut marked."""
    spec = get_model(name, size, **overrides)
    if name == "gpt":
        return gpt.GPT(spec.config)
    return Sequential(tuple(spec.layers))


def register_model(name: str, build) -> None:
    """Adds `build(size, **overrides) -> ModelSpec` to the registry under `name`
    (MODEL_NAMES stays the built-in four; `registered_models()` lists all)."""
    if name in _BUILDERS:
        raise ValueError(f"register_model: {name!r} is already registered.")
    _BUILDERS[name] = build


def registered_models() -> tuple[str, ...]:
    return tuple(_BUILDERS)


# Burst-parallelism workloads (DeepPool's): registered beside the built-in four.
from jaxhybrid.models import vgg, wrn  # noqa: E402

register_model("vgg16", vgg.build)
register_model("wrn", wrn.build)
