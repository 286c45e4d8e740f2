"""The SPMD pipeline runtime: `Pipeline` runs heterogeneous Flax layers as stages."""
from jaxhybrid.pipeline.api import Pipeline
from jaxhybrid.pipeline.reference import reference_loss, reference_value_and_grad
from jaxhybrid.pipeline.stages import even_boundaries
from jaxhybrid.schedules import SCHEDULE_NAMES, SCHEDULES, Schedule, make_schedule
from jaxhybrid.splitter.program import stage_boundary  # noqa: F401 (a forced cut in a model)
from jaxhybrid.weighted_loss import WeightedMean

__all__ = ["Pipeline", "Schedule", "make_schedule", "SCHEDULES", "SCHEDULE_NAMES",
           "reference_value_and_grad", "reference_loss", "even_boundaries", "stage_boundary",
           "WeightedMean"]
