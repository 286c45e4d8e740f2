"""Burst parallelism (DeepPool): planner vs brute force and its limits, executor and
multiplexing exactness against single-device references, the projection script."""
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxhybrid import burst
from jaxhybrid.burst import multiplex
from jaxhybrid.mesh import make_mesh
from jaxhybrid.models.spec import apply_layers, init_layers
from jaxhybrid.plan import LayerCost, Topology
from jaxhybrid.plan import burst as planner
from jaxhybrid.plan import multiplexing
from jaxhybrid.plan.hardware import measured_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
G = 8


# --- planner ------------------------------------------------------------------------------
def _costs(rng, L, batch=64):
    """Synthetic layers: compute-heavy convs, weight-heavy dense layers, free pools."""
    out = []
    for l in range(L):
        kind = rng.choice(["conv", "dense", "other"])
        params = {"conv": rng.integers(1e4, 1e6), "dense": rng.integers(1e5, 1e7), "other": 0}[kind]
        reuse = {"conv": rng.uniform(50, 500), "dense": 1.0, "other": 0.0}[kind]
        flops = 2 * params * reuse * batch + (1e6 * batch if kind == "other" else 0)
        act = int(rng.integers(1e3, 1e6)) * 4
        out.append(LayerCost(name=f"{kind}{l}", batch_size=batch, fwd_flops=flops,
                             bwd_flops=2 * flops, fwd_bytes=act * batch + 4 * params,
                             bwd_bytes=2 * act * batch + 8 * params, param_bytes=4 * params,
                             param_count=int(params), in_bytes=act * batch, out_bytes=act * batch,
                             saved_bytes=act * batch, saved_bytes_remat=act * batch,
                             fwd_time=0.0, bwd_time=0.0))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("hardware", ["v100_dgx1", "h100_dgx"])
def test_planner_matches_brute_force(seed, hardware):
    rng = np.random.default_rng(seed)
    costs = _costs(rng, L=5)
    limit = float(rng.choice([1.2, 2.0, 4.0, np.inf]))
    tab = planner.build_tables(costs, num_devices=G, batch_size=64, hardware=hardware,
                               fast_layer_time=float(rng.choice([0.0, 300e-6])))
    plan = planner.plan_burst(None, num_devices=G, batch_size=64, amplification_limit=limit,
                              tables=tab)
    best, widths = planner.brute_force(tab, limit)
    assert plan.iteration_time == pytest.approx(best, rel=1e-9)
    assert planner._evaluate(tab, [tab.widths.index(w) for w in plan.widths], len(tab.widths) - 1) \
        == pytest.approx(plan.iteration_time, rel=1e-9)


def test_amplification_limit_and_fast_layers():
    costs = _costs(np.random.default_rng(7), L=6)
    tab = planner.build_tables(costs, num_devices=G, batch_size=64, hardware="v100_dgx1",
                               fast_layer_time=0.0)
    strict = planner.plan_burst(None, num_devices=G, batch_size=64, amplification_limit=1.0,
                                tables=tab)
    loose = planner.plan_burst(None, num_devices=G, batch_size=64, amplification_limit=2.0,
                               tables=tab)
    free = planner.plan_burst(None, num_devices=G, batch_size=64, amplification_limit=np.inf,
                              tables=tab)
    for p, limit in ((strict, 1.0), (loose, 2.0)):
        assert all(a <= limit + 1e-9 for a in p.amplification)
    # Small batches cost more per example (the small-batch model), so limit 1 keeps
    # every layer on one device, and a looser limit is never slower.
    assert strict.widths == [1] * 6
    assert free.iteration_time <= loose.iteration_time <= strict.iteration_time
    assert free.iteration_time < strict.iteration_time
    # Every layer exempt (fast_layer_time above all): the limit no longer binds.
    exempt = planner.build_tables(costs, num_devices=G, batch_size=64, hardware="v100_dgx1",
                                  fast_layer_time=1e9)
    p = planner.plan_burst(None, num_devices=G, batch_size=64, amplification_limit=1.0,
                           tables=exempt)
    assert p.iteration_time == pytest.approx(free.iteration_time)
    with pytest.raises(ValueError, match="amplification_limit"):
        planner.plan_burst(costs, num_devices=G, batch_size=64, amplification_limit=0.5)


def test_plan_accounting_summary_and_plot(tmp_path):
    costs = _costs(np.random.default_rng(3), L=4)
    p = planner.plan_burst(costs, num_devices=G, batch_size=64, hardware="v100_dgx1",
                           amplification_limit=1.5)
    busy = p.busy_time()
    assert busy.shape == (G,) and np.all(np.diff(busy) <= 1e-15)   # device 0 runs every layer
    assert busy[0] <= p.iteration_time + 1e-12
    assert p.idle_time().sum() == pytest.approx(G * p.iteration_time - p.device_time)
    assert "iteration" in p.summary() and len(p.summary().splitlines()) == 2 + 4 + 1
    p.plot(str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").stat().st_size > 5000
    t = multiplexing.throughput(p, bg_step_time=0.01, bg_batch=8, efficiency=1.0)
    assert t.background == pytest.approx(p.idle_time().sum() / p.iteration_time * 800)
    assert t.ratio == pytest.approx((64 / p.iteration_time + t.background) / (64 / p.dp_time))


def test_small_batch_fit_recovers_the_model():
    truth = {"conv": 5e4, "dense": 2e3}
    samples = []
    for kind, half in truth.items():
        outs = 1000.0
        b = np.array([1, 2, 4, 8, 16])
        samples.append((kind, outs, b, 1e-6 * (b + half / outs)))   # t = c (b + b_half)
    fit = planner.fit_small_batch(samples)
    assert fit.half_work["conv"] == pytest.approx(5e4)
    assert fit.half_work["dense"] == pytest.approx(2e3)
    assert fit.half_work["other"] == 0.0
    assert fit.factor("conv", 5e4) == pytest.approx(2.0)


def test_transfer_accounting_on_a_topology():
    """Narrowing 8 -> 2 devices over a uniform network: device 1 receives the 4 blocks of
    B/8 rows of devices 4..7 (device 0 three: one is its own), forward and backward."""
    costs = _costs(np.random.default_rng(1), L=2)
    topo = Topology.uniform(G, 1e9, 0.0)
    tab = planner.build_tables(costs, num_devices=G, batch_size=64, hardware=measured_device(),
                               topology=topo)
    rows = 64 // 8
    expect = 2 * 4 * rows * tab.in_bytes[1] / 1e9
    assert tab.transfer(3, 1, 1) == pytest.approx(expect)


# --- executor -------------------------------------------------------------------------------
class Residual(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(self.width)(x)) + x


class NormDrop(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(self.width)(x))
        return nn.Dropout(0.3, deterministic=not train)(nn.relu(x))


class ConvNorm(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.relu(x).reshape(x.shape[0], -1)


class Head(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(x)


def xent(logits, labels):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))


FG_LAYERS = [ConvNorm(), Residual(64), NormDrop(64), Residual(64), Head()]
B = 32


def _fg():
    r = np.random.RandomState(0)
    x = r.randn(B, 4, 4, 3).astype(np.float32)
    y = (np.arange(B) % 10).astype(np.int32)
    return x, y, init_layers(FG_LAYERS, jax.random.PRNGKey(0), x[:2])


def _max_err(a, b):
    return max(float(jnp.max(jnp.abs(jnp.asarray(p) - jnp.asarray(q))))
               for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("widths", [(8, 8, 8, 8, 8), (1, 1, 1, 1, 1), (8, 2, 4, 1, 2),
                                    (2, 8, 1, 4, 8)])
def test_executor_matches_reference(widths):
    mesh = make_mesh(data=G)
    x, y, v = _fg()
    prog = burst.BurstProgram(FG_LAYERS, xent, widths, mesh, B)
    rng = jax.random.PRNGKey(1)
    loss, grads, new_vars = burst.value_and_grad(prog, burst.replicate(v, mesh), x, y, rng)
    r_loss, r_grads, r_vars = burst.reference_value_and_grad(FG_LAYERS, v, xent, x, y, widths, rng)
    assert float(loss) == pytest.approx(float(r_loss), rel=1e-6, abs=1e-6)
    assert _max_err(burst.first_copy(grads), r_grads) < 1e-5
    assert _max_err(burst.first_copy(new_vars), r_vars) < 1e-5
    # Every device that runs layer l holds its full gradient (all-reduced over its g_l).
    for l, g in enumerate(widths):
        for d in range(1, g):
            assert _max_err(jax.tree.map(lambda a: a[d], grads[l]), r_grads[l]) < 1e-5
    if widths == (1, 1, 1, 1, 1):   # one chunk: the plain model on the whole batch
        def plain(p):
            out, _ = apply_layers(FG_LAYERS, [{**s, "params": q} for q, s in zip(p, v)], x,
                                  train=True, rng=rng)
            return xent(out, y)
        pl, pg = jax.value_and_grad(plain)([u["params"] for u in v])
        assert float(loss) == pytest.approx(float(pl), rel=1e-6)
        assert _max_err(burst.first_copy(grads), pg) < 1e-5


def _masked_batch():
    r = np.random.RandomState(3)
    x = r.randn(B, 12).astype(np.float32)
    mask = (np.arange(B) >= 20).astype(np.float32)   # 12 of 32 rows count, all in the back
    mask[3] = 1.0
    return x, {"labels": (np.arange(B) % 10).astype(np.int32), "mask": mask}


@pytest.mark.parametrize("widths", [(8, 8), (8, 2), (2, 8), (1, 4)])
def test_a_weighted_mean_is_the_whole_batchs_at_any_widths(widths):
    # It was taken per chunk (a mean of the chunks' token means): with the masked rows
    # bunched, the loss and gradients moved with the last layer's width.
    from jaxhybrid import pipeline as jp

    class MaskedCE(jp.WeightedMean):
        def total(self, logits, t):
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, t["labels"])
            return jnp.sum(ce * t["mask"])

        def weight(self, t):
            return jnp.sum(t["mask"])

    loss_fn = MaskedCE()
    layers = [Residual(12), Head()]
    mesh = make_mesh(data=G)
    x, t = _masked_batch()
    v = init_layers(layers, jax.random.PRNGKey(0), x[:2])
    prog = burst.BurstProgram(layers, loss_fn, widths, mesh, B)
    loss, grads, _ = burst.value_and_grad(prog, burst.replicate(v, mesh), x, t, None)

    def plain(p):
        out, _ = apply_layers(layers, [{**s, "params": q} for q, s in zip(p, v)], x, train=True)
        return loss_fn(out, t)
    pl, pg = jax.value_and_grad(plain)([u["params"] for u in v])
    assert float(loss) == pytest.approx(float(pl), rel=1e-6)
    assert _max_err(burst.first_copy(grads), pg) < 1e-5
    r_loss, r_grads, _ = burst.reference_value_and_grad(layers, v, loss_fn, x, t, widths)
    assert float(r_loss) == pytest.approx(float(pl), rel=1e-6)
    assert _max_err(r_grads, pg) < 1e-5
    if widths == (8, 2):   # the train step and the multiplexed step weigh it alike
        opt = optax.sgd(0.1)
        state = burst.init_train_state(opt, v, mesh)
        t_loss, _ = burst.train_step(prog, opt, state, x, t, None)
        assert float(t_loss) == pytest.approx(float(pl), rel=1e-6)
        bx = np.ones((G, 4, 12), np.float32)
        by = (np.arange(G * 4) % 10).reshape(G, 4).astype(np.int32)
        job = multiplex.BackgroundJob(BG_LAYERS, xent, opt, 4)
        bts = burst.init_train_state(opt, init_layers(BG_LAYERS, jax.random.PRNGKey(2), bx[0]), mesh)
        m_loss, *_ = multiplex.multiplexed_step(multiplex.MuxProgram(prog, opt, job), state, bts,
                                                x, t, bx, by, jax.random.PRNGKey(1),
                                                jax.random.PRNGKey(3))
        assert float(m_loss) == pytest.approx(float(pl), rel=1e-6)


def test_bad_widths_and_mesh_errors():
    mesh = make_mesh(data=G)
    with pytest.raises(ValueError, match="power of two"):
        burst.BurstProgram(FG_LAYERS, xent, (8, 3, 1, 1, 1), mesh, B)
    with pytest.raises(ValueError, match="one per layer"):
        burst.BurstProgram(FG_LAYERS, xent, (8, 8), mesh, B)
    with pytest.raises(ValueError, match="multiple of the 8 devices"):
        burst.BurstProgram(FG_LAYERS, xent, (8,) * 5, mesh, 20)
    with pytest.raises(ValueError, match="pipe=1"):
        burst.BurstProgram(FG_LAYERS, xent, (4,) * 5, make_mesh(data=4, pipe=2), B)


# --- multiplexing --------------------------------------------------------------------------
BG_LAYERS = [NormDrop(16), Residual(16), Head()]


def test_assign_slots_order_and_idle_layers():
    widths = [8, 2, 4, 1, 2]
    table = multiplex.assign_slots(widths, G, 8, idle_times=[1, 1, 1, 3, 1])
    assert (table[0] == -1).all()              # device 0 runs every layer
    for d in range(1, G):
        assert (np.diff(table[d]) >= 0).all()
        assert all(widths[l] <= d for l in table[d])
    assert set(table[1]) == {3}                # device 1 idles in layer 3 only
    slots = multiplex.slot_widths(widths)      # forward, then backward in reverse
    assert slots == [8, 2, 4, 1, 2, 2, 1, 4, 2, 8]
    both = multiplex.assign_slots(slots, G, 8)
    assert set(both[1]) == {3, 6}              # layer 3's forward and its backward


def test_multiplexed_jobs_equal_each_alone():
    mesh = make_mesh(data=G)
    x, y, v = _fg()
    widths = (8, 2, 4, 1, 2)
    prog = burst.BurstProgram(FG_LAYERS, xent, widths, mesh, B)
    opt, bg_opt = optax.adam(1e-2), optax.sgd(0.1, momentum=0.9)
    r = np.random.RandomState(1)
    bx = r.randn(G, 4, 12).astype(np.float32)
    by = (np.arange(G * 4) % 10).reshape(G, 4).astype(np.int32)
    bv = init_layers(BG_LAYERS, jax.random.PRNGKey(2), bx[0])
    job = multiplex.BackgroundJob(BG_LAYERS, xent, bg_opt, 4)
    mux = multiplex.MuxProgram(prog, opt, job)
    fts, bts = burst.init_train_state(opt, v, mesh), burst.init_train_state(bg_opt, bv, mesh)
    k1, k2 = jax.random.PRNGKey(1), jax.random.PRNGKey(3)
    fg_loss, fg_new, bg_loss, bg_new = multiplex.multiplexed_step(mux, fts, bts, x, y, bx, by,
                                                                  k1, k2)
    # Foreground: the burst train step alone (its backward written out instead of
    # autodiff's: equal up to float rounding).
    a_loss, a_new = burst.train_step(prog, opt, fts, x, y, k1)
    assert float(fg_loss) == pytest.approx(float(a_loss), rel=1e-6)
    assert _max_err(fg_new, a_new) < 1e-5
    # Background: device d's instance equals its plain single-device step (jax.grad).
    runs = mux.runs_background
    assert not runs[0] and runs[1:].all()
    assert float(bg_loss[0]) == 0.0
    state0 = burst.first_copy(bts)
    for d in (1, 5, 7):
        key = jax.random.fold_in(k2, d)

        def plain(p, d=d, key=key):
            out, _ = apply_layers(BG_LAYERS, [{**s, "params": q} for q, s in zip(p, bv)],
                                  bx[d], train=True, rng=key)
            return xent(out, by[d])
        loss, grads = jax.value_and_grad(plain)(state0["params"])
        upd, _ = bg_opt.update(grads, state0["opt_state"], state0["params"])
        params = optax.apply_updates(state0["params"], upd)
        assert float(bg_loss[d]) == pytest.approx(float(loss), rel=1e-6)
        assert _max_err(jax.tree.map(lambda a: a[d], bg_new["params"]), params) < 1e-6
    # Device 0 ran no background step: its copy is unchanged.
    assert _max_err(jax.tree.map(lambda a: a[0], bg_new), state0) == 0.0
    # And the background alone (same devices) gives the same result.
    s_loss, s_new = multiplex.background_step(mux, bts, bx, by, k2)
    assert _max_err(s_loss, bg_loss) < 1e-6 and _max_err(s_new, bg_new) < 1e-6
    # The states the steps return run the next steps without compiling them again (the
    # widths in a TrainState's structure were part of the jit's key: call 2 compiled).
    sizes = (multiplex._multiplexed_step._cache_size(), burst.executor._train_step._cache_size())
    multiplex.multiplexed_step(mux, fg_new, bg_new, x, y, bx, by, k1, k2)
    burst.train_step(prog, opt, a_new, x, y, k1)
    assert (multiplex._multiplexed_step._cache_size(),
            burst.executor._train_step._cache_size()) == sizes


# --- the projection script ------------------------------------------------------------------
def test_burst_script_json(tmp_path):
    png = tmp_path / "plan.png"
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "burst.py"), "--model=vgg16",
         "--size=tiny", "--devices=8,16", "--hardware=v100_dgx1", "--batch=64", "--json",
         f"--cache_dir={tmp_path}", f"--plot={png}"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    rows = out["results"][0]["rows"]
    assert [x["devices"] for x in rows] == [8, 16]
    for x in rows:
        assert len(x["widths"]) == 16 and x["ratio"] > 0 and x["data_parallel"] > 0
        assert x["total"] == pytest.approx(x["foreground"] + x["background"])
    assert png.stat().st_size > 5000
    assert os.path.exists(tmp_path / "burst_costs_vgg16_tiny.json")


def _timed_costs(times, batch=16, param_count=1000, act=4000):
    return [LayerCost(name=f"l{i}", batch_size=batch, fwd_flops=2.0 * param_count * batch,
                      bwd_flops=4.0 * param_count * batch, fwd_bytes=0.0, bwd_bytes=0.0,
                      param_bytes=4 * param_count, param_count=param_count, in_bytes=act * batch,
                      out_bytes=act * batch, saved_bytes=0, saved_bytes_remat=0,
                      fwd_time=t / 3, bwd_time=2 * t / 3, measured=True) for i, t in enumerate(times)]


@pytest.mark.parametrize("seed", range(4))
def test_branch_mode_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    costs = _timed_costs(rng.uniform(1e-3, 5e-3, 3))
    branches = {1: _timed_costs(rng.uniform(0.2e-3, 2e-3, 2))}
    topo = Topology.uniform(4, float(rng.choice([1e8, 1e10])), 1e-6)
    model = planner.SmallBatchModel({"dense": float(rng.choice([0.0, 2e4]))})
    limit = float(rng.choice([1.0, 2.0]))
    tab = planner.build_tables(costs, num_devices=4, batch_size=16, hardware=measured_device(),
                               topology=topo, small_batch=model, branches=branches)
    plan = planner.plan_burst(None, num_devices=4, batch_size=16, amplification_limit=limit,
                              tables=tab)
    best, _ = planner.brute_force(tab, limit, 4)
    assert plan.iteration_time == pytest.approx(best, rel=1e-9)


def test_branches_run_side_by_side_when_layers_cannot_widen():
    """Limit 1 keeps every layer on one device; a block of two branches then runs them
    on devices 0 and 1 at once (fast network): max instead of sum of their times."""
    costs = _timed_costs([4e-3, 6e-3, 4e-3])
    branches = {1: _timed_costs([2e-3, 4e-3])}
    topo = Topology.uniform(4, 1e15, 0.0)
    model = planner.SmallBatchModel({"dense": 1e9})       # widening never pays
    p = planner.plan_burst(costs, num_devices=4, batch_size=16, hardware=measured_device(),
                           topology=topo, small_batch=model, amplification_limit=1.0,
                           branches=branches)
    assert p.widths[0] == p.widths[2] == 1       # (the block's output layout is a tie)
    assert [(o, g) for o, g, *_ in p.branch_groups[1]] == [(0, 1), (1, 1)]
    assert p.iteration_time == pytest.approx(4e-3 + 4e-3 + 4e-3, rel=1e-6)
    busy = p.busy_time()
    assert busy[0] == pytest.approx(10e-3, rel=1e-6)      # layers 0, 2 and branch 0
    assert busy[1] == pytest.approx(4e-3, rel=1e-6) and busy[2] == 0.0   # branch 1

@pytest.mark.parametrize("flag,message", [
    ("--model=resnet", "--model: unknown ['resnet']; choose from"),
    ("--devices=8,abc", "flag --devices=8,abc: 'abc' is not a whole number >= 1"),
    ("--hardware=tpu", "unknown hardware 'tpu'"),
    ("--bg_batch=0", "--bg_batch=0 must be >= 1"),
    ("--mux_efficiency=2", "give a number in (0, 1]"),
    ("--amplification_limit=0.5", "amplification_limit=0.5 must be >= 1"),
])
def test_burst_script_bad_flags_fail_in_one_line(tmp_path, flag, message):
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "burst.py"), "--model=inception_v3",
         "--devices=8", "--hardware=v100_dgx1", f"--cache_dir={tmp_path}", flag],
        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert message in r.stderr   # the script's own line, or absl's for a list of ints


@pytest.mark.parametrize("hardware", ["v100_dgx1", "measured"])
def test_branches_and_layers_price_their_all_reduce_alike(hardware):
    """A branch with a layer's parameters syncs in the layer's time at every width, on a
    preset cluster and on measured hardware alike (the branches were priced as a ring
    over the cluster's topology on measured hardware, the layers hierarchically)."""
    # Two nodes of 4 (the ring over the cluster's topology and the hierarchical
    # all-reduce part there) and, measured, 2 compute slots (a shared host).
    hw = (measured_device(devices_per_node=4, inter_bandwidth=1e9, compute_slots=2.0)
          if hardware == "measured" else hardware)
    costs = _timed_costs([1e-3, 2e-3, 1e-3], param_count=50_000)
    branches = {1: _timed_costs([1e-3, 1e-3], param_count=50_000)}
    tab = planner.build_tables(costs, num_devices=8, batch_size=16, hardware=hw,
                               branches=branches)
    for row in tab.branches[1]["sync"]:
        np.testing.assert_allclose(row, tab.sync[1], rtol=1e-12)
    assert tab.sync[1, -1] > 0
