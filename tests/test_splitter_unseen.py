"""Models in styles researchers write, unlike those of test_splitter.py, split as
docs/splitter.md tells a user (`jp.Pipeline(model, ...)` with the planner's cuts, or a
`SplitModel` with explicit boundaries): loss, gradients and new batch statistics equal
the unsplit model's, `pipe.init` gives the model's own tree and `pack` / `unpack`
round-trip, and `pipe.apply` equals the model in evaluation mode. Then regressions of
what these models broke.

linen: a ViT (setup with a Python list of blocks, cls token and position embedding as
params, attention dropout, keyword-only `train`); a U-Net (skips crossing many cuts,
concatenate, ConvTranspose, GroupNorm, jax.image.resize); an `nn.scan` of an `nn.remat`
block with dropout split per layer; a tied-embedding LM (dict input, int tokens, causal +
padding masks, `deterministic=` instead of `train`, `self.sow`, dict output).
NNX: a CNN (BatchNorm, Dropout with its own rng stream, `self.sow`); an MLP-Mixer
(`nnx.List` of blocks, `train=` passed down by hand); layers created by `nnx.vmap` and
applied by `nnx.scan`."""
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from jaxhybrid.splitter import SplitModel
from test_splitter import RNG, _close, _nnx_reference, mse, xent


# --- linen models -------------------------------------------------------------------
class VitBlock(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1,
                                            deterministic=not train)(h, h)
        x = x + nn.Dropout(0.1)(h, deterministic=not train)
        h = nn.Dropout(0.1)(nn.gelu(nn.Dense(2 * x.shape[-1])(nn.LayerNorm()(x))),
                            deterministic=not train)
        return x + nn.Dense(x.shape[-1])(h)


class ViT(nn.Module):
    width: int = 16
    depth: int = 1

    def setup(self):
        self.patch = nn.Conv(self.width, (2, 2), strides=(2, 2), padding="VALID")
        self.cls = self.param("cls", nn.initializers.normal(0.02), (1, 1, self.width))
        self.pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, 10, self.width))
        self.blocks = [VitBlock() for _ in range(self.depth)]
        self.norm, self.head, self.drop = nn.LayerNorm(), nn.Dense(5), nn.Dropout(0.1)

    def __call__(self, img, *, train: bool = False):
        x = self.patch(img)
        x = x.reshape(x.shape[0], -1, self.width)
        x = jnp.concatenate([jnp.tile(self.cls, (x.shape[0], 1, 1)), x], axis=1) + self.pos
        x = self.drop(x, deterministic=not train)
        for block in self.blocks:
            x = block(x, train)
        return self.head(self.norm(x)[:, 0])


class UNet(nn.Module):
    channels: tuple = (4, 8, 8)

    @nn.compact
    def __call__(self, x):
        skips = []
        for i, c in enumerate(self.channels):
            x = nn.swish(nn.GroupNorm(num_groups=2)(nn.Conv(c, (3, 3))(x)))
            skips.append(x)
            if i < len(self.channels) - 1:
                x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        for i in reversed(range(len(self.channels) - 1)):
            x = nn.ConvTranspose(self.channels[i], (2, 2), strides=(2, 2))(x)
            x = nn.relu(nn.Conv(self.channels[i], (3, 3))(jnp.concatenate([x, skips[i]], -1)))
        b, h, w, c = x.shape
        x = jax.image.resize(x, (b, h // 2, w // 2, c), "bilinear")
        return nn.Conv(2, (1, 1))(jnp.concatenate([x, nn.max_pool(skips[0], (2, 2), (2, 2))], -1))


class ScanLayer(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        h = nn.Dropout(0.2, deterministic=not train)(nn.gelu(nn.Dense(16)(nn.LayerNorm()(x))))
        return x + nn.Dense(x.shape[-1])(h), None


class ScanRemat(nn.Module):
    """MaxText style: layers as nn.scan over nn.remat, dropout rngs split per layer."""
    @nn.compact
    def __call__(self, x, train: bool = False):
        stack = nn.scan(nn.remat(ScanLayer, static_argnums=(2,)), variable_axes={"params": 0},
                        split_rngs={"params": True, "dropout": True}, in_axes=(nn.broadcast,),
                        length=4)
        x, _ = stack(name="stack")(nn.Dense(8)(x), train)
        return nn.Dense(3)(x)


class LMBlock(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, mask, deterministic):
        h = nn.SelfAttention(num_heads=2, dropout_rate=0.1,
                             deterministic=deterministic)(nn.RMSNorm()(x), mask=mask)
        self.sow("intermediates", "attention", h)
        x = x + h
        h = nn.Dropout(0.1)(nn.relu(nn.Dense(2 * self.width)(nn.RMSNorm()(x))),
                            deterministic=deterministic)
        return x + nn.Dense(self.width)(h)


class DictLM(nn.Module):
    """Tied embeddings; {"ids", "valid"} in, {"logits", "hidden"} out; `deterministic`."""
    vocab: int = 11
    width: int = 16
    depth: int = 1

    def setup(self):
        self.embed = nn.Embed(self.vocab, self.width)
        self.blocks = [LMBlock(self.width) for _ in range(self.depth)]
        self.norm = nn.LayerNorm()

    def __call__(self, batch, deterministic: bool = True):
        ids, valid = batch["ids"], batch["valid"]
        x = self.embed(ids) * jnp.sqrt(self.width)
        mask = nn.combine_masks(nn.make_causal_mask(ids), nn.make_attention_mask(valid, valid))
        for block in self.blocks:
            x = block(x, mask, deterministic)
        x = self.norm(x)
        return {"logits": self.embed.attend(x), "hidden": x.mean(1)}


# --- NNX models ---------------------------------------------------------------------
class NnxCNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.c1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, momentum=0.8, rngs=rngs)
        self.c2 = nnx.Conv(8, 8, (3, 3), strides=2, rngs=rngs)
        self.bn2 = nnx.BatchNorm(8, momentum=0.8, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.fc = nnx.Linear(8, 5, rngs=rngs)

    def __call__(self, x):
        h = self.c1(x)
        self.sow(nnx.Intermediate, "a_features", h)   # a variable sorted before bn1's
        h = nnx.relu(self.bn2(self.c2(nnx.relu(self.bn1(h)))))
        return self.fc(self.drop(h.mean(axis=(1, 2))))


class MixerBlock(nnx.Module):
    def __init__(self, tokens: int, ch: int, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(ch, rngs=rngs), nnx.LayerNorm(ch, rngs=rngs)
        self.tok1, self.tok2 = nnx.Linear(tokens, 8, rngs=rngs), nnx.Linear(8, tokens, rngs=rngs)
        self.ch1, self.ch2 = nnx.Linear(ch, 16, rngs=rngs), nnx.Linear(16, ch, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x, train):
        y = self.tok2(nnx.gelu(self.tok1(jnp.swapaxes(self.ln1(x), 1, 2))))
        x = x + self.drop(jnp.swapaxes(y, 1, 2), deterministic=not train)
        return x + self.ch2(nnx.gelu(self.ch1(self.ln2(x))))


class NnxMixer(nnx.Module):
    """Passes `train` down by hand, as much NNX code does instead of model.train()."""
    def __init__(self, rngs: nnx.Rngs, ch: int = 8, depth: int = 1):
        self.stem = nnx.Conv(3, ch, (2, 2), strides=2, padding="VALID", rngs=rngs)
        self.blocks = nnx.List([MixerBlock(9, ch, rngs) for _ in range(depth)])
        self.norm, self.head = nnx.LayerNorm(ch, rngs=rngs), nnx.Linear(ch, 5, rngs=rngs)

    def __call__(self, img, *, train: bool = False):
        x = self.stem(img)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        for block in self.blocks:
            x = block(x, train)
        return self.head(self.norm(x).mean(1))


class StackLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln, self.lin = nnx.LayerNorm(8, rngs=rngs), nnx.Linear(8, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)   # one rng stream per layer

    def __call__(self, x):
        return x + self.drop(jnp.tanh(self.lin(self.ln(x))))


class NnxScanStack(nnx.Module):
    """Layers created by nnx.vmap (stacked parameters and dropout streams), applied by
    nnx.scan."""
    def __init__(self, rngs: nnx.Rngs, depth: int = 4):
        self.inp, self.out = nnx.Linear(5, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)

        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return StackLayer(rngs)
        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, layer):
            return layer(x)
        return self.out(body(self.inp(x), self.layers))


# --- data, losses -------------------------------------------------------------------
def _images(b, seed, size=6):
    r = np.random.RandomState(seed)
    return r.randn(b, size, size, 3).astype(np.float32), r.randint(0, 5, (b,)).astype(np.int32)


def _maps(b, seed):
    r = np.random.RandomState(seed)
    return r.randn(b, 8, 8, 3).astype(np.float32), r.randn(b, 4, 4, 2).astype(np.float32)


def _vectors(b, seed):
    r = np.random.RandomState(seed)
    return r.randn(b, 5).astype(np.float32), r.randn(b, 3).astype(np.float32)


def _token_dict(b, seed):
    r = np.random.RandomState(seed)
    ids = r.randint(0, 11, (b, 6)).astype(np.int32)
    valid = (np.arange(6)[None] < r.randint(3, 7, (b, 1))).astype(np.int32)
    return {"ids": ids, "valid": valid}, np.roll(ids, -1, 1)


def lm_loss(out, labels):
    return xent(out["logits"], labels) + 1e-2 * jnp.mean(out["hidden"] ** 2)


CASES = {   # name: (model factory, batch maker, loss, uses dropout)
    "vit": (ViT, _images, xent, True),
    "unet": (UNet, _maps, mse, False),
    "scan_remat": (ScanRemat, _vectors, mse, True),
    "dict_lm": (DictLM, _token_dict, lm_loss, True),
    "nnx_cnn": (lambda: NnxCNN(nnx.Rngs(0, dropout=1)), _images, xent, True),
    "nnx_mixer": (lambda: NnxMixer(nnx.Rngs(0, dropout=1)), _images, xent, True),
    "nnx_scan": (lambda: NnxScanStack(nnx.Rngs(0, dropout=1)), _vectors, mse, True),
}


@functools.lru_cache(maxsize=None)
def _model(name):
    return CASES[name][0]()


def with_train(model: nn.Module) -> nn.Module:
    """A linen model taking `deterministic` as one taking `train` (same class, so the same
    variable paths and dropout rngs): what `jp.reference_value_and_grad` calls."""
    cls = type(model)
    sub = type(cls.__name__ + "Train", (cls,), {
        "__call__": lambda self, x, train=False: cls.__call__(self, x, deterministic=not train)})
    return sub(**{f.name: getattr(model, f.name) for f in dataclasses.fields(model)
                  if f.init and f.name not in ("parent", "name")})


def _reference(name, model, native, loss_fn, x, t, data, M, rng):
    """(loss, gradients, new batch_stats or None) of the unsplit model, as leaves."""
    if isinstance(model, nnx.Module):
        kw = {"train": True} if name == "nnx_mixer" else {}
        loss, grads, new = _nnx_reference(model, x, t, data, M, loss_fn, rng, **kw)
        return loss, jax.tree.leaves(grads), jax.tree.leaves(new) or None
    layer = with_train(model) if name == "dict_lm" else model
    loss, grads, new = jp.reference_value_and_grad([layer], [native], loss_fn, x, t, data=data,
                                                   num_microbatches=M, rng=rng)
    return loss, jax.tree.leaves(grads[0]), jax.tree.leaves(new[0].get("batch_stats")) or None


def _arrays(tree):
    """Leaves, with NNX rng keys as their raw data."""
    return [jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a
            for a in jax.tree.leaves(tree)]


def _eval(model, variables, x):
    """The unsplit model in evaluation mode on `variables` (its own tree)."""
    if isinstance(model, nnx.Module):
        def run(state, x):
            m = nnx.merge(nnx.graphdef(model), state)
            m.eval()
            return m(x)
        return jax.jit(run)(variables, x)
    return jax.jit(model.apply)(variables, x)


def split_case(model, case, data, pipe_size, schedule, M, options):
    """A CASES entry's batch (data x M microbatches of 2), loss, dropout rng, and the
    model split on it (split_and_round_trip)."""
    _, batch, loss_fn, dropout = case
    x, t = batch(data * M * 2, data + M)
    return x, t, loss_fn, RNG if dropout else None, split_and_round_trip(
        model, x, data, pipe_size, schedule, M, options)


def split_and_round_trip(model, x, data, pipe_size, schedule, M, options):
    """The model split, planned and initialised: with the planner's cuts (XLA cost
    analysis of the pieces), or with `planner=False` in options the user's own split and
    even cuts (faster). Checks that unpack gives the model's own variable tree (structure,
    shapes, dtypes) and that pack inverts it. Returns (pipe, variables, native tree)."""
    mesh = jh.make_mesh(data=data, pipe=pipe_size)
    options = dict(options)
    stages = pipe_size * options.get("virtual_stages", 1)
    if options.pop("planner", True):
        pipe = jp.Pipeline(model, mesh=mesh, num_microbatches=M, schedule=schedule,
                           remat="none", **options)
    else:
        split = SplitModel(model, jax.tree.map(lambda a: a[:a.shape[0] // (data * M)], x),
                           max_pieces=8, min_pieces=stages)
        pipe = jp.Pipeline(split, mesh=mesh, num_microbatches=M, schedule=schedule, remat="none",
                           boundaries=jp.even_boundaries(split.num_pieces, stages), **options)
    variables = pipe.init(jax.random.key(0), x)
    assert len(pipe.layers) >= pipe.num_stages
    native = pipe.unpack(variables)
    if isinstance(model, nnx.Module):
        want = nnx.state(model)
    else:
        want = jax.eval_shape(model.init, {"params": RNG, "dropout": RNG},
                              jax.tree.map(lambda a: a[:1], x))
    assert jax.tree.structure(native) == jax.tree.structure(want)
    assert [(a.shape, a.dtype) for a in _arrays(native)] == \
        [(a.shape, a.dtype) for a in _arrays(want)]
    for a, b in zip(jax.tree.leaves(pipe.pack(native)), jax.tree.leaves(variables)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return pipe, variables, native


@pytest.mark.parametrize("name,data,pipe_size,schedule,M,options", [
    ("vit", 1, 2, "interleaved", 2, dict(virtual_stages=2)),
    ("unet", 1, 4, "1f1b", 2, dict(planner=False)),
    ("scan_remat", 2, 2, "zb-h1", 2, {}),
    ("dict_lm", 1, 4, "gpipe", 2, dict(planner=False)),
    ("nnx_cnn", 2, 2, "1f1b", 2, {}),
    ("nnx_mixer", 2, 2, "gpipe", 2, dict(planner=False)),
    ("nnx_scan", 1, 2, "1f1b", 2, dict(planner=False)),
])
def test_unseen_model_matches_unsplit(name, data, pipe_size, schedule, M, options):
    model = _model(name)
    x, t, loss_fn, rng, (pipe, variables, native) = split_case(
        model, CASES[name], data, pipe_size, schedule, M, options)
    loss, grads, new = pipe.value_and_grad(loss_fn)(variables, x, t, rng)
    ref_loss, ref_grads, ref_stats = _reference(name, model, native, loss_fn, x, t, data, M, rng)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    got = pipe.unpack({**variables, "params": grads})
    got = nnx.filter_state(got, nnx.Param) if isinstance(got, nnx.State) else got["params"]
    _close(jax.tree.leaves(got), ref_grads, "grads")
    if ref_stats is not None:
        got = pipe.unpack(new)
        got = (nnx.filter_state(got, nnx.BatchStat) if isinstance(got, nnx.State)
               else got["batch_stats"])
        _close(jax.tree.leaves(got), ref_stats, "batch_stats")

    if name not in ("unet", "nnx_scan"):   # the others' evaluation graph differs
        _close(pipe.apply(variables, x), _eval(model, native, x), "apply")


# --- regressions --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["scan_remat", "nnx_cnn"])
def test_evaluation_needs_no_rng(name):
    # flax's lifted scan splits the dropout rng per layer even when dropout is off, and
    # an NNX model's rng streams were outputs of the traced program: either way the
    # evaluation pieces asked for a key, and pipe.apply(variables, x) failed with
    # "pass rng=". Only training should draw.
    model = _model(name)
    x = jax.tree.map(lambda a: a[:2], CASES[name][1](2, 0)[0])
    split = SplitModel(model, x, max_pieces=4)
    needs = lambda train: [s.needs_key for s in split._segments(split._x_abs, train)[1]]
    assert any(needs(True)) and not any(needs(False))


def test_a_model_with_two_inputs_is_told_to_wrap_them():
    class TwoInputs(nn.Module):
        @nn.compact
        def __call__(self, x, cond, train: bool = False):
            return nn.Dense(3)(x * nn.Dense(5)(cond))

    x, _ = _vectors(4, 0)
    with pytest.raises(ValueError, match=r"takes 2 inputs \(x, cond\).*model\(\*inputs\)"):
        jp.Pipeline(TwoInputs(), mesh=jh.make_mesh(data=1, pipe=2), sample_inputs=(x, x))
    split = SplitModel(TwoInputs(), x, call_kwargs={"cond": x[0]})   # a constant: fine
    assert split.num_pieces >= 1


class LearnedNoise(nn.Module):
    """Returns one of its parameters as an output (a learned noise scale for a Gaussian
    likelihood): it is read by no operation, only by the last piece."""
    @nn.compact
    def __call__(self, x):
        log_sigma = self.param("log_sigma", nn.initializers.constant(0.2), (3,))
        h = jnp.tanh(nn.Dense(8)(jnp.tanh(nn.Dense(8)(x))))
        return {"mean": nn.Dense(3)(h), "log_sigma": log_sigma}


def _gaussian_nll(out, t):
    return jnp.mean(0.5 * ((t - out["mean"]) / jnp.exp(out["log_sigma"])) ** 2 + out["log_sigma"])


def test_a_variable_returned_as_an_output():
    # It was held by no piece: KeyError in the planner's piece costs and in run_piece.
    from jaxhybrid.layers import apply_layer
    from jaxhybrid.splitter.costs import piece_costs
    model = LearnedNoise()
    x, t = _vectors(4, 0)
    native = model.init(jax.random.key(0), x)
    split = SplitModel(model, x, max_pieces=4)
    assert split.num_pieces >= 3
    assert len(piece_costs(split, x)) == split.num_pieces

    def pieces(params):
        h = x
        for piece, v in zip(split.layers, split.to_layer_vars({"params": params})):
            h, _ = apply_layer(piece, v, h, train=True)
        return _gaussian_nll(h, t)

    whole = lambda params: _gaussian_nll(model.apply({"params": params}, x), t)
    (l1, g1), (l2, g2) = [jax.value_and_grad(f)(native["params"]) for f in (pieces, whole)]
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
    _close(g1, g2, "grads")
