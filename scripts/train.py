"""Train a model from a config file.

    python scripts/train.py --config=inception_hybrid.py
    python scripts/train.py --config=gpt_hybrid.py --workdir=/tmp/gpt \\
        --config.train.steps=200 --config.mesh.data=4 --config.mesh.pipe=2

--config takes a path or a name in configs/; --config.<field>=value overrides a field.
--workdir (default /tmp/jaxhybrid/<config name>) receives metrics.jsonl, TensorBoard
events and checkpoints; running again in the same workdir resumes from its latest
checkpoint, also on another mesh layout. On a host without GPUs, jax gets 8 simulated
CPU devices so the data x pipe mesh of the configs fits.

Several processes (hosts): started by SLURM (srun) or Open MPI (mpirun), the run joins
them by itself; otherwise give every process --coordinator_address=host:port,
--num_processes=N and --process_id=i (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID). scripts/launch_local.py starts N such processes on one machine.

Compiled programs and layer profiles are cached in --cache_dir (default
~/.cache/jaxhybrid), so a second run of a job starts in a fraction of the first one's
time; the log's "start-up:" line gives plan, init, compile and first-step seconds.
"""
import time

_LAUNCHED = time.time()   # the start-up line of the log counts from here

import logging as std_logging  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402


# XLA CPU's compile-time settings for the training host without GPUs: its MLIR fusion
# emitters run a pass pipeline per fused kernel (the Inception step has ~2300 kernels),
# the classic emitters compile the same step in ~30-40% fewer CPU seconds; with them,
# LLVM at level 1 (of 3; default 2) takes another ~15-25% off, and the step runs as
# fast with both (docs/training.md, "Start-up").
CPU_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=1")


def _simulate_cpu_devices() -> None:
    """Before jax starts, when no GPU will be used: 8 host devices, and
    `CPU_COMPILE_FLAGS`. Decided without importing jax (that would fix the device
    count): JAX_PLATFORMS=cpu, or no nvidia-smi on PATH. What XLA_FLAGS (or
    JAX_NUM_CPU_DEVICES) already sets is left alone."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    no_gpu = platforms.split(",")[0].strip() == "cpu" or (
        not platforms and shutil.which("nvidia-smi") is None)
    if not no_gpu:
        return
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not any("xla_force_host_platform_device_count" in f for f in flags) and (
            "JAX_NUM_CPU_DEVICES" not in os.environ):
        flags.append("--xla_force_host_platform_device_count=8")
    flags += [f for f in CPU_COMPILE_FLAGS
              if not any(g.startswith(f.split("=")[0]) for g in flags)]
    os.environ["XLA_FLAGS"] = " ".join(flags)


_simulate_cpu_devices()

from absl import app, flags, logging  # noqa: E402  (after the XLA_FLAGS set-up)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxhybrid import config_flags, distributed  # noqa: E402

DEFAULT_CONFIG = "inception_hybrid.py"
# No flag default: absl parses a default when the flag is defined, and running the
# config file there (inception_hybrid.py asks jax for its backend) would start jax
# before jax.distributed may; `_parse_flags` adds --config=DEFAULT_CONFIG after that.
_CONFIG = config_flags.define_config_flag("config", default=None, help_string=(
    f"config file, or a name in configs/ ({', '.join(config_flags.available_configs())}); "
    f"default {DEFAULT_CONFIG}; override fields with --config.train.steps=10 etc."))
flags.declare_key_flag("config")   # listed by --help (defined in jaxhybrid.config_flags)
flags.FLAGS["config"].default_as_str = repr(DEFAULT_CONFIG)   # added by _parse_flags
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (default: "
                               "/tmp/jaxhybrid/<config name>)")
_CACHE_DIR = flags.DEFINE_string(
    "cache_dir", None, "where compiled programs (jax's persistent compilation cache) and "
    "layer profiles are kept so the next run starts fast (default: $JAXHYBRID_CACHE_DIR, "
    "$XDG_CACHE_HOME/jaxhybrid or ~/.cache/jaxhybrid); --cache_dir= turns caching off")
# Start-up flags are parsed (and jax.distributed started) before the others: parsing
# --config runs the config file, which may ask jax for its devices.
_STARTUP = flags.FlagValues()
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "multi-process: host:port of process 0's coordinator "
    "(default: $JAX_COORDINATOR_ADDRESS, or what SLURM / Open MPI say)", flag_values=_STARTUP)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "multi-process: number of processes (default: "
    "$JAX_NUM_PROCESSES or the cluster's)", flag_values=_STARTUP)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "multi-process: this process's id in [0, num_processes) (default: "
    "$JAX_PROCESS_ID or the cluster's)", flag_values=_STARTUP)
_INIT_TIMEOUT = flags.DEFINE_integer(
    "initialization_timeout", 300, "multi-process: seconds to wait for every process to "
    "join", flag_values=_STARTUP)
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "heartbeat_timeout", 100, "multi-process: seconds after which a silent (dead) process "
    "stops the others with an error naming it", flag_values=_STARTUP)
_SHUTDOWN_TIMEOUT = flags.DEFINE_integer(
    "shutdown_timeout", 300, "multi-process: seconds a finished process waits at exit for "
    "the others to finish", flag_values=_STARTUP)
flags.FLAGS.append_flag_values(_STARTUP)
for _name in list(_STARTUP):                 # listed by --help with the other flags
    flags.FLAGS.register_flag_by_module(sys.argv[0], _STARTUP[_name])


def _parse_flags(argv):
    """Start-up flags, jax.distributed (when multi-process), then the other flags."""
    rest = _STARTUP(argv, known_only=True)
    try:
        distributed.initialize(distributed.Settings(
            _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
            initialization_timeout=_INIT_TIMEOUT.value,
            heartbeat_timeout=_HEARTBEAT_TIMEOUT.value,
            shutdown_timeout=_SHUTDOWN_TIMEOUT.value))
    except ValueError as e:
        sys.exit(f"error: {e}")
    if _config_arg(rest[1:]) is None:
        rest = [rest[0], f"--config={DEFAULT_CONFIG}", *rest[1:]]
    try:
        # Told to every process: one that exited alone on its flag error left the others
        # waiting 2 minutes in jax's start-up, then failing with a timeout that did not
        # name it.
        return distributed.fail_together(lambda: flags.FLAGS(rest), flags.Error)
    except flags.Error as e:
        # A flag error (a misspelt --config.field, a wrong type: --config.train.steps=abc)
        # is the user's typo: one line, not absl's traceback (app.run's own parser would
        # catch it, but _parse_flags replaces that parser).
        sys.exit(f"error: {e}")


def _config_arg(args) -> str | None:
    """The --config value as typed in `args` (None: not given)."""
    for i, arg in enumerate(args):
        if arg.split("=", 1)[0] in ("--config", "-config"):
            return arg.split("=", 1)[1] if "=" in arg else args[i + 1]
    return None


def _quiet_orbax(record) -> bool:
    """Orbax logs every step of every save at INFO; keep its warnings only."""
    return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def main(argv):
    if len(argv) > 1:   # app.UsageError printed the whole --help page first
        sys.exit(f"error: unexpected arguments {argv[1:]}; every setting is a flag "
                 f"(--name=value, --config.<field>=value; --help lists them).")
    if _WORKDIR.value == "":
        sys.exit("error: --workdir= is empty; give a directory, or leave the flag out for "
                 "/tmp/jaxhybrid/<config name>.")
    logging.get_absl_handler().addFilter(_quiet_orbax)
    import jax
    main_process = distributed.is_main_process()
    if not main_process:                  # logs, progress and metrics: process 0 only
        logging.set_verbosity(logging.WARNING)
    from jaxhybrid import checkpoint, startup, train
    from jaxhybrid.plan import MemoryBudgetError
    distributed.stop_on_signals()
    try:
        startup.enable_caches(startup.default_cache_dir() if _CACHE_DIR.value is None
                              else _CACHE_DIR.value)
    except ValueError as e:
        sys.exit(f"error: {e}")
    typed = _config_arg(sys.argv[1:]) or DEFAULT_CONFIG
    name = os.path.splitext(os.path.basename(typed.split(":")[0]))[0]
    workdir = _WORKDIR.value or os.path.join("/tmp/jaxhybrid", name)
    logging.info("config %s, workdir %s, process %d of %d", name, workdir,
                 jax.process_index(), jax.process_count())
    try:
        config = config_flags.none_overrides(_CONFIG.value, sys.argv[1:])
        result = train.train_and_evaluate(config, workdir, launched=_LAUNCHED)
    except (train.ConfigError, train.TrainingDiverged, checkpoint.CheckpointMismatch,
            checkpoint.CheckpointWriteError, MemoryBudgetError) as e:
        distributed.exit_with_error(f"error: {e}")
    except KeyboardInterrupt as e:        # Ctrl-C or SIGTERM; the log names the step
        name = e.args[0] if e.args else "SIGINT"
        sys.stderr.write(f"stopped by {name}\n")
        sys.exit(143 if name == "SIGTERM" else 130)
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() == 1:
            raise
        # A collective failed: usually another process died (its own output says why).
        distributed.exit_with_error(
            f"error: process {jax.process_index()}: {str(e).splitlines()[0]} (if another "
            f"process stopped, its output names the cause)")
    if main_process:
        # Significant digits: a learning rate of 1.5e-4 printed as 0.0001 with .4f.
        print(" ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in result.items()))


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
