"""`SplitModel`: one Flax model (linen or NNX) as a list of pieces that run like layers.

Each piece is a small linen Module (`Piece`) whose `__call__(x, train)` evaluates its
segment of the model's traced program with its own variables, so the pipeline engine,
the profiler and the planner treat pieces exactly as they treat hand-written layers.
Piece 0 takes the model's input pytree; piece k > 0 takes (shape markers, carried
values): zero-size arrays with the shapes of the model inputs (so a piece can re-trace
the model at the microbatch size it is given) and every value computed earlier and used
by a later piece (skip connections, encoder outputs, the dropout key). The last piece
returns the model's output pytree.

Variables: a piece holds every variable its segment reads, under the collection and the
path name of the model's tree ("Dense_0/kernel"; a slice "[a:b]" of a scanned stack when
a scan is split between pieces). A variable read by several pieces (tied embeddings) is
held by each; `from_layer_vars(..., grads=True)` sums its gradients, and in a pipeline
`sync_packed` writes the sum into every copy after each step, so copies stay identical
under any optimizer. A state variable (BatchNorm statistics) is written by exactly one
piece (cuts never separate its read from its update); other copies are refreshed from it.

Randomness: the model's "dropout" rng on microbatch g is the key piece 0 receives,
`layer_rng(rng, g, 0)`: the same as a one-layer list [model], i.e. what
`jaxhybrid.pipeline.reference_value_and_grad([model], ...)` uses.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.layers import raw_key
from jaxhybrid.plan.costs import device_peak
from jaxhybrid.splitter import cuts as C
from jaxhybrid.splitter.program import flatten, scan_layout
from jaxhybrid.splitter.trace import make_adapter, trace

PyTree = Any


class Piece(nn.Module):
    """One piece of a split model (see `SplitModel`)."""
    split: Any
    index: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        return self.split.run_piece(self, x, train)


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.asarray(a).dtype
                                                       if not hasattr(a, "dtype") else a.dtype), tree)


def _warn_if_scanning_the_batch_axis(t, x_abs) -> None:
    """A scan over the leading axis of activations as long as a microbatch: a time-major
    model (`nn.RNN(time_major=True)` on [T, B, ...]) whose inputs the pipeline cuts along
    time, which trains silently wrong (gradients 55% off in a probe), or `lax.map` over
    the examples, which is fine. Only scanned values computed from the inputs count:
    not stacked parameters, keys or RNG counts (a layer scan, `nnx.scan` over `nnx.vmap`'d
    layers, `nn.scan` splitting dropout keys: the warning fired on those where the layers
    were as many as a microbatch's rows), nor values whose leading axis a transpose moved
    away (a batch-major model scanning its time axis, as long as a microbatch by chance).
    A warning, since a time-major model and `lax.map` cannot be told apart from the
    program."""
    leaves = jax.tree.leaves(x_abs)
    rows = int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else 0
    if rows < 2:
        return
    from_inputs = set(t.x_ids)
    for op in t.prog.ops:
        # A transpose that moves the leading axis away (a batch-major RNN's swapaxes to
        # [T, B, ...]) ends the chain: what it scans over is not the examples' axis.
        moves_rows = (op.eqn.primitive.name == "transpose"
                      and tuple(op.eqn.params["permutation"])[:1] != (0,))
        if any(i in from_inputs for i in op.ins) and not moves_rows:
            from_inputs.update(op.outs)
        if op.eqn.primitive.name != "scan" or int(op.eqn.params["length"]) != rows:
            continue
        nc, ncarry = scan_layout(op)
        xs = [i for i in op.ins[nc + ncarry:] if i in from_inputs and not _is_key(t.prog.avals[i])
              and np.shape(t.prog.avals[i])[:1] == (rows,)]
        if xs:
            warnings.warn(f"Splitter: the model scans over a leading axis of "
                          f"{rows} steps, as many as a microbatch has rows. The pipeline "
                          f"cuts inputs into microbatches along their leading axis: if "
                          f"your inputs are time-major ([T, B, ...]), transpose them to "
                          f"batch-major, or the gradients are wrong; if they are batch-major, "
                          f"ignore this.", stacklevel=2)
            return


def _raise_if_per_example_kwargs(error: Exception, call_kwargs: dict, x_abs) -> None:
    """A model that failed to trace with arrays in call_kwargs that are not one
    microbatch long: likely a per-example value (a mask [batch, ...]) given whole to
    every microbatch; said so, with the fix (the model's own error was 12 frames deep)."""
    rows = np.shape(jax.tree.leaves(x_abs)[0])[0] if jax.tree.leaves(x_abs) else None
    names = [jax.tree_util.keystr(p) for p, a in jax.tree_util.tree_flatten_with_path(
        call_kwargs)[0] if np.ndim(a) >= 1 and np.shape(a)[0] not in (1, rows)]
    if names:
        raise ValueError(f"Splitter: the model failed on one microbatch of {rows} rows "
                         f"({type(error).__name__}: {str(error).splitlines()[0][:200]}); "
                         f"call_kwargs {', '.join(names)} go whole to every microbatch: a "
                         f"per-example value (e.g. a mask [batch, ...]) must travel with the "
                         f"inputs, e.g. inputs=(x, mask) and __call__(self, inputs).") from error


def _is_key(aval) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key)


def _wire_dtype(aval):
    return jnp.uint32 if _is_key(aval) else aval.dtype


def _to_wire(v, aval):
    return jax.random.key_data(v) if _is_key(aval) else v


def _from_wire(v, aval):
    return jax.random.wrap_key_data(v, impl=aval.dtype._impl) if _is_key(aval) else v


class SplitModel:
    """A Flax model cut into `num_pieces` pieces (`.layers`) at candidate cuts of its
    traced forward. See the module docstring; `docs/splitter.md` for the design.

    Args:
      model: a flax.linen.Module or flax.nnx.Module, called as model(x, **call_kwargs).
      sample_inputs: a pytree of arrays (batch-major) at the size the pieces are chosen
        for (one microbatch); pieces re-trace at other sizes.
      max_pieces: about this many pieces, each ~1/max_pieces of the estimated cost (the
        greedy choice may make a few more); the planner then groups them into stages.
      min_pieces: at least this many (e.g. the number of stages); an error says how many
        cut points the model has when it has fewer.
    """

    def __init__(self, model, sample_inputs: PyTree, *, call_kwargs: dict | None = None,
                 max_pieces: int = 32, min_pieces: int = 1):
        self.model, self.max_pieces = model, int(max_pieces)
        self.adapter = make_adapter(model, call_kwargs, sample_inputs)
        self._peaks = device_peak()
        self._cache: dict = {}
        self._x_tree = jax.tree.structure(sample_inputs)
        x_abs = self._x_abs = _abstract(sample_inputs)
        t = self._traced(x_abs, True)
        _warn_if_scanning_the_batch_axis(t, x_abs)
        self.structure = t.prog.structure()
        self.num_candidates = len(C.candidates(t))
        if self.num_candidates + 1 < min_pieces:
            raise ValueError(f"Splitter: the model has only {self.num_candidates} possible cut "
                             f"points ({self.num_candidates + 1} pieces) but {min_pieces} stages "
                             f"were asked for; use fewer stages: pipe (x virtual stages per "
                             f"device) <= {self.num_candidates + 1}.")
        self.cuts = C.choose_cuts(t, self.max_pieces, min_pieces)
        self.num_pieces = n = len(self.cuts) + 1
        owners: dict = {}
        for p, seg in enumerate(C.build_segments(t, C.assign_from_cuts(t.prog, self.cuts), n)):
            for key in seg.reads:
                owners.setdefault(key, set()).add(p)
        for j in self.adapter.program_vars:   # unused variables still need a home
            if not any(k[0] == j for k in owners):
                owners[(j, None, None)] = {0}
        C.assign_by_placement(self._traced(x_abs, False), owners, n)
        self._owners = owners
        self.piece_keys = [sorted((k for k, ps in owners.items() if p in ps),
                                  key=lambda k: (k[0], k[1] or 0)) for p in range(n)]
        self._writer = {j: p for p, seg in enumerate(self._segments(x_abs, True)[1])
                        for j, _ in seg.writes}
        self._rng_values = {i: None for i, _ in self.adapter.rng_leaves}
        if self.adapter.kind == "nnx":
            leaves = jax.tree.leaves(self.adapter.init_variables(None, None))
            self._rng_values = {i: leaves[i] for i, _ in self.adapter.rng_leaves}
        self.layers = [Piece(split=self, index=p) for p in range(n)]

    # --- traces, cached per input shapes and mode ------------------------------------
    def _traced(self, x_abs, train: bool) -> C.Traced:
        key = ("traced", str(x_abs), train)
        if key not in self._cache:
            try:
                closed, y_tree = trace(self.adapter, x_abs, train)
            except Exception as e:
                _raise_if_per_example_kwargs(e, self.adapter.call_kwargs, x_abs)
                raise
            prog = flatten(closed, self._peaks)
            nv, nx = len(self.adapter.program_vars), len(jax.tree.leaves(x_abs))
            var_ids = prog.invars[:nv]
            ny = y_tree.num_leaves
            state_out = list(zip(self.adapter.state_leaves, prog.outvars[ny:]))
            self._cache[key] = C.Traced(
                prog, dict(zip(var_ids, self.adapter.program_vars)),
                dict(zip(self.adapter.program_vars, var_ids)), prog.invars[nv:nv + nx],
                prog.invars[nv + nx], prog.outvars[:ny], y_tree, state_out)
        return self._cache[key]

    def _segments(self, x_abs, train: bool):
        key = ("segments", str(x_abs), train)
        if key not in self._cache:
            t = self._traced(x_abs, train)
            if train:
                if t.prog.structure() != self.structure:
                    raise ValueError("Splitter: the model's graph changes with the input shape "
                                     f"({x_abs}); split it at the shape it runs with.")
                assign = C.assign_from_cuts(t.prog, self.cuts)
            else:
                owners = {k: set(v) for k, v in self._owners.items()}
                assign = C.assign_by_placement(t, owners, self.num_pieces)
                if owners != self._owners:
                    raise ValueError("Splitter: the model's evaluation graph changes with the "
                                     f"input shape ({x_abs}); split it at that shape.")
            segs = C.build_segments(t, assign, self.num_pieces)
            for p, seg in enumerate(segs):
                extra = set(seg.reads) - set(self.piece_keys[p])
                if extra:
                    raise ValueError(f"Splitter: piece {p} reads variables it does not hold "
                                     f"({sorted(extra)[:3]}) at input shape {x_abs}.")
            self._cache[key] = (t, segs)
        return self._cache[key]

    def _marker_dtype(self, train: bool, k: int):
        key = ("marker", train, k)
        if key not in self._cache:
            t, segs = self._segments(self._x_abs, train)
            sized = [(t.prog.nbytes(i), _wire_dtype(t.prog.avals[i])) for i in segs[k].live_out]
            sized = [d for n, d in sorted(sized, key=lambda nd: -nd[0]) if n > 0]
            self._cache[key] = sized[0] if sized else jnp.float32
        return self._cache[key]

    # --- running a piece -----------------------------------------------------------
    def var_name(self, key) -> tuple[str, str]:
        j, a, b = key
        name = self.adapter.names[j] + ("" if a is None else f"[{a}:{b}]")
        return self.adapter.colls[j], name

    def _var_aval(self, key):
        j, a, b = key
        aval = self.adapter.avals[j]
        return aval if a is None else jax.ShapeDtypeStruct((b - a, *aval.shape[1:]), aval.dtype)

    def run_piece(self, module: Piece, x, train: bool):
        k, last = module.index, module.index == self.num_pieces - 1
        if k == 0:
            leaves, tree = jax.tree.flatten(x)
            if tree != self._x_tree:
                raise ValueError(f"Splitter: the model was split for inputs structured as "
                                 f"{self._x_tree}, got {tree}.")
            x_abs = jax.tree.unflatten(tree, [jax.ShapeDtypeStruct(l.shape, l.dtype) for l in leaves])
        else:
            markers, leaves = x
            x_abs = jax.tree.unflatten(self._x_tree, [
                jax.ShapeDtypeStruct(m.shape[:-1], a.dtype)
                for m, a in zip(markers, jax.tree.leaves(self._x_abs))])
        t, segs = self._segments(x_abs, train)
        if not last:
            # Zero-size arrays with the model inputs' shapes, in a dtype this boundary
            # already carries (packing needs every dtype it sees to have a buffer).
            dtype = self._marker_dtype(train, k)
            markers = tuple(jnp.zeros((*l.shape, 0), dtype) for l in jax.tree.leaves(x_abs))
        seg = segs[k]
        none = self.without_gradient(t, segs)
        env = dict(t.prog.consts)
        for key in self.piece_keys[k]:
            coll, name = self.var_name(key)
            aval = self._var_aval(key)
            zeros = functools.partial(jnp.zeros, aval.shape, aval.dtype)
            if coll == "params":
                value = module.param(name, lambda rng: zeros())
            else:
                value = module.variable(coll, name, zeros).value
            if key in seg.reads:
                env[seg.reads[key]] = value
        if k == 0:
            env.update(zip(t.x_ids, leaves))
            if seg.needs_key:
                env[t.key_id] = _dropout_key(module)
        else:
            for i, v in zip(seg.live_in, leaves):
                v = _from_wire(v, t.prog.avals[i])
                # No part in the gradient: say so to jax (`cuts.without_gradient`).
                env[i] = jax.lax.stop_gradient(v) if i in none else v
        for unit in seg.units:
            unit.run(env)
        if train:
            for j, i in seg.writes:
                module.put_variable(*self.var_name((j, None, None)), env[i])
        if last:
            return jax.tree.unflatten(t.y_tree, [env[i] for i in t.y_ids])
        return markers, tuple(_to_wire(jax.lax.stop_gradient(env[i]) if i in none else env[i],
                                       t.prog.avals[i]) for i in seg.live_out)

    def without_gradient(self, t, segs) -> frozenset:
        """`cuts.without_gradient` of these segments (`_segments`), once: for the pieces
        and their costs (`splitter.costs`)."""
        key = ("without_gradient", id(segs))
        if key not in self._cache:
            self._cache[key] = (segs, C.without_gradient(t.prog, segs, t.y_ids))
        return self._cache[key][1]

    # --- variables -----------------------------------------------------------------
    def init_variables(self, rng, sample_inputs):
        """The model's own variable tree (linen: model.init with train=False on one
        example, as layers are initialised; NNX: the model's current state)."""
        return self.adapter.init_variables(rng, sample_inputs)

    def to_layer_vars(self, variables) -> list[dict]:
        """The model's variable tree -> one {collection: {name: array}} per piece."""
        leaves = self.adapter.leaves(variables)
        for j, (leaf, want) in enumerate(zip(leaves, self.adapter.avals)):
            # The pieces are programs traced at the model's own shapes and dtypes: a
            # bfloat16 copy of float32 parameters failed inside the step ("lax.add
            # requires arguments to have the same dtypes"), deep in a traceback.
            if _is_key(want):
                continue
            got = (tuple(np.shape(leaf)), jnp.result_type(leaf))
            if got != (tuple(want.shape), jnp.dtype(want.dtype)):
                c, name = self.adapter.colls[j], self.adapter.names[j]
                fix = ("made for this model and its options" if got[0] != tuple(want.shape)
                       else "cast with jax.tree.map(lambda a, b: a.astype(b.dtype), tree, "
                            "pipe.unpack(variables)), or build the model with the dtype "
                            "you mean (param_dtype=)")
                raise ValueError(f"Splitter: variable {c}/{name} is {got[1].name}{list(got[0])}"
                                 f", the model's is {jnp.dtype(want.dtype).name}"
                                 f"{list(want.shape)}; pass variables {fix}.")
        for i in self._rng_values:
            self._rng_values[i] = leaves[i]
        out = []
        for keys in self.piece_keys:
            d: dict = {}
            for key in keys:
                j, a, b = key
                v = leaves[j]
                if not isinstance(v, jax.core.Tracer):   # host copies; traced values stay
                    v = np.asarray(jax.device_get(v))
                coll, name = self.var_name(key)
                d.setdefault(coll, {})[name] = v if a is None else v[a:b]
            out.append(d)
        return out

    def from_layer_vars(self, per_piece, grads: bool = False):
        """Per-piece variables -> the model's own tree (only the collections present).
        grads=True: a variable held by several pieces gets the sum of their values (the
        gradient of a tied parameter); otherwise the first copy (all copies are equal)."""
        if len(per_piece) != self.num_pieces:
            raise ValueError(f"Splitter: {len(per_piece)} piece variable dicts for "
                             f"{self.num_pieces} pieces.")
        present = {c for d in per_piece for c in d}
        leaves = [None] * len(self.adapter.avals)
        for i, v in self._rng_values.items():
            leaves[i] = v
        copies: dict = {}
        for p, keys in enumerate(self.piece_keys):
            for key in keys:
                coll, name = self.var_name(key)
                if coll in per_piece[p]:
                    copies.setdefault(key[0], []).append((key, per_piece[p][coll][name]))
        for j, cs in copies.items():
            whole = [v for k, v in cs if k[1] is None]
            parts: dict = {}
            for k, v in cs:
                if k[1] is not None:
                    parts.setdefault(k[1:], []).append(v)
            sliced = None
            if parts:
                pick = (lambda vs: sum(vs[1:], vs[0])) if grads else (lambda vs: vs[0])
                pieces = [pick(parts[r]) for r in sorted(parts)]
                traced = any(isinstance(v, jax.core.Tracer) for v in pieces)
                sliced = (jnp.concatenate(pieces, 0) if traced
                          else np.concatenate([np.asarray(v) for v in pieces], 0))
            if grads:
                total = sum(whole[1:], whole[0]) if whole else None
                leaves[j] = sliced if total is None else (total if sliced is None else total + sliced)
            else:
                leaves[j] = whole[0] if whole else sliced
        for j in range(len(leaves)):
            if leaves[j] is None and self.adapter.colls[j] in present:
                raise ValueError(f"Splitter: no piece holds {self.adapter.names[j]}.")
        keep = None if present >= {self.adapter.colls[j] for j in self.adapter.program_vars} \
            else present
        if keep is not None:   # a partial tree (e.g. only "params"): fill, then filter
            leaves = [v if v is not None else np.zeros(a.shape, a.dtype)
                      for v, a in zip(leaves, self.adapter.avals)]
        return self.adapter.tree(leaves, keep)

    def output_shape(self, x_abs):
        t = self._traced(x_abs, True)
        return jax.tree.unflatten(t.y_tree, [jax.ShapeDtypeStruct(t.prog.avals[i].shape,
                                                                  t.prog.avals[i].dtype)
                                             for i in t.y_ids])

    def shared_variables(self) -> dict:
        """{variable name: pieces holding it} for variables held by several pieces."""
        out = {}
        for key, ps in self._owners.items():
            if len(ps) > 1:
                out[self.var_name(key)[1]] = sorted(ps)
        return out


def _dropout_key(module: nn.Module):
    """The raw "dropout" key the pipeline handed piece 0 (layer_rng(rng, g, 0))."""
    if not module.has_rng("dropout"):   # no rng= given: the pipeline names the fix
        # (flax's own message named "dropout", which the model may never draw from).
        raise flax.errors.InvalidRngError("the model draws random numbers (from its rng "
                                          "streams) and no key was given")
    lazy = module.scope.rngs["dropout"]
    return raw_key(getattr(lazy, "rng", lazy))
