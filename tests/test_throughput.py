"""The speed fields of the training records: a pipeline's model FLOPs per step (from the
layers' profiled costs) and `metrics.throughput` (examples/s, model TFLOP/s, MFU)."""
import types

import flax.linen as nn
import jax.numpy as jnp
import pytest

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from jaxhybrid.metrics import throughput

WIDTHS = (48, 64, 32, 16)


def dense_pipeline():
    layers = [nn.Dense(w) for w in WIDTHS[1:]]
    return jp.Pipeline(layers, mesh=jh.make_mesh(data=2, pipe=2), num_microbatches=2)


def test_model_flops_count_forward_and_backward_of_every_layer():
    pipe = dense_pipeline()
    with pytest.raises(ValueError, match="make_plan"):
        pipe.model_flops(8)
    pipe.make_plan(jnp.ones((16, WIDTHS[0])))
    matmul = sum(2 * a * b for a, b in zip(WIDTHS[:-1], WIDTHS[1:]))   # per example
    # Forward one matmul per layer, backward two (the input's and the weight's
    # gradients) but none for the data's gradient, plus bias adds; recomputation is
    # never counted.
    matmuls = 3 * matmul - 2 * WIDTHS[0] * WIDTHS[1]
    flops = pipe.model_flops(8)
    assert matmuls * 8 <= flops <= 1.05 * matmuls * 8
    assert pipe.model_flops(32) == pytest.approx(4 * flops)   # linear in the rows


def _device(platform, kind):
    return types.SimpleNamespace(platform=platform, device_kind=kind)


def test_throughput_fields():
    gpus = [_device("gpu", "NVIDIA H200")] * 2
    out = throughput(4.0, 64, 1e12, gpus)
    assert out["examples_per_sec"] == 256.0
    assert out["model_tflops"] == pytest.approx(4.0)
    assert out["mfu"] == pytest.approx(4e12 / (2 * 989e12))
    cpu = throughput(4.0, 64, 1e12, [_device("cpu", "cpu")] * 8)
    assert "mfu" not in cpu and cpu["model_tflops"] == pytest.approx(4.0)
    assert throughput(4.0, 64, None, gpus) == {"examples_per_sec": 256.0}


class _DenseStack(nn.Module):
    """The dense pipeline's layers as one module, for the splitter to cut."""
    @nn.compact
    def __call__(self, x):
        for w in WIDTHS[1:]:
            x = nn.Dense(w)(x)
        return x


def test_a_split_model_counts_the_same_flops_as_its_layers():
    # The splitter priced a linear piece's backward one forward short (jit dropped the
    # forward its backward does not read): a split GPT tiny counted 1.24 of 2.34 MFLOPs
    # of backward per row.
    sample = jnp.ones((16, WIDTHS[0]))
    layers = dense_pipeline()
    layers.make_plan(sample)
    split = jp.Pipeline(_DenseStack(), mesh=jh.make_mesh(data=2, pipe=2), num_microbatches=2)
    split.make_plan(sample)
    assert split.model_flops(8) == pytest.approx(layers.model_flops(8), rel=0.02)
