"""Start-up of a training run: on-disk caches and the time each start-up phase took.

Two caches make a second run of the same job start fast, both under one directory
(default `$JAXHYBRID_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxhybrid`, else
`~/.cache/jaxhybrid`; `scripts/train.py --cache_dir=DIR`, `--cache_dir=` turns both off):

  <dir>/xla     jax's persistent compilation cache: every compiled program (layer
                initialisers, the training and evaluation steps) is read back instead
                of compiled again;
  <dir>/costs   `jaxhybrid.plan.profile` results, keyed by the layers, input shapes and
                dtypes, device kind and jax version: the planner's input without profiling.

`Phases` splits the time from launch to the first finished training step into
plan (layer profiling and partition; `jaxhybrid.train` compiles and runs the layers'
initialiser on a second thread meanwhile), compile (tracing, lowering and XLA
compilation, from jax's own monitoring events, or reading them back from the cache;
`jaxhybrid.train` compiles the step right after planning, from the layers' shapes,
while the initialiser finishes), init (what is left to wait for of the initialiser,
optimizer state, restore) and the first step itself.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pathlib
import threading
import time

import jax

from jaxhybrid.plan import costs

# Compile-side events jax records (jax._src.dispatch): tracing to a jaxpr, lowering to
# MLIR, and the backend compile (which includes a persistent-cache lookup and read).
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")

_lock = threading.Lock()
_compile_seconds = {e: 0.0 for e in COMPILE_EVENTS}
# The same, per thread: a phase moves to "compile" only its own thread's compile time
# (a compile on a background thread overlaps the phase, it does not stop it).
_thread_compile_seconds: dict[int, float] = {}
_listening = False


def default_cache_dir() -> str:
    if os.environ.get("JAXHYBRID_CACHE_DIR"):
        return os.environ["JAXHYBRID_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxhybrid")


def enable_caches(cache_dir: str | os.PathLike | None) -> str | None:
    """Turns on jax's persistent compilation cache in `<cache_dir>/xla` and the profile
    cache in `<cache_dir>/costs`; None or "" turns both off. Returns the directory used.
    Call before the first compilation."""
    if not cache_dir:
        costs.set_cache_dir(None)
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    cache_dir = os.path.abspath(os.path.expanduser(os.fspath(cache_dir)))
    try:
        pathlib.Path(cache_dir, "xla").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cache directory {cache_dir} cannot be created ({e.strerror}); pass "
                         f"--cache_dir=<a writable directory>, or --cache_dir= for no cache.")
    jax.config.update("jax_compilation_cache_dir", os.path.join(cache_dir, "xla"))
    # Every program, also the many small ones (a layer's initialiser compiles in well
    # under jax's default threshold of 1 s, and there are dozens).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    costs.set_cache_dir(cache_dir)
    return cache_dir


def _on_duration(event: str, duration: float, **_) -> None:
    if event in _compile_seconds:   # jax calls this on the thread that compiled
        me = threading.get_ident()
        with _lock:
            _compile_seconds[event] += duration
            _thread_compile_seconds[me] = _thread_compile_seconds.get(me, 0.0) + duration


def compile_seconds(event: str | None = None) -> float:
    """Seconds this process has spent tracing, lowering and compiling (or reading
    compiled programs back from the persistent cache) since the first `Phases`, on all
    threads; or those of one of `COMPILE_EVENTS`."""
    return _compile_seconds[event] if event else sum(_compile_seconds.values())


def thread_compile_seconds() -> float:
    """`compile_seconds()` of the calling thread only."""
    return _thread_compile_seconds.get(threading.get_ident(), 0.0)


class Phases:
    """Wall time per start-up phase: `with phases("init"): ...`, or `phases.start("init")`
    ... `phases.stop("init")`. The time jax spent compiling inside a phase, on the
    thread that runs the phase, is moved to "compile" unless `split_compile` is False
    (planning: its cost-analysis compiles are planning); compiles on other threads
    overlap the phases and count in the summary's totals only. `summary()` is one line."""

    def __init__(self, launched: float | None = None):
        global _listening
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True
        self.launched = time.time() if launched is None else launched
        self.seconds: dict[str, float] = {}
        self._events_at_start = {e: compile_seconds(e) for e in COMPILE_EVENTS}
        self._open: dict[str, tuple[float, float | None]] = {}

    def start(self, name: str, split_compile: bool = True) -> None:
        self._open[name] = (time.time(), thread_compile_seconds() if split_compile else None)

    def stop(self, name: str) -> None:
        t0, c0 = self._open.pop(name)
        wall = time.time() - t0
        compiled = 0.0 if c0 is None else thread_compile_seconds() - c0
        self.seconds[name] = self.seconds.get(name, 0.0) + max(wall - compiled, 0.0)
        self.seconds["compile"] = self.seconds.get("compile", 0.0) + compiled

    @contextlib.contextmanager
    def __call__(self, name: str, split_compile: bool = True):
        self.start(name, split_compile)
        try:
            yield
        finally:
            self.stop(name)

    def summary(self) -> str:
        total = time.time() - self.launched
        parts = [f"{k} {v:.1f} s" for k, v in self.seconds.items()]
        trace, lower, xla = (compile_seconds(e) - self._events_at_start[e] for e in COMPILE_EVENTS)
        if "compile" in self.seconds:
            parts[list(self.seconds).index("compile")] += (
                f" (all phases: tracing {trace:.1f} s, lowering {lower:.1f} s, XLA or its "
                f"cache {xla:.1f} s)")
        other = total - sum(self.seconds.values())
        # CPU seconds of all threads (compiles run on several): on a shared host the
        # wall times grow with the load, the CPU seconds much less.
        return (f"start-up: {', '.join(parts)}, other (imports, data, checkpoints) "
                f"{other:.1f} s; process CPU {time.process_time():.1f} s; "
                f"launch -> first step done {total:.1f} s")


class LayerInit:
    """`pipe.init_layers` on a second thread: `shapes()` (the variables' shapes, known
    after tracing) and `result()` (the values) wait for their part."""

    def __init__(self, pipe, rng, sample_inputs):
        self._shapes, self._values = concurrent.futures.Future(), concurrent.futures.Future()
        threading.Thread(target=self._run, args=(pipe, rng, sample_inputs), daemon=True,
                         name="layer-init").start()

    def _run(self, pipe, rng, sample_inputs):
        try:
            self._shapes.set_result(pipe.init_layer_shapes(rng, sample_inputs))
            self._values.set_result(jax.block_until_ready(pipe.init_layers(rng, sample_inputs)))
        except BaseException as e:   # noqa: BLE001 (raised again by the waiting caller)
            for future in (self._shapes, self._values):
                if not future.done():
                    future.set_exception(e)

    def shapes(self) -> list[dict]:
        return self._shapes.result()

    def result(self) -> list[dict]:
        return self._values.result()

    def wait(self) -> None:
        """Until the thread is done, whether it succeeded or failed."""
        concurrent.futures.wait([self._values])


def init_layers_in_background(pipe, rng, sample_inputs) -> LayerInit | None:
    """`pipe.init_layers` on a second thread, started before planning: the layers'
    initialiser needs no plan, and XLA compiles it (releasing the GIL) while the
    planner traces and profiles the layers, on a core planning leaves idle. None where
    `pipe.init` must do it (a split model: its splitter; a "model" axis: `init` also
    learns which dimensions the layers split)."""
    if pipe.splitter is not None or pipe.model > 1:
        return None
    return LayerInit(pipe, rng, sample_inputs)
