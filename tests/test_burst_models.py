"""DeepPool's workloads in the model zoo: VGG-16 and the wide ResNet (torchvision's
parameter counts at full size, from shapes only; tiny sizes run forward and backward)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid import models

FAST_COMPILE = {"xla_backend_optimization_level": 0}


@pytest.mark.parametrize("name, params, layers", [("vgg16", 138_357_544, 16),
                                                  ("wrn", 126_886_696, 35)])
def test_full_size_matches_torchvision(name, params, layers):
    spec = models.get_model(name, "full")
    assert models.count_params(spec) == params
    assert len(spec.layers) == layers
    assert name in models.registered_models() and name not in models.MODEL_NAMES


@pytest.mark.parametrize("name", ["vgg16", "wrn"])
def test_tiny_trains(name):
    spec = models.get_model(name, "tiny")
    x, y = spec.sample_batch(4)
    variables = spec.init(jax.random.key(0, impl="rbg"), x[:2])

    def loss(params, rng):
        out, new_vars = spec.apply([{**v, "params": p} for v, p in zip(variables, params)], x,
                                   train=True, rng=rng)
        return spec.loss_fn(out, y), (out, new_vars)

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True), compiler_options=FAST_COMPILE)
    (value, (out, new_vars)), grads = fn([v["params"] for v in variables], jax.random.PRNGKey(1))
    assert out.shape == (4, spec.config["num_classes"]) and np.isfinite(float(value))
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    assert sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads)) > 0
    if name == "wrn":      # BatchNorm statistics move in training
        before = jax.tree.leaves([v.get("batch_stats") for v in variables])
        after = jax.tree.leaves([v.get("batch_stats") for v in new_vars])
        assert any(float(jnp.abs(a - b).max()) > 0 for a, b in zip(after, before))


def test_bad_options():
    with pytest.raises(ValueError, match="multiple of 32"):
        models.get_model("vgg16", "tiny", image_size=40)
    with pytest.raises(ValueError, match="four positive counts"):
        models.get_model("wrn", "tiny", blocks=(1, 1, 1))
    with pytest.raises(ValueError, match="unknown option"):
        models.get_model("wrn", "tiny", depth=10)
    for rate in (1.5, -0.1, "0.1"):      # 1.5 trained silently
        with pytest.raises(ValueError, match=r"gpt: dropout_rate=.* must be a number in \[0, 1\)"):
            models.get_model("gpt", "tiny", dropout_rate=rate)
    assert models.get_model("gpt", "tiny", dropout_rate=0.0) is not None
    # Wrong types and signs: tracebacks from inside the model or the planner before.
    for name, option, need in [
            ("gpt", {"num_layers": "x"}, r"num_layers='x' must be an int >= 1"),
            ("gpt", {"d_model": -4}, r"d_model=-4 must be an int >= 1"),
            ("biglstm", {"vocab_size": 0}, r"vocab_size=0 must be an int >= 1"),
            ("gpt", {"tied": 1}, r"tied=1 must be True or False"),
            ("gpt", {"dtype": "int8"}, r"dtype='int8' must be a float dtype name"),
            ("gnmt", {"pad_id": -1}, r"pad_id=-1 must be an int >= 0 or None"),
            ("inception_v3", {"width": 0.0}, r"width=0.0 must be a finite number > 0"),
            ("inception_v3", {"bn_momentum": 1.0}, r"bn_momentum=1.0 must be a number in"),
            ("inception_v3", {"aux_weight": -1.0}, r"aux_weight=-1.0 must be a number >= 0")]:
        with pytest.raises(ValueError, match=rf"{name}: {need}"):
            models.get_model(name, "tiny", **option)
    for name, option in [("gpt", {"dtype": "bfloat16", "pad_id": None, "tied": True}),
                         ("biglstm", {"num_sampled": 0}), ("inception_v3", {"width": 1})]:
        assert models.get_model(name, "tiny", **option) is not None
