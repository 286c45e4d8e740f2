"""Mistakes on several processes stop every process at once with one line naming the
cause (2 processes x 4 simulated devices, gloo): numpy batches that differ between
processes (they trained on a mix, silently), pipelines cut differently (gloo's
"collective mismatch"), a flag error on one process of train.py (the others waited
2 minutes in jax's start-up and failed with a timeout)."""
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import launch_local  # noqa: E402

TIMEOUT_S = 300      # a hang guard: the runs take 5-40 s


def test_numpy_batches_and_cuts_must_be_the_same_on_every_process():
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes=2",
           "--devices_per_process=4", "--stop_grace_s=30",
           f"--script={ROOT / 'tests' / 'multihost_misuse.py'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    got = {r["case"]: r for r in (json.loads(l.split("RESULT ", 1)[1])
                                   for l in out.splitlines() if "RESULT " in l)}
    assert len(got) == 15, out[-4000:]
    assert got["the same numpy batch"]["loss"] == got["placed rows"]["loss"]
    for case in ("own rows as numpy", "other numbers"):
        assert got[case]["error"].startswith(
            "Pipeline.value_and_grad: a numpy batch differs between processes"), got[case]
        assert "jaxhybrid.data.place_batch" in got[case]["error"]
    assert got["other cuts"]["error"].startswith(
        "process 1 built its Pipeline or called pack with boundaries=[2, 3, 4] but process 0 "
        "with [1, 2, 3]"), got["other cuts"]
    # A key of each process's own (fold_in(key, process_index())): each process had
    # another loss for the same step, silently.
    assert "loss" in got["the same key"], got["the same key"]
    assert got["own key"]["error"].startswith(
        "Pipeline.value_and_grad: rng differs between processes"), got["own key"]
    assert "loss" in got["burst same widths"], got["burst same widths"]
    assert got["burst other widths"]["error"].startswith(
        "process 1 built its BurstProgram or called burst.value_and_grad with widths="), \
        got["burst other widths"]
    assert got["burst own batch"]["error"].startswith(
        "burst.value_and_grad: a numpy batch differs between processes"), got["burst own batch"]
    # A process's own background rows or key trained each instance on a mix, silently.
    assert "loss" in got["mux same"], got["mux same"]
    assert got["mux own bg rows"]["error"].startswith(
        "burst.multiplexed_step: a numpy batch differs between processes"), got["mux own bg rows"]
    assert got["mux own bg key"]["error"].startswith(
        "burst.multiplexed_step: bg_rng differs between processes"), got["mux own bg key"]
    assert got["bg alone own rows"]["error"].startswith(
        "burst.background_step: a numpy batch differs"), got["bg alone own rows"]
    # jax's own assertion printed pages of numbers and no cause.
    assert got["another init key"]["error"].startswith(
        "Pipeline.pack: the variables differ between processes"), got["another init key"]


def test_a_flag_error_on_one_process_stops_every_process_at_once(tmp_path):
    port = launch_local.free_port()
    procs = []
    for i in range(2):
        bad = ["--config.train.batch_size=abc"] if i == 1 else []
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "scripts" / "train.py"), "--config=gpt_hybrid.py",
             f"--workdir={tmp_path / 'w'}", "--initialization_timeout=60", *bad],
            env=launch_local.process_env({**os.environ, "PYTHONPATH": str(ROOT)}, i, 2, 4, port),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT))
    started, outs = time.monotonic(), []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    waited = time.monotonic() - started
    assert all(p.returncode != 0 for p in procs)
    flag = "flag --config.train.batch_size=abc: invalid literal for int()"
    assert f"error: process 1: {flag}" in outs[0], outs[0][-3000:]
    assert f"error: {flag}" in outs[1], outs[1][-3000:]
    assert waited < 60, f"the processes took {waited:.0f} s to stop"   # 121 s before


def test_an_error_on_one_process_stops_every_process_soon():
    # Process 1 raises between steps; process 0 waits in the next step's collective.
    # Process 1 hung at exit in jax.distributed's shutdown barrier, so the launcher saw
    # no failure and both died after the barrier's 5 minutes. It now exits at once,
    # and the launcher stops process 0 after its grace period.
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes=2",
           "--devices_per_process=4", "--stop_grace_s=5",
           f"--script={ROOT / 'tests' / 'multihost_raise.py'}"]
    started = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    waited, out = time.monotonic() - started, run.stdout + run.stderr
    assert run.returncode != 0
    assert "RuntimeError: a bug in process 1's own code" in out, out[-3000:]
    assert "distributed: process 1 stops on this error" in out, out[-3000:]
    assert waited < 90, f"the processes took {waited:.0f} s to stop"


def test_a_process_slower_to_stop_on_the_same_error_is_not_aborted():
    # Every process refused the same plan, process 1 some seconds later (waiting for its
    # initialiser's compile): process 0 exited after its 2 s grace, ending the
    # coordination service, and jax aborted process 1 from C++ (SIGABRT, a page of
    # stacks) before it printed its own error. Process 0 now waits for the others' stop.
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes=2",
           "--devices_per_process=4", "--stop_grace_s=30",
           f"--script={ROOT / 'tests' / 'multihost_slow_stop.py'}"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert out.count("ValueError: a plan that no process can run") == 2, out[-3000:]
    for i in (0, 1):
        assert f"distributed: process {i} stops on this error" in out, out[-3000:]
    assert "SIGABRT" not in out and "Fatal Python error" not in out, out[-3000:]
