"""GPT (pre-LayerNorm transformer decoder) as a byte-level language model on Python's
standard-library sources, data x pipeline parallel.

    python scripts/train.py --config=gpt_hybrid.py --workdir=/tmp/jh_gpt

Expected on a host without GPUs (8 simulated CPU devices, data=2 x pipe=4 with the
planner's boundaries, 1F1B over 4 microbatches), measured on 2 CPU cores shared with
other jobs: after 400 steps eval_loss 2.14 nats per byte (3.09 bits) and
eval_token_accuracy 0.428 on the held-out 10% of the bytes (first 20 batches), in
8.5 minutes wall time (~0.9 steps/s).
"""
from jaxhybrid.config_flags import base_config


def get_config():
    c = base_config()
    c.model.name = "gpt"
    c.model.size = "small"              # 4 blocks, d_model 128, 128 bytes of context
    c.model.overrides = dict(dropout_rate=0.1)
    c.mesh.data, c.mesh.pipe = 2, 4       # embedding | 4 blocks | head over 4 stages
    c.mesh.model = 1                      # 2: blocks' heads and MLP split over 2 devices
                                          # (then e.g. data=2, pipe=2; docs/training.md)
    c.pipeline.schedule = "1f1b"
    c.pipeline.num_microbatches = 4
    c.train.steps = 400
    c.train.batch_size = 32
    c.train.learning_rate = 2e-3
    c.train.warmup_steps = 40
    c.train.weight_decay = 0.01
    c.train.grad_clip_norm = 1.0
    c.train.log_every = 50
    c.train.eval_every = 200
    c.train.eval_steps = 20              # 20 x 32 sequences of the held-out bytes
    c.data.options = dict(max_bytes=2_000_000)
    c.checkpoint.every = 200
    return c
