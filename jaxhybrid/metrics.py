"""Evaluation and metric output of the training program: `evaluate` (metrics over the
test split, padding rows masked, computed where the outputs are) and `MetricWriter`
(workdir/metrics.jsonl, TensorBoard events and the log), `ProfilerTrace` (config.profile:
a jax profiler trace of some steps)."""
from __future__ import annotations

import functools
import itertools
import json
import os
import pathlib
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxhybrid import data

if TYPE_CHECKING:
    from jaxhybrid.train import Run


# Evaluation's keys, for a model that draws in evaluation: fixed, so evaluations repeat.
EVAL_SEED = 0x5EED


@functools.partial(jax.jit, static_argnums=0)
def metric_sums(metrics_fn, outputs, targets, mask):
    """({metric: sum over kept rows of value x count}, sum of counts): metrics_fn per
    row (its "count", default 1, weighs it), rows where mask is False left out. Runs
    where the outputs are, so no process gathers the outputs of the others."""
    one = lambda tree: jax.tree.map(lambda a: a[None], tree)
    n = mask.shape[0]
    leaves, tree = jax.tree_util.tree_flatten_with_path(outputs)
    per_row = [np.ndim(a) > 0 and np.shape(a)[0] == n for _, a in leaves]
    for (path, a), by_row in zip(leaves, per_row):
        if not by_row and not (np.ndim(a) > 0 and n % np.shape(a)[0] == 0):
            raise ValueError(
                f"evaluation: the model's output {jax.tree_util.keystr(path)} "
                f"{tuple(np.shape(a))} has neither a row per example nor one per microbatch "
                f"(the batch has {n} rows); return batch-major outputs, or this one only in "
                f"training (train=True).")
    # An output with one value per microbatch (an auxiliary loss: pipe.apply returns them
    # [data x M, ...]) is seen by each row as the value of its microbatch, as the loss sees
    # it in training.
    expanded = [a if by_row else jnp.repeat(a, n // np.shape(a)[0], axis=0)
                for (_, a), by_row in zip(leaves, per_row)]

    def row(o, t):
        o = tree.unflatten([a[None] if by_row else a for a, by_row in zip(o, per_row)])
        return metrics_fn(o, one(t))
    rows = jax.vmap(row)(expanded, targets)
    count = rows.pop("count", jnp.ones(mask.shape, jnp.float32))
    weight = count * mask
    # where, not v x 0: a left-out row's NaN (padding a model normalises, a label past
    # the classes) made the whole sum NaN.
    return ({k: jnp.sum(jnp.where(weight > 0, v * weight, 0.0)) for k, v in rows.items()},
            jnp.sum(weight))


def evaluate(run: Run, variables, max_batches: int = 0) -> dict:
    """Metrics over the test split (all of it, or the first `max_batches` batches):
    padded rows are dropped by the mask, examples weighed by the metrics' "count"."""
    totals, weight = {}, 0.0
    batches = itertools.islice(run.eval_batches(), max_batches or None)
    for b in itertools.count():
        batch = next(batches, None)
        _check_streams_agree(batch is None, b)
        if batch is None:
            break
        inputs, targets, mask = batch
        inputs, targets, mask = data.place_batch((inputs, targets, np.asarray(mask, bool)),
                                                 run.mesh)
        # A key in case the model draws in evaluation (a VAE's latent): one per batch.
        outputs = run.pipe.apply(variables, inputs, rng=jax.random.fold_in(
            jax.random.key(EVAL_SEED), b))
        sums, count = metric_sums(run.spec.metrics_fn, outputs, targets, mask)
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + float(v)
        weight += float(count)
    return {f"eval_{k}": v / (weight if weight > 0 else 1.0) for k, v in totals.items()}


def _check_streams_agree(ended: bool, batches: int) -> None:
    """On several processes, whether every evaluation stream ended together: one that
    yielded fewer batches left the others in the next batch's collectives and itself in
    the next step's, silently, for good. A ValueError (the same on every process)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils
    # One small collective per batch (allgather_json takes two: sizes, then bytes).
    ends = [bool(e) for e in np.asarray(
        multihost_utils.process_allgather(np.asarray(ended, np.bool_))).reshape(-1)]
    if any(ends) and not all(ends):
        done = [i for i, e in enumerate(ends) if e]
        raise ValueError(f"evaluation: the evaluation data of process(es) {done} ended after "
                         f"{batches} batches, the other processes' went on; every process's "
                         f"eval_data() must yield the same number of batches (or set "
                         f"train.eval_steps to at most the fewest).")


# --- metrics output -----------------------------------------------------------------
def _records_until(path: pathlib.Path, step: int) -> list[str]:
    """The lines of `path` for steps <= `step`. A line cut off (a kill or a full disk in
    the middle of a write) failed every later resume with a JSONDecodeError, after the
    planning, compiling and restoring; it is dropped with a warning."""
    kept, cut = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            cut += 1
            continue
        if isinstance(record, dict) and record.get("step", step + 1) <= step:
            kept.append(line)
    if cut:
        logging.warning("%s: dropped %d line(s) that were cut off", path, cut)
    return kept


def throughput(steps_per_sec: float, batch_size: int, step_flops: float | None,
               devices: list) -> dict:
    """The speed fields of a metrics record: examples/s, and where the step's model FLOPs
    are known (`Pipeline.model_flops`), the model TFLOP/s of all `devices` together and,
    on accelerators, model FLOPs utilization: that over `devices`' summed peaks
    (`plan.costs.device_peak`: the device kind's dense bf16 datasheet peak). A CPU's
    peak is a guess, and simulated devices share its cores: no utilization there."""
    out = {"examples_per_sec": steps_per_sec * batch_size}
    if step_flops:
        from jaxhybrid.plan.layer_cost import device_peak
        achieved = step_flops * steps_per_sec
        out["model_tflops"] = achieved / 1e12
        if all(d.platform != "cpu" for d in devices):
            out["mfu"] = achieved / sum(device_peak(d)[0] for d in devices)
    return out


class MetricWriter:
    """One JSON object per logged step in workdir/metrics.jsonl, the same scalars as
    TensorBoard events in workdir, and a line in the log. On resume, records after the
    restored step (from the interrupted run) are dropped so every step appears once."""

    def __init__(self, workdir: pathlib.Path, start_step: int):
        from tensorboardX import SummaryWriter   # imported here: only training needs it
        self.path = workdir / "metrics.jsonl"
        kept = _records_until(self.path, start_step) if self.path.exists() else []
        # Written aside, then renamed: a crash or a full disk while rewriting it in place
        # would lose the whole history.
        partial = self.path.with_name(self.path.name + ".tmp")
        partial.write_text("".join(line + "\n" for line in kept))
        os.replace(partial, self.path)
        # Purged from step 1 too: a fresh start in a workdir whose run crashed before its
        # first checkpoint would else show that run's steps beside the new ones.
        # flush_secs=1: tensorboardX's writer thread puts events on disk within a second
        # (by default 2 minutes: a killed run lost that many steps' events for good, as
        # the resume purges only the steps after its checkpoint).
        self.tb = SummaryWriter(str(workdir), purge_step=start_step + 1, flush_secs=1)

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        for k, v in record.items():
            if k != "step":
                group, _, name = k.partition("_")
                self.tb.add_scalar(f"{group}/{name}" if name else k, v, step)
        logging.info("step %d: %s", step, ", ".join(
            f"{k}={v:.5g}" for k, v in record.items() if k != "step"))

    def close(self) -> None:
        self.tb.close()


class ProfilerTrace:
    """config.profile: a jax profiler trace of steps start_step .. start_step +
    num_steps - 1 in workdir/profile; a resumed run traces what is left of them."""

    def __init__(self, profile, workdir: pathlib.Path, first_step: int):
        self.profile, self.workdir, self.tracing = profile, workdir, False
        self.last = profile.start_step + profile.num_steps - 1
        if profile.enabled and first_step > self.last:
            logging.warning("profile: steps %d..%d ran before the restored step %d; no trace "
                            "(set profile.start_step > %d)", profile.start_step, self.last,
                            first_step - 1, first_step - 1)

    def before(self, step: int) -> None:
        if self.profile.enabled and not self.tracing and \
                self.profile.start_step <= step <= self.last:
            jax.profiler.start_trace(str(self.workdir / "profile"))
            self.tracing = True

    def after(self, step: int, state) -> None:
        if self.tracing and step == self.last:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.tracing = False

    def close(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False
