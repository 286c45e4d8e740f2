"""Every test runs on 8 simulated CPU devices (set before jax is imported)."""
import atexit
import os
import shutil
import tempfile

# Tests compile many small programs once each: skipping LLVM's optimisations compiles
# them several times faster, and they still run fast enough.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The user cache (`jaxhybrid.startup.default_cache_dir`) holds a stored calibration once
# `scripts/bench.py projection` has run, and planned pipelines price steps with it: a
# fresh one per run keeps the tests from depending on what this machine ran before.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="jaxhybrid-tests-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
