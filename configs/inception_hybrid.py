"""Inception-V3 on scikit-learn digits (75x75), data x pipeline parallel. THE DEFAULT.

    python scripts/train.py --config=inception_hybrid.py --workdir=/tmp/jh_default

Expected on a host without GPUs (8 simulated CPU devices, mesh data=2 x pipe=4, the
planner's stage boundaries [3, 6, 11], 1F1B over 4 microbatches, Inception-V3 "tiny"):
after 300 steps (~13 epochs of the 1438 training digits) eval_accuracy 0.972 on the
359 test digits (0.955-0.972 across seeds and engine versions, whose floating-point
summation orders differ), in 3 min 2 s - 3 min 12 s wall time on 2 quiet CPU cores:
~60 s planning (layer profiling) and initialisation, ~40 s compiling, then 4-4.5 steps/s
(measured before layer profiling went abstract and cached: the log's "start-up:" line
gives this run's phases; a second run reads the layer profiles and compiled programs
from --cache_dir, ~/.cache/jaxhybrid).


With GPUs the mesh uses every GPU (pipe = 4, 2 or 1, whichever divides the count;
data fills the rest), a wider model ("small") and a bigger batch.
"""
from jaxhybrid.config_flags import base_config


def get_config():
    c = base_config()
    c.model.name = "inception_v3"
    c.model.size = "tiny"
    c.model.overrides = dict(num_classes=10, image_size=75, dropout_rate=0.1)
    c.mesh.data, c.mesh.pipe = 2, 4
    c.pipeline.schedule = "1f1b"
    c.pipeline.num_microbatches = 4
    c.pipeline.remat = "auto"           # no memory budget: the planner recomputes nothing
    c.train.steps = 300
    c.train.batch_size = 64
    c.train.learning_rate = 1e-2
    c.train.warmup_steps = 30
    c.train.weight_decay = 1e-4
    c.train.log_every = 25
    c.train.eval_every = 100
    c.checkpoint.every = 100
    c.checkpoint.keep = 2
    _use_gpus(c)
    return c


def _use_gpus(c):
    """Scale the recipe up when jax sees GPUs (the CPU numbers above are unchanged)."""
    import jax   # imported here: scripts/train.py sets XLA_FLAGS before jax starts
    if jax.default_backend() != "gpu":
        return
    n = jax.device_count()
    c.mesh.pipe = next(p for p in (4, 2, 1) if n % p == 0)
    c.mesh.data = -1
    c.model.size = "small"
    c.pipeline.num_microbatches = 8
    c.train.batch_size = 64 * (n // c.mesh.pipe)
