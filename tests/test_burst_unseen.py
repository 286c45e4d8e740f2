"""Burst parallelism and multiplexing on models and inputs the existing tests do not
use: dict / tuple activations, a layer without parameters, conv + BatchNorm, dropout,
odd batches, 1, 2, 6 and 8 devices, a background job with state; the planner on
hand-made costs; the script's flags. Each error case failed with a traceback from deep
inside JAX (or gave a wrong projection) before its fix."""
import functools
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
from jaxhybrid.bench import mlp
from jaxhybrid.bench.mlp import xent
from jaxhybrid.burst import multiplex
from jaxhybrid.mesh import make_mesh
from jaxhybrid.models.spec import apply_layers, init_layers
from jaxhybrid.plan import LayerCost, Topology
from jaxhybrid.plan import burst as planner
from jaxhybrid.plan import multiplexing
from jaxhybrid.plan.hardware import measured_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- layers nobody here wrote -------------------------------------------------------------
class ConvSplit(nn.Module):
    """Conv + BatchNorm; returns a dict of two activations."""
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.BatchNorm(use_running_average=not train, momentum=0.8)(nn.Conv(3, (3, 3))(x))
        return {"a": h.reshape(h.shape[0], -1), "b": jnp.mean(x, axis=(1, 2))}


class DictToTuple(nn.Module):
    @nn.compact
    def __call__(self, d):
        return nn.Dense(8)(d["a"]), d["b"]


class Join(nn.Module):
    """No parameters; takes a tuple."""
    def __call__(self, t):
        a, b = t
        return jnp.concatenate([jnp.tanh(a), 2.0 * b], axis=-1)


class Drop(nn.Module):
    """Dropout alone: no parameters, uses the rng."""
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dropout(0.5, deterministic=not train)(x)


Head = functools.partial(mlp.Head, classes=5)


LAYERS = [ConvSplit(), DictToTuple(), Join(), Drop(), Head()]


def _data(B, seed=0):
    r = np.random.RandomState(seed)
    x = r.randn(B, 4, 4, 3).astype(np.float32)
    y = (np.arange(B) % 5).astype(np.int32)
    return x, y, init_layers(LAYERS, jax.random.PRNGKey(0), x[:2])


def _err(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    return max([float(jnp.max(jnp.abs(jnp.asarray(p) - jnp.asarray(q)))) for p, q in zip(la, lb)]
               + [0.0])


# --- executor ---------------------------------------------------------------------------------
@pytest.mark.parametrize("G, B, widths", [
    (8, 24, (8, 2, 1, 4, 8)),     # 3 rows per device at the widest width
    (1, 5, (1, 1, 1, 1, 1)),      # one device, odd batch
    (2, 6, (2, 1, 2, 1, 2)),
    (6, 12, (6, 2, 1, 2, 6)),     # 6 devices: widths 1, 2 and 6 (6 was refused)
])
def test_unseen_layers_match_reference(G, B, widths):
    mesh = make_mesh(data=G)
    x, y, v = _data(B)
    prog = burst.BurstProgram(LAYERS, xent, widths, mesh, B)
    rng = jax.random.key(1)                       # a typed key
    loss, grads, new_vars = burst.value_and_grad(prog, burst.replicate(v, mesh), x, y, rng)
    r_loss, r_grads, r_vars = burst.reference_value_and_grad(LAYERS, v, xent, x, y, widths, rng)
    assert float(loss) == pytest.approx(float(r_loss), rel=1e-6, abs=1e-6)
    assert _err(burst.first_copy(grads), r_grads) < 1e-5
    assert _err(burst.first_copy(new_vars), r_vars) < 1e-5
    for l, g in enumerate(widths):          # every device running layer l has its gradient
        for d in range(1, g):
            assert _err(jax.tree.map(lambda a: a[d], grads[l]), r_grads[l]) < 1e-5
    # The BatchNorm statistics moved (the check above is not vacuous).
    assert _err(r_vars[0]["batch_stats"], v[0]["batch_stats"]) > 1e-3


def test_data_parallel_widths_on_six_devices_equal_the_plain_model_without_dropout():
    layers = LAYERS[:3] + [Head()]
    mesh = make_mesh(data=6)
    x, y, _ = _data(12)
    v = init_layers(layers, jax.random.PRNGKey(0), x[:2])
    widths = burst.data_parallel_widths(len(layers), mesh)
    assert widths == (6,) * 4
    prog = burst.BurstProgram(layers, xent, widths, mesh, 12)
    loss, grads, _ = burst.value_and_grad(prog, burst.replicate(v, mesh), x, y, jax.random.key(0))
    r_loss, r_grads, _ = burst.reference_value_and_grad(layers, v, xent, x, y, widths)
    assert float(loss) == pytest.approx(float(r_loss), rel=1e-6)
    assert _err(burst.first_copy(grads), r_grads) < 1e-5


def test_widths_that_do_not_divide_the_devices_are_refused():
    # 4 of 6 devices: rows B/6 vs B/4 do not regroup; was a broadcasting TypeError.
    with pytest.raises(ValueError, match="power of two dividing the 6 devices"):
        burst.BurstProgram(LAYERS, xent, (6, 4, 2, 1, 6), make_mesh(data=6), 12)
    with pytest.raises(ValueError, match="power of two dividing the 3 devices"):
        burst.BurstProgram(LAYERS, xent, (3, 2, 1, 1, 3), make_mesh(data=3), 6)


def test_call_shape_errors_name_the_fix():
    mesh = make_mesh(data=8)
    x, y, v = _data(16)
    prog = burst.BurstProgram(LAYERS, xent, (8, 2, 1, 4, 8), mesh, 16)
    stacked, key = burst.replicate(v, mesh), jax.random.key(1)
    x32, y32, _ = _data(32)
    # A batch of 32 for a program of 16: was a broadcasting error inside the loss.
    with pytest.raises(ValueError, match=r"inputs has shape \(32, 4, 4, 3\).*batch_size=16"):
        burst.value_and_grad(prog, stacked, x32, y32, key)
    with pytest.raises(ValueError, match=r"targets has shape \(32,\).*batch_size=16"):
        burst.value_and_grad(prog, stacked, x, y32, key)
    # Unstacked variables: was shard_map's "not evenly divisible" about a leaf.
    with pytest.raises(ValueError, match=r"burst.replicate\(variables, mesh\)"):
        burst.value_and_grad(prog, v, x, y, key)
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match="init_train_state"):
        burst.train_step(prog, opt, {"params": [u.get("params", {}) for u in v],
                                     "states": [{}] * 5, "opt_state": ()}, x, y, key)
    # A per-example loss: was "cond branches must have equal output types".
    per_example = burst.BurstProgram(
        LAYERS, lambda o, t: -jnp.take_along_axis(jax.nn.log_softmax(o), t[:, None], 1)[:, 0],
        (8, 2, 1, 4, 8), mesh, 16)
    with pytest.raises(ValueError, match=r"loss_fn returned shape \(2,\).*scalar"):
        burst.value_and_grad(per_example, stacked, x, y, key)


class Aux(nn.Module):
    """Returns a per-layer constant beside the batch (no batch axis)."""
    @nn.compact
    def __call__(self, x):
        return {"h": nn.Dense(4)(x.reshape(x.shape[0], -1)), "scale": jnp.full((4,), 2.0)}


class UseAux(nn.Module):
    @nn.compact
    def __call__(self, d):
        return Head()(d["h"] * d["scale"])


def test_unbatched_activation_leaf_at_a_width_change():
    layers, mesh = [Aux(), UseAux()], make_mesh(data=8)
    x, y, _ = _data(16)
    v = init_layers(layers, jax.random.PRNGKey(0), x[:2])
    stacked, key = burst.replicate(v, mesh), jax.random.key(0)
    # Same width: every device keeps its own constant; equals the plain model.
    prog = burst.BurstProgram(layers, xent, (8, 8), mesh, 16)
    loss, _, _ = burst.value_and_grad(prog, stacked, x, y, key)
    r_loss, _, _ = burst.reference_value_and_grad(layers, v, xent, x, y, (1, 1))
    assert float(loss) == pytest.approx(float(r_loss), rel=1e-6)
    # A width change would move it as rows: was a broadcasting error in layer 1.
    for widths in ((8, 1), (2, 8)):
        prog = burst.BurstProgram(layers, xent, widths, mesh, 16)
        with pytest.raises(ValueError, match=r"output of layer 0 \(Aux\)\['scale'\] has shape "
                                             r"\(4,\).*leading dimension"):
            burst.value_and_grad(prog, stacked, x, y, key)


def test_train_steps_keep_device_zero_equal_to_the_reference_update():
    """Two SGD steps with a narrowing plan: device 0's parameters equal the reference's
    gradients applied by hand, and layers' inactive copies stay as they were."""
    mesh = make_mesh(data=8)
    x, y, v = _data(16)
    widths = (8, 1, 2, 1, 4)
    prog = burst.BurstProgram(LAYERS, xent, widths, mesh, 16)
    opt = optax.sgd(0.05)
    ts = burst.init_train_state(opt, v, mesh)
    params = [u.get("params", {}) for u in v]
    ref_vars = v
    for step in range(2):
        key = jax.random.fold_in(jax.random.key(7), step)
        loss, ts = burst.train_step(prog, opt, ts, x, y, key)
        r_loss, r_grads, ref_vars = burst.reference_value_and_grad(
            LAYERS, [{**u, "params": p} for u, p in zip(ref_vars, params)], xent, x, y, widths, key)
        params = jax.tree.map(lambda p, g: p - 0.05 * g, params, r_grads)
        assert float(loss) == pytest.approx(float(r_loss), rel=1e-6)
    assert _err(burst.first_copy(ts["params"]), params) < 1e-5
    # Layer 1 runs on device 0 only: device 5's copy was never updated.
    assert _err(jax.tree.map(lambda a: a[5], ts["params"][1]), v[1]["params"]) == 0.0


def test_a_state_trained_under_other_widths_is_made_current():
    """A new plan (other batch, other hardware) on a trained state: devices outside a
    layer's old width kept stale copies (parameters, momentum, batch statistics), and a
    wider layer ran on them, with wrong loss and gradients and no error (a probe:
    1.4267 against the reference's 1.3618). A widening step now starts from device 0's
    copies, as replicate(first_copy(state)) does; a narrowing one needs nothing."""
    mesh = make_mesh(data=8)
    x, y, v = _data(16)
    opt = optax.sgd(0.05, momentum=0.9)
    narrow = burst.BurstProgram(LAYERS, xent, (8, 1, 2, 1, 4), mesh, 16)
    wide = burst.BurstProgram(LAYERS, xent, (8, 8, 8, 2, 8), mesh, 16)
    ts = burst.init_train_state(opt, v, mesh)
    for step in range(2):
        _, ts = burst.train_step(narrow, opt, ts, x, y, jax.random.key(step))
    fresh = burst.replicate(burst.first_copy(dict(ts)), mesh)
    key = jax.random.key(5)
    loss, new = burst.train_step(wide, opt, ts, x, y, key)
    want_loss, want = burst.train_step(wide, opt, fresh, x, y, key)
    assert float(loss) == float(want_loss)
    assert _err(dict(new), dict(want)) == 0.0
    # A copy, or a checkpoint restored into a fresh state, does not know its widths:
    # taken as stale (was wrong by 2.7e-2 after two more momentum steps).
    loss_copy, from_copy = burst.train_step(wide, opt, dict(ts), x, y, key)
    assert float(loss_copy) == float(want_loss) and _err(dict(from_copy), dict(want)) == 0.0
    assert ts.widths == narrow.widths and new.widths == wide.widths
    # Narrower than what the state is current for: the copies are used as they are.
    _, again = burst.train_step(narrow, opt, new, x, y, key)
    assert again.widths == narrow.widths


# --- multiplexing -------------------------------------------------------------------------------
class BgIn(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.BatchNorm(use_running_average=not train)(nn.Dense(6)(x))
        return {"h": h, "x": x}


class BgJoin(nn.Module):
    def __call__(self, d):
        return jnp.concatenate([d["h"], d["x"]], -1)


class Tokens(nn.Module):
    """int32 tokens in: the background's first input has no gradient."""
    @nn.compact
    def __call__(self, t):
        return nn.Embed(11, 2)(t).reshape(t.shape[0], -1)


BG_LAYERS = [Tokens(), BgIn(), BgJoin(), Drop(), Head()]


def _mux(G, B, widths, b):
    mesh = make_mesh(data=G)
    x, y, v = _data(B)
    prog = burst.BurstProgram(LAYERS, xent, widths, mesh, B)
    opt, bg_opt = optax.adam(1e-2), optax.sgd(0.1, momentum=0.9)
    r = np.random.RandomState(1)
    bx = r.randint(0, 11, (G, b, 3)).astype(np.int32)
    by = (np.arange(G * b) % 5).reshape(G, b).astype(np.int32)
    bv = init_layers(BG_LAYERS, jax.random.PRNGKey(2), bx[0])
    mux = multiplex.MuxProgram(prog, opt, multiplex.BackgroundJob(BG_LAYERS, xent, bg_opt, b))
    fts, bts = burst.init_train_state(opt, v, mesh), burst.init_train_state(bg_opt, bv, mesh)
    return mux, prog, opt, bg_opt, (x, y), (bx, by), bv, fts, bts


def test_stateful_background_equals_its_plain_step():
    G = 8
    mux, prog, opt, bg_opt, (x, y), (bx, by), bv, fts, bts = _mux(G, 16, (8, 2, 1, 4, 8), 4)
    k1, k2 = jax.random.PRNGKey(1), jax.random.PRNGKey(3)
    fg_loss, fg_new, bg_loss, bg_new = multiplex.multiplexed_step(mux, fts, bts, x, y, bx, by,
                                                                  k1, k2)
    a_loss, a_new = burst.train_step(prog, opt, fts, x, y, k1)
    assert float(fg_loss) == pytest.approx(float(a_loss), rel=1e-6)
    assert _err(fg_new, a_new) < 1e-5
    s0 = burst.first_copy(bts)
    assert not mux.runs_background[0] and mux.runs_background[1:].all()

    @jax.jit
    def plain_grad(p, xd, yd, key):     # one compile for every device's instance
        def plain(p):
            out, nv = apply_layers(BG_LAYERS, [{**s, "params": q} for q, s in zip(p, bv)], xd,
                                   train=True, rng=key)
            return xent(out, yd), nv
        return jax.value_and_grad(plain, has_aux=True)(p)

    for d in range(1, G):
        (loss, nv), grads = plain_grad(s0["params"], bx[d], by[d], jax.random.fold_in(k2, d))
        upd, _ = bg_opt.update(grads, s0["opt_state"], s0["params"])
        assert float(bg_loss[d]) == pytest.approx(float(loss), rel=1e-6)
        assert _err(jax.tree.map(lambda a: a[d], bg_new["params"]),
                    optax.apply_updates(s0["params"], upd)) < 1e-6
        assert _err(jax.tree.map(lambda a: a[d], bg_new["states"]),
                    [{k: w for k, w in u.items() if k != "params"} for u in nv]) < 1e-6
    assert _err(jax.tree.map(lambda a: a[0], bg_new), s0) == 0.0


def test_no_idle_slot_runs_no_background():
    mux, prog, opt, _, (x, y), (bx, by), _, fts, bts = _mux(8, 16, (8,) * 5, 2)
    assert not mux.runs_background.any()
    fg_loss, fg_new, bg_loss, bg_new = multiplex.multiplexed_step(
        mux, fts, bts, x, y, bx, by, jax.random.PRNGKey(1), jax.random.PRNGKey(3))
    a_loss, a_new = burst.train_step(prog, opt, fts, x, y, jax.random.PRNGKey(1))
    assert float(fg_loss) == pytest.approx(float(a_loss), rel=1e-6)
    assert _err(fg_new, a_new) < 1e-5
    assert float(jnp.abs(bg_loss).max()) == 0.0 and _err(bg_new, bts) == 0.0


def test_background_batch_shape_errors():
    mux, _, _, _, (x, y), (bx, by), _, fts, bts = _mux(8, 16, (8, 2, 1, 4, 8), 4)
    k = jax.random.PRNGKey(0)
    flat_x, flat_y = bx.reshape(32, 3), by.reshape(32)
    # [G * b, ...] instead of [G, b, ...]: was an IndexError inside the loss.
    with pytest.raises(ValueError, match=r"bg_inputs has shape \(32, 3\).*\[8, 4, \.\.\.\]"):
        multiplex.multiplexed_step(mux, fts, bts, x, y, flat_x, flat_y, k, k)
    with pytest.raises(ValueError, match=r"bg_targets has shape \(32,\)"):
        multiplex.background_step(mux, bts, bx, flat_y, k)
    # 5 examples per device for a job of batch_size 4: ran silently.
    with pytest.raises(ValueError, match=r"\(8, 5, 6\).*batch_size=4"):
        multiplex.multiplexed_step(mux, fts, bts, x, y, np.zeros((8, 5, 6), np.int32),
                                   np.zeros((8, 5), np.int32), k, k)


# --- planner on hand-made costs ----------------------------------------------------------------
def _cost(name, m, seconds, params, act_bytes):
    return LayerCost(name=name, batch_size=m, fwd_flops=2.0 * params * m,
                     bwd_flops=4.0 * params * m, fwd_bytes=0.0, bwd_bytes=0.0,
                     param_bytes=4 * params, param_count=params, in_bytes=act_bytes * m,
                     out_bytes=act_bytes * m, saved_bytes=0, saved_bytes_remat=0,
                     fwd_time=seconds / 3, bwd_time=2 * seconds / 3, measured=True)


def _handmade(m):
    """Layer 0 and 2 scale perfectly (8 ms at batch 64, few parameters): they must burst.
    Layer 1 is cheap (50 us, exempt from the limit), does not scale and has 50M
    parameters: its all-reduce over g > 1 devices costs far more than moving its small
    input to one device."""
    return [_cost("scales", m, 8e-3 * m / 64, 1000, 64),
            _cost("cheap_big", m, 50e-6, 50_000_000, 64),
            _cost("scales2", m, 8e-3 * m / 64, 1000, 64)]


def test_planner_bursts_what_scales_and_narrows_what_cannot_pay():
    topo = Topology.uniform(8, 10e9, 1e-6)
    kw = dict(num_devices=8, batch_size=64, hardware=measured_device(), topology=topo)
    p = planner.plan_burst(_handmade, **kw)
    assert p.widths == [8, 1, 8]
    tab = planner.build_tables(_handmade, **kw)
    best, widths = planner.brute_force(tab, 2.0)
    assert widths == [8, 1, 8] and p.iteration_time == pytest.approx(best, rel=1e-12)
    assert p.iteration_time < p.dp_time and p.dp_width == 8
    assert p.sync_time[1] == 0.0 and p.transfer_time[1] > 0 and p.transfer_time[2] > 0
    assert np.allclose(p.busy_time()[1:], p.busy_time()[1])     # devices 1-7 alike
    # Not exempt (fast_layer_time 0): a layer that does not scale may not widen past 2
    # (amplification g), even where its all-reduce would be free.
    free_sync = lambda m: [_cost(c.name, m, c.fwd_time * 3, 0, 64) for c in _handmade(m)]  # noqa: E731
    q = planner.plan_burst(free_sync, fast_layer_time=0.0, **kw)
    assert q.widths[1] <= 2 and q.amplification[1] <= 2.0 + 1e-9
    assert planner.plan_burst(free_sync, **kw).widths == [8, 8, 8]   # exempt: stays wide


def test_planner_on_six_devices_plans_data_parallelism_over_all_six():
    p = planner.plan_burst(_handmade, num_devices=6, batch_size=12, hardware="v100_dgx1")
    assert p.dp_width == 6 and set(p.widths) <= {1, 2, 6}
    assert planner.widths_for(6, 12) == [1, 2, 6] and planner.widths_for(8, 64) == [1, 2, 4, 8]
    one = planner.plan_burst(_handmade, num_devices=1, batch_size=3, hardware="v100_dgx1")
    assert one.widths == [1, 1, 1] and one.iteration_time == pytest.approx(one.dp_time)
    assert one.idle_time().sum() == 0.0


@pytest.mark.parametrize("G, B", [(8, 12), (16, 1000), (12, 1024), (2048, 1024)])
def test_planner_refuses_a_batch_that_does_not_split_over_every_device(G, B):
    # Was a plan whose widest width left devices that never ran a layer: their idle time
    # went to the background against a DP baseline over fewer devices (2048 x 1024:
    # "225x" total throughput).
    with pytest.raises(ValueError, match=f"batch_size={B} is not a multiple of num_devices={G}"):
        planner.plan_burst(_handmade, num_devices=G, batch_size=B, hardware="v100_dgx1")


def test_planner_refuses_nan_limits():
    kw = dict(num_devices=8, batch_size=64, hardware="v100_dgx1")
    with pytest.raises(ValueError, match="amplification_limit=nan"):   # kept every layer at 1
        planner.plan_burst(_handmade, amplification_limit=float("nan"), **kw)
    with pytest.raises(ValueError, match="fast_layer_time=-1"):
        planner.plan_burst(_handmade, fast_layer_time=-1.0, **kw)
    p = planner.plan_burst(_handmade, amplification_limit=float("inf"), **kw)
    t = multiplexing.throughput(p, bg_step_time=0.01, bg_batch=8)
    assert t.ratio > 0 and np.isfinite(t.ratio)


# --- the script ----------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--batch=1000", "--devices=8,16"], "--batch=1000 is not a multiple of --devices [16]"),
    (["--amplification_limit=nan"], "--amplification_limit=nan must be >= 1"),
    (["--size=huge"], "--size=huge: choose one of tiny, small, full"),
    (["--model="], "--model is empty"),
    (["--hardware=v100_dgx1,h100_dgx", "--plot=x.png"], "--plot draws one plan"),
    (["--plot=/nonexistent/dir/x.png"], "no folder /nonexistent/dir (it does not exist)"),
])
def test_burst_script_odd_flags_fail_in_one_line(tmp_path, flags, message):
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "burst.py"), "--model=vgg16",
         "--devices=8", "--hardware=v100_dgx1", f"--cache_dir={tmp_path}", *flags],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not os.listdir(tmp_path)      # failed before profiling anything


def test_assign_slots_checks_its_times():
    slots = multiplex.slot_widths([8, 2, 4, 1, 2])
    for kw in (dict(idle_times=[1, 1]), dict(idle_times=[1] * 12), dict(task_times=[1, 2]),
               dict(task_times=[float("nan")] * 8), dict(idle_times=[1, -1] + [1] * 8)):
        with pytest.raises(ValueError, match="assign_slots: .* one per"):
            multiplex.assign_slots(slots, 8, 8, **kw)


def test_assign_slots_puts_no_task_where_there_is_no_idle_time():
    # Task 0 went to the device's first idle slot even with zero idle time there.
    slots = multiplex.slot_widths([8, 2, 4, 1, 2])
    table = multiplex.assign_slots(slots, 8, 8, idle_times=[0, 0, 0, 5, 0, 0, 0, 0, 0, 0])
    assert (table[0] == -1).all()
    assert all(set(row) == {3} for row in table[1:])    # all the idle time is in slot 3


def test_background_job_of_no_examples_is_refused():
    with pytest.raises(ValueError, match="batch_size=0 must be an int >= 1"):   # ran silently
        multiplex.BackgroundJob(BG_LAYERS, xent, optax.sgd(0.1), 0)


def test_loss_fn_that_cannot_take_outputs_and_targets_is_refused_at_creation():
    # Was a TypeError deep in the first step's trace, after the program compiled.
    mesh = make_mesh(data=8, pipe=1)
    with pytest.raises(TypeError, match=r"BurstProgram: loss_fn\(y\) cannot be called"):
        burst.BurstProgram(LAYERS, lambda y: jnp.mean(y), (8, 2, 1, 4, 8), mesh, 16)
    with pytest.raises(TypeError, match=r"BackgroundJob: loss_fn must be a function"):
        multiplex.BackgroundJob(BG_LAYERS, "xent", optax.sgd(0.1), 4)


@pytest.mark.parametrize("flag", ["--repeats=0", "--bg_batch=0"])
def test_burst_bench_bad_counts_fail_before_compiling(flag):
    # --repeats=0 failed in min() after compiling four programs; --bg_batch=0 ran.
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "burst", flag],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"bench burst: {flag} must be >= 1." in r.stderr
    assert "compiled" not in r.stdout


def test_planner_argument_mismatches_are_refused():
    tab = planner.build_tables(_handmade, num_devices=4, batch_size=64, hardware="v100_dgx1")
    # Tables for 4 devices planned as 8: DP over 4, the other 4 counted idle.
    with pytest.raises(ValueError, match="built for batch_size=64 on 4 devices"):
        planner.plan_burst(None, num_devices=8, batch_size=64, tables=tab)
    assert planner.plan_burst(None, num_devices=4, batch_size=64, tables=tab).dp_width == 4
    # Branches of a layer the model does not have: were ignored.
    with pytest.raises(ValueError, match=r"branches for layers \[7\]"):
        planner.plan_burst(_handmade, num_devices=8, batch_size=64, hardware="v100_dgx1",
                           branches={7: _handmade})
    p = planner.plan_burst(_handmade, num_devices=8, batch_size=64, hardware="v100_dgx1")
    for kw in (dict(bg_step_time=0.0), dict(efficiency=2.0), dict(bg_batch=-1)):
        with pytest.raises(ValueError, match="throughput: bg_step_time"):
            multiplexing.throughput(p, **{"bg_step_time": 0.01, "bg_batch": 8, **kw})


# --- found by a probe (fifteenth session) --------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: optax.chain(optax.clip_by_global_norm(0.01), optax.sgd(0.1)),
    lambda: optax.apply_if_finite(optax.sgd(0.1), 3)])
def test_an_optimizer_that_looks_across_layers_is_refused(make):
    # Devices that skip a layer hold zero gradients for it: a global-norm clip moved
    # device 1's copy of layer 0 6e-4 from device 0's in one step, silently.
    mesh = make_mesh(data=8)
    x, y, v = _data(16)
    prog = burst.BurstProgram(LAYERS, xent, (8, 1, 2, 1, 4), mesh, 16)
    opt = make()
    ts = burst.init_train_state(opt, v, mesh)
    with pytest.raises(ValueError, match="depends on other layers' gradients.*first_copy"):
        burst.train_step(prog, opt, ts, x, y, jax.random.key(0))
    job = multiplex.BackgroundJob(BG_LAYERS, xent, opt, 2)   # its own whole model: fine
    with pytest.raises(ValueError, match="^MuxProgram: this optimizer's update of a layer"):
        multiplex.MuxProgram(prog, opt, job)


def test_per_layer_optimizers_pass_the_layer_check():
    from jaxhybrid.pipeline.optimizer_checks import check_layer_by_layer
    for opt in (optax.adam(1e-2), optax.lamb(1e-2), optax.sgd(0.1, momentum=0.9),
                optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda a: a.ndim > 0, p))):
        check_layer_by_layer(opt, "test")


class _Carry(nn.Module):
    @nn.compact
    def __call__(self, tok, train: bool = False):
        return {"h": nn.Embed(11, 6)(tok).mean(1), "tok": tok}


class _Mid(nn.Module):
    @nn.compact
    def __call__(self, d, train: bool = False):
        return {"h": nn.Dense(6)(d["h"]) + d["tok"][:, :1], "tok": d["tok"]}


class _Out(nn.Module):
    @nn.compact
    def __call__(self, d, train: bool = False):
        return nn.Dense(5)(d["h"])


def test_an_integer_activation_leaf_crosses_width_changes_in_a_multiplexed_step():
    # The explicit backward sent the integer leaf's float0 cotangent through the
    # widening relayout's "out + part": a TypeError deep in jax.
    G, B = 8, 16
    mesh = make_mesh(data=G)
    layers = [_Carry(), _Mid(), _Out()]
    tok = np.random.RandomState(3).randint(0, 11, (B, 4)).astype(np.int32)
    y = (np.arange(B) % 5).astype(np.int32)
    v = init_layers(layers, jax.random.PRNGKey(0), tok[:2])
    prog = burst.BurstProgram(layers, xent, (8, 2, 1), mesh, B)
    opt = optax.sgd(0.1)
    job = multiplex.BackgroundJob([nn.Dense(5)], xent, opt, 2)
    mux = multiplex.MuxProgram(prog, opt, job)
    bx = np.ones((G, 2, 4), np.float32)
    by = np.zeros((G, 2), np.int32)
    fg = burst.init_train_state(opt, v, mesh)
    bg = burst.init_train_state(opt, init_layers(job.layers, jax.random.PRNGKey(1), bx[0]), mesh)
    alone_loss, alone = burst.train_step(prog, opt, fg, tok, y, None)
    out = multiplex.multiplexed_step(mux, fg, bg, tok, y, bx, by, None, jax.random.key(0))
    assert float(out[0]) == pytest.approx(float(alone_loss), rel=1e-6)
    assert _err(burst.first_copy(out[1]["params"]), burst.first_copy(alone["params"])) < 1e-6


def test_batch_statistics_keep_their_dtype_on_skipping_devices():
    # Statistics kept in bfloat16 came back float32 from float32 inputs on the devices
    # that run the layer, and the skipping branch's bfloat16 failed the cond ("branches
    # must have equal output types"); so did float32 statistics under x64.
    mesh = make_mesh(data=8)
    x, y, v = _data(16)
    v = [{**u, **({"batch_stats": jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                                                u["batch_stats"])} if "batch_stats" in u else {})}
         for u in v]
    prog = burst.BurstProgram(LAYERS, xent, (2, 1, 2, 1, 4), mesh, 16)
    loss, _, new = burst.value_and_grad(prog, burst.replicate(v, mesh), x, y, jax.random.key(1))
    assert np.isfinite(float(loss))
    assert {a.dtype for a in jax.tree.leaves(new[0]["batch_stats"])} == {jnp.dtype(jnp.bfloat16)}


def test_bad_program_arguments_are_refused_before_any_step():
    mesh = make_mesh(data=8)
    for kw, match in [(dict(layers=[]), "no layers"), (dict(batch_size=0), "batch_size=0"),
                      (dict(widths=(2.7,) * 5), "whole numbers of devices, got 2.7")]:
        args = dict(layers=LAYERS, loss_fn=xent, widths=(8,) * 5, mesh=mesh, batch_size=16)
        args.update(kw)
        with pytest.raises(ValueError, match=match):
            burst.BurstProgram(**args)
    with pytest.raises(ValueError, match="branches\\[1\\] is empty"):
        planner.plan_burst(_handmade, num_devices=8, batch_size=16, branches={1: []})
    with pytest.raises(ValueError, match="must be ints >= 1"):
        planner.plan_burst(_handmade, num_devices=2.5, batch_size=16)
    x, y, v = _data(16)
    prog = burst.BurstProgram(LAYERS, xent, (8,) * 5, mesh, 16)
    ts = burst.init_train_state(optax.sgd(0.1), v, mesh)
    with pytest.raises(ValueError, match="opt_state was made by another optimizer"):
        burst.train_step(prog, optax.adam(1e-3), ts, x, y, jax.random.key(0))
