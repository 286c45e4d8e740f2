"""Input pipelines: batch shapes and order, evaluation padding, the content of each
dataset, datasets that fit every model, and placement on the mesh."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxhybrid as jh
from jaxhybrid import data, models
from jaxhybrid.data import digits, text, translation
from jaxhybrid.data.dataset import Dataset

SMALL = {"digits": dict(image_size=16), "stdlib_text": dict(max_bytes=100_000, seq_len=32),
         "translation": dict(num_train=300, num_test=70)}


def _ds(name, split="train", batch_size=8, seed=0, **options):
    return data.get_dataset(name, split, batch_size=batch_size, seed=seed,
                            **{**SMALL[name], **options})


def _equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _index_dataset(n=23, batch_size=5, seed=0):
    """Examples whose value is their index, to follow where each one goes."""
    return Dataset("index", "train", (np.arange(n), np.arange(n) * 10), batch_size=batch_size,
                   seed=seed, pad_values=(-7, -1))


# --- batching ----------------------------------------------------------------------
@pytest.mark.parametrize("name", list(data.DATASETS))
def test_batches_match_element_spec(name):
    ds = _ds(name, batch_size=8)
    spec = ds.element_spec
    for batch in itertools.islice(ds.batches(), 3):
        assert jax.tree.structure(batch) == jax.tree.structure(spec)
        for leaf, s in zip(jax.tree.leaves(batch), jax.tree.leaves(spec)):
            assert isinstance(leaf, np.ndarray)
            assert leaf.shape == s.shape and leaf.dtype == s.dtype and leaf.shape[0] == 8
    assert ds.steps_per_epoch == ds.num_examples // 8
    assert len(list(ds.batches(epochs=2))) == 2 * ds.steps_per_epoch


def test_epochs_are_permutations_reshuffled_and_reproducible():
    ds = _index_dataset(n=23, batch_size=5, seed=3)
    epochs = [np.concatenate([x for x, _ in ds.batches(epochs=1)])]
    both = np.concatenate([x for x, _ in ds.batches(epochs=2)])
    epochs.append(both[20:])
    for e in epochs:                              # 4 batches of 5; 3 examples dropped
        assert len(e) == 20 and len(set(e.tolist())) == 20
    assert np.array_equal(both[:20], epochs[0])   # same seed -> same order
    assert not np.array_equal(epochs[0], epochs[1])   # reshuffled every epoch
    other = np.concatenate([x for x, _ in _index_dataset(seed=4).batches(epochs=1)])
    assert not np.array_equal(other, epochs[0])
    x, y = next(ds.batches())
    assert np.array_equal(y, x * 10)              # inputs and targets stay paired
    ordered = np.concatenate([x for x, _ in ds.batches(epochs=1, shuffle=False)])
    assert np.array_equal(ordered, np.arange(20))


def test_start_resumes_the_same_stream():
    ds = _index_dataset(n=23, batch_size=5, seed=3)
    stream = [x for x, _ in itertools.islice(ds.batches(), 11)]
    resumed = [x for x, _ in itertools.islice(ds.batches(start=6), 5)]
    assert _equal(resumed, stream[6:])
    finite = [x for x, _ in ds.batches(epochs=3, start=6)]
    assert len(finite) == 3 * 4 - 6 and _equal(finite[:5], stream[6:])


def test_infinite_batches_keep_going():
    ds = _index_dataset(n=7, batch_size=3)
    assert len(list(itertools.islice(ds.batches(), 50))) == 50


@pytest.mark.parametrize("name", list(data.DATASETS))
def test_same_seed_same_batches(name):
    a = list(itertools.islice(_ds(name, seed=1).batches(), 3))
    b = list(itertools.islice(_ds(name, seed=1).batches(), 3))
    c = list(itertools.islice(_ds(name, seed=2).batches(), 3))
    assert _equal(a, b) and not _equal(a, c)


# --- evaluation padding -------------------------------------------------------------
@pytest.mark.parametrize("name", list(data.DATASETS))
def test_eval_batches_cover_every_example_once(name):
    ds = _ds(name, "test", batch_size=16)
    assert ds.num_examples % 16, "choose sizes that leave a partial last batch"
    batches = list(ds.eval_batches())
    assert len(batches) == ds.eval_steps == -(-ds.num_examples // 16)
    masks = [m for *_, m in batches]
    assert all(m.dtype == bool and m.shape == (16,) for m in masks)
    assert all(m.all() for m in masks[:-1]) and masks[-1].sum() == ds.num_examples % 16
    real = jax.tree.map(lambda *xs: np.concatenate(xs),
                        *[jax.tree.map(lambda a, m=m: a[m], (x, y)) for x, y, m in batches])
    expected = ds._gather(np.arange(ds.num_examples))
    assert _equal(real, expected)
    # Padding is marked where the model's loss looks too: label -1 / the pad token.
    x, y, m = batches[-1]
    pad_target = -1 if name == "digits" else ds.pad_id
    assert np.all(y[~m] == pad_target)


def test_padded_rows_do_not_change_metrics():
    spec = models.get_model("inception_v3", "tiny")
    _, y, m = list(_ds("digits", "test", batch_size=16).eval_batches())[-1]
    logits = jnp.asarray(np.random.RandomState(0).randn(16, 10), jnp.float32)
    full = spec.metrics_fn(logits, y)
    only_real = spec.metrics_fn(logits[m], y[m])
    assert float(full["count"]) == m.sum()
    np.testing.assert_allclose(full["loss"], only_real["loss"], rtol=1e-6)


# --- content of each dataset --------------------------------------------------------
def test_digits_read_directly_equal_sklearns_load_digits():
    """The loader reads the CSV scikit-learn ships without importing sklearn (seconds of
    start-up): the same pixels and labels as `load_digits`, and `load_digits` itself
    where the file is not where sklearn keeps it."""
    from unittest import mock

    from sklearn.datasets import load_digits
    ref = load_digits()
    pixels, labels = digits._raw_digits()
    assert pixels.dtype == ref.images.dtype and np.array_equal(pixels, ref.images)
    assert np.array_equal(labels, ref.target)
    with mock.patch.object(digits.os.path, "exists", return_value=False):
        pixels, labels = digits._raw_digits()
    assert np.array_equal(pixels, ref.images) and np.array_equal(labels, ref.target)


def test_digits_split_is_stratified_disjoint_and_normalised():
    from sklearn.datasets import load_digits
    labels = load_digits().target
    train_idx, test_idx = digits.stratified_split(labels, 0.2)
    assert len(np.intersect1d(train_idx, test_idx)) == 0
    assert len(train_idx) + len(test_idx) == len(labels) == 1797
    train = data.get_dataset("digits", "train", batch_size=8, image_size=8)
    test = data.get_dataset("digits", "test", batch_size=8, image_size=8)
    assert train.num_examples == len(train_idx) and test.num_examples == len(test_idx)
    counts = np.bincount(labels, minlength=10)
    test_counts = np.bincount(test.examples[1], minlength=10)
    assert np.all(np.abs(test_counts - 0.2 * counts) <= 0.5)   # every class 20% +- rounding
    assert np.array_equal(test_counts + np.bincount(train.examples[1], minlength=10), counts)
    x = train.examples[0]
    assert abs(x.mean()) < 1e-4 and abs(x.std() - 1) < 1e-4    # train statistics
    assert train.num_classes == 10


def test_digits_resize_matches_jax_image_resize():
    m = digits.bilinear_matrix(8, 75)
    np.testing.assert_allclose(m.sum(1), 1.0, atol=1e-12)
    img = np.random.RandomState(0).rand(8, 8)
    ours = m @ img @ m.T
    ref = jax.image.resize(jnp.asarray(img, jnp.float32), (75, 75), "linear")
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_digits_images_are_nhwc_rgb_of_the_requested_size():
    ds = _ds("digits", image_size=75)
    x, y = next(ds.batches())
    assert x.shape == (8, 75, 75, 3) and x.dtype == np.float32 and y.dtype == np.int32
    assert np.array_equal(x[..., 0], x[..., 2]) and 0 <= y.min() and y.max() < 10
    grey = _ds("digits", image_size=75, channels=1)
    assert next(grey.batches())[0].shape == (8, 75, 75, 1)


def test_text_targets_are_inputs_shifted_by_one():
    ds = _ds("stdlib_text", seq_len=32)
    x, y = next(ds.batches(shuffle=False))
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == np.int32
    assert np.array_equal(x[:, 1:], y[:, :-1])
    assert np.array_equal(x[1:, 0], y[:-1, -1])   # windows follow each other
    corpus = text.stdlib_bytes(100_000)
    assert np.array_equal(x.ravel(), corpus[:8 * 32])
    with open(next(text.stdlib_files()), "rb") as f:  # real stdlib source, first file first
        assert bytes(corpus[:64]) == f.read(64)
    assert 0 <= x.min() and x.max() < 256 and ds.vocab_size == 257


def test_text_train_and_test_partition_the_corpus():
    train, test = _ds("stdlib_text"), _ds("stdlib_text", "test")
    assert train.num_bytes + test.num_bytes == 100_000
    assert abs(test.num_bytes - 10_000) <= 1
    first_test = test.examples[0][0]
    corpus = text.stdlib_bytes(100_000)
    assert np.array_equal(first_test, corpus[train.num_bytes:train.num_bytes + 32])


def test_text_can_carry_targets_in_inputs():
    ds = _ds("stdlib_text", targets_in_inputs=True)
    (tokens, t), targets = next(ds.batches(shuffle=False))
    assert np.array_equal(t, targets) and np.array_equal(tokens[:, 1:], targets[:, :-1])


def test_translation_is_reversed_mapped_source():
    ds = _ds("translation")
    again = _ds("translation")
    assert _equal(ds.examples, again.examples)
    assert not _equal(ds.examples[0][0][:70], _ds("translation", "test").examples[0][0])
    (src, tgt_in), tgt_out = ds.examples
    for s, ti, to in zip(src[:50], tgt_in[:50], tgt_out[:50]):
        words = s[s != 0]
        n = len(words)
        assert 1 <= n <= 7 and np.all(s[n:] == 0) and np.all(words >= 3)
        assert np.array_equal(to[:n], translation.map_tokens(words[::-1], 3, 32, 1))
        assert to[n] == 2 and np.all(to[n + 1:] == 0)
        assert ti[0] == 1 and np.array_equal(ti[1:n + 1], to[:n]) and np.all(ti[n + 1:] == 0)
    assert set(np.unique(src[src != 0]).tolist()) == set(range(3, 32))


# --- datasets that fit the models ----------------------------------------------------
def _cheap_variables(spec, x):
    """Small random variables of the right shapes, drawn with numpy: these tests check
    that the data fits the model, and XLA:CPU needs tens of seconds to compile
    Inception's real initialisers (tests/test_models.py covers those)."""
    r = np.random.RandomState(0)
    return jax.tree.map(lambda s: r.uniform(0.01, 0.1, s.shape).astype(s.dtype),
                        models.spec.abstract_variables(spec.layers, x))


FIT = [("inception_v3", {}), ("gpt", {}), ("biglstm", {}), ("biglstm", {"num_sampled": 8}),
       ("gnmt", {})]


@pytest.mark.parametrize("name,overrides", FIT, ids=[f"{n}{o}" for n, o in FIT])
def test_for_model_batches_run_through_the_model(name, overrides):
    spec = models.get_model(name, "tiny", **overrides)
    opts = {"max_bytes": 50_000} if spec.task == "language_model" else {}
    ds = data.for_model(spec, "test", batch_size=4, **opts)
    x, y = next(ds.batches())
    sx, sy = spec.sample_batch(4)
    assert jax.tree.structure((x, y)) == jax.tree.structure((sx, sy))
    for a, b in zip(jax.tree.leaves((x, y)), jax.tree.leaves((sx, sy))):
        assert a.shape == b.shape and a.dtype == b.dtype
    variables = _cheap_variables(spec, x)
    apply = jax.jit(lambda v, x, train: spec.apply(v, x, train=train, rng=jax.random.key(1))[0],
                    static_argnums=2)
    out = apply(variables, x, bool(overrides))
    assert np.isfinite(float(spec.loss_fn(out, y)))
    ex, ey, mask = list(ds.eval_batches())[-1]
    out = apply(variables, ex, False)
    metrics = spec.metrics_fn(out, ey)
    per_example = np.prod(ey.shape[1:]) if ey.ndim > 1 else 1
    if spec.task == "translation":               # variable lengths: count real tokens
        assert float(metrics["count"]) == np.sum(ey[mask] != spec.config["pad_id"])
    else:                                        # padded rows count for nothing
        assert float(metrics["count"]) == mask.sum() * per_example


def test_for_model_rejects_models_the_data_cannot_feed():
    with pytest.raises(ValueError, match="vocab_size"):
        data.for_model(models.get_model("gpt", "tiny", vocab_size=100, pad_id=99), "train",
                       batch_size=4)
    with pytest.raises(ValueError, match="num_classes=10"):
        data.for_model(models.get_model("inception_v3", "tiny", num_classes=5), "train",
                       batch_size=4)


# --- placement ----------------------------------------------------------------------
def test_place_batch_shards_the_batch_over_data():
    mesh = jh.make_mesh(data=2, pipe=4)
    batch = next(_ds("translation", batch_size=8).batches())
    placed = data.place_batch(batch, mesh)
    for host, dev in zip(jax.tree.leaves(batch), jax.tree.leaves(placed)):
        assert isinstance(dev, jax.Array) and dev.sharding.spec == P("data")
        assert dev.sharding.mesh.shape == {"data": 2, "pipe": 4}
        np.testing.assert_array_equal(np.asarray(dev), host)
        shards = dev.addressable_shards
        assert len(shards) == 8 and all(s.data.shape[0] == 4 for s in shards)
        # replicated over pipe: the 4 devices of one data row hold the same rows
        assert sorted({s.index[0].start or 0 for s in shards}) == [0, 4]
    with pytest.raises(ValueError, match="multiple of 2"):
        data.place_batch(np.zeros((3, 2)), mesh)


def test_prefetch_to_mesh_keeps_order_and_places_every_batch():
    mesh = jh.make_mesh(data=2, pipe=4)
    ds = _index_dataset(n=40, batch_size=4)
    host = list(ds.batches(epochs=1))
    pulled = []

    def source():
        for b in host:
            pulled.append(1)
            yield b

    it = data.prefetch_to_mesh(source(), mesh, size=3)
    first = next(it)
    assert len(pulled) == 3                       # `size` batches placed ahead
    rest = list(it)
    assert len(rest) + 1 == len(host)
    for (hx, hy), (dx, dy) in zip(host, [first] + rest):
        assert dx.sharding.spec == P("data")
        np.testing.assert_array_equal(np.asarray(dx), hx)
        np.testing.assert_array_equal(np.asarray(dy), hy)
    with pytest.raises(ValueError, match="size"):
        next(data.prefetch_to_mesh(iter(host), mesh, size=0))


# --- errors -------------------------------------------------------------------------
@pytest.mark.parametrize("call,match", [
    (lambda: data.get_dataset("mnist", "train", batch_size=4), "digits"),
    (lambda: data.get_dataset("digits", "valid", batch_size=4), "train"),
    (lambda: data.get_dataset("digits", "train", batch_size=4, size=75), "image_size"),
    (lambda: data.get_dataset("stdlib_text", "train", batch_size=4, seqlen=8), "seq_len"),
    (lambda: data.get_dataset("translation", "train", batch_size=4, vocab=8), "vocab_size"),
    (lambda: data.get_dataset("digits", "train", batch_size=0), "batch_size"),
    (lambda: data.get_dataset("stdlib_text", "train", batch_size=4, pad_id=10), "pad_id"),
    (lambda: data.get_dataset("stdlib_text", "test", batch_size=4, max_bytes=100,
                              seq_len=64), "max_bytes"),
    (lambda: data.get_dataset("translation", "train", batch_size=4, tgt_len=1), "tgt_len"),
    (lambda: next(_ds("translation", "test", batch_size=100).batches()), "batch_size"),
])
def test_bad_requests_name_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()
