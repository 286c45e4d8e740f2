"""More models in researchers' styles, beyond test_splitter_unseen.py, split as
docs/splitter.md tells a user and checked as there: loss, gradients per variable and new
batch statistics equal the unsplit model's, `pipe.unpack` gives the model's own tree and
`pipe.apply` equals the model in evaluation mode. Then regressions of what they broke.

linen: a module instance called twice (weights shared across stages) with a
`stop_gradient` path and a `(logits, aux_loss)` output; an `nn.vmap` ensemble with
`Dropout(broadcast_dims=...)`; a weight-tied recurrence in `lax.fori_loop` and
`nn.while_loop`; a rotary-embedding GLU LM with RMSNorm, a `(ids, mask, aux)` tuple input,
`jnp.where` masking, `Embed.attend` head, bfloat16 activations and a dict of heads.
NNX: an `nnx.Dict` of submodules sharing one `nnx.Param`, BatchNorm in residual blocks.
"""
import functools
import inspect

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
from test_splitter_unseen import _eval, split_case


# --- linen models -------------------------------------------------------------------
class SharedTrunk(nn.Module):
    """One Dense applied at the start and again at the end (weights cross the cut), a
    frozen `stop_gradient` feature path, and a (logits, aux_loss) output."""
    @nn.compact
    def __call__(self, x, train: bool = False):
        shared = nn.Dense(8, name="shared")
        h = jnp.tanh(shared(nn.Dense(8)(x)))
        frozen = jax.lax.stop_gradient(nn.Dense(8, name="probe")(h))
        h = nn.gelu(nn.Dense(8)(h)) + 0.1 * frozen
        h = nn.Dropout(0.2, deterministic=not train)(h)
        h = jnp.tanh(shared(h))   # again, in another stage
        aux = jnp.mean(h ** 2)    # a scalar output: loss_fn combines it per microbatch
        return nn.Dense(5)(h), aux


class Member(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        h = nn.relu(nn.Dense(8)(x))
        h = nn.Dropout(0.3, broadcast_dims=(1,), deterministic=not train)(h)
        return nn.Dense(3)(h)


class Ensemble(nn.Module):
    """Four members by `nn.vmap` over a leading ensemble axis (stacked params, per-member
    dropout), averaged; inputs [b, tokens, feat]."""
    @nn.compact
    def __call__(self, x, train: bool = False):
        members = nn.vmap(Member, variable_axes={"params": 0},
                          split_rngs={"params": True, "dropout": True},
                          in_axes=(None, None), out_axes=0, axis_size=4)
        h = nn.LayerNorm()(nn.Dense(8)(x))
        y = members(name="members")(h, train)            # [4, b, tokens, 3]
        return nn.Dense(3)(y.mean(0).mean(1))


class Loops(nn.Module):
    """Weight-tied recurrence in `lax.fori_loop` (static trip count: a scan) over
    parameters read as constants; a spectrally normalised Dense whose power iteration is
    a `lax.while_loop` (until converged) on `stop_gradient` of its kernel."""
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.orthogonal(), (8, 8))
        b = self.param("b", nn.initializers.zeros, (8,))
        h = nn.Dense(8)(x)
        h = jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(h @ w + b + 0.1 * i), h)
        h = nn.LayerNorm()(h)
        k = self.param("sn_kernel", nn.initializers.lecun_normal(), (8, 8))
        ks = jax.lax.stop_gradient(k)

        def step(c):
            u, _, i = c
            v = ks.T @ u / jnp.linalg.norm(ks.T @ u)
            u2 = ks @ v / jnp.linalg.norm(ks @ v)
            return u2, jnp.abs(u2 - u).max(), i + 1
        u, _, _ = jax.lax.while_loop(lambda c: (c[1] > 1e-6) & (c[2] < 50), step,
                                     (jnp.ones(8) / np.sqrt(8), jnp.float32(1), 0))
        v = jax.lax.stop_gradient(k.T @ u / jnp.linalg.norm(k.T @ u))
        h = h + jnp.tanh(h @ (k / (u @ k @ v)))
        return nn.Dense(3)(h)


def rope(x):
    """Rotary position embedding of x [b, t, heads, d]."""
    t, d = x.shape[1], x.shape[-1] // 2
    freq = 1.0 / 10000 ** (jnp.arange(d) / d)
    ang = jnp.arange(t)[:, None] * freq[None]
    sin, cos = jnp.sin(ang)[None, :, None], jnp.cos(ang)[None, :, None]
    x1, x2 = x[..., :d], x[..., d:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


class RopeBlock(nn.Module):
    width: int
    dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x, keep, deterministic):
        b, t, _ = x.shape
        qkv = nn.DenseGeneral((3, 2, self.width // 2), dtype=self.dtype)(nn.RMSNorm()(x))
        q, k, v = rope(qkv[:, :, 0]), rope(qkv[:, :, 1]), qkv[:, :, 2]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(self.width // 2)
        allowed = (jnp.tril(jnp.ones((t, t), bool))[None, None]) & keep[:, None, None, :]
        s = jnp.where(allowed, s, -1e9)
        h = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s).astype(self.dtype), v)
        x = x + nn.DenseGeneral(self.width, axis=(-2, -1), dtype=self.dtype)(h)
        g = nn.Dense(2 * self.width, dtype=self.dtype)(nn.RMSNorm()(x))
        a, gate = jnp.split(g, 2, -1)
        h = nn.Dropout(0.1)(a * nn.silu(gate), deterministic=deterministic)   # SwiGLU
        return x + nn.Dense(self.width, dtype=self.dtype)(h).astype(x.dtype)


class RopeLM(nn.Module):
    """(ids, keep mask, float aux features) in; {"logits", "score", "pooled"} out."""
    vocab: int = 11
    width: int = 16
    depth: int = 2

    @nn.compact
    def __call__(self, inputs, deterministic: bool = True):
        ids, keep, aux = inputs
        keep = keep.astype(bool)
        embed = nn.Embed(self.vocab, self.width, name="embed")
        x = embed(ids) + nn.Dense(self.width, name="aux_proj")(aux)[:, None]
        for _ in range(self.depth):
            x = RopeBlock(self.width)(x, keep, deterministic)
        x = nn.RMSNorm()(x)
        x = jnp.where(keep[..., None], x, 0.0)
        pooled = x.sum(1) / jnp.maximum(keep.sum(1, keepdims=True), 1)
        return {"logits": embed.attend(x), "score": nn.Dense(1)(pooled)[:, 0], "pooled": pooled}


class DropPath(nn.Module):
    """Stochastic depth as timm / big_vision write it: one draw per example."""
    rate: float

    @nn.compact
    def __call__(self, x, train):
        if not train:
            return x
        keep = jax.random.bernoulli(self.make_rng("dropout"), 1 - self.rate, (x.shape[0], 1))
        return jnp.where(keep, x / (1 - self.rate), 0.0)


class NormedNet(nn.Module):
    """nn.SpectralNorm (its power-iteration state in "batch_stats", updated when
    `update_stats`), nn.WeightNorm, DropPath via make_rng, a step counter in a collection
    of its own, and a layer with bfloat16 parameters."""
    @nn.compact
    def __call__(self, x, train: bool = False):
        count = self.variable("counters", "steps", lambda: jnp.zeros((), jnp.int32))
        if train:
            count.value += 1
        h = nn.SpectralNorm(nn.Dense(8))(x, update_stats=train)
        h = nn.gelu(nn.WeightNorm(nn.Dense(8))(h))
        h = h + DropPath(0.25)(jnp.tanh(nn.Dense(8, param_dtype=jnp.bfloat16)(h)), train)
        h = h + DropPath(0.25)(jnp.tanh(nn.Dense(8)(h)), train)
        return nn.Dense(3)(h)


class MoE(nn.Module):
    """Top-1 mixture of experts (softmax router, top_k, one_hot dispatch, stacked expert
    kernels) with a load-balancing loss: (outputs, aux) out."""
    experts: int = 4

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x)
        probs = jax.nn.softmax(nn.Dense(self.experts, name="router")(h))
        gate, idx = jax.lax.top_k(probs, 1)
        dispatch = jax.nn.one_hot(idx[:, 0], self.experts)
        w1 = self.param("w1", nn.initializers.lecun_normal(), (self.experts, 8, 16))
        w2 = self.param("w2", nn.initializers.lecun_normal(), (self.experts, 16, 8))
        y = jnp.einsum("be,bd,edf->bf", dispatch, h, w1)
        y = jnp.einsum("be,bf,efd->bd", dispatch, nn.relu(y), w2) * gate
        balance = self.experts * jnp.sum(dispatch.mean(0) * probs.mean(0))
        return nn.Dense(3)(nn.LayerNorm()(h + y)), balance


# --- NNX model ----------------------------------------------------------------------
class ResBN(nnx.Module):
    def __init__(self, ch, shared: nnx.Linear, rngs):
        self.conv, self.bn = nnx.Conv(ch, ch, (3, 3), rngs=rngs), nnx.BatchNorm(ch, rngs=rngs)
        self.shared = shared   # one Linear referenced by every block

    def __call__(self, x):
        return nnx.relu(x + self.shared(self.bn(self.conv(x))))


class NnxSharedRes(nnx.Module):
    """An nnx.Dict of residual blocks with BatchNorm that all hold the same Linear
    (one nnx.Param shared between layers), plus a head."""
    def __init__(self, rngs: nnx.Rngs, ch: int = 6):
        self.stem = nnx.Conv(3, ch, (3, 3), rngs=rngs)
        shared = nnx.Linear(ch, ch, rngs=rngs)
        self.blocks = nnx.Dict({f"b{i}": ResBN(ch, shared, rngs) for i in range(3)})
        self.head = nnx.Linear(ch, 5, rngs=rngs)

    def __call__(self, x):
        h = self.stem(x)
        for name in sorted(self.blocks):
            h = self.blocks[name](h)
        return self.head(h.mean((1, 2)))


# --- data, losses -------------------------------------------------------------------
def _vec(b, seed, shape=(5,)):
    r = np.random.RandomState(seed)
    return r.randn(b, *shape).astype(np.float32), r.randint(0, 5, (b,)).astype(np.int32)


def _seq(b, seed):
    x, _ = _vec(b, seed, (3, 5))
    return x, np.random.RandomState(seed + 1).randn(b, 3).astype(np.float32)


def _vec3(b, seed):
    r = np.random.RandomState(seed)
    return r.randn(b, 5).astype(np.float32), r.randn(b, 3).astype(np.float32)


def _images(b, seed):
    r = np.random.RandomState(seed)
    return r.randn(b, 6, 6, 3).astype(np.float32), r.randint(0, 5, (b,)).astype(np.int32)


def _lm_batch(b, seed):
    r = np.random.RandomState(seed)
    ids = r.randint(0, 11, (b, 6)).astype(np.int32)
    keep = (np.arange(6)[None] < r.randint(3, 7, (b, 1))).astype(np.int32)
    aux = r.randn(b, 4).astype(np.float32)
    t = {"ids": np.roll(ids, -1, 1), "score": r.randn(b).astype(np.float32)}
    return (ids, keep, aux), t


def aux_loss(out, labels):
    logits, aux = out
    return xent(logits, labels) + 0.1 * aux


def moe_loss(out, t):
    return mse(out[0], t) + 1e-2 * out[1]


def lm_loss(out, t):
    return (xent(out["logits"].astype(jnp.float32), t["ids"]) + mse(out["score"], t["score"])
            + 1e-2 * jnp.mean(out["pooled"] ** 2))


CASES = {   # name: (model factory, batch maker, loss, uses dropout)
    "shared_trunk": (SharedTrunk, _vec, aux_loss, True),
    "ensemble": (Ensemble, _seq, mse, True),
    "loops": (Loops, _vec3, mse, False),
    "rope_lm": (RopeLM, _lm_batch, lm_loss, True),
    "normed": (NormedNet, _vec3, mse, True),
    "moe": (MoE, _vec3, moe_loss, False),
    "nnx_shared_res": (lambda: NnxSharedRes(nnx.Rngs(0)), _images, xent, False),
}


@functools.lru_cache(maxsize=None)
def _model(name):
    return CASES[name][0]()


def _close_dtype(got, want, what):
    """_close, but a bfloat16 leaf within ~2 ulps of its largest entry, each entry
    (gradients summed over microbatches in bfloat16, in another order than jax.grad of
    the unsplit model: a small entry can be many of its own ulps off)."""
    for a, b in zip(got, want):
        assert a.dtype == b.dtype, what
        if a.dtype == jnp.bfloat16:
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(a, b, rtol=2 ** -7, atol=2 ** -7 * np.abs(b).max())
        else:
            _close(a, b, what)


def _reference(model, native, loss_fn, x, t, data, M, rng):
    """(loss, gradient leaves, new batch_stats leaves or None) of the unsplit model."""
    if isinstance(model, nnx.Module):
        loss, grads, new = _nnx_reference(model, x, t, data, M, loss_fn, rng)
        return loss, jax.tree.leaves(grads), jax.tree.leaves(new) or None
    layer = model
    if "deterministic" in inspect.signature(type(model).__call__).parameters:
        from test_splitter_unseen import with_train
        layer = with_train(model)
    loss, grads, new = jp.reference_value_and_grad([layer], [native], loss_fn, x, t, data=data,
                                                   num_microbatches=M, rng=rng)
    state = {k: v for k, v in new[0].items() if k != "params"}   # batch_stats, counters
    return loss, jax.tree.leaves(grads[0]), jax.tree.leaves(state) or None


@pytest.mark.parametrize("name,data,pipe_size,schedule,M,options", [
    ("shared_trunk", 1, 2, "interleaved", 2, dict(virtual_stages=2, planner=False)),
    ("ensemble", 2, 2, "zb-h1", 2, {}),
    ("loops", 1, 4, "1f1b", 2, dict(planner=False)),
    ("rope_lm", 1, 2, "gpipe", 2, {}),
    ("normed", 2, 2, "1f1b", 2, dict(planner=False)),
    ("moe", 1, 2, "interleaved", 2, dict(virtual_stages=2)),
    ("nnx_shared_res", 2, 2, "1f1b", 2, dict(planner=False)),
])
def test_unseen_model_matches_unsplit(name, data, pipe_size, schedule, M, options):
    model = _model(name)
    x, t, loss_fn, rng, (pipe, variables, native) = split_case(
        model, CASES[name], data, pipe_size, schedule, M, options)
    loss, grads, new = pipe.value_and_grad(loss_fn)(variables, x, t, rng)
    ref_loss, ref_grads, ref_stats = _reference(model, native, loss_fn, x, t, data, M, rng)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    got = pipe.unpack({**variables, "params": grads})
    got = nnx.filter_state(got, nnx.Param) if isinstance(got, nnx.State) else got["params"]
    _close_dtype(jax.tree.leaves(got), ref_grads, "grads")
    if ref_stats is not None:
        got = pipe.unpack(new)
        got = nnx.filter_state(got, nnx.BatchStat) if isinstance(got, nnx.State) else \
            {k: v for k, v in got.items() if k != "params"}
        _close([np.asarray(a, np.float32) for a in jax.tree.leaves(got)], ref_stats, "state")
    got, want = pipe.apply(variables, x), _eval(model, native, x)
    if name in ("shared_trunk", "moe"):   # the scalar comes back per microbatch (Limits)
        mb = len(t) // (data * M)
        want = (want[0], jnp.stack([_eval(model, native, x[i * mb:(i + 1) * mb])[1]
                                    for i in range(data * M)]))
    _close(got, want, "apply")


# --- regressions --------------------------------------------------------------------
class Tempered(nn.Module):
    @nn.compact
    def __call__(self, inputs):
        return nn.Dense(3)(jnp.tanh(nn.Dense(8)(inputs["x"]))) / inputs["temperature"]


def test_an_input_leaf_that_is_not_per_example_is_told_to_be_a_constant():
    # A scalar among the inputs ({"x": [b, 5], "temperature": 0.5}): pipe.init failed
    # with an IndexError reading the batch size off the first leaf (and a [3, 5] table
    # would have been cut into microbatches). Now both say what to do.
    x, t = _vec3(8, 0)
    for inputs in ({"x": x, "temperature": np.float32(0.5)}, {"x": x, "temperature": x[:3]}):
        pipe = jp.Pipeline(Tempered(), mesh=jh.make_mesh(data=2, pipe=2), num_microbatches=2)
        with pytest.raises(ValueError, match=r"same leading batch dimension.*call_kwargs="):
            pipe.init(jax.random.key(0), inputs)
    # A nested Python list is a tree of scalars to jax: was "got ['None']", call_kwargs=.
    with pytest.raises(ValueError, match=r"sample_inputs is a Python list of numbers; pass an "
                                         r"array, e.g. np.asarray\(sample_inputs\)"):
        pipe.init(jax.random.key(0), x.tolist())


class VAE(nn.Module):
    """Samples its latent in evaluation mode too; (reconstruction, KL) out."""
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(8)(x))
        mu, logvar = nn.Dense(4)(h), nn.Dense(4)(h)
        z = mu + jnp.exp(0.5 * logvar) * jax.random.normal(self.make_rng("dropout"), mu.shape)
        kl = -0.5 * jnp.sum(1 + logvar - mu ** 2 - jnp.exp(logvar), -1)
        return nn.Dense(5)(jnp.tanh(nn.Dense(8)(z))), kl


def test_a_model_sampling_in_evaluation_mode_is_told_to_pass_rng_to_apply():
    # pipe.apply(variables, x) of a VAE said "draws random numbers while training; pass
    # rng=: pipe.apply(variables, inputs, train=True, ...)": the wrong mode and a fix that
    # switches dropout on. It names evaluation mode and apply(..., rng=key) now, and that
    # call gives the model's sample with microbatch g's key layer_rng(key, g, 0).
    from jaxhybrid.layers import layer_rng
    model, (x, _), M = VAE(), _vec(4, 0), 2
    split = SplitModel(model, x[:2], max_pieces=4, min_pieces=2)
    pipe = jp.Pipeline(split, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=M,
                       boundaries=jp.even_boundaries(split.num_pieces, 2), remat="none")
    variables = pipe.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"in evaluation mode \(train=False\).*"
                                         r"pipe\.apply\(variables, inputs, rng=key\)\."):
        pipe.apply(variables, x)
    native, mb = pipe.unpack(variables), len(x) // M
    got = pipe.apply(variables, x, rng=RNG)
    want = [model.apply(native, x[g * mb:(g + 1) * mb], rngs={"dropout": layer_rng(RNG, g, 0)})
            for g in range(M)]
    _close(got[0], jnp.concatenate([w[0] for w in want]), "sample")
    _close(got[1], jnp.concatenate([w[1] for w in want]), "kl")


class TrainFlagNet(nnx.Module):
    """An NNX model taking `train=` (default False), as NNX code often does."""
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.l2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x, train: bool = False):
        return self.l2(jnp.tanh(self.bn(self.l1(x), use_running_average=not train)))


def test_an_nnx_model_taking_train_is_passed_it():
    # Its `train` attribute is nnx.Module.train, a method: taken for a mode fixed in the
    # constructor, the model was never passed train=True and trained in evaluation mode.
    model = TrainFlagNet(nnx.Rngs(0))
    x = jnp.asarray(np.random.RandomState(0).randn(8, 4), jnp.float32)
    y = jnp.asarray(np.random.RandomState(1).randn(8, 3), jnp.float32)
    mse = lambda out, t: jnp.mean((out - t) ** 2)
    pipe = jp.Pipeline(model, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=1,
                       remat="none", sample_inputs=x)
    v = pipe.init(jax.random.key(0), x)
    loss, _, _ = pipe.value_and_grad(mse)(v, x, y)
    np.testing.assert_allclose(np.asarray(pipe.apply(v, x)),
                               np.asarray(nnx.clone(model)(x, train=False)), rtol=1e-5, atol=1e-6)
    want = mse(nnx.clone(model)(x, train=True), y)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)


def test_unpacked_variables_update_an_nnx_model_that_trains_on():
    # pipe.unpack gave read-only views of the fetched buffers: after nnx.update, the
    # model's next BatchNorm update failed ("assignment destination is read-only").
    model = TrainFlagNet(nnx.Rngs(0))
    x = jnp.asarray(np.random.RandomState(0).randn(8, 4), jnp.float32)
    pipe = jp.Pipeline(model, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=1,
                       remat="none", sample_inputs=x)
    unpacked = pipe.unpack(pipe.init(jax.random.key(0), x))
    assert all(a.flags.writeable for a in jax.tree.leaves(unpacked) if isinstance(a, np.ndarray))
    nnx.update(model, unpacked)
    model(x, train=True)
    assert np.abs(np.asarray(model.bn.mean[...])).max() > 0


class FrozenBackbone(nnx.Module):
    """A backbone BatchNorm built frozen (fine-tuning) beside a head that trains."""
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, use_running_average=True, rngs=rngs)
        self.l2 = nnx.Linear(8, 8, rngs=rngs)
        self.bn2 = nnx.BatchNorm(8, rngs=rngs)
        self.l3 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.bn1(self.l1(x)))
        return self.l3(jnp.tanh(self.bn2(self.l2(h))))


def test_nnx_modules_set_apart_in_evaluation_mode_stay_so_in_training():
    # Every module was put in training mode: the frozen BatchNorm's statistics moved and
    # every gradient was off.
    model = FrozenBackbone(nnx.Rngs(0))
    model.bn1.mean[...] = jnp.linspace(-1.0, 1.0, 8)
    x = jnp.asarray(np.random.RandomState(0).randn(8, 4), jnp.float32)
    y = jnp.asarray(np.random.RandomState(1).randn(8, 3), jnp.float32)
    mse = lambda out, t: jnp.mean((out - t) ** 2)
    ref = nnx.clone(model)
    want, g_ref = nnx.value_and_grad(lambda m: mse(m(x), y))(ref)
    pipe = jp.Pipeline(model, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=1,
                       remat="none", sample_inputs=x)
    v = pipe.init(jax.random.key(0), x)
    loss, _, new = pipe.value_and_grad(mse)(v, x, y)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    state = pipe.unpack(new)           # the model's own nnx.State
    np.testing.assert_allclose(np.asarray(state["bn1"]["mean"][...]), np.linspace(-1, 1, 8),
                               rtol=1e-6)      # frozen: unchanged
    np.testing.assert_allclose(np.asarray(state["bn2"]["mean"][...]),
                               np.asarray(ref.bn2.mean[...]), rtol=1e-5, atol=1e-6)
