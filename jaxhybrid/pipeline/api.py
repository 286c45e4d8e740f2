"""`Pipeline`: heterogeneous Flax layers as pipeline stages on a ("data", "pipe") mesh."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxhybrid.checks import is_int
from jaxhybrid.layers import check_loss_fn, raw_key
from jaxhybrid import distributed, tensor_parallel
from jaxhybrid.mesh import DATA, MODEL, PIPE
from jaxhybrid.pipeline import (async_weights, layouts, optimizer_checks, packing, programs,
                                runtime, tables, zero)
from jaxhybrid.pipeline.arguments import (batch_size_of, call_hint, check_plan_inputs,
                                          check_plan_matches,
                                         check_state_order, checked_mesh, checked_schedule,
                                         checked_layers, checked_zero, on_every_process,
                                         outside_context_mesh,
                                         rng_hint, same_key_everywhere, TRAIN_STEP_CALL)
from jaxhybrid.pipeline.planning import PipelinePlanning
from jaxhybrid.pipeline.variables import PipelineVariables
from jaxhybrid.pipeline.stages import (StageProgram, check_boundaries, check_stage_remat,
                                       even_boundaries, is_layer_flags, policy_by_name,
                                       stage_ranges)
from jaxhybrid.schedules import Schedule, forward_schedule
from jaxhybrid.schedules.asynchronous import synchronous_view, updates_per_call
from jaxhybrid.weighted_loss import per_part

PyTree = Any


class Pipeline(PipelinePlanning, PipelineVariables):
    """Runs `layers` (applied in order) as pipeline stages on `mesh.shape["pipe"]`
    devices (one stage each, or several with virtual stages), each replicated over
    `mesh.shape["data"]` data-parallel replicas.

    Args:
      layers: flax.linen Modules; each one's output pytree is the next one's input. Or one
        model (flax.linen / flax.nnx Module, or a `jaxhybrid.splitter.SplitModel`): it is
        split into pieces that act as the layers (docs/splitter.md); `init`, `pack` and
        `unpack` then use the model's own variable tree.
      mesh: a Mesh with axes "data" and "pipe" (`jaxhybrid.make_mesh`).
      num_microbatches: M; each data replica's batch is split into M microbatches.
      schedule: a name in `jaxhybrid.schedules.SCHEDULES` ("gpipe", "1f1b",
        "interleaved", "zb-h1", "zbv", or one you registered) or a `Schedule` built for
        (pipe, num_microbatches). `pipe.num_stages` = pipe x its virtual stages.
      virtual_stages: stages per device of schedule="interleaved" (default 2).
      boundaries: first layer index of stages 1..num_stages-1; None = the planner's
        cost-balanced split (decided in `init`, from the layers profiled on one microbatch).
      remat: "none" | "full" (recompute each stage from its input) | a
        `jax.checkpoint_policies` name | a per-stage list of those or of per-layer bool
        lists (e.g. ["full", [True, False]]) | a list of one bool per layer (recompute
        that layer) | "auto" (the planner's per-layer choice so that
        every stage fits `memory_budget`; no recompute without a budget).
      memory_budget: bytes per device (int or "16GB") for remat="auto";
        param_state_factor: what the training step holds per parameter byte, for the
        planner (default 4: parameters, gradients, Adam's two moments).
      topology: a `jaxhybrid.plan.Topology` or spec string; the planner then weighs the
        boundary transfers over the links each cut crosses.
      plan: a `jaxhybrid.plan.Plan` to run as is (boundaries and remat from it).
      call_kwargs: constant keyword arguments of a single model's call.
      sample_inputs: lets a single model be split here (else in `init`); needed for
        explicit `boundaries` (piece indices) on a model.
      zero: 1 = ZeRO stage 1 over "data" for `init_optimizer` / `train_step`: each data
        replica keeps 1 / data of the optimizer state (`jaxhybrid.pipeline.zero`).

    `pipe.plan` is the plan in use (`.summary()`, `.to_json()`, `.plot(path)`); it is
    made by `init` and, for explicit boundaries, on first access after `init`.
    """

    def __init__(self, layers: Sequence[nn.Module], *, mesh: Mesh, num_microbatches: int = 1,
                 schedule: str | Schedule = "1f1b", boundaries: Sequence[int] | None = None,
                 remat: Any = "auto", memory_budget: int | str | None = None,
                 param_state_factor: float = 4,
                 topology: Any = None, plan: Any = None, virtual_stages: int | None = None,
                 call_kwargs: dict | None = None, sample_inputs: PyTree = None,
                 zero: int = 0):
        from jaxhybrid.splitter.pipeline_hooks import for_pipeline   # one model -> pieces
        remat = policy_by_name(remat)
        if isinstance(remat, (list, tuple)):
            remat = [policy_by_name(r) for r in remat]
        self.splitter, layers = for_pipeline(layers, mesh, call_kwargs, sample_inputs,
                                             num_microbatches)
        if self.splitter is not None:
            self.splitter.check_counted_options(boundaries, plan, remat)
        self.layers = checked_layers(layers)
        self.mesh = checked_mesh(mesh)
        # Tensor parallelism: stage buffers are stacked over (pipe, model) shards.
        self.model = int(dict(mesh.shape).get(MODEL, 1))
        self.stage_spec = P((PIPE, MODEL)) if MODEL in mesh.axis_names else P(PIPE)
        self._split_dims = None   # per layer: {collection: tree of the dim split over "model"}
        self._degree_checked = False   # `degree_check` ran on the first packed values
        if self.model > 1 and self.splitter is not None:
            raise ValueError("Pipeline: a mesh with model > 1 needs a list of layers (the "
                             "tensor-parallel layouts come from each layer's init): pass the "
                             "model's blocks as layers written with jaxhybrid.tensor_parallel "
                             "(docs/pipeline.md), or use a mesh with model=1.")
        self.pipe_size = int(mesh.shape[PIPE])
        self.data = int(mesh.shape[DATA])
        self.zero = checked_zero(zero)
        if not is_int(num_microbatches) or num_microbatches < 1:
            raise ValueError(f"Pipeline: num_microbatches={num_microbatches!r} must be an int >= 1.")
        self.num_microbatches = int(num_microbatches)
        self.schedule = checked_schedule(schedule, self.pipe_size, self.num_microbatches,
                                          virtual_stages, self.zero, len(self.layers))
        # A "stage" is a piece of the model: S x v of them with v virtual stages per device.
        self.num_stages = self.schedule.num_stages
        L, S = len(self.layers), self.num_stages
        if memory_budget is not None and remat != "auto":
            raise ValueError(f"Pipeline: memory_budget needs remat='auto' (got remat={remat!r}); "
                             f"drop one of them.")
        self.memory_budget, self.topology = memory_budget, topology
        self.param_state_factor = param_state_factor
        check_plan_inputs(memory_budget, topology)
        self._plan, self._sample = None, None
        self._layer_vars = None   # per layer: {collection: tree of ShapeDtypeStruct}
        self._init_program = None   # the jitted initialiser of `init_layers`
        self._cache: dict = {}
        self._generation = 0   # bumped with each new layout: steps' own traces go stale
        if plan is not None:
            if plan.num_layers != L or plan.num_stages != S:
                raise ValueError(f"Pipeline: the plan is for {plan.num_layers} layers on "
                                 f"{plan.num_stages} stages, this pipeline has {L} layers on "
                                 f"{S}; make a plan for this model and mesh.")
            check_plan_matches(plan, self.schedule, self.num_microbatches, self.data,
                               memory_budget)
            boundaries, remat = plan.boundaries, (plan.pipeline_remat if remat == "auto" else remat)
            self._plan = plan
        # Planner decisions wait for `init` (they need input shapes); until then an even
        # split stands in so the object is usable for pack/unpack of explicit layouts.
        self._needs_plan = boundaries is None or (remat == "auto" and memory_budget is not None)
        self._planner_cuts = boundaries is None
        if (self._planner_cuts and isinstance(remat, (list, tuple)) and len(remat) == S
                and any(is_layer_flags(r) for r in remat)):
            raise ValueError("Pipeline: remat lists some stages' own layers, but the planner "
                             "chooses the cuts (boundaries=None): give boundaries=, or one bool "
                             "per layer, or per stage 'full' / 'none' / a policy.")
        self._set_layout(even_boundaries(L, S) if boundaries is None
                         else check_boundaries(boundaries, L, S), remat)
        if plan is not None and self.programs != self._stage_programs(plan.pipeline_remat):
            # It ran the remat given while `pipe.plan` described (and priced) the plan's.
            raise ValueError(f"Pipeline: plan= runs the plan as is, recomputing "
                             f"{plan.pipeline_remat!r}, and remat={remat!r} differs; drop "
                             f"remat=, or reuse the plan's split with "
                             f"boundaries=plan.boundaries, remat={remat!r} instead of plan=.")
        if self.splitter is not None:
            self.value_and_grad = self.splitter.wrap_value_and_grad(self, self.value_and_grad)
            self.train_step = self.splitter.wrap_train_step(self, self.train_step)

    def _set_layout(self, boundaries, remat) -> None:
        self.boundaries = list(boundaries)
        self.ranges = stage_ranges(self.boundaries, len(self.layers))
        self.remat = remat
        self.programs = self._stage_programs(remat)
        self._reset_caches()

    def _reset_caches(self) -> None:
        self._cache.clear()
        self._generation += 1

    # --- stage set-up ---------------------------------------------------------------
    def _stage_programs(self, remat) -> list[StageProgram]:
        S, L = self.num_stages, len(self.layers)
        if isinstance(remat, str):
            if remat == "auto":
                remat = "none"
            per_stage, per_layer = [check_stage_remat(remat)] * S, [False] * L
        elif isinstance(remat, (list, tuple)) and len(remat) == L and all(
                isinstance(r, (bool, np.bool_)) for r in remat) and not (
                len(remat) == S and any(isinstance(r, str) for r in remat)):
            per_stage, per_layer = ["none"] * S, [bool(r) for r in remat]
        elif isinstance(remat, (list, tuple)) and len(remat) == S and all(
                isinstance(r, str) or is_layer_flags(r) for r in remat):
            # Per stage: a stage-wide choice, or that stage's own per-layer flags (a plan
            # recomputing some stages whole and single layers in others).
            per_stage, per_layer = [], []
            for s, (r, (a, b)) in enumerate(zip(remat, self.ranges)):
                if isinstance(r, str):
                    per_stage.append(check_stage_remat(r))
                    per_layer += [False] * (b - a)
                elif len(r) != b - a:
                    raise ValueError(f"Pipeline: remat[{s}] has {len(r)} bools, stage {s} "
                                     f"has {b - a} layers ({a}..{b - 1}): give one per layer.")
                else:
                    per_stage.append("none")
                    per_layer += [bool(f) for f in r]
        else:
            raise ValueError(f"Pipeline: remat={remat!r} must be 'none', 'full', 'auto', a "
                             f"jax.checkpoint_policies name, a list of {S} entries (one per "
                             f"stage: one of those, or a list of bools, one per layer of the "
                             f"stage), or a list of {L} bools (one per layer).")
        return [StageProgram(s, a, b, per_stage[s], tuple(per_layer[a:b]))
                for s, (a, b) in enumerate(self.ranges)]

    @property
    def device_layers(self) -> list[list[int]]:
        """Per pipe device, the layers whose variables its buffers hold, in stage order."""
        sd = self.schedule.stage_device
        return [[i for k in range(self.num_stages) if sd[k] == d for i in range(*self.ranges[k])]
                for d in range(self.pipe_size)]

    def _set_layer_vars(self, abstract: list[dict]) -> None:
        """Lays the buffers out for per-layer variables given as `abstract_layer_vars`."""
        self._layer_vars = abstract
        colls = sorted({c for v in abstract for c in v})
        self.state_collections = [c for c in colls if c != "params"]
        # param_layouts[d][c]: device d's row of buffers (all its stages' layers);
        # stage_layouts[k][c]: stage k's part of its device's row.
        self.param_layouts = [{} for _ in range(self.pipe_size)]
        self.stage_layouts = [{} for _ in range(self.num_stages)]
        sd, lengths = self.schedule.stage_device, {}
        for c in ["params", *self.state_collections]:
            tree = lambda i: abstract[i].get(c, {})
            rows, lengths[c] = packing.shared_layouts(
                [[tree(i) for i in layers] for layers in self.device_layers])
            for d, row in enumerate(rows):
                self.param_layouts[d][c] = row
                mine = [k for k in range(self.num_stages) if sd[k] == d]
                parts = packing.split_layout(row, [[tree(i) for i in range(*self.ranges[k])]
                                                   for k in mine])
                for k, part in zip(mine, parts):
                    self.stage_layouts[k][c] = part
        self.param_len = (zero.round_rest_lengths(lengths["params"], self.data) if self.zero
                          else lengths["params"])
        self.state_len = {c: lengths[c] for c in self.state_collections}
        self._reset_caches()

    @property
    def layer_shapes(self) -> list[dict]:
        """Per layer (piece, for a split model): {collection: tree of
        jax.ShapeDtypeStruct}, known after `init` or `pack`."""
        self._require_vars()
        return list(self._layer_vars)

    def _require_vars(self):
        if self._layer_vars is None:   # pack needs stages: before the planner's, init only
            raise ValueError("Pipeline: call pipe.init(rng, sample_inputs) first." if self._needs_plan
                             else "Pipeline: call pipe.init(rng, sample_inputs) or "
                                  "pipe.pack(per_layer) first.")

    def _stage(self, k: int) -> runtime.Stage:
        """Stage k as the runtime sees it (its state as {collection: per-layer trees})."""
        a, b = self.ranges[k]
        has = [set(self._layer_vars[i]) for i in range(a, b)]
        colls, prog, layers = self.state_collections, self.programs[k], self.layers

        def apply(params, state, x, *, train, rng, microbatch):
            per_layer = [{c: state[c][j] for c in colls if c in has[j]} for j in range(b - a)]
            y, new = prog.apply(layers, params, per_layer, x, train=train, rng=rng,
                                microbatch=microbatch)
            return y, {c: [st.get(c, {}) for st in new] for c in colls}

        return runtime.Stage(
            apply=apply, params=self.stage_layouts[k]["params"],
            state={c: self.stage_layouts[k][c] for c in colls},
            abstract_params=[self._layer_vars[i].get("params", {}) for i in range(a, b)],
            abstract_state={c: [self._layer_vars[i].get(c, {}) for i in range(a, b)] for c in colls})

    def engine(self) -> runtime.Engine:
        """The runtime's explicit view of this pipeline (stages, buffer lengths, sizes)."""
        self._require_vars()
        return runtime.Engine(tuple(self._stage(k) for k in range(self.num_stages)),
                              self.param_len, self.state_len, self.data, self.num_microbatches,
                              self.zero)

    def make_plan(self, sample_inputs: PyTree) -> None:
        """Takes the planner's decisions (stage boundaries, remat) from the layers'
        costs on one microbatch of `sample_inputs`; `init` calls it (a second call does
        nothing), `scripts/train.py` first, to time planning on its own. On several
        processes every one must call it (through `init`): all plan from process 0's
        measured costs, so all cut the same stages."""
        self._sample = self._microbatch_sample(sample_inputs)
        if self.splitter is not None:
            self.splitter.attach(self)
        if self._needs_plan:
            # Several processes run one program: all plan from process 0's measured
            # costs (timings differ from host to host, and so would the cuts).
            plan = self._make_plan(fixed=not self._planner_cuts,
                                   costs=distributed.process_0s(self._layer_costs()))
            self._plan, self._needs_plan = plan, False
            if self.remat == "auto":
                async_weights.check_planned_remat(self.schedule, plan, self.memory_budget)
            self._set_layout(plan.boundaries, plan.pipeline_remat if self.remat == "auto" else self.remat)

    # --- execution ------------------------------------------------------------------
    def _microbatch(self, tree: PyTree, what: str) -> PyTree:
        b = batch_size_of(tree, what)
        n = self.data * self.num_microbatches
        if b % n:
            raise ValueError(f"Pipeline: {what} batch {b} is not divisible by data x "
                             f"num_microbatches = {self.data} x {self.num_microbatches} = {n}; "
                             f"use a batch that is a multiple of {n}.")
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((b // n, *np.shape(a)[1:]), a.dtype), tree)

    def _layouts(self, mb_inputs, mb_targets, loss_fn, train, rng, traced: dict | None = None):
        """The stage layouts, with `loss_fn` traced into the last stage's; kept in
        `traced`, the cache of one `value_and_grad` / `train_step` call, so that a new
        call traces the loss anew (as `jax.jit(jax.value_and_grad(f))` does: a loss object
        whose attributes changed kept its first trace), and a loss need not be hashable
        (None: traced afresh, for benches). The last ones are `_cache["last_layouts"]`."""
        traced = {} if traced is None else traced
        key = (self._generation, jax.tree.structure(mb_inputs), str(mb_inputs),
               str(mb_targets), train, rng is not None)
        if key not in traced:
            with tensor_parallel.degree(self.model):   # local shapes, "model" bound
                traced[key] = layouts.stage_layouts(
                    self.engine(), mb_inputs, mb_targets, loss_fn, train, rng,
                    split=self.schedule.split_backward)
        self._cache["last_layouts"] = traced[key]
        return traced[key]

    def _control(self, sched: Schedule) -> tables.ControlTable:
        key = ("control", sched)
        if key not in self._cache:
            self._cache[key] = tables.control_table(sched)
        return self._cache[key]

    def _train_body(self, loss_fn, inputs, targets, rng, train, optimizer, traced):
        """The per-device program of one step, for these shapes."""
        mb_in, mb_tg = self._microbatch(inputs, "inputs"), self._microbatch(targets, "targets")
        if batch_size_of(inputs, "inputs") != batch_size_of(targets, "targets"):
            # Else microbatch m of the inputs met another slice of the targets in loss_fn.
            raise ValueError(f"Pipeline: inputs have batch {batch_size_of(inputs, 'inputs')}, "
                             f"targets {batch_size_of(targets, 'targets')}; pass one target "
                             f"row per input example.")
        check_state_order(self.schedule, self._layer_vars, self.ranges, train)
        eng = self.engine()
        if self.num_stages == 1 and optimizer is None:
            return programs.single_stage_program(eng, loss_fn, train, rng is not None)
        rng_aval = jax.ShapeDtypeStruct(rng.shape, rng.dtype) if rng is not None else None
        lay = self._layouts(mb_in, mb_tg, loss_fn, train, rng_aval, traced)
        if optimizer is not None:
            async_weights.check_layer_remat(self.schedule, eng, mb_in, train, rng_aval)
        # Without an optimizer an asynchronous schedule computes the gradient of the
        # current weights (its table without U tasks).
        sched = (self.schedule.with_updates() if optimizer is not None
                 else synchronous_view(self.schedule))
        job = runtime.Job(eng, lay, loss_fn, train, rng is not None, sched.split_backward,
                          sched.weights)
        return runtime.train_program(job, self._control(sched), optimizer and
                                     async_weights.pipeline_optimizer(optimizer, sched,
                                                                      self.num_microbatches))

    def _run_step(self, loss_fn, train, optimizer, traced, variables, opt_state, inputs,
                  targets, rng):
        with tensor_parallel.degree(self.model):   # layers trace at their local shapes
            return self._run_step_body(loss_fn, train, optimizer, traced, variables, opt_state,
                                       inputs, targets, rng)

    def _run_step_body(self, loss_fn, train, optimizer, traced, variables, opt_state, inputs,
                       targets, rng):
        rng_arg = raw_key(rng if rng is not None else jax.random.key(0))
        # A WeightedMean (a mean per token): each microbatch's share of the batch's mean,
        # or under an asynchronous schedule's updates, of its update window's.
        loss_fn, targets = per_part(loss_fn, targets, self.data * self.num_microbatches,
                                    data=self.data, windows=updates_per_call(self.schedule)
                                    if optimizer is not None else 1)
        body = self._train_body(loss_fn, inputs, targets, None if rng is None else rng_arg,
                                train, optimizer, traced)
        state = {c: variables[c] for c in self.state_collections}
        opt_spec = zero.opt_state_specs(opt_state, self.zero and optimizer is not None,
                                        self.stage_spec)
        st = self.stage_spec
        return jax.shard_map(
            body, mesh=self.mesh,
            in_specs=(st, st, opt_spec, P(DATA), P(DATA), P()),
            out_specs=(P(), st, st, st, opt_spec), check_vma=False,
        )(variables["params"], state, opt_state, inputs, targets, rng_arg)

    def value_and_grad(self, loss_fn: Callable, *, train: bool = True) -> Callable:
        """Returns f(variables, inputs, targets, rng=None) -> (loss, grads, new_variables).

        loss is the mean of `loss_fn(outputs, targets)` over the data x M microbatches
        of the global batch, or a `jp.WeightedMean`'s mean over the whole batch (a plain
        per-token or summed loss depends on data x M: docs/pipeline.md, "What the loss
        means"); each call traces `loss_fn` anew;
        grads (same structure as variables["params"]) its gradient;
        new_variables carry the updated mutable collections (e.g. batch_stats, updated
        per microbatch in order, then averaged over data replicas)."""
        self._require_vars()
        check_loss_fn(loss_fn, "Pipeline.value_and_grad")

        traced: dict = {}

        def _step(variables, inputs, targets, rng=None):
            loss, grads, new_state, _, _ = self._run_step(loss_fn, train, None, traced,
                                                          variables, None, inputs, targets, rng)
            return loss, grads, new_state

        jitted = jax.jit(_step)

        def step(variables, inputs, targets, rng=None):
            packing.check_packed(variables, self.abstract_variables(), "value_and_grad")
            inputs, targets = on_every_process(self, "value_and_grad", inputs, targets)
            rng = same_key_everywhere(self, "value_and_grad", rng)
            with rng_hint("value_and_grad(loss_fn)(variables, inputs, targets, rng=key)"), \
                    self._fit_hint():
                loss, grads, new_state = jitted(variables, inputs, targets, rng)
            # Merged outside the jit: returning the unchanged params from it would make
            # XLA copy the whole parameter buffer every step.
            return loss, grads, {**variables, **new_state}

        step.lower = jitted.lower   # for memory_analysis / cost_analysis of the step
        return step

    def init_optimizer(self, optimizer, variables: dict):
        """`optimizer.init` on the packed parameters (slots sharded like them; with
        zero=1 also over "data", see `jaxhybrid.pipeline.zero`); for an asynchronous
        schedule, of the optimizer its U tasks run (`async_weights`)."""
        self._require_vars()
        optimizer_checks.check_per_element(optimizer, self.param_len)
        optimizer = async_weights.pipeline_optimizer(optimizer, self.schedule,
                                                     self.num_microbatches)
        with outside_context_mesh():
            return async_weights.init_on_packed(lambda p: zero.init_optimizer(
                optimizer, p, self.mesh, self.stage_spec, bool(self.zero)), variables["params"])

    def train_step(self, loss_fn: Callable, optimizer, *, train: bool = True,
                   donate: bool = False) -> Callable:
        """Returns f(variables, opt_state, inputs, targets, rng=None) -> (loss, grads,
        new_variables, new_opt_state): the optimizer runs inside the pipeline, as U tasks
        after each device's last backward (gradients averaged over "data" first). The
        optimizer must act per parameter (optax's adam, sgd, masked weight decay...):
        it sees one device's buffers at a time, so a global-norm clip would see a part
        (refused: `optimizer_checks.check_per_element`). donate: the step takes over the
        buffers of `variables` and `opt_state` (unusable after the call) and writes the
        new ones into them, as the planner's memory model assumes; wrapping the step in
        your own `jax.jit(..., donate_argnums=(0, 1))` deletes them but reuses none."""
        self._require_vars()
        check_loss_fn(loss_fn, "Pipeline.train_step")
        optimizer_checks.check_per_element(optimizer, self.param_len)
        async_weights.check_remat(self.schedule, self.programs)
        expected_state = async_weights.init_on_packed(functools.partial(
            jax.eval_shape, async_weights.pipeline_optimizer(
                optimizer, self.schedule, self.num_microbatches).init),
            self.abstract_variables()["params"])

        traced: dict = {}

        def _step(variables, opt_state, inputs, targets, rng=None):
            # Every pipeline depth (one stage too) runs the optimizer as U tasks.
            loss, grads, new_state, params, opt_state = self._run_step(
                loss_fn, train, optimizer, traced, variables, opt_state, inputs, targets, rng)
            return loss, grads, {**variables, **new_state, "params": params}, opt_state

        # The budget is checked on the step with its variables and optimizer state
        # donated, as the planner models it (scripts/train.py runs it so): a step that
        # is not also holds the old buffers, and was warned about at 1.4x a plan whose
        # donated step fitted (17 of 24 budgets a probe set).
        donated = jax.jit(_step, donate_argnums=(0, 1))
        jitted = donated if donate else jax.jit(_step)
        budget_checked: set = set()   # the batch sizes whose step was checked

        def step(variables, opt_state, inputs, targets, rng=None):
            packing.check_packed(variables, self.abstract_variables(), "train_step")
            async_weights.check_opt_state(opt_state, expected_state, not self.zero)
            if donate:
                packing.check_donatable(variables, opt_state, "Pipeline.train_step")
            inputs, targets = on_every_process(self, "train_step", inputs, targets)
            rng = same_key_everywhere(self, "train_step", rng)
            args = (variables, opt_state, inputs, targets, rng)
            with rng_hint(TRAIN_STEP_CALL), self._fit_hint():
                if (self.memory_budget is not None
                        and (rows := batch_size_of(inputs, "inputs")) not in budget_checked):
                    # Compiled ahead, once per batch size: a later, larger batch than the
                    # first call's needed 3.4x the budget, unchecked.
                    budget_checked.add(rows)
                    self._warn_over_budget(donated.lower(*args).compile(),
                                           rows // (self.data * self.num_microbatches))
                return jitted(*args)

        step.lower = jitted.lower
        return step

    def apply(self, variables: dict, inputs: PyTree, *, train: bool = False,
              rng: jax.Array | None = None) -> PyTree:
        """Forward pass of the whole model over the global batch; returns the last
        layer's outputs, sharded over "data": batch-major leaves (leading axis the
        microbatch size) as one batch, any other leaf (a scalar such as an auxiliary
        loss, a parameter the model returns) one value per microbatch, [data x M, ...]
        in batch order. Mutable state is not updated."""
        self._require_vars()
        packing.check_packed(variables, self.abstract_variables(), "apply")
        inputs, = on_every_process(self, "apply", inputs)
        rng = same_key_everywhere(self, "apply", rng)
        key = ("apply", train, rng is not None)
        if key not in self._cache:
            self._cache[key] = jax.jit(functools.partial(self._apply, train=train))
        with self._fit_hint():
            return self._cache[key](variables, inputs, rng)

    def _apply(self, variables, inputs, rng, *, train):
        with rng_hint("apply(variables, inputs, train=True, rng=key)" if train else
                       "apply(variables, inputs, rng=key)", train), \
                tensor_parallel.degree(self.model):
            mb_in = self._microbatch(inputs, "inputs")
            rng_arg = raw_key(rng if rng is not None else jax.random.key(0))
            lay = layouts.forward_layouts(self.engine(), mb_in, train, jax.ShapeDtypeStruct(
                rng_arg.shape, rng_arg.dtype) if rng is not None else None)
            body = programs.forward_program(self.engine(), lay,
                                            self._control(forward_schedule(self.schedule)),
                                            rng is not None)
            state = {c: variables[c] for c in self.state_collections}
            params = (variables["params"] if self.splitter is None
                      else self.splitter.tie_params(self, variables["params"]))
            return jax.shard_map(body, mesh=self.mesh,
                                 in_specs=(self.stage_spec, self.stage_spec, P(DATA), P()),
                                 out_specs=P(DATA), check_vma=False)(
                params, state, inputs, rng_arg)

    @contextlib.contextmanager
    def _fit_hint(self):
        with outside_context_mesh(), call_hint(self._sample):
            yield

