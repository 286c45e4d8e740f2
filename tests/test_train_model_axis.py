"""train_and_evaluate with a tensor-parallel "model" mesh axis (config mesh.model): GPT
tiny on (data, pipe, model) = (2, 2, 2) trains with the losses of (2, 4, 1), gradient
clipping and weight decay included; its checkpoints restore into model=1 layouts and
back (they store whole layers); a degree that does not fit fails in one line first."""
import json
import shutil

import jax
import numpy as np
import pytest

from jaxhybrid import checkpoint, optim, portable, train
from jaxhybrid.config_flags import load_config

# Both split a batch of 16 into the same 8 microbatches of 2 (dropout keys per microbatch).
LAYOUTS = {(2, 4, 1): (4, (1, 2, 3)), (2, 2, 2): (4, (2,)), (1, 2, 4): (8, (2,)),
           (2, 2, 1): (4, (2,))}


def config(data, pipe, model, **overrides):
    m, bounds = LAYOUTS[(data, pipe, model)]
    return load_config("gpt_hybrid.py", {
        "model.size": "tiny", "mesh.data": data, "mesh.pipe": pipe, "mesh.model": model,
        "pipeline.num_microbatches": m, "pipeline.boundaries": bounds,
        "train.batch_size": 16, "train.steps": 4, "train.warmup_steps": 1,
        "train.log_every": 1, "train.eval_every": 0, "train.eval_steps": 1,
        "data.options.max_bytes": 40_000, "checkpoint.every": 2, **overrides})


def losses(workdir, key="train_loss"):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r[key] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for layout in [(2, 4, 1), (2, 2, 2)]:
        workdir = tmp_path_factory.mktemp("x".join(map(str, layout)))
        train.train_and_evaluate(config(*layout), workdir)
        out[layout] = workdir
    return out


def test_model_parallel_run_has_the_losses_of_model_1(runs):
    one, two = losses(runs[(2, 4, 1)]), losses(runs[(2, 2, 2)])
    assert sorted(two) == [1, 2, 3, 4]
    # Clipping (grad_clip_norm 1) and weight decay in the config: the norm counts each
    # replicated leaf once, the decay mask covers the split kernels.
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)],
                               rtol=1e-5)
    for key in ("grad_norm", "param_norm"):
        a, b = losses(runs[(2, 4, 1)], key), losses(runs[(2, 2, 2)], key)
        np.testing.assert_allclose([b[s] for s in sorted(b)], [a[s] for s in sorted(a)],
                                   rtol=1e-5)
    assert max(losses(runs[(2, 4, 1)], "grad_norm").values()) > 1.0   # clipping is on


def test_model_parallel_run_with_zero_has_the_losses_of_model_1(runs, tmp_path):
    # train.zero=1 on top: Adam slots P(("pipe", "model"), "data"), the updated params
    # gathered back to whole stage rows.
    train.train_and_evaluate(config(2, 2, 2, **{"train.steps": 2, "train.zero": 1,
                                                "checkpoint.every": 0}), tmp_path)
    one, two = losses(runs[(2, 4, 1)]), losses(tmp_path)
    assert sorted(two) == [1, 2]
    np.testing.assert_allclose([two[1], two[2]], [one[1], one[2]], rtol=1e-5)


def test_an_asynchronous_run_reports_the_norms_of_model_1(runs, tmp_path):
    # The asynchronous step took optax's norm of the packed buffers: a leaf every model
    # shard holds whole counted T times (grad_norm 5.35 against 3.87 at model=1). The
    # same pipe depth: the weights' staleness depends on it.
    overrides = {"pipeline.schedule": "pipedream", "train.grad_clip_norm": 0.0,
                 "train.weight_decay": 0.0, "train.steps": 2, "checkpoint.every": 0}
    for layout in [(2, 2, 1), (2, 2, 2)]:
        train.train_and_evaluate(config(*layout, **overrides), tmp_path / str(layout[2]))
    for key in ("train_loss", "grad_norm", "param_norm"):
        one, two = losses(tmp_path / "1", key), losses(tmp_path / "2", key)
        assert sorted(two) == [1, 2]
        np.testing.assert_allclose([two[1], two[2]], [one[1], one[2]], rtol=1e-5)


def _portable(layout, ckpt_dir, step):
    run = train.prepare(config(*layout))
    variables = run.pipe.init(jax.random.key(0), next(run.train_batches())[0])
    tx = optim.make_optimizer(config(*layout).train, optim.weight_decay_mask(run.pipe, variables))
    template = {"variables": variables, "opt_state": tx.init(variables["params"])}
    state, meta = checkpoint.Checkpointer(ckpt_dir, keep=2).restore(run.pipe, template, step)
    return portable.to_portable(run.pipe, state), meta


def test_checkpoints_move_between_model_degrees(runs, tmp_path):
    ckpt1, ckpt2 = runs[(2, 4, 1)] / "checkpoints", runs[(2, 2, 2)] / "checkpoints"
    # The model=2 run's step 2, restored on model=1 and on model=2: the same whole layers.
    into1, meta = _portable((2, 4, 1), ckpt2, 2)
    into2, _ = _portable((2, 2, 2), ckpt2, 2)
    assert meta["layout"]["model"] == 2
    for a, b in zip(jax.tree.leaves(into1), jax.tree.leaves(into2)):
        np.testing.assert_array_equal(a, b)
    # ... and equal (float rounding) to the model=1 run's own step 2.
    own, _ = _portable((2, 4, 1), ckpt1, 2)
    assert jax.tree.structure(own) == jax.tree.structure(into1)
    for a, b in zip(jax.tree.leaves(own), jax.tree.leaves(into1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # model=1's checkpoint restored on model=2 then saved again is model=1's.
    back, _ = _portable((2, 2, 2), ckpt1, 2)
    for a, b in zip(jax.tree.leaves(own), jax.tree.leaves(back)):
        np.testing.assert_array_equal(a, b)
    # Continue the model=2 run's step-2 checkpoint on model=1: steps 3-4 as model=1's.
    workdir = tmp_path / "moved"
    shutil.copytree(ckpt2 / "2", workdir / "checkpoints" / "2")
    train.train_and_evaluate(config(2, 4, 1), workdir)
    ref, new = losses(runs[(2, 4, 1)]), losses(workdir)
    assert sorted(new) == [3, 4]
    np.testing.assert_allclose([new[3], new[4]], [ref[3], ref[4]], rtol=1e-5)


@pytest.mark.parametrize("model,message", [
    (3, r"mesh.model=3: tensor parallel: num_heads=2 is not divisible by the model degree 3"),
    (5, r"mesh .*data=2 x pipe=1 x model=5 = 10 devices, but only 8"),
    (4, r"mesh.model=4: tensor parallel: num_heads=2 is not divisible by the model degree 4"),
])
def test_a_model_degree_that_does_not_fit_fails_in_one_line(tmp_path, model, message):
    overrides = {"mesh.data": 2, "mesh.pipe": 1, "mesh.model": model,
                 "pipeline.boundaries": ()}
    workdir = tmp_path / "w"
    with pytest.raises(train.ConfigError, match=message) as e:
        train.train_and_evaluate(config(2, 4, 1, **overrides), workdir)
    assert "\n" not in str(e.value)
    assert not workdir.exists()


def test_jitted_cut_at_model_2_equals_the_host_cut():
    # Stages on other processes: checkpoints are cut and packed by jitted programs
    # (jax.numpy split / concatenate of the model shards), the same trees as the host's.
    from test_multihost import assert_jitted_cut_equals_host_cut
    state, host, back = assert_jitted_cut_equals_host_cut(config(2, 2, 2))
    # Whole layers: the block's attention kernel [D, 3, heads, head dim] has all 2 heads.
    assert np.shape(host["layers"][1]["variables"]["params"]["c_attn"]["kernel"])[2] == 2
    # Packed again, the parameters are the ones we started from (padding is zeros there).
    for a, b in zip(jax.tree.leaves(state["variables"]), jax.tree.leaves(back["variables"])):
        np.testing.assert_array_equal(a, b)