"""Tensor parallelism ("model") and ZeRO ("data") on layers nobody here wrote: a
researcher's own Megatron-style layers built with `jaxhybrid.tensor_parallel`, with their
own logical names (or none), a whole-built annotated sub-layer inside a split layer,
batch statistics of split features, a gathered column-parallel head; exact against the
single-device reference (loss, gradients, state, `apply`)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from jaxhybrid import tensor_parallel as tp
from jaxhybrid.layers import apply_layer
from jaxhybrid.sharding import variable_split_dims

LP = nn.with_logical_partitioning
INIT = nn.initializers.lecun_normal()
SMALL = nn.initializers.normal(0.1)
RNG = jax.random.key(1)
VOCAB, WIDTH, HIDDEN = 13, 8, 16


class Embed(nn.Module):
    @nn.compact
    def __call__(self, ids):
        return nn.Embed(VOCAB, WIDTH, embedding_init=LP(SMALL, ("vocab", "embed")))(ids)


class GatedMLP(nn.Module):
    """Megatron MLP (column- then row-parallel) plus a gate that is an ordinary Flax Dense
    annotated "mlp" for GSPMD: built whole at every degree, so it must stay whole while
    the MLP's own kernels split."""
    @nn.compact
    def __call__(self, x):
        gate = nn.Dense(WIDTH, kernel_init=LP(INIT, ("embed", "mlp")), name="gate")(x)
        h = nn.Dense(tp.local(HIDDEN, "hidden"), kernel_init=LP(INIT, ("embed", "mlp")),
                     name="up")(tp.copy_to_model(x))
        down = self.param("down", LP(INIT, ("mlp", "embed")), (tp.local(HIDDEN, "hidden"), WIDTH))
        return x + tp.reduce_from_model(nn.gelu(h) @ down) + jnp.tanh(gate).mean(-1, keepdims=True)


class OwnNamesMLP(nn.Module):
    """Split with the researcher's own logical names ("d", "ffn"), and one kernel with no
    names at all: what the layer builds at 1 / T says what is split."""
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(tp.local(HIDDEN, "hidden"), kernel_init=LP(INIT, ("d", "ffn")),
                     bias_init=LP(SMALL, ("ffn",)))(tp.copy_to_model(x))
        down = self.param("down", INIT, (tp.local(HIDDEN, "hidden"), WIDTH))
        return x + tp.reduce_from_model(nn.gelu(h) @ down)


class NormedMLP(nn.Module):
    """BatchNorm on the split hidden features: its batch statistics are split too."""
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(tp.local(HIDDEN, "hidden"), kernel_init=LP(INIT, ("embed", "mlp")))(
            tp.copy_to_model(x))
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(h)
        down = self.param("down", LP(INIT, ("mlp", "embed")), (tp.local(HIDDEN, "hidden"), WIDTH))
        return x + tp.reduce_from_model(nn.relu(h) @ down)


class GatheredHead(nn.Module):
    """Column-parallel classifier whose shards are gathered (16 columns, 13 used)."""
    @nn.compact
    def __call__(self, x):
        y = nn.Dense(tp.local(16, "classes"))(tp.copy_to_model(x))
        return tp.gather_from_model(y, -1)[..., :VOCAB]


LAYERS = [Embed(), GatedMLP(), OwnNamesMLP(), NormedMLP(), GatheredHead()]


def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def batch(n, seed):
    r = np.random.RandomState(seed)
    return (r.randint(0, VOCAB, (n, 6)).astype(np.int32),
            r.randint(0, VOCAB, (n, 6)).astype(np.int32))


def _per_layer():
    pipe = jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=1, pipe=1), boundaries=[], remat="none")
    return pipe.unpack(pipe.init(jax.random.key(0), batch(2, 0)[0]))


def _close(got, ref):
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_researchers_own_tensor_parallel_layers_match_the_reference():
    """(2, 2, 2), 1f1b: a split layer with a whole-built annotated gate inside, one with
    its own names (and none), batch statistics of split features, a gathered head."""
    data, M = 2, 2
    inputs, targets = batch(data * M * 2, 7)
    ref = _per_layer()
    ref_loss, ref_grads, ref_vars = jp.reference_value_and_grad(
        LAYERS, ref, loss_fn, inputs, targets, data=data, num_microbatches=M, rng=RNG)
    pipe = jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=data, pipe=2, model=2),
                       num_microbatches=M, schedule="1f1b", boundaries=[2], remat="none")
    with pytest.warns(UserWarning, match=r"GatedMLP .* builds \['params'\]\['gate'\]\['kernel'\] whole"):
        pipe.init(jax.random.key(0), inputs[:2])
    shapes = pipe.layer_shapes   # one model shard's
    assert shapes[1]["params"]["gate"]["kernel"].shape == (WIDTH, WIDTH)
    assert shapes[1]["params"]["up"]["kernel"].shape == (WIDTH, HIDDEN // 2)
    assert shapes[2]["params"]["down"].shape == (HIDDEN // 2, WIDTH)
    assert shapes[3]["batch_stats"]["BatchNorm_0"]["mean"].shape == (HIDDEN // 2,)
    variables = pipe.pack(ref)
    loss, grads, new_vars = pipe.value_and_grad(loss_fn)(variables, inputs, targets, RNG)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    _close([v["params"] for v in pipe.unpack(grads)], ref_grads)
    _close(pipe.unpack(new_vars), ref_vars)
    _close(pipe.unpack(variables), ref)   # pack / unpack round trip

    def sequential(x):
        for layer, v in zip(LAYERS, ref):
            x, _ = apply_layer(layer, v, x, train=False, rng=None)
        return x
    _close(pipe.apply(variables, inputs), sequential(inputs))


def test_split_dims_follow_what_the_layer_builds():
    x = jax.ShapeDtypeStruct((1, 6, WIDTH), jnp.float32)
    _, dims = variable_split_dims(GatedMLP(), x)
    assert dims["params"] == {"gate": {"kernel": -1, "bias": -1}, "up": {"kernel": 1, "bias": 0},
                              "down": 0}
    _, dims = variable_split_dims(NormedMLP(), x)
    assert dims["batch_stats"] == {"BatchNorm_0": {"mean": 0, "var": 0}}

    class Shrinks(nn.Module):   # a kernel that loses a row at degree > 1
        @nn.compact
        def __call__(self, x):
            k = self.param("k", INIT, (WIDTH - (tp.size() > 1), tp.local(HIDDEN, "hidden")))
            return tp.reduce_from_model(x[..., :k.shape[0]] @ k).sum(-1, keepdims=True) + x
    class TwoNames(nn.Module):   # GSPMD names on both dims: built whole, or split in one
        split: bool

        @nn.compact
        def __call__(self, x):
            cols = tp.local(HIDDEN, "hidden") if self.split else HIDDEN
            k = self.param("k", LP(INIT, ("mlp", "heads")), (WIDTH, cols))
            h = (tp.copy_to_model(x) if self.split else x) @ k
            return tp.reduce_from_model(h).sum(-1, keepdims=True) if self.split else h
    # Refused by the names ("splits 2 dimensions over 'model'") before the layer was asked.
    assert variable_split_dims(TwoNames(False), x)[1]["params"] == {"k": -1}
    assert variable_split_dims(TwoNames(True), x)[1]["params"] == {"k": 1}
    with pytest.raises(ValueError, match=r"Shrinks\['params'\]\['k'\] has shape \(8, 16\) at "
                                         r"model degree 1 but \(7, 8\) at degree 2; split one"):
        variable_split_dims(Shrinks(), x)


def test_the_planner_prices_a_layer_split_under_its_own_names_split():
    """The shapes-only profile (the planner's) sees OwnNamesMLP's kernels split as the
    pipeline runs them, not whole because no name is "heads" or "mlp"."""
    from jaxhybrid.plan import profile
    costs = profile([Embed(), OwnNamesMLP()], batch(2, 0)[0])
    assert costs[1].model_param_bytes == costs[1].param_bytes == 4 * (2 * WIDTH * HIDDEN + HIDDEN)
    assert costs[1].model_flops_fraction == 1.0


def test_a_mesh_with_explicit_axes_is_refused_with_the_fix():
    """jax.make_mesh's default (Explicit axes) used to fail at the first step, inside
    shard_map, with a message about in_specs."""
    for shape, names in (((2, 2, 2), ("data", "pipe", "model")), ((4, 2), ("data", "pipe"))):
        with pytest.raises(ValueError, match=r"are not AxisType.Auto .* build the mesh with "
                                             r"jaxhybrid.make_mesh"):
            jp.Pipeline(LAYERS, mesh=jax.make_mesh(shape, names), boundaries=[2], remat="none")


class ColumnParallel(nn.Module):
    """Megatron's ColumnParallelLinear as a layer of its own: its output stays split."""
    @nn.compact
    def __call__(self, x):
        return nn.gelu(nn.Dense(tp.local(HIDDEN, "hidden"))(tp.copy_to_model(x)))


class RowParallel(nn.Module):
    """Megatron's RowParallelLinear: its kernel is built from its (split) input's width."""
    @nn.compact
    def __call__(self, h):
        kernel = self.param("kernel", INIT, (h.shape[-1], WIDTH))
        return tp.reduce_from_model(h @ kernel) + self.param("bias", SMALL, (WIDTH,))


def test_column_and_row_parallel_layers_split_across_a_stage_boundary():
    """The split activation of ColumnParallel crosses the pipe boundary to RowParallel,
    whose kernel rows split because its input does (no names, no `local` call)."""
    layers = [Embed(), ColumnParallel(), RowParallel(), GatheredHead()]
    pipe0 = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=1), boundaries=[], remat="none")
    inputs, targets = batch(8, 5)
    ref = pipe0.unpack(pipe0.init(jax.random.key(0), inputs[:2]))
    ref_loss, ref_grads, _ = jp.reference_value_and_grad(layers, ref, loss_fn, inputs, targets,
                                                         data=2, num_microbatches=2)
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=2, pipe=2, model=2), num_microbatches=2,
                       schedule="gpipe", boundaries=[2], remat="none")
    pipe.init(jax.random.key(0), inputs[:2])
    assert pipe.layer_shapes[2]["params"]["kernel"].shape == (HIDDEN // 2, WIDTH)
    variables = pipe.pack(ref)
    loss, grads, _ = pipe.value_and_grad(loss_fn)(variables, inputs, targets)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    _close([v["params"] for v in pipe.unpack(grads)], ref_grads)


def test_a_plain_layer_fed_a_split_activation_is_refused():
    """An ordinary Flax Dense (annotated "mlp" for GSPMD, no collective) right after
    ColumnParallel would get half the features on each model shard; split along its
    input it used to run on slices whose partial sums nobody added. (Refused by the
    degree check: a rule on shapes alone refused correct per-feature layers too.)"""
    class GspmdDense(nn.Module):
        @nn.compact
        def __call__(self, h):
            return nn.Dense(WIDTH, kernel_init=LP(INIT, ("mlp", "embed")))(h)

    pipe = jp.Pipeline([Embed(), ColumnParallel(), GspmdDense(), GatheredHead()],
                       mesh=jh.make_mesh(data=2, pipe=2, model=2), num_microbatches=2,
                       boundaries=[2], remat="none")
    with pytest.raises(ValueError, match=r"layer 2 \(GspmdDense\) computes another function "
                                         r".* gather a split input"):
        pipe.init(jax.random.key(0), batch(2, 0)[0])
    plain = jp.Pipeline([Embed(), ColumnParallel(), nn.Dense(WIDTH), GatheredHead()],
                        mesh=jh.make_mesh(data=2, pipe=2, model=2), num_microbatches=2,
                        boundaries=[2], remat="none")   # no names at all: the same
    with pytest.raises(ValueError, match=r"layer 2 \(Dense\) computes another function"):
        plain.init(jax.random.key(0), batch(2, 0)[0])


def test_a_model_whose_output_stays_split_over_model_is_refused():
    """A column-parallel head without its gather: loss_fn got each shard's half of the
    logits (nan, or a finite wrong loss), and apply returned half the classes."""
    class SplitHead(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(tp.local(16, "classes"))(tp.copy_to_model(x))

    pipe = jp.Pipeline([Embed(), ColumnParallel(), RowParallel(), SplitHead()],
                       mesh=jh.make_mesh(data=2, pipe=2, model=2), num_microbatches=2,
                       boundaries=[2], remat="none")
    with pytest.raises(ValueError, match=r"last layer's output stays split over 'model' .*"
                                         r"gather_from_model"):
        pipe.init(jax.random.key(0), batch(2, 0)[0])


class FusedQKV(nn.Module):
    """Attention with one fused qkv kernel. `shard_major=False` lays its columns out
    [q | k | v] (the usual single-device way): model shard 0 then gets all of q and half
    of k and reads them as its q, k, v."""
    shard_major: bool
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        hl, k = tp.local(self.heads, "heads"), WIDTH // self.heads
        qkv = nn.Dense(3 * hl * k, kernel_init=LP(INIT, ("embed", "heads")))(tp.copy_to_model(x))
        if self.shard_major:
            q, kk, v = jnp.moveaxis(qkv.reshape(*x.shape[:-1], hl, 3, k), -2, 0)
        else:
            q, kk, v = (a.reshape(*x.shape[:-1], hl, k) for a in jnp.split(qkv, 3, -1))
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(k), -1)
        o = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(*x.shape[:-1], hl * k)
        out = self.param("out", LP(INIT, ("heads", "embed")), (hl * k, WIDTH))
        return x + tp.reduce_from_model(o @ out)


class SubLayerNormMLP(nn.Module):
    """A LayerNorm on the split hidden features (NormFormer style): it normalises over
    its shard's slice."""
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(tp.local(HIDDEN, "hidden"), kernel_init=LP(INIT, ("embed", "mlp")))(
            tp.copy_to_model(x))
        h = nn.LayerNorm()(nn.gelu(h))
        down = self.param("down", LP(INIT, ("mlp", "embed")), (tp.local(HIDDEN, "hidden"), WIDTH))
        return x + tp.reduce_from_model(h @ down)


class WholeScaleMLP(nn.Module):
    """A whole parameter used on the split features: each shard's gradient of it is its
    part, unless it goes through copy_to_model (then summed over the group)."""
    copied: bool

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(tp.local(HIDDEN, "hidden"), kernel_init=LP(INIT, ("embed", "mlp")))(
            tp.copy_to_model(x))
        alpha = self.param("alpha", nn.initializers.ones, ())
        alpha = tp.copy_to_model(alpha) if self.copied else alpha
        down = self.param("down", LP(INIT, ("mlp", "embed")), (tp.local(HIDDEN, "hidden"), WIDTH))
        return x + tp.reduce_from_model(alpha * nn.gelu(h) @ down)


class BiasBeforeReduceMLP(nn.Module):
    """A row-parallel Dense with flax's default bias (zeros) before the sum: the bias is
    added on every shard, T times in all. At init the bias is zero, so the output and
    every gradient agree at both degrees; the check passed, and training then ran T x
    the bias silently (a probe: loss 0.878 at model=2, 0.792 at model=1 after 5 steps)."""
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(tp.local(HIDDEN, "hidden"), kernel_init=LP(INIT, ("embed", "mlp")))(
            tp.copy_to_model(x))
        return x + tp.reduce_from_model(nn.Dense(WIDTH)(nn.gelu(h)))


class Head(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(VOCAB)(x)


@pytest.mark.parametrize("layer,message", [
    (FusedQKV(shard_major=False), "outputs differ"),
    (SubLayerNormMLP(), "outputs differ"),
    (WholeScaleMLP(copied=False), "parameter gradients differ"),
    (BiasBeforeReduceMLP(), "outputs differ"),
])
def test_a_layer_that_computes_otherwise_on_its_shard_is_refused(layer, message):
    # Built with the right shapes, each computed another function at model > 1: a
    # probe's fused-qkv model trained to loss 2.18 at model=2 and restored onto model=1
    # at 3.14 (its init gave a different loss at each degree). Now the first pack runs
    # each split layer at both degrees on the sample and refuses, naming the layer.
    ids = jax.random.randint(RNG, (8, 6), 0, VOCAB)
    pipe = jp.Pipeline([Embed(), layer, Head()], mesh=jh.make_mesh(data=1, pipe=2, model=2),
                       num_microbatches=2, boundaries=[1])
    with pytest.raises(ValueError, match=f"layer 1 .*{message}.*contiguous blocks"):
        pipe.init(jax.random.key(0), ids)


class NoisyMLP(nn.Module):
    """A correct column / row-parallel MLP that draws noise in evaluation too."""
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(tp.local(HIDDEN, "hidden"), kernel_init=LP(INIT, ("embed", "mlp")))(
            tp.copy_to_model(x))
        h = h + 0.01 * jax.random.normal(self.make_rng("dropout"), h.shape)
        down = self.param("down", LP(INIT, ("mlp", "embed")), (tp.local(HIDDEN, "hidden"), WIDTH))
        return x + tp.reduce_from_model(nn.gelu(h) @ down)


def test_a_constant_sample_or_a_sampling_layer_does_not_hide_a_wrong_layer():
    # pipe.init(key, jnp.zeros(...)): a first layer without biases gave zeros at both
    # degrees and was accepted; a split layer that draws in evaluation ended the check,
    # and the wrong layer after it trained another model silently (loss 1.94 at model=2,
    # 1.13 at model=1 for the same variables). Both are refused now.
    mesh = jh.make_mesh(data=1, pipe=2, model=2)
    zeros = jnp.zeros((8, 6, WIDTH))
    pipe = jp.Pipeline([FusedQKV(shard_major=False), Head()], mesh=mesh, num_microbatches=2,
                       boundaries=[1])
    with pytest.raises(ValueError, match=r"layer 0 \(FusedQKV\) .*outputs differ"):
        pipe.init(jax.random.key(0), zeros)
    ids = jax.random.randint(RNG, (8, 6), 0, VOCAB)
    pipe = jp.Pipeline([Embed(), NoisyMLP(), FusedQKV(shard_major=False), Head()], mesh=mesh,
                       num_microbatches=2, boundaries=[2])
    with pytest.raises(ValueError, match=r"layer 2 \(FusedQKV\) .*outputs differ"):
        pipe.init(jax.random.key(0), ids)
    pipe = jp.Pipeline([Embed(), NoisyMLP(), FusedQKV(shard_major=True), Head()], mesh=mesh,
                       num_microbatches=2, boundaries=[2])
    pipe.init(jax.random.key(0), ids)           # the right layout after it is accepted


@pytest.mark.parametrize("layer", [FusedQKV(shard_major=True), WholeScaleMLP(copied=True)])
def test_the_shard_major_and_copied_forms_train_as_one_device(layer):
    ids = jax.random.randint(RNG, (8, 6), 0, VOCAB)
    labels = jax.random.randint(jax.random.key(2), (8, 6), 0, VOCAB)
    ce = lambda o, t: optax.softmax_cross_entropy_with_integer_labels(o, t).mean()
    layers = [Embed(), layer, Head()]
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=2, model=2),
                       num_microbatches=2, boundaries=[1])
    v = pipe.init(jax.random.key(0), ids)
    per_layer = pipe.unpack(v)
    loss, grads, _ = pipe.value_and_grad(ce)(v, ids, labels)

    def ref(params):
        x = ids
        for l, p, full in zip(layers, params, per_layer):
            x = apply_layer(l, {**full, "params": p}, x, train=False)[0]
        return ce(x, labels)
    ref_loss, ref_grads = jax.value_and_grad(ref)([l["params"] for l in per_layer])
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, w in zip(jax.tree.leaves([l["params"] for l in pipe.unpack({**v, "params": grads})]),
                    jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


class FeatureScale(nn.Module):
    """A per-feature scale: correct on a split activation without any collective."""
    @nn.compact
    def __call__(self, h):
        return h * self.param("s", nn.initializers.normal(1.0), (h.shape[-1],))


class HalfPrecisionMLP(nn.Module):
    """float32 parameters and residual stream, bfloat16 matmuls (Flax mixed precision)."""
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(tp.local(HIDDEN, "hidden"), dtype=jnp.bfloat16,
                     kernel_init=LP(INIT, ("embed", "mlp")))(tp.copy_to_model(x))
        down = self.param("down", LP(INIT, ("mlp", "embed")), (tp.local(HIDDEN, "hidden"), WIDTH))
        return x + tp.reduce_from_model(nn.gelu(h).astype(jnp.bfloat16) @ down.astype(
            jnp.bfloat16)).astype(jnp.float32)


@pytest.mark.parametrize("layers", [
    [Embed(), ColumnParallel(), FeatureScale(), RowParallel(), Head()],
    [Embed(), HalfPrecisionMLP(), Head()],
], ids=["per-feature layer on a split activation", "bfloat16 matmuls"])
def test_correct_layers_are_not_refused(layers):
    # A probe's correct models that were refused: a per-feature layer between column-
    # and row-parallel layers (by a rule on shapes alone: "joins no collective"), and
    # bfloat16 rounding judged at float32's tolerance (the output's dtype).
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=2, model=2), num_microbatches=2,
                       boundaries=[1])
    pipe.init(jax.random.key(0), jax.random.randint(RNG, (8, 6), 0, VOCAB))


class GeneralQKV(nn.Module):
    """A head-parallel projection written as MaxText writes it: a DenseGeneral whose
    kernel carries 4-D logical names (flax keeps it flat and constrains it under rules)."""
    @nn.compact
    def __call__(self, x):
        heads = tp.local(4, "heads")
        qkv = nn.DenseGeneral((heads, 3, 2), kernel_init=LP(SMALL, ("embed", "heads", "qkv", "kv")),
                              name="qkv")(tp.copy_to_model(x))
        wo = self.param("wo", LP(SMALL, ("heads", "qkv", "kv", "embed")), (heads, 3, 2, WIDTH))
        return x + tp.reduce_from_model(jnp.einsum("bthqk,hqke->bte", qkv, wo))


@pytest.mark.parametrize("rules", [
    (("batch", "data"), ("heads", "model"), ("mlp", "model")),   # tensor-parallel rules
    (("batch", "data"), ("embed", "data")),                       # FSDP-style
    (("mlp", "tensor"),)])                                        # an axis the mesh lacks
def test_a_users_logical_axis_rules_change_nothing(rules):
    # A researcher's own nn.logical_axis_rules around the calls turned the layers'
    # logical constraints into constraints over the step's manual axes: jax's "only valid
    # for values of rank at least 4" (the fused kernel) or "data is not found in mesh".
    layers = [Embed(), GeneralQKV(), GatheredHead()]
    inputs, targets = batch(8, 3)
    make = lambda: jp.Pipeline(layers, mesh=jh.make_mesh(data=2, pipe=2, model=2),
                               num_microbatches=2, boundaries=[2], remat="none")
    pipe = make()
    variables = pipe.init(jax.random.key(0), inputs[:2])
    want = pipe.value_and_grad(loss_fn)(variables, inputs, targets)[:2]
    want_out = pipe.apply(variables, inputs)
    opt = optax.adam(1e-2)
    with nn.logical_axis_rules(rules):
        pipe = make()          # traced under the rules
        again = pipe.init(jax.random.key(0), inputs[:2])
        _close(again, variables)
        _close(pipe.value_and_grad(loss_fn)(again, inputs, targets)[:2], want)
        _close(pipe.apply(again, inputs), want_out)
        pipe.train_step(loss_fn, opt)(again, pipe.init_optimizer(opt, again), inputs, targets)
