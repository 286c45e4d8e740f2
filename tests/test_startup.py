"""Fast start: the on-disk profile cache, one cost analysis per distinct layer, jax's
persistent compilation cache switch, the start-up phase clock, the host-built
weight-decay mask, the layers initialised in one program while planning, and the
script's CPU compile flags."""
import functools
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhybrid as jh
from jaxhybrid import optim, portable, startup, train
from jaxhybrid import pipeline as jp
from jaxhybrid.plan import cost_cache
from jaxhybrid.plan import costs as costs_mod
from jaxhybrid.plan import profile


class Dense(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(self.features)(x))


LAYERS = [Dense(16), Dense(16), Dense(16), Dense(8)]
X = np.ones((4, 16), np.float32)


def _count_cost_analyses(monkeypatch):
    calls = []
    real = costs_mod._layer_cost

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(costs_mod, "_layer_cost", counted)
    return calls


def test_one_cost_analysis_per_distinct_layer_and_input(monkeypatch):
    calls = _count_cost_analyses(monkeypatch)
    costs = profile(LAYERS, X, cache_dir=None)
    # Layer 0 (no input gradient), layers 1 and 2 (same layer, same input: once), layer 3.
    assert len(calls) == 3
    assert costs[1].fwd_flops == costs[2].fwd_flops and costs[1].name != costs[2].name
    assert [c.name for c in costs] == ["Dense_0", "Dense_1", "Dense_2", "Dense_3"]


def test_profile_compiles_on_a_thread_pool_with_the_same_costs(monkeypatch):
    """The cost-analysis compiles run on `COMPILE_THREADS` background threads while the
    next layer is traced; the costs equal those of compiling each in line."""
    threads = []
    real = costs_mod._compile
    monkeypatch.setattr(costs_mod, "_compile", lambda lowered, run: threads.append(
        threading.current_thread().name) or real(lowered, run))
    layers = [Block(16), Block(12), Block(12), Dense(8)]
    monkeypatch.setattr(costs_mod, "COMPILE_THREADS", 0)
    in_line = profile(layers, X, cache_dir=None)
    assert threads and not any(t.startswith("profile-compile") for t in threads)
    threads.clear()
    monkeypatch.setattr(costs_mod, "COMPILE_THREADS", 2)
    pooled = profile(layers, X, cache_dir=None)
    assert len(threads) == 8 and all(t.startswith("profile-compile") for t in threads)
    assert [c.to_dict() for c in pooled] == [c.to_dict() for c in in_line]


def test_profile_disk_cache_round_trip(tmp_path, monkeypatch):
    first = profile(LAYERS, X, cache_dir=tmp_path)
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    calls = _count_cost_analyses(monkeypatch)
    again = profile(LAYERS, X, cache_dir=tmp_path, names=list("abcd"))
    assert not calls                                   # read back, nothing analysed
    assert [c.name for c in again] == list("abcd")
    assert [c.fwd_flops for c in again] == [c.fwd_flops for c in first]
    # Another input shape or another layer is another entry.
    profile(LAYERS, np.ones((4, 8), np.float32), cache_dir=tmp_path)
    profile([Dense(32), *LAYERS[1:]], X, cache_dir=tmp_path)
    assert len(calls) == 3 + 4 and len(list((tmp_path / "costs").glob("*.json"))) == 3


class Apply(nn.Module):
    """A layer that applies a function it is given (a lambda, a closure)."""
    fn: object

    @nn.compact
    def __call__(self, x):
        return self.fn(x)


def _scaled(k):
    return lambda x: x * k


def test_layers_holding_other_functions_are_other_entries(tmp_path):
    """Every lambda's repr is "<function <lambda>>" and every closure of one factory has
    one name: the signature reads their code and captured values, so a layer holding
    another function is never given (in one profile, or from the disk cache) the costs
    of the first; the same function rebuilt shares its entry."""
    from jaxhybrid.plan.costs import layer_signature
    same, tiled = Apply(lambda x: x), Apply(lambda x: jax.numpy.tile(x, (1, 4)))
    assert layer_signature(same) != layer_signature(tiled)
    assert layer_signature(Apply(_scaled(2.0))) != layer_signature(Apply(_scaled(3.0)))
    assert layer_signature(Apply(_scaled(2.0))) == layer_signature(Apply(_scaled(2.0)))
    a = profile([same, Dense(8)], X, cache_dir=tmp_path)
    b = profile([tiled, Dense(8)], X, cache_dir=tmp_path)
    assert (a[0].out_bytes, b[0].out_bytes) == (X.nbytes, 4 * X.nbytes)
    assert b[1].param_bytes == (4 * 16 * 8 + 8) * 4 != a[1].param_bytes
    # In one profile too: each layer's output feeds the next with its own shape.
    both = profile([same, tiled, Dense(8)], X, cache_dir=None)
    assert [c.out_bytes for c in both] == [X.nbytes, 4 * X.nbytes, 4 * 8 * 4]


def test_unreadable_cache_entry_is_profiled_afresh(tmp_path):
    profile(LAYERS, X, cache_dir=tmp_path)
    (entry,) = (tmp_path / "costs").glob("*.json")
    entry.write_text("{half written")
    assert len(profile(LAYERS, X, cache_dir=tmp_path)) == 4
    assert entry.read_text().startswith("[")
    # A number edited to null or text (a TypeError in the planner's arithmetic before).
    rows = json.loads(entry.read_text())
    rows[1]["fwd_time"], rows[2]["param_bytes"] = None, "12"
    entry.write_text(json.dumps(rows))
    again = profile(LAYERS, X, cache_dir=tmp_path)
    assert all(isinstance(c.fwd_time, float) and isinstance(c.param_bytes, int) for c in again)


def test_enable_caches_turns_both_on_and_off(tmp_path):
    before = jax.config.jax_compilation_cache_dir
    try:
        assert startup.enable_caches(tmp_path / "c") == str(tmp_path / "c")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c" / "xla")
        assert cost_cache.cache_dir() == str(tmp_path / "c")
        assert startup.enable_caches("") is None
        assert cost_cache.cache_dir() is None and jax.config.jax_compilation_cache_dir is None
        (tmp_path / "file").write_text("")
        with pytest.raises(ValueError, match="--cache_dir"):
            startup.enable_caches(tmp_path / "file")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        costs_mod.set_cache_dir(None)


def test_phases_move_compile_time_out_of_other_phases():
    phases = startup.Phases(launched=time.time() - 1.0)
    with phases("init"):
        jax.jit(lambda x: x * 3 + 1).lower(np.ones(7, np.float32)).compile()
    with phases("plan", split_compile=False):
        jax.jit(lambda x: x * 5 - 2).lower(np.ones(7, np.float32)).compile()
    assert phases.seconds["compile"] > 0 and set(phases.seconds) == {"init", "compile", "plan"}
    line = phases.summary()
    assert line.startswith("start-up: init") and "launch -> first step done" in line
    assert "process CPU" in line
    assert float(line.rsplit(" ", 2)[-2]) >= 1.0


def test_a_compile_on_another_thread_overlaps_the_phase():
    phases = startup.Phases()
    before = startup.compile_seconds()
    with phases("init"):
        t = threading.Thread(target=lambda: jax.jit(lambda x: x * 7 - 3).lower(
            np.ones(9, np.float32)).compile())
        t.start()
        t.join()
    assert startup.compile_seconds() > before               # counted in the totals
    assert phases.seconds["compile"] == 0.0 and phases.seconds["init"] > 0


def test_weight_decay_mask_from_shapes_matches_the_unpacked_parameters():
    mesh = jh.make_mesh(data=2, pipe=2)
    pipe = jp.Pipeline(LAYERS, mesh=mesh, num_microbatches=2, boundaries=[2])
    variables = pipe.init(jax.random.key(0), np.ones((8, 16), np.float32))
    mask = optim.weight_decay_mask(pipe, variables)
    per_layer = portable.unpack_like_params(pipe, variables["params"])
    expect = portable.pack_like_params(pipe, [
        jax.tree.map(lambda a: np.full(a.shape, a.ndim >= 2, a.dtype), t) for t in per_layer])
    assert jax.tree.structure(mask) == jax.tree.structure(expect)
    for got, want in zip(jax.tree.leaves(mask), jax.tree.leaves(expect)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert 0 < np.asarray(got).sum() < np.asarray(got).size   # kernels 1, biases 0


class Tower(nn.Module):
    """One module the splitter cuts into pieces."""
    @nn.compact
    def __call__(self, x):
        for width in (16, 16, 16, 8):
            x = nn.relu(nn.Dense(width)(x))
        return x


def test_split_model_piece_costs_cached_on_disk(tmp_path, monkeypatch):
    from jaxhybrid.splitter import costs as piece_mod
    from jaxhybrid.splitter.model import SplitModel
    split = SplitModel(Tower(), X, min_pieces=4)
    try:
        costs_mod.set_cache_dir(tmp_path)
        first = piece_mod.piece_costs(split, X)
        analysed = []
        real = piece_mod.lowered_cost
        monkeypatch.setattr(piece_mod, "lowered_cost",
                            lambda *a: analysed.append(1) or real(*a))
        again = piece_mod.piece_costs(split, X)
    finally:
        costs_mod.set_cache_dir(None)
    assert not analysed and len(list((tmp_path / "costs").glob("*.json"))) >= 2
    assert [c.fwd_flops for c in again] == [c.fwd_flops for c in first]
    assert [c.bwd_bytes for c in again] == [c.bwd_bytes for c in first]
    assert piece_mod.piece_costs(split, X)[0].fwd_flops > 0 and analysed   # no cache: analysed


class Block(nn.Module):
    """Parameters, batch statistics and dropout: every kind of variable init makes."""
    features: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(self.features)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dropout(0.1, deterministic=not train)(nn.relu(x))


BLOCKS = [Block(16), Block(12), Block(12), Dense(8)]


def _assert_trees_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _one_by_one(layers, rng, x):
    from jaxhybrid.layers import init_layer
    want, h = [], x[:1]
    with jax.threefry_partitionable(False):
        for i, layer in enumerate(layers):
            v, h = jax.jit(lambda k, a, l=layer: init_layer(l, k, a, train=False))(
                jax.random.fold_in(rng, i), h)
            want.append(v)
    return want


def test_layers_initialised_in_one_program_equal_one_by_one_init():
    """`init_layers` (one program, forwards dropped) gives bit for bit what initialising
    each layer on the previous one's output with key fold_in(rng, i) gives, and
    `init` packs exactly that."""
    mesh = jh.make_mesh(data=2, pipe=2)
    pipe = jp.Pipeline(BLOCKS, mesh=mesh, num_microbatches=2, boundaries=[2])
    rng, x = jax.random.key(3), np.linspace(-1, 1, 8 * 16, dtype=np.float32).reshape(8, 16)
    want = _one_by_one(BLOCKS, rng, x)
    _assert_trees_equal(pipe.init_layers(rng, x), want)
    _assert_trees_equal(pipe.unpack(pipe.init(rng, x)), want)


def test_runs_of_equal_layers_are_initialised_by_one_scan():
    """A run of equal, shape-keeping layers is initialised by a `lax.scan` (its program
    does not grow with the run's length) and gives bit for bit the one-by-one values; a
    shape-changing first member (16 -> 12) and a short run stay unrolled."""
    from jaxhybrid.pipeline import variables

    def program(depth):
        layers = [Block(16), Block(12)] + [Block(12)] * depth + [Dense(8), Dense(8)]
        return layers, jax.make_jaxpr(functools.partial(variables._init_in_order, layers))(
            jax.random.key(0), np.ones((1, 16), np.float32))
    layers, short = program(5)
    _, deep = program(10)
    # Only taking each layer's variables out of the stacked ones grows with depth.
    work = lambda jaxpr: [e.primitive.name for e in jaxpr.eqns  # noqa: E731
                          if e.primitive.name not in ("slice", "squeeze", "dynamic_slice")]
    assert "scan" in work(short)
    assert work(deep) == work(short)
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2,
                       boundaries=[3])
    rng, x = jax.random.key(4), np.linspace(-1, 1, 4 * 16, dtype=np.float32).reshape(4, 16)
    _assert_trees_equal(pipe.init_layers(rng, x), _one_by_one(layers, rng, x))


class WeightNormed(nn.Module):
    """Data-dependent initialisation (weight norm): g and b from the first batch. On one
    example the variance is 0 and v * g + b cancels, so a scanned run's forward rounds
    differently from the unrolled one and every later b differs."""
    features: int

    @nn.compact
    def __call__(self, x):
        v = nn.Dense(self.features)(x)
        g = self.param("g", lambda k: jax.lax.rsqrt(jnp.var(v, 0) + 1e-3))
        b = self.param("b", lambda k: -jnp.mean(v, 0) * g)
        return x + jnp.tanh(v * g + b)


class Filled(nn.Module):
    """A parameter filled with `value`: an int value makes int parameters."""
    features: int
    value: float = 1.0

    @nn.compact
    def __call__(self, x):
        g = self.param("g", lambda k: jnp.full((self.features,), self.value))
        return jnp.tanh(nn.Dense(self.features)(x)) * g.astype(x.dtype)


class NumpyDrawn(nn.Module):
    """Weights drawn from numpy's global generator when traced, not from the key."""
    features: int

    @nn.compact
    def __call__(self, x):
        w = self.param("w", lambda k, s: jnp.asarray(np.random.standard_normal(s), jnp.float32),
                       (self.features, self.features))
        return jnp.tanh(x @ w)


@pytest.mark.parametrize("layers,runs", [
    ([WeightNormed(16)] * 6, {}),                            # reads its input's values
    ([Block(16)] * 5 + [WeightNormed(16)], {}),              # ... after the run
    ([Filled(16, 1)] + [Filled(16, 1.0)] * 5, {1: 6}),       # equal by ==, not by field types
], ids=["data-dependent", "data-dependent-after", "int-vs-float-field"])
def test_runs_that_a_scan_would_change_are_unrolled(layers, runs):
    from jaxhybrid.pipeline import variables
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2,
                       boundaries=[3])
    rng = jax.random.key(7)
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    assert variables._scanned_runs(layers, rng, x[:1]) == runs
    _assert_trees_equal(pipe.init_layers(rng, x), _one_by_one(layers, rng, x))


def test_layers_drawing_numpy_numbers_when_traced_are_not_scanned():
    """A scan traces a run once: six layers would get one numpy draw between them."""
    layers = [NumpyDrawn(16)] * 6
    pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=2), num_microbatches=2,
                       boundaries=[3])
    w = [v["params"]["w"] for v in pipe.init_layers(jax.random.key(7), np.ones((4, 16),
                                                                                np.float32))]
    assert not any(np.array_equal(w[0], b) for b in w[1:])


def test_train_initialises_the_layers_while_planning():
    """The background initialiser train.py starts before planning packs to what
    `pipe.init` returns; a split model (initialised by its splitter) gets none."""
    mesh = jh.make_mesh(data=2, pipe=2)
    rng, x = jax.random.key(5), np.ones((8, 16), np.float32)
    pipe = jp.Pipeline(BLOCKS, mesh=mesh, num_microbatches=2)   # planner's boundaries
    future = startup.init_layers_in_background(pipe, rng, x)
    pipe.make_plan(x)
    pipe.set_layer_shapes(future.shapes())          # shapes first: what the step compiles for
    abstract = pipe.abstract_variables()
    background = pipe.pack(future.result())
    _assert_trees_equal(background, pipe.init(rng, x))
    placed = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding), tree)
    assert placed(abstract) == placed(background)
    split = jp.Pipeline(Tower(), mesh=mesh, num_microbatches=2, sample_inputs=X)
    assert startup.init_layers_in_background(split, rng, X) is None


@pytest.mark.parametrize("overrides", [
    {},                                          # 1f1b, adamw, weight decay, clipping
    {"pipeline.schedule": "spectrain", "train.optimizer": "sgd",   # optimizer in the pipeline
     "train.weight_decay": 0.0, "train.grad_clip_norm": 0.0},
    # A model axis: initialised by pipe.init, not in the background; its step compiled
    # in the first step, with no memory check.
    {"mesh.data": 1, "mesh.model": 2}])
def test_train_step_compiles_once_before_the_layers_are_initialised(tmp_path, caplog,
                                                                     overrides):
    """`train_and_evaluate` compiles the step from the layers' shapes while they are
    initialised (`train.compile_ahead`); the first real step (real state, batch and key)
    runs that program: one trace and one XLA compile of the step, both before step 1."""
    from jaxhybrid.config_flags import load_config
    config = load_config("gpt_hybrid.py", {
        "model.size": "tiny", "mesh.data": 2, "mesh.pipe": 4, "pipeline.num_microbatches": 2,
        "pipeline.boundaries": (1, 2, 3), "train.batch_size": 8, "train.steps": 1,
        "train.eval_every": 0, "train.eval_steps": 1, "data.options.max_bytes": 20_000,
        **overrides})
    order, memory = [], []
    real_ahead, real_step, real_check = (train.compile_ahead, train.make_train_step,
                                         train.check_step_memory)
    ahead = lambda *a, **k: order.append("compile_ahead") or real_ahead(*a, **k)
    made = lambda *a, **k: order.append("make_train_step") or real_step(*a, **k)
    check = lambda *a, **k: memory.append(real_check(*a, **k)) or memory[-1]
    with pytest.MonkeyPatch.context() as mp, jax.log_compiles(True), \
            caplog.at_level("WARNING", logger="jax._src.dispatch"):
        mp.setattr(train, "compile_ahead", ahead)
        mp.setattr(train, "make_train_step", made)
        mp.setattr(train, "check_step_memory", check)
        final = train.train_and_evaluate(config, tmp_path)
    assert final["step"] == 1 and np.isfinite(final["train_loss"])
    assert order == ["make_train_step", "compile_ahead"]
    # The compiled step's memory is read (and checked) before the first step.
    assert len(memory) == 1 and memory[0].startswith("memory per device: the compiled step needs")
    logs = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("Finished tracing train_step") for m in logs) == 1
    assert sum(m.startswith("Finished XLA compilation of jit(train_step)") for m in logs) == 1


_FLAGS_PROBE = """
import json, os, runpy
sim = runpy.run_path(os.path.join("scripts", "train.py"), run_name="probe")["_simulate_cpu_devices"]
out = []
for env in json.loads(os.environ["PROBE_CASES"]):
    for k in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES"):
        os.environ.pop(k, None)
    os.environ.update(env)
    sim()
    out.append(os.environ.get("XLA_FLAGS", ""))
print(json.dumps(out))
"""


def test_script_sets_the_cpu_compile_flags_without_overriding_the_users():
    root = pathlib.Path(__file__).resolve().parents[1]
    cases = [{"JAX_PLATFORMS": "cpu"},
             {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=true"},
             {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4"},
             {"JAX_PLATFORMS": "cuda"}]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PROBE_CASES": json.dumps(cases),
           "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", _FLAGS_PROBE], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    cpu, user, devices, gpu = json.loads(out.stdout.strip().splitlines()[-1])
    ours = ["--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=1"]
    assert cpu.split() == ["--xla_force_host_platform_device_count=8", *ours]
    assert user.split() == ["--xla_cpu_use_fusion_emitters=true",
                            "--xla_force_host_platform_device_count=8", *ours[1:]]
    assert devices.split() == ours
    assert gpu == ""


_IMPORT_PROBE = """
import json, sys
import jaxhybrid.checkpoint, jaxhybrid.models, jaxhybrid.pipeline, jaxhybrid.train
from jaxhybrid.data import digits
digits._raw_digits()
print(json.dumps([m for m in ("flax.nnx", "IPython", "sklearn") if m in sys.modules]))
"""


def test_a_layer_list_run_imports_neither_flax_nnx_nor_sklearn():
    # flax.nnx pulls in IPython (~0.5 s) and sklearn takes 1-2 s: a run of the built-in
    # models on digits needs neither, so neither is imported at start-up.
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
