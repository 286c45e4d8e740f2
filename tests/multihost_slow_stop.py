"""A multi-process script whose every process raises the same error (a plan no layout can
meet), process 1 only some seconds later, as a start-up whose initialiser thread is still
compiling (tests/test_multihost_misuse.py starts it with scripts/launch_local.py)."""
import time

from jaxhybrid import distributed

distributed.initialize()

import jax  # noqa: E402 (after jax.distributed)

try:
    raise ValueError("a plan that no process can run")
except ValueError:
    if jax.process_index() == 1:
        time.sleep(6)   # still waiting for its initialiser when process 0 stops
    raise
