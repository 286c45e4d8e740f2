"""Checkpoints and processes used as a researcher who did not write them would: a
workdir holding another model's or optimizer's checkpoint, a damaged step directory, a
disk that fills up during a save, and processes started with different flags. Each
case failed after compiling, failed with pages of traceback, or trained silently on
the wrong thing before the fixes (docs/training.md, "Checkpoints and processes, tried
as a new user would").

GPT "tiny" with explicit boundaries (no profiling); one saved run of two steps.
"""
import errno
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxhybrid import checkpoint, optim, train
from jaxhybrid.config_flags import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = {"model.size": "tiny", "mesh.data": 2, "mesh.pipe": 4, "pipeline.num_microbatches": 4,
         "pipeline.boundaries": (1, 2, 3), "train.batch_size": 16, "train.steps": 2,
         "train.log_every": 1, "train.eval_every": 0, "train.eval_steps": 1,
         "data.options.max_bytes": 40_000, "checkpoint.every": 1, "checkpoint.keep": 5}


def gpt_config(model=None, **overrides):
    config = load_config("gpt_hybrid.py", {**SMALL, **overrides})
    with config.unlocked():
        config.model.overrides.update(model or {})
    return config


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A workdir with the checkpoints of steps 1 and 2 of `gpt_config()`."""
    workdir = tmp_path_factory.mktemp("saved")
    train.train_and_evaluate(gpt_config(), workdir)
    return workdir


def copy_checkpoints(saved, workdir):
    shutil.copytree(saved / "checkpoints", workdir / "checkpoints")
    return workdir / "checkpoints"


@pytest.mark.parametrize("model,overrides,message", [
    ({"d_model": 64}, {}, r"\(layers/0/opt/0/wpe was saved with shape \(64, 32\), this model "
                          r"has \(64, 64\)\)"),
    ({"num_layers": 3}, {}, r"\(the checkpoint has 4 layers, this model 5\)"),
    ({}, {"train.optimizer": "sgd"}, r"\(the checkpoint has 2 optimizer slots per parameter, "
                                     r"this optimizer 1: another train.optimizer"),
    # An asynchronous schedule makes several optimizer updates per step: Adam's counts
    # and the learning-rate schedule were silently misread (rate 0 after pipedream ->
    # 1f1b: the weights froze; the warm-up again after M=2 -> 4).
    ({}, {"pipeline.schedule": "pipedream", "train.grad_clip_norm": 0.0,
          "train.weight_decay": 0.0},
     r"saved by schedule 1f1b with 4 microbatches, 1 optimizer updates per step; this run, "
     r"schedule pipedream with 4 microbatches, makes 4.*keep pipeline.schedule"),
    # spectrain keeps one more slot: the message named the optimizer, not the schedule.
    ({}, {"pipeline.schedule": "spectrain", "train.grad_clip_norm": 0.0,
          "train.weight_decay": 0.0},
     r"3 \(saved with schedule 1f1b, this run uses spectrain\): another pipeline.schedule"),
])
def test_another_models_checkpoint_is_refused_before_compiling(saved, tmp_path, monkeypatch,
                                                                model, overrides, message):
    """The refusal came after the step had compiled (minutes for a large model) and
    said only "tree structures do not match" or orbax's shape message; it now comes from
    the checkpoint's metadata before any compilation and names the difference."""
    copy_checkpoints(saved, tmp_path)
    compiled = []
    monkeypatch.setattr(train, "compile_ahead", lambda *a, **k: compiled.append(a))
    with pytest.raises(checkpoint.CheckpointMismatch, match=message) as e:
        train.train_and_evaluate(gpt_config(model, **{"train.steps": 3, **overrides}), tmp_path)
    assert "\n" not in str(e.value) and "step 2" in str(e.value)
    assert compiled == []


def restorer(config):
    """restore(directory) -> (state, meta) of its latest step, for `config`'s pipeline."""
    run = train.prepare(config)
    variables = run.pipe.init(jax.random.key(0), run.sample_inputs)
    tx = optim.make_optimizer(config.train, optim.weight_decay_mask(run.pipe, variables))
    template = {"variables": variables, "opt_state": tx.init(variables["params"])}

    def restore(directory):
        checkpointer = checkpoint.Checkpointer(directory, keep=5)
        try:
            return checkpointer.restore(run.pipe, template)
        finally:
            checkpointer.close()
    return restore


def test_a_damaged_checkpoint_is_named_in_one_line(saved, tmp_path):
    """A truncated data file (a copy cut short, a disk error) raised tensorstore's plain
    Exception with a page of spec JSON; a garbled meta file said "does not fit this
    model". Both now say the step cannot be read and name the step to resume from."""
    directory = copy_checkpoints(saved, tmp_path)
    step = directory / "2" / "state"
    for f in step.rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[:100])
    restore = restorer(gpt_config())
    pattern = (r"^checkpoint: step 2 in .* cannot be read \(.+\): it is incomplete or "
               r"damaged; move it away to resume from step 1\.$")
    with pytest.raises(checkpoint.CheckpointMismatch, match=pattern) as e:
        restore(directory)
    assert "\n" not in str(e.value) and "tensorstore_spec" not in str(e.value)
    assert len(str(e.value)) < 400
    shutil.rmtree(directory / "2")
    shutil.copytree(saved / "checkpoints" / "2", directory / "2")
    (directory / "2" / "meta" / "metadata").write_text("{garbage")
    with pytest.raises(checkpoint.CheckpointMismatch, match=pattern):
        restore(directory)
    shutil.rmtree(directory / "2")
    _, meta = restore(directory)       # the older step still restores
    assert meta["step"] == 1


def test_a_flipped_byte_in_a_data_file_is_found(saved, tmp_path):
    """One byte changed in place (bit rot, a bad copy) restored silently: orbax's chunks
    carry no checksum (a kernel 0.019 off). Each leaf's checksum in the meta finds it,
    or the file no longer decodes; either way the step is named damaged."""
    restore = restorer(gpt_config())
    intact, meta = restore(saved / "checkpoints")
    assert meta["step"] == 2      # the intact checkpoint agrees with its checksums
    data = max((f for f in (saved / "checkpoints" / "2" / "state").rglob("*")
                if f.is_file() and f.parent.name == "d"), key=lambda f: f.stat().st_size)
    size, found = data.stat().st_size, []
    for at in range(size // 8, size, size // 8):
        directory = copy_checkpoints(saved, tmp_path / str(at))
        flipped = directory / data.relative_to(saved / "checkpoints")
        raw = bytearray(flipped.read_bytes())
        raw[at] ^= 0x10
        flipped.write_bytes(bytes(raw))
        try:
            state, _ = restore(directory)
        except checkpoint.CheckpointMismatch as e:
            assert re.search(r"step 2 .* cannot be read .* damaged", str(e))
            found.append("differs from what was saved" in str(e))
            continue
        # A byte the values do not use (the file's own framing) may change nothing, but
        # nothing restores different numbers silently.
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(intact)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    assert any(found)      # the checksums caught a flip the file's decoding did not


def test_checksums_on_the_host_equal_the_devices(monkeypatch):
    """Held whole on host-CPU devices, a leaf's checksum is computed in numpy (jitted,
    XLA compiled a reduction per leaf: 13.5 s at a run's first checkpoint); the figure
    is the one the devices compute (a checkpoint saved on one host, checked on several
    processes), for every dtype, key data, a 0-d leaf and a leaf sharded over 8 devices;
    and one changed word changes it."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxhybrid import checkpoint_meta
    rng = np.random.default_rng(0)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    tree = {"f32": jax.numpy.asarray(rng.normal(size=(3, 4)).astype(np.float32)),
            "bf16": jax.numpy.asarray(rng.normal(size=(5,))).astype(jax.numpy.bfloat16),
            "i32": jax.numpy.asarray(rng.integers(-5, 5, (2, 3, 4)).astype(np.int32)),
            "bool": jax.numpy.asarray(rng.random(7) > 0.5),
            "u8": jax.numpy.asarray(np.uint8([1, 2, 250])),
            "key": jax.random.split(jax.random.key(1), 4),
            "c64": jax.numpy.asarray((rng.normal(size=3) + 1j).astype(np.complex64)),
            "scalar": jax.numpy.float32(2.5),
            "sharded": jax.device_put(rng.normal(size=(16, 300)).astype(np.float32),
                                      NamedSharding(mesh, P("x")))}
    on_host = checkpoint_meta.checksums(tree)
    monkeypatch.setattr(checkpoint_meta, "_on_host", lambda leaf: None)
    assert checkpoint_meta.checksums(tree) == on_host
    monkeypatch.undo()
    flipped = np.asarray(tree["sharded"]).copy()
    flipped[9, 123] = np.nextafter(flipped[9, 123], np.float32(1))
    assert checkpoint_meta.checksums({**tree, "sharded": flipped})["sharded"] != \
        on_host["sharded"]


def test_a_full_disk_ends_the_run_in_one_line_naming_the_last_checkpoint(tmp_path,
                                                                         monkeypatch):
    """Orbax reports a failed asynchronous write (no space left) at the next save, as
    pages of traceback from its save thread; it is now one line naming the directory,
    the cause and the last complete checkpoint."""
    save, calls = ocp.CheckpointManager.save, []

    def full_after_the_first(self, step, *args, **kwargs):
        calls.append(step)
        if len(calls) > 1:          # orbax waits for the previous save, then fails
            self.wait_until_finished()
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(self, step, *args, **kwargs)
    monkeypatch.setattr(ocp.CheckpointManager, "save", full_after_the_first)
    # On a real full disk TensorBoard's writer fails to close too; its OSError replaced
    # the one-line error on its way out.
    monkeypatch.setattr(train.MetricWriter, "close", lambda self: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(checkpoint.CheckpointWriteError,
                       match=r"^checkpoint: writing to .*checkpoints failed \(.*No space left "
                             r"on device\); free space there .*last complete checkpoint: "
                             r"step 1\)\.$") as e:
        train.train_and_evaluate(gpt_config(), tmp_path)
    assert "\n" not in str(e.value)


def test_a_read_only_workdir_is_refused_before_planning(tmp_path, monkeypatch):
    """A workdir on a read-only file system (tried with a read-only bind mount) failed
    with an OSError traceback when config.json was written, after planning, compiling
    and restoring. Here the folder it would be made in reads as not writable (root
    writes through permission bits, so no chmod)."""
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, *a, **k: (
        False if pathlib.Path(path) == tmp_path else access(path, mode, *a, **k)))
    with pytest.raises(train.ConfigError, match=rf"^workdir: {tmp_path} is not writable "
                                                r"\(a read-only file system or no "
                                                r"permission\); pass a --workdir") as e:
        train.train_and_evaluate(gpt_config(), tmp_path / "w")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "w").exists()


WRAPPER = '''
import os, runpy, sys
extra = os.environ.get("EXTRA_FLAGS_%s" % os.environ["JAX_PROCESS_ID"], "")
sys.argv = [{train!r}, *sys.argv[1:], *extra.split()]
runpy.run_path({train!r}, run_name="__main__")
'''


def test_processes_started_with_different_flags_stop_with_one_error(tmp_path):
    """Process 1 with another learning rate trained silently (its data replica apart
    from process 0's, into the same checkpoint); with another train.steps it died in a
    mismatched gloo collective. Now every process stops before the workdir is touched,
    naming the first differing field."""
    script = tmp_path / "per_process.py"
    script.write_text(WRAPPER.format(train=str(ROOT / "scripts" / "train.py")))
    args = [f"--config.{k}={v!r}" if isinstance(v, tuple) else f"--config.{k}={v}"
            for k, v in SMALL.items()]
    env = {**os.environ, "EXTRA_FLAGS_1": "--config.train.learning_rate=0.01"}
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes=2",
           "--devices_per_process=4", "--stop_grace_s=20", f"--script={script}", "--",
           "--config=gpt_hybrid.py", f"--workdir={tmp_path / 'w'}", "--cache_dir=",
           "--heartbeat_timeout=10", "--initialization_timeout=60", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    line = ("error: config: process 1 was started with train.learning_rate=0.01 but process "
            "0 with 0.002; start every process with the same --config, --config.* flags and "
            "--workdir.")
    for i in (0, 1):
        assert f"[{i}] {line}" in text, text[-3000:]
    assert not (tmp_path / "w").exists()


FULL_ON_ONE = '''
import errno, os, runpy, sys
if os.environ["JAX_PROCESS_ID"] == "1":     # its disk full from the second save on
    import orbax.checkpoint as ocp
    save, calls = ocp.CheckpointManager.save, []
    def full(self, *a, **k):
        calls.append(1)
        if len(calls) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(self, *a, **k)
    ocp.CheckpointManager.save = full
sys.argv = [{train!r}, *sys.argv[1:]]
runpy.run_path({train!r}, run_name="__main__")
'''


def test_an_error_on_one_process_stops_both_at_once(tmp_path):
    """A checkpoint write failing on process 1 only: it printed its line, then waited in
    jax.distributed's shutdown barrier, process 0 in the next step's collective, both
    silently for --shutdown_timeout (300 s), and the launcher saw no exit. Now it exits
    at once, naming the error, and the launcher stops the other."""
    script = tmp_path / "full_on_one.py"
    script.write_text(FULL_ON_ONE.format(train=str(ROOT / "scripts" / "train.py")))
    args = [f"--config.{k}={v!r}" if isinstance(v, tuple) else f"--config.{k}={v}"
            for k, v in SMALL.items()]
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes=2",
           "--devices_per_process=4", "--stop_grace_s=20", f"--script={script}", "--",
           "--config=gpt_hybrid.py", f"--workdir={tmp_path / 'w'}", "--cache_dir=",
           "--heartbeat_timeout=10", "--initialization_timeout=60", "--shutdown_timeout=200",
           *args, "--config.train.steps=6"]
    start = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert re.search(r"\[1\] error: checkpoint: writing to .* failed \(\[Errno 28\] No space", text), text[-3000:]
    assert "[1] distributed: process 1 stops on this error" in text
    assert time.time() - start < 150, text[-3000:]    # not the 200 s shutdown barrier


HIDDEN = '''
import os, runpy, sys
if os.environ["JAX_PROCESS_ID"] == "1":    # a host whose own disk holds no checkpoint
    import orbax.checkpoint as ocp
    ocp.CheckpointManager.latest_step = lambda self: None
sys.argv = [{train!r}, *sys.argv[1:]]
runpy.run_path({train!r}, run_name="__main__")
'''


def test_processes_that_see_different_checkpoints_stop_with_one_error(saved, tmp_path):
    """The workdir on each host's own disk (the default is under /tmp): process 0 found
    step 2 and resumed there, process 1 found none and started at step 1, and both went
    on in the same collectives (the replicas trained from different states). Now every
    process stops, naming the steps and the fix."""
    copy_checkpoints(saved, tmp_path / "w")
    script = tmp_path / "hidden.py"
    script.write_text(HIDDEN.format(train=str(ROOT / "scripts" / "train.py")))
    args = [f"--config.{k}={v!r}" if isinstance(v, tuple) else f"--config.{k}={v}"
            for k, v in {**SMALL, "train.steps": 3}.items()]
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes=2",
           "--devices_per_process=4", "--stop_grace_s=20", f"--script={script}", "--",
           "--config=gpt_hybrid.py", f"--workdir={tmp_path / 'w'}", "--cache_dir=",
           "--heartbeat_timeout=10", "--initialization_timeout=60", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode != 0
    line = (f"error: checkpoint: process 1 finds in {tmp_path / 'w' / 'checkpoints'} the "
            f"checkpoint step=None but process 0 with 2; put --workdir on a file system "
            f"every process sees")
    for i in (0, 1):
        assert f"[{i}] {line}" in out.stdout, out.stdout[-3000:]
    assert not (tmp_path / "w" / "metrics.jsonl").exists()


def test_launcher_fails_when_every_process_fails_at_once(tmp_path):
    """Processes that all exited non-zero between two of the launcher's polls (the same
    error at start-up) ended its loop with no failure seen: it exited 0."""
    script = tmp_path / "fail.py"
    script.write_text("import sys; sys.exit(3)\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch_local.py"),
                          "--processes=3", f"--script={script}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stdout
    # The first failure the launcher sees is named with its pid (which process that is
    # depends on which exited first), every other failure after it.
    assert re.search(r"launch_local: process \d \(pid \d+\) exited with code 3", out.stdout)
    for i in range(3):
        assert re.search(rf"launch_local: process {i} (\(pid \d+\) )?exited with code 3",
                         out.stdout), out.stdout


@pytest.mark.parametrize("flag,message", [("--port=99999", "must be a TCP port"),
                                          ("--stop_grace_s=-1", "must be >= 0 seconds")])
def test_launcher_refuses_a_port_or_grace_that_cannot_be(flag, message):
    # Accepted: every process then failed to reach the coordinator, or was not waited for.
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch_local.py"),
                          "--processes=2", flag], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def test_a_process_whose_peer_never_starts_says_what_it_waited_for(tmp_path):
    """Process 0 of 2 alone: jax aborts it from C++ after --initialization_timeout with
    "DEADLINE_EXCEEDED ... RegisterTask" and "most likely indicates that another task
    died"; nothing of ours said which processes it waited for, where, or how long."""
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu",
           "JAX_COORDINATOR_ADDRESS": "localhost:1", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"),
                          "--initialization_timeout=1", f"--workdir={tmp_path / 'w'}",
                          "--cache_dir="], capture_output=True, text=True, env=env,
                         timeout=120, cwd=ROOT)
    assert out.returncode != 0
    assert ("distributed: process 1 of 2 joining localhost:1; waiting up to 1 s for every "
            "process to start") in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "w").exists()


PLACE = '''
import sys
sys.path.insert(0, {root!r})
from jaxhybrid import distributed
distributed.initialize()
import jax, numpy as np
from jax.experimental import multihost_utils
from jaxhybrid import data, make_mesh
mesh = make_mesh(data=2, pipe=3)
rows = data.process_rows(mesh, 12)
x = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)
placed = data.place_batch((x[rows],), mesh)[0]
whole = multihost_utils.process_allgather(placed, tiled=True)
assert placed.shape == (12, 3) and np.array_equal(whole, x), (placed.shape, whole)
# One write of the whole line: print() wrote its pieces one by one (unbuffered), and
# Gloo's C++ log lines landed between them ("[0] placed[Gloo] Rank 0 ... 0 ...").
sys.stdout.write(f"placed {{jax.process_index()}} {{rows}}\\n")
sys.stdout.flush()
'''


def test_a_process_holding_parts_of_two_data_replicas_places_its_rows(tmp_path):
    """3 processes x 2 devices on data=2 x pipe=3: process 1 holds a device of each data
    replica, so it loads all 12 rows while the others load 6. The run planned, compiled
    and then failed at the first batch with "Unable to compute global_shape due to
    non-uniform sharding" (a traceback on every process); the global shape is now given.
    (A 2-step training on this layout then gives the 1-process losses bit for bit.)"""
    script = tmp_path / "place.py"
    script.write_text(PLACE.format(root=str(ROOT)))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch_local.py"),
                          "--processes=3", "--devices_per_process=2", "--stop_grace_s=20",
                          f"--script={script}"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:]
    for i, rows in ((0, "slice(0, 6, None)"), (1, "slice(0, 12, None)"),
                    (2, "slice(6, 12, None)")):
        # The line is one write; a Gloo log line (C++, in pieces) may still wrap around
        # it, so it is looked for without launch_local's "[i] " prefix (it names i).
        assert f"placed {i} {rows}\n" in out.stdout, out.stdout[-3000:]


def test_a_metrics_file_cut_off_mid_line_does_not_block_the_resume(tmp_path):
    """A kill or a full disk in the middle of a record's write left a cut-off last line,
    and every later resume failed with a JSONDecodeError after compiling and restoring."""
    lines = [json.dumps({"step": s, "train_loss": 1.0 / s}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "train_lo')
    writer = train.MetricWriter(tmp_path, 2)
    writer.write({"step": 3, "train_loss": 0.5})
    writer.close()
    got = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert got == [json.loads(lines[0]), json.loads(lines[1]), {"step": 3, "train_loss": 0.5}]


SAVE_AND_RETURN = '''
import sys
import flax.linen as nn, jax, jax.numpy as jnp
import jaxhybrid as jh
from jaxhybrid import checkpoint, pipeline as jp
pipe = jp.Pipeline([nn.Dense(4), nn.Dense(4)], mesh=jh.make_mesh(data=1, pipe=2), boundaries=[1])
v = pipe.init(jax.random.key(0), jnp.ones((2, 4)))
ck = checkpoint.Checkpointer(sys.argv[1], keep=2)
try:
    ck.save(3, pipe, {"variables": v}, {})
except ValueError as e:
    print("NO OPT", e)
ck.save(3, pipe, {"variables": v, "opt_state": ()}, {})
try:
    ck.save(2, pipe, {"variables": v, "opt_state": ()}, {})
except checkpoint.CheckpointWriteError as e:
    print("REFUSED", e)
'''


def test_a_save_is_finished_when_the_script_returns_and_an_older_step_is_refused(tmp_path):
    """A script that saved and returned without wait() / close() exited 0 with only a
    temporary step directory; a save of a step at or below the newest one wrote nothing
    without a word (orbax skips it)."""
    script = tmp_path / "save.py"
    script.write_text(SAVE_AND_RETURN)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], text=True,
                         capture_output=True, timeout=240, cwd=tmp_path,
                         env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "NO OPT Checkpointer.save: state must be {'variables'" in out.stdout
    assert re.search(r"REFUSED checkpoint: cannot save step 2 in .*: step 3 is there already", out.stdout)
    assert sorted(os.listdir(tmp_path / "ck")) == ["3"]
    assert checkpoint.Checkpointer(tmp_path / "ck", keep=2).all_steps() == [3]


UNEVEN_EVAL = '''
import sys
sys.path.insert(0, {root!r})
from jaxhybrid import distributed
distributed.initialize()
import jax, numpy as np
from jaxhybrid import config_flags, train
me = jax.process_index()
def batches(n):
    rs = np.random.RandomState(0)
    for _ in range(n):
        x = rs.randint(0, 256, (8, 16)).astype(np.int32)
        yield x, np.roll(x, -1, 1)
def eval_data():      # process 1's stream is shorter
    for x, y in batches(1 if me == 1 else 3):
        yield x, y, np.ones(8, bool)
config = config_flags.load_config("gpt_hybrid.py", {{
    "model.size": "tiny", "mesh.data": 2, "mesh.pipe": 2, "train.steps": 2,
    "train.batch_size": 8, "pipeline.num_microbatches": 2, "train.eval_steps": 0,
    "train.eval_every": 1, "train.log_every": 1, "checkpoint.every": 0}})
train.train_and_evaluate(config, {workdir!r}, train_data=lambda: batches(100),
                         eval_data=eval_data)
'''


def test_evaluation_streams_of_other_lengths_stop_every_process_by_name(tmp_path):
    """Process 1's eval_data() yielding fewer batches than process 0's: process 0 waited
    in the next batch's collectives, process 1 in the next step's, silently, for good."""
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN_EVAL.format(root=str(ROOT), workdir=str(tmp_path / "w")))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch_local.py"),
                          "--processes=2", "--devices_per_process=2", "--stop_grace_s=20",
                          f"--script={script}", "--", "--heartbeat_timeout=10"],
                         capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert out.returncode != 0
    line = ("ValueError: evaluation: the evaluation data of process(es) [1] ended after 1 "
            "batches, the other processes' went on")
    assert line in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
