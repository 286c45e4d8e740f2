"""A researcher's multi-process script that raises on process 1 between two steps while
process 0 goes on into the next step's collectives (tests/test_multihost_misuse.py
starts it with scripts/launch_local.py)."""
from jaxhybrid import distributed

distributed.initialize()

import flax.linen as nn   # noqa: E402 (after jax.distributed)
import jax                # noqa: E402
import jax.numpy as jnp   # noqa: E402
import numpy as np        # noqa: E402

import jaxhybrid as jh    # noqa: E402
from jaxhybrid import pipeline as jp  # noqa: E402

pipe = jp.Pipeline([nn.Dense(8) for _ in range(4)], mesh=jh.make_mesh(data=2, pipe=4),
                   num_microbatches=2, boundaries=(1, 2, 3))
x = np.ones((8, 8), np.float32)
v = pipe.init(jax.random.key(0), x)
step = pipe.value_and_grad(lambda o, y: jnp.mean((o - y) ** 2))
for i in range(3):
    if i == 1 and jax.process_index() == 1:
        raise RuntimeError("a bug in process 1's own code")
    print(f"step {i} loss {float(step(v, x, x)[0]):.4f}", flush=True)
