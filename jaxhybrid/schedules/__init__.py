"""Pipeline schedules as typed task data (pure numpy; shared by `pipeline/` and `plan/`).

A schedule is a set of tasks (tick, device, kind, stage, microbatch) plus a stage -> device
map. Kinds (`TaskType`):
  F  forward of one stage on one microbatch (stashes the residuals of its vjp);
  B  backward: the full backward, or — when the schedule splits it — only the input
     gradient (the critical path);
  W  the weight-gradient half of a split backward (deferrable; reuses the forward's
     residuals and B's intermediate cotangents, never recomputes the forward);
  U  apply an optimizer update to a device's parameters (after the last backward of
     its stages; with virtual stages it updates all of them, its `stage` is the first).
`stage` counts model stages: with `virtual_stages=v` a pipeline of S devices has S*v
stages and device d runs stages d, d+S, d+2S, ... (interleaved), so activations wrap
from the last device to the first.

The runtime executes the tasks in lock step: in one tick every device runs at most one
task of each kind, in the order F, B, W, U, then activations and gradients move between
devices (`ppermute`). Dependencies (checked by `Schedule.validate`):
  F(k, m) after F(k-1, m) in an earlier tick;
  B(k, m) after B(k+1, m) in an earlier tick, or on the last stage after F(k, m)
          (the same tick is fine: F runs first);
  W(k, m) after B(k, m) (same tick fine);   U(k) after every B / W of stage k.
So a tick lasts as long as its busiest device; `tick_times` / `bubble_fraction` /
`plot` use that, and so does the planner's step time.

Builders (registered in `SCHEDULES`, built by `make_schedule(name, num_stages,
num_microbatches, **options)`, where `num_stages` is the pipeline depth in devices):
  gpipe        all forwards, then all backwards; M microbatches in flight.
  1f1b         one-forward-one-backward; stage s starts backwards after 2(S-1-s)+1
               forwards, so in lock step a steady tick runs one F and one B on every
               device; in flight <= 2S-1, independent of M.
  interleaved  Megatron's interleaved 1F1B (`virtual_stages=v`, default 2): forwards
               in groups of S microbatches per chunk (a short last group merged into
               the one before when that has less bubble), 1F1B steady state; the warm-up
               per device is the smallest that does not stall the lock step.
  zb-h1        zero bubble (Qi et al. 2024): backward split into B and W, one task per
               tick; B first, then F, and W fills what would be bubble; stashed
               residuals plus B->W cotangents capped at 1f1b's peak 2S-1 rows.
               Bubble (S-1)/(3M+S-1) with F = B = W.
  zbv          zero-bubble V-shape (Qi et al.): 2 stages per device, d and 2S-1-d;
               half-size stages halve the fill; residual + cotangent rows <= 3S
               half-stages (1.5S stages' worth, below 1f1b's 2S-1).
Asynchronous (`jaxhybrid.schedules.asynchronous`; no flush between updates, U after
each backward window; the `weights` field says which weights a task sees):
  async        naive: forwards and backwards use the newest weights.
  pipedream    weight stashing: a backward uses its forward's weights.
  2bw          two versions, gradients accumulated over a window (PipeDream-2BW).
  spectrain    weight prediction W + s u from the optimizer's last update.
(ZB-H2's extra warm-up cannot shorten a lock-step table: the last device cannot start
before tick S-1, which already bounds zb-h1; so it is not offered.)
Each is a device-order policy placed on ticks by one greedy placer (`place_tasks`).
"""
from jaxhybrid.schedules.builders import (SCHEDULES, forward_schedule, make_schedule,
                                          one_f_one_b_warmup, register_schedule)
from jaxhybrid.schedules import asynchronous   # registers async, pipedream, 2bw, spectrain
from jaxhybrid.schedules.placer import ScheduleDeadlock, place_tasks
from jaxhybrid.schedules.tasks import IDLE, Schedule, Task, TaskType

# Every built-in schedule, synchronous and asynchronous (taken once all have registered;
# `SCHEDULES` also holds those a user registers later).
SCHEDULE_NAMES = tuple(SCHEDULES)

__all__ = ["IDLE", "SCHEDULES", "SCHEDULE_NAMES", "Schedule", "ScheduleDeadlock", "Task",
           "TaskType", "asynchronous", "forward_schedule", "make_schedule", "one_f_one_b_warmup", "place_tasks",
           "register_schedule"]
