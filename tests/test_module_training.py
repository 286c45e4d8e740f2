"""Training one Flax module named by import path (config `model.module`): the pipeline
splits it; the run follows a single-device optax loop over the unsplit model (tied
embedding: its gradient summed, counted once by gradient clipping); the four built-in
models train as single modules; config mistakes fail in one line."""
import json
import pathlib
import shutil

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxhybrid import data, models, optim, portable, train
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


def train_capturing_run(config, workdir, monkeypatch):
    """train_and_evaluate, returning (final metrics, the Run it prepared)."""
    runs, prepare = [], train.prepare
    monkeypatch.setattr(train, "prepare", lambda *a, **k: runs.append(prepare(*a, **k)) or runs[-1])
    return train.train_and_evaluate(config, workdir), runs[0]


def initial_variables(run, config):
    """The model's own variables the run started from (the split is already made), and
    the run's training rng."""
    init_rng, train_rng = jax.random.split(jax.random.key(config.train.seed))
    return run.pipe.unpack(run.pipe.init(init_rng, run.sample_inputs)), train_rng


def records(workdir):
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_module_run_follows_the_unsplit_model(tmp_path, monkeypatch):
    # SGD (not scale-invariant like Adam) with a clip that triggers, weight decay and
    # dropout: every step's loss and gradient norm must match a plain optax loop over
    # model.apply on one device, started from the same variables.
    config = module_config(**{"train.optimizer": "sgd", "train.grad_clip_norm": 0.5,
                              "train.learning_rate": 0.5, "train.weight_decay": 0.01})
    final, run = train_capturing_run(config, tmp_path, monkeypatch)
    got = records(tmp_path)

    t = config.train
    model, spec = run.spec.module, run.spec
    native, train_rng = initial_variables(run, config)
    assert len(run.pipe.layers) >= 2 and run.pipe.splitter.split.shared_variables(), \
        "the tied embedding is held by two pieces"
    params, rest = native["params"], {k: v for k, v in native.items() if k != "params"}
    decay = jax.tree.map(lambda a: np.full(a.shape, a.ndim >= 2, a.dtype), params)
    tx = optim.make_optimizer(t, decay)
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
    # Checkpoints hold the model's own variable tree (as model.init returns it).
    packed = run.pipe.pack(native)
    saved = portable._portable(run.pipe, {"variables": packed, "opt_state": ()}, host=True)
    (entry,) = saved["layers"]
    assert jax.tree.structure(entry["variables"]) == jax.tree.structure(native)
    for a, b in zip(jax.tree.leaves(entry["variables"]), jax.tree.leaves(native)):
        np.testing.assert_array_equal(a, b)


def test_module_checkpoint_resumes_on_another_layout(tmp_path):
    # Saved at step 2 on data=2 x pipe=2 (M=2); resumed on data=4 x pipe=1 (M=1): the
    # same 4 microbatches of 2 per step (same dropout keys), other cuts and packing.
    common = {"train.steps": 4, "checkpoint.every": 2}
    train.train_and_evaluate(module_config(**common), tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")
    train.train_and_evaluate(module_config(**common, **{
        "mesh.data": 4, "mesh.pipe": 1, "pipeline.num_microbatches": 1}), tmp_path / "b")
    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["train_loss"] for r in b[2:]],
                               [r["train_loss"] for r in a[2:]], rtol=0, atol=1e-4)


# The four built-in models as ONE module each, config from the layer-list config's recipe.
FOUR = {"gpt": {}, "inception_v3": {}, "gnmt": {}, "biglstm": {"num_sampled": 0}}


@pytest.mark.parametrize("name", sorted(FOUR))
def test_built_in_models_train_as_single_modules(tmp_path, monkeypatch, name):
    spec = models.get_model(name, "tiny", **FOUR[name])
    dataset, options = data.model_options(spec)     # the dataset the layer list trains on
    options.update({"stdlib_text": {"max_bytes": 20_000}, "digits": {},
                    "translation": {"num_train": 64, "num_test": 16}}[dataset])
    config = module_config(**{"train.steps": 2, "model.loss": None, "data.name": dataset})
    with config.unlocked():
        config.model.kwargs = {"name": name, "size": "tiny", **FOUR[name]}
        config.data.options = options
    final, run = train_capturing_run(config, tmp_path, monkeypatch)
    assert final["step"] == 2 and np.isfinite(final["train_loss"]) and final["eval_loss"] > 0
    # The first step trained the unsplit model's loss at the initial variables.
    assert run.spec.module is not None and run.pipe.splitter is not None
    native, train_rng = initial_variables(run, config)
    x, y = next(run.train_batches())
    loss, _ = jp.reference_loss([run.spec.module], [native], run.spec.loss_fn, x, y,
                                data=2, num_microbatches=2, rng=jax.random.fold_in(train_rng, 1))
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
    # Found by a probe: silently ignored, or failing after planning with a traceback
    # (or as "the run diverged" at step 1) that named neither field.
    ({"model.module": "test_module_training:INSTANCE"}, "names a module instance, which "
                                                        "model.kwargs="),
    ({"model.loss": "os.path:basename"}, "cannot be called as loss_fn\\(outputs, targets\\)"),
    ({"model.loss": "optax:softmax_cross_entropy_with_integer_labels"},
     "model.loss / model.kwargs: Pipeline: loss_fn returned shape \\(2, 16\\)"),
    ({"model.kwargs": {"name": "gpt", "size": "tiny", "vocab_size": 100}},
     "the model scores 100 tokens but the dataset has 257"),
    # Ignored silently: "tiny" asked for, the factory's "small" trained.
    ({"model.size": "tiny"}, "model.size / model.overrides are for model.name.*"
                             "--config.model.kwargs.size=tiny"),
    ({"model.overrides": {"dropout_rate": 0.5}}, "model.size / model.overrides are for"),
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


INSTANCE = nn.Dense(4)   # a module instance named by import path


def test_a_modules_boundaries_count_its_pieces_from_the_config():
    # "boundaries of a single model count its pieces ... pass sample_inputs=": a config
    # could not pass them.
    run = train.prepare(module_config(**{"pipeline.boundaries": (3,)}))
    assert run.pipe.boundaries == [3] and len(run.pipe.layers) > 3


class NnxClassifier(nnx.Module):
    """An NNX model named by import path ("test_module_training:NnxClassifier")."""
    def __init__(self, hidden: int = 16, *, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.inp = nnx.Linear(8 * 8 * 3, hidden, rngs=rngs)
        self.bn = nnx.BatchNorm(hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.bn(self.inp(x.reshape(x.shape[0], -1))))
        return self.out(h)


def test_an_nnx_module_trains_from_a_config(tmp_path, monkeypatch):
    config = module_config(**{"train.steps": 2, "model.module":
                              "test_module_training:NnxClassifier", "model.loss":
                              "classification", "data.name": "digits"})
    with config.unlocked():
        config.model.kwargs = {"hidden": 16}
        config.data.options = {"image_size": 8}
    final, run = train_capturing_run(config, tmp_path, monkeypatch)
    assert final["step"] == 2 and np.isfinite(final["train_loss"]) and final["eval_accuracy"] >= 0
    assert (tmp_path / "checkpoints" / "2").is_dir()
    # Step 1's loss: the unsplit model in training mode (BatchNorm on batch statistics)
    # on the 4 microbatches of 2 rows, from the initial state.
    state, _ = initial_variables(run, config)
    model = nnx.merge(nnx.graphdef(run.spec.module), jax.tree.map(jax.numpy.asarray, state))
    model.set_attributes(use_running_average=False, raise_if_not_found=False)
    x, y = next(run.train_batches())
    want = np.mean([float(run.spec.loss_fn(model(x[i:i + 2]), y[i:i + 2])) for i in range(0, 8, 2)])
    np.testing.assert_allclose(records(tmp_path)[0]["train_loss"], want, rtol=2e-5)


def test_asynchronous_schedule_of_a_tied_module_is_refused(tmp_path):
    # Its pipeline updated each copy of the tied embedding with that copy's part of the
    # gradient: the run trained, silently wrong.
    config = module_config(**{"pipeline.schedule": "spectrain", "train.optimizer": "sgd",
                              "train.grad_clip_norm": 0.0, "train.weight_decay": 0.0})
    with pytest.raises(train.ConfigError, match=r"'spectrain' .*share variables") as e:
        train.train_and_evaluate(config, tmp_path / "w")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "w").exists()
