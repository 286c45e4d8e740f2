"""Training one Flax module named by import path (config `model.module`): the pipeline
splits it; the run follows a single-device optax loop over the unsplit model (tied
embedding: its gradient summed, counted once by gradient clipping); the four built-in
models train as single modules; config mistakes fail in one line."""
import pathlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxhybrid import data, models, train
from jaxhybrid import pipeline as jp
from jaxhybrid.config_flags import load_config


def module_config(**overrides):
    """GPT tiny with a tied head as one module, on data=2 x pipe=2."""
    return load_config("gpt_module.py", {
        "model.kwargs.size": "tiny", "data.options.max_bytes": 40_000,
        "data.options.seq_len": 16, "mesh.data": 2, "mesh.pipe": 2,
        "pipeline.num_microbatches": 2, "train.batch_size": 8, "train.steps": 4,
        "train.warmup_steps": 1, "train.log_every": 1, "train.eval_every": 0,
        "train.eval_steps": 1, "checkpoint.every": 0, **overrides})


def records(workdir):
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_module_run_follows_the_unsplit_model(tmp_path):
    # SGD (not scale-invariant like Adam) with a clip that triggers, weight decay and
    # dropout: every step's loss and gradient norm must match a plain optax loop over
    # model.apply on one device, started from the same variables.
    config = module_config(**{"train.optimizer": "sgd", "train.grad_clip_norm": 0.5,
                              "train.learning_rate": 0.5, "train.weight_decay": 0.01})
    final = train.train_and_evaluate(config, tmp_path)
    got = records(tmp_path)

    t = config.train
    run = train.prepare(config)
    model, spec = run.spec.module, run.spec
    init_rng, train_rng = jax.random.split(jax.random.key(t.seed))
    pipe = run.pipe
    native = pipe.unpack(pipe.init(init_rng, run.sample_inputs))
    assert len(pipe.layers) >= 2 and pipe.splitter.split.shared_variables(), \
        "the tied embedding is held by two pieces"
    params, rest = native["params"], {k: v for k, v in native.items() if k != "params"}
    decay = jax.tree.map(lambda a: np.full(a.shape, a.ndim >= 2, a.dtype), params)
    tx = train.make_optimizer(t, decay)
    opt_state = tx.init(params)
    for step, (x, y) in zip(range(1, t.steps + 1), run.train_batches()):
        loss, grads, _ = jp.reference_value_and_grad(
            [model], [{"params": params, **rest}], spec.loss_fn, x, y, data=2,
            num_microbatches=2, rng=jax.random.fold_in(train_rng, step))
        record = got[step - 1]
        assert record["step"] == step
        np.testing.assert_allclose(record["train_loss"], float(loss), rtol=2e-5)
        np.testing.assert_allclose(record["grad_norm"], float(optax.tree.norm(grads[0])),
                                   rtol=2e-5)
        updates, opt_state = tx.update(grads[0], opt_state, params)
        params = optax.apply_updates(params, updates)
        assert record["grad_norm"] > t.grad_clip_norm        # the clip was active
    assert final["step"] == t.steps


# The four built-in models as ONE module each, config from the layer-list config's recipe.
FOUR = {"gpt": {}, "inception_v3": {}, "gnmt": {}, "biglstm": {"num_sampled": 0}}


@pytest.mark.parametrize("name", sorted(FOUR))
def test_built_in_models_train_as_single_modules(tmp_path, name):
    spec = models.get_model(name, "tiny", **FOUR[name])
    dataset, options = data.model_options(spec)     # the dataset the layer list trains on
    options.update({"stdlib_text": {"max_bytes": 20_000}, "digits": {},
                    "translation": {"num_train": 64, "num_test": 16}}[dataset])
    config = module_config(**{"train.steps": 2, "model.loss": None, "data.name": dataset})
    with config.unlocked():
        config.model.kwargs = {"name": name, "size": "tiny", **FOUR[name]}
        config.data.options = options
    final = train.train_and_evaluate(config, tmp_path)
    assert final["step"] == 2 and np.isfinite(final["train_loss"]) and final["eval_loss"] > 0
    # The first step trained the unsplit model's loss at the initial variables.
    run = train.prepare(config)
    assert run.spec.module is not None and run.pipe.splitter is not None
    init_rng, train_rng = jax.random.split(jax.random.key(config.train.seed))
    native = run.pipe.unpack(run.pipe.init(init_rng, run.sample_inputs))
    x, y = next(run.train_batches())
    loss, _, _ = jp.reference_value_and_grad([run.spec.module], [native], run.spec.loss_fn, x, y,
                                             data=2, num_microbatches=2,
                                             rng=jax.random.fold_in(train_rng, 1))
    np.testing.assert_allclose(records(tmp_path)[0]["train_loss"], float(loss), rtol=2e-5)


@pytest.mark.parametrize("overrides,message", [
    ({"model.module": "no_such_package.models:make"}, "cannot import 'no_such_package.models'"),
    ({"model.module": "jaxhybrid.models:nope"}, "has no attribute 'nope'"),
    ({"model.module": "jaxhybrid.models"}, "must be an import path"),
    ({"model.module": "jaxhybrid.models:count_params"}, "calling it with model.kwargs"),
    ({"model.module": "jaxhybrid.models:registered_models", "model.kwargs": {}},
     "not a flax.linen.Module"),
    ({"model.loss": "hinge"}, "model.loss='hinge' is unknown"),
    ({"data.name": None}, "needs data.name"),
    ({"model.name": "gpt"}, "are both set"),
])
def test_module_config_mistakes_fail_in_one_line(tmp_path, overrides, message):
    config = module_config()
    with config.unlocked():
        for k, v in overrides.items():
            node, _, last = k.rpartition(".")
            config[node][last] = v
    with pytest.raises(train.ConfigError, match=message) as e:
        train.prepare(config)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "metrics.jsonl").exists()
