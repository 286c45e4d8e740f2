"""A training config checked and turned into what a run needs: `prepare(config)` ->
`Run` (model, mesh, pipeline, this process's data streams), nothing written yet.

Everything the config decides is checked here, before `jaxhybrid.train` touches the
workdir: a bad config raises `ConfigError` (a ValueError with one line naming the field
and the fix).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Callable, Iterable, Iterator

import jax
import ml_collections
import numpy as np
from absl import logging

import jaxhybrid as jh
from jaxhybrid import config_flags, data, models
from jaxhybrid import pipeline as jp
from jaxhybrid.checks import is_int as _int
from jaxhybrid.mesh import DATA
from jaxhybrid.optim import OPTIMIZERS
from jaxhybrid.plan.from_config import step_param_factor
from jaxhybrid.plan.topology import parse_bytes
from jaxhybrid.schedules import SCHEDULES, asynchronous, make_schedule


class ConfigError(ValueError):
    """A config that cannot run; the message names the field and the fix."""


@dataclasses.dataclass
class Run:
    """What `prepare` built from a valid config (nothing is on disk yet).
    train_batches(start=0) -> iterator of (inputs, targets) numpy batches from batch
    `start` of the stream (the same stream on every call); eval_batches() -> iterator of
    (inputs, targets, mask), mask False on padding rows. Both hold this process's rows
    of every global batch (`data.process_rows`; all rows with one process).
    sample_inputs: inputs shaped like one global batch (for `Pipeline.init`), the same
    on every process; sample_targets: targets shaped like one global batch (for
    compiling the training step before the first batch is loaded)."""
    spec: models.ModelSpec
    mesh: Any
    pipe: jp.Pipeline
    train_batches: Callable[..., Iterator]
    eval_batches: Callable[[], Iterator]
    sample_inputs: Any = None
    sample_targets: Any = None


# --- validation ---------------------------------------------------------------------
def _check_fields(config) -> None:
    expected = set(config_flags.config_keys(config_flags.base_config(), ""))
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"config must be an ml_collections.ConfigDict, got "
                          f"{type(config).__name__}; load it with config_flags.load_config.")
    have = set(config_flags.config_keys(config, ""))
    # model.overrides, model.kwargs and data.options are free-form dicts (checked by
    # the model / the module's factory / the dataset).
    free = ("model.overrides.", "model.kwargs.", "data.options.")
    missing = sorted(k for k in expected - have if not k.startswith(free))
    unknown = sorted(k for k in have - expected if not k.startswith(free))
    if missing or unknown:
        raise ConfigError(f"config: missing fields {missing} / unknown fields {unknown}; start "
                          f"from jaxhybrid.config_flags.base_config() or a file in configs/.")


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def prepare(config, train_data: Callable[[], Iterable] | None = None,
            eval_data: Callable[[], Iterable] | None = None) -> Run:
    """Checks `config` and builds model, mesh, pipeline and datasets (config.data,
    unless `train_data` / `eval_data` bring their own). Raises ConfigError."""
    _check_fields(config)
    _check_settings(config)
    for name, stream in (("train_data", train_data), ("eval_data", eval_data)):
        # Called once per run (and again on resume); a generator object passed by
        # mistake would fail as "'generator' object is not callable" with a traceback.
        require(stream is None or callable(stream),
                f"{name} must be a function returning a fresh iterable of batches (a "
                f"generator function, or lambda: loader), got a {type(stream).__name__}: a "
                f"resumed run calls it again to replay the stream.")
    t, p = config.train, config.pipeline
    try:
        spec = _model_spec(config, train_data)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"model: {e}") from None
    model = config.mesh.get("model", 1)
    require(_int(model) and model >= 1, f"mesh.model={model!r} must be an int >= 1 (the "
             f"tensor-parallel degree).")
    try:
        mesh = jh.make_mesh(data=config.mesh.data, pipe=config.mesh.pipe, model=model)
    except ValueError as e:
        raise ConfigError(f"mesh (config.mesh.data/pipe/model, {jax.device_count()} "
                          f"{jax.default_backend()} devices): {e}") from None
    if mesh.size < jax.device_count():   # allowed (e.g. a checkpoint continued on fewer)
        logging.warning("mesh %s uses %d of the %d devices; the rest stay idle "
                        "(mesh.data=-1 takes every device left).",
                        " x ".join(f"{k}={v}" for k, v in mesh.shape.items()), mesh.size,
                        jax.device_count())
    n_data, m = mesh.shape[DATA], p.num_microbatches
    require(_int(m) and m >= 1, f"pipeline.num_microbatches={m!r} must be an int >= 1.")
    require(t.batch_size % (n_data * m) == 0,
             f"train.batch_size={t.batch_size} is not divisible by mesh data x "
             f"pipeline.num_microbatches = {n_data} x {m} = {n_data * m}; use a multiple of "
             f"{n_data * m}.")
    try:
        pipe = build_pipeline(config, spec, mesh)
    except ValueError as e:
        raise ConfigError(f"pipeline: {e}") from None
    try:
        rows = data.process_rows(mesh, t.batch_size)
    except ValueError as e:
        raise ConfigError(f"mesh (config.mesh.data/pipe, {jax.process_count()} processes): "
                          f"{e}") from None
    train_batches, eval_batches, first = _streams(config, spec, rows, train_data, eval_data)
    # The first real example, repeated to a global batch, stands in for the planner's
    # sample (exact shapes and dtypes, the same on every process).
    sample, sample_targets = jax.tree.map(
        lambda a: np.repeat(np.asarray(a)[:1], t.batch_size, axis=0), first)
    _check_model_degree(spec, sample, model)
    check_loss_on_model(pipe, spec, sample, sample_targets)
    return Run(spec, mesh, pipe, train_batches, eval_batches, sample, sample_targets)


def check_loss_on_model(pipe, spec, inputs, targets) -> None:
    """A split model's loss against its outputs on the first batch, before planning: a
    loss that cannot take them failed in the first step, after planning and compiling,
    with a traceback that named neither model.loss nor model.kwargs."""
    if pipe.splitter is None:
        return
    try:
        pipe.splitter.check_loss(pipe, spec.loss_fn, inputs, targets)
    except ValueError as e:
        raise ConfigError(f"model.loss / model.kwargs: {str(e).splitlines()[0]}") from None


def _check_settings(config) -> None:
    """The scalar settings of train, checkpoint and profile (ConfigError naming the fix)."""
    t, p = config.train, config.pipeline
    for name in ("steps", "batch_size", "log_every"):
        require(_int(t[name]) and t[name] >= 1, f"train.{name}={t[name]!r} must be an int >= 1.")
    for name in ("warmup_steps", "eval_every", "eval_steps", "seed"):
        require(_int(t[name]) and t[name] >= 0, f"train.{name}={t[name]!r} must be an int >= 0.")
    require(t.get("zero", 0) in (0, 1), f"train.zero={t.get('zero')!r} must be 0 or 1 "
             f"(1: optimizer state sharded over the mesh's data replicas).")
    require(t.optimizer in OPTIMIZERS,
             f"train.optimizer={t.optimizer!r} is unknown; choose one of {OPTIMIZERS}.")
    # inf passed "> 0" and diverged at the first step, after planning and compiling.
    require(0 < t.learning_rate < math.inf,
            f"train.learning_rate={t.learning_rate} must be a finite number > 0.")
    for name in ("weight_decay", "grad_clip_norm", "momentum"):
        require(0 <= t[name] < math.inf, f"train.{name}={t[name]} must be a finite number "
                                         f">= 0{' (0: no clipping)' * (name == 'grad_clip_norm')}.")
    if p.schedule in SCHEDULES and asynchronous.is_asynchronous(make_schedule(p.schedule, 1, 1)):
        # Its optimizer runs per device inside the pipeline (see docs/async.md).
        require(t.grad_clip_norm == 0 and t.weight_decay == 0,
                 f"pipeline.schedule={p.schedule!r} updates weights inside the pipeline, one "
                 f"device's buffers at a time: set train.grad_clip_norm=0 and "
                 f"train.weight_decay=0 (a global clip or packed decay mask needs every stage).")
    # Parsed here, not first by the planner (a traceback from inside the plan).
    if p.memory_budget is not None:
        try:
            parse_bytes(p.memory_budget)
        except ValueError as e:
            raise ConfigError(f"pipeline.memory_budget={p.memory_budget!r}: {e}") from None
    b = p.boundaries
    require(b is None or (isinstance(b, (tuple, list)) and all(_int(x) for x in b)),
            f"pipeline.boundaries={b!r} must be a tuple of ints (the first layer of stages "
            f"1..S-1), e.g. \"(3, 6, 11)\", or None (the planner decides).")
    c = config.checkpoint
    require(_int(c.every) and c.every >= 0, f"checkpoint.every={c.every!r} must be an int "
             f">= 0 (0: only at the end).")
    require(_int(c.keep) and c.keep >= 1, f"checkpoint.keep={c.keep!r} must be an int >= 1.")
    pr = config.profile
    require(not pr.enabled or (_int(pr.start_step) and pr.start_step >= 1 and _int(pr.num_steps)
                                and pr.num_steps >= 1),
             "profile.start_step and profile.num_steps must be ints >= 1.")
    # A window after the last step would trace nothing, without a word.
    require(not pr.enabled or pr.start_step <= t.steps,
            f"profile.start_step={pr.start_step} is after the run's last step (train.steps="
            f"{t.steps}); set profile.start_step <= {t.steps}.")


def _streams(config, spec, rows, train_data, eval_data):
    """(train_batches(start=0), eval_batches(), the first training example's (inputs,
    targets)): this process's `rows` of the config's dataset, or of the user's streams."""
    t = config.train
    try:
        if train_data is None:
            train_ds = _dataset(config, spec, "train")
            require(train_ds.steps_per_epoch >= 1,
                     f"train.batch_size={t.batch_size} exceeds the {train_ds.num_examples} "
                     f"training examples; use a smaller batch.")
            train_batches = functools.partial(train_ds.batches, rows=rows)
            first = tuple(next(train_ds.batches(rows=slice(0, 1))))[:2]
        else:
            train_batches = _process_share(train_data, rows, t.batch_size, "train_data")
            first = tuple(next(iter(train_data())))[:2]
            _check_rows(first, t.batch_size, "train_data", 0)   # before any file is written
        if eval_data is None:
            # A module by import path has no dataset of its own to evaluate on (this
            # failed as KeyError 'num_classes' inside data.for_model).
            require(config.model.module is None or config.data.name is not None,
                    f"model.module={config.model.module!r} with train_data= and no data.name "
                    f"needs eval_data= too (a function yielding (inputs, targets[, mask])).")
            eval_batches = functools.partial(_dataset(config, spec, "test").eval_batches,
                                             rows=rows)
        else:
            eval_batches = _process_share(eval_data, rows, t.batch_size, "eval_data", eval=True)
            # Its first batch now, not after the whole training run.
            _check_rows(_eval_batch(tuple(next(iter(eval_data()), ())), t.batch_size, 0),
                        t.batch_size, "eval_data", 0)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"data: {e}") from None
    return train_batches, eval_batches, first


def _check_model_degree(spec, sample, model: int) -> None:
    """With mesh.model > 1, the layers traced at that degree (abstractly, as the pipeline
    will) so that a degree that does not divide their split dimensions (heads, MLP
    width) stops here in one line, before any work."""
    if model == 1:
        return
    from jaxhybrid import tensor_parallel
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *np.shape(a)[1:]), np.asarray(a).dtype),
                     sample)
    try:
        with tensor_parallel.degree(model):
            tensor_parallel.eval_shape(lambda k, xx: models.init_layers(spec.layers, k, xx),
                                       jax.random.key(0), x)
    except ValueError as e:
        raise ConfigError(f"mesh.model={model}: {str(e).splitlines()[0]}") from None


def _model_spec(config, train_data=None) -> models.ModelSpec:
    """The registered model `model.name`, or the module `model.module` (one Flax module
    by import path, split by the pipeline; it needs `data.name` or `train_data`)."""
    m = config.model
    if m.module is None:
        # The reverse of the check below: these were ignored silently (a run given
        # --config.model.loss=mine:fn trained with the built-in model's own loss).
        require(m.loss is None and not m.kwargs.to_dict(),
                f"model.loss / model.kwargs are for model.module (one Flax module by import "
                f"path); model.name={m.name!r} is built from model.size and model.overrides "
                f"(its loss is its own): pass them there, or give model.module.")
        return models.get_model(m.name, m.size, **m.overrides.to_dict())
    from jaxhybrid.models import from_module
    require(not m.name, f"model.name={m.name!r} and model.module={m.module!r} are both set; "
             f"set one of them.")
    # They were ignored silently: a run asked for "tiny" trained the factory's "small".
    from jaxhybrid.config_flags import base_config
    require(m.size == base_config().model.size and not m.overrides.to_dict(),
            f"model.size / model.overrides are for model.name; model.module={m.module!r} "
            f"is built from model.kwargs: pass them there (e.g. --config.model.kwargs.size="
            f"{m.size}).")
    if train_data is not None:      # the caller's stream; the loss decides the task
        example, info = tuple(next(iter(train_data())))[:2], {}
        task = "classification" if m.loss in (None, "classification") else "language_model"
    else:
        require(config.data.name is not None,
                 f"model.module={m.module!r} needs data.name (one of {tuple(data.DATASETS)}) "
                 f"or train_data=: a module by import path has no dataset of its own.")
        ds = _dataset(config, None, "test")
        task = {v: k for k, v in data.TASK_DATASETS.items()}[config.data.name]
        example, info = next(ds.eval_batches(rows=slice(0, 1)))[:2], ds.info
    return from_module.build(m.module, m.kwargs.to_dict(), m.loss, task, info, example)


def build_pipeline(config, spec, mesh, boundaries=None, remat=None) -> jp.Pipeline:
    """The config's Pipeline (explicit boundaries / remat override the config's)."""
    p = config.pipeline
    if boundaries is None and p.boundaries is not None:
        boundaries = list(p.boundaries)
    # One module is split at construction, on the dataset's first example: its
    # boundaries count pieces (refused without a sample: "pass sample_inputs="), and its
    # loss can be checked against its outputs before planning (`check_loss_on_model`).
    sample = (None if spec.module is None else
              spec.sample_batch(config.train.batch_size)[0])
    return jp.Pipeline(spec.pipeline_model, mesh=mesh, num_microbatches=p.num_microbatches,
                       sample_inputs=sample,
                       schedule=p.schedule, boundaries=boundaries,
                       virtual_stages=p.virtual_stages if p.schedule == "interleaved" else None,
                       remat=p.remat if remat is None else remat,
                       memory_budget=p.memory_budget if remat is None else None,
                       zero=config.train.get("zero", 0),
                       param_state_factor=step_param_factor(
                           config.train.optimizer, config.train.momentum,
                           config.train.weight_decay, config.mesh.model))


def _process_share(stream: Callable[[], Iterable], rows: slice, batch_size: int, name: str,
                   eval: bool = False) -> Callable[..., Iterator]:
    """A stream of global batches -> this process's rows of each, from batch `start`.
    Every batch must have `batch_size` rows: a batch of another size would otherwise
    recompile the step and train silently on another batch (or fail deep in the
    pipeline). Evaluation batches (`eval`) may be short or come without a mask
    (`_eval_batch`)."""
    def batches(start: int = 0):
        for i, batch in enumerate(itertools.islice(stream(), start, None), start):
            batch = _eval_batch(tuple(batch), batch_size, i) if eval else tuple(batch)
            _check_rows(batch, batch_size, name, i)
            yield jax.tree.map(lambda a: np.asarray(a)[rows], batch)
    return batches


def _check_rows(batch: tuple, batch_size: int, name: str, index: int) -> None:
    parts = 3 if name == "eval_data" else 2
    sizes = sorted({np.shape(a)[0] if np.ndim(a) else 0 for a in jax.tree.leaves(batch)})
    require(len(batch) == parts and sizes == [batch_size],
            f"{name}: batch {index} has {len(batch)} parts with {sizes} rows; every batch must "
            f"be (inputs, targets{', mask' if parts == 3 else ''}) with train.batch_size="
            f"{batch_size} rows{' (a short last one is padded)' if parts == 3 else ''}.")


def _eval_batch(batch: tuple, batch_size: int, index: int) -> tuple:
    """(inputs, targets[, mask]) -> (inputs, targets, mask) of `batch_size` rows: no mask
    means every row counts; a short (last) batch is padded with copies of its first row,
    masked out. (Evaluation unpacked three parts and placed the batch as it was: both
    failed only after the whole training run.)"""
    require(len(batch) in (2, 3), f"eval_data: batch {index} has {len(batch)} parts; yield "
            f"(inputs, targets, mask) or (inputs, targets) batches (and at least one).")
    inputs, targets, *mask = batch
    mask = np.asarray(mask[0], bool) if mask else np.ones(
        np.shape(jax.tree.leaves(inputs)[0])[0], bool)
    short = batch_size - mask.shape[0]
    if short > 0:
        pad = lambda a: np.concatenate([np.asarray(a), np.repeat(np.asarray(a)[:1], short, 0)])
        inputs, targets = jax.tree.map(pad, (inputs, targets))
        mask = np.concatenate([mask, np.zeros(short, bool)])
    return inputs, targets, mask


def _dataset(config, spec, split):
    options = config.data.options.to_dict()
    kw = dict(batch_size=config.train.batch_size, seed=config.train.seed)
    if config.data.name is None:
        return data.for_model(spec, split, **kw, **options)
    return data.get_dataset(config.data.name, split, **kw, **options)
