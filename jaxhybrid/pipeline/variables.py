"""`Pipeline`'s variables: per-layer flax variables initialised in order, packed into
each device's stage buffers (`jaxhybrid.pipeline.packing`) and unpacked back, with the
shards of a "model" axis (`model_shards`). A mixin of `Pipeline` (api.py), which holds
the layout these methods read (`param_layouts`, `device_layers`, `_layer_vars`)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

from jaxhybrid import tensor_parallel
from jaxhybrid.layers import init_layer
from jaxhybrid.pipeline import degree_check, model_shards, packing
from jaxhybrid.pipeline.layouts import abstract_value
from jaxhybrid.pipeline.arguments import outside_context_mesh, same_pipeline_everywhere

PyTree = Any


class PipelineVariables:
    def init(self, rng: jax.Array, sample_inputs: PyTree) -> dict:
        """Initialises every layer (in order, on the first example of `sample_inputs`) and
        returns packed variables {collection: {buffer key: [S, length]}} sharded over "pipe"
        (buffer keys: see `jaxhybrid.pipeline.packing`)."""
        dtype = getattr(rng, "dtype", None)
        if dtype is None or not (jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
                                 or dtype == np.uint32):
            # An int seed failed inside jax ("invalid PRNG key data"), after the planner
            # had profiled every layer.
            raise ValueError(f"Pipeline.init: rng must be a PRNG key, got {rng!r:.60}; for a "
                             f"seed pass jax.random.key(seed).")
        with outside_context_mesh():
            return self._init(rng, sample_inputs)

    def _init(self, rng: jax.Array, sample_inputs: PyTree) -> dict:
        self.make_plan(sample_inputs)
        if self.splitter is not None:
            return self.pack(self.splitter.init_variables(rng, sample_inputs))
        if self.model > 1:   # which dimensions each layer's logical names split
            x = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *np.shape(a)[1:]), a.dtype),
                             sample_inputs)
            x_local = x   # what layer i gets at the model degree (split after a column-parallel one)
            for i, layer in enumerate(self.layers):
                self._record_split_dims(i, layer, x, x_local)
                init = functools.partial(init_layer, layer, train=False)
                x = jax.eval_shape(init, jax.random.fold_in(rng, i), x)[1]
                with tensor_parallel.degree(self.model):
                    x_local = tensor_parallel.eval_shape(init, jax.random.fold_in(rng, i), x_local)[1]
            shape = lambda tree: jax.tree.map(np.shape, tree)
            if shape(x) != shape(x_local):   # loss_fn got one shard's part: a wrong loss
                raise ValueError(
                    f"Pipeline: the last layer's output stays split over 'model' (per shard "
                    f"{shape(x_local)}, whole {shape(x)}); join it in the last layer, e.g. "
                    f"jaxhybrid.tensor_parallel.gather_from_model(y), so that loss_fn sees "
                    f"whole outputs.")
        return self._pack(self.init_layers(rng, sample_inputs))

    def init_layers(self, rng: jax.Array, sample_inputs: PyTree) -> list[dict]:
        """Per-layer variables, initialised in order on the first example of
        `sample_inputs` with key `fold_in(rng, i)` for layer i: what `init` packs. Needs
        no plan, so it can run while the planner profiles (`jaxhybrid.train` does);
        `pipe.pack(pipe.init_layers(rng, x))` equals `pipe.init(rng, x)`. A list of
        layers only (a split model initialises through its splitter)."""
        program, x = self._initialiser(sample_inputs)
        # Non-partitionable threefry: initialisers run unsharded here, and XLA CPU takes
        # about twice as long to compile the partitionable variant (Inception: 48 s -> 23 s).
        with jax.threefry_partitionable(False):
            return program(rng, x)

    def init_layer_shapes(self, rng: jax.Array, sample_inputs: PyTree) -> list[dict]:
        """What `init_layers` returns, as jax.ShapeDtypeStructs, from tracing alone; the
        trace is the one `init_layers` then compiles (jax keeps it), so asking first
        costs nothing extra. Lets the training step compile before the values exist."""
        program, x = self._initialiser(sample_inputs)
        with jax.threefry_partitionable(False):
            return program.trace(rng, x).out_info

    def _initialiser(self, sample_inputs):
        """(The jitted all-layers initialiser, its input: the first example)."""
        if self.splitter is not None:
            raise ValueError("Pipeline.init_layers: a split model is initialised by "
                             "pipe.init(rng, sample_inputs).")
        if self._init_program is None:
            # One program for all layers: XLA drops the forward passes that no
            # initialiser reads, and compiles once instead of once per layer (Inception:
            # 17 programs). One jitted function per pipeline, so that its traces are kept.
            self._init_program = jax.jit(functools.partial(_init_in_order, tuple(self.layers)))
        return self._init_program, jax.tree.map(lambda a: jnp.asarray(a)[:1], sample_inputs)

    def _dims(self, i: int, c: str):
        """Layer i's tree of dims split over "model" for collection c (None: none)."""
        if self.model == 1 or self._split_dims is None:
            return None
        return self._split_dims[i].get(c)

    def _model_shard(self, i: int, c: str, tree, j: int):
        return model_shards.shard(tree, self._dims(i, c), self.model, j, f"layer {i}")

    def _model_merge(self, i: int, c: str, shards: list):
        return model_shards.merge(self._dims(i, c), shards)

    def _record_split_dims(self, i: int, layer: nn.Module, x: PyTree, x_local: PyTree) -> None:
        if self._split_dims is None:
            self._split_dims = [None] * len(self.layers)
        self._split_dims[i] = {"params": {}, **model_shards.split_dims(layer, x, self.model,
                                                                        x_local)}

    def pack(self, per_layer: Sequence[dict]) -> dict:
        """Per-layer flax variable dicts -> packed, sharded stage variables. Once the
        layout is known (`init`, an earlier `pack`), the variables must match it."""
        return self._pack(per_layer, check=self._layer_vars is not None)

    def abstract_layer_vars(self, per_layer: Sequence[dict]) -> list[dict]:
        """Per layer {collection: tree of ShapeDtypeStruct} (model shard 0's shapes)."""
        return [{c: jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)),
                                 self._model_shard(i, c, tree, 0)) for c, tree in dict(v).items()}
                for i, v in enumerate(per_layer)]

    def _check_like_layout(self, abstract: list[dict]) -> None:
        """Refuses variables unlike the layout's, naming the first difference: they were
        packed into a new layout, the step then blamed the inputs, and the variables
        `init` had made no longer fitted."""
        for i, (got, want) in enumerate(zip(abstract, self._layer_vars)):
            if got == want:
                continue
            g = dict(jax.tree_util.tree_flatten_with_path(got)[0])
            w = dict(jax.tree_util.tree_flatten_with_path(want)[0])
            name = lambda path: "/".join(str(getattr(k, "key", k)) for k in path)  # noqa: E731
            show = lambda a: f"{jnp.dtype(a.dtype).name}{list(a.shape)}"  # noqa: E731
            diff = next((f"{name(p)} is {show(g[p])}, the layout's {show(w[p])}"
                         for p in w if p in g and g[p] != w[p]), None)
            diff = diff or next((f"{name(p)} is missing" for p in w if p not in g), None)
            diff = diff or next(f"{name(p)} is not in the layout" for p in g if p not in w)
            raise ValueError(f"Pipeline.pack: layer {i}'s {diff}; pass variables shaped as "
                             f"pipe.init made them (pipe.unpack(variables) shows them), or "
                             f"make a new Pipeline for other layers.")

    def _pack(self, per_layer: Sequence[dict], check: bool = False) -> dict:
        per_layer = self._checked_layer_vars(per_layer, "pack")
        abstract = self.abstract_layer_vars(per_layer)
        if check:
            self._check_like_layout(abstract)
        if abstract != self._layer_vars:   # a new layout; the same one keeps the compiled
            self._set_layer_vars(abstract)   # programs (apply recompiled after every pack)
        same_pipeline_everywhere(self, "pack")
        if self.model > 1 and not self._degree_checked and self.splitter is None:
            # Once per pipeline, on the first values: a layer that computes another
            # function on its shard would train another model silently.
            degree_check.check_layers(
                self.layers, per_layer, self._split_dims, self._sample, self.model,
                [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()])
            self._degree_checked = True
        sharding = NamedSharding(self.mesh, self.stage_spec)
        out = {}
        for c in ["params", *self.state_collections]:
            lengths = self.param_len if c == "params" else self.state_len[c]
            # One row per (pipe device, model shard), pipe-major like the "stage_spec".
            rows = [packing.pack_numpy(self.param_layouts[d][c],
                                       [self._model_shard(i, c, per_layer[i].get(c, {}), j)
                                        for i in layers], lengths)
                    for d, layers in enumerate(self.device_layers) for j in range(self.model)]
            out[c] = {k: _put(np.stack([r[k] for r in rows]), sharding) for k in lengths}
        return out

    def set_layer_shapes(self, per_layer: Sequence[dict]) -> None:
        """Lays the buffers out for per-layer variables given by shape alone (e.g.
        `init_layer_shapes`), as `pack` would for their values: the step can then be
        traced and compiled (on `abstract_variables`) before the values exist."""
        self._set_layer_vars(self.abstract_layer_vars(
            self._checked_layer_vars(per_layer, "set_layer_shapes")))

    def abstract_variables(self) -> dict:
        """What `pack` returns, as jax.ShapeDtypeStructs with the same shardings."""
        self._require_vars()
        sharding = NamedSharding(self.mesh, self.stage_spec)
        rows = self.pipe_size * self.model
        return {c: {k: jax.ShapeDtypeStruct((rows, n), packing.dtype_of(k), sharding=sharding)
                    for k, n in (self.param_len if c == "params" else self.state_len[c]).items()}
                for c in ["params", *self.state_collections]}

    def _checked_layer_vars(self, per_layer: Sequence[dict], who: str) -> list[dict]:
        """`per_layer` (the model's own tree for a split model) as unboxed per-layer
        dicts, after the checks that a layout can be made from them."""
        if self._needs_plan:
            raise ValueError(f"Pipeline.{who}: the planner has not chosen the stages yet; call "
                             "pipe.init(rng, sample_inputs) first, or pass boundaries= (and a "
                             "remat other than 'auto' with a memory_budget).")
        if self.splitter is not None:   # the model's own variable tree -> per piece
            per_layer = self.splitter.to_layer_vars(per_layer)
        if len(per_layer) != len(self.layers):
            raise ValueError(f"Pipeline.{who}: got variables for {len(per_layer)} layers, the "
                             f"pipeline has {len(self.layers)}.")
        if self.model > 1 and self._split_dims is None:
            raise ValueError(f"Pipeline.{who}: with a 'model' mesh axis call pipe.init(rng, "
                             "sample_inputs) first (it learns which parameter dimensions "
                             "are split over 'model').")
        return [nn.meta.unbox(dict(v)) for v in per_layer]

    def unpack(self, variables: dict) -> list[dict]:
        """Packed variables -> list of per-layer flax variable dicts (numpy, portable).
        Packed gradients (`value_and_grad`'s grads: the "params" buffers alone) unpack
        to per-layer {"params": ...} dicts. On several processes, rows on other
        processes' devices are gathered: every process must call it (a collective)."""
        self._require_vars()
        if "params" not in variables:
            keys = {k for d in self.param_layouts for k in d["params"].size_of}
            # {}: a model without parameters has no gradient buffers (nor wrong ones).
            if (not variables and keys) or not set(variables) <= keys:
                raise ValueError(f"Pipeline.unpack: got a tree with keys {sorted(variables)}; "
                                 "pass packed variables (from pipe.init or a step) or packed "
                                 f"gradients (buffers {sorted(keys)}).")
            variables = {"params": variables}
        packing.check_packed(variables, {c: b for c, b in self.abstract_variables().items()
                                         if c in variables}, "unpack")
        host = _to_host(variables)
        per_layer = [dict() for _ in self.layers]
        for c in ["params", *(c for c in self.state_collections if c in host)]:
            for d, layers in enumerate(self.device_layers):
                shards = [packing.unpack_numpy(self.param_layouts[d][c],
                                               {k: v[d * self.model + j] for k, v in host[c].items()})
                          for j in range(self.model)]
                for n, i in enumerate(layers):
                    if c in self._layer_vars[i]:
                        per_layer[i][c] = self._model_merge(i, c, [t[n] for t in shards])
        # Writable: views of the fetched buffers are read-only, and an NNX model updated
        # with them (nnx.update) failed its next BatchNorm or counter update in place.
        per_layer = jax.tree.map(lambda a: a if not isinstance(a, np.ndarray) or
                                 a.flags.writeable else a.copy(), per_layer)
        return per_layer if self.splitter is None else self.splitter.from_layer_vars(per_layer)

    def padding_stats(self) -> dict:
        """Parameter elements per device, per-device buffer length and padding waste."""
        self._require_vars()
        used = [sum(n for _, n in l["params"].sizes) for l in self.param_layouts]
        per_device = sum(self.param_len.values())
        return dict(stage_params=used, buffer_params=per_device, total_params=sum(used),
                    padding_waste=1.0 - sum(used) / max(1, per_device * self.pipe_size))


def _to_host(tree: PyTree) -> PyTree:
    """numpy copies of `tree`'s arrays. An array that spans other processes' devices
    (stages on other hosts: jax.device_get refuses it) is gathered whole, with the same
    collective on every process."""
    from jax.experimental import multihost_utils

    def get(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.asarray(jax.device_get(a))
    return jax.tree.map(get, tree)


def _init_in_order(layers, rng, x) -> list[dict]:
    """Each layer's variables (key fold_in(rng, i)), each on the previous one's output.
    A run of equal layers is initialised by one `lax.scan` over its indices where that
    gives the same values (`_scanned_runs`), compiled once for the run (96 Dense blocks
    took 15-17 s to compile unrolled, 3 s scanned)."""
    runs = _scanned_runs(layers, rng, x)
    per_layer, i = [], 0
    while i < len(layers):
        if i in runs:
            end = runs[i]
            x, stacked = lax.scan(functools.partial(_init_one, layers[i], rng), x,
                                  jnp.arange(i, end))
            per_layer += [jax.tree.map(lambda a, n=n: a[n], stacked) for n in range(end - i)]
        else:
            end = i + 1
            x, variables = _init_one(layers[i], rng, x, i)
            per_layer.append(variables)
        i = end
    return per_layer


# Runs shorter than this are unrolled: XLA drops the forward passes no initialiser reads
# there, and a scan's loop costs more than two or three small layers' code.
MIN_SCANNED_RUN = 4


def _init_one(layer, rng, x, i):
    variables, y = init_layer(layer, jax.random.fold_in(rng, i), x, train=False)
    return y, variables


def _scanned_runs(layers, rng, x) -> dict:
    """{first: end} of the runs `_init_in_order` scans: at least `MIN_SCANNED_RUN` equal
    layers (`_same`) whose first two members trace to the same initialiser (a layer
    drawing numpy random numbers at trace time does not) and whose output keeps the
    input's types (a scan's carry), after the last layer whose variables read its
    input's values (data-dependent initialisation: a loop body's forward pass may round
    differently from the unrolled one, and every later initialiser would read that)."""
    n = len(layers)
    ends = [i + 1 for i in range(n)]
    for i in range(n - 2, -1, -1):
        if _same(layers[i + 1], layers[i]):
            ends[i] = ends[i + 1]
    if all(e - i < MIN_SCANNED_RUN for i, e in enumerate(ends)):
        return {}                       # nothing to scan: no extra tracing
    runs, reads, i, x = {}, [], 0, jax.tree.map(abstract_value, x)
    while i < n:
        traced, y, reads_x = _trace_init(layers[i], rng, x)
        end = i + 1
        if ends[i] - i >= MIN_SCANNED_RUN and _carry_type(y) == _carry_type(x):
            if _trace_init(layers[i + 1], rng, x)[0] == traced:
                end = ends[i]
                runs[i] = end
        reads += [reads_x] * (end - i)
        i, x = end, y
    last = max((k for k, r in enumerate(reads) if r), default=-1)
    return {a: b for a, b in runs.items() if a > last}


def _trace_init(layer, rng, x) -> tuple:
    """(the layer's initialiser as comparable data: jaxpr text and constants, its output's
    abstract value, whether its variables depend on the input's values)."""
    from jax.extend import core as jcore
    closed, (y, _) = jax.make_jaxpr(lambda r, a, i: _init_one(layer, r, a, i),
                                    return_shape=True)(abstract_value(rng), x, jnp.int32(0))
    consts = tuple(_const_value(c) for c in closed.consts)
    jaxpr = closed.jaxpr
    n_rng, n_x = len(jax.tree.leaves(rng)), len(jax.tree.leaves(x))
    dep = set(jaxpr.invars[n_rng:n_rng + n_x])
    for eqn in jaxpr.eqns:   # a nested call reading the input counts whole: conservative
        if any(not isinstance(v, jcore.Literal) and v in dep for v in eqn.invars):
            dep.update(eqn.outvars)
    var_outs = jaxpr.outvars[len(jax.tree.leaves(y)):]
    reads_x = any(not isinstance(v, jcore.Literal) and v in dep for v in var_outs)
    return (str(jaxpr), consts), y, reads_x


def _const_value(c):
    """A trace's constant as comparable bytes (a key or other opaque array: itself)."""
    try:
        a = np.asarray(c)
        return a.dtype.str, a.shape, a.tobytes()
    except Exception:
        return c


def _carry_type(tree):
    """What a scan's carry must keep, of an abstract tree: structure, shapes, dtypes and
    weak types."""
    return jax.tree.structure(tree), [(tuple(a.shape), a.dtype, a.weak_type)
                                      for a in jax.tree.leaves(tree)]


def _same(a, b) -> bool:
    """Equal layers, field by field with the fields' types (1 == 1.0 == True in Python,
    but an int field makes int parameters)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:   # an array field does not compare to one truth value: not the same
        return False


def _put(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """device_put of packed host values; on several processes they must be the same
    everywhere (jax asserts it, with pages of numbers and no cause)."""
    try:
        return jax.device_put(value, sharding)
    except AssertionError as e:
        if "not the same on each process" not in str(e):
            raise
        raise ValueError(f"Pipeline.pack: the variables differ between processes (process "
                         f"{jax.process_index()}'s are not process 0's): initialise with the "
                         f"same key on every process (pipe.init(jax.random.key(seed), ...) "
                         f"with one seed), or restore one checkpoint everywhere.") from None
