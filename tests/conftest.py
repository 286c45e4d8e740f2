"""Every test runs on 8 simulated CPU devices (set before jax is imported)."""
import os

# Tests compile many small programs once each: skipping LLVM's optimisations compiles
# them several times faster, and they still run fast enough.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
