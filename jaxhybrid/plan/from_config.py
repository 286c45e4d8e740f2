"""`plan_from_config`: a training config's model profiled and planned, the library side
of scripts/plan.py (the same reading of the config as `jaxhybrid.train`'s pipeline)."""
from __future__ import annotations

from jaxhybrid.plan.planner import checked_budget, checked_topology, make_plan
from jaxhybrid.plan.topology import Topology
from jaxhybrid.schedules import make_schedule


def step_param_factor(optimizer: str = "adamw", momentum: float = 0.9,
                      weight_decay: float = 0.0, model: int = 1) -> float:
    """Bytes `jaxhybrid.train`'s step holds per parameter byte: parameters, gradients, the
    optimizer's slots, and the packed weight-decay mask and norm weights it passes
    (`jaxhybrid.optim`). With Adam's 4 alone, plans under a budget compiled 13% over it
    (GPT tiny with weight decay: the mask is a parameter-sized argument)."""
    slots = {"adamw": 2, "sgd": 1 if momentum > 0 else 0}.get(optimizer, 2)
    return 2 + slots + (weight_decay > 0) + (model > 1)


def plan_from_config(config, *, topology: str | Topology | None = None, memory_budget=None,
                     stages: int | None = None, measure: bool = False, objective: str | None = None,
                     hardware="stored"):
    """Profiles the config's model on one microbatch and plans it: the library side of
    scripts/plan.py. Reads config.model.{name,size,overrides}, config.mesh.{data,pipe,model},
    config.train.zero,
    config.pipeline.{schedule,num_microbatches,remat,memory_budget,boundaries},
    config.train.batch_size. `memory_budget` (argument) overrides the config's, which is
    used only with pipeline.remat="auto" (as `Pipeline` does). hardware: "stored" (this
    device kind's stored calibration, `calibration.stored_hardware`, if any), a
    `Hardware`, or None (no engine terms). Returns (plan, costs)."""
    from jaxhybrid.models import get_model   # plan/ may use models, never pipeline/
    from jaxhybrid.plan.costs import profile

    def get(section, key, default=None):
        sec = config.get(section, None) if hasattr(config, "get") else getattr(config, section, None)
        if sec is None:
            return default
        val = sec.get(key, default) if hasattr(sec, "get") else getattr(sec, key, default)
        return default if val is None else val

    name = get("model", "name")
    if not name:
        raise ValueError("plan_from_config: config.model.name is missing; set it or pass --model.")
    overrides = get("model", "overrides", {})
    overrides = dict(overrides.to_dict() if hasattr(overrides, "to_dict") else overrides)
    spec = get_model(name, size=get("model", "size", "tiny"), **overrides)
    data, S = int(get("mesh", "data", 1)), int(stages or get("mesh", "pipe", 1))
    if data < 1 or S < 1:
        raise ValueError(f"plan_from_config: mesh data={data} x pipe={S} must both be >= 1 "
                         f"(planning needs explicit sizes, not -1).")
    M = int(get("pipeline", "num_microbatches", 1))
    if M < 1:
        raise ValueError(f"plan_from_config: pipeline.num_microbatches={M} must be >= 1.")
    batch = int(get("train", "batch_size", M * data))
    if batch < 1:   # 0 planned microbatches of 0 examples; < 0 failed inside numpy
        raise ValueError(f"plan_from_config: train.batch_size={batch} (--batch_size) must be "
                         f">= 1, a multiple of data={data} x num_microbatches={M}.")
    if batch % (data * M):
        raise ValueError(f"plan_from_config: train.batch_size={batch} is not divisible by data={data} "
                         f"x num_microbatches={M}; pick a batch size that is.")
    remat = get("pipeline", "remat", "auto")
    budget = memory_budget
    if budget is None and remat == "auto":
        budget = get("pipeline", "memory_budget")
    cuts = get("pipeline", "boundaries")
    schedule = get("pipeline", "schedule", "1f1b")
    v = int(get("pipeline", "virtual_stages", 2)) if schedule == "interleaved" else 1
    if v < 1:   # 0 was read as 1 by the schedule, then refused by make_plan after profiling
        raise ValueError(f"plan_from_config: pipeline.virtual_stages={v} (--virtual_stages) "
                         f"must be >= 1.")
    # What can be wrong without the costs is checked before profiling (minutes for a big
    # model): the budget, the topology, the schedule, and stages against layers.
    budget = None if budget is None else checked_budget(budget, "plan_from_config: memory_budget")
    # virtual_stages=1 passed on too (left out, interleaved's builder takes 2: the planner
    # planned twice the stages train.py runs); make_plan gets this table, as Pipeline
    # passes its own.
    sched = make_schedule(schedule, S, M,
                          **({"virtual_stages": v} if schedule == "interleaved" else {}))
    if cuts is not None and len(cuts) != sched.num_stages - 1:   # e.g. --stages changed
        raise ValueError(f"plan_from_config: pipeline.boundaries={list(cuts)} gives "
                         f"{len(cuts) + 1} stages, the plan has {sched.num_stages}; fix or "
                         f"drop pipeline.boundaries (None: the planner's split).")
    if sched.num_stages > len(spec.layers):
        # Named as the stage count came about: with virtual stages "8 stages" was neither
        # the --stages given (4) nor fixable by it alone.
        vs = sched.virtual_stages
        how = (f" (pipe {S} x {vs} virtual stages per device, {sched.name})" if vs > 1 else "")
        fix = ("fewer virtual stages (pipeline.virtual_stages, --virtual_stages)"
               if sched.takes_virtual_stages else "a schedule with one stage per device")
        raise ValueError(f"plan_from_config: {sched.num_stages} stages{how} but the model has "
                         f"only {len(spec.layers)} layers; use fewer stages (--stages)"
                         + (f" or {fix}" if vs > 1 else "") + ".")
    topology = checked_topology(topology, S, data, sched.virtual_stages, "plan_from_config",
                                 "--topology")
    inputs, _ = spec.sample_batch(batch // (data * M))
    costs = profile(spec.layers, inputs, measure=measure)
    if isinstance(hardware, str):
        from jaxhybrid.plan.calibration import stored_hardware
        hardware = stored_hardware()
    model, zero = int(get("mesh", "model", 1)), int(get("train", "zero", 0))
    plan = make_plan(costs, num_stages=S, num_microbatches=M, schedule=sched, virtual_stages=v,
                     hardware=hardware, data=data, topology=topology, memory_budget=budget,
                     model=model, zero_shards=data if zero else 1,
                     objective=objective or get("pipeline", "objective", "bottleneck"),
                     boundaries=None if cuts is None else [int(b) for b in cuts],
                     param_state_factor=step_param_factor(
                         get("train", "optimizer", "adamw"), get("train", "momentum", 0.9),
                         get("train", "weight_decay", 0.0), model))
    return plan, costs
