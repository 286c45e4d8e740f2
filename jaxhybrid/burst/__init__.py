"""Burst parallelism (DeepPool): per-layer device counts over the data axis, and a
background job multiplexed into the idle device time. See docs/burst.md.

    from jaxhybrid import burst
    prog = burst.BurstProgram(layers, loss_fn, widths=plan.widths, mesh=mesh, batch_size=B)
    loss, grads, new_vars = burst.value_and_grad(prog, burst.replicate(variables, mesh),
                                                 inputs, targets, rng)
"""
from jaxhybrid.burst.executor import (BurstProgram, TrainState, data_parallel_widths,
                                      first_copy, init_train_state, replicate, train_step,
                                      value_and_grad)
from jaxhybrid.burst.reference import reference_value_and_grad

__all__ = ["BurstProgram", "TrainState", "value_and_grad", "train_step", "init_train_state",
           "replicate",
           "first_copy", "data_parallel_widths", "reference_value_and_grad"]
