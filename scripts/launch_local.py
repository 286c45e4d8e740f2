"""Start N training processes on this machine, as a cluster would start them on N hosts.

    python scripts/launch_local.py --processes=2 --devices_per_process=4 -- \\
        --config=gpt_hybrid.py --workdir=/tmp/gpt2p --config.model.size=tiny

Every process runs scripts/train.py (or --script) with the arguments after `--`, on CPU
with `--devices_per_process` devices (XLA_FLAGS=--xla_force_host_platform_device_count)
and gloo collectives, and joins the others through JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID (a free local port unless --port is given). Their
output is forwarded line by line with a "[i] " prefix.

When a process fails (non-zero exit or a signal) the launcher names it, gives the others
--stop_grace_s seconds to stop by themselves (jax.distributed stops them, naming the
dead process, after train.py's --heartbeat_timeout), then terminates the rest, and exits
with the failed process's code. Ctrl-C stops all of them.

The launcher sets each process's id, the process count and the coordinator's address:
the same flags after `--` (`--process_id`, `--num_processes`, `--coordinator_address`)
would override them with one value for every process, and are refused.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxhybrid import distributed

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def process_env(base: dict, process_id: int, processes: int, devices: int, port: int) -> dict:
    """The environment of process `process_id`: CPU devices, and how to join the others."""
    flags = [f for f in base.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = {k: v for k, v in base.items() if k != "JAX_NUM_CPU_DEVICES"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]),
               JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(processes),
               JAX_PROCESS_ID=str(process_id))
    return env


# train.py flags that override the launcher's per-process environment (process_env).
PER_PROCESS_FLAGS = ("--coordinator_address", "--num_processes", "--process_id")


def per_process_flags(script_args: list[str]) -> list[str]:
    """The flags among `script_args` that would give every process the same id, count or
    address: one aborted with ALREADY_EXISTS and the other waited 300 s to start."""
    names = {a.split("=", 1)[0].lstrip("-") for a in script_args if a.startswith("-")}
    return [f for f in PER_PROCESS_FLAGS if f[2:] in names]


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _forward(stream, prefix: str, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            sys.stdout.write(prefix + line.decode(errors="replace"))
            sys.stdout.flush()


def _interrupt(signum, frame):
    raise KeyboardInterrupt    # SIGTERM to the launcher stops every process, as Ctrl-C does


def launch(args: argparse.Namespace, script_args: list[str]) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    port = args.port or free_port()
    lock = threading.Lock()
    procs, threads = [], []
    for i in range(args.processes):
        env = process_env(os.environ, i, args.processes, args.devices_per_process, port)
        p = subprocess.Popen([sys.executable, "-u", args.script, *script_args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(p)
        print(f"launch_local: process {i}: pid {p.pid}", flush=True)
        t = threading.Thread(target=_forward, args=(p.stdout, f"[{i}] ", lock), daemon=True)
        t.start()
        threads.append(t)
    failed = None

    def first_failure():
        # Also after the loop: processes that all failed between two polls (e.g. the
        # same config error at start-up) ended the loop with the launcher exiting 0.
        for i, p in enumerate(procs):
            if p.poll() not in (None, 0):
                rest = (f"; stopping the others within {args.stop_grace_s:g} s"
                        if any(q.poll() is None for q in procs) else "")
                print(f"launch_local: process {i} (pid {p.pid}) {describe(p.returncode)}{rest}",
                      flush=True)
                return i, p.returncode, time.monotonic()
        return None
    try:
        while any(p.poll() is None for p in procs):
            failed = failed or first_failure()
            if failed is not None and time.monotonic() - failed[2] > args.stop_grace_s:
                _stop(procs)
                break
            time.sleep(0.2)
        failed = failed or first_failure()
    except KeyboardInterrupt:
        print("launch_local: interrupted; stopping every process", flush=True)
        _stop(procs)
        failed = failed or (None, 130, 0.0)
    for t in threads:
        t.join(timeout=5)
    if failed is None:
        return 0
    i, code, _ = failed
    for j, p in enumerate(procs):
        if j != i and p.returncode not in (0, None):
            print(f"launch_local: process {j} {describe(p.returncode)}", flush=True)
    return code if code > 0 else 128 - code


def _stop(procs, wait_s: float = 10.0) -> None:
    """SIGTERM to the processes still running, SIGKILL to those still there `wait_s` later."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + wait_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     usage="%(prog)s [options] -- <train.py arguments>")
    parser.add_argument("--processes", type=int, required=True, help="number of processes")
    parser.add_argument("--devices_per_process", type=int, default=1,
                        help="simulated CPU devices in each process")
    parser.add_argument("--port", type=int, default=0, help="coordinator port (default: free)")
    parser.add_argument("--stop_grace_s", type=float, default=30.0,
                        help="seconds the others get to stop by themselves after one fails")
    parser.add_argument("--script", default=TRAIN, help="the Python script every process runs")
    args = parser.parse_args(argv[:split])
    if args.processes < 1 or args.devices_per_process < 1:
        parser.error("--processes and --devices_per_process must be >= 1")
    if not 0 <= args.port <= 65535:   # every process failed to connect, after starting
        parser.error(f"--port={args.port} must be a TCP port, 1..65535 (0: a free one)")
    if not args.stop_grace_s >= 0:
        parser.error(f"--stop_grace_s={args.stop_grace_s} must be >= 0 seconds")
    # Checked before any process starts (each started, then failed a second later with
    # Python's "can't open file").
    if not os.path.isfile(args.script):
        parser.error(f"--script={args.script} is not a file; give the path of the Python "
                     f"script every process runs (default: scripts/train.py)")
    script_args = argv[split + 1:]
    if repeated := per_process_flags(script_args):
        parser.error(f"{', '.join(repeated)} after `--` would give every "
                     f"process the same value; remove it (the launcher sets each process's "
                     f"id, the count and the address; --port picks the port)")
    if args.port and distributed.port_in_use(args.port):
        parser.error(f"--port={args.port} is already in use on this machine (another job's "
                     f"coordinator, or another program); pick a free one, or leave --port out")
    return launch(args, script_args)


if __name__ == "__main__":
    sys.exit(main())
