"""`train_and_evaluate(config, workdir)`: the one training loop.

config (see configs/*.py and docs/training.md) -> model layers -> mesh -> Pipeline
(planner or explicit boundaries) -> optax on the packed parameters -> a jitted step
-> metrics (stdout, workdir/metrics.jsonl, TensorBoard) and per-layer checkpoints in
workdir/checkpoints, resumed automatically, in any mesh layout.

Everything the config decides is checked first (`jaxhybrid.run_setup.prepare`): a bad
config raises `ConfigError` (a ValueError with one line naming the field and the fix)
before any file in the workdir is written.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import pathlib
import time
from typing import Any, Callable, Iterable

import jax
import ml_collections
import numpy as np
import optax
from absl import logging
from jax.sharding import NamedSharding

from jaxhybrid import checkpoint, data, distributed, portable, startup, step_memory, stopping
from jaxhybrid import workdir as workdir_
from jaxhybrid.metrics import MetricWriter, ProfilerTrace, evaluate, throughput
from jaxhybrid.optim import (global_norm, learning_rate_schedule, make_optimizer, norm_weights,
                             weight_decay_mask)
from jaxhybrid.pipeline import async_weights
# ConfigError and Run are part of this module's interface too (scripts, tests).
from jaxhybrid.run_setup import ConfigError, Run, build_pipeline, prepare, require  # noqa: F401
from jaxhybrid.schedules import asynchronous
from jaxhybrid.stopping import TrainingDiverged  # noqa: F401 (train.TrainingDiverged)


def _updates_per_step(pipe) -> int:
    return asynchronous.updates_per_call(pipe.schedule)


def initial_state(pipe, t, variables, masks=(None, None)) -> dict:
    """{"variables", "opt_state"} before step 1; `masks` = (weight-decay mask, tied-copy
    norm weights). An asynchronous schedule's U tasks run the optimizer wrapped for their
    windows (and SpecTrain's last update): its state is what is trained and checkpointed."""
    params = variables["params"]
    opt_init, shardings = _optimizer_init(pipe, t, params, masks)
    return {"variables": variables, "opt_state": jax.jit(opt_init, out_shardings=shardings)(params)}


def _optimizer_init(pipe, t, params, masks):
    """(The optimizer's init on the packed params, the shardings of its state)."""
    opt_init = async_weights.pipeline_optimizer(
        make_optimizer(t, *masks, updates_per_step=_updates_per_step(pipe)), pipe.schedule,
        pipe.num_microbatches).init
    return opt_init, portable.opt_state_shardings(pipe, jax.eval_shape(opt_init, params),
                                                    params, zero=pipe.zero)


def compile_ahead(run: Run, train_step, state: dict, masks, rng):
    """Compiles `train_step` for the state `initial_state` will build, given as its
    `abstract_state` (from the layers' variable shapes alone): jax keeps the compiled
    step, and the first call with real values (the same shapes and shardings) runs it.
    Returns the compiled step (for its `memory_analysis`)."""
    batch = data.batch_sharding(run.mesh)
    inputs, targets = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=batch),
        (run.sample_inputs, run.sample_targets))
    return train_step.lower(state, masks, inputs, targets, rng).compile()


def check_step_memory(compiled, budget, planned: float | None, limit: float | None,
                      recomputes_all: bool = False) -> str:
    """The compiled step's bytes per device (`step_memory.compiled_bytes`) against the
    device's memory `limit` (ConfigError: the first step would fail to allocate), and
    against `pipeline.memory_budget` (a warning: the planner's model, `planned` bytes,
    fell short of this step; a plan that recomputes every layer already cannot recompute
    more); returns the log line."""
    from jaxhybrid.plan.topology import fmt_bytes
    need = step_memory.compiled_bytes(compiled)
    if need is None:   # a backend without memory analysis: nothing to check
        return "memory per device: not reported by this backend"
    line = f"memory per device: the compiled step needs {fmt_bytes(need)}" + (
        f" (the planner's model: {fmt_bytes(planned)})" if planned else "")
    if limit and need > limit:
        raise ConfigError(f"the compiled training step needs {fmt_bytes(need)} per device, more "
                          f"than the device's {fmt_bytes(limit)}; set pipeline.remat='full' "
                          f"(recompute every stage), or {step_memory.MORE_STAGES}.")
    warning = step_memory.over_budget(need, budget, planned, recomputes_all,
                                      "pipeline.remat='full'")
    if warning:
        logging.warning(warning.replace("memory_budget=", "pipeline.memory_budget=", 1))
    return line


def abstract_state(pipe, t, masks) -> dict:
    """`initial_state`'s result as jax.ShapeDtypeStructs (with shardings), from the
    layers' shapes (`pipe.set_layer_shapes`) alone."""
    variables = pipe.abstract_variables()
    opt_init, shardings = _optimizer_init(pipe, t, variables["params"], masks)
    opt_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             jax.eval_shape(opt_init, variables["params"]), shardings)
    return {"variables": variables, "opt_state": opt_state}


def make_train_step(run: Run, t):
    if asynchronous.is_asynchronous(run.pipe.schedule):
        return _make_async_train_step(run, t)
    grad_fn = run.pipe.value_and_grad(run.spec.loss_fn)

    def train_step(state, masks, inputs, targets, rng):
        decay_mask, weights = masks
        loss, grads, variables = grad_fn(state["variables"], inputs, targets, rng)
        params = state["variables"]["params"]
        updates, opt_state = make_optimizer(t, decay_mask, weights).update(
            grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        if run.pipe.zero:   # updated in data shards: all-gather the params (stage rows only)
            new_params = jax.lax.with_sharding_constraint(
                new_params, NamedSharding(run.mesh, run.pipe.stage_spec))
        variables = {**variables, "params": new_params}
        metrics = {"loss": loss, "grad_norm": global_norm(grads, weights),
                   "param_norm": global_norm(variables["params"], weights)}
        return {"variables": variables, "opt_state": opt_state}, metrics
    return jax.jit(train_step, donate_argnums=0)


def _make_async_train_step(run: Run, t):
    """The same step for an asynchronous schedule: the optimizer runs inside the
    pipeline (U tasks after each gradient window); grads are the mean of the
    microbatch gradients the call applied."""
    try:
        step = run.pipe.train_step(
            run.spec.loss_fn, make_optimizer(t, updates_per_step=_updates_per_step(run.pipe)))
    except ValueError as e:       # e.g. a model whose pieces share variables
        raise ConfigError(str(e)) from None

    def train_step(state, masks, inputs, targets, rng):
        # The decay mask is refused up front; the norm weights count a leaf every model
        # shard holds whole once (the norms were ~1.4x model=1's at model=2).
        weights = masks[1]
        loss, grads, variables, opt_state = step(state["variables"], state["opt_state"],
                                                 inputs, targets, rng)
        metrics = {"loss": loss, "grad_norm": global_norm(grads, weights),
                   "param_norm": global_norm(variables["params"], weights)}
        return {"variables": variables, "opt_state": opt_state}, metrics
    return jax.jit(train_step, donate_argnums=0)


# --- the loop -----------------------------------------------------------------------
def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | os.PathLike, *,
                       train_data: Callable[[], Iterable] | None = None,
                       eval_data: Callable[[], Iterable] | None = None,
                       launched: float | None = None) -> dict:
    """Trains `config` in `workdir` (resuming from its latest checkpoint) and returns the
    final metrics: step, train_loss, eval_* and wall_time_s (of this call).

    train_data / eval_data replace the config's dataset: train_data() must yield the
    same (inputs, targets) stream on every call (a resumed run skips the batches already
    trained on), eval_data() yields (inputs, targets, mask) with a fixed batch shape.

    Multi-process (jax.distributed initialised, see jaxhybrid.distributed): every
    process calls this; each loads its own rows of every global batch, writes its own
    checkpoint shards, and only process 0 writes metrics, events and logs.

    launched: time.time() at the program's start; the log's start-up line (plan, init,
    compile, first step: `jaxhybrid.startup.Phases`) counts from it (default: now)."""
    started = time.time()
    phases = startup.Phases(launched or started)
    workdir = pathlib.Path(workdir).absolute()
    try:
        distributed.check_devices_per_process()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_processes_agree(config, workdir)
    # ConfigError before any file is written; on every process when one fails (its mesh
    # devices, its disk), instead of the others waiting for it in a collective.
    run = distributed.fail_together(
        lambda: _prepare_in(workdir, config, train_data, eval_data), ConfigError)
    main = distributed.is_main_process()   # metrics, events, progress and logs: process 0
    fresh = not workdir.exists()
    lock = distributed.fail_together(lambda: workdir_.Lock(workdir) if main else None,
                                     ConfigError)
    writer = begun = ckpt = None
    failed = True
    try:
        try:
            ckpt = checkpoint.Checkpointer(workdir / "checkpoints", keep=config.checkpoint.keep)
        except OSError as e:   # where os.access says yes but mkdir fails (/proc, some mounts)
            raise workdir_.cannot_create(workdir / "checkpoints", e) from None
        _check_processes_see_one_checkpoint(ckpt)
        saved = ckpt.latest_step() or 0
        if saved > config.train.steps:
            # It restored, evaluated and rewrote config.json with the smaller count.
            raise ConfigError(f"train.steps={config.train.steps}, but {workdir} holds a run "
                              f"at step {saved}; raise train.steps to train on, or use "
                              f"another --workdir.")
        begun = _begin(run, config, phases, main, ckpt)
        if main:
            (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
            writer = MetricWriter(workdir, begun.start)
        final = _train_steps(begun, config, workdir, phases, writer)
        failed = False
    finally:
        # Each in turn, and while an error is on its way out none replaces it (on a full
        # disk TensorBoard's OSError at close hid the one-line CheckpointWriteError).
        workdir_.close_in_turn([
            ckpt and ckpt.close, writer and writer.close,
            # Refused at start-up (a plan over budget, ...): no empty workdir left behind.
            begun is None and fresh and main and (lambda: workdir_.remove_if_empty(workdir)),
            lock and lock.release], failed)
    final["wall_time_s"] = time.time() - started
    if main:
        logging.info("done: %s", final)
    return final


def _prepare_in(workdir: pathlib.Path, config, train_data, eval_data) -> Run:
    """`prepare`, then the checks that `workdir` can take the run (ConfigError)."""
    run = prepare(config, train_data, eval_data)
    require(not workdir.exists() or workdir.is_dir(),
             f"workdir {workdir} is a file; pass a directory (it is created if missing).")
    # Else orbax fails only at the first save, after training, with pages of traceback.
    require(not (workdir / "checkpoints").exists() or (workdir / "checkpoints").is_dir(),
            f"{workdir / 'checkpoints'} is a file; move it away (the run keeps its "
            f"checkpoints in that directory).")
    workdir_.check_writable(workdir)
    return run


def _check_processes_agree(config, workdir: pathlib.Path) -> None:
    """Several processes: every one must run process 0's config in process 0's workdir
    (ConfigError on all of them, naming the first difference). A process started with
    other flags failed in a mismatched collective (gloo: "Is there a distributed
    collective mismatch in your code?"), hung, or trained its replicas apart."""
    if jax.process_count() == 1 or not isinstance(config, ml_collections.ConfigDict):
        return
    def flat(node, prefix=""):
        for k, v in node.items():
            yield from flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]
    fields = {"workdir": str(workdir),
              **dict(flat(json.loads(config.to_json_best_effort(sort_keys=True))))}
    try:
        distributed.check_same_everywhere(fields)
        distributed.check_jax_settings_agree()      # again: a config file may update them
    except ValueError as e:
        raise ConfigError(f"config: {e}") from None


def _check_processes_see_one_checkpoint(ckpt: checkpoint.Checkpointer) -> None:
    """Several processes: all must resume from the same step. With the workdir on each
    host's own disk (the default /tmp/jaxhybrid/<config>), process 0 found its steps and
    the others none: they trained from other steps in the same collectives, silently."""
    if jax.process_count() == 1:
        return
    try:
        distributed.check_same_everywhere(
            {"checkpoint step": ckpt.latest_step()}, seen=f"finds in {ckpt.directory} the",
            fix="put --workdir on a file system every process sees (the checkpoints are "
                "written by all of them)")
    except ValueError as e:
        raise checkpoint.CheckpointMismatch(f"checkpoint: {e}") from None


@dataclasses.dataclass
class _Begun:
    """Where the steps start: the run (with the plan every process agreed on), the state
    after step `start` (restored from the latest checkpoint, else initial), the
    optimizer's masks, the jitted step, the step keys' base and the checkpointer."""
    run: Run
    state: dict
    masks: tuple
    train_step: Callable
    start: int
    train_rng: Any
    ckpt: checkpoint.Checkpointer
    # The losses of the steps since the last record up to `start`: the record after a
    # resume averages them with the new ones, as the uninterrupted run did (it averaged
    # only the steps since the checkpoint when checkpoint.every was off log_every's grid).
    loss_window: tuple = ()
    step_flops: float | None = None   # model FLOPs of one step (None: not profiled)


def _begin(run: Run, config, phases, main: bool, ckpt: checkpoint.Checkpointer) -> _Begun:
    """Plan, compile (from the layers' shapes, while the initialiser still runs),
    initialise and restore: the phases of the start-up line."""
    t, pipe = config.train, run.pipe
    init_rng, train_rng = jax.random.split(jax.random.key(t.seed))
    layer_init = startup.init_layers_in_background(pipe, init_rng, run.sample_inputs)
    train_step = masks = None
    try:
        with phases("plan", split_compile=False):
            pipe.make_plan(run.sample_inputs)
        # The plan is final (on several processes every one planned from process 0's
        # costs), so the step compiles now, after the checkpoint to resume from is found
        # to fit.
        if layer_init is not None:
            train_step, masks = _compile_while_initialising(
                run, t, layer_init, phases, jax.random.fold_in(train_rng, 1), ckpt,
                config.pipeline)
    except BaseException:
        # A refused plan, checkpoint or step: let the initialiser's thread leave XLA
        # first. An interpreter that exits while it is inside XLA aborts ("terminate
        # called ..."), after the error's own line.
        if layer_init is not None:
            layer_init.wait()
        raise
    phases.start("init")                 # parameters, optimizer state, restore
    variables = (pipe.init(init_rng, run.sample_inputs) if layer_init is None
                 else pipe.pack(layer_init.result()))
    planned = config.pipeline.boundaries is None or config.pipeline.memory_budget is not None
    # With explicit boundaries `pipe.plan` would profile every layer just for this log.
    if main:
        logging.info("model %s on mesh data=%d x pipe=%d x model=%d (%d processes), %d "
                     "stages, boundaries %s\n%s",
                     config.model.module or f"{config.model.name}/{config.model.size}",
                     pipe.data, pipe.pipe_size, pipe.model, jax.process_count(),
                     pipe.num_stages, pipe.boundaries, pipe.plan.summary() if planned else "")
    masks = masks or _masks(pipe, t, variables)
    # From the costs the plan was made of (profiling only for this would slow start-up).
    step_flops = pipe.model_flops(t.batch_size) if planned else None
    state = initial_state(pipe, t, variables, masks)
    if train_step is None:
        # A split model or a model axis (initialised here, not in the background): its
        # step compiles now, checked like the others (it compiled in the first step,
        # unchecked, and its time counted as the first record's steps_per_sec).
        train_step = _checked_step(run, t, state, masks, jax.random.fold_in(train_rng, 1),
                                   config.pipeline, ckpt)
    start, loss_window = 0, ()
    if ckpt.latest_step() is not None:
        state, meta = ckpt.restore(pipe, state)
        start, loss_window = int(meta["step"]), tuple(meta.get("loss_window", ()))
        if "rng" not in meta:   # saved by a Checkpointer outside train.py
            raise ConfigError(f"checkpoint: step {start} in {ckpt.directory} has no training "
                              f"key (meta 'rng'): it was not saved by train.py; use a fresh "
                              f"workdir, or save with meta={{'rng': key data, ...}}.")
        train_rng = jax.random.wrap_key_data(np.asarray(meta["rng"], np.uint32))
        if main:
            logging.info("resumed from %s at step %d (saved on %s)", ckpt.directory, start,
                         meta.get("layout"))
            if meta.get("train_steps", t.steps) != t.steps:
                # The learning rate decays to 0 at train.steps: a run of 200 steps resumed
                # for 400 is not the uninterrupted 400-step run, and nothing said so.
                logging.warning("resumed with train.steps=%d, saved under train.steps=%d: the "
                                "learning-rate schedule (cosine to 0 at train.steps) changes "
                                "from step %d on; steps 1-%d followed the old one.",
                                t.steps, meta["train_steps"], start + 1, start)
    phases.stop("init")
    return _Begun(run, state, masks, train_step, start, train_rng, ckpt, loss_window,
                  step_flops)


def _compile_while_initialising(run: Run, t, layer_init: startup.LayerInit, phases, rng,
                                ckpt, p):
    """(The jitted step, the masks), the step compiled from the layers' shapes while the
    initialiser computes their values on the other thread. A checkpoint in the workdir
    that does not fit is refused first (it was found only after the compilation); a step
    that cannot fit the device's memory after it (`check_step_memory`; p: the config's
    pipeline section)."""
    with phases("init"):
        layer_shapes = layer_init.shapes()
    with phases("compile"):
        run.pipe.set_layer_shapes(layer_shapes)
        masks = _masks(run.pipe, t)
        state = abstract_state(run.pipe, t, masks)   # built once: the check and the compile
        train_step = _checked_step(run, t, state, masks, rng, p, ckpt)
    return train_step, masks


def _checked_step(run: Run, t, state, masks, rng, p, ckpt: checkpoint.Checkpointer):
    """The jitted step, compiled ahead for `state` (its shapes; values are not needed)
    and refused if it cannot fit the device's memory (`check_step_memory`); a checkpoint
    in the workdir that does not fit `state` is refused first (it was found only after
    the compilation)."""
    ckpt.check(run.pipe, state)
    train_step = make_train_step(run, t)
    if hasattr(train_step, "lower"):    # a jitted step (not one wrapped by a test)
        compiled = compile_ahead(run, train_step, state, masks, rng)
        planned = (run.pipe.plan.device_memory
                   if p.boundaries is None or p.memory_budget is not None else None)
        # Several processes: a step too big for one process's device stops them all
        # (the others would wait for it in the first step's collectives).
        logging.info(distributed.fail_together(lambda: check_step_memory(
            compiled, p.memory_budget, planned, step_memory.device_memory_limit(),
            p.memory_budget is not None and all(run.pipe.plan.remat)), ConfigError))
    return train_step


def _train_steps(b: _Begun, config, workdir: pathlib.Path, phases, writer) -> dict:
    """Steps `b.start + 1` .. train.steps: a record every log_every steps (and an
    evaluation every eval_every and at the end), a checkpoint every checkpoint.every;
    returns the last record."""
    t, run, state = config.train, b.run, b.state
    schedule = learning_rate_schedule(t)
    # Batch k of the (seeded, reproducible) stream is the one step k+1 trains on, so a
    # resumed run skips exactly the batches the saved steps consumed.
    # Only the batches the steps use: the prefetch must not read (and check) a batch past
    # the last step, e.g. the short last batch of a finite stream.
    batches = data.prefetch_to_mesh(
        itertools.islice(run.train_batches(start=b.start), max(t.steps - b.start, 0)), run.mesh)
    rng_data = [int(x) for x in np.asarray(jax.random.key_data(b.train_rng)).reshape(-1)]
    final, window, last_saved = {"step": b.start}, list(b.loss_window), b.ckpt.latest_step()
    meta = lambda step: {"rng": rng_data, "data_position": step, "loss_window": list(window),  # noqa: E731
                         "train_steps": t.steps}
    done = b.start                          # the step `state` is after
    timed = 0                               # steps since `tick` (not the window's restored)
    tick = time.time()
    from tqdm import tqdm
    bar = tqdm(total=t.steps, initial=b.start, desc="train", unit="step",
               disable=None if writer is not None else True)
    trace = ProfilerTrace(config.profile, workdir, b.start + 1)
    steps = stopping.steps_until_stopped(b.start + 1, t.steps)
    try:
        for step in steps:
            trace.before(step)
            try:
                batch = next(batches, None)
                if batch is None:
                    raise ValueError(f"train: the training data ran out after {step - 1} "
                                     f"steps; train_data() must yield train.steps={t.steps} "
                                     f"batches.")
            except Exception:
                # A bad batch (a short last one, a stream that ends) ended the run with
                # every step since the last checkpoint lost (all of them by default).
                stopping.save_stopped(b, state, done, last_saved, meta(done))
                raise
            inputs, targets = batch
            with phases("first step") if step == b.start + 1 else contextlib.nullcontext():
                new_state, m = b.train_step(state, b.masks, inputs, targets,
                                            jax.random.fold_in(b.train_rng, step))
                m = {k: float(v) for k, v in m.items()}
            if step == b.start + 1 and writer is not None:
                logging.info(phases.summary())
            stopping.check_finite(m, step, t, last_saved, b.ckpt, from_init=step == 1)
            state, done = new_state, step
            window.append(m["loss"])
            timed += 1
            bar.update(1)
            trace.after(step, state)
            last = step == t.steps
            do_eval = last or (t.eval_every and step % t.eval_every == 0)
            record = None
            if do_eval or step % t.log_every == 0:
                record = {"step": step, "train_loss": float(np.mean(window)),
                          "learning_rate": float(schedule(step - 1)),
                          "grad_norm": m["grad_norm"], "param_norm": m["param_norm"],
                          "steps_per_sec": timed / max(time.time() - tick, 1e-9)}
                record.update(throughput(record["steps_per_sec"], t.batch_size,
                                         b.step_flops, list(run.mesh.devices.flat)))
                window, timed = [], 0
            # Saved before the evaluation: an evaluation that fails (a model whose outputs
            # the metrics cannot take) lost every step since the last checkpoint.
            if last or (config.checkpoint.every and step % config.checkpoint.every == 0):
                saving = time.time()
                b.ckpt.save(step, run.pipe, state, meta(step))
                last_saved = step                 # once saved (a stop may cut the save)
                tick += time.time() - saving                            # not a step's time
            if record is not None:
                if do_eval:
                    record.update(evaluate(run, state["variables"], t.eval_steps))
                if writer is not None:
                    writer.write(record)
                bar.set_postfix(loss=f"{record['train_loss']:.4f}")
                final, tick = record, time.time()
        if b.start >= t.steps:              # nothing left to train: report the saved state
            final = {"step": b.start, **evaluate(run, state["variables"], t.eval_steps)}
    except KeyboardInterrupt:               # Ctrl-C, or SIGTERM (distributed.stop_on_signals)
        stopping.save_stopped(b, state, done, last_saved, meta(done))
        raise
    finally:
        steps.close()                       # signals are raised at once again
        trace.close()
        bar.close()
    return final


def _masks(pipe, t, variables=None) -> tuple:
    """(weight-decay mask, tied-copy norm weights) of `make_optimizer`; from the layers'
    shapes, except a split model's norm weights (they read `variables`)."""
    return (weight_decay_mask(pipe, variables) if t.weight_decay > 0 else None,
            norm_weights(pipe, variables))
