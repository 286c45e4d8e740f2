"""Start-up and exit mistakes on several processes end with one line naming the cause
instead of a crash or a 5-minute wait (2 processes, gloo): a coordinator port already in
use (a running job's processes aborted, or process 0 died by SIGSEGV), one process with
another jax setting (gloo: "Received data size doesn't match expected size"), the
launcher's per-process flags repeated after `--` (a duplicate process id waited 300 s),
a process that finishes while the others still run collectives (silent for 5 minutes)."""
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from jaxhybrid import distributed

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import launch_local  # noqa: E402

TIMEOUT_S = 240      # a hang guard: the runs take 5-40 s


def _listening_socket() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _run_processes(argvs: list[list[str]], envs: list[dict]) -> list[tuple[int, str, float]]:
    """Starts one process per argv; (return code, output, seconds to its end) each."""
    procs = [subprocess.Popen(a, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=ROOT) for a, e in zip(argvs, envs)]
    started, results = time.monotonic(), []
    try:
        for p in procs:
            out = p.communicate(timeout=TIMEOUT_S)[0]
            results.append((p.returncode, out, time.monotonic() - started))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def _env(i: int, port: int, **extra) -> dict:
    base = {**os.environ, "PYTHONPATH": str(ROOT)}
    return {**launch_local.process_env(base, i, 2, 2, port), **extra}


def test_a_port_in_use_is_refused_before_jax_starts():
    held = _listening_socket()
    port = held.getsockname()[1]
    try:
        assert distributed.port_in_use(port)
        with pytest.raises(ValueError, match=rf"port {port} of coordinator_address="
                                             rf"'localhost:{port}' is already in use"):
            distributed.check_coordinator_port(f"localhost:{port}")
    finally:
        held.close()
    assert not distributed.port_in_use(port)
    distributed.check_coordinator_port(f"localhost:{port}")
    with pytest.raises(ValueError, match="needs a port"):
        distributed.check_coordinator_port("localhost")


def test_launcher_refuses_per_process_flags_and_a_busy_port(capsys):
    with pytest.raises(SystemExit):
        launch_local.main(["--processes=2", "--", "--config=gpt_hybrid.py", "--process_id=1"])
    assert "--process_id after `--` would give every process the same value" in \
        capsys.readouterr().err
    assert launch_local.per_process_flags(["-num_processes", "2", "--coordinator_address=h:1",
                                           "--process_idx=3"]) == \
        ["--coordinator_address", "--num_processes"]
    held = _listening_socket()
    try:
        with pytest.raises(SystemExit):
            launch_local.main(["--processes=2", f"--port={held.getsockname()[1]}", "--"])
    finally:
        held.close()
    assert "is already in use on this machine" in capsys.readouterr().err


def test_train_py_process_0_on_a_busy_port_stops_with_one_line(tmp_path):
    held = _listening_socket()
    try:
        [(code, out, _)] = _run_processes(
            [[sys.executable, str(ROOT / "scripts" / "train.py"), f"--workdir={tmp_path}"]],
            [_env(0, held.getsockname()[1])])
    finally:
        held.close()
    assert code == 1, out[-2000:]
    assert out.strip().splitlines()[-1].startswith("error: distributed: port "), out[-2000:]


def test_one_process_with_another_jax_setting_stops_every_process_with_one_line(tmp_path):
    port = launch_local.free_port()
    argv = [sys.executable, str(ROOT / "scripts" / "train.py"), f"--workdir={tmp_path}",
            "--initialization_timeout=60"]
    results = _run_processes([argv, argv],
                             [_env(0, port), _env(1, port, JAX_ENABLE_X64="1")])
    for code, out, _ in results:
        assert code == 1, out[-2000:]
        assert out.strip().splitlines()[-1] == (
            "error: distributed: process 1 runs with jax_enable_x64='True' but process 0 "
            "with 'False'; set the same JAX_* environment variables and jax.config updates, "
            "and install the same jax and jaxlib, on every process."), out[-2000:]


def test_processes_with_other_device_counts_stop_at_start_up():
    port = launch_local.free_port()
    argv = [sys.executable, "-c", "from jaxhybrid import distributed; distributed.initialize()"]
    envs = [_env(0, port), {**_env(1, port), "XLA_FLAGS": "--xla_force_host_platform_device_count=6"}]
    for code, out, _ in _run_processes([argv, argv], envs):
        assert code == 1, out[-2000:]
        assert ("ValueError: distributed: the processes hold different numbers of devices "
                "(process 0: 2, process 1: 6)") in out, out[-2000:]


# Process 1 finishes at once; process 0 then waits in a collective for it.
EARLY_EXIT = """
from jaxhybrid import distributed
distributed.initialize(distributed.Settings(shutdown_timeout=20, heartbeat_timeout=10))
import jax
if jax.process_index() == 0:
    distributed.allgather_json(0)
"""


def test_a_process_that_finishes_early_says_it_waits_for_the_others():
    port = launch_local.free_port()
    argv = [sys.executable, "-c", EARLY_EXIT]
    (_, out0, t0), (code1, out1, t1) = _run_processes([argv, argv], [_env(0, port), _env(1, port)])
    assert ("distributed: process 1 finished but still waits, up to 20 s, for the other "
            "processes to finish") in out1, out1[-3000:]
    assert code1 != 0 and max(t0, t1) < 120, (t0, t1, out0[-2000:])
