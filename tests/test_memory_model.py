"""The planner's memory model against the compiled step: the bytes per device it
predicts for a real model at S=4 are within 10% of XLA's `memory_analysis()` of the
training step `scripts/train.py` runs (tiny BigLSTM: LSTM backward temporaries, the
loss's residuals and per-dtype stash padding all count), with 1F1B and with a split
backward (zb-h1: B's second residual row; tiny GPT: the cross ring)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from jaxhybrid.bench import memory_bench


@pytest.fixture(scope="module")
def biglstm():
    return memory_bench.compare(memory_bench.model_config("biglstm", "tiny", 4), "train")


def test_predicted_device_memory_within_10_percent_of_compiled(biglstm):
    r = biglstm
    assert r["pipe"] == 4 and r["compiled"] > 0
    assert sum(r["terms"].values()) == pytest.approx(r["predicted"])
    assert abs(r["error"]) <= 0.10, (r["predicted"], r["compiled"], r["terms"])


@pytest.fixture(scope="module")
def biglstm_zb():
    config = memory_bench.model_config("biglstm", "tiny", 4, schedule="zb-h1")
    assert config.pipeline.schedule == "zb-h1"
    return memory_bench.compare(config, "train")


def test_split_backward_memory_within_10_percent_of_compiled(biglstm, biglstm_zb):
    # zb-h1 compiles to more than 1F1B (B writes W's cotangents into a copy of the row it
    # reads); without that row the model was 18% under.
    r = biglstm_zb
    assert r["schedule"] == "zb-h1" and r["compiled"] > biglstm["compiled"]
    assert r["terms"]["working"] - biglstm["terms"]["working"] == pytest.approx(r["model_row"])
    assert abs(r["error"]) <= 0.10, (r["predicted"], r["compiled"], r["terms"])


def test_terms_match_the_runtime_buffers(biglstm):
    # The parameter buffer is sized for the device with the most parameters; the stash
    # row (residuals, padded per dtype) for the stage with the most residuals.
    r = biglstm
    assert r["terms"]["params"] == pytest.approx(r["param_buffer"], rel=0.02)
    assert r["model_row"] == pytest.approx(r["residual_row"], rel=0.05)
    assert r["terms"]["opt_state"] == pytest.approx(2 * r["terms"]["params"])


@pytest.fixture(scope="module")
def gpt_zb():
    return memory_bench.compare(memory_bench.model_config("gpt", "tiny", 4, schedule="zb-h1"),
                                "train")


def test_split_backward_cross_ring_is_priced(gpt_zb):
    # GPT's blocks hand W more cotangents than the residuals W no longer reads leave room
    # for in the stash row: the runtime puts the rest in a cross ring (4 x 32KB here).
    # Without it the model was 11.1% under the compiled step.
    r = gpt_zb
    assert r["cross_ring"] > 0
    assert r["terms"]["cross"] == pytest.approx(r["cross_ring"], rel=0.1)
    assert abs(r["error"]) <= 0.10, (r["predicted"], r["compiled"], r["terms"])


def test_recomputed_split_backward_needs_no_cross_ring():
    # Every layer recomputed (each under its own jax.checkpoint, as the planner's choices
    # run): a row holds the layer's input alone, and W's values are mostly made again by
    # B's recomputation; GPT's runtime has no cross ring. Counting the recomputed layers'
    # crossing values and W's residuals as crossing predicted 502KB of ring (+47%).
    r = memory_bench.compare(memory_bench.model_config("gpt", "tiny", 4, schedule="zb-h1"),
                             "train", remat="layers")
    assert r["cross_ring"] == 0 and r["terms"]["cross"] == 0
    assert abs(r["error"]) <= 0.10, (r["predicted"], r["compiled"], r["terms"])


class _DenseTanh(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(256)(x))


def _cross_rings(layers, x, y, pipe_size, boundaries, remat):
    """(the runtime's zb-h1 cross ring, the memory model's) in bytes."""
    from jaxhybrid.pipeline.planning import profile_cached
    from jaxhybrid.plan.memory_model import memory_terms
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=pipe_size,
                                                 devices=jax.devices()[:pipe_size]),
                       num_microbatches=4, schedule="zb-h1", boundaries=boundaries, remat=remat)
    pipe.init(jax.random.key(0), x)
    lay = pipe._layouts(pipe._microbatch(x, "inputs"), pipe._microbatch(y, "targets"),
                        lambda o, t: jnp.mean((o - t) ** 2), True, None)
    ring = pipe.schedule.ring_slots()[1]["cross"] * memory_bench._nbytes(lay.cross_len)
    return ring, memory_terms(profile_cached(pipe.layers, pipe._sample), pipe.boundaries,
                              pipe.schedule, remat if isinstance(remat, list) else None)["cross"]


@pytest.mark.parametrize("remat", [[True, False] * 3, [True] * 6])
def test_recomputed_layers_weight_gradients_cross_to_w(remat):
    # A recomputed layer's backward is one jax.checkpoint equation B runs whole: its
    # parameter gradients cross to W, and with kernels larger than its row (the input)
    # they go to the cross ring (1.57MB here). The model said 0, and zb-h1 plans it
    # called within a budget compiled 22-29% over it. Then it counted bytes into the
    # row's free space (0.26 and 1.05MB): the runtime places whole values, and a kernel's
    # gradient fits into none of the dead 65KB activations.
    ring, predicted = _cross_rings([_DenseTanh() for _ in range(6)], jnp.ones((256, 256)),
                                   jnp.zeros((256, 256)), 2, [3], remat)
    assert ring >= 2 * 256 * 256 * 4            # two slots of a kernel's gradient or more
    assert predicted == pytest.approx(ring, rel=0.02)


class _DenseGelu(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.gelu(nn.Dense(self.width)(x))


def test_the_first_stages_cotangent_crosses_whole():
    # The first stage's input is not differentiated: its W runs the whole backward and
    # reads every residual, and its output's cotangent (262KB here) crosses to W. The
    # model counted the stage's per-layer splits (as if B made an input gradient) and
    # priced the ring at 0; a budget between its 8.4MB and the compiled 10.1MB was
    # accepted and missed by up to 21%.
    layers = [_DenseGelu(w) for w in (32, 256, 256, 32, 64, 128, 32)] + [nn.Dense(8)]
    ring, predicted = _cross_rings(layers, jnp.ones((32, 32, 32)), jnp.zeros((32, 32, 8)), 4,
                                   [2, 3, 5], "none")
    assert ring >= 4 * 8 * 32 * 256 * 4          # four slots of the 256-wide cotangent
    assert predicted == pytest.approx(ring, rel=0.02)


class _TanhMLP(nn.Module):
    """One module (the splitter cuts it into pieces): 8 x Dense(256) + tanh and a head."""
    @nn.compact
    def __call__(self, x):
        for _ in range(8):
            x = jnp.tanh(nn.Dense(256)(x))
        return nn.Dense(10)(x)


class _Tanh(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(x)


def _split_model_memory(model, x, y, loss_fn, schedule="1f1b"):
    """(predicted bytes per device, compiled bytes, the model's stash row, the runtime's)
    of a split model's value_and_grad step at pipe 4, M=4, from the planner's own piece
    costs (`Pipeline._layer_costs`, what `make_plan` and remat='auto' read)."""
    from jaxhybrid.plan.memory_model import memory_terms
    pipe = jp.Pipeline(model, mesh=jh.make_mesh(data=1, pipe=4, devices=jax.devices()[:4]),
                       num_microbatches=4, schedule=schedule)
    variables = pipe.init(jax.random.key(0), x)
    costs = pipe._layer_costs()
    terms = memory_terms(costs, pipe.boundaries, pipe.schedule, None,
                         param_state_factor=2)
    ma = pipe.value_and_grad(loss_fn).lower(variables, x, y, jax.random.key(1)).compile() \
        .memory_analysis()
    compiled = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                - ma.alias_size_in_bytes)
    lay = pipe._layouts(pipe._microbatch(x, "inputs"), pipe._microbatch(y, "targets"),
                        loss_fn, True, None)
    rows = pipe.schedule.ring_slots()[1]["stash"]
    return (sum(terms.values()), compiled, terms["stash"] / rows,
            memory_bench._nbytes(lay.res_len), costs)


@pytest.mark.parametrize("as_list", [False, True], ids=["one module", "layer list"])
def test_a_split_models_pieces_stash_what_the_stage_stashes(as_list):
    # A piece's residuals were every float value it computes, and a tanh's output, which
    # the next piece's matmul also keeps, was counted by both: GPT small as one module
    # was predicted at 189MB per device against 54MB compiled, and a budget made the
    # planner recompute where nothing needed it. Now each piece's vjp is traced as the
    # engine's (parameters and cheap values left out) and a value two pieces stash counts
    # once. The same for a layer list with tanh as a layer of its own (row 82.6KB
    # predicted, 49.9KB in the runtime).
    x, y = jnp.ones((64, 256)), jnp.zeros((64,), jnp.int32)
    loss = lambda o, t: optax.softmax_cross_entropy_with_integer_labels(o, t).mean()  # noqa: E731
    model = ([m for _ in range(8) for m in (nn.Dense(256), _Tanh())] + [nn.Dense(10)]
             if as_list else _TanhMLP())
    predicted, compiled, row, runtime_row, costs = _split_model_memory(model, x, y, loss)
    assert any(c.shared_residuals for c in costs)
    assert row == pytest.approx(runtime_row, rel=0.05)
    assert abs(predicted / compiled - 1) <= 0.10, (predicted, compiled)


def test_a_split_transformer_is_predicted_within_15_percent():
    # +11.5%: the stage's one trace recomputes cheaply some values that the pieces,
    # traced apart, stash (row 258KB against the runtime's 194KB). It was +49%.
    from jaxhybrid import models
    spec = models.get_model("gpt", "tiny", tied=True)
    x, y = spec.sample_batch(16)
    predicted, compiled, *_ = _split_model_memory(models.module("gpt", "tiny", tied=True),
                                                  x, y, spec.loss_fn)
    assert -0.05 <= predicted / compiled - 1 <= 0.15, (predicted, compiled)


class _ConvBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        for c in (16, 32, 32):
            x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(c, (3, 3))(x)))
        return nn.Dense(8)(x.reshape(x.shape[0], -1))


def test_a_split_conv_nets_backward_temporaries_are_counted():
    # Its pieces' backward temporaries are about a residual row: counted as none, the
    # split was predicted 12% under the compiled step (a budget it called met was
    # missed). Each distinct piece's backward is now compiled for them.
    x = jax.random.normal(jax.random.key(0), (32, 12, 12, 3))
    y = jnp.zeros((32, 8))
    predicted, compiled, _, _, costs = _split_model_memory(
        _ConvBN(), x, y, lambda o, t: jnp.mean((o - t) ** 2))
    assert any(c.bwd_temp_bytes for c in costs)
    assert abs(predicted / compiled - 1) <= 0.10, (predicted, compiled)


def test_recomputed_pieces_keep_only_the_inputs_they_read():
    # A recomputed piece was priced as keeping every value it receives, also those it
    # only passes on (the residual stream around an attention block): GPT tiny with every
    # piece recomputed was predicted at 3.22MB against 2.09MB compiled (+54%).
    from jaxhybrid import models
    from jaxhybrid.plan.memory_model import memory_terms
    spec = models.get_model("gpt", "tiny", tied=True)
    model = models.module("gpt", "tiny", tied=True)
    x, y = spec.sample_batch(16)
    mesh = jh.make_mesh(data=1, pipe=4, devices=jax.devices()[:4])
    plain = jp.Pipeline(model, mesh=mesh, num_microbatches=4)
    plain.init(jax.random.key(0), x)
    every = [True] * len(plain.layers)
    pipe = jp.Pipeline(model, mesh=mesh, num_microbatches=4, remat=every, sample_inputs=x,
                       boundaries=plain.boundaries)
    variables = pipe.init(jax.random.key(0), x)
    costs = pipe._layer_costs()
    assert all(c.saved_bytes_remat <= c.in_bytes for c in costs)
    assert any(c.saved_bytes_remat < c.in_bytes for c in costs)
    predicted = sum(memory_terms(costs, pipe.boundaries, pipe.schedule, every,
                                 param_state_factor=2).values())
    ma = pipe.value_and_grad(spec.loss_fn).lower(variables, x, y, jax.random.key(1)).compile() \
        .memory_analysis()
    compiled = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                - ma.alias_size_in_bytes)
    assert 0.95 <= predicted / compiled <= 1.35, (predicted, compiled)
