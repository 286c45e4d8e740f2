"""train_and_evaluate: smoke runs of the configs, pipelined == data-parallel, exact
resume, restore into other layouts, metrics output, NaN guard, bad configs.

Most tests train GPT "tiny" (4 layers: embedding | block | block | head), which
compiles in seconds; explicit boundaries skip the planner's profiling. The Inception
default config is smoke-run through scripts/train.py in test_config_flags.py.
"""
import itertools
import json
import pathlib
import queue
import shutil
import time
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jaxhybrid import checkpoint, data, metrics, models, optim, portable, train
from jaxhybrid import pipeline as jp
from jaxhybrid.config_flags import load_config

# (data, pipe) -> num_microbatches and boundaries such that every layout splits a
# batch of 16 into the same 8 microbatches of 2 (dropout keys are per microbatch).
LAYOUTS = {(2, 4): (4, (1, 2, 3)), (8, 1): (1, ()), (4, 2): (2, (2,)), (1, 1): (8, ())}


def gpt_config(data=2, pipe=4, **overrides):
    m, bounds = LAYOUTS[(data, pipe)]
    return load_config("gpt_hybrid.py", {
        "model.size": "tiny", "mesh.data": data, "mesh.pipe": pipe,
        "pipeline.num_microbatches": m, "pipeline.boundaries": bounds,
        "train.batch_size": 16, "train.steps": 6, "train.warmup_steps": 2,
        "train.log_every": 1, "train.eval_every": 0, "train.eval_steps": 2,
        "data.options.max_bytes": 40_000, "checkpoint.every": 3, **overrides})


def records(workdir):
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def losses(workdir):
    return {r["step"]: r["train_loss"] for r in records(workdir)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """6 uninterrupted steps on (data=2, pipe=4), checkpoints at 3 and 6."""
    workdir = tmp_path_factory.mktemp("reference")
    final = train.train_and_evaluate(gpt_config(), workdir)
    return workdir, final


@pytest.mark.parametrize("name,overrides", [
    # Explicit boundaries save the planner's profiling; gpt keeps the planner's choice.
    # Other schedules from the config: interleaved (4 devices x 2 stages), zb-h1.
    ("gnmt_hybrid.py", {"train.batch_size": 16, "data.options.num_train": 64,
                        "data.options.num_test": 32, "pipeline.schedule": "interleaved",
                        "pipeline.boundaries": (2, 3, 4, 5, 6, 7, 9)}),
    ("biglstm_hybrid.py", {"train.batch_size": 16, "data.options.max_bytes": 40_000,
                           "pipeline.schedule": "zb-h1", "pipeline.boundaries": (1, 2, 3)}),
    ("gpt_hybrid.py", {"train.batch_size": 16, "data.options.max_bytes": 40_000}),
])
def test_every_config_runs_two_steps_at_tiny_size(tmp_path, name, overrides, caplog):
    config = load_config(name, {"model.size": "tiny", "train.steps": 2, "train.eval_steps": 1,
                                **overrides})
    caplog.set_level("INFO", logger="absl")
    final = train.train_and_evaluate(config, tmp_path)
    # The mesh as configured (interleaved logged its 8 stages as pipe=8 on 4 devices).
    stages = 8 if config.pipeline.schedule == "interleaved" else 4
    assert f"on mesh data=2 x pipe=4 x model=1 (1 processes), {stages} stages" in caplog.text
    assert final["step"] == 2
    assert np.isfinite(final["train_loss"]) and np.isfinite(final["eval_loss"])
    assert final["eval_loss"] > 0
    assert (tmp_path / "checkpoints" / "2").is_dir()
    assert final["examples_per_sec"] == pytest.approx(final["steps_per_sec"] * 16)
    # Model FLOPs from the costs the planner profiled (explicit boundaries: none, and
    # no profiling for them); no utilization on CPU, whose peak is a guess.
    assert ("model_tflops" in final) == (config.pipeline.boundaries is None)
    assert final.get("model_tflops", 1.0) > 0 and "mfu" not in final


def test_pipelined_run_follows_the_data_parallel_run(tmp_path):
    # Same global batches, same 8 microbatches of 2 (dropout on, same keys per
    # microbatch); only the placement differs: 8 replicas vs 2 replicas x 4 stages.
    common = {"train.steps": 20, "checkpoint.every": 0, "train.eval_every": 20}
    dp = train.train_and_evaluate(gpt_config(8, 1, **common), tmp_path / "dp")
    pp = train.train_and_evaluate(gpt_config(2, 4, **common), tmp_path / "pp")
    a, b = losses(tmp_path / "dp"), losses(tmp_path / "pp")
    assert sorted(a) == sorted(b) == list(range(1, 21))
    np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=0, atol=1e-4)
    assert a[20] < a[1] - 0.5                                 # and it actually learns
    assert abs(dp["eval_loss"] - pp["eval_loss"]) < 1e-4


class _Preempted(Exception):
    pass


def _interrupt_at(monkeypatch, stop_call, error=_Preempted):
    """Make the train step raise `error` on its `stop_call`-th call, like a preemption."""
    make = train.make_train_step

    def patched(run, t):
        step, calls = make(run, t), [0]

        def wrapped(*args):
            calls[0] += 1
            if calls[0] == stop_call:
                raise error()
            return step(*args)
        return wrapped
    monkeypatch.setattr(train, "make_train_step", patched)


def test_interrupted_and_resumed_run_matches_the_uninterrupted_one(reference, tmp_path,
                                                                   monkeypatch):
    ref_dir, ref_final = reference
    with monkeypatch.context() as m:
        _interrupt_at(m, 5)               # steps 1-4 done and logged, checkpoint at 3
        with pytest.raises(_Preempted):
            train.train_and_evaluate(gpt_config(), tmp_path)
    assert checkpoint.Checkpointer(tmp_path / "checkpoints", keep=2).all_steps() == [3]
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3, 4]
    final = train.train_and_evaluate(gpt_config(), tmp_path)
    # Step 4 was logged by the interrupted run and again after resuming from 3: once.
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3, 4, 5, 6]
    assert losses(tmp_path) == losses(ref_dir)                # bit for bit
    assert final["eval_loss"] == ref_final["eval_loss"]


def test_a_resume_under_another_train_steps_says_the_schedule_changed(reference, tmp_path,
                                                                      caplog):
    # The learning rate decays to 0 at train.steps: 6 steps resumed for 7 is not a
    # 7-step run, and nothing said so (a probe's spectrain run: other losses from step 2).
    shutil.copytree(reference[0] / "checkpoints", tmp_path / "checkpoints")
    train.train_and_evaluate(gpt_config(**{"train.steps": 7}), tmp_path)
    assert "resumed with train.steps=7, saved under train.steps=6" in caplog.text
    assert "changes from step 7 on" in caplog.text


def test_a_stopped_run_saves_its_last_step_and_resumes_from_it(reference, tmp_path,
                                                               monkeypatch):
    # SIGTERM (a preemption, launch_local's stop) killed the run at once: the steps
    # since the last checkpoint were lost and a checkpoint being written was dropped.
    import os
    import signal
    from jaxhybrid import distributed
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    exits = queue.Queue()

    fake_exit = exits.put         # what the watcher thread would exit the process with
    try:
        distributed.stop_on_signals(grace_s=0.5, _exit=fake_exit)
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
        assert exits.get(timeout=10) == 143      # had the main thread not stopped
        # One of several processes: exits at once, naming itself, even while the main
        # thread waits in a collective (a Ctrl-C to one left the others waiting 300 s
        # in a checkpoint barrier, then blamed process 0).
        with monkeypatch.context() as m:
            m.setattr(jax, "process_count", lambda: 2)
            m.setattr(jax, "process_index", lambda: 1)
            distributed.stop_on_signals(_exit=fake_exit)
            os.kill(os.getpid(), signal.SIGINT)
            assert exits.get(timeout=10) == 130
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])
    with monkeypatch.context() as m:
        _interrupt_at(m, 5, KeyboardInterrupt)      # what SIGTERM raises now
        with pytest.raises(KeyboardInterrupt):
            train.train_and_evaluate(gpt_config(), tmp_path)
    assert checkpoint.Checkpointer(tmp_path / "checkpoints", keep=2).all_steps() == [3, 4]
    train.train_and_evaluate(gpt_config(), tmp_path)
    assert losses(tmp_path) == losses(reference[0])          # bit for bit


def test_the_record_after_a_resume_averages_the_steps_since_the_last_record(reference, tmp_path,
                                                                            monkeypatch):
    # Records every 2 steps, checkpoints every 3: the record of step 4 averages steps 3
    # and 4. Resumed from step 3 it averaged step 4 alone (the window was not saved).
    ref = losses(reference[0])                                # every step's own loss
    config = gpt_config(**{"train.log_every": 2})
    with monkeypatch.context() as m:
        _interrupt_at(m, 5)
        with pytest.raises(_Preempted):
            train.train_and_evaluate(config, tmp_path)
    train.train_and_evaluate(config, tmp_path)
    got = losses(tmp_path)
    assert sorted(got) == [2, 4, 6]
    np.testing.assert_allclose([got[2], got[4], got[6]],
                               [np.mean([ref[1], ref[2]]), np.mean([ref[3], ref[4]]),
                                np.mean([ref[5], ref[6]])], rtol=1e-6)


def _restore(config, ckpt_dir, step):
    """The portable (per-layer) train state of `step`, restored through `config`'s layout."""
    run = train.prepare(config)
    variables = run.pipe.init(jax.random.key(0), next(run.train_batches())[0])
    tx = optim.make_optimizer(config.train, optim.weight_decay_mask(run.pipe, variables))
    template = {"variables": variables, "opt_state": tx.init(variables["params"])}
    state, meta = checkpoint.Checkpointer(ckpt_dir, keep=2).restore(run.pipe, template, step)
    assert meta["step"] == step and meta["layout"] == {
        "data": 2, "pipe": 4, "model": 1, "boundaries": [1, 2, 3], "schedule": "1f1b",
        "num_microbatches": 4, "updates_per_step": 1}
    return portable.to_portable(run.pipe, state)


@pytest.fixture(scope="module")
def saved_at_3(reference):
    return _restore(gpt_config(2, 4), reference[0] / "checkpoints", 3)


@pytest.mark.parametrize("layout", [(4, 2), (1, 1)])
def test_checkpoint_restores_into_another_layout_and_continues(reference, saved_at_3,
                                                                tmp_path, layout):
    ref_dir, _ = reference
    saved = saved_at_3
    moved = _restore(gpt_config(*layout), ref_dir / "checkpoints", 3)
    # Same per-layer parameters and optimizer moments, whatever the packing.
    assert jax.tree.structure(saved) == jax.tree.structure(moved)
    for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(moved)):
        np.testing.assert_array_equal(x, y)
    # Continue steps 4-6 on the new layout from the (2, 4) checkpoint at step 3.
    workdir = tmp_path / "moved"
    shutil.copytree(ref_dir / "checkpoints" / "3", workdir / "checkpoints" / "3")
    train.train_and_evaluate(gpt_config(*layout), workdir)
    ref, new = losses(ref_dir), losses(workdir)
    assert sorted(new) == [4, 5, 6]
    np.testing.assert_allclose([new[s] for s in (4, 5, 6)], [ref[s] for s in (4, 5, 6)],
                               rtol=0, atol=1e-4)


def test_checkpoint_of_another_optimizer_is_refused_clearly(reference, tmp_path):
    ref_dir, _ = reference
    shutil.copytree(ref_dir / "checkpoints" / "6", tmp_path / "checkpoints" / "6")
    with pytest.raises(checkpoint.CheckpointMismatch, match=r"step 6 in .* does not fit") as e:
        train.train_and_evaluate(gpt_config(**{"train.optimizer": "sgd"}), tmp_path)
    assert "\n" not in str(e.value)
    assert checkpoint.Checkpointer(tmp_path / "checkpoints", keep=2).all_steps() == [6]


def test_workdir_holds_metrics_events_config_and_checkpoints(reference):
    ref_dir, final = reference
    recs = records(ref_dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert all(np.isfinite(r["train_loss"]) and r["learning_rate"] >= 0 for r in recs)
    assert recs[1]["learning_rate"] == pytest.approx(2e-3 / 2)   # warm-up: 1 of 2 steps
    assert "eval_loss" in recs[-1] and "eval_token_accuracy" in recs[-1]
    assert "eval_loss" not in recs[0]                       # eval_every=0: only at the end
    assert final["eval_loss"] == recs[-1]["eval_loss"] and final["step"] == 6
    assert list(ref_dir.glob("events.out.tfevents.*"))
    assert json.loads((ref_dir / "config.json").read_text())["model"]["name"] == "gpt"
    assert checkpoint.Checkpointer(ref_dir / "checkpoints", keep=2).all_steps() == [3, 6]


def test_own_data_streams_replace_the_dataset(reference, tmp_path):
    ref_dir, ref_final = reference
    # Also traces steps 2-3 with jax.profiler (tracing must not change the numbers).
    config = gpt_config(**{"profile.enabled": True, "profile.start_step": 2,
                           "profile.num_steps": 2})
    ds = {split: data.for_model(models.get_model("gpt", "tiny", dropout_rate=0.1), split,
                                batch_size=16, max_bytes=40_000) for split in ("train", "test")}
    half = lambda: ((x, y, np.arange(16) < 8) for x, y, _ in ds["test"].eval_batches())
    final = train.train_and_evaluate(config, tmp_path, train_data=ds["train"].batches,
                                     eval_data=lambda: itertools.islice(half(), 2))
    assert losses(tmp_path) == losses(ref_dir)          # the same stream as the config's
    assert final["eval_loss"] != ref_final["eval_loss"]  # masked rows are left out
    assert [p for p in (tmp_path / "profile").rglob("*") if p.is_file()]
    with pytest.raises(ValueError, match=r"ran out after 2 steps"):
        train.train_and_evaluate(config, tmp_path / "short",
                                 train_data=lambda: itertools.islice(ds["train"].batches(), 2))
    # The two steps trained are kept: a stream that ends (or a bad batch) lost every
    # step since the last checkpoint (checkpoint.every=3 here), all of them by default.
    assert checkpoint.Checkpointer(tmp_path / "short" / "checkpoints", keep=2).all_steps() == [2]


def test_resumed_run_traces_what_is_left_of_the_profile_window(tmp_path, caplog):
    # Steps 2-3 traced; a run resumed at step 3 traces step 3, one resumed later none.
    profile = ml_collections.ConfigDict(dict(enabled=True, start_step=2, num_steps=2))
    trace = metrics.ProfilerTrace(profile, tmp_path, first_step=3)
    for step in (3, 4):
        trace.before(step)
        assert trace.tracing == (step == 3)
        trace.after(step, None)
    assert [p for p in (tmp_path / "profile").rglob("*") if p.is_file()]
    metrics.ProfilerTrace(profile, tmp_path / "late", first_step=5).before(5)
    assert not (tmp_path / "late").exists()
    assert "steps 2..3 ran before the restored step 4" in caplog.text


def _events(event_file) -> list:
    """The Event protos of one TensorBoard event file (TFRecords: length, its crc, the
    Event proto, its crc)."""
    from tensorboardX.proto.event_pb2 import Event
    data, out, i = pathlib.Path(event_file).read_bytes(), [], 0
    while i < len(data):
        n = int.from_bytes(data[i:i + 8], "little")
        out.append(Event.FromString(data[i + 12:i + 12 + n]))
        i += 16 + n
    return out


def _session_starts(event_file) -> list[int]:
    """Steps of the SessionLog START events in one event file; TensorBoard purges earlier
    files' events from such a step on."""
    from tensorboardX.proto.event_pb2 import SessionLog
    return [e.step for e in _events(event_file)
            if e.HasField("session_log") and e.session_log.status == SessionLog.START]


def test_fresh_start_in_a_used_workdir_purges_the_old_events(tmp_path):
    # A run that crashed before its first checkpoint left steps 1-3 in the events; the
    # restart (from step 0) had no purge marker, so TensorBoard showed both runs.
    from jaxhybrid.metrics import MetricWriter
    for steps in ([1, 2, 3], [1, 2]):
        writer = MetricWriter(tmp_path, start_step=0)
        for step in steps:
            writer.write({"step": step, "train_loss": 1.0})
        writer.close()
        time.sleep(1.1)          # the event file's name holds the second it was made in
    files = sorted(tmp_path.glob("events.out.tfevents.*"), key=lambda f: f.stat().st_mtime_ns)
    assert len(files) == 2 and _session_starts(files[-1]) == [1]
    assert [json.loads(r)["step"] for r in (tmp_path / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2]


def _scalar_steps(event_file) -> list[int]:
    return [e.step for e in _events(event_file) for _ in e.summary.value]


def test_each_record_is_in_the_events_before_the_run_ends(tmp_path):
    # A killed run lost the events tensorboardX had buffered (up to 2 minutes of them)
    # for good: the resume purges only steps after its checkpoint, and never rewrote them.
    from jaxhybrid.metrics import MetricWriter
    writer = MetricWriter(tmp_path, start_step=0)
    for step in (1, 2):
        writer.write({"step": step, "train_loss": 1.0})
    (events,) = tmp_path.glob("events.out.tfevents.*")
    for _ in range(50):                          # not closed: as a SIGKILL would leave it
        if _scalar_steps(events) == [1, 2]:
            break
        time.sleep(0.1)
    assert _scalar_steps(events) == [1, 2]
    writer.close()


def test_a_nan_loss_with_finite_gradients_names_the_targets():
    # A label past the model's classes (own train_data, no num_classes to check against)
    # gave a NaN loss with finite gradients, blamed on the learning rate.
    t, ckpt = types.SimpleNamespace(learning_rate=0.1), types.SimpleNamespace(directory="ck")
    with pytest.raises(train.TrainingDiverged, match="check the targets .*label past"):
        train.stopping.check_finite({"loss": float("nan"), "grad_norm": 1.0, "param_norm": 2.0}, 1, t,
                            None, ckpt)
    with pytest.raises(train.TrainingDiverged, match="diverged; lower train.learning_rate"):
        train.stopping.check_finite({"loss": float("nan"), "grad_norm": float("nan"),
                             "param_norm": 2.0}, 1, t, None, ckpt)
    # A fresh run's first gradients come from the initial parameters: NaN there (sqrt at
    # 0 in the model) was blamed on the learning rate, not used yet.
    with pytest.raises(train.TrainingDiverged, match=r"initial parameters already give them, "
                                                     r"before any update \(not the learning"):
        train.stopping.check_finite({"loss": 2.39, "grad_norm": float("nan"),
                                     "param_norm": float("nan")}, 1, t, None, ckpt,
                                    from_init=True)


def test_nan_guard_names_the_step_and_keeps_no_bad_checkpoint(tmp_path):
    config = gpt_config(**{"train.learning_rate": 1e12, "train.warmup_steps": 0,
                           "train.weight_decay": 0.0, "train.grad_clip_norm": 0.0,
                           "train.steps": 20, "checkpoint.every": 1})
    with pytest.raises(train.TrainingDiverged, match=r"at step (\d+) .*learning_rate") as e:
        train.train_and_evaluate(config, tmp_path)
    bad = int(e.value.args[0].split("at step ")[1].split(" ")[0])
    assert 1 <= bad <= 20
    saved = checkpoint.Checkpointer(tmp_path / "checkpoints", keep=2).all_steps()
    assert all(s < bad for s in saved)
    assert (f"last checkpoint: step {saved[-1]} in" if saved      # was "step None"
            else "no checkpoint was saved in") in str(e.value)
    if saved:                              # what was saved before is finite
        state = _restore(config, tmp_path / "checkpoints", saved[-1])
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(state))


@pytest.mark.parametrize("overrides,message", [
    ({"mesh.data": 4, "mesh.pipe": 4}, r"mesh .*only 8 are available"),
    ({"train.batch_size": 12}, r"batch_size=12 is not divisible by .* 2 x 4 = 8"),
    ({"model.name": "resnet"}, r"model: .*unknown model 'resnet'"),
    ({"train.optimizer": "lamb"}, r"train.optimizer='lamb' is unknown"),
    ({"pipeline.boundaries": (1, 2)}, r"pipeline: "),
    ({"mesh.pipe": 8, "mesh.data": 1, "pipeline.boundaries": None}, r"8 stages .*but only 4 layers"),
    ({"profile.enabled": True, "profile.start_step": 7}, r"profile.start_step=7 is after .*=6\)"),
    ({"train.learning_rate": float("inf")}, r"learning_rate=inf must be a finite number > 0"),
    ({"train.weight_decay": float("inf")}, r"weight_decay=inf must be a finite number >= 0"),
    ({"model.overrides.num_layers": "x"}, r"model: gpt: num_layers='x' must be an int >= 1"),
])
def test_bad_config_fails_clearly_before_touching_the_workdir(tmp_path, overrides, message):
    workdir = tmp_path / "w"
    with pytest.raises(train.ConfigError, match=message) as e:
        train.train_and_evaluate(gpt_config(**overrides), workdir)
    assert "\n" not in str(e.value)
    assert not workdir.exists()


def test_unknown_config_key_fails_clearly():
    with pytest.raises(ValueError, match=r"unknown key 'train.stepz'.*train.steps"):
        gpt_config(**{"train.stepz": 3})


def test_a_workdir_in_use_by_another_run_is_refused_naming_it(tmp_path):
    # Two runs in one workdir wrote the same checkpoint steps and interleaved their
    # metrics.jsonl records (278 for 150 steps), or failed at the first save in orbax.
    from jaxhybrid import workdir as workdir_
    (tmp_path / "notes.txt").write_text("the other run's file")
    held = workdir_.Lock(tmp_path)            # as the other run's process 0 holds it
    try:
        with pytest.raises(train.ConfigError, match=r"is in use by another run \(pid \d+ on "):
            train.train_and_evaluate(gpt_config(), tmp_path)
        assert (tmp_path / "notes.txt").exists() and not (tmp_path / "checkpoints").exists()
    finally:
        held.release()
    final = train.train_and_evaluate(gpt_config(), tmp_path)   # free again: it runs
    assert final["step"] == gpt_config().train.steps


@pytest.mark.parametrize("at", [5, 6])
def test_a_signal_during_a_step_stops_after_it_and_saves_it(reference, tmp_path, monkeypatch, at):
    # Raised at once, the KeyboardInterrupt landed while the host waited for the step,
    # whose input state was donated: "Array has been deleted", no checkpoint (3 of 3
    # real SIGTERMs), and records or a checkpoint cut short. Now the step, its record
    # and checkpoint finish, then the run stops; the resumed run is the uninterrupted one.
    # During the last step (6) the run finishes: it ended "stopped" (status 143), which a
    # scheduler read as preempted, after it had trained, saved and evaluated every step.
    import os
    import signal
    from jaxhybrid import distributed
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    make = train.make_train_step

    def patched(run, t):
        step, calls = make(run, t), [0]

        def wrapped(*args):
            calls[0] += 1
            out = step(*args)                 # `state` is donated to it
            if calls[0] == at:
                os.kill(os.getpid(), signal.SIGTERM)
            return out
        return wrapped
    try:
        distributed.stop_on_signals(grace_s=600, _exit=lambda code: None)
        with monkeypatch.context() as m:
            m.setattr(train, "make_train_step", patched)
            if at == 6:
                final = train.train_and_evaluate(gpt_config(), tmp_path)
            else:
                with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
                    train.train_and_evaluate(gpt_config(), tmp_path)
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])
    assert checkpoint.Checkpointer(tmp_path / "checkpoints", keep=2).latest_step() == at
    assert sorted(losses(tmp_path)) == sorted(s for s in losses(reference[0]) if s <= at)
    if at == 6:
        timed = ("wall_time_s", "steps_per_sec", "examples_per_sec", "model_tflops")
        assert {k: v for k, v in final.items() if k not in timed} == \
            {k: v for k, v in reference[1].items() if k not in timed}
        return
    train.train_and_evaluate(gpt_config(), tmp_path)
    assert losses(tmp_path) == losses(reference[0])          # bit for bit


def test_rows_left_out_of_the_evaluation_cannot_poison_it():
    # A padding row's NaN (a model normalising zero rows, a label past the classes) made
    # eval_loss NaN although its mask was False.
    from jaxhybrid.models.spec import classification_metrics
    logits = jnp.array([[2.0, 0.0], [jnp.nan, 1.0], [0.0, 3.0]])
    labels = jnp.array([0, 1, 99])
    sums, count = metrics.metric_sums(classification_metrics, logits, labels,
                                      jnp.array([True, False, False]))
    want = float(jax.nn.logsumexp(logits[0]) - logits[0, 0])
    assert float(count) == 1.0
    np.testing.assert_allclose(float(sums["loss"]), want, rtol=1e-6)
    assert float(sums["accuracy"]) == 1.0


class _MaskedTokenLoss(jp.WeightedMean):
    """A researcher's masked per-token loss: targets (labels [B, T], mask [B, T])."""

    def total(self, outputs, targets):
        labels, mask = targets
        nll = -jnp.take_along_axis(jax.nn.log_softmax(outputs), labels[..., None], -1)[..., 0]
        return jnp.sum(nll * mask)

    def weight(self, targets):
        return jnp.sum(targets[1])


def test_eval_loss_of_a_weighted_mean_is_its_mean_over_the_set():
    # A loss given by import path was evaluated row by row with each row weighed 1: a
    # masked token loss's eval_loss was the mean of the rows' token means (a probe: 3.84
    # where the loss itself said 1.71), unlike train_loss.
    from jaxhybrid.models.from_module import LossOnlyMetrics
    loss = _MaskedTokenLoss()
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 5, 7)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 7, size=(4, 5)))
    mask = jnp.asarray([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]],
                       jnp.float32)
    sums, count = metrics.metric_sums(LossOnlyMetrics(loss), logits, (labels, mask),
                                      jnp.ones(4, bool))
    assert float(count) == 7.0
    np.testing.assert_allclose(float(sums["loss"]) / float(count),
                               float(loss(logits, (labels, mask))), rtol=1e-6)


def test_evaluation_takes_outputs_with_one_value_per_microbatch():
    # apply returns a scalar output (an auxiliary loss) once per microbatch, [data x M];
    # the per-row metrics failed with jax's "vmap got inconsistent sizes" after the whole
    # run. Each row now sees its microbatch's value, as the loss does in training.
    fn = lambda o, t: {"loss": jnp.mean((o["y"] - t) ** 2) + o["aux"]}
    y, t = jnp.arange(8.0), jnp.zeros(8)
    aux = jnp.asarray([10.0, 20.0, 30.0, 40.0])        # 4 microbatches of 2 rows
    sums, count = metrics.metric_sums(fn, {"y": y, "aux": aux}, t, jnp.ones(8, bool))
    assert float(count) == 8.0
    np.testing.assert_allclose(float(sums["loss"]), float(jnp.sum(y ** 2) + 2 * jnp.sum(aux)))
    with pytest.raises(ValueError, match=r"output \['aux'\] \(3,\) has neither a row per "
                                         r"example nor one per microbatch") as e:
        metrics.metric_sums(fn, {"y": y, "aux": aux[:3]}, t, jnp.ones(8, bool))
    assert "\n" not in str(e.value)


def test_the_checkpoint_is_written_before_an_evaluation_that_fails(tmp_path, monkeypatch):
    # The last step's evaluation ran before its checkpoint: a model whose evaluation
    # failed (one that samples in evaluation, an output the metrics could not take) lost
    # the whole run, every step since the last checkpoint.
    def failing(*args, **kwargs):
        raise RuntimeError("evaluation failed")
    monkeypatch.setattr(train, "evaluate", failing)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        train.train_and_evaluate(gpt_config(**{"train.steps": 2, "checkpoint.every": 0}),
                                 tmp_path)
    assert checkpoint.Checkpointer(tmp_path / "checkpoints", keep=2).latest_step() == 2


def test_evaluation_gives_a_model_that_samples_its_keys(monkeypatch):
    # A model that draws in evaluation (a VAE's latent) needs a key in apply; evaluation
    # passed none and failed after the whole run. Each batch gets its own, fixed, key.
    keys = []

    class Pipe:
        def apply(self, variables, inputs, rng=None):
            keys.append(None if rng is None else np.asarray(jax.random.key_data(rng)))
            return inputs

    batches = [(np.ones((8, 2), np.float32), np.zeros((8, 2), np.float32), np.ones(8, bool))] * 2
    run = types.SimpleNamespace(eval_batches=lambda: iter(batches), pipe=Pipe(),
                                mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
                                spec=types.SimpleNamespace(metrics_fn=lambda o, t: {
                                    "loss": jnp.mean((o - t) ** 2)}))
    for _ in range(2):
        assert metrics.evaluate(run, None) == {"eval_loss": 1.0}
    assert len(keys) == 4 and all(k is not None for k in keys)
    assert not np.array_equal(keys[0], keys[1])          # one per batch
    np.testing.assert_array_equal(keys[0], keys[2])      # the same in every evaluation
