"""GNMT (LSTM encoder-decoder with attention) on a synthetic translation task
(reverse-and-map sentences), data x pipeline parallel.

    python scripts/train.py --config=gnmt_hybrid.py --workdir=/tmp/jh_gnmt

Expected on a host without GPUs (8 simulated CPU devices, data=2 x pipe=4 over GNMT's
11 layers with the planner's boundaries, 1F1B over 4 microbatches), measured on 2 CPU
cores shared with other jobs (load ~8): after 600 steps eval_token_accuracy 0.999 and
eval_loss 0.010 on the 1024 test sentences, in 10.2 minutes wall time (~0.8-1.9
steps/s as the load varied).
"""
from jaxhybrid.config_flags import base_config


def get_config():
    c = base_config()
    c.model.name = "gnmt"
    c.model.size = "small"              # hidden 128, 4 + 4 layers, 17 tokens, vocab 64
    c.model.overrides = dict(dropout_rate=0.0)   # a noiseless task: no dropout needed
    c.mesh.data, c.mesh.pipe = 2, 4
    c.pipeline.schedule = "1f1b"
    c.pipeline.num_microbatches = 4
    c.train.steps = 600
    c.train.batch_size = 64
    c.train.learning_rate = 5e-3
    c.train.warmup_steps = 50
    c.train.grad_clip_norm = 1.0
    c.train.log_every = 50
    c.train.eval_every = 300
    c.data.options = dict(num_train=8192, num_test=1024)
    c.checkpoint.every = 300
    return c
