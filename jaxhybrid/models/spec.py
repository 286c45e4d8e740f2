"""`ModelSpec`: a model as a flat list of Flax layers plus everything needed to train it
(loss, metrics, a sample batch), and helpers shared by the model files: parameter
initialisers with logical axis names, cross-entropy losses, parameter and FLOP counts.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.layers import apply_layer, init_layer, layer_rng, mode_kwargs
from jaxhybrid.weighted_loss import WeightedMean

PyTree = Any
TASKS = ("classification", "language_model", "translation")


# --- parameters with logical axis names --------------------------------------------
def logical(init: Callable, *names: str | None) -> Callable:
    """`init` whose parameters are boxed with logical axis `names` (one per dimension)."""
    return nn.with_logical_partitioning(init, names)


def dense_init(*names: str | None, scale: float = 1.0) -> Callable:
    """Lecun-normal kernel init (variance `scale`/fan_in) with logical names."""
    return logical(nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal"), *names)


def zeros_init(*names: str | None) -> Callable:
    return logical(nn.initializers.zeros_init(), *names)


def ones_init(*names: str | None) -> Callable:
    return logical(nn.initializers.ones_init(), *names)


def normal_init(stddev: float, *names: str | None) -> Callable:
    return logical(nn.initializers.normal(stddev), *names)


# --- losses and metrics -------------------------------------------------------------
def _masked_cross_entropy(logits, labels, mask):
    """(sum of -log p(label), number of correct argmaxes, number of counted items)."""
    logits = logits.astype(jnp.float32)
    safe = jnp.where(mask, labels, 0)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    mask = mask.astype(jnp.float32)
    correct = (jnp.argmax(logits, -1) == safe).astype(jnp.float32) * mask
    return jnp.sum(nll * mask), jnp.sum(correct), jnp.sum(mask)


def image_sample_batch(cfg, batch_size: int, seed: int = 0):
    """Random (images [b, s, s, 3] float32, labels [b] int32) for an image classifier whose
    config has image_size and num_classes (the shared `sample_batch` of the CNN models)."""
    r = np.random.RandomState(seed)
    s = cfg["image_size"]
    images = r.randn(batch_size, s, s, 3).astype(np.float32)
    labels = r.randint(0, cfg["num_classes"], size=(batch_size,)).astype(np.int32)
    return images, labels


@dataclasses.dataclass(frozen=True)
class ClassificationLoss(WeightedMean):
    """Mean cross-entropy over examples; labels < 0 mark padding and are ignored. A
    WeightedMean: the step sums it over its microbatches and divides by the batch's
    labelled examples, on any layout (a mean of per-microbatch means gave 4x too small a
    loss and gradient at data x M = 4 with the -1 labels bunched in a few microbatches)."""

    def total(self, logits, labels):
        return _masked_cross_entropy(logits, labels, labels >= 0)[0]

    def weight(self, labels):
        return jnp.sum(labels >= 0)


classification_loss = ClassificationLoss()


def classification_metrics(logits, labels):
    """{"loss", "accuracy"}: means over non-padding examples; "count": how many."""
    total, correct, count = _masked_cross_entropy(logits, labels, labels >= 0)
    n = jnp.maximum(count, 1.0)
    return {"loss": total / n, "accuracy": correct / n, "count": count}


def _token_terms(outputs, targets, pad_id):
    # Outputs are logits [B, T, V], or (sampled softmax, BigLSTM) a dict whose "labels"
    # index into its own "logits" columns; padding is always read from the real targets.
    mask = (targets != pad_id) if pad_id is not None else jnp.ones(targets.shape, bool)
    if isinstance(outputs, dict):
        return _masked_cross_entropy(outputs["logits"], outputs["labels"], mask)
    return _masked_cross_entropy(outputs, targets, mask)


@dataclasses.dataclass(frozen=True)
class TokenLoss(WeightedMean):
    """Mean cross-entropy per (non-padding) token of the whole batch: a WeightedMean, so
    a step sums it over its microbatches and divides by the batch's token count, on any
    layout (it was a mean of per-microbatch token means, which moved with data x M)."""
    pad_id: int | None

    def total(self, outputs, targets):
        return _token_terms(outputs, targets, self.pad_id)[0]

    def weight(self, targets):
        return (jnp.sum(targets != self.pad_id) if self.pad_id is not None
                else jnp.asarray(targets.size))


@dataclasses.dataclass(frozen=True)
class TokenMetrics:
    """{"loss", "token_accuracy"}: means over non-padding tokens; "count": how many."""
    pad_id: int | None

    def __call__(self, outputs, targets):
        total, correct, count = _token_terms(outputs, targets, self.pad_id)
        n = jnp.maximum(count, 1.0)
        return {"loss": total / n, "token_accuracy": correct / n, "count": count}


# --- the spec -----------------------------------------------------------------------
@dataclasses.dataclass
class ModelSpec:
    """A model as the pipeline consumes it.

    name, size: registry name and size ("tiny" | "small" | "full").
    config: the resolved hyperparameters (size preset + overrides).
    layers: flax.linen Modules applied in order; one's output pytree is the next's input.
    loss_fn(outputs, targets) -> scalar mean loss of one microbatch.
    metrics_fn(outputs, targets) -> dict of scalar means ("loss" plus "accuracy" for
      classifiers, "token_accuracy" for token models) and "count", the number of
      non-padding examples/tokens they average over (to weigh batches in evaluation).
    task: "classification" | "language_model" | "translation".
    sample_batch(batch_size, seed=0) -> (inputs, targets) numpy arrays of the right
      shapes and dtypes (random values).
    module: the model as ONE Flax module (linen or NNX) that the pipeline's splitter
      cuts into stages (config `model.module`); then `layers` is `[module]`, the
      unsplit model as a one-layer reference. None: the pipeline takes `layers`.
    """
    name: str
    size: str
    config: dict
    layers: list
    loss_fn: Callable
    metrics_fn: Callable
    task: str
    sample_batch: Callable[..., tuple]
    module: Any = None
    _flops: float | None = dataclasses.field(default=None, repr=False)

    @property
    def pipeline_model(self):
        """What `jp.Pipeline` is given: the one module (split automatically) or the layers."""
        return self.layers if self.module is None else self.module

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"ModelSpec: task {self.task!r} must be one of {TASKS}.")

    @property
    def flops_per_example(self) -> float:
        """Forward FLOPs of one example: 2 x multiply-adds of every matmul and
        convolution, counted from shapes (nothing is computed or allocated)."""
        if self._flops is None:
            self._flops = forward_flops(self.layers, self.sample_batch(2)[0]) / 2
        return self._flops

    def init(self, rng: jax.Array, inputs: PyTree) -> list[dict]:
        """Per-layer (unboxed) variables, initialised in order on `inputs`."""
        return init_layers(self.layers, rng, inputs)

    def apply(self, variables: Sequence[dict], inputs: PyTree, *, train: bool = False,
              rng: jax.Array | None = None):
        """Runs the layers in order on one device. Returns (outputs, new per-layer
        variables) — the sequential reference the pipeline must agree with."""
        return apply_layers(self.layers, variables, inputs, train=train, rng=rng)


def init_layers(layers: Sequence[nn.Module], rng: jax.Array, inputs: PyTree) -> list[dict]:
    x, out = inputs, []
    for i, layer in enumerate(layers):
        variables, x = init_layer(layer, jax.random.fold_in(rng, i), x, train=False)
        out.append(variables)
    return out


def apply_layers(layers, variables, inputs, *, train=False, rng=None):
    x, new_vars = inputs, []
    for i, (layer, v) in enumerate(zip(layers, variables)):
        key = layer_rng(rng, 0, i) if rng is not None else None
        x, state = apply_layer(layer, v, x, train=train, rng=key)
        new_vars.append({**v, **state})
    return x, new_vars


class Sequential(nn.Module):
    """The layers composed into one Module (variables under "layers_<i>"): the whole
    model, for comparing against the per-layer split."""
    layers: Sequence[nn.Module]

    @nn.compact
    def __call__(self, x, train: bool = False):
        for layer in self.layers:
            x = layer(x, **mode_kwargs(layer, train))
        return x


# --- counting without allocating ----------------------------------------------------
def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), tree)


def abstract_variables(layers: Sequence[nn.Module], inputs: PyTree) -> list[dict]:
    """Per-layer variables as ShapeDtypeStructs (jax.eval_shape: nothing allocated)."""
    return jax.eval_shape(lambda k, x: init_layers(layers, k, x), jax.random.key(0),
                          _abstract(inputs))


def count_params(spec: ModelSpec, sample_batch_size: int = 1, per_layer: bool = False):
    """Number of trainable parameters ("params" collection), from shapes only."""
    inputs = spec.sample_batch(sample_batch_size)[0]
    counts = [sum(math.prod(a.shape) for a in jax.tree.leaves(v.get("params", {})))
              for v in abstract_variables(spec.layers, inputs)]
    return counts if per_layer else sum(counts)


def _subjaxprs(params: dict):
    for value in params.values():
        for v in (value if isinstance(value, (tuple, list)) else (value,)):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield v.jaxpr


def _jaxpr_flops(jaxpr, loops_once: bool = False) -> float:
    """Matmul + convolution FLOPs of `jaxpr`: a scan's body `length` times (with
    `loops_once`, the copies XLA's cost analysis counts: its loop body holds `unroll`
    of them, and the remainder runs outside), a cond's dearest branch."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            k = math.prod(lhs[d] for d in lhs_contract)
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * k
        elif name == "conv_general_dilated":
            total += _conv_flops(eqn)
        else:
            inner = [_jaxpr_flops(j, loops_once) for j in _subjaxprs(eqn.params)]
            if name == "cond":                       # one branch runs
                total += max(inner, default=0.0)
            else:                                    # scan runs its body `length` times
                total += sum(inner) * _body_copies(eqn.params, loops_once)
    return total


def _body_copies(params: dict, loops_once: bool) -> int:
    length = params.get("length", 1)
    if not loops_once:
        return length
    unroll = params.get("unroll", 1)
    unroll = length if unroll is True else max(int(unroll), 1)
    return min(length, unroll + length % unroll)


def _conv_flops(eqn) -> float:
    """2 x the multiply-adds of a convolution whose kernel taps fall on the input: none
    for the padding, nor for the zeros `lhs_dilation` puts between input elements (a
    strided convolution's input gradient; counted, they made it ~s^d times too dear)."""
    p, dn = eqn.params, eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    out = eqn.outvars[0].aval.shape
    taps = 1
    for d, (ld, rd, od) in enumerate(zip(dn.lhs_spec[2:], dn.rhs_spec[2:], dn.out_spec[2:])):
        stride, (lo, _) = p["window_strides"][d], p["padding"][d]
        ldil = (p.get("lhs_dilation") or (1,) * len(out))[d]
        rdil = (p.get("rhs_dilation") or (1,) * len(out))[d]
        pos = (np.arange(out[od])[:, None] * stride + np.arange(rhs[rd])[None, :] * rdil - lo)
        taps *= int(np.sum((pos >= 0) & (pos <= (lhs[ld] - 1) * ldil) & (pos % ldil == 0)))
    return 2.0 * out[dn.out_spec[0]] * out[dn.out_spec[1]] * rhs[dn.rhs_spec[1]] * taps


def forward_flops(layers: Sequence[nn.Module], inputs: PyTree) -> float:
    """Matmul + convolution FLOPs of one forward pass (eval mode) over `inputs`."""
    variables = abstract_variables(layers, inputs)
    jaxpr = jax.make_jaxpr(lambda v, x: apply_layers(layers, v, x)[0])(
        variables, _abstract(inputs))
    return _jaxpr_flops(jaxpr.jaxpr)


# Options whose allowed range is not "> 0" (floats) or ">= 1" (ints with a default >= 1).
_OPTION_RANGES = {"dropout_rate": (0, 1, "the fraction of units dropped; 0 turns dropout off"),
                  "bn_momentum": (0, 1, "the running statistics' decay"),
                  "aux_weight": (0, math.inf, "the auxiliary head's loss weight")}


def _option_error(key: str, value, default) -> str | None:
    """What `value` must be for an option whose default is `default`, or None when it
    fits. Wrong types or signs failed as tracebacks from inside the model or the plan
    ('str' object cannot be interpreted as an integer; Slice size out of range)."""
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    is_num = (is_int or isinstance(value, (float, np.floating))) and math.isfinite(value)
    if default is None or key.endswith("_id"):     # a token id, or None for none
        return None if value is None or (is_int and value >= 0) else "an int >= 0 or None"
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "True or False"
    if isinstance(default, int):
        low = 1 if default >= 1 else 0
        return None if is_int and value >= low else f"an int >= {low}"
    if isinstance(default, float):
        ranged = next((r for name, r in _OPTION_RANGES.items() if key.endswith(name)), None)
        if ranged is None:                          # a width, a scale: > 0
            return None if is_num and value > 0 else "a finite number > 0"
        low, high, what = ranged
        span = f"in [{low}, {high})" if high < math.inf else f">= {low}"
        return None if is_num and low <= value < high else f"a number {span} ({what})"
    if key == "dtype":
        try:
            ok = jnp.issubdtype(jnp.dtype(value), jnp.floating)
        except TypeError:
            ok = False
        return None if ok else "a float dtype name, e.g. 'float32' or 'bfloat16'"
    return None                                    # tuples etc.: the model checks them


def check_overrides(model: str, defaults: dict, overrides: dict) -> dict:
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"{model}: unknown option(s) {unknown}; valid options: "
                         f"{sorted(defaults)}.")
    for key, value in overrides.items():
        need = _option_error(key, value, defaults[key])
        if need:
            raise ValueError(f"{model}: {key}={value!r} must be {need}.")
    return {**defaults, **overrides}
