"""Multi-process start-up: when and how `jax.distributed.initialize` is called.

A run is multi-process when it is told so, by flags or environment variables
(`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), or when it was
started by a cluster manager that JAX detects by itself (SLURM's `srun`, Open MPI's
`mpirun`): then `jax.distributed.initialize()` reads the process count and rank from
the manager. Otherwise the run stays single-process and nothing is initialised.

Failure behaviour: every process sends heartbeats to the coordinator (process 0); when
one stops (crash, kill, lost node) the coordinator tells the others, which then abort
with "The following tasks are unhealthy (stopped sending heartbeats): <process ids>"
after at most `heartbeat_timeout` seconds, instead of waiting forever in a collective.

CPU runs (several processes on one machine, see scripts/launch_local.py) use gloo
collectives; the number of CPU devices per process comes from `JAX_NUM_CPU_DEVICES` or
`XLA_FLAGS=--xla_force_host_platform_device_count=K`.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import os
import socket
import time

import numpy as np

ENV_VARS = {"coordinator_address": "JAX_COORDINATOR_ADDRESS",
            "num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID"}
# Cluster managers whose environment jax.distributed.initialize() reads by itself:
# (name, variables that must all be set, variable holding the number of processes).
CLUSTERS = (("SLURM", ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID"), "SLURM_NTASKS"),
            ("Open MPI", ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_RANK"),
             "OMPI_COMM_WORLD_SIZE"))


@dataclasses.dataclass(frozen=True)
class Settings:
    """How to start: explicit values (None: from the environment or the cluster)."""
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout: int = 300     # seconds to wait for every process to join
    heartbeat_timeout: int = 100          # seconds of silence before a process counts as dead
    shutdown_timeout: int = 300           # seconds a finished process waits for the others


# jax settings that change what a traced program computes or how its arguments are laid
# out: processes that differ in one traced different programs and failed in a gloo
# collective ("Received data size doesn't match expected size") or in jax's equality
# check of a host value, with no word on the cause.
JAX_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                "jax_threefry_partitionable", "jax_numpy_rank_promotion",
                "jax_numpy_dtype_promotion", "jax_disable_jit")


def detected_cluster(environ=os.environ) -> str | None:
    """The cluster manager that started this process with more than one process, if any."""
    for name, required, count in CLUSTERS:
        if all(v in environ for v in required) and int(environ.get(count, "1")) > 1:
            return name
    return None


def resolve(settings: Settings, environ=os.environ) -> Settings | None:
    """`settings` completed from the environment variables; None for a single-process
    run. A partial explicit set-up (an address without a count, ...) -> ValueError
    naming what is missing."""
    values = {k: getattr(settings, k) if getattr(settings, k) is not None else environ.get(v)
              for k, v in ENV_VARS.items()}
    given = {k for k, v in values.items() if v not in (None, "")}
    if not given:
        return settings if detected_cluster(environ) else None
    for key in ("num_processes", "process_id"):
        if key in given:
            try:
                values[key] = int(values[key])
            except ValueError:
                raise ValueError(f"distributed: {key}={values[key]!r} (flag --{key} or "
                                 f"{ENV_VARS[key]}) must be an int.") from None
    if detected_cluster(environ) is None and given != set(ENV_VARS):
        missing = [f"--{k} ({ENV_VARS[k]})" for k in ENV_VARS if k not in given]
        raise ValueError(f"distributed: set {', '.join(missing)} too: outside a cluster manager "
                         f"JAX detects (SLURM, Open MPI), a multi-process run needs the "
                         f"coordinator address, the number of processes and this process's id.")
    n, pid = values["num_processes"], values["process_id"]
    if n is not None and (n < 1 or (pid is not None and not 0 <= pid < n)):
        raise ValueError(f"distributed: process_id={pid} must be in [0, num_processes={n}).")
    if min(settings.initialization_timeout, settings.heartbeat_timeout,
           settings.shutdown_timeout) < 1:
        raise ValueError("distributed: initialization_timeout, heartbeat_timeout and "
                         "shutdown_timeout must be >= 1 second.")
    return dataclasses.replace(settings, **{k: values[k] for k in given})


def initialize(settings: Settings = Settings(), environ=os.environ) -> bool:
    """Starts jax.distributed when the run is multi-process (see the module docstring);
    True if it did. Call before anything touches jax devices."""
    resolved = resolve(settings, environ)
    if resolved is None:
        return False
    import sys

    import jax
    # CPU collectives across processes (ignored by GPU and TPU backends).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Said before joining: when a process never starts, jax aborts every other one from
    # C++ ("DEADLINE_EXCEEDED ... RegisterTask", "most likely ... another task died"),
    # with no Python exception to turn into a message of ours.
    if resolved.num_processes is not None:
        print(f"distributed: process {resolved.process_id} of {resolved.num_processes} "
              f"joining {resolved.coordinator_address}; waiting up to "
              f"{resolved.initialization_timeout} s for every process to start (one that "
              f"never does ends the others with DEADLINE_EXCEEDED ... RegisterTask)",
              file=sys.stderr, flush=True)
    if resolved.process_id == 0 and resolved.coordinator_address:
        check_coordinator_port(resolved.coordinator_address)
    jax.distributed.initialize(
        coordinator_address=resolved.coordinator_address,
        num_processes=resolved.num_processes, process_id=resolved.process_id,
        initialization_timeout=resolved.initialization_timeout,
        heartbeat_timeout_seconds=resolved.heartbeat_timeout,
        shutdown_timeout_seconds=resolved.shutdown_timeout)
    exit_on_uncaught_error()
    import threading
    if threading.current_thread() is threading.main_thread():
        # SIGTERM / Ctrl-C end this process at once, naming it, in any program: jax's
        # preemption notifier caught SIGTERM and a user's script (not train.py, which
        # installs this itself) went on, past `timeout` and SLURM's stop.
        stop_on_signals()
    say_when_exit_waits(resolved.shutdown_timeout)
    check_devices_per_process()      # first: jax's allgather needs as many devices everywhere
    check_jax_settings_agree()
    return True


def port_in_use(port: int) -> bool:
    """Whether a socket on this machine is bound to TCP `port` (any address). Checked
    with SO_REUSEADDR, as gRPC binds: a closed job's TIME_WAIT connections do not count."""
    for family, address in ((socket.AF_INET6, ("::", port)), (socket.AF_INET, ("", port))):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:          # no IPv6 on this machine
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
                if e.errno != errno.EADDRNOTAVAIL:
                    raise
    return False


def check_coordinator_port(address: str) -> None:
    """ValueError when process 0's machine already uses the coordinator's port. gRPC
    shares a port with another gRPC server (SO_REUSEPORT): a second job on the port of a
    running one made the *running* job's processes abort ("tried to connect with a
    different incarnation"); a port held by another program killed process 0 with SIGSEGV
    after "Failed to add port to server"."""
    port = address.rpartition(":")[2]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"distributed: coordinator_address={address!r} needs a port, "
                         f"host:1..65535 (flag --coordinator_address or "
                         f"JAX_COORDINATOR_ADDRESS).")
    if port_in_use(int(port)):
        raise ValueError(f"distributed: port {port} of coordinator_address={address!r} is "
                         f"already in use on process 0's machine (another job's coordinator, "
                         f"or another program); give this job a free port (launch_local.py "
                         f"picks one when --port is not given).")


def jax_settings() -> dict:
    """This process's jax and jaxlib versions and `JAX_SETTINGS`, as strings."""
    import jax
    import jaxlib
    return {"jax version": jax.__version__, "jaxlib version": jaxlib.__version__,
            **{name: str(getattr(jax.config, name, None)) for name in JAX_SETTINGS}}


def check_jax_settings_agree() -> None:
    """ValueError (the same on every process) when a process runs another jax, jaxlib or
    `JAX_SETTINGS` value than process 0 (JAX_ENABLE_X64=1 on one host). A collective
    every process joins; `allgather_json` sends each process's size first, so processes
    whose default integer widths differ still exchange their settings."""
    try:
        check_same_everywhere(jax_settings(), seen="runs with",
                              fix="set the same JAX_* environment variables and jax.config "
                                  "updates, and install the same jax and jaxlib, on every "
                                  "process")
    except ValueError as e:
        raise ValueError(f"distributed: {e}") from None


def say_when_exit_waits(shutdown_timeout: int, after_s: float = 10.0) -> None:
    """At a normal exit, jax waits (`shutdown_timeout` s) until every process has exited
    too; a process still running collectives waits for this one meanwhile (scripts whose
    processes see different numbers of batches), and both aborted 5 minutes later with
    DEADLINE_EXCEEDED and no word in between. If the exit still waits `after_s` s later,
    this says so on stderr. Registered after jax's own exit hook, so it runs first."""
    import atexit
    import sys
    import threading

    import jax

    def warn():
        sys.stderr.write(f"distributed: process {jax.process_index()} finished but still "
                         f"waits, up to {shutdown_timeout} s, for the other processes to "
                         f"finish: one of them is still running, likely waiting for this one "
                         f"in a collective (did the processes run different numbers of "
                         f"steps or batches?)\n")
        sys.stderr.flush()

    def arm():
        timer = threading.Timer(after_s, warn)
        timer.daemon = True
        timer.start()

    atexit.register(arm)


COORDINATOR_EXIT_GRACE_S = 2.0   # process 0 waits this long before an error's exit
# ... after waiting up to this long for the other processes to reach their own stop.
COORDINATOR_EXIT_WAIT_S = 30.0


def exit_on_uncaught_error(_exit=os._exit) -> None:
    """After an uncaught exception's traceback, the process exits (status 1) at once.
    Left to Python, the interpreter's exit ran jax.distributed's shutdown barrier, which
    waits for the other processes, themselves waiting in a step's collective for this
    one: all hung for the barrier's 5 minutes, and `launch_local.py` (which stops the
    others once one exits) never saw a failure."""
    import sys
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        _stop_process(_exit)

    sys.excepthook = hook


def _stop_process(_exit=os._exit) -> None:
    """Ends this process of several at once (status 1), after a line saying so."""
    import sys

    import jax
    print(f"distributed: process {jax.process_index()} stops on this error; the others "
          f"stop when their launcher does or after --heartbeat_timeout",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    if jax.process_count() > 1:
        client = _coordination_client()
        if client is not None:
            try:   # said where process 0 can see it
                client.key_value_set(f"{_STOPPING}/{jax.process_index()}", "1", True)
            except Exception:   # noqa: BLE001 - the service may be gone already
                pass
        if jax.process_index() == 0:
            # Process 0 hosts the coordination service: its exit aborts the others from
            # C++. A check that fails on every process at once (other device counts)
            # let some of them abort before printing their own line (CI: SIGABRT); so
            # did a plan refused on every process while one still waited for its
            # initialiser's compile. Process 0 waits for the others to reach their own
            # stop (at most COORDINATOR_EXIT_WAIT_S: one waiting in a collective never
            # does), then a grace for their exits.
            _await_stops(client, jax.process_count(), COORDINATOR_EXIT_WAIT_S)
            time.sleep(COORDINATOR_EXIT_GRACE_S)
    _exit(1)


_STOPPING = "jaxhybrid_stopping"


def _coordination_client():
    """jax.distributed's client (its key-value store), or None where there is none."""
    try:
        from jax._src import distributed as jax_distributed
        return jax_distributed.global_state.client
    except Exception:   # noqa: BLE001 - a jax without it: no handshake
        return None


def _await_stops(client, processes: int, wait_s: float) -> None:
    """Returns once every process has said it stops (`_stop_process`) or after `wait_s`."""
    if client is None:
        return
    deadline = time.monotonic() + wait_s
    for i in range(1, processes):
        left_ms = int(1000 * (deadline - time.monotonic()))
        if left_ms <= 0:
            return
        try:
            client.blocking_key_value_get(f"{_STOPPING}/{i}", left_ms)
        except Exception:   # noqa: BLE001 - timed out: that process is elsewhere
            return


def exit_with_error(message: str, _exit=os._exit) -> None:
    """Ends the program on an error it has named in one line (`message`): sys.exit on
    one process; on several, printed and then ended at once as an uncaught error is
    (`exit_on_uncaught_error`). A SystemExit on one process only (its checkpoint write
    failed) ran jax.distributed's shutdown barrier: it waited there for the others,
    themselves waiting in the next step's collective for it, silently for
    --shutdown_timeout."""
    import sys

    import jax
    if jax.process_count() == 1:
        sys.exit(message)
    print(message, file=sys.stderr, flush=True)
    _stop_process(_exit)


def is_main_process() -> bool:
    """Process 0: the one that writes metrics, TensorBoard events and logs."""
    import jax
    return jax.process_index() == 0


def broadcast_json(value):
    """Process 0's JSON-able `value`, on every process (a no-op with one process)."""
    import jax
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils
    raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(raw.size)))
    padded = np.zeros(size, np.uint8)
    padded[:min(size, raw.size)] = raw[:size]
    out = np.asarray(multihost_utils.broadcast_one_to_all(padded), np.uint8)
    return json.loads(out.tobytes().decode())


def allgather_json(value) -> list:
    """Every process's JSON-able `value`, in process order, on every process ([value]
    with one process)."""
    import jax
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils
    raw = np.frombuffer(json.dumps(value, sort_keys=True).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(raw.size))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(padded), np.uint8)
    return [json.loads(row[:n].tobytes().decode()) for row, n in zip(rows, sizes)]


def check_same_everywhere(fields: dict, *, seen: str = "was started with",
                          fix: str = "start every process with the same --config, --config.* "
                                     "flags and --workdir") -> None:
    """Raises ValueError (on every process, with the same message) when a process has
    other `fields` ({name: JSON-able value}) than process 0 ("process 1 <seen> k=v but
    process 0 with w; <fix>."): processes running different steps, layouts or learning
    rates would fail in a mismatched collective, hang, or train their replicas apart
    silently."""
    everyone = allgather_json(fields)
    diffs = [(i, k) for i, other in enumerate(everyone[1:], 1)
             for k in sorted(set(other) | set(everyone[0])) if other.get(k) != everyone[0].get(k)]
    if diffs:
        i, k = diffs[0]
        more = f" (and {len(diffs) - 1} more differences)" if len(diffs) > 1 else ""
        raise ValueError(f"process {i} {seen} {k}={everyone[i].get(k)!r} but process 0 "
                         f"with {everyone[0].get(k)!r}{more}; {fix}.")


def check_devices_per_process() -> None:
    """ValueError (the same on every process) when the processes hold different numbers
    of devices: jax's multi-process helpers (a host value's device_put onto a mesh,
    process_allgather, orbax's syncs) lay the devices out as processes x local devices,
    and failed with "cannot reshape array of size 8 into shape (2,6)"."""
    import jax
    if jax.process_count() == 1:
        return
    counts = collections.Counter(d.process_index for d in jax.devices())
    if len(set(counts.values())) > 1:
        held = ", ".join(f"process {i}: {n}" for i, n in sorted(counts.items()))
        raise ValueError(f"distributed: the processes hold different numbers of devices "
                         f"({held}); start every process with as many (the same "
                         f"--devices_per_process, JAX_NUM_CPU_DEVICES, "
                         f"--xla_force_host_platform_device_count or number of visible GPUs).")


def fail_together(fn, error=ValueError):
    """fn(); on several processes, when it raises on some process it raises on all of
    them: there its own exception, elsewhere `error("process <i>: <its message>")`.
    For checks that only some processes can fail (its devices, its disk): the others
    went on to their next collective and waited there for jax.distributed's shutdown
    timeout (5 minutes) while the failed one waited at exit. Every process must call it."""
    import jax
    if jax.process_count() == 1:
        return fn()
    try:
        result, raised = fn(), None
    except Exception as e:   # noqa: BLE001 (told to every process, then re-raised)
        result, raised = None, e
    messages = allgather_json(None if raised is None else
                              (str(raised).splitlines() or [type(raised).__name__])[0])
    failed = [(i, m) for i, m in enumerate(messages) if m is not None]
    if raised is not None:
        raise raised
    if failed:
        i, message = failed[0]
        raise error(f"process {i}: {message}")
    return result


def process_0s(items: list) -> list:
    """Process 0's `items` (a list of dataclasses of JSON values, e.g. layer costs) on
    every process: a collective, one item list per process; unchanged with one."""
    import jax
    if jax.process_count() == 1:
        return items
    chosen = broadcast_json([dataclasses.asdict(x) for x in items])
    return [type(x)(**d) for x, d in zip(items, chosen)]


# A stop signal on one process, recorded while the training loop defers it (see
# `signals_deferred`): the signal's name, or None.
_STOP: dict = {"deferred": 0, "signal": None}


@contextlib.contextmanager
def signals_deferred():
    """Inside, a stop signal on one process is recorded (`stop_requested`) instead of raised:
    the training loop ends the step in flight, its record and its checkpoint, then stops.
    Raised at once, a KeyboardInterrupt while the host waited for a step lost the state
    donated to that step ("Array has been deleted"): no checkpoint was written, and a
    save or an evaluation cut short left a log line naming a checkpoint that was not
    there, or records that were not. Outside (start-up), and at a second signal, it is
    raised as before."""
    if not _STOP["deferred"]:
        _STOP["signal"] = None      # a stop that ended an earlier loop of this process
    _STOP["deferred"] += 1
    try:
        yield
    finally:
        _STOP["deferred"] -= 1


def stop_requested() -> str | None:
    """The name of a stop signal received inside `signals_deferred`, else None."""
    return _STOP["signal"]


def stop_on_signals(grace_s: float = 60.0, _exit=os._exit) -> None:
    """SIGTERM (what SLURM, Kubernetes and `launch_local.py` send to stop a run) ends the
    run like Ctrl-C: on one process as a KeyboardInterrupt (inside the training loop at
    the end of the step in flight, `signals_deferred`), so the training loop saves
    its last step and waits for the checkpoint being written (SIGTERM's default killed
    the process at once and dropped that write); if it has not ended `grace_s` later (the
    main thread stuck in a compile or a collective), it exits then. On several processes
    a checkpoint needs all of them, and a stopped one would leave the others waiting in
    a barrier (for 300 s after a Ctrl-C to one process): SIGTERM and SIGINT end this
    process at once, with a line naming it, and the others stop within
    --heartbeat_timeout naming it, as when a process dies. The last complete checkpoint
    stays. A watcher thread reads the signals from the wakeup fd, so this holds while
    the main thread is inside XLA (where Python handlers do not run). Main thread only;
    `_exit` is for tests."""
    import signal
    import sys
    import threading

    import jax
    several = jax.process_count() > 1
    stops = {signal.SIGTERM, signal.SIGINT}

    def exit_now(signum: int, why: str) -> None:
        sys.stderr.write(f"process {jax.process_index()}: stopped by "
                         f"{signal.Signals(signum).name}{why}\n")
        sys.stderr.flush()
        _exit(128 + signum)

    def handler(signum, frame):   # the main thread, between two Python instructions
        if not several:
            name = signal.Signals(signum).name
            if _STOP["deferred"] and _STOP["signal"] is None:
                _STOP["signal"] = name        # the loop stops after this step
                return
            raise KeyboardInterrupt(name)

    def watch(fd: int) -> None:
        while True:
            got = os.read(fd, 1)
            if got and got[0] in stops:
                if several:
                    exit_now(got[0], "; the other processes stop within "
                             "--heartbeat_timeout, and a restart resumes from the last "
                             "complete checkpoint")
                time.sleep(grace_s)
                exit_now(got[0], f" and still running {grace_s:g} s later; exiting (the "
                         f"last complete checkpoint stays)")

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for signum in stops:
        signal.signal(signum, handler)
    threading.Thread(target=watch, args=(read_fd,), daemon=True,
                     name="stop_on_signals").start()


def place_everywhere(a, sharding, what: str):
    """A numpy value or a process's own key as one global array on `sharding`: jax.jit
    reads such an argument as each process's own value, so processes that passed other
    batches or keys (`fold_in(key, process_index())`) trained on a mix, silently. jax
    checks that the value is the same on every process; a difference is a ValueError
    naming `what`. Global jax.Arrays and Python scalars are returned as they are."""
    import jax
    key = isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
    if isinstance(a, jax.Array) and (not a.is_fully_addressable or not key and
                                     len(a.sharding.device_set) > 1):
        return a        # global already (or committed across devices by the caller)
    if not key and not isinstance(a, (np.ndarray, jax.Array)):
        return a
    data = np.asarray(jax.random.key_data(a) if key else a)
    try:
        placed = jax.device_put(data, sharding)
    except AssertionError as e:   # jax: "... is not the same on each process"
        raise ValueError(f"{what} differs between processes (jax: not the same on each "
                         f"process); pass the same global value on every process (a key: "
                         f"the same seed; a batch: the global batch, or each process's rows "
                         f"as one global array: jaxhybrid.data.place_batch).") from e
    return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(a)) if key else placed


def place_key_everywhere(rng, mesh, what: str):
    """`rng` as one key replicated on `mesh`, checked by jax to be the same on every
    process (`place_everywhere`); as it is with one process, without a key (None), or
    inside a trace."""
    import jax
    if rng is None or jax.process_count() == 1 or isinstance(rng, jax.core.Tracer):
        return rng
    return place_everywhere(rng, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
                            what)


def argument_shapes(trees) -> str:
    """Shapes and dtypes of `trees` as one comparable string (`check_same_everywhere`)."""
    import jax
    import jax.numpy as jnp
    return str(jax.tree.map(lambda a: (np.shape(a), str(jnp.result_type(a))), trees))
