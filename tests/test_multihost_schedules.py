"""Several processes with the stages themselves on other processes' devices ("pipe"
across processes, not only the data all-reduce as in tests/test_multihost.py): the
V-shaped zbv (its "-1" channel and the wrap cross processes), an asynchronous schedule
(2bw), interleaved virtual stages with a "model" axis and ZeRO where "data", "pipe" all
cross processes, the planner's cut when the processes measure different costs, and
`unpack` of rows held by other processes. Each gives the numbers of the same pipeline in
this one process (8 devices): bit for bit where the reduction order is the same.

Bad set-ups fail at once on every process, with one line naming the fix: processes with
different device counts, and a mesh that leaves a process without devices (scripts/
train.py: that process failed alone and the other waited for it for 5 minutes).

One 2-process run (tests/multihost_cases.py under scripts/launch_local.py) holds all
the cases; the 1-process references are computed here while it runs.
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import multihost_cases

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "multihost_cases.py"
LAUNCH = ROOT / "scripts" / "launch_local.py"
RUN_TIMEOUT_S = 600      # a hang guard only: the runs take 10-90 s

# 2 processes x 4 devices: jax.devices() 0-3 are process 0's, 4-7 process 1's.
# (2, 2, 2) over this order: model groups [0, 1] [4, 5] | [6, 7] [2, 3], so "pipe"
# (0-1 -> 4-5) and "data" (0-1 / 6-7) both cross processes, "model" stays inside one.
CROSSING = [0, 1, 4, 5, 6, 7, 2, 3]
CASES = [
    # 16 stages on 8 devices, device d holds stages d and 15 - d: the V turns on
    # device 7 (process 1) and comes back over the "-1" channel to device 0.
    {"name": "zbv", "mesh": [1, 8, 1], "schedule": "zbv", "num_mix": 12, "unpack": True},
    {"name": "2bw", "mesh": [1, 8, 1], "schedule": "2bw", "num_mix": 6, "grad": False,
     "steps": 3},
    {"name": "interleaved+model+zero", "mesh": [2, 2, 2], "perm": CROSSING,
     "schedule": "interleaved", "zero": 1, "steps": 2},
    {"name": "planner", "mesh": [1, 8, 1], "schedule": "1f1b", "num_mix": 10,
     "boundaries": "planner", "skew": True},
]


def launch(args, timeout=RUN_TIMEOUT_S, meanwhile=None):
    """scripts/launch_local.py (2 processes x 4 devices) with `args` after its options:
    (return code, output). meanwhile: called while the processes run. A hang fails the
    test with the output so far."""
    cmd = [sys.executable, str(LAUNCH), "--processes=2", "--devices_per_process=4",
           "--stop_grace_s=60", *args]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        try:
            if meanwhile is not None:
                meanwhile()
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            hung = _stop(proc)
        log.seek(0)
        output = log.read()
    if hung:
        pytest.fail(f"launch_local.py {' '.join(args[:3])} ... still running after "
                    f"{timeout} s:\n{_compact(output)}")
    return proc.returncode, output


def _stop(proc) -> bool:
    """Stops `proc` if it still runs (True then): SIGTERM first, so that the launcher
    stops its processes (a SIGKILL would leave them behind), SIGKILL 30 s later."""
    if proc.poll() is not None:
        return False
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return True


def _compact(text):
    """The end of a run's output, without gloo's connection lines."""
    return "\n".join(l for l in text.splitlines() if "[Gloo]" not in l)[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"two": 2-process results, "one": 1-process references, "output": its log}."""
    out = tmp_path_factory.mktemp("mp_schedules") / "two.json"
    one = {}

    def references():   # computed here while the two processes compile
        for c in CASES:
            if c.get("boundaries") != "planner":
                one[c["name"]] = multihost_cases.to_json(multihost_cases.run_case(c))
    code, output = launch([f"--script={SCRIPT}", "--", str(out), json.dumps(CASES)],
                          meanwhile=references)
    assert code == 0 and out.exists(), _compact(output)
    two = json.loads(out.read_text())
    planned = two["planner"]
    if "boundaries" in planned:   # the same pipeline here, cut where the processes agreed
        case = {**CASES[-1], "boundaries": planned["boundaries"][0]}
        one["planner"] = multihost_cases.to_json(multihost_cases.run_case(case))
    return {"two": two, "one": one, "output": output}


def _case(runs, name):
    two = runs["two"][name]
    assert "error" not in two, f"{name}: {two['error']}\n{_compact(runs['output'])}"
    return two, runs["one"][name]


def _assert_trees(a, b, exact):
    """Two JSON trees (dicts of number arrays where not exact) equal, or within 1e-5."""
    if exact:
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
        return
    assert sorted(a) == sorted(b)
    for k in a:
        if isinstance(a[k], dict):
            _assert_trees(a[k], b[k], exact)
        else:
            np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=1e-5,
                                       atol=1e-6, err_msg=k)


def test_zbv_with_its_v_across_processes_equals_one_process(runs):
    two, one = _case(runs, "zbv")
    assert two["loss"] == one["loss"]                            # bit for bit
    for key in ("grads", "state", "unpacked_grads", "unpacked"):
        _assert_trees(two[key], one[key], exact=True)


def test_unpack_gathers_the_rows_of_other_processes(runs):
    # Pipeline.unpack called jax.device_get, which refuses arrays spanning other
    # processes' devices ("Fetching value for `jax.Array` that spans non-addressable").
    two, _ = _case(runs, "zbv")
    assert len(two["unpacked"]) == 16 and "batch_stats" in two["unpacked"][0]
    assert all(set(v) == {"params"} for v in two["unpacked_grads"])


def test_asynchronous_2bw_across_processes_equals_one_process(runs):
    two, one = _case(runs, "2bw")
    assert two["train_losses"] == one["train_losses"]
    _assert_trees(two["params"], one["params"], exact=True)


def test_interleaved_model_axis_and_zero_with_every_axis_across_processes(runs):
    two, one = _case(runs, "interleaved+model+zero")
    # "data" crosses processes: the all-reduce and ZeRO's reduce-scatter sum in another
    # order than in one process.
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-6)
    np.testing.assert_allclose(two["train_losses"], one["train_losses"], rtol=1e-5)
    _assert_trees(two["grads"], one["grads"], exact=False)
    _assert_trees(two["params"], one["params"], exact=False)


def test_processes_that_measure_differently_cut_the_same_stages(runs):
    # Each process profiled the layers and cut where its own timings said: the packed
    # buffers differed, and `init` failed in jax's device_put ("... is not the same on
    # each process") or in a mismatched collective. Now all plan from process 0's costs.
    two, one = _case(runs, "planner")
    alone = two["alone"]
    assert alone[0] != alone[1]                       # process 1's own costs cut elsewhere
    assert two["boundaries"] == [alone[0], alone[0]]  # both run process 0's cut
    assert two["loss"] == one["loss"]
    _assert_trees(two["grads"], one["grads"], exact=True)


def test_processes_with_different_device_counts_fail_with_one_line(tmp_path):
    """2 + 6 devices: jax's multi-process transfers (device_put of the packed variables,
    process_allgather) assume as many devices on every process and failed with "cannot
    reshape array of size 8 into shape (2,6)". Started by jax.distributed.initialize
    itself (distributed.initialize refuses it earlier: tests/test_multihost_startup.py),
    the Pipeline refuses it."""
    out = tmp_path / "uneven.json"
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import launch_local
    finally:
        sys.path.pop(0)
    port = launch_local.free_port()
    case = [{"name": "uneven", "mesh": [1, 8, 1], "schedule": "1f1b", "num_mix": 6}]
    logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(out), json.dumps(case)],
                              env={**launch_local.process_env(os.environ, i, 2, n, port),
                                   "CASES_JAX_INITIALIZE": "1"},
                              stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for i, (n, log) in enumerate(zip((2, 6), logs))]
    hung = False
    for p in procs:
        try:
            p.wait(timeout=240)
        except subprocess.TimeoutExpired:
            hung = True
        hung = _stop(p) or hung
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    assert not hung, "processes with 2 and 6 devices hung:\n" + "\n".join(outputs)[-4000:]
    error = json.loads(out.read_text())["uneven"].get("error", "")
    assert error == ("ValueError: Pipeline: distributed: the processes hold different numbers "
                     "of devices (process 0: 2, process 1: 6); start every process with as "
                     "many (the same --devices_per_process, JAX_NUM_CPU_DEVICES, "
                     "--xla_force_host_platform_device_count or number of visible GPUs)."), \
        "\n".join(outputs)[-4000:]
    assert all("case uneven: ValueError: Pipeline: distributed: the processes hold" in o
               for o in outputs)


def test_a_mesh_without_a_process_s_devices_stops_every_process_at_once(tmp_path):
    """mesh.data=2 x mesh.pipe=2 on 2 processes x 4 devices: the mesh holds process 0's
    devices only. Process 1 failed alone ("process 1 has no device in the mesh") and
    then waited at exit for jax.distributed's shutdown (5 minutes) while process 0 waited
    for it in orbax's first sync: the run hung. Now both stop at once, the same line."""
    args = ["--", "--config=gpt_hybrid.py", f"--workdir={tmp_path / 'w'}",
            "--config.model.size=tiny", "--config.mesh.data=2", "--config.mesh.pipe=2",
            "--config.pipeline.boundaries=(2,)", "--config.train.batch_size=8",
            "--config.data.options.max_bytes=40000", "--initialization_timeout=120"]
    code, out = launch(args, timeout=240)
    assert code != 0, _compact(out)
    line = ("error: process 1: mesh (config.mesh.data/pipe, 2 processes): process_rows: "
            "process 1 has no device in the mesh; build the mesh over all 8 devices.")
    assert f"[0] {line}" in out, _compact(out)
    assert "[1] error: mesh (config.mesh.data/pipe, 2 processes): process_rows: process 1 " \
           "has no device in the mesh" in out, _compact(out)
    assert "SIGABRT" not in out and "SIGKILL" not in out, _compact(out)
    assert not (tmp_path / "w" / "checkpoints").exists()    # stopped before any file
