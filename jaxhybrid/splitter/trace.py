"""Models as pure functions of their variable leaves: linen and NNX adapters, and the trace.

An adapter flattens the model's own variable tree (what `model.init` returns for linen,
`nnx.state(model)` for NNX) into leaves, says each leaf's collection ("params",
"batch_stats", ...) and name, and gives
    forward(var_leaves, x, key, train) -> (y, new values of the state leaves)
with the model called as `model(x, **call_kwargs)`, `train=` set when `__call__` takes it
(or `training=` / `is_training=`, else `deterministic=not train`: `layers.MODE_FLAGS`),
linen and NNX alike, and for NNX the
attributes `deterministic` / `use_running_average` set too. The
rngs of a linen model are `layers.call_rngs(key, streams)` (`key` raw uint32 key data:
"dropout", and every other stream it draws from, `layers.with_streams`, from a key folded
from it). NNX rng streams (RngKey /
RngCount variables) are not trained: while split they are re-seeded per microbatch, the
RngKey that is leaf j of the model's state becoming fold_in(key, j) (split to its shape
when it is stacked, as nnx.vmap'd layers' are) with its count at 0.
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxhybrid import layers

PyTree = Any


def is_nnx_module(obj) -> bool:
    """isinstance(obj, flax.nnx.Module) without importing flax.nnx: its import pulls in
    IPython (~0.5 s of every start-up of a layer-list model). An object can only be an
    NNX module once flax.nnx has been imported; so the functions below that handle an
    NNX model import it themselves."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(obj, nnx.Module)


def is_flax_module(obj) -> bool:
    """A linen or an NNX module (a whole model, not a list of layers)."""
    return isinstance(obj, nn.Module) or is_nnx_module(obj)


def _path_name(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return "/".join(p for p in parts if p != "value")


@dataclasses.dataclass
class Adapter:
    model: Any
    call_kwargs: dict
    kind: str                 # "linen" | "nnx"
    treedef: Any = None       # of the model's variable tree (array leaves)
    colls: list = None        # collection per leaf
    names: list = None        # name per leaf (path inside its collection)
    avals: list = None        # ShapeDtypeStruct per leaf
    program_vars: list = None  # leaf indices that are traced inputs (not NNX rng state)
    rng_leaves: list = None   # NNX: (leaf index, "key" | "count")
    graphdef: Any = None
    paths: list = None        # tree path per leaf
    sown: set | None = None   # linen: the collections the model sows into (found once)
    kept_modes: dict = dataclasses.field(default_factory=dict)   # NNX: `_modes_set_apart`

    # --- the variable tree ----------------------------------------------------------
    def leaves(self, tree, what: str = "variables") -> list:
        leaves, treedef = jax.tree.flatten(_unbox(tree, self.kind))
        if treedef != self.treedef:
            want = "the tree model.init returns" if self.kind == "linen" else "nnx.state(model)"
            raise ValueError(f"Splitter: {what} do not have the model's variable structure; "
                             f"pass {want} (got {treedef}, want {self.treedef}).")
        return leaves

    def tree(self, leaves: list, keep: set | None = None):
        """The model's variable tree from its leaves; keep: only those collections."""
        if keep is None or set(self.colls) <= keep:
            return jax.tree.unflatten(self.treedef, leaves)
        if self.kind == "nnx":
            from flax import nnx
            # One State of the kept Variables, classified as `colls` is: several type
            # filters would give a tuple of States, and a collection's name as a filter
            # is an nnx tag, which no Variable of a custom type carries.
            return nnx.filter_state(jax.tree.unflatten(self.treedef, leaves),
                                    lambda _, v: _nnx_collection(v) in keep)
        out: dict = {}
        for path, leaf, c in zip(self.paths, leaves, self.colls):
            if c not in keep:
                continue
            d = out
            for k in path[:-1]:
                d = d.setdefault(k.key, {})
            d[path[-1].key] = leaf
        return out

    def init_variables(self, rng, x):
        if self.kind == "nnx":
            from flax import nnx
            return nnx.state(self.model)
        with jax.threefry_partitionable(False):
            return jax.jit(self.init_fn)(rng, jax.tree.map(lambda a: jnp.asarray(a)[:1], x))

    def init_fn(self, rng, x):
        """model.init in evaluation mode with the call's keyword arguments; the keys as
        `jaxhybrid.layers.init_layer` splits them."""
        params_key, dropout_key = jax.random.split(rng)
        kw = {**self.call_kwargs, **self.mode_kwargs(False)}
        return nn.meta.unbox(dict(self.model.init({"params": params_key, "dropout": dropout_key},
                                                  x, **kw)))

    @property
    def state_leaves(self) -> list:
        """Leaf indices of the state variables whose new values `forward` returns: every
        collection but "params", less NNX rng streams (re-seeded, never trained)."""
        rng = {i for i, _ in self.rng_leaves}
        return [i for i, c in enumerate(self.colls) if c != "params" and i not in rng]

    # --- the forward ----------------------------------------------------------------
    def mode_kwargs(self, train: bool) -> dict:
        """The mode flag (`train=`, `deterministic=`, ...: `layers.MODE_FLAGS`) for a
        `__call__` that takes one (linen and NNX)."""
        return layers.mode_kwargs(self.model, train)

    def forward(self, var_leaves: list, x, key, train: bool):
        leaves = [None] * len(self.avals)
        for i, v in zip(self.program_vars, var_leaves):
            leaves[i] = v
        if self.kind == "linen":
            return layers.with_streams(self.model, key, lambda rngs: self._linen_forward(
                leaves, x, rngs, train))
        return self._nnx_forward(leaves, x, key, train)

    def _linen_forward(self, leaves, x, rngs, train):
        """`forward` of a linen model, its rngs `layers.call_rngs` of the key."""
        variables = jax.tree.unflatten(self.treedef, leaves)
        kw = {**self.call_kwargs, **self.mode_kwargs(train)}
        state_colls = sorted(set(self.colls) - {"params"})
        if train and state_colls:
            # A collection the model sows into (`self.sow`, which model.init keeps) is
            # left out of the call: sow appends to what it is given, so its new value
            # sat behind the old one and the old one came back as the "new" state. Left
            # out, the call sows afresh, as model.init did.
            sown = self._sown_collections(variables, x, rngs, state_colls, kw)
            given = {c: v for c, v in variables.items() if c not in sown}
            y, new = self.model.apply(given, x, rngs=rngs, mutable=state_colls, **kw)
            by_path = {_path_name(p): v for p, v in
                       jax.tree_util.tree_flatten_with_path(nn.meta.unbox(dict(new)))[0]}
            state = [by_path.get(_path_name(self.paths[i]), leaves[i]) for i in self.state_leaves]
            return y, state
        try:
            y = self.model.apply(variables, x, rngs=rngs, **kw)
        except flax.errors.ModifyScopeVariableError:
            # The model writes state even when evaluating (flax's counter pattern, `if
            # not self.is_initializing(): c.value += 1`): evaluated with its state
            # mutable and the writes dropped. Only then: a model may read mutability as
            # its mode (`train = self.is_mutable_collection("batch_stats")`).
            y, _ = self.model.apply(variables, x, rngs=rngs, mutable=state_colls, **kw)
        return y, [leaves[i] for i in self.state_leaves]

    def _sown_collections(self, variables, x, rngs, state_colls, kw) -> set:
        """The state collections whose tree the training call changes (sow appends);
        found once, by an abstract call."""
        if self.sown is not None:
            return self.sown
        _, new = jax.eval_shape(lambda v, x: self.model.apply(
            v, x, rngs=rngs, mutable=state_colls, **kw), variables, x)
        new = nn.meta.unbox(dict(new))
        self.sown = {c for c in state_colls if jax.tree.structure(new.get(c, {}))
                     != jax.tree.structure(nn.meta.unbox(variables.get(c, {})))}
        return self.sown

    def _nnx_forward(self, leaves, x, key, train):
        from flax import nnx
        for i, what in self.rng_leaves:
            a = self.avals[i]
            if what == "key":
                k = jax.random.wrap_key_data(jax.random.fold_in(
                    key if key is not None else jax.random.PRNGKey(0), i))
                # A stacked stream (layers made by nnx.vmap + split_rngs) gets one key per
                # layer, as the model has: the same key everywhere would give every layer
                # the same dropout mask.
                leaves[i] = jax.random.split(k, a.shape) if a.shape else k
            else:
                leaves[i] = jnp.zeros(a.shape, a.dtype)
        state = jax.tree.unflatten(self.treedef, leaves)
        m = nnx.merge(self.graphdef, state)
        m.set_attributes(deterministic=not train, use_running_average=not train,
                         raise_if_not_found=False)
        if train and self.kept_modes:
            for path, node in nnx.iter_graph(m):
                for name, value in self.kept_modes.get(tuple(path), {}).items():
                    setattr(node, name, value)
        y = m(x, **self.call_kwargs, **self.mode_kwargs(train))
        # By path, not by position: the call may add variables (`self.sow` makes
        # nnx.Intermediate ones), which shifts the positions of those after them.
        by_path = {_path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(
            nnx.state(m), is_leaf=lambda v: isinstance(v, nnx.Variable))[0]}
        # Not the rng streams' new keys and counts: as outputs they would keep the key
        # derivation alive, so evaluation (dropout off) would still ask for an rng.
        return y, [jax.tree.leaves(by_path[self.names[i]])[0] for i in self.state_leaves]


def _unbox(tree, kind):
    # FrozenDicts (older flax's init, flax.core.freeze) as the plain dicts init returns.
    return nn.meta.unbox(flax.core.unfreeze(tree)) if kind == "linen" else tree


def _nnx_collection(var) -> str:
    from flax import nnx
    if isinstance(var, nnx.Param):
        return "params"
    if isinstance(var, nnx.BatchStat):
        return "batch_stats"
    return type(var).__name__.lower()


def _read_signature(a: Adapter) -> None:
    """A clear error, before any tracing, when `a.model.__call__` needs more positional
    inputs than the one input pytree the pipeline passes, or when call_kwargs sets the
    mode flag the pipeline sets (`layers.mode_flag`)."""
    try:
        params = inspect.signature(type(a.model).__call__).parameters
    except (TypeError, ValueError):
        return
    flag = layers.mode_flag(a.model)
    if flag is not None and flag in a.call_kwargs:
        raise ValueError(f"Splitter: do not pass {flag} in call_kwargs; the pipeline "
                         f"sets it (training in value_and_grad, evaluation in apply).")
    set_by_us = {flag} - {None}
    positional = [n for n, p in list(params.items())[1:]   # after self
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [n for n in positional[1:] if params[n].default is params[n].empty
                and n not in a.call_kwargs and n not in set_by_us]
    if required:
        names = ", ".join(positional[:1] + required)
        raise ValueError(f"Splitter: {type(a.model).__name__}.__call__ takes "
                         f"{len(required) + 1} inputs ({names}) but the pipeline calls "
                         f"model(inputs, **call_kwargs) with one input pytree; wrap it in a "
                         f"module whose __call__(self, inputs) returns model(*inputs), or pass "
                         f"constant ones in call_kwargs.")


def make_adapter(model, call_kwargs: dict | None, sample_x) -> Adapter:
    call_kwargs = dict(call_kwargs or {})
    if isinstance(model, nn.Module):
        a = Adapter(model, call_kwargs, "linen")
        _read_signature(a)
        abstract = _trace_errors(lambda: jax.eval_shape(
            a.init_fn, jax.random.PRNGKey(0),
            jax.tree.map(lambda l: jax.ShapeDtypeStruct((1, *np.shape(l)[1:]), l.dtype),
                         sample_x)))
        flat, a.treedef = jax.tree_util.tree_flatten_with_path(abstract)
        a.paths = [tuple(p) for p, _ in flat]
        a.colls = [_path_name(p[:1]) for p, _ in flat]
        a.names = [_path_name(p[1:]) for p, _ in flat]
        a.avals = [jax.ShapeDtypeStruct(l.shape, l.dtype) for _, l in flat]
        a.program_vars, a.rng_leaves = list(range(len(flat))), []
        return a
    if is_nnx_module(model):
        from flax import nnx
        a = Adapter(model, call_kwargs, "nnx")
        _read_signature(a)
        a.graphdef, state = nnx.split(model)
        _, a.treedef = jax.tree.flatten(state)
        flat = jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
        a.colls = [_nnx_collection(v) for _, v in flat]
        a.names = [_path_name(p) for p, _ in flat]
        values = jax.tree.leaves(state)
        if len(values) != len(flat):
            raise ValueError("Splitter: an NNX variable holds a pytree, not one array; "
                             "only array variables are supported.")
        # A Variable may hold a Python number (e.g. a step counter): jax's dtype for it.
        a.avals = [jax.ShapeDtypeStruct(np.shape(v), v.dtype if hasattr(v, "dtype")
                                        else jnp.asarray(v).dtype) for v in values]
        a.rng_leaves = [(i, "key" if isinstance(v, nnx.RngKey) else "count")
                        for i, (_, v) in enumerate(flat) if isinstance(v, (nnx.RngKey, nnx.RngCount))]
        rng_idx = {i for i, _ in a.rng_leaves}
        a.program_vars = [i for i in range(len(flat)) if i not in rng_idx]
        a.paths = [tuple(p) for p, _ in flat]
        a.kept_modes = _modes_set_apart(model)
        return a
    raise ValueError(f"Splitter: expected a flax.linen.Module or flax.nnx.Module, got "
                     f"{type(model).__name__}.")


_NNX_MODES = ("deterministic", "use_running_average")


def _modes_set_apart(model) -> dict:
    """{module path: its mode attributes} of an NNX model's modules that were handed over
    in evaluation mode beside others in training mode (a BatchNorm frozen at
    construction, a backbone after `model.backbone.eval()`): training keeps them so, as
    plain NNX would (they were switched to training, silently: the frozen statistics
    moved, every gradient was off). A model all in one mode is put in the step's."""
    from flax import nnx
    modes = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            attrs = {a: getattr(node, a) for a in _NNX_MODES
                     if isinstance(getattr(node, a, None), bool)}
            if attrs:
                modes[tuple(path)] = attrs
    apart = {p: a for p, a in modes.items() if all(a.values())}
    if apart and len(apart) < len(modes):
        logging.info("splitter: keeping the evaluation mode of %s in training (set apart "
                     "from the rest of the model)", ", ".join("/".join(map(str, p)) or "<model>"
                                                               for p in apart))
        return apart
    return {}


def _trace_errors(thunk):
    """Runs a trace of the model; names the fix for the usual ways a trace fails."""
    try:
        return thunk()
    except (jax.errors.TracerBoolConversionError, jax.errors.ConcretizationTypeError,
            jax.errors.TracerIntegerConversionError) as e:
        raise ValueError(f"Splitter: the model uses Python control flow on a traced value "
                         f"({type(e).__name__}: {str(e).splitlines()[0]}); use jnp.where / "
                         f"jax.lax.cond, or pass the deciding value as a constant in "
                         f"call_kwargs.") from e
    except NameError as e:
        if "unbound axis name" not in str(e):
            raise
        raise ValueError(f"Splitter: the model uses a collective over a named axis "
                         f"({str(e).splitlines()[0]}), e.g. BatchNorm(axis_name=...) for a "
                         f"pmap trainer; build it with axis_name=None (the pipeline runs "
                         f"each microbatch as its own batch, as the model does unmapped).") from e
    except ValueError as e:
        # nnx.Dropout (or a module like it) left to take its rngs at call time: the
        # pipeline calls model(x), so flax said only that none were given.
        if "no `rngs` argument was provided" not in str(e):
            raise
        raise ValueError("Splitter: an NNX module takes its rngs at call time (e.g. "
                         "nnx.Dropout(rate)(x, rngs=rngs)), and the pipeline calls model(x) "
                         "with none; give it rngs= when you build it (nnx.Dropout(rate, "
                         "rngs=rngs)) or keep an nnx.Rngs on the model and pass "
                         "rngs=self.rngs.") from e


def trace(adapter: Adapter, x_abstract, train: bool):
    """make_jaxpr of forward(var leaves, x, key) -> (y, state); returns (closed jaxpr,
    y treedef)."""
    var_avals = [adapter.avals[i] for i in adapter.program_vars]
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    box = {}

    def f(var_leaves, x, key):
        y, state = adapter.forward(var_leaves, x, key, train)
        leaves, box["y_tree"] = jax.tree.flatten(y)
        return leaves, state

    closed = _trace_errors(lambda: jax.make_jaxpr(f)(var_avals, x_abstract, key))
    return closed, box["y_tree"]
