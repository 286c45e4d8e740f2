"""The training program used as a researcher who did not write it would: command-line
typos, unreadable pipeline settings, the researcher's own data streams (wrong batch
size, a generator instead of a function, evaluation batches without a mask or with a
short last batch) and own module in a file of their own. Each case here failed with a
traceback, failed only after the whole training run, or trained silently on the wrong
thing before the fixes (docs/training.md, "Trying it with your own model and data").

GPT "tiny" with explicit boundaries (no profiling); the few runs that train are one step.
"""
import itertools
import os
import pathlib
import shutil
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest

import jaxhybrid.plan
from jaxhybrid import checkpoint, data, models, train
from jaxhybrid.config_flags import base_config, load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def gpt_config(**overrides):
    return load_config("gpt_hybrid.py", {
        "model.size": "tiny", "mesh.data": 2, "mesh.pipe": 4,
        "pipeline.num_microbatches": 4, "pipeline.boundaries": (1, 2, 3),
        "train.batch_size": 16, "train.steps": 1, "train.log_every": 1,
        "train.eval_every": 0, "train.eval_steps": 0, "data.options.max_bytes": 40_000,
        "checkpoint.every": 0, **overrides})


@pytest.fixture(scope="module")
def streams():
    """GPT tiny's own dataset as the researcher's streams: (train batches, eval batches
    as (inputs, targets, mask) lists)."""
    spec = models.get_model("gpt", "tiny")
    ds = {s: data.for_model(spec, s, batch_size=16, max_bytes=40_000) for s in ("train", "test")}
    return ds["train"], list(itertools.islice(ds["test"].eval_batches(), 2))


def fails_in_one_line(config, workdir, message, **kw):
    with pytest.raises(train.ConfigError, match=message) as e:
        train.train_and_evaluate(config, workdir, **kw)
    assert "\n" not in str(e.value)
    assert not workdir.exists()


def run_script(workdir, *flags):
    """scripts/train.py on GPT (its own config unless `flags` change it) in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config=gpt_hybrid.py", *flags,
           *([f"--workdir={workdir}"] if "--workdir=" not in flags else []), "--cache_dir="]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("flag,message", [
    ("--config.train.batch_size=abc", r"^error: flag --config.train.batch_size=abc: invalid literal"),
    ("--config.train.stepz=3", r"^error: flag --config.train.stepz: .*valid keys .*train.steps"),
])
def test_script_flag_typos_end_in_one_error_line(tmp_path, flag, message):
    # They ended in absl's traceback: the script's own flags parser did not catch them.
    out = run_script(tmp_path / "w", flag)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert any(__import__("re").match(message, line) for line in out.stderr.splitlines()), \
        out.stderr[-2000:]
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("case", ["checkpoint of another model", "memory budget"])
def test_refusals_during_start_up_exit_with_their_error_line(tmp_path, case):
    """Refused while the layers' initialiser still ran on its thread: a checkpoint of
    another model size (after its error line the interpreter aborted, "terminate called
    ...", exit status 134) and a memory budget no plan fits (a traceback)."""
    if case == "checkpoint of another model":
        train.train_and_evaluate(gpt_config(**{"checkpoint.every": 1}), tmp_path)
        flags = ["--config.model.size=small"]
        message = r"error: checkpoint: step 1 in .* does not fit .*use a fresh workdir"
    else:
        flags = ["--config.model.size=tiny", "--config.pipeline.memory_budget=1KB"]
        message = r"error: the SPMD program needs .* over the 1KB memory budget; .*bigger budget"
    out = run_script(tmp_path, *flags)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "Fatal" not in out.stderr, out.stderr[-2000:]
    assert __import__("re").search(message, out.stderr), out.stderr[-2000:]


@pytest.mark.parametrize("field,value,message", [
    # A traceback from inside the planner (parse_bytes) after the start-up began.
    ("memory_budget", "lots", r"pipeline.memory_budget='lots': cannot read size"),
    # 1.5 was cut to layer 1 silently; "abc" failed as "invalid literal for int()".
    ("boundaries", (1.5, 2, 3), r"pipeline.boundaries=\(1.5, 2, 3\) must be a tuple of ints"),
    ("boundaries", ("abc",), r"pipeline.boundaries=\('abc',\) must be a tuple of ints"),
])
def test_unreadable_pipeline_settings_fail_in_one_line(tmp_path, field, value, message):
    config = gpt_config()
    with config.unlocked():
        config.pipeline[field] = value
    fails_in_one_line(config, tmp_path / "w", message)


def test_train_stream_mistakes_fail_before_the_workdir(tmp_path, streams):
    train_ds, _ = streams
    # A stream of 8-row batches for train.batch_size=16 trained silently (on 8 rows).
    fails_in_one_line(gpt_config(), tmp_path / "w", r"train_data: batch 0 has .*\[8\] rows.*"
                      r"train.batch_size=16", train_data=lambda: ((x[:8], y[:8]) for x, y in
                                                                  train_ds.batches()))
    # The generator instead of the function making it: "'generator' object is not callable".
    fails_in_one_line(gpt_config(), tmp_path / "w", r"train_data must be a function .*got a "
                      r"generator", train_data=train_ds.batches())


def test_a_short_batch_later_in_the_train_stream_is_named(tmp_path, streams):
    train_ds, _ = streams

    def short_second():
        x, y = next(train_ds.batches())
        yield x, y
        yield x[:8], y[:8]                  # would recompile and train on 8 rows
    with pytest.raises(train.ConfigError, match=r"train_data: batch 1 has .*\[8\] rows"):
        train.train_and_evaluate(gpt_config(**{"train.steps": 2}), tmp_path / "w",
                                 train_data=short_second)


def test_eval_stream_without_mask_and_with_a_short_last_batch(tmp_path, streams):
    """(inputs, targets) batches and a 5-row last batch: evaluation unpacked three parts
    and placed the short batch as it was, both failing after the whole training run.
    Now the metrics are those of the same rows given padded and masked. Also: a train
    stream whose batch after the last step is short is never read."""
    train_ds, evals = streams
    (x0, y0, m0), (x1, y1, _) = evals

    def one_batch_then_short():
        x, y = next(train_ds.batches())
        yield x, y
        yield x[:8], y[:8]                  # past train.steps=1: not read
    plain = lambda: iter([(x0, y0), (x1[:5], y1[:5])])
    final = train.train_and_evaluate(gpt_config(), tmp_path, train_data=one_batch_then_short,
                                     eval_data=plain)
    assert final["step"] == 1 and np.isfinite(final["eval_loss"])
    padded = lambda: iter([(x0, y0, np.ones(16, bool)), (x1, y1, np.arange(16) < 5)])
    # The same workdir at train.steps=1: nothing left to train, only evaluated again.
    again = train.train_and_evaluate(gpt_config(), tmp_path, train_data=one_batch_then_short,
                                     eval_data=padded)
    assert again["step"] == 1
    np.testing.assert_allclose(final["eval_loss"], again["eval_loss"], rtol=1e-6)
    np.testing.assert_allclose(final["eval_token_accuracy"], again["eval_token_accuracy"],
                               rtol=1e-6)


MY_MODEL = '''
import flax.linen as nn

class Classifier(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(nn.relu(nn.Dense(self.hidden)(x)))
'''


def test_own_module_with_train_data_needs_eval_data(tmp_path, monkeypatch):
    """A module in the researcher's own file, streams of their own, no data.name: without
    eval_data it failed as KeyError 'num_classes' deep in data.for_model."""
    (tmp_path / "my_models.py").write_text(MY_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    c = base_config()
    c.model.module, c.model.kwargs = "my_models:Classifier", {"hidden": 8}
    c.mesh.data, c.mesh.pipe, c.pipeline.num_microbatches = 2, 2, 2
    c.train.batch_size, c.train.steps = 8, 1
    c.lock()
    x = np.random.default_rng(0).normal(size=(8, 12)).astype(np.float32)
    batches = lambda: itertools.repeat((x, np.arange(8, dtype=np.int32)))
    fails_in_one_line(c, tmp_path / "w", r"model.module='my_models:Classifier' with "
                      r"train_data= and no data.name needs eval_data=", train_data=batches)


def test_a_file_named_checkpoints_in_the_workdir_fails_before_training(tmp_path):
    # Orbax failed at the first save, after the training steps, with pages of traceback.
    (tmp_path / "checkpoints").write_text("my notes")
    with pytest.raises(train.ConfigError, match=r"checkpoints is a file; move it away") as e:
        train.train_and_evaluate(gpt_config(), tmp_path)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_a_plan_over_the_memory_budget_leaves_no_workdir(tmp_path):
    # The refusal was right but left an empty checkpoints/ folder (orbax makes it).
    with pytest.raises(jaxhybrid.plan.MemoryBudgetError, match=r"1KB") as e:
        train.train_and_evaluate(gpt_config(**{"pipeline.memory_budget": "1KB",
                                               "pipeline.boundaries": None}), tmp_path / "w")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "w").exists()


def test_a_workdir_that_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    # os.access can say yes where mkdir fails (/proc as root): orbax's traceback before.
    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(checkpoint, "Checkpointer", refuse)
    with pytest.raises(train.ConfigError, match=r"workdir: cannot create .*checkpoints "
                                                r"\(Permission denied\); pass a --workdir") as e:
        train.train_and_evaluate(gpt_config(), tmp_path / "w")
    assert "\n" not in str(e.value)


def test_a_workdir_whose_lock_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    # The lock's mkdir came first: /proc/x as root ended in a 35-line FileNotFoundError.
    from jaxhybrid import workdir as workdir_
    monkeypatch.setattr(workdir_, "open", lambda *a, **k: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied")), raising=False)
    with pytest.raises(train.ConfigError, match=r"workdir: cannot create .*\.lock "
                                                r"\(Permission denied\); pass a --workdir") as e:
        train.train_and_evaluate(gpt_config(), tmp_path / "w")
    assert "\n" not in str(e.value)


def test_fewer_steps_than_the_workdir_holds_are_refused_before_anything_changes(tmp_path):
    """train.steps=1 in a workdir at step 2: it restored, evaluated, rewrote config.json
    with the smaller count and reported step 2, exit 0."""
    train.train_and_evaluate(gpt_config(**{"train.steps": 2, "checkpoint.every": 2}), tmp_path)
    saved = (tmp_path / "config.json").read_text()
    with pytest.raises(train.ConfigError, match=r"train.steps=1, but .* holds a run at step 2; "
                                                r"raise train.steps"):
        train.train_and_evaluate(gpt_config(), tmp_path)
    assert (tmp_path / "config.json").read_text() == saved
    # The same count again (a requeued job that had finished) still runs as before.
    again = gpt_config(**{"train.steps": 2, "checkpoint.every": 2})
    assert train.train_and_evaluate(again, tmp_path)["step"] == 2


@pytest.mark.parametrize("args,message", [
    (["--config.model.size=tiny", "--config.model.loss=mine:fn"],
     r"^error: model.loss / model.kwargs are for model.module"),
    (["--config.model.size=tiny", "--config.model.kwargs.depth=2"],
     r"^error: model.loss / model.kwargs are for model.module"),
    (["stray"], r"^error: unexpected arguments \['stray'\]; every setting is a flag"),
    (["--workdir="], r"^error: --workdir= is empty; give a directory"),
])
def test_settings_train_py_would_ignore_are_refused_in_one_line(tmp_path, args, message):
    """A built-in model trained with its own loss whatever model.loss / model.kwargs
    said; a stray argument printed the whole --help page; an empty --workdir wrote to
    /tmp/jaxhybrid/<config>."""
    out = run_script(tmp_path / "w", *args)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr and "flags:" not in out.stderr, out.stderr[-2000:]
    assert any(__import__("re").match(message, line) for line in out.stderr.splitlines()), \
        out.stderr[-2000:]
    assert not (tmp_path / "w").exists()


def test_a_workdir_under_a_file_is_named_as_such(tmp_path):
    # Was "... is not writable (a read-only file system or no permission)".
    (tmp_path / "afile").write_text("")
    fails_in_one_line(gpt_config(), tmp_path / "afile" / "sub",
                      r"workdir: .*afile is a file, so .*sub cannot be made in it")


def test_an_empty_step_directory_names_the_older_step_to_resume_from(tmp_path):
    """A leftover empty `checkpoints/9/` beside a good step 1: the refusal said only
    "does not fit this model and optimizer"; it now also names step 1 to resume from."""
    train.train_and_evaluate(gpt_config(), tmp_path)
    (tmp_path / "checkpoints" / "9").mkdir()
    with pytest.raises(checkpoint.CheckpointMismatch, match=r"step 9 .*move it away to "
                       r"resume from step 1\.$") as e:
        train.train_and_evaluate(gpt_config(**{"train.steps": 10}), tmp_path)
    assert "\n" not in str(e.value)
    shutil.rmtree(tmp_path / "checkpoints" / "9")
    assert train.train_and_evaluate(gpt_config(**{"train.steps": 2}), tmp_path)["step"] == 2


def test_a_mesh_smaller_than_the_devices_runs_and_says_how_many_are_idle():
    from absl import logging as absl_logging
    from jaxhybrid import run_setup
    config = load_config("gpt_hybrid.py", {
        "mesh.data": 2, "mesh.pipe": 3, "model.size": "tiny", "train.batch_size": 16,
        "pipeline.num_microbatches": 2})
    seen = []
    with mock.patch.object(absl_logging, "warning", lambda msg, *a: seen.append(msg % a)):
        run = run_setup.prepare(config)
    assert run.mesh.size == 6
    assert seen == ["mesh data=2 x pipe=3 uses 6 of the 8 devices; the rest stay idle "
                    "(mesh.data=-1 takes every device left)."]
