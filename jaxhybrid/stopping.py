"""How a training run stops before its last step: a stop signal (after the step in
flight, with a checkpoint), a batch the data cannot give (the steps trained so far are
saved first), and a loss or gradient that is not finite (before it is saved)."""
from __future__ import annotations

import logging
import math

import jax

from jaxhybrid import distributed


class TrainingDiverged(FloatingPointError):
    """The loss or gradient became NaN/Inf; the message names the step."""


def save_stopped(b, state, done: int, last_saved, meta: dict) -> int | None:
    """Checkpoints the last finished step `done` of a run that stops early, where it is
    not saved yet and one process can save alone; returns the last saved step."""
    # A second signal may land inside a step, after its state was donated to it.
    whole = not any(getattr(a, "is_deleted", lambda: False)() for a in jax.tree.leaves(state))
    if done > (last_saved or 0) and jax.process_count() == 1 and whole:
        last_saved = done
        b.ckpt.save(done, b.run.pipe, state, meta)
    logging.warning("stopped after step %d; the last checkpoint is step %s (the "
                    "same command resumes from it)", done, last_saved)
    return last_saved


def steps_until_stopped(first: int, last: int):
    """first .. last, under `distributed.signals_deferred`: a stop signal ends the run
    after the step in flight, its record and its checkpoint (KeyboardInterrupt then).
    One that comes during the last step lets the run finish: it has trained, evaluated
    and saved every step (it ended "stopped", status 143, and a scheduler read it as
    preempted, restarting it to evaluate again)."""
    with distributed.signals_deferred():
        for step in range(first, last + 1):
            yield step
            if distributed.stop_requested() and step < last:
                raise KeyboardInterrupt(distributed.stop_requested())
        if distributed.stop_requested():
            logging.warning("%s came during the last step (%d); the run finished, saved "
                            "and evaluated it", distributed.stop_requested(), last)


def check_finite(m: dict, step: int, t, last_saved, ckpt, from_init: bool = False) -> None:
    """Stops a diverged run before it is checkpointed. The updated parameters count too:
    a finite loss with an overflowing update would otherwise be saved before the next
    step's loss shows it. `from_init`: this step's gradients are the initial parameters'
    (a fresh run's first step: no update, so no learning rate, made them)."""
    if not all(map(math.isfinite, m.values())):
        # A NaN loss beside finite gradients is a value the loss read out of range (a
        # label past the model's classes: jax's gather fills NaN), not a divergence.
        if not math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]):
            cause = ("the loss is not finite but the gradients are: check the targets (a "
                     "label past the model's output size, an index out of range)")
        elif from_init and not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
            # Blamed on the learning rate, which had not been used yet.
            cause = ("the initial parameters already give them, before any update (not the "
                     "learning rate): a numerics problem in the model or its loss (sqrt or "
                     "log at 0, a division by zero, an overflow in a 16-bit dtype); find it "
                     "on one device with jax.config.update('jax_debug_nans', True)")
        else:
            cause = (f"the run diverged; lower train.learning_rate (now {t.learning_rate}) "
                     f"or set train.grad_clip_norm")
        raise TrainingDiverged(
            f"train: non-finite values at step {step} (loss={m['loss']}, grad_norm="
            f"{m['grad_norm']}, param_norm={m['param_norm']}): {cause}; "
            + (f"last checkpoint: step {last_saved} in {ckpt.directory}." if last_saved
               else f"no checkpoint was saved in {ckpt.directory}."))
