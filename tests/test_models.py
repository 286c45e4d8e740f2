"""The four models at size "tiny" (forward, loss, gradients, logical axis names, dropout,
BatchNorm state) and at size "full" (parameter counts from shapes only)."""
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid import models
from jaxhybrid.layers import mode_kwargs
from jaxhybrid.sharding import LOGICAL_AXES

# Tiny presets of the token models have no dropout; turn it on to test it.
TRAIN_OVERRIDES = {"inception_v3": {}, "gnmt": {"dropout_rate": 0.1},
                   "biglstm": {"dropout_rate": 0.1}, "gpt": {"dropout_rate": 0.1}}
BATCH = 4
# Tests run small programs once: skipping LLVM's optimisations compiles faster (Inception
# tiny's train step ~30% faster) and runs fast enough.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _init_key(seed=0):
    # "rbg" keys: with the default (partitionable threefry) keys, XLA:CPU spends ~45 s
    # compiling Inception's ~100 random initialisers; rbg compiles in a few seconds.
    return jax.random.key(seed, impl="rbg")


@functools.lru_cache(maxsize=None)
def _setup(name):
    """Spec, batch, variables and jitted train/eval functions, shared by the tests."""
    spec = models.get_model(name, "tiny", **TRAIN_OVERRIDES[name])
    x, y = spec.sample_batch(BATCH)
    variables = jax.jit(spec.init, compiler_options=FAST_COMPILE)(_init_key(), x)
    params = [v.get("params", {}) for v in variables]
    state = [{k: c for k, c in v.items() if k != "params"} for v in variables]

    def join(params, state):
        return [{**s, "params": p} for p, s in zip(params, state)]

    def train_loss(params, state, x, y, rng):
        out, new_vars = spec.apply(join(params, state), x, train=True, rng=rng)
        return spec.loss_fn(out, y), (out, new_vars)

    grad_fn = jax.jit(jax.value_and_grad(train_loss, has_aux=True),
                      compiler_options=FAST_COMPILE)
    eval_fn = jax.jit(lambda v, x, rng: spec.apply(v, x, train=False, rng=rng),
                      compiler_options=FAST_COMPILE)
    return spec, x, y, variables, params, state, grad_fn, eval_fn


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_forward_shape_and_finite_loss(name):
    spec, x, y, variables, *_, eval_fn = _setup(name)
    out, new_vars = eval_fn(variables, x, jax.random.key(0))
    cfg = spec.config
    if name == "inception_v3":
        expected = (BATCH, cfg["num_classes"])
    else:
        length = cfg["tgt_len"] if name == "gnmt" else cfg["seq_len"]
        expected = (BATCH, length, cfg["vocab_size"])
    assert out.shape == expected and out.dtype == jnp.float32
    loss = float(spec.loss_fn(out, y))
    # Near chance at init: cross-entropy about log(number of classes).
    n = expected[-1]
    assert np.isfinite(loss) and 0.5 * math.log(n) < loss < 2.0 * math.log(n)
    metrics = spec.metrics_fn(out, y)
    assert np.isclose(float(metrics["loss"]), loss, rtol=1e-5)
    # Eval mode leaves state (BatchNorm statistics) as it was.
    assert all(jax.tree.all(jax.tree.map(jnp.array_equal, a, b))
               for a, b in zip(variables, new_vars))


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_gradients_finite_and_nonzero_for_every_parameter(name):
    spec, x, y, variables, params, state, grad_fn, _ = _setup(name)
    (loss, _), grads = grad_fn(params, state, x, y, jax.random.key(1))
    assert np.isfinite(float(loss))
    assert all(len(jax.tree.leaves(p)) for p in params), "every layer has parameters"
    for i, g in enumerate(grads):
        for path, leaf in jax.tree_util.tree_leaves_with_path(g):
            where = f"layer {i} ({type(spec.layers[i]).__name__}) {jax.tree_util.keystr(path)}"
            assert np.all(np.isfinite(leaf)), where
            assert np.any(leaf != 0), f"zero gradient: {where}"


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_parameters_carry_logical_axis_names(name):
    spec, x, *_ = _setup(name)

    def boxed_init(key, x):                   # like init_layers, but keeps the boxes
        out = []
        for i, layer in enumerate(spec.layers):
            kw = mode_kwargs(layer, False)
            x, v = layer.init_with_output({"params": jax.random.fold_in(key, i)}, x, **kw)
            out.append(v)
        return out

    boxed = jax.eval_shape(boxed_init, jax.random.key(0), x)
    is_box = lambda b: isinstance(b, nn.LogicallyPartitioned)
    for i, v in enumerate(boxed):
        leaves = jax.tree.leaves(v["params"], is_leaf=is_box)
        assert leaves
        for leaf in leaves:
            assert is_box(leaf), f"layer {i}: unnamed parameter {leaf}"
            assert len(leaf.names) == len(leaf.value.shape)
            assert set(leaf.names) <= set(LOGICAL_AXES), leaf.names
    specs = nn.get_partition_spec(boxed)
    assert all(isinstance(s, jax.sharding.PartitionSpec)
               for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(
                   s, jax.sharding.PartitionSpec)))


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_dropout_uses_the_rng_in_training_and_eval_is_deterministic(name):
    spec, x, y, variables, params, state, grad_fn, eval_fn = _setup(name)
    (_, (out1, _)), _ = grad_fn(params, state, x, y, jax.random.key(1))
    (_, (again, _)), _ = grad_fn(params, state, x, y, jax.random.key(1))
    (_, (out2, _)), _ = grad_fn(params, state, x, y, jax.random.key(2))
    assert np.array_equal(out1, again)                # same rng, same dropout mask
    assert not np.allclose(out1, out2)                # another rng, another mask
    e1, _ = eval_fn(variables, x, jax.random.key(1))
    e2, _ = eval_fn(variables, x, jax.random.key(2))
    assert np.array_equal(e1, e2)


def test_inception_batchnorm_statistics_update_in_training():
    spec, x, y, variables, params, state, grad_fn, _ = _setup("inception_v3")
    (_, (_, new_vars)), _ = grad_fn(params, state, x, y, jax.random.key(1))
    stats = [v["batch_stats"] for v in variables if "batch_stats" in v]
    new_stats = [v["batch_stats"] for v in new_vars if "batch_stats" in v]
    assert len(stats) == len(spec.layers) - 1          # every layer but the classifier
    for old, new in zip(stats, new_stats):
        changed = jax.tree.map(lambda a, b: bool(np.any(a != b)), old, new)
        assert all(jax.tree.leaves(changed))
        assert all(np.all(np.isfinite(a)) for a in jax.tree.leaves(new))


def test_biglstm_sampled_softmax_trains_on_sampled_columns():
    spec = models.get_model("biglstm", "tiny", num_sampled=8)
    x, y = spec.sample_batch(2)
    assert isinstance(x, tuple) and np.array_equal(x[1], y)
    variables = jax.jit(spec.init, compiler_options=FAST_COMPILE)(_init_key(), x)
    apply = jax.jit(lambda v, x, train: spec.apply(v, x, train=train, rng=jax.random.key(3))[0],
                    static_argnums=2, compiler_options=FAST_COMPILE)
    out = apply(variables, x, True)
    assert out["logits"].shape == (2, spec.config["seq_len"], 9)
    assert np.array_equal(out["labels"], np.zeros_like(y))   # true class is column 0
    assert np.isfinite(float(spec.loss_fn(out, y)))
    full = apply(variables, x, False)                        # evaluation: full softmax
    assert full.shape == (2, spec.config["seq_len"], spec.config["vocab_size"])


# --- full sizes: counted from shapes, nothing allocated ----------------------------
def _lstm(inputs, hidden, projection=None):
    r = projection or hidden
    return inputs * 4 * hidden + r * 4 * hidden + 4 * hidden + (hidden * r if projection else 0)


def _gnmt_params(v, h=1024, enc=8, dec=8):
    embed = 2 * v * h
    encoder = 2 * _lstm(h, h) + _lstm(2 * h, h) + (enc - 2) * _lstm(h, h)
    attention = 2 * h * h + 2 * h + 1                   # query, key, bias, v, g
    decoder = _lstm(h, h) + attention + (dec - 1) * _lstm(2 * h, h)
    return embed + encoder + decoder + h * v + v


def _biglstm_params(v=793471, h=8192, p=1024, layers=2):
    return v * p + layers * _lstm(p, h, p) + v * p + v


def _gpt_params(v=50257, d=768, layers=12, positions=1024, tied=False):
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return v * d + positions * d + layers * block + 2 * d + (0 if tied else d * v)


FULL = {   # name, overrides -> (exact count, the published figure's range)
    ("inception_v3", ()): (23_834_568, (23.5e6, 24.0e6)),        # torchvision, no aux
    ("inception_v3", (("aux_head", True),)): (27_161_264, (27e6, 27.5e6)),
    ("gnmt", ()): (_gnmt_params(32000), (160e6, 280e6)),          # vocab 32000
    ("biglstm", ()): (_biglstm_params(), (0.8e9, 1.9e9)),        # vocab 793471
    ("gpt", ()): (_gpt_params(), (160e6, 165e6)),                 # untied head
    ("gpt", (("tied", True),)): (124_439_808, (124e6, 125e6)),    # GPT-2 small
}


@pytest.mark.parametrize("name,overrides", list(FULL), ids=[f"{n}{dict(o)}" for n, o in FULL])
def test_full_size_parameter_counts(name, overrides):
    exact, (lo, hi) = FULL[(name, overrides)]
    n = models.count_params(models.get_model(name, "full", **dict(overrides)))
    assert n == exact and lo <= n <= hi


def test_per_layer_counts_sum_to_the_total():
    spec = models.get_model("gpt", "full")
    per_layer = models.count_params(spec, per_layer=True)
    assert len(per_layer) == len(spec.layers) == 14
    assert sum(per_layer) == models.count_params(spec)
    assert per_layer[0] == 50257 * 768 + 1024 * 768


# --- errors and the registry --------------------------------------------------------
@pytest.mark.parametrize("call,match", [
    (lambda: models.get_model("resnet"), "inception_v3"),
    (lambda: models.get_model("gpt", size="huge"), "tiny"),
    (lambda: models.get_model("gnmt", "tiny", hiden=8), "hidden"),
    (lambda: models.get_model("inception_v3", "tiny", image_size=64), "75"),
    (lambda: models.get_model("inception_v3", "tiny", aux_head=True), "139"),
    (lambda: models.get_model("gpt", "tiny", num_heads=3), "divisible"),
    (lambda: models.get_model("gpt", "tiny", seq_len=128), "max_positions"),
    (lambda: models.get_model("biglstm", "tiny", num_sampled=10_000), "num_sampled"),
    (lambda: models.get_model("gnmt", "tiny", encoder_layers=1), "encoder_layers"),
    (lambda: models.register_model("gpt", lambda size: None), "already"),
])
def test_bad_requests_name_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_register_model_adds_a_buildable_model(monkeypatch):
    monkeypatch.setattr(models, "_BUILDERS", dict(models._BUILDERS))   # undone after
    models.register_model("gpt_wide", lambda size, **o: models.gpt.build(size, d_model=64,
                                                                          **o))
    spec = models.get_model("gpt_wide", "tiny")
    assert "gpt_wide" in models.registered_models() and spec.config["d_model"] == 64
    assert models.MODEL_NAMES == ("inception_v3", "gnmt", "biglstm", "gpt")


def test_inception_aux_head_scales_with_width():
    # AuxHead at width w: 1x1 conv c(128), 5x5 conv c(768) (each + BatchNorm scale/bias),
    # then the classifier; every channel count scales with the width like the rest.
    w, classes = 0.125, 10
    c = lambda n: max(1, int(round(n * w)))
    kw = dict(image_size=139, width=w, num_classes=classes)
    with_aux = models.count_params(models.get_model("inception_v3", "tiny", aux_head=True, **kw))
    without = models.count_params(models.get_model("inception_v3", "tiny", **kw))
    aux = (c(768) * c(128) + 2 * c(128) + c(128) * 25 * c(768) + 2 * c(768)
           + c(768) * classes + classes)
    assert with_aux - without == aux


def test_gnmt_attention_vector_init_is_symmetric():
    spec, _, _, variables, *_ = _setup("gnmt")
    i = next(i for i, l in enumerate(spec.layers)
             if type(l).__name__ == "AttentionDecoderLayer")
    v = np.asarray(variables[i]["params"]["BahdanauAttention_0"]["v"])
    bound = 1 / np.sqrt(spec.config["hidden"])
    assert v.min() < 0 < v.max() and np.all(np.abs(v) <= bound)


def test_docs_add_a_model_example_runs(monkeypatch):
    import pathlib
    import re
    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S)
                 if "register_model(" in b)
    monkeypatch.setattr(models, "_BUILDERS", dict(models._BUILDERS))
    scope = {}
    exec(block, scope)
    spec = scope["spec"]
    x, y = spec.sample_batch(4)
    out, _ = spec.apply(spec.init(jax.random.key(0), x), x)
    assert out.shape == (4, 10) and np.isfinite(float(spec.loss_fn(out, y)))
    assert models.count_params(spec) == 32 * 8 + 8 + 8 * 10 + 10


def test_gpt_refuses_sequences_longer_than_its_positions():
    # A config's seq_len over the size's max_positions failed as "Incompatible shapes for
    # broadcasting", naming neither.
    spec = models.get_model("gpt", "tiny")
    tokens = jnp.zeros((2, spec.config["max_positions"] + 1), jnp.int32)
    with pytest.raises(ValueError, match=r"sequences of 65 tokens, but the model has "
                                         r"max_positions=64.*data.options.seq_len <= 64"):
        spec.layers[0].init(jax.random.key(0), tokens)


@pytest.mark.parametrize("aux", [False, True])
def test_classification_losses_ignore_padding_labels_on_any_layout(aux):
    # Labels -1 (padding) bunched in some microbatches: the loss was a mean of the
    # microbatches' masked means, 4x too small at data x M = 4 (an all-padding microbatch
    # counted 0); it is the batch's mean over its labelled examples on every layout.
    import jaxhybrid as jh
    from jaxhybrid import pipeline as jp
    from jaxhybrid.models.inception import _Loss
    layers = [nn.Dense(8), nn.Dense(5)]
    if aux:
        class TwoHeads(nn.Module):
            @nn.compact
            def __call__(self, x):
                return {"logits": nn.Dense(5)(x), "aux_logits": nn.Dense(5)(x)}
        layers = [nn.Dense(8), TwoHeads()]
    loss_fn = _Loss(0.3) if aux else models.spec.classification_loss
    rs = np.random.RandomState(0)
    x = jnp.asarray(rs.randn(16, 6), jnp.float32)
    labels = jnp.asarray(np.r_[rs.randint(0, 5, 4), -np.ones(12, int)], jnp.int32)
    ref_pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=1), num_microbatches=1)
    per_layer = ref_pipe.unpack(ref_pipe.init(jax.random.key(0), x))

    def whole(params):
        h = x
        for layer, p in zip(layers, params):
            h = layer.apply({"params": p}, h)
        heads = [(h["logits"], 1.0), (h["aux_logits"], 0.3)] if aux else [(h, 1.0)]
        keep = labels >= 0
        nll = lambda z: -jnp.take_along_axis(jax.nn.log_softmax(z), jnp.where(
            keep, labels, 0)[:, None], 1)[:, 0]
        return sum(w * jnp.sum(nll(z) * keep) for z, w in heads) / keep.sum()
    want, g_want = jax.value_and_grad(whole)([v["params"] for v in per_layer])
    for data, pipe_size, M in [(2, 1, 2), (4, 1, 1), (1, 2, 4)]:
        pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=data, pipe=pipe_size),
                           num_microbatches=M, boundaries=[1][:pipe_size - 1])
        v = pipe.pack(per_layer)
        loss, g, _ = pipe.value_and_grad(loss_fn)(v, x, labels)
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
        for a, b in zip(jax.tree.leaves([v["params"] for v in pipe.unpack(g)]),
                        jax.tree.leaves(g_want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
