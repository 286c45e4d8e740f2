"""plan.profile on a small heterogeneous layer list: XLA FLOPs, exact byte counts,
residual memory with and without recomputation, measured times, serialisation, errors."""
import dataclasses
import os
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid.pipeline import backward
from jaxhybrid.plan import LayerCost, cost_arrays, layer_times, profile

B, T, VOCAB, EMB, CONV, HID, CLASSES = 4, 8, 50, 16, 24, 64, 10
F32 = 4


class Embed(nn.Module):
    """int tokens [B, T] -> [B, T, EMB] (no input gradient: integer input)."""
    @nn.compact
    def __call__(self, ids):
        return nn.Embed(VOCAB, EMB)(ids)


class Conv(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Conv(CONV, (3,))(x))


class Norm(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)


class Dense(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features)(x)


class Head(nn.Module):
    """Loss-like head: mean over time, logits, log-softmax."""
    @nn.compact
    def __call__(self, x):
        return jax.nn.log_softmax(nn.Dense(CLASSES)(x.mean(axis=1)))


LAYERS = [Embed(), Conv(), Norm(), Dense(HID), Dense(HID), Head()]
IDS = np.arange(B * T, dtype=np.int32).reshape(B, T) % VOCAB


@pytest.fixture(scope="module")
def costs():
    return profile(LAYERS, IDS)


def test_one_cost_per_layer_with_names(costs):
    assert [c.name for c in costs] == ["Embed_0", "Conv_1", "Norm_2", "Dense_3", "Dense_4", "Head_5"]
    assert all(c.batch_size == B and not c.measured for c in costs)


def test_flops_positive_and_backward_about_twice_forward(costs):
    for c in costs[1:]:   # the embedding gather has no multiply-adds worth counting
        assert c.fwd_flops > 0 and c.bwd_flops > 0, c.name
    for c, fan_in in zip(costs[3:5], (CONV, HID)):   # dense: input + weight grads = 2 x fwd
        assert c.fwd_flops == pytest.approx(2 * B * T * fan_in * HID, rel=0.05)
        assert c.bwd_flops == pytest.approx(2 * c.fwd_flops, rel=0.05)
    conv = costs[1]
    # 3-tap 'SAME' conv: XLA skips the multiply-adds with the zero padding at both ends.
    assert conv.fwd_flops == pytest.approx(2 * B * (3 * T - 2) * EMB * CONV, rel=0.05)
    assert conv.bwd_flops == pytest.approx(2 * conv.fwd_flops, rel=0.2)


def test_param_and_state_bytes_exact(costs):
    expect_params = [VOCAB * EMB, 3 * EMB * CONV + CONV, 2 * CONV, HID * CONV + HID,
                     HID * HID + HID, HID * CLASSES + CLASSES]
    assert [c.param_count for c in costs] == expect_params
    assert [c.param_bytes for c in costs] == [F32 * n for n in expect_params]
    assert costs[2].state_bytes == F32 * 2 * CONV                   # BatchNorm mean + var
    assert [c.state_bytes for i, c in enumerate(costs) if i != 2] == [0] * 5


def test_activation_bytes_exact(costs):
    outs = [B * T * EMB, B * T * CONV, B * T * CONV, B * T * HID, B * T * HID, B * CLASSES]
    assert [c.out_bytes for c in costs] == [F32 * n for n in outs]
    assert costs[0].in_bytes == IDS.nbytes
    assert [c.in_bytes for c in costs[1:]] == [c.out_bytes for c in costs[:-1]]
    # Recomputation keeps only the layer input.
    assert [c.saved_bytes_remat for c in costs] == [c.in_bytes for c in costs]


def test_recompute_keeps_less_than_saving_residuals(costs):
    for c in costs[1:5]:   # conv + relu, batch norm, dense keep more than their input
        assert c.saved_bytes > 0
    for c in (costs[1], costs[2]):
        assert c.saved_bytes_remat < c.saved_bytes, c.name
    # Dense keeps its input (same size as the remat input) and no parameters.
    assert costs[3].saved_bytes == costs[3].in_bytes


def _compiled_residual_bytes(layer, x, remat=False):
    """Bytes of the non-parameter vjp residuals the pipeline stashes, read from XLA's
    memory_analysis of a compiled function that returns them (checkpointed: what
    jax.checkpoint keeps)."""
    params = layer.init(jax.random.key(0), x)["params"]

    def residuals(p, xx):
        fn = lambda p_, x_: layer.apply({"params": p_}, x_)  # noqa: E731
        _, vjp_fn = jax.vjp(jax.checkpoint(fn) if remat else fn, p, xx)
        known = jax.tree.leaves(p)
        return [l for l in jax.tree.leaves(vjp_fn) if not any(l is q for q in known)]

    # Those the pipeline's backward recomputes cheaply from the others are not stashed.
    closed = jax.make_jaxpr(residuals)(params, x)
    keep = backward.Derivation.of(closed, closed.jaxpr.outvars).stash
    stashed = lambda p, xx: [residuals(p, xx)[i] for i in keep]  # noqa: E731

    outs = jax.eval_shape(stashed, params, x)
    ma = jax.jit(stashed).lower(params, x).compile().memory_analysis()
    return ma.output_size_in_bytes, len(outs)


@pytest.mark.parametrize("index", [1, 3, 5])
def test_saved_bytes_agree_with_compiled_memory_analysis(costs, index):
    # Layers past the first are differentiated w.r.t. their float input as well, as here.
    shapes = {1: (B, T, EMB), 3: (B, T, CONV), 5: (B, T, HID)}
    x = np.ones(shapes[index], np.float32)
    c = costs[index]
    for remat, expect in ((False, c.saved_bytes), (True, c.saved_bytes_remat)):
        nbytes, n_out = _compiled_residual_bytes(LAYERS[index], x, remat)
        # XLA adds an 8-byte pointer per element of a tuple result.
        assert expect <= nbytes <= expect + 8 * n_out * (n_out > 1), (c.name, remat)


def test_roofline_times_follow_the_peaks():
    c = profile(LAYERS[3:5], np.ones((B, T, CONV), np.float32), peak_flops=1e9, memory_bandwidth=1e15)
    for x in c:
        assert x.fwd_time == pytest.approx(x.fwd_flops / 1e9)
        assert x.bwd_time == pytest.approx(x.bwd_flops / 1e9)
    np.testing.assert_allclose(layer_times(c), [x.fwd_time + x.bwd_time for x in c])


@pytest.mark.parametrize("timing", ["alone", "loop"])
def test_measure_gives_positive_times(timing):
    c = profile(LAYERS[2:4], np.ones((B, T, CONV), np.float32), measure=True, repeats=1,
                timing=timing)
    assert all(x.measured and x.fwd_time > 0 and x.bwd_time > 0 for x in c)
    cores = os.cpu_count() or 1
    assert all(1.0 <= t <= cores for x in c for t in (x.fwd_threads, x.bwd_threads))


def test_threads_are_cpu_over_wall_seconds_beyond_the_calls_own():
    """A layer's cores busy: its CPU seconds beyond a no-op call's over its wall seconds
    beyond them, between 1 and the host's cores (a small layer timed below its call's
    overhead, or a process that burnt no CPU: 1)."""
    from jaxhybrid.plan.layer_timing import _Timing, threads
    base = _Timing(1e-5, 1e-4, 1e-4)
    cores = os.cpu_count() or 1
    busy = _Timing(1e-4, 1e-3, 1e-4 + min(cores, 2) * 9e-4)
    assert threads(busy, base) == pytest.approx(min(cores, 2))
    assert threads(_Timing(1e-4, 1e-3, 1e-4 + 100 * 9e-4), base) == cores   # clipped
    assert threads(_Timing(1e-5, 1e-4, 5e-5), base) == 1.0    # no work beyond the call
    assert threads(_Timing(1e-4, 1e-3, 5e-4), base) == 1.0    # below one core: one


def test_split_backward_values_by_hand(costs):
    # Split as the engine splits a backward into B (input gradient) and W (weight
    # gradient): W of a Dense reads its input (a residual) and the output's cotangent,
    # which B hands over (a crossing value); W of relu(Conv) the cotangent past the relu,
    # which B computes; the embedding (integer input, no B) reads the token ids and gets
    # the output's cotangent.
    embed, conv, _, dense = costs[:4]
    assert dense.cross_by_dtype == {"float32": B * T * HID * F32}
    assert dense.weight_saved_by_dtype == {"float32": B * T * CONV * F32}
    assert conv.cross_by_dtype == {"float32": B * T * CONV * F32}
    assert conv.weight_saved_by_dtype == {"float32": B * T * EMB * F32}
    assert embed.cross_by_dtype == {"float32": B * T * EMB * F32}
    assert embed.weight_saved_by_dtype == {"int32": B * T * 4}
    twice = dense.scaled(2 * B)
    assert twice.cross_by_dtype == {"float32": 2 * B * T * HID * F32}
    assert twice.weight_saved_by_dtype == {"float32": 2 * B * T * CONV * F32}


def test_dict_round_trip_and_scaling(costs):
    for c in costs:
        d = c.to_dict()
        assert set(d) == {f.name for f in dataclasses.fields(LayerCost)}
        assert LayerCost.from_dict(d) == c
    twice = costs[3].scaled(2 * B)
    assert twice.fwd_flops == 2 * costs[3].fwd_flops and twice.out_bytes == 2 * costs[3].out_bytes
    assert twice.param_bytes == costs[3].param_bytes and twice.batch_size == 2 * B
    arr = cost_arrays(costs)
    np.testing.assert_array_equal(arr["param_bytes"], [c.param_bytes for c in costs])


def test_given_variables_and_names():
    x = np.ones((B, T, CONV), np.float32)
    v = [jax.tree.map(jnp.zeros_like, LAYERS[3].init(jax.random.key(0), x))]
    (c,) = profile(LAYERS[3:4], x, variables=v, names=["fc"])
    assert c.name == "fc" and c.param_bytes == F32 * (HID * CONV + HID)


@pytest.mark.parametrize("args, kwargs, match", [
    (([], IDS), {}, "layers is empty"),
    ((LAYERS[:2], IDS), {"names": ["a"]}, "1 names for 2 layers"),
    ((LAYERS[:2], IDS), {"variables": [{}]}, "1 variable dicts for 2 layers"),
    ((LAYERS[:1], np.float32(1.0)), {}, "batch dimension"),
    ((LAYERS[:1], IDS), {"timing": "scan"}, "use 'alone' or 'loop'"),
])
def test_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        profile(*args, **kwargs)


def test_scaled_rejects_bad_batch(costs):
    with pytest.raises(ValueError, match="batch_size=0"):
        costs[0].scaled(0)


def test_gpu_flops_count_the_convolutions(monkeypatch):
    # A GPU's compiled module calls cuDNN for convolutions, and its cost analysis left
    # their FLOPs out (an H200 profiled Inception-V3 at 1/22 of its FLOPs): there the
    # FLOPs are at least the jaxpr's matmuls and convolutions; the bytes stay the
    # compiled (fused) module's.
    from jaxhybrid.plan import costs as plan_costs
    conv = nn.Conv(8, (3, 3))
    x = jnp.ones((2, 16, 16, 4))
    v = conv.init(jax.random.key(0), x)
    traced = jax.jit(conv.apply).trace(v, x)
    library_call = types.SimpleNamespace(cost_analysis=lambda: {"flops": 0.0,
                                                                 "bytes accessed": 123.0})
    real = plan_costs._compile(traced.lower(), False)        # XLA's own count on CPU
    monkeypatch.setattr(plan_costs, "_platform", lambda compiled: "gpu")
    flops, nbytes = plan_costs.flops_and_bytes(traced, library_call)
    assert nbytes == 123.0 and flops == pytest.approx(plan_costs.xla_cost(real)[0], rel=0.02)
    monkeypatch.setattr(plan_costs, "_platform", lambda compiled: "cpu")
    assert plan_costs.flops_and_bytes(traced, library_call) == (0.0, 123.0)


def test_a_scanned_layer_counts_every_iteration():
    # XLA's cost analysis counts a loop's body once: an LSTM over 10 steps was profiled
    # at one step's matmuls (biglstm tiny: 2.3 of 3.4 MFLOPs).
    from jaxhybrid.plan import costs as plan_costs
    h, w = jnp.ones((8, 64)), jnp.ones((64, 64))

    def recurrent(n):
        return lambda h, w: jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), h, None,
                                         length=n)[0]
    flops = []
    for n in (1, 10):
        traced = jax.jit(recurrent(n)).trace(h, w)
        flops.append(plan_costs.flops_and_bytes(traced, plan_costs._compile(traced.lower(),
                                                                            False))[0])
    assert flops[0] >= 2 * 8 * 64 * 64
    assert flops[1] == pytest.approx(10 * flops[0], rel=0.02)


@pytest.mark.parametrize("conv", [
    nn.Conv(8, (3, 3)), nn.Conv(8, (7, 7), strides=2), nn.Conv(8, (3, 3), kernel_dilation=2),
    nn.Conv(8, (3, 3), input_dilation=2, padding=((1, 1), (1, 1))),
    nn.ConvTranspose(8, (4, 4), strides=(4, 4))], ids=["same", "strided", "dilated",
                                                    "input-dilated", "transposed"])
def test_jaxpr_counts_a_convolutions_taps_as_xla_does(conv):
    # The jaxpr count (a GPU's FLOPs, where cuDNN hides the convolutions from XLA) counts
    # no tap on padding or on the zeros between a dilated input's elements: a strided
    # convolution's input gradient (one such) was ~s^d times too dear, a 4x4-strided
    # transposed one 16x.
    from jaxhybrid.models.spec import _jaxpr_flops
    from jaxhybrid.plan import costs as plan_costs
    x = jnp.ones((2, 17, 17, 16))
    v = conv.init(jax.random.key(0), x)
    grad = jax.grad(lambda v, x: jnp.sum(conv.apply(v, x) ** 2), argnums=(0, 1))
    traced = jax.jit(grad).trace(v, x)
    xla = plan_costs.xla_cost(plan_costs._compile(traced.lower(), False))[0]
    assert 0.94 * xla <= _jaxpr_flops(traced.jaxpr.jaxpr) <= xla     # xla: + bias, squares


@pytest.mark.parametrize("unroll", [1, 2, 3, True])
def test_an_unrolled_scan_is_counted_once_per_iteration(unroll):
    # XLA's loop body holds `unroll` copies (the remainder outside): counting one there
    # added (unroll - 1) iterations too many (a fully unrolled scan ~2x).
    from jaxhybrid.plan import costs as plan_costs
    h, w = jnp.ones((8, 64)), jnp.ones((64, 64))
    f = lambda h, w: jax.lax.scan(lambda c, _: (c @ w, None), h, None, length=8,  # noqa: E731
                                  unroll=unroll)[0]
    traced = jax.jit(f).trace(h, w)
    flops = plan_costs.flops_and_bytes(traced, plan_costs._compile(traced.lower(), False))[0]
    assert flops == pytest.approx(8 * 2 * 8 * 64 * 64, rel=0.01)
