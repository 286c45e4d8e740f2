"""`Pipeline`'s planning: the layers' measured costs (cached per layers and input
shapes) and the plan made from them (boundaries, remat, predicted time and memory). A
mixin of `Pipeline` (api.py), which holds the settings these methods read."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid import step_memory
from jaxhybrid.pipeline.arguments import batch_size_of, one_microbatch


# remat="auto" under a memory budget: the jax.checkpoint policies tried, in place of the
# layers the planner recomputes, on the stages that recompute (`_with_auto_policies`).
AUTO_POLICIES = ("dots_saveable",)


class PipelinePlanning:
    def _microbatch_sample(self, sample_inputs):
        """One microbatch of `sample_inputs` (the planner's costs are per microbatch)."""
        return one_microbatch(sample_inputs, self.data * self.num_microbatches)

    def _layer_costs(self):
        return (profile_cached(self.layers, self._sample) if self.splitter is None
                else self.splitter.costs(self._sample))   # lowered pieces, no compiles

    def model_flops(self, rows: int) -> float:
        """FLOPs of one forward and backward pass of every layer over `rows` examples:
        XLA's cost analysis of each layer as profiled for the plan (cached; profiled now
        if the plan was not made from costs), recomputation not counted -- the "model
        FLOPs" of model FLOPs utilization. Call after `make_plan` (or `init`)."""
        if self._sample is None:
            raise ValueError("Pipeline.model_flops: call pipe.make_plan(sample_inputs) (or "
                             "pipe.init) first: the layers are profiled on its sample.")
        return float(sum((c.fwd_flops + c.bwd_flops) * rows / c.batch_size
                         for c in self._layer_costs()))

    def _make_plan(self, fixed: bool, costs=None):
        from jaxhybrid import plan as planner   # plan/ never imports pipeline/
        from jaxhybrid.plan.calibration import stored_hardware
        costs = self._layer_costs() if costs is None else costs
        kw = dict(num_stages=self.pipe_size, num_microbatches=self.num_microbatches,
                  schedule=self.schedule, data=self.data, topology=self.topology,
                  model=self.model, zero_shards=self.data if self.zero else 1,
                  hardware=stored_hardware(), remat=self._planned_remat(),
                  whole_stage_remat=self._planned_whole_stages(),
                  param_state_factor=self.param_state_factor, stage_policy=[
                      p.stage_remat if p.stage_remat not in ("none", "full") else None
                      for p in self.programs])
        plan = planner.make_plan(
            costs, memory_budget=self.memory_budget if self.remat == "auto" else None,
            boundaries=self.boundaries if fixed else None, **kw)
        policies = kw["stage_policy"]
        if self.remat == "auto" and self.memory_budget is not None:
            return self._with_auto_policies(plan, costs, kw)
        if any(policies) and self.model == 1:
            # Stages under a jax.checkpoint policy: their memory from the residuals the
            # policy keeps and their backward's time from what it runs again, traced on
            # the cuts made (a device's share of a tensor-parallel layer is not traced:
            # with model > 1 they stay priced as not recomputed).
            from jaxhybrid.pipeline.policy_costs import policy_costs
            kept, again = policy_costs(self.layers, self._sample, plan.stage_ranges, policies)
            plan = planner.make_plan(
                costs, boundaries=plan.boundaries, device_order=plan.device_order,
                policy_kept=kept, policy_recompute=again, **kw)
        return plan

    def _with_auto_policies(self, plan, costs, kw: dict):
        """remat="auto" under a budget: `plan` (layers recomputed, or stages whole, as the
        planner chose) or, where it fits the budget too and its predicted step is
        shorter, the same cuts with every stage that recomputes run under one of
        `AUTO_POLICIES` instead (priced by `policy_costs`: what the policy keeps and what
        its backward runs again). Not with a model axis (a device's share is not traced)
        nor with an asynchronous schedule (its recomputation is checked per layer)."""
        from jaxhybrid import plan as planner
        from jaxhybrid.pipeline.policy_costs import policy_costs
        whole = plan.whole_stage_remat or [False] * plan.num_stages
        recomputes = [w or any(plan.remat[a:b]) for (a, b), w in zip(plan.stage_ranges, whole)]
        if self.model != 1 or not any(recomputes) or self.schedule.weights != "sync":
            return plan
        best = plan
        for name in AUTO_POLICIES:
            policies = [name if r else None for r in recomputes]
            kept, again = policy_costs(self.layers, self._sample, plan.stage_ranges, policies)
            candidate = planner.make_plan(
                costs, memory_budget=self.memory_budget, boundaries=plan.boundaries,
                device_order=plan.device_order, policy_kept=kept, policy_recompute=again,
                **{**kw, "remat": [False] * plan.num_layers, "stage_policy": policies})
            if (candidate.device_memory <= plan.memory_budget
                    and candidate.predicted_step_time < best.predicted_step_time):
                best = candidate
        return best

    def _planned_remat(self) -> list | None:
        """The user's per-layer recompute flags for the planner to predict (it reported
        its own choice, nothing recomputed, whatever ran); None where the planner chooses.
        A stage recomputed whole is `_planned_whole_stages` (make_plan marks its layers
        for whatever cuts it picks: flags taken from the even split standing in before
        planning described other stages than ran); a stage under a jax.checkpoint policy
        has no recompute flags (its memory and recompute time are `policy_costs`')."""
        if isinstance(self.remat, str) and self.remat in ("auto", "none"):
            return None
        return [bool(r) for prog in self.programs for r in prog.layer_remat]

    def _planned_whole_stages(self) -> list | None:
        """Per stage, recomputed whole from its input (a stage's remat "full"); None where
        no stage is or the planner chooses."""
        if self._planned_remat() is None or not any(p.stage_remat == "full"
                                                     for p in self.programs):
            return None
        return [p.stage_remat == "full" for p in self.programs]

    @property
    def plan(self):
        """The plan in use (boundaries, remat per layer, predicted per-stage time/memory):
        the user's remat when given ('full', one bool per layer, or per stage 'none' /
        'full'; a stage's jax.checkpoint policy in `plan.stage_policy`, its memory priced
        from the residuals the policy keeps, its time with what its backward runs again)."""
        if self._plan is None:
            if self._sample is None:
                raise ValueError("Pipeline.plan: call pipe.init(rng, sample_inputs) first (the "
                                 "plan is made from the layers' measured costs).")
            self._plan = self._make_plan(fixed=True)
        return self._plan

    def _warn_over_budget(self, compiled, microbatch_rows: int) -> None:
        """Warns where the compiled training step (of microbatches of `microbatch_rows`;
        its variables and optimizer state donated, as the planner models it) needs more
        than `memory_budget` per device: the planner's model fell short of it
        (docs/planner.md has its errors), or planned another microbatch size."""
        need = step_memory.compiled_bytes(compiled)
        warning = need and step_memory.over_budget(
            need, self.memory_budget, self.plan.device_memory, all(self.plan.remat),
            "remat='full' without a memory_budget")
        planned = (microbatch_rows if self._sample is None
                   else batch_size_of(self._sample, "sample_inputs"))
        if warning and microbatch_rows != planned:
            # The plan holds for init's sample: 1-row microbatches from an 8-row sample
            # planned 208KB, and a batch of 512 compiled to 875KB without a word.
            warning = (f"the plan is for microbatches of {planned} rows (init's sample_inputs"
                       f"), this step's have {microbatch_rows}: give init a sample batch of "
                       f"the training batch's size. {warning}")
        if warning:
            warnings.warn(f"Pipeline.train_step: {warning} (Measured with the variables and "
                          f"optimizer state donated, as train_step(..., donate=True) runs; "
                          f"without it the step holds the old buffers too.)", stacklevel=4)


_PROFILE_CACHE: dict = {}


def profile_cached(layers, sample):
    """Per-layer costs, cached on the layers and the per-example input shapes: pipelines
    that differ in mesh, schedule or microbatch size share one profile (costs per example
    scale linearly to the microbatch at hand)."""
    from jaxhybrid.plan import profile
    rows = int(np.shape(jax.tree.leaves(sample)[0])[0])
    key = (tuple(id(l) for l in layers),
           str(jax.tree.map(lambda a: (np.shape(a)[1:], jnp.asarray(a).dtype), sample)))
    if key not in _PROFILE_CACHE:   # the cached list keeps the layers alive: ids stay unique
        _PROFILE_CACHE[key] = (list(layers), profile(layers, sample))
    costs = _PROFILE_CACHE[key][1]
    return costs if costs[0].batch_size == rows else [c.scaled(rows) for c in costs]
