"""GPT with tied input/output embeddings given as ONE Flax module (`model.module`): the
pipeline's splitter cuts it into stages, the tied matrix is held by the first and the
last stage with its gradient summed. Any Flax model trains the same way, by import path:

    python scripts/train.py --config=gpt_module.py --workdir=/tmp/jh_gpt_module
    python scripts/train.py --config=gpt_module.py \\
        --config.model.module=my_package.models:make_model --config.model.loss=token \\
        --config.model.kwargs="{'hidden': 256}"    # replaces GPT's kwargs below

(`--config.model.kwargs.hidden=256` adds one argument to GPT's kwargs.)

`model.module` names a factory called with `model.kwargs` (or a module instance);
`model.loss` is "classification", "token" or an import path of loss_fn(outputs, targets);
`data.name` picks the dataset, `data.options` its options.
"""
from jaxhybrid.config_flags import base_config


def get_config():
    c = base_config()
    c.model.module = "jaxhybrid.models:module"
    c.model.kwargs = dict(name="gpt", size="small", tied=True, dropout_rate=0.1)
    c.model.loss = "token"
    c.data.name = "stdlib_text"
    c.data.options = dict(max_bytes=2_000_000, seq_len=128, pad_id=256)
    c.mesh.data, c.mesh.pipe = 2, 4
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
    c.train.eval_steps = 20
    c.checkpoint.every = 200
    return c
