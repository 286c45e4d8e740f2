"""Flax and JAX features of researchers' models that once failed in the pipeline (a
fourth probe, 2026-11-27), each against the plain model on one device: complex values
(FFT mixing, state-space models), sown collections, typed PRNG keys in stashed values,
flax's counter pattern, sharding constraints inside the model, and the messages for
inputs the pipeline cannot microbatch."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from test_splitter import _close, _nnx_reference, mse

B, D = 8, 4


def _batch():
    return (jax.random.normal(jax.random.key(0), (B, D)),
            jax.random.normal(jax.random.key(1), (B, D)))


def _microbatch_reference(model, variables, x, t, M):
    """Mean over M microbatches of mse(model.apply(...)) and its parameter gradients."""
    def total(p):
        xs, ts = jnp.split(x, M), jnp.split(t, M)
        # mutable: the state each microbatch writes is dropped (none reads it back here)
        return sum(mse(model.apply({**variables, "params": p}, a, mutable=True)[0], b)
                   for a, b in zip(xs, ts)) / M
    return jax.value_and_grad(total)(variables["params"])


def _split_step_matches(model, variables, x, t, *, data=1, packed_variables=None,
                        mesh=None, **options):
    """The model split over pipe 2 (M=2): loss and gradients of one value_and_grad equal
    the unsplit model's on the same microbatches. Returns (pipe, new packed variables)."""
    pipe = jp.Pipeline(model, mesh=mesh or jh.make_mesh(data=data, pipe=2),
                       num_microbatches=2, **options)
    pipe.init(jax.random.key(1), x)
    packed = pipe.pack(variables if packed_variables is None else packed_variables)
    loss, grads, new = pipe.value_and_grad(mse)(packed, x, t)
    want_loss, want = _microbatch_reference(model, variables, x, t, 2 * pipe.data)
    got = pipe.unpack({**packed, "params": grads})["params"]
    assert float(np.abs(jax.tree.leaves(got)[0]).max()) > 0
    _close(loss, want_loss, "loss")
    _close(got, want, "gradients")
    return pipe, new


# --- complex values ------------------------------------------------------------------
class ComplexCut(nn.Module):
    """A complex activation crosses the cut (FFT mixing, complex state-space states)."""
    @nn.compact
    def __call__(self, x):
        z = jnp.exp(1j * nn.Dense(D)(x).astype(jnp.complex64))
        z = jp.stage_boundary(z)
        z = jnp.fft.fft(z, axis=-1)
        return nn.Dense(D)(jnp.real(z) * 2 + jnp.imag(z))


class ComplexParams(nn.Module):
    """A complex64 kernel in the second stage, a real one in the first."""
    @nn.compact
    def __call__(self, x):
        h = jp.stage_boundary(jnp.tanh(nn.Dense(D)(x)))
        w = self.param("w", nn.initializers.normal(1.0, jnp.complex64), (D, D), jnp.complex64)
        return jnp.abs(h.astype(jnp.complex64) @ w)


@pytest.mark.parametrize("model,schedule,data", [(ComplexCut(), "1f1b", 1),
                                                 (ComplexCut(), "zb-h1", 2),
                                                 (ComplexParams(), "gpipe", 1)])
def test_complex_values_carry_gradients_across_cuts(model, schedule, data):
    # Complex leaves were filed as non-differentiable: every parameter before a complex
    # value crossing a cut got a zero gradient, with loss and apply exact.
    x, t = _batch()
    _split_step_matches(model, model.init(jax.random.key(2), x), x, t, data=data,
                        schedule=schedule)


def test_complex_activation_between_listed_layers():
    class ToComplex(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.exp(1j * nn.Dense(D)(x).astype(jnp.complex64))

    class ToReal(nn.Module):
        @nn.compact
        def __call__(self, z):
            return nn.Dense(D)(jnp.real(z) * 2 + jnp.imag(z))

    x, t = _batch()
    layers = [ToComplex(), ToReal()]
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2)
    variables = pipe.init(jax.random.key(1), x)
    loss, grads, _ = pipe.value_and_grad(mse)(variables, x, t)
    want_loss, want, _ = jp.reference_value_and_grad(layers, pipe.unpack(variables), mse, x, t,
                                                     num_microbatches=2)
    got = pipe.unpack({**variables, "params": grads})
    assert float(np.abs(got[0]["params"]["Dense_0"]["kernel"]).max()) > 0
    _close(loss, want_loss, "loss")
    _close([g["params"] for g in got], want, "gradients")


# --- typed PRNG keys in the stash ----------------------------------------------------
class RematScan(nnx.Module):
    """nnx.scan over nnx.remat'd blocks with Dropout: the backward's saved values hold
    the blocks' typed dropout keys."""
    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)
        self.blocks = make(rngs)
        self.out = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        @nnx.remat
        def body(block, h):
            return block(h)
        return self.out(body(self.blocks, x))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, h):
        return h + self.drop(nnx.gelu(self.dense(h)))


def test_rematerialised_dropout_keys_are_stashed():
    # Packing the stash refused the typed keys: "canonicalize_dtype called on extended
    # dtype key<fry>" from value_and_grad.
    x, t = _batch()
    rng = jax.random.key(4)
    pipe = jp.Pipeline(RematScan(nnx.Rngs(0)), mesh=jh.make_mesh(data=1, pipe=2),
                       num_microbatches=2)
    variables = pipe.init(jax.random.key(1), x)
    loss, grads, _ = pipe.value_and_grad(mse)(variables, x, t, rng)
    want_loss, want, _ = _nnx_reference(RematScan(nnx.Rngs(0)), x, t, 1, 2, rng=rng)
    got = nnx.filter_state(pipe.unpack({**variables, "params": grads}), nnx.Param)
    _close(loss, want_loss, "loss")
    _close(nnx.to_pure_dict(got), nnx.to_pure_dict(want), "gradients")


# --- sown collections ----------------------------------------------------------------
class SowsALoss(nn.Module):
    """`self.sow` into a collection model.init keeps ("losses", not "intermediates")."""
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(16)(x))
        self.sow("losses", "aux", jnp.mean(h ** 2))
        return nn.Dense(D)(jnp.tanh(nn.Dense(16)(h)))


def test_a_sown_collection_holds_the_last_microbatchs_value():
    # sow appends to the tuple it is given: the new value came second and the pipeline
    # returned the old one (whatever was packed) as the new state, silently.
    x, t = _batch()
    model = SowsALoss()
    variables = model.init(jax.random.key(2), x)
    pipe, new = _split_step_matches(
        model, variables, x, t,
        packed_variables={**variables, "losses": {"aux": (jnp.float32(123.0),)}})
    _, sown = model.apply({"params": variables["params"]}, x[B // 2:], mutable=["losses"])
    _close(pipe.unpack(new)["losses"], sown["losses"], "sown value")


# --- state written while evaluating ---------------------------------------------------
class CountsCalls(nn.Module):
    """flax's counter pattern: the update is not guarded by is_mutable_collection."""
    @nn.compact
    def __call__(self, x):
        calls = self.variable("counters", "n", lambda: jnp.zeros((), jnp.float32))
        if not self.is_initializing():
            calls.value += 1.0
        return nn.Dense(D)(jnp.tanh(nn.Dense(16)(x)))


def test_a_model_that_writes_state_when_evaluating_splits_and_trains():
    # The splitter's evaluation trace (no collection mutable) raised flax's
    # ModifyScopeVariableError at pipe.init, though the user only trained.
    x, t = _batch()
    model = CountsCalls()
    variables = model.init(jax.random.key(2), x)
    pipe, new = _split_step_matches(model, variables, x, t)
    assert float(pipe.unpack(new)["counters"]["n"]) == 2.0      # once per microbatch
    _close(pipe.apply(pipe.pack(variables), x),
           model.apply(variables, x, mutable=["counters"])[0], "apply")


# --- sharding constraints inside the model ---------------------------------------------
def test_sharding_constraints_in_a_model_are_dropped_and_in_layers_named():
    # Inside the pipeline's shard_map every mesh axis is manual: a constraint to the
    # whole mesh failed with jax's "Mesh for all inputs should be equal", deep in a step.
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jh.make_mesh(data=2, pipe=2)

    class Constrained(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jnp.tanh(nn.Dense(16)(x))
            h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data")))
            return nn.Dense(D)(jnp.tanh(nn.Dense(16)(h)))

    x, t = _batch()
    model = Constrained()
    variables = model.init(jax.random.key(2), x)
    _split_step_matches(model, variables, x, t, mesh=mesh)

    class ConstrainedLayer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jax.lax.with_sharding_constraint(jnp.tanh(nn.Dense(D)(x)),
                                                    NamedSharding(mesh, P("data")))

    layers = jp.Pipeline([ConstrainedLayer(), ConstrainedLayer()], mesh=mesh,
                         num_microbatches=2)
    variables = layers.init(jax.random.key(1), x)
    with pytest.raises(ValueError, match="with_sharding_constraint.*nn.with_logical_constraint"):
        layers.value_and_grad(mse)(variables, x, t)


# --- messages ---------------------------------------------------------------------------
class Mlp(nn.Module):
    width: int = 16

    @nn.compact
    def __call__(self, x):
        return nn.Dense(D)(jnp.tanh(nn.Dense(self.width)(x)))


def test_pack_refuses_variables_of_other_dtypes_or_shapes_by_name():
    # bfloat16 copies of float32 parameters were packed and the step failed inside a
    # traced piece ("lax.add requires arguments to have the same dtypes").
    x, _ = _batch()
    pipe = jp.Pipeline(Mlp(), mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2)
    pipe.init(jax.random.key(1), x)
    variables = Mlp().init(jax.random.key(2), x)
    with pytest.raises(ValueError, match=r"params/Dense_0/bias is bfloat16\[4\], the model's "
                                         r"is float32\[4\].*astype"):
        pipe.pack(jax.tree.map(lambda a: a.astype(jnp.bfloat16), variables))
    with pytest.raises(ValueError, match=r"float32\[17, 4\], the model.s is float32\[16, 4\]; pass "
                                         r"variables made for this model"):
        pipe.pack(Mlp(17).init(jax.random.key(2), x))


def test_a_per_example_array_in_call_kwargs_is_named():
    # The model's own broadcasting error came 12 frames deep from pipe.init.
    class MaskedPool(nn.Module):
        @nn.compact
        def __call__(self, x, mask=None):
            h = jnp.tanh(nn.Dense(16)(x))
            return nn.Dense(D)(jnp.where(mask[..., None], h, 0.0).sum(1))

    x = jnp.ones((16, 8, D))
    mask = jnp.ones((16, 8), bool)
    pipe = jp.Pipeline(MaskedPool(), mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2,
                       call_kwargs={"mask": mask})
    with pytest.raises(ValueError, match=r"call_kwargs \['mask'\] go whole to every "
                                         r"microbatch.*inputs=\(x, mask\)"):
        pipe.init(jax.random.key(1), x)


def test_sample_inputs_split_the_model_on_one_microbatch():
    # sample_inputs= split the model on one example, init on one microbatch: a model
    # whose graph follows the batch size (lax.map over its examples) was refused at init
    # ("the model's graph changes with the input shape"), though it trained without them.
    class MapsExamples(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.normal(), (16, 16))
            h = jax.lax.map(lambda e: jnp.tanh(e @ w), nn.Dense(16)(x))
            return nn.Dense(D)(h)

    x, t = _batch()
    model = MapsExamples()
    variables = model.init(jax.random.key(2), x)
    with pytest.warns(UserWarning, match="if they are batch-major, ignore this"):
        _split_step_matches(model, variables, x, t, sample_inputs=x, boundaries=[2])


# --- time-major inputs ------------------------------------------------------------------
class Recurrent(nn.Module):
    """A simple RNN over the leading axis of x [T, B, F] (time-major) or, transposed
    inside, over axis 1 of x [B, T, F]."""
    time_major: bool

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x if self.time_major else jnp.swapaxes(x, 0, 1))
        cell = nn.SimpleCell(8)
        scan = nn.scan(lambda c, carry, xt: c(carry, xt), variable_broadcast="params",
                       split_rngs={"params": False})
        _, hs = scan(cell, cell.initialize_carry(jax.random.key(0), h[0].shape), h)
        y = nn.Dense(D)(hs)
        return y if self.time_major else jnp.swapaxes(y, 0, 1)


def test_a_scan_over_the_leading_axis_warns_of_time_major_inputs():
    # Time-major inputs are cut along time: the loss was 0.1% off, the gradients 55%,
    # with no word.
    import warnings
    mesh = jh.make_mesh(data=1, pipe=2)
    with pytest.warns(UserWarning, match=r"time-major \(\[T, B, \.\.\.\]\), transpose"):
        jp.Pipeline(Recurrent(True), mesh=mesh, num_microbatches=2).init(
            jax.random.key(1), jnp.ones((16, 4, D)))       # [T=16, B=4]: 8 steps each
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jp.Pipeline(Recurrent(False), mesh=mesh, num_microbatches=2).init(
            jax.random.key(1), jnp.ones((16, 5, D)))       # [B=16, T=5]
        # Batch-major with T as long as a microbatch (8 rows): the swapaxes inside moved
        # the examples' axis; the warning said "the gradients are wrong" where they were
        # exact.
        jp.Pipeline(Recurrent(False), mesh=mesh, num_microbatches=2).init(
            jax.random.key(1), jnp.ones((16, 8, D)))       # [B=16, T=8]


class _DropLayer(nn.Module):
    train: bool

    @nn.compact
    def __call__(self, h, _):
        return nn.Dropout(0.1, deterministic=not self.train)(jnp.tanh(nn.Dense(D)(h))), None


class ScannedLayers(nn.Module):
    """Four Dense+dropout layers under nn.scan, the dropout keys split per layer."""
    @nn.compact
    def __call__(self, x, train: bool = True):
        stack = nn.scan(_DropLayer, variable_axes={"params": 0},
                        split_rngs={"params": True, "dropout": True}, length=4)
        return stack(train)(x, None)[0]


def test_a_scan_over_layers_as_many_as_a_microbatchs_rows_does_not_warn():
    # The scan's per-layer dropout keys (uint32[4, 2]) were taken for per-example
    # values: "the gradients are wrong" where they were exact.
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jp.Pipeline(ScannedLayers(), mesh=jh.make_mesh(data=1, pipe=2),
                    num_microbatches=2).init(jax.random.key(1), jnp.ones((8, D)))


class _CallTimeRngs(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.drop = nnx.Linear(D, D, rngs=rngs), nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
        return self.drop(nnx.relu(self.l1(x)), rngs=rngs)


def test_an_nnx_dropout_without_rngs_is_refused_with_the_fix():
    # flax's own message ("no `rngs` argument was provided to Dropout") named neither the
    # pipeline nor the fix.
    with pytest.raises(ValueError, match=r"^Splitter: an NNX module takes its rngs at call "
                                         r"time.*give it rngs= when you build it"):
        jp.Pipeline(_CallTimeRngs(nnx.Rngs(0)), mesh=jh.make_mesh(data=1, pipe=2),
                    num_microbatches=2).init(jax.random.key(1), jnp.ones((8, D)))


def test_a_split_models_step_names_bad_targets_inputs_and_losses_first():
    # The splitter's loss check ran first: targets of another batch size were blamed on
    # loss_fn, inputs unlike init's gave flax's ScopeParamShapeError, and a (loss, aux)
    # loss failed inside jnp.asarray 18 frames deep.
    class Positional(nn.Module):
        @nn.compact
        def __call__(self, x):                     # x [b, T, D]
            pos = self.param("pos", nn.initializers.normal(), x.shape[1:])
            return nn.Dense(D)(jnp.tanh(nn.Dense(16)(x + pos)))

    x, t = jnp.ones((8, 6, D)), jnp.zeros((8, 6, D))
    pipe = jp.Pipeline(Positional(), mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2)
    variables = pipe.init(jax.random.key(1), x)
    step = pipe.value_and_grad(mse)
    with pytest.raises(ValueError, match="inputs have batch 8, targets 4; pass one target row"):
        step(variables, x, t[:4])
    with pytest.raises(ValueError, match="do not fit the packed variables.*sample_inputs"):
        step(variables, jnp.ones((8, 12, D)), jnp.zeros((8, 12, D)))
    with pytest.raises(ValueError, match="loss_fn returned a tuple; it must return a scalar, the loss"):
        pipe.value_and_grad(lambda y, t: (mse(y, t), {"acc": jnp.float32(0)}))(variables, x, t)
