"""Benchmarks that print figures (never pass/fail): one mode per topic.

    python scripts/bench.py pipeline     # bubble, memory, params/device, CPU-seconds ratios
    python scripts/bench.py plan         # planner vs brute force / equal split, mapping, remat
    python scripts/bench.py projection   # step-time model vs the real engine on this host
    python scripts/bench.py memory       # memory model vs the compiled step, four models
    python scripts/bench.py burst        # burst / multiplexed CPU-seconds, device-time check
    python scripts/bench.py sharding     # params / Adam bytes per device: model axis, ZeRO
    python scripts/bench.py async        # convergence study of the asynchronous schedules
    python scripts/bench.py collectives  # CPU cost of a lock-step tick's collectives
    python scripts/bench.py breakdown    # a pipelined step's thunk time by kind vs DP

`python scripts/bench.py MODE --help` lists a mode's flags. On a host without GPUs the
8 simulated CPU devices are set up here, before jax starts.
"""
import importlib
import os
import sys

MODES = {"pipeline": "jaxhybrid.bench.pipeline_bench",
         "plan": "jaxhybrid.bench.plan_bench",
         "projection": "jaxhybrid.bench.projection_bench",
         "memory": "jaxhybrid.bench.memory_bench",
         "burst": "jaxhybrid.bench.burst_bench",
         "sharding": "jaxhybrid.bench.sharding_bench",
         "async": "jaxhybrid.bench.async_bench",
         "collectives": "jaxhybrid.bench.collectives_bench",
         "breakdown": "jaxhybrid.bench.breakdown_bench"}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in MODES:
        raise SystemExit(f"usage: python scripts/bench.py {{{'|'.join(MODES)}}} [--flags]")
    mode = sys.argv.pop(1)
    # Only affects the host (CPU) platform; a GPU host still runs on its GPUs.
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    from absl import app
    from absl import flags
    module = importlib.import_module(MODES[mode])   # defines only this mode's flags
    flags.adopt_module_key_flags(module)   # `--help` lists them (absl: the main module's)

    def run(argv):
        try:
            module.main(argv)
        except (ValueError, OSError) as e:   # input errors, unreadable / unwritable paths:
            raise SystemExit(f"bench {mode}: {e}") from None   # one line naming the fix
    app.run(run)


if __name__ == "__main__":
    main()
