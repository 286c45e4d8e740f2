"""How jaxhybrid calls one layer: the convention shared by the pipeline and the profiler.

A layer is any `flax.linen.Module`. Its `__call__(self, x)` takes the previous layer's
output (any pytree) and returns the next activation (any pytree). If `__call__` accepts a
keyword `train`, it gets `train=True` while training and `train=False` otherwise
(BatchNorm: `use_running_average=not train`; Dropout: `deterministic=not train`);
`training` and `is_training` are taken alike, and `deterministic` and
`use_running_average` get `not train` (`MODE_FLAGS`, the first one `__call__` accepts:
flax's own `nn.Dropout` and `nn.BatchNorm` can be layers as they are).

Collections other than "params" (e.g. "batch_stats") are *state*: mutable while training,
frozen in evaluation. Dropout draws from the "dropout" rng, which is derived per
microbatch and per layer with `layer_rng`, so every layer of every microbatch gets its own
reproducible stream however the layers are split into stages. Any other stream a layer
draws from (a VAE's `make_rng("noise")`) gets a key derived from that one (`call_rngs`,
`with_streams`).
"""
from __future__ import annotations

import functools
import inspect
import re
import zlib
from typing import Any, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


# The mode flags a layer's (or a split model's) `__call__` may take, looked for in this
# order: name -> its value while training. Haiku- and Keras-style code names it
# `training` / `is_training`; a model taking those trained with dropout off and its
# batch statistics frozen when only `train` was looked for. flax's `nn.BatchNorm` as a
# layer of its own takes `use_running_average` (without it, flax refused the call).
MODE_FLAGS = {"train": True, "training": True, "is_training": True, "deterministic": False,
              "use_running_average": False}


@functools.lru_cache(maxsize=None)
def _mode_flag(cls: type) -> str | None:
    try:
        params = inspect.signature(cls.__call__).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in MODE_FLAGS if name in params), None)


def mode_flag(model) -> str | None:
    """The MODE_FLAGS keyword `model.__call__` accepts (the first), or None."""
    return _mode_flag(type(model))


def mode_kwargs(model, train: bool) -> dict:
    """The keyword that puts `model` (a layer, or a whole linen / NNX model) in training
    (`train`) or evaluation mode; {} when its `__call__` takes no mode flag, or when the
    model fixed it as an attribute (flax's `nn.BatchNorm(use_running_average=False)`
    refuses it "passed to the constructor and at call time")."""
    flag = mode_flag(model)
    # A linen field of that name set to a value (an NNX model's `train` is its method).
    fixed = (isinstance(model, nn.Module) and flag in getattr(model, "__dataclass_fields__", {})
             and getattr(model, flag) is not None)
    if flag is None or fixed:
        return {}
    return {flag: train if MODE_FLAGS[flag] else not train}


def raw_key(key: jax.Array) -> jax.Array:
    """A typed PRNG key as its raw uint32 data (raw keys pack into flat buffers and can be
    stashed between pipeline ticks; typed keys cannot)."""
    dtype, shape = getattr(key, "dtype", None), np.shape(key)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and shape == ():
        impl, default = str(jax.random.key_impl(key)), jax.config.jax_default_prng_impl
        if impl != default:
            # Its data were folded as a default key: JAX's "invalid PRNG key data".
            raise ValueError(f"rng is a {impl!r} key, but the pipeline derives its layers' "
                             f"keys with the default implementation {default!r}: pass "
                             f"jax.random.key(seed), or set jax.config.update("
                             f"'jax_default_prng_impl', {impl!r}) first.")
        return jax.random.key_data(key)
    if dtype == np.uint32 and len(shape) == 1:
        return key
    # Anything else (an int seed, a batch of keys) failed when the step was lowered, with
    # "Cannot lower jaxpr with verifier errors".
    raise ValueError(f"rng must be one PRNG key, jax.random.key(seed) or "
                     f"jax.random.PRNGKey(seed), got an array of dtype {dtype} "
                     f"and shape {shape}; for a seed pass jax.random.key(seed).")


def layer_rng(key: jax.Array, microbatch: jax.Array | int, layer_index: int) -> jax.Array:
    """The dropout key (raw uint32 data) of one layer on one (global) microbatch."""
    return jax.random.fold_in(jax.random.fold_in(raw_key(key), microbatch), layer_index)


def call_rngs(key: jax.Array | None, streams: Sequence[str] = ()) -> dict:
    """The rngs of one layer's call on one microbatch from its key (`layer_rng`): "dropout"
    is the key itself, every other stream in `streams` ("noise", "sample", ...) the key
    folded with a number made from its name, so each stream is its own (flax's lifted
    transforms split or broadcast it as `split_rngs` says for that name). No key
    (evaluation without rng=): no streams, so a layer that draws is refused, naming the
    fix."""
    if key is None:
        return {}
    return {"dropout": key, **{s: jax.random.fold_in(key, zlib.crc32(s.encode()) & 0x7FFFFFFF)
                               for s in streams if s != "dropout"}}


# Per model or layer (by identity: a linen module hashes by its attributes, and one
# holding a dict cannot), (the module, the rng streams other than "dropout" it was seen
# to draw from).
_STREAMS: dict = {}


def declare_rng_streams(module, *streams: str):
    """Supplies `module` (a layer, or a model the splitter cuts) the rng `streams` on
    every call with a key, beside those it is found to draw from: a stream it only looks
    for (`if self.has_rng("droppath"): ...`) is never asked for, so `with_streams` cannot
    find it, and the gated draw never ran. Returns `module`."""
    for s in streams:
        if not isinstance(s, str) or not s:
            raise ValueError(f"declare_rng_streams: stream names are non-empty strings "
                             f"(e.g. 'noise'), got {s!r}.")
    seen = _STREAMS.get(id(module))
    known = seen[1] if seen is not None and seen[0] is module else ()
    _STREAMS[id(module)] = (module, tuple(dict.fromkeys((*known, *streams))))
    return module


def with_streams(module, key: jax.Array | None, call):
    """`call(rngs)` with `call_rngs(key, streams)`, the streams `module` draws from: a
    stream it asks for and was not given (flax's InvalidRngError, which names it) is added
    and the call traced again, and remembered for the module's next calls. A stream the
    module only looks for (`self.has_rng("noise")`) is never asked for: it is given only
    when declared (`declare_rng_streams`)."""
    seen = _STREAMS.get(id(module))
    streams = seen[1] if seen is not None and seen[0] is module else ()
    while True:
        try:
            return call(call_rngs(key, streams))
        except flax.errors.InvalidRngError as e:
            missing = re.search(r'needs PRNG for "([^"]+)"', str(e))
            if key is None or missing is None or missing.group(1) in ("dropout", *streams):
                raise
            streams = (*streams, missing.group(1))
            _STREAMS[id(module)] = (module, streams)


def init_layer(layer: nn.Module, key: jax.Array, x: PyTree, *, train: bool = True,
               boxed: bool = False):
    """Initialises one layer; returns (unboxed variables, output on `x`); `boxed`: the
    variables as `init` returns them (logical-axis boxes kept)."""
    params_key, dropout_key = jax.random.split(key)
    kwargs = mode_kwargs(layer, train)
    out, variables = layer.init_with_output(
        {"params": params_key, "dropout": dropout_key}, x, **kwargs)
    return (dict(variables) if boxed else nn.meta.unbox(dict(variables))), out


def apply_layer(layer: nn.Module, variables: dict, x: PyTree, *, train: bool,
                rng: jax.Array | None = None):
    """Runs one layer. Returns (output, new state) where new state holds the
    non-"params" collections (updated when training, unchanged otherwise)."""
    kwargs = mode_kwargs(layer, train)
    state = {k: v for k, v in variables.items() if k != "params"}
    if train and state:   # rng: also in evaluation (a VAE samples)
        y, new_state = with_streams(layer, rng, lambda rngs: layer.apply(
            variables, x, rngs=rngs, mutable=list(state), **kwargs))
        return y, nn.meta.unbox(dict(new_state))
    y = with_streams(layer, rng, lambda rngs: layer.apply(variables, x, rngs=rngs, **kwargs))
    return y, state


def check_loss_fn(loss_fn, who: str) -> None:
    """A loss the step can call as loss_fn(outputs, targets), refused before any tracing:
    a name (e.g. "mse") or a one-argument function failed deep inside the step's trace."""
    if not callable(loss_fn):
        raise TypeError(f"{who}: loss_fn must be a function loss_fn(outputs, targets) -> "
                        f"scalar, got {type(loss_fn).__name__} {loss_fn!r}.")
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):          # a builtin or C function: nothing to check
        return
    try:
        signature.bind(None, None)
    except TypeError as e:
        raise TypeError(f"{who}: loss_fn{signature} cannot be called as loss_fn(outputs, "
                        f"targets) ({e}); wrap it, e.g. lambda outputs, targets: ...") from None


class LossError(ValueError):
    """A loss that cannot give the step what it needs (a tuple, an integer, a per-example
    loss, fewer scores than the dataset's classes), said in one line naming the fix."""


def loss_dtype():
    """The dtype losses are summed and seeded in: jax's default float (float64 under
    jax_enable_x64, else float32). Fixed at float32, an x64 model's loss came back
    truncated, and its gradients ~3e-8 off wherever 1 / (data x M) is not a power of two."""
    return jax.dtypes.canonicalize_dtype(jnp.float64)


def scalar_loss(loss_fn, outputs: PyTree, targets: PyTree, who: str, what: str) -> jax.Array:
    """loss_fn(outputs, targets) as a scalar of `loss_dtype()`. A loss that is not one (an
    unreduced per-example loss, a (loss, aux) tuple) is refused while the step is traced, naming
    `what` it must be: else it surfaced as a cond / switch type error or a shape error
    deep inside the step."""
    raw = loss_fn(outputs, targets)
    if isinstance(raw, (tuple, list, dict)):
        # jax.value_and_grad(has_aux=True)'s habit: (loss, {"acc": ...}) failed inside
        # jnp.asarray 18 frames deep, and (loss, 1.0) was called "shape (2,)".
        raise LossError(f"{who}: loss_fn returned a {type(raw).__name__}; it must return "
                         f"a scalar, the loss alone ({what}): compute auxiliary values "
                         f"(accuracy, ...) outside, e.g. from pipe.apply.")
    dtype = getattr(raw, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
        # jax.grad refuses an integer output; cast to float32 here it had zero gradients.
        raise LossError(f"{who}: loss_fn returned dtype {dtype}; it must return a float "
                         f"scalar ({what}): an integer loss has no gradient, so drop the "
                         f"cast to an integer or bool.")
    loss = jnp.asarray(raw, loss_dtype())
    if loss.shape != ():
        raise LossError(f"{who}: loss_fn returned shape {loss.shape}; it must return a scalar "
                         f"({what}): reduce it, e.g. jnp.mean(...), and compute auxiliary "
                         f"values outside.")
    return loss
