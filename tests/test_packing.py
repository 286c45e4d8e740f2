"""Shared buffer layouts: round trips, whole buffers for big leaves, no slice copies."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid.pipeline import packing

S = jax.ShapeDtypeStruct
BIG = packing.WHOLE_MIN


def _stage(blocks: int, head: bool = False):
    """Per-layer params like a residual MLP stage: big kernels, small biases, a head
    kernel much smaller than the others."""
    layers = [{"kernel": S((2 * BIG, 8), jnp.float32), "bias": S((8,), jnp.float32)}
              for _ in range(blocks)]
    if head:
        layers.append({"kernel": S((BIG,), jnp.float32), "bias": S((3,), jnp.float32),
                       "step": S((), jnp.int32)})
    return layers


def _random_like(tree, seed):
    r = np.random.default_rng(seed)
    return jax.tree.map(lambda a: (r.standard_normal(a.shape) * 10).astype(a.dtype), tree)


def test_round_trip_on_shared_buffers():
    trees = [_stage(4), _stage(4), _stage(3, head=True)]
    layouts, lengths = packing.shared_layouts(trees)
    for s, (tree, lay) in enumerate(zip(trees, layouts)):
        values = _random_like(tree, s)
        bufs = packing.pack(lay, values, lengths)
        assert {k: v.shape for k, v in bufs.items()} == {k: (n,) for k, n in lengths.items()}
        for a, b in zip(jax.tree.leaves(packing.unpack(lay, bufs)), jax.tree.leaves(values)):
            np.testing.assert_array_equal(a, b)
        host = packing.pack_numpy(lay, values, lengths)
        for k in lengths:
            np.testing.assert_array_equal(host[k], bufs[k])
        for a, b in zip(jax.tree.leaves(packing.unpack_numpy(lay, host)), jax.tree.leaves(values)):
            np.testing.assert_array_equal(a, b)


def test_big_leaves_get_whole_buffers():
    trees = [_stage(4), _stage(4), _stage(3, head=True)]
    layouts, lengths = packing.shared_layouts(trees)
    whole = {k for k in lengths if "#w" in k}
    # Four kernel buffers (the stage with three leaves one unused) and one for the head's
    # big kernel; biases and the int step go to the rest buffers.
    assert sorted(lengths[k] for k in whole) == [BIG] + [16 * BIG] * 4
    assert lengths["float32"] == 4 * 8 and lengths["int32"] == 1
    for lay in layouts:
        for shape, key in zip(lay.shapes, lay.keys):
            assert (key in whole) == (np.prod(shape) >= BIG)
    # Padding: the unused buffers cost under WHOLE_TOLERANCE more than packing flat.
    flat = max(sum(np.prod(l.shape) for l in jax.tree.leaves(t)) for t in trees)
    assert sum(lengths.values()) - 1 <= flat * (1 + packing.WHOLE_TOLERANCE)


def test_rare_big_leaf_stays_in_the_rest_buffer():
    # Stage 1 has a big leaf no other stage has, stage 0 as many values in small leaves:
    # a whole buffer would double every device's buffers, so the leaf is packed flat.
    small = [S((BIG // 2,), jnp.float32)] * 8
    trees = [small, [S((4 * BIG,), jnp.float32)]]
    _, lengths = packing.shared_layouts(trees)
    assert lengths == {"float32": 4 * BIG}
    # Where that stage pads anyway, the whole buffer is free and is taken.
    _, lengths = packing.shared_layouts([[S((8,), jnp.float32)], [S((4 * BIG,), jnp.float32)]])
    assert lengths == {"float32": 8, "float32#w0": 4 * BIG}


def test_values_that_travel_get_one_buffer_per_dtype():
    # Activations: one ppermute per buffer, so whole_min=None packs them flat; a lone
    # array still fills its buffer exactly and is read without a slice.
    trees = [{"h": S((BIG,), jnp.float32), "c": S((BIG,), jnp.float32), "ids": S((4,), jnp.int32)}] * 3
    layouts, lengths = packing.shared_layouts(trees, whole_min=None)
    assert lengths == {"float32": 2 * BIG, "int32": 4}
    lone, lengths = packing.shared_layouts([[S((BIG,), jnp.float32)]] * 2, whole_min=None)
    prims = {e.primitive.name for e in jax.make_jaxpr(
        lambda b: packing.unpack(lone[0], b))(packing.zeros(lengths)).eqns}
    assert "slice" not in prims


def test_whole_leaves_are_read_without_slicing():
    prims = lambda lay, lengths: {e.primitive.name for e in jax.make_jaxpr(
        lambda b: packing.unpack(lay, b))(packing.zeros(lengths)).eqns}
    kernels = [S((BIG,), jnp.float32)] * 2
    layouts, lengths = packing.shared_layouts([kernels, kernels])
    assert "slice" not in prims(layouts[1], lengths)
    layouts, lengths = packing.shared_layouts([[S((8,), jnp.float32)] * 2] * 2)
    assert "slice" in prims(layouts[1], lengths)


def test_pack_rejects_values_that_do_not_fit():
    lay = packing.layout_of([S((10,), jnp.float32)])
    with pytest.raises(ValueError, match="do not fit"):
        packing.pack(lay, [jnp.zeros(10)], {"float32": 5})
    with pytest.raises(ValueError, match="got 2 leaves"):
        packing.pack_numpy(lay, [np.zeros(10), np.zeros(1)], {"float32": 10})


def test_place_in_free_space_uses_dead_leaves_and_padding_then_spills():
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    # One row: a whole buffer of 8192 floats and a rest buffer of 3 + 5 floats.
    lays, lengths = packing.shared_layouts([[f32(8192), f32(3), f32(5)]])
    row = lays[0]
    # The whole buffer's leaf is dead: an 8192-float value takes it whole (offset 0).
    placed, spilled = packing.place_in_free_space(row, lengths, [False, True, True],
                                                  [f32(8192), f32(2)])
    assert spilled == [1] and placed.keys == ("float32#w0",) and placed.offsets == (0,)
    # The 3-float leaf is dead: a 2-float value fits there, a 4-float one does not.
    placed, spilled = packing.place_in_free_space(row, lengths, [True, False, True],
                                                  [f32(4), f32(2)])
    assert spilled == [0] and placed.keys == ("float32",) and placed.offsets == (0,)
    # Only live leaves' space is protected: nothing placed overlaps the live 5 floats.
    placed, _ = packing.place_in_free_space(row, lengths, [True, True, True], [f32(1)])
    assert placed.shapes == ()
    # A different dtype never lands in a float buffer.
    _, spilled = packing.place_in_free_space(row, lengths, [False, False, False],
                                             [jax.ShapeDtypeStruct((3,), jnp.int32)])
    assert spilled == [0]


def test_typed_prng_keys_round_trip_as_their_data():
    # A stashed residual of a rematerialised dropout (nnx.remat in nnx.scan) is a typed
    # key; canonicalize_dtype refused it ("called on extended dtype key<fry>").
    keys = jax.random.split(jax.random.key(5), 3)
    trees = [{"k": keys, "x": jnp.arange(4.0)}, {"k": keys[:2], "x": jnp.ones(2)}]
    layouts, lengths = packing.shared_layouts(trees)
    assert set(lengths) == {"float32", "uint32"} and lengths["uint32"] == 6
    for tree, lay in zip(trees, layouts):
        back = packing.unpack(lay, packing.pack(lay, tree, lengths))
        assert back["k"].dtype == keys.dtype
        np.testing.assert_array_equal(jax.random.key_data(back["k"]),
                                      jax.random.key_data(tree["k"]))
        np.testing.assert_array_equal(back["x"], tree["x"])
        host = packing.unpack_numpy(lay, packing.pack_numpy(lay, tree, lengths))
        np.testing.assert_array_equal(jax.random.key_data(host["k"]),
                                      jax.random.key_data(tree["k"]))
    row = packing.pack_into(layouts[1], {"k": keys[1:], "x": jnp.zeros(2)}, packing.zeros(lengths))
    np.testing.assert_array_equal(jax.random.key_data(packing.unpack(layouts[1], row)["k"]),
                                  jax.random.key_data(keys[1:]))
    placed, spilled = packing.place_in_free_space(layouts[0], lengths, [False, True],
                                                  [jax.ShapeDtypeStruct((2,), keys.dtype)])
    assert spilled == [] and placed.key_impls and placed.shapes == ((2, 2),)
