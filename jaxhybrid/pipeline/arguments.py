"""The checks of `Pipeline`'s arguments and calls: each bad value is one ValueError that
names the fix, raised before anything is traced or compiled."""
from __future__ import annotations

import contextlib
import contextvars
import re
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxhybrid import distributed
from jaxhybrid.checks import batch_size_of
from jaxhybrid.mesh import DATA, MODEL, PIPE
from jaxhybrid.schedules import Schedule, make_schedule

PyTree = Any


def checked_mesh(mesh) -> Mesh:
    if not isinstance(mesh, Mesh) or set(mesh.axis_names) not in ({DATA, PIPE},
                                                                   {DATA, PIPE, MODEL}):
        names = getattr(mesh, "axis_names", None)
        raise ValueError(f"Pipeline: mesh must have the axes ('data', 'pipe') or ('data', "
                         f"'pipe', 'model'), got {names}; build it with "
                         f"jaxhybrid.make_mesh(data=..., pipe=..., model=...).")
    explicit = [n for n, t in zip(mesh.axis_names, getattr(mesh, "axis_types", ()))
                if t != AxisType.Auto]
    if explicit:
        # jax.make_mesh makes Explicit axes by default; shard_map then refuses the
        # unsharded batch ("in_specs ... does not match the specs of the input").
        raise ValueError(f"Pipeline: mesh axes {explicit} are not AxisType.Auto (jax.make_mesh "
                         f"makes Explicit ones); build the mesh with jaxhybrid.make_mesh, or pass "
                         f"axis_types=(jax.sharding.AxisType.Auto,) * {len(mesh.axis_names)}.")
    try:   # else `pack` failed in jax's device_put with "cannot reshape array of size ..."
        distributed.check_devices_per_process()
    except ValueError as e:
        raise ValueError(f"Pipeline: {e}") from None
    return mesh


def checked_zero(zero) -> bool:
    if zero not in (0, 1, False, True):
        raise ValueError(f"Pipeline: zero={zero!r} must be 0 (replicated optimizer state) "
                         f"or 1 (optimizer state sharded over 'data').")
    return bool(zero)


def checked_schedule(schedule, pipe: int, M: int, virtual_stages, zero: bool,
                      num_layers: int) -> Schedule:
    """The schedule built by name (or a user's own), checked against the other options."""
    options = {} if virtual_stages is None else {"virtual_stages": virtual_stages}
    if options and isinstance(schedule, Schedule):   # (the message printed all its tasks)
        raise ValueError(f"Pipeline: virtual_stages is an option of schedule='interleaved'; "
                         f"schedule {schedule.name!r} is a Schedule, whose stage_device "
                         f"already places its stages: drop virtual_stages.")
    if options and schedule != "interleaved":
        raise ValueError(f"Pipeline: virtual_stages is an option of schedule='interleaved' "
                         f"(got schedule={schedule!r}); drop it or use 'interleaved'.")
    sched = make_schedule(schedule, pipe, M, **options)
    if sched.forward_only:   # its value_and_grad returned zero gradients
        raise ValueError(f"Pipeline: schedule {sched.name!r} is forward_only (no backward "
                         f"tasks); pass a training schedule (apply derives its forward "
                         f"table from it).")
    if zero and sched.weights != "sync":
        raise ValueError(f"Pipeline: zero=1 shards a synchronous step's optimizer state; "
                         f"schedule {sched.name!r} updates per gradient window "
                         f"(weight versions per replica): use zero=0 with it.")
    if sched.num_stages > num_layers:
        v = sched.virtual_stages
        how = f" ({pipe} devices x {v} virtual)" if v > 1 else ""
        raise ValueError(f"Pipeline: {sched.num_stages} stages{how} but only {num_layers} "
                         f"layers; use a mesh with pipe <= {num_layers // v}"
                         f"{_fewer_stages_per_device(sched)}, "
                         f"or split the model into more layers.")
    return sched


def check_state_order(sched: Schedule, layer_vars, ranges, train: bool) -> None:
    """Mutable state updates microbatch by microbatch, in order (the reference's
    semantics): a table whose forwards of a stage with state ran out of that order
    returned other batch statistics, silently (loss and gradients were right).
    layer_vars: per layer {collection: tree}; ranges: per stage its layers [a, b)."""
    held = [sorted({c for i in range(a, b) for c in layer_vars[i] if c != "params"})
            for a, b in ranges]
    broken = sched.forward_order_break([k for k, h in enumerate(held) if h]) if train else None
    if broken:
        k, m = broken
        raise ValueError(f"Pipeline: schedule {sched.name!r} runs F{m} of stage {k} before "
                         f"F{m - 1}, but its {', '.join(held[k])} update microbatch by "
                         f"microbatch in order; run that stage's forwards in microbatch "
                         f"order (or train it without mutable state).")


def check_plan_inputs(memory_budget, topology) -> None:
    """Reads memory_budget and a topology spec now: the planner read them only in `init`,
    after profiling (compiling) every layer."""
    from jaxhybrid.plan.topology import Topology, parse_bytes   # pure: no pipeline import
    for what, value, read in (("memory_budget", memory_budget, parse_bytes),
                              ("topology", topology, Topology.from_spec)):
        if value is not None and (what == "memory_budget" or isinstance(value, str)):
            try:
                read(value)
            except ValueError as e:
                raise ValueError(f"Pipeline: {what}={value!r}: {e}") from e


def check_plan_matches(plan, schedule, num_microbatches: int, data: int, memory_budget) -> None:
    """A plan given to `Pipeline(plan=...)` runs as is: one made for another schedule,
    number of microbatches or data degree would report (`pipe.plan`) the memory and step
    time of another setup, and a memory budget beside it would be ignored."""
    made = dict(schedule=plan.schedule, num_microbatches=plan.num_microbatches,
                data=plan.data, virtual_stages=plan.virtual_stages)
    here = dict(schedule=schedule.name, num_microbatches=num_microbatches, data=data,
                virtual_stages=schedule.virtual_stages)
    differ = [k for k in made if made[k] != here[k]]
    if differ:
        raise ValueError(
            "Pipeline: the plan was made for " + ", ".join(f"{k}={made[k]}" for k in differ)
            + "; this pipeline runs " + ", ".join(f"{k}={here[k]}" for k in differ)
            + ". Make a plan for this setup (make_plan(..., " + ", ".join(
                f"{k}={here[k]!r}" for k in differ) + ")), or reuse its split with "
            "boundaries=plan.boundaries, remat=plan.pipeline_remat instead of plan=.")
    if memory_budget is not None:
        raise ValueError(f"Pipeline: plan= runs the plan as is (made under memory_budget="
                         f"{plan.memory_budget}), so memory_budget={memory_budget!r} would be "
                         f"ignored; drop memory_budget, or drop plan= to plan under it.")


def checked_layers(layers) -> list:
    """The layers as a list; a ValueError naming what they must be."""
    import flax.linen as nn
    layers = list(layers)
    if not layers or not all(isinstance(l, nn.Module) for l in layers):
        raise ValueError("Pipeline: layers must be one model (linen or NNX) or a non-empty "
                         "list of flax.linen Modules; NNX layers go in one nnx.Module "
                         "(e.g. an nnx.List of them, called in order).")
    return layers


def one_microbatch(sample: PyTree, n: int) -> PyTree:
    """The first microbatch of `sample` when it divides into `n` (data x microbatches),
    else `sample` as given (one microbatch already, or one example)."""
    b = batch_size_of(sample, "sample_inputs")
    rows = b // n if b % n == 0 else b
    return jax.tree.map(lambda a: jnp.asarray(a)[:rows], sample)


# The step a missing rng's message names for train_step (also for a tied model's, which
# runs value_and_grad inside).
TRAIN_STEP_CALL = "train_step(loss_fn, optimizer)(variables, opt, inputs, targets, rng=key)"
# The outermost call in progress: a step built on another (a tied model's train_step runs
# value_and_grad) names the call the user made, not the one inside.
_OUTER_CALL: contextvars.ContextVar = contextvars.ContextVar("rng_hint_call", default=None)


@contextlib.contextmanager
def rng_hint(call: str, train: bool = True):
    """flax's missing-rng error names a module, not the fix; name the fix (for the mode
    the call runs in: a VAE samples in evaluation mode too)."""
    token = _OUTER_CALL.set(_OUTER_CALL.get() or call)
    try:
        yield
    except flax.errors.InvalidRngError as e:
        mode = "while training" if train else "in evaluation mode (train=False)"
        raise ValueError(f"Pipeline: a layer draws random numbers (e.g. Dropout) {mode}; "
                         f"pass rng=: pipe.{_OUTER_CALL.get()}. ({str(e).splitlines()[0]})"
                         ) from e
    finally:
        _OUTER_CALL.reset(token)


@contextlib.contextmanager
def outside_context_mesh():
    """Runs a pipeline call with no context mesh and no flax logical axis rules. The
    pipeline places every value on its own mesh; a stage traced under a user's
    `jax.set_mesh(mesh)` (Auto axes) and replayed in the step's shard_map (Manual axes)
    failed with "context mesh ... should match the aval mesh". A user's
    `nn.logical_axis_rules` turned a layer's logical constraints into constraints over
    the step's manual axes (a `DenseGeneral`'s 4-D names on its flat kernel: jax's "only
    valid for values of rank at least 4"; FSDP rules: "data is not found in mesh").
    Inside a user's jit the mesh cannot be unset: refused there, with the fix."""
    with nn.logical_axis_rules(()):
        with _no_context_mesh():
            yield


@contextlib.contextmanager
def _no_context_mesh():
    if jax.sharding.get_abstract_mesh().empty:
        yield
        return
    try:
        unset = jax.set_mesh(None)
    except ValueError as e:   # "`set_mesh` can only be used outside of `jax.jit`"
        raise ValueError("Pipeline: called inside jax.jit under jax.set_mesh(mesh); call the "
                         "pipeline's step outside that jit (it is jitted already) or outside "
                         "the set_mesh block.") from e
    with unset:
        yield


@contextlib.contextmanager
def call_hint(sample):
    """The errors of a pipeline call whose messages name a symptom, said with the cause:
    flax's parameter shape errors name a module's initializer (the inputs are shaped
    unlike `sample`, what the variables were made on); jax's mesh errors name devices or
    axis types."""
    try:
        yield
    except (flax.errors.ScopeParamShapeError, flax.errors.ScopeParamNotFoundError) as e:
        shapes = ("" if sample is None else " (per example: " + str(jax.tree.map(
            lambda a: tuple(np.shape(a)[1:]), sample)) + ")")
        raise ValueError(f"Pipeline: the inputs do not fit the packed variables "
                         f"({str(e).splitlines()[0].split(' (https')[0]}); pass inputs "
                         f"shaped like pipe.init's sample_inputs{shapes}, or pack "
                         f"variables made for these inputs.") from e
    except flax.errors.ModifyScopeVariableError as e:
        found = re.search(r'collection "([^"]+)"', str(e))
        raise ValueError(f"Pipeline: a layer updates its {found[1] if found else 'state'!r} "
                         f"collection in evaluation, where state is frozen (e.g. nn.BatchNorm("
                         f"use_running_average=False) fixed in its constructor); leave the "
                         f"mode unset so the pipeline passes it (layers.MODE_FLAGS), or "
                         f"call apply(..., train=True).") from e
    except ValueError as e:
        if "Mesh for all inputs should be equal" in str(e):
            raise ValueError("Pipeline: a layer constrains a value to the mesh (jax.lax."
                             "with_sharding_constraint), whose axes are manual inside the "
                             "pipeline's stages; remove it from the layer, or use "
                             "nn.with_logical_constraint (a single model's constraints the "
                             "splitter drops itself).") from e
        if "incompatible devices" not in str(e):
            raise
        raise ValueError(f"Pipeline: an argument is committed to other devices than the "
                         f"pipeline's mesh (a device of it alone, another mesh or device "
                         f"order: {str(e).splitlines()[0]}); pass numpy arrays, or place "
                         f"them with jax.device_put(x, NamedSharding(pipe.mesh, "
                         f"P('data'))).") from e


def same_pipeline_everywhere(pipe, call: str, trees=()) -> None:
    """With several processes, once per `call`: a ValueError on every process when one
    built its pipeline otherwise (cuts, schedule, microbatches, remat, mesh) or passes
    arguments of other shapes. Cut differently, packing failed in jax's "not the same on
    each process" and steps in gloo ("collective mismatch"), neither naming the cause."""
    if jax.process_count() == 1:
        return
    checked = pipe._cache.setdefault("same_on_every_process", set())
    if call in checked:
        return
    distributed.check_same_everywhere(
        {"boundaries": list(pipe.boundaries), "schedule": pipe.schedule.name,
         "num_microbatches": pipe.num_microbatches, "stages": pipe.num_stages,
         "remat": [[p.stage_remat, list(p.layer_remat)] for p in pipe.programs],
         "zero": bool(pipe.zero), "mesh": dict(pipe.mesh.shape),
         "parameters": dict(pipe.param_len),
         "arguments": distributed.argument_shapes(tuple(trees))},
        seen=f"built its Pipeline or called {call} with",
        fix="build the Pipeline with the same arguments on every process and pass the "
            "global batch's shapes")
    checked.add(call)


def on_every_process(pipe, call: str, *trees):
    """`trees` (inputs, targets) as global arrays when several processes run the pipeline,
    after `same_pipeline_everywhere`; as given with one process. jax.jit reads a numpy
    argument as each process's own value: batches that differed between processes (each
    its own rows, the natural mistake) trained on a mix, silently (a loss of 5.13 against
    the batch's 3.82). Numpy leaves are placed over "data" (jax checks they are the same
    on every process); each process's own rows go through `jaxhybrid.data.place_batch`."""
    if jax.process_count() == 1 or any(isinstance(a, jax.core.Tracer)
                                       for a in jax.tree.leaves(trees)):
        return trees      # inside a jit of the caller's (train.py's step): its arguments
    same_pipeline_everywhere(pipe, call, trees)
    sharding = jax.sharding.NamedSharding(pipe.mesh, jax.sharding.PartitionSpec(DATA))

    def place(a):
        if not np.ndim(a) or np.shape(a)[0] % pipe.data:
            return a     # refused by the step's own checks
        return distributed.place_everywhere(a, sharding, f"Pipeline.{call}: a numpy batch")
    return tuple(jax.tree.map(place, t) for t in trees)


def same_key_everywhere(pipe, call: str, rng):
    """`rng` as one replicated global key when several processes run the pipeline: a key
    of each process's own (`fold_in(key, process_index())`) gave each process another
    loss for the same step, silently. Checked by jax on every call (a few bytes)."""
    return distributed.place_key_everywhere(rng, pipe.mesh, f"Pipeline.{call}: rng")


def _fewer_stages_per_device(sched: Schedule) -> str:
    """How to run fewer stages per device: fewer virtual stages where the schedule takes
    them (interleaved); zbv always runs two (virtual_stages does not change it)."""
    if sched.virtual_stages == 1:
        return ""
    if sched.takes_virtual_stages:
        return " or fewer virtual stages"
    return f" or a schedule with one stage per device ({sched.name} runs {sched.virtual_stages})"
