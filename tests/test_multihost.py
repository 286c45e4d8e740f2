"""Several processes on one machine (scripts/launch_local.py: CPU, gloo collectives):
train losses equal to one process on the same mesh, checkpoints moving between process
counts and layouts, a killed process stopping the run with an error naming it, and the
pieces (start-up settings, per-process rows) on their own.

Multi-process start-up and compilation are slow on 2 cores, so the module runs two
2-process trainings and shares them between the tests: run "2p" starts from scratch,
run "2p_moved" resumes a 1-process checkpoint on another layout. Both are stopped by
killing process 1 once they have logged step 4 (train.steps is large so the learning
rate schedule is the same in every run; the 1-process runs stop by an injected
preemption, as in test_train.py).
"""
import functools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from jaxhybrid import checkpoint, data, distributed, make_mesh, optim, portable, train
from jaxhybrid.config_flags import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEARTBEAT_S = 10          # train.py --heartbeat_timeout in the 2-process runs
EXIT_WITHIN_S = 90        # a killed process must end the run this soon (launcher grace: 120;
                          # 7-10 s measured, docs/training.md: slack for a loaded CI host)
STOP_AFTER = 4            # steps each 2-process run trains before it is stopped
REFERENCE_STEPS = 5       # steps of the 1-process reference run

# (data, pipe) -> overrides; both split a batch of 16 into the same 8 microbatches of 2.
# (4, 2) leaves the stages to the planner: each process profiles, all take process 0's.
LAYOUTS = {(2, 4): {"pipeline.num_microbatches": 4, "pipeline.boundaries": (1, 2, 3)},
           (4, 2): {"pipeline.num_microbatches": 2}}


def overrides(layout=(2, 4)):
    return {"model.size": "tiny", "mesh.data": layout[0], "mesh.pipe": layout[1],
            **LAYOUTS[layout], "train.batch_size": 16, "train.steps": 1000,
            "train.warmup_steps": 2, "train.log_every": 1, "train.eval_every": 0,
            "train.eval_steps": 1, "data.options.max_bytes": 40_000, "checkpoint.every": 2,
            # Keep every checkpoint: the resumed run trains on while the test waits for the
            # first run to end, and with a fast start it is past step 4 + 2 * keep by then
            # (with keep=5 its step-4 checkpoint was gone and the test waited 900 s).
            "checkpoint.keep": 10_000}


def losses(workdir):
    # Complete lines only: a running training may be half-way through appending one.
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().split("\n")[:-1]
    return {r["step"]: r["train_loss"] for r in map(json.loads, lines)}


class _Preempted(Exception):
    pass


def train_in_process(workdir, layout, stop_after_step):
    """One process, 8 devices: train until `stop_after_step` (then a preemption)."""
    make, calls = train.make_train_step, [0]
    start = checkpoint.Checkpointer(pathlib.Path(workdir) / "checkpoints", keep=5).latest_step()

    def patched(run, t):
        step = make(run, t)

        def wrapped(*args):
            calls[0] += 1
            if calls[0] > stop_after_step - (start or 0):
                raise _Preempted()
            return step(*args)
        return wrapped
    train.make_train_step = patched
    try:
        with pytest.raises(_Preempted):
            train.train_and_evaluate(load_config("gpt_hybrid.py", overrides(layout)), workdir)
    finally:
        train.make_train_step = make


class TwoProcessRun:
    """scripts/launch_local.py --processes=2 --devices_per_process=4 -- train.py ...,
    stopped by SIGKILL to process 1 once metrics.jsonl has step `STOP_AFTER` and the
    checkpoint of step `checkpoint_step` is complete."""

    def __init__(self, workdir, layout, checkpoint_step):
        self.workdir = pathlib.Path(workdir)
        self.checkpoint_step = checkpoint_step
        args = [f"--config.{k}={v!r}" if isinstance(v, tuple) else f"--config.{k}={v}"
                for k, v in overrides(layout).items()]
        cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes=2",
               "--devices_per_process=4", "--stop_grace_s=120", "--",
               "--config=gpt_hybrid.py", f"--workdir={self.workdir}",
               f"--heartbeat_timeout={HEARTBEAT_S}", "--initialization_timeout=120", *args]
        self.lines: list[str] = []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=ROOT)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def stop(self):
        """SIGTERM to the launcher (it stops its processes), SIGKILL if that hangs."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def output(self, tail=60):
        return "".join(self.lines[-tail:])

    def _ready(self):
        path = self.workdir / "metrics.jsonl"
        done = path.exists() and STOP_AFTER in losses(self.workdir)
        return done and (self.workdir / "checkpoints" / str(self.checkpoint_step)).is_dir()

    def kill_process_1(self, timeout=900):
        """Waits for step STOP_AFTER, kills process 1; returns seconds to the run's end."""
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"2-process run ended or stalled before step {STOP_AFTER}:\n"
                            f"{self.output()}")
            time.sleep(0.5)
        pid = int(re.search(r"process 1: pid (\d+)", "".join(self.lines)).group(1))
        killed = time.monotonic()
        subprocess.run(["kill", "-9", str(pid)], check=True)
        try:
            self.proc.wait(timeout=EXIT_WITHIN_S + 60)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"the run did not end after process 1 was killed:\n{self.output()}")
        return time.monotonic() - killed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's runs: "1p" (1 process, (2, 4)), "2p" (2 processes, (2, 4), from
    scratch, started first so it compiles while "1p" trains), "2p_moved" (2 processes,
    (4, 2), resumed from 1p's checkpoint at step 2)."""
    root = tmp_path_factory.mktemp("multihost")
    two = TwoProcessRun(root / "2p", (2, 4), checkpoint_step=2)
    moved = None
    try:
        train_in_process(root / "1p", (2, 4), REFERENCE_STEPS)
        shutil.copytree(root / "1p" / "checkpoints" / "2",
                        root / "2p_moved" / "checkpoints" / "2")
        moved = TwoProcessRun(root / "2p_moved", (4, 2), checkpoint_step=STOP_AFTER)
        two_exit_s = two.kill_process_1()
        moved_exit_s = moved.kill_process_1()
    finally:                              # no processes left behind when something fails
        for run in (two, moved):
            if run is not None:
                run.stop()
    print(f"\nmultihost: process 1 killed -> run ended after {two_exit_s:.1f} s / "
          f"{moved_exit_s:.1f} s (--heartbeat_timeout={HEARTBEAT_S})")
    return {"root": root, "2p": two, "2p_moved": moved,
            "exit_s": {"2p": two_exit_s, "2p_moved": moved_exit_s}}


def test_two_processes_train_like_one_on_the_same_mesh(runs):
    one, two = losses(runs["root"] / "1p"), losses(runs["root"] / "2p")
    steps = list(range(1, STOP_AFTER + 1))
    assert [two[s] for s in steps] == [one[s] for s in steps]       # bit for bit
    assert two[STOP_AFTER] < two[1]
    # Metrics, events and config from process 0 only: one record per step.
    lines = (runs["root"] / "2p" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len({json.loads(line)["step"] for line in lines})
    assert len(list((runs["root"] / "2p").glob("events.out.tfevents.*"))) == 1
    logged = lambda i: [l for l in runs["2p"].lines if l.startswith(f"[{i}]") and "] step " in l]
    assert logged(0) and not logged(1)
    # The step was compiled from the layers' shapes before it ran, and its memory
    # checked, on several processes as on one (fresh, and resumed on the planner's cuts).
    for run in ("2p", "2p_moved"):
        assert any(l.startswith("[0]") and "memory per device: the compiled step needs" in l
                   for l in runs[run].lines), runs[run].output()


def test_two_process_checkpoint_resumes_in_one_process(runs, tmp_path):
    ckpt = runs["root"] / "2p" / "checkpoints"
    meta = json.loads((ckpt / "2" / "meta" / "metadata").read_text())
    assert meta["processes"] == 2 and meta["step"] == 2
    # Each process wrote its own shards, a good part of them. Not "about half" in bytes:
    # process 0 also writes the replicated values, and OCDBT's files vary with timing
    # (under CI load process 0's directory held 1029KB against 337KB, 25%; 440KB against
    # 289KB, 40%, in a quiet run of the same test).
    written = {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
               for p in (ckpt / "2" / "state").glob("ocdbt.process_*")}
    assert sorted(written) == ["ocdbt.process_0", "ocdbt.process_1"]
    assert min(written.values()) > 0.15 * sum(written.values())
    single = sum(f.stat().st_size for f in (runs["root"] / "1p" / "checkpoints" / "2" / "state")
                 .glob("ocdbt.process_*/**/*") if f.is_file())
    print(f"\nmultihost: checkpoint bytes per process {written}, one process: {single}")
    # Process 1 was killed once step 4 was logged. The kill lands a little later (the
    # test polls; under CI load the run reached step 6 first), maybe while a step was
    # being saved: only complete steps count (orbax renames a step's directory once all
    # processes wrote it); what else is there is an unfinished temporary directory.
    steps = checkpoint.Checkpointer(ckpt, keep=5).all_steps()
    assert steps == list(range(2, 2 * len(steps) + 1, 2)), steps   # every 2nd, from 2
    assert all("tmp" in p.name for p in ckpt.iterdir() if p.name not in map(str, steps))
    # Resume from the latest checkpoint the 1-process reference run goes past.
    start = max(s for s in steps if s < REFERENCE_STEPS)
    for s in steps[:steps.index(start) + 1]:
        shutil.copytree(ckpt / str(s), tmp_path / "checkpoints" / str(s))
    train_in_process(tmp_path, (2, 4), REFERENCE_STEPS)
    resumed, one = losses(tmp_path), losses(runs["root"] / "1p")
    assert sorted(resumed) == list(range(start + 1, REFERENCE_STEPS + 1))
    assert [resumed[s] for s in resumed] == [one[s] for s in resumed]   # bit for bit


def test_one_process_checkpoint_resumes_in_two_processes_on_another_layout(runs):
    moved, one = losses(runs["root"] / "2p_moved"), losses(runs["root"] / "1p")
    assert min(moved) == 3 and STOP_AFTER in moved
    steps = range(3, STOP_AFTER + 1)
    # (4, 2) vs (2, 4): the same microbatches, other summation orders.
    np.testing.assert_allclose([moved[s] for s in steps], [one[s] for s in steps],
                               rtol=0, atol=1e-4)
    # It went on saving, in its own layout and process count.
    ckpt = runs["root"] / "2p_moved" / "checkpoints"
    assert checkpoint.Checkpointer(ckpt, keep=5).all_steps()[:2] == [2, STOP_AFTER]
    meta = json.loads((ckpt / str(STOP_AFTER) / "meta" / "metadata").read_text())
    assert meta["processes"] == 2 and meta["layout"]["data"] == 4
    assert len(meta["layout"]["boundaries"]) == 1                      # the planner's cut


@pytest.mark.parametrize("name", ["2p", "2p_moved"])
def test_killed_process_ends_the_run_with_an_error_naming_it(runs, name):
    run = runs[name]
    out = "".join(run.lines)
    assert runs["exit_s"][name] < EXIT_WITHIN_S, out[-3000:]
    assert run.proc.returncode != 0
    assert re.search(r"launch_local: process 1 \(pid \d+\) was killed by signal SIGKILL", out)
    # Process 0 stopped by itself (the launcher's grace was far longer), naming process 1.
    assert re.search(r"\[0\] .*tasks are unhealthy \(stopped sending heartbeats\):\s*\n"
                     r"\[0\] 1\n", out), out[-3000:]
    assert "launch_local: process 0 was killed by signal SIGABRT" in out


# --- the pieces, in this process ----------------------------------------------------
def test_start_up_settings_come_from_flags_environment_or_cluster():
    s = distributed.Settings
    assert distributed.resolve(s(), {}) is None                        # single process
    env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    got = distributed.resolve(s(initialization_timeout=7), env)
    assert (got.coordinator_address, got.num_processes, got.process_id,
            got.initialization_timeout) == ("h:1", 4, 3, 7)
    got = distributed.resolve(s(process_id=1), env)                   # a flag wins
    assert got.process_id == 1
    slurm = {"SLURM_JOB_ID": "5", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "0",
             "SLURM_NTASKS": "2"}
    assert distributed.detected_cluster(slurm) == "SLURM"
    assert distributed.resolve(s(), slurm) == s()                    # jax reads SLURM's
    assert distributed.resolve(s(), {**slurm, "SLURM_NTASKS": "1"}) is None
    with pytest.raises(ValueError, match=r"set --num_processes \(JAX_NUM_PROCESSES\), "
                                         r"--process_id"):
        distributed.resolve(s(coordinator_address="h:1"), {})
    with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, num_processes=2\)"):
        distributed.resolve(s("h:1", 2, 2), {})


def test_rows_of_any_split_make_the_same_batches():
    ds = data.get_dataset("digits", "train", batch_size=16, seed=3, image_size=16)
    whole = list(zip(range(3), ds.batches(start=5)))
    halves = [ds.batches(start=5, rows=slice(0, 8)), ds.batches(start=5, rows=slice(8, 16))]
    for (_, (x, y)), a, b in zip(whole, *halves):
        np.testing.assert_array_equal(np.concatenate([a[0], b[0]]), x)
        np.testing.assert_array_equal(np.concatenate([a[1], b[1]]), y)
    test = data.get_dataset("digits", "test", batch_size=16, image_size=16)
    last = list(test.eval_batches())[-1]
    part = list(test.eval_batches(rows=slice(8, 16)))[-1]
    for full, half in zip(last, part):
        np.testing.assert_array_equal(full[8:], half)
    with pytest.raises(ValueError, match=r"rows=.* must be a slice of consecutive"):
        ds.batches(rows=[0, 1])
    assert data.process_rows(make_mesh(2, 4), 16) == slice(0, 16)     # one process: all
    with pytest.raises(ValueError, match=r"batch size 12 is not divisible"):
        data.process_rows(make_mesh(8, 1), 12)


def test_jitted_cut_for_stages_on_other_processes_equals_the_host_cut():
    # With pipe across processes (e.g. 2 processes on (1, 8)) checkpoints are cut and
    # packed by jitted programs instead of on the host: the same trees, both ways.
    assert_jitted_cut_equals_host_cut(load_config("gpt_hybrid.py", overrides((2, 4))))


def assert_jitted_cut_equals_host_cut(config):
    """The checkpoint cut and pack as jitted programs (stages on other processes) give
    the host's trees and shardings, both ways (also used at mesh.model=2). Returns
    (state, host cut, jitted pack of the jitted cut)."""
    run = train.prepare(config)
    variables = run.pipe.init(jax.random.key(0), run.sample_inputs)
    tx = optim.make_optimizer(config.train, optim.weight_decay_mask(run.pipe, variables))
    state = {"variables": variables, "opt_state": tx.init(variables["params"])}
    state["opt_state"] = jax.tree.map(lambda a: a + 1, state["opt_state"])   # not zeros
    host = portable.to_portable(run.pipe, state)
    jitted = portable._spread(run.pipe, functools.partial(portable._portable, run.pipe))(state)
    assert jax.tree.structure(host) == jax.tree.structure(jitted)
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(jitted)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(a, b)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    back = jax.jit(functools.partial(portable._from_portable, run.pipe, abstract))(jitted)
    for a, b in zip(jax.tree.leaves(portable.from_portable(run.pipe, host, state)),
                    jax.tree.leaves(back)):
        np.testing.assert_array_equal(a, b)
    return state, host, back


def test_the_default_config_waits_for_jax_distributed():
    """train.py without --config, as process 0 of 2 whose peer never comes: it must reach
    jax.distributed's start-up (and time out there). Reading the default config when the
    flag was defined asked jax for its backend first, so every multi-process run of
    the default config died with "initialize() must be called before any JAX calls"."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import launch_local
    finally:
        sys.path.pop(0)
    env = launch_local.process_env(os.environ, 0, 2, 4, launch_local.free_port())
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"),
                        "--initialization_timeout=3"], env=env, capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode != 0   # the peer never joins
    assert "must be called before any JAX calls" not in out, out[-3000:]
    assert "Coordination" in out or "DEADLINE_EXCEEDED" in out, out[-3000:]


OWN_SCRIPT = '''
import sys, time
sys.path.insert(0, {root!r})
from jaxhybrid import distributed
distributed.initialize(distributed.Settings(heartbeat_timeout=10, shutdown_timeout=30))
print("ready", flush=True)
time.sleep(120)
print("still here", flush=True)
'''


def test_sigterm_stops_a_process_of_a_users_own_script_at_once(tmp_path):
    """jax's preemption notifier caught SIGTERM (SLURM's and `timeout`'s stop) in a
    script of one's own on several processes: it logged "SIGTERM caught" and went on."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import launch_local
    finally:
        sys.path.pop(0)
    script = tmp_path / "own.py"
    script.write_text(OWN_SCRIPT.format(root=str(ROOT)))
    port = launch_local.free_port()
    procs = [subprocess.Popen([sys.executable, "-u", str(script)], text=True,
                              env=launch_local.process_env(os.environ, i, 2, 2, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(2)]
    try:
        for line in procs[1].stdout:      # joined (gloo's lines come first)
            if line.strip() == "ready":
                break
        procs[1].send_signal(15)
        assert procs[1].wait(timeout=30) == 143
        assert "process 1: stopped by SIGTERM" in procs[1].stdout.read()
        assert procs[0].wait(timeout=90) != 0       # the other stops too, not after 120 s
    finally:
        for p in procs:
            p.kill()
