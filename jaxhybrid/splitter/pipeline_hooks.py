"""What `Pipeline` calls when it is given one model instead of a list of layers.

`Pipeline.__init__` asks `for_pipeline` for a `ModelSplitter` (None for layer lists);
`init` lets it split the model at the microbatch shape (pieces become the pipeline's
layers) and initialise the model's own variables; `pack` / `unpack` translate between
the model's variable tree and per-piece dicts; `value_and_grad` is wrapped so that tied
copies of a parameter receive the summed gradient and state copies follow their writer
(`sync_packed`), and a loss_fn that cannot take the model's outputs fails with one line;
`train_step` of such a model applies its optimizer to those summed gradients.
"""
from __future__ import annotations

import functools
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.checks import hashable
from jaxhybrid.layers import LossError
from jaxhybrid.pipeline import packing
from jaxhybrid.pipeline.arguments import TRAIN_STEP_CALL, one_microbatch, rng_hint
from jaxhybrid.pipeline.stages import microbatch_loss
from jaxhybrid.splitter.model import SplitModel
from jaxhybrid.splitter.trace import is_flax_module


class _PendingPiece(nn.Module):
    """Stands for the pieces until `Pipeline.init` has shown the splitter an input."""

    @nn.compact
    def __call__(self, x):
        raise ValueError("Pipeline: a model is split at the first pipe.init(rng, sample_inputs) "
                         "(or pass sample_inputs= to Pipeline); call init first.")


def for_pipeline(layers, mesh, call_kwargs, sample_inputs, num_microbatches=1):
    """(ModelSplitter or None, the layers the pipeline starts with). A model is split on
    one microbatch of `sample_inputs`, as `init` splits it (it was split on one example:
    a model whose graph follows the batch size, e.g. `lax.map` over its examples, was
    then refused at init for a graph that changed)."""
    if isinstance(layers, SplitModel):
        s = ModelSplitter(layers.model, call_kwargs, layers)
        return s, s.split.layers
    if not is_flax_module(layers):
        if call_kwargs:
            raise ValueError("Pipeline: call_kwargs= is for a single model, not a list of layers.")
        return None, layers
    stages = int(dict(getattr(mesh, "shape", {})).get("pipe", 1))
    s = ModelSplitter(layers, call_kwargs, None)
    if sample_inputs is not None:
        m = num_microbatches if isinstance(num_microbatches, int) and num_microbatches > 0 else 1
        s.split_at(one_microbatch(sample_inputs, int(dict(getattr(mesh, "shape", {})).get(
            "data", 1)) * m), stages)
        return s, s.split.layers
    # Enough stand-ins for any stage count (virtual stages included) until the split.
    return s, [_PendingPiece()] * max(256, stages)


class ModelSplitter:
    def __init__(self, model, call_kwargs, split: SplitModel | None):
        self.model, self.call_kwargs, self.split = model, dict(call_kwargs or {}), split
        self._checked: set = set()
        self._costs: dict = {}

    def split_at(self, sample, num_stages: int) -> None:
        self.split = SplitModel(self.model, sample, call_kwargs=self.call_kwargs,
                                min_pieces=num_stages)

    def check_counted_options(self, boundaries, plan, remat) -> None:
        """Options counted in pieces, known only once the model is split (with
        sample_inputs=, or at init): before, they were checked against 256 stand-ins, and
        boundaries were then silently replaced by an even split."""
        given = [n for n, v in (("boundaries", boundaries), ("plan", plan)) if v is not None]
        given += ["a remat list"] if isinstance(remat, (list, tuple)) else []
        if self.split is None and given:
            raise ValueError(f"Pipeline: {' and '.join(given)} of a single model count its "
                             f"pieces, known once it is split: pass sample_inputs= too.")

    def attach(self, pipe) -> None:
        """Splits (once) at the pipeline's microbatch sample; pieces become pipe.layers."""
        if self.split is not None:
            return
        from jaxhybrid.pipeline.stages import even_boundaries
        self.split_at(pipe._sample, pipe.num_stages)
        pipe.layers = list(self.split.layers)
        pipe._set_layout(even_boundaries(len(pipe.layers), pipe.num_stages), pipe.remat)

    def costs(self, sample):
        """Per-piece LayerCosts (XLA cost analysis of the lowered pieces), cached."""
        from jaxhybrid.splitter.costs import piece_costs
        key = str(jax.tree.map(lambda a: (np.shape(a), jnp.result_type(a)), sample))
        if key not in self._costs:
            self._costs[key] = piece_costs(self.split, sample)
        return self._costs[key]

    def init_variables(self, rng, sample_inputs):
        return self.split.init_variables(rng, sample_inputs)

    def to_layer_vars(self, variables):
        if isinstance(variables, (list, tuple)) and len(variables) == self.split.num_pieces:
            return list(variables)   # already per piece
        return self.split.to_layer_vars(variables)

    def from_layer_vars(self, per_piece):
        # Packed gradients hold the summed gradient in every copy (`sync_packed`), so the
        # first copy is right for values and gradients alike.
        return self.split.from_layer_vars(per_piece, grads=False)

    def tie_params(self, pipe, params: dict) -> dict:
        """`params` as they are, but differentiated as one variable per set of copies:
        jax.grad through `pipe.apply` gave each copy of a tied variable its own part of
        the gradient (pipe.unpack then showed one part, and a step with it let the copies
        drift apart); now every copy gets the sum, as value_and_grad's gradients hold."""
        groups = _groups(pipe, self.split, "params")
        if not groups:
            return params

        @jax.custom_vjp
        def tie(p):
            return p
        tie.defvjp(lambda p: (p, None), lambda _, ct: (_sync(ct, groups, True),))
        return tie(params)

    # --- the training step --------------------------------------------------------
    def wrap_value_and_grad(self, pipe, value_and_grad):
        @functools.wraps(value_and_grad)
        def wrapped(loss_fn, **kwargs):
            step = value_and_grad(loss_fn, **kwargs)

            def tied_step(variables, inputs, targets, rng=None):
                self.check_loss(pipe, loss_fn, inputs, targets)
                loss, grads, new = step(variables, inputs, targets, rng)
                grads, new = sync_packed(pipe, self.split, grads, new)
                return loss, grads, new

            tied_step.lower = getattr(step, "lower", None)
            return tied_step
        return wrapped

    def wrap_train_step(self, pipe, train_step):
        """train_step of a model whose pieces share variables (tied embeddings, a module
        used twice): its U tasks updated each copy with its own part of the gradient, and
        the copies drifted apart, silently. A synchronous schedule now applies the
        optimizer to value_and_grad's summed gradients after the step (what its U after
        the last backward computes for an untied model); an asynchronous one is refused:
        the sum would be a collective between stages inside the pipeline."""
        @functools.wraps(train_step)
        def wrapped(loss_fn, optimizer, **kwargs):
            step = train_step(loss_fn, optimizer, **kwargs)     # its checks, up front
            if not any(_groups(pipe, self.split, c)
                       for c in ["params", *pipe.state_collections]):
                return step
            if pipe.schedule.weights != "sync":
                raise ValueError(
                    f"Pipeline: schedule {pipe.schedule.name!r} updates each stage's weights "
                    f"inside the pipeline, but this model's pieces share variables (tied "
                    f"weights or a module used twice) whose copies would drift apart; use a "
                    f"synchronous schedule (e.g. '1f1b'), or untie them.")
            donate = kwargs.pop("donate", False)
            value_and_grad, update = pipe.value_and_grad(loss_fn, **kwargs), {}

            def tied_step(variables, opt_state, inputs, targets, rng=None):
                packing.check_not_donated(opt_state, "Pipeline.train_step: opt_state")
                if donate:
                    packing.check_donatable(variables, opt_state, "Pipeline.train_step")
                with rng_hint(TRAIN_STEP_CALL):
                    loss, grads, new = value_and_grad(variables, inputs, targets, rng)
                if not update:   # jitted once, keeping the buffers' and slots' placement
                    shardings = lambda tree: jax.tree.map(lambda a: a.sharding, tree)
                    # donate: the update writes the new parameters and state into the
                    # old ones' buffers (the gradient step above cannot: it reads them).
                    update["f"] = jax.jit(functools.partial(_apply_optimizer, optimizer),
                                          out_shardings=(shardings(variables["params"]),
                                                         shardings(opt_state)),
                                          donate_argnums=(1, 2) if donate else ())
                params, opt_state = update["f"](grads, opt_state, variables["params"])
                return loss, grads, {**new, "params": params}, opt_state

            tied_step.lower = None
            return tied_step
        return wrapped

    def check_loss(self, pipe, loss_fn, inputs, targets):
        """loss_fn against the model's outputs, before the step is traced. Only for
        inputs and targets the pipeline's own checks would pass (one batch size, a
        multiple of the microbatch count, arrays): for others those checks say what is
        wrong (this check blamed loss_fn for targets of another batch size, and gave
        flax's or numpy's errors for misshapen or list inputs)."""
        n = pipe.data * pipe.num_microbatches
        leaves = jax.tree.leaves(inputs) + jax.tree.leaves(targets)
        if not all(hasattr(l, "shape") and np.ndim(l) for l in leaves):
            return
        sizes = {np.shape(l)[0] for l in leaves}
        if len(sizes) != 1 or sizes.pop() % n:
            return   # the pipeline reports batch sizes itself
        # The dtype jax will see, read without moving the array (jnp.asarray copied every
        # numpy batch to the device at each call, for its dtype only).
        mb = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            (np.shape(a)[0] // n, *np.shape(a)[1:]), jnp.result_type(a)), tree)
        key = (hashable(loss_fn), str(mb(inputs)), str(mb(targets)))
        if key in self._checked:
            return
        try:
            with pipe._fit_hint():          # inputs unlike init's: the shapes' one line
                out = self.split.output_shape(mb(inputs))
        except ValueError:
            raise
        except Exception:   # noqa: BLE001 - the step's own checks name the fault
            return
        try:   # as the step calls it: a per-example or tuple loss is named here too
            jax.eval_shape(lambda o, t: microbatch_loss(loss_fn, o, t, 1), out, mb(targets))
        except LossError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure means the same fix
            # Both trees: a fault in the targets (a dtype, a shape) was blamed on the outputs.
            shapes = lambda tree: jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", tree)
            raise ValueError(f"Pipeline: loss_fn(outputs, targets) cannot take the model's "
                             f"outputs {shapes(out)} with a microbatch's targets "
                             f"{shapes(mb(targets))} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); make loss_fn accept "
                             f"them, or pass targets it can take.") from e
        self._checked.add(key)


# --- keeping copies of a variable identical in packed buffers ------------------------
def _locations(pipe, coll: str) -> dict:
    """{(piece, name): (row of the packed buffers, buffer key, offset, shape)} of one
    collection: row d holds the pieces `pipe.device_layers[d]`, laid out as `pack` does."""
    out = {}
    for d, layers in enumerate(pipe.device_layers):
        tree = [pipe._layer_vars[i].get(coll, {}) for i in layers]
        lay = pipe.param_layouts[d][coll]
        for idx, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
            out[(layers[path[0].idx], path[1].key)] = (d, lay.keys[idx], lay.offsets[idx],
                                                       lay.shapes[idx])
    return out


def _groups(pipe, split: SplitModel, coll: str) -> list:
    """Per variable with several copies: [(key, location)], and the writer's piece."""
    locs = _locations(pipe, coll)
    by_var: dict = {}
    for p, keys in enumerate(split.piece_keys):
        for key in keys:
            c, name = split.var_name(key)
            if c == coll:
                by_var.setdefault(key[0], []).append((key, locs[(p, name)], p))
    groups = []
    for j, copies in by_var.items():
        whole = [c for c in copies if c[0][1] is None]
        ranges = [c[0][1:] for c in copies if c[0][1] is not None]
        if len(whole) > 1 or (whole and ranges) or len(ranges) != len(set(ranges)):
            groups.append((j, copies, split._writer.get(j)))
    return groups


def _read(bufs, loc):
    s, key, off, shape = loc
    n = int(np.prod(shape))
    return jax.lax.dynamic_slice_in_dim(bufs[key][s], off, n).reshape(shape)


def _write(bufs, loc, value):
    s, key, off, shape = loc
    bufs[key] = bufs[key].at[s, off:off + int(np.prod(shape))].set(value.reshape(-1))


def _sync(bufs, groups, is_params: bool):
    bufs = dict(bufs)
    for j, copies, writer in groups:
        whole = [loc for key, loc, _ in copies if key[1] is None]
        parts: dict = {}
        for key, loc, _ in copies:
            if key[1] is not None:
                parts.setdefault(key[1:], []).append(loc)
        if is_params:
            total = sum((_read(bufs, l) for l in whole[1:]), _read(bufs, whole[0])) if whole else None
            if parts:
                sl = jnp.concatenate([sum((_read(bufs, l) for l in parts[r][1:]),
                                          _read(bufs, parts[r][0])) for r in sorted(parts)], 0)
                total = sl if total is None else total + sl
        else:
            src = [loc for key, loc, p in copies if p == writer and key[1] is None]
            if not src:
                continue
            total = _read(bufs, src[0])
        for key, loc, _ in copies:
            _write(bufs, loc, total if key[1] is None else total[key[1]:key[2]])
    return bufs


def _apply_optimizer(optimizer, grads, opt_state, params):
    import optax
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def copy_weights(pipe, split: SplitModel, params: dict) -> dict | None:
    """Packed buffers like `params`, 1/(number of copies) at every element of a variable
    held by several pieces, 1 elsewhere; None when no variable has copies. Sums over the
    packed buffers weighted by them count each model variable once (the global gradient
    norm of the model, for clipping), although every copy holds the summed gradient."""
    groups = _groups(pipe, split, "params")
    if not groups:
        return None
    w = {k: np.ones(np.shape(v), np.float32) for k, v in params.items()}
    for j, copies, _ in groups:
        count = np.zeros(split.adapter.avals[j].shape, np.float32)
        for key, _, _ in copies:
            count[slice(key[1], key[2])] += 1.0   # slice(None, None): the whole variable
        for key, (row, k, off, shape), _ in copies:
            part = 1.0 / count[slice(key[1], key[2])]
            w[k][row, off:off + part.size] = part.reshape(-1)
    return {k: jax.device_put(v.astype(params[k].dtype), params[k].sharding)
            for k, v in w.items()}


def sync_packed(pipe, split: SplitModel, grads: dict, new_vars: dict):
    """Sums tied parameters' gradients into every copy; copies state from its writer."""
    cache = pipe._cache.setdefault("splitter_sync", {})
    for c in ["params", *pipe.state_collections]:
        if c not in cache:
            groups = _groups(pipe, split, c)
            cache[c] = groups and jax.jit(functools.partial(
                _sync, groups=groups, is_params=c == "params"))
    if cache["params"]:
        grads = cache["params"](grads)
    for c in pipe.state_collections:
        if cache[c]:
            new_vars = {**new_vars, c: cache[c](new_vars[c])}
    return grads, new_vars


# --- checkpoints in the model's own variable tree ------------------------------------
def holds_model_tree(pipe) -> bool:
    """Does `pipe` checkpoint one linen model's own tree (instead of per-piece trees)?"""
    return pipe.splitter is not None and pipe.splitter.split.adapter.kind == "linen"


def to_model_entries(pipe, entries: list) -> list:
    """Per-piece checkpoint entries [{"variables", "opt": [slot trees]}] -> one entry in
    the model's own tree (variables as model.init returns them, each optimizer slot like
    its "params"), so a checkpoint does not depend on where the model was cut."""
    split = pipe.splitter.split
    variables = split.from_layer_vars([e["variables"] for e in entries])
    opt = [split.from_layer_vars([{"params": e["opt"][k]} for e in entries])["params"]
           for k in range(len(entries[0]["opt"]))]
    return [{"variables": variables, "opt": opt}]


def from_model_entries(pipe, entries: list) -> list:
    """Inverse of `to_model_entries` for this pipeline's pieces."""
    split = pipe.splitter.split
    (entry,) = entries
    variables = split.to_layer_vars(entry["variables"])
    slots = [split.to_layer_vars({**entry["variables"], "params": slot}) for slot in entry["opt"]]
    return [{"variables": v, "opt": [slot[p].get("params", {}) for slot in slots]}
            for p, v in enumerate(variables)]
