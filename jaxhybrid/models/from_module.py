"""A model given as ONE Flax module by import path (config `model.module`), trained
without registering it: the pipeline's splitter cuts it into stages (docs/splitter.md).

    c.model.module = "my_package.models:make_resnet"   # factory(**c.model.kwargs) -> Module
    c.model.kwargs = dict(num_classes=10)
    c.model.loss = "classification"   # or "token", or "my_package.losses:loss_fn"
    c.data.name = "digits"            # required: the dataset feeds the module as it is

`module(name, size, **overrides)` offers the four built-in models the same way
(`c.model.module = "jaxhybrid.models:module"`, `c.model.kwargs = dict(name="gpt",
size="small", tied=True)`).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.models.spec import (ModelSpec, TokenLoss, TokenMetrics, classification_loss,
                                   classification_metrics)
from jaxhybrid.checks import hashable
from jaxhybrid.layers import LossError, check_loss_fn
from jaxhybrid.splitter.trace import is_flax_module
from jaxhybrid.weighted_loss import WeightedMean, nonzero

# Built-in losses by name: (loss_fn, metrics_fn) from the dataset's info (pad_id).
LOSSES = {
    "classification": lambda info: (
        WeightedEnoughScores(classification_loss, info.get("num_classes"), "classes"),
        classification_metrics),
    "token": lambda info: (
        WeightedEnoughScores(TokenLoss(info.get("pad_id")), info.get("vocab_size"), "tokens"),
        TokenMetrics(info.get("pad_id"))),
}
# The loss a dataset's task takes when model.loss is not set.
TASK_LOSSES = {"classification": "classification", "language_model": "token",
               "translation": "token"}


def import_object(path: str, what: str) -> Any:
    """"package.module:name" (name may be dotted) -> the object; ValueError naming `what`."""
    module_name, sep, attr = str(path).partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what}={path!r} must be an import path 'package.module:name'.")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what}={path!r}: cannot import {module_name!r} ({e}); put its "
                         f"package on PYTHONPATH or install it.") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}={path!r}: {module_name!r} has no attribute {attr!r}.")
        obj = getattr(obj, part)
    return obj


@dataclasses.dataclass(frozen=True)
class EnoughScores:
    """A built-in loss that first checks the model scores as many classes (or tokens) as
    the dataset has: with fewer, labels past them gave a NaN loss at step 1, blamed on
    the learning rate ("the run diverged")."""
    loss_fn: Callable
    count: int | None
    what: str

    def __call__(self, outputs, targets):
        self._check(outputs)
        return self.loss_fn(outputs, targets)

    def _check(self, outputs):
        if self.count and outputs.shape[-1] < self.count:
            raise LossError(f"the model scores {outputs.shape[-1]} {self.what} but the "
                            f"dataset has {self.count}; set the model's output size (e.g. "
                            f"in model.kwargs) to {self.count}.")


class WeightedEnoughScores(EnoughScores, WeightedMean):
    """EnoughScores of a WeightedMean (the classification and token losses), itself one:
    the step weighs the whole batch's labelled examples or tokens alike."""

    __call__ = WeightedMean.__call__   # total / weight, as a step trains it (total checks)

    def total(self, outputs, targets):
        self._check(outputs)
        return self.loss_fn.total(outputs, targets)

    def weight(self, targets):
        return self.loss_fn.weight(targets)


@dataclasses.dataclass(frozen=True, eq=False)
class LossOnlyMetrics:
    """Metrics of a user loss: {"loss"} (equal losses hash equal, an unhashable one by
    identity: evaluation's jit takes it as a static argument). A
    `WeightedMean` is weighed by its weight, so eval_loss is its mean over the whole
    set as train_loss is over the batch (each row weighed 1, a masked token loss's
    eval_loss was the mean of the rows' token means: 3.84 where the loss said 1.71)."""
    loss_fn: Callable

    def __hash__(self) -> int:
        return hash(hashable(self.loss_fn))

    def __eq__(self, other) -> bool:
        return (type(other) is type(self)
                and hashable(self.loss_fn) == hashable(other.loss_fn))

    def __call__(self, outputs, targets):
        if isinstance(self.loss_fn, WeightedMean):
            weight = jnp.asarray(self.loss_fn.weight(targets), jnp.float32)
            total = self.loss_fn.total(outputs, targets)
            return {"loss": total / nonzero(weight), "count": weight}
        return {"loss": self.loss_fn(outputs, targets)}


def losses(loss: str | None, task: str, info: dict) -> tuple[Callable, Callable]:
    """(loss_fn, metrics_fn) for config model.loss: a name in LOSSES, an import path of a
    loss_fn(outputs, targets) -> scalar, or None (the dataset task's usual loss)."""
    loss = TASK_LOSSES[task] if loss is None else loss
    if loss in LOSSES:
        return LOSSES[loss](info)
    if ":" not in loss:
        raise ValueError(f"model.loss={loss!r} is unknown; use one of {tuple(LOSSES)} or an "
                         f"import path 'package.module:loss_fn'.")
    fn = import_object(loss, "model.loss")
    if not callable(fn):
        raise ValueError(f"model.loss={loss!r} is not callable; name a loss_fn(outputs, "
                         f"targets) -> scalar.")
    try:   # its signature now, not in the first step's trace after planning
        check_loss_fn(fn, f"model.loss={loss!r}")
    except TypeError as e:
        raise ValueError(str(e)) from None
    return fn, LossOnlyMetrics(fn)


def build(path: str, kwargs: dict, loss: str | None, task: str, info: dict,
          example: tuple) -> ModelSpec:
    """ModelSpec of the module `factory(**kwargs)` named by `path`, trained on a dataset of
    `task` (its `info`; `example`: one (inputs, targets) row of it)."""
    factory = import_object(path, "model.module")
    if is_flax_module(factory):
        if kwargs:   # they changed nothing, silently (config.json recorded them)
            raise ValueError(f"model.module={path!r} names a module instance, which "
                             f"model.kwargs={kwargs} cannot change; name its class or a "
                             f"factory function, or drop model.kwargs.")
        model = factory                      # a module instance named directly
    else:
        try:
            model = factory(**kwargs)
        except TypeError as e:
            raise ValueError(f"model.module={path!r}: calling it with model.kwargs={kwargs} "
                             f"failed ({e}); fix model.kwargs.") from None
    if not is_flax_module(model):
        raise ValueError(f"model.module={path!r} gave a {type(model).__name__}, not a "
                         f"flax.linen.Module or flax.nnx.Module; name a factory that "
                         f"returns the model.")
    loss_fn, metrics_fn = losses(loss, task, info)

    def sample_batch(batch_size: int, seed: int = 0):
        del seed   # the dataset's first example, repeated (exact shapes and dtypes)
        return jax.tree.map(lambda a: np.repeat(np.asarray(a)[:1], batch_size, axis=0),
                            tuple(example))

    return ModelSpec(name=path, size="", config=dict(kwargs), layers=[model],
                     loss_fn=loss_fn, metrics_fn=metrics_fn, task=task,
                     sample_batch=sample_batch, module=model)
