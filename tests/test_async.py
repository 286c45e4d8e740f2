"""Asynchronous schedules (async, pipedream, 2bw, spectrain): the engine's losses and
weights equal a plain single-device simulation of each algorithm, written here from
the algorithms' definitions (which weights a microbatch's forward and backward use),
not from the engine's tables."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxhybrid as jh
from jaxhybrid import pipeline as jp
from jaxhybrid.schedules import TaskType, asynchronous, make_schedule

S, WIDTH, OUT = 4, 6, 3


class Layer(nn.Module):
    features: int
    last: bool = False

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(self.features)(x)
        return y if self.last else jnp.tanh(y)


LAYERS = [Layer(WIDTH) for _ in range(S - 1)] + [Layer(OUT, last=True)]


def loss_fn(y, t):
    return jnp.mean((y - t) ** 2)


def _batches(calls, M, mb, data=1, seed=0):
    rng = np.random.default_rng(seed)
    n = data * M * mb
    return [(rng.normal(size=(n, WIDTH)).astype(np.float32),
             rng.normal(size=(n, OUT)).astype(np.float32)) for _ in range(calls)]


# --- the simulation ---------------------------------------------------------------------
def _forward(w, x, last):
    y = x @ w["kernel"] + w["bias"]
    return y if last else np.tanh(y)


def _backward(w, x, out, g, last):
    """Gradient from the forward's activations (x, out) and the weights `w` the
    backward runs with (they differ from the forward's in naive async / SpecTrain v1)."""
    dz = g if last else g * (1 - out ** 2)
    return {"kernel": x.T @ dz, "bias": dz.sum(0)}, dz @ w["kernel"].T


def _predicted(w, u, s):
    return jax.tree.map(lambda a, b: a + np.float32(s) * b, w, u)


def simulate(policy, params, tx, batches, M, window=1, data=1, tasks_per_tick=2):
    """One device, one stage after another, in the order of the schedule's tasks
    (lock-step 1F1B: a tick runs forwards, then backwards, then updates; with
    tasks_per_tick=1 PipeDream's order, a device alternating forwards and backwards).
    Returns the per-call mean losses and the final per-stage weights."""
    K = len(params)
    w = [jax.tree.map(np.asarray, p) for p in params]
    opt = [tx.init(p) for p in w]
    u = [jax.tree.map(np.zeros_like, p) for p in w]
    # Updates of stage k between a microbatch's F and B: 2(S-1-k) in lock step with a
    # forward and a backward per tick; the paper's N-k-1 with one task per tick.
    D = (2 if tasks_per_tick == 2 else 1) * (S - 1 - np.arange(K))
    s_f = {"predict-v2": D, "predict-v1": np.arange(K) // 2 + D}.get(policy, 0 * D)
    s_b = np.arange(K) // 2 if policy == "predict-v1" else 0 * D
    base = (make_schedule("1f1b", S, M) if tasks_per_tick == 2
            else asynchronous.one_task_per_tick(S, M))
    order = sorted(base.tasks, key=lambda t: (t.tick, t.kind))
    losses = []
    for x_all, t_all in batches:
        # Data replicas: replica r takes rows [r*M*mb, (r+1)*M*mb); its microbatch m is
        # its m-th block; each update averages the replicas' gradients.
        rows = x_all.shape[0] // (data * M)
        mbs = [[(x_all[(r * M + m) * rows:(r * M + m + 1) * rows],
                 t_all[(r * M + m) * rows:(r * M + m + 1) * rows]) for r in range(data)]
               for m in range(M)]
        acts, saved, grads_in, acc, total = {}, {}, {}, [None] * K, 0.0
        for task in order:
            k, m = task.stage, task.microbatch
            last = k == K - 1
            if task.kind == TaskType.F:
                wf = _predicted(w[k], u[k], s_f[k])
                xs = [mbs[m][r][0] if k == 0 else acts[(k, m)][r] for r in range(data)]
                outs = [_forward(wf, x, last) for x in xs]
                saved[(k, m)] = (wf, xs, outs)
                if last:
                    total += sum(np.mean((o - mbs[m][r][1]) ** 2) for r, o in enumerate(outs))
                    grads_in[(k, m)] = [2 * (o - mbs[m][r][1]) / o.size
                                        for r, o in enumerate(outs)]
                else:
                    acts[(k + 1, m)] = outs
            elif task.kind == TaskType.B:
                wf, xs, outs = saved.pop((k, m))
                wb = {"newest": w[k], "predict-v1": _predicted(w[k], u[k], s_b[k])}.get(policy, wf)
                for r in range(data):
                    g, gx = _backward(wb, xs[r], outs[r], grads_in[(k, m)][r], last)
                    g = jax.tree.map(lambda a: a / data, g)
                    acc[k] = g if acc[k] is None else jax.tree.map(np.add, acc[k], g)
                    if k > 0:
                        grads_in.setdefault((k - 1, m), []).append(gx)
                if (m + 1) % window == 0:
                    g = jax.tree.map(lambda a: a / window, acc[k])
                    upd, opt[k] = tx.update(g, opt[k], w[k])
                    w[k] = jax.tree.map(np.asarray, optax.apply_updates(w[k], upd))
                    u[k], acc[k] = jax.tree.map(np.asarray, upd), None
        losses.append(total / (M * data))
    return losses, w


# --- the engine -------------------------------------------------------------------------
def _engine(schedule, options, tx, batches, M, data=1, steps=None):
    mesh = jh.make_mesh(data=data, pipe=S)
    sched = make_schedule(schedule, S, M, **options)
    pipe = jp.Pipeline(LAYERS, mesh=mesh, num_microbatches=M, schedule=sched,
                       boundaries=list(range(1, S)), remat="none")
    variables = pipe.init(jax.random.key(0), batches[0][0])
    start = [v["params"]["Dense_0"] for v in pipe.unpack(variables)]
    opt = pipe.init_optimizer(tx, variables)
    step = pipe.train_step(loss_fn, tx)
    losses = []
    for x, t in batches:
        loss, _, variables, opt = step(variables, opt, x, t)
        losses.append(float(loss))
    return pipe, start, losses, [v["params"]["Dense_0"] for v in pipe.unpack(variables)]


CASES = [("async", {}, "newest", 1), ("pipedream", {}, "stash", 1),
         ("2bw", {"window": 8}, "two-buffer", 8), ("spectrain", {}, "predict-v2", 1),
         ("spectrain", {"version": 1}, "predict-v1", 1),
         # PipeDream's timing (one task per device per tick): the paper's staleness
         ("pipedream-1t", {}, "stash", 1), ("spectrain-v1-1t", {}, "predict-v1", 1)]


@pytest.mark.parametrize("schedule,options,policy,window", CASES)
def test_engine_matches_simulation(schedule, options, policy, window):
    M = 16
    tx = optax.sgd(0.05, momentum=0.9)
    batches = _batches(2, M, 2)
    _, start, losses, final = _engine(schedule, options, tx, batches, M)
    ref_losses, ref = simulate(policy, start, tx, batches, M, window,
                               tasks_per_tick=1 if schedule.endswith("-1t") else 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, want in zip(final, ref):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_policies_differ_and_adam_with_data_replicas():
    # The simulation tells the policies apart (else the test above could not fail),
    # and SpecTrain with Adam on two data replicas matches too.
    M, tx = 8, optax.adam(0.01)
    batches = _batches(2, M, 2, data=2, seed=1)
    _, start, losses, final = _engine("spectrain", {}, tx, batches, M, data=2)
    ref_losses, ref = simulate("predict-v2", start, tx, batches, M, data=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    others = {p: simulate(p, start, tx, batches, M, data=2)[1] for p in ("newest", "stash")}
    for p, w in others.items():
        gap = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(ref)))
        assert gap > 1e-4, p


def test_tables_bound_versions_and_staleness():
    for S_, M in [(4, 16), (8, 32)]:
        pd = make_schedule("pipedream", S_, M)
        from jaxhybrid.pipeline import tables
        ctl = tables.control_table(pd)
        # PipeDream keeps one weight version per microbatch in flight, no more.
        assert ctl.sizes["versions"] == pd.in_flight().max() == 2 * S_ - 1
        assert list(asynchronous.staleness(pd)) == [2 * (S_ - 1 - k) for k in range(S_)]
        assert tables.control_table(make_schedule("2bw", S_, M)).sizes["versions"] == 2
        assert tables.control_table(make_schedule("async", S_, M)).sizes["versions"] == 0
        # One update per microbatch (per window for 2bw) on every stage.
        assert sum(t.kind == TaskType.U for t in pd.tasks) == S_ * M
        assert asynchronous.updates_per_call(make_schedule("2bw", S_, M)) == M // (2 * S_)
        assert asynchronous.updates_per_call(make_schedule("2bw", S_, M, window=M)) == 1
    with pytest.raises(ValueError, match="gradient window of at least 6 .*: window=8"):
        make_schedule("2bw", 4, 16, window=4)
    # Stage 1 fails first at window 2: its own count (4) was named, and window=4 then
    # failed on stage 0 with "at least 6".
    with pytest.raises(ValueError, match="gradient window of at least 6 .*: window=8"):
        make_schedule("2bw", 4, 16, window=2)
    with pytest.raises(ValueError, match="multiple of"):
        make_schedule("2bw", 4, 12, window=8)
    with pytest.raises(ValueError, match="version"):
        make_schedule("spectrain", 4, 8, version=3)
    # PipeDream's timing: the paper's N-k versions and N-k-1 stale updates on stage k.
    for S_ in (4, 8):
        pd = make_schedule("pipedream-1t", S_, 16)
        assert list(pd.stage_in_flight()) == [S_ - k for k in range(S_)]
        assert tables.control_table(pd).sizes["versions"] == S_
        assert list(asynchronous.staleness(pd)) == [S_ - 1 - k for k in range(S_)]
        assert list(asynchronous.prediction_distances(make_schedule("spectrain-1t", S_, 16))[0]) \
            == [S_ - 1 - k for k in range(S_)]
    with pytest.raises(ValueError, match="tasks_per_tick"):
        make_schedule("pipedream", 4, 8, tasks_per_tick=3)


def test_value_and_grad_of_an_async_schedule_is_the_synchronous_gradient():
    M = 4
    x, t = _batches(1, M, 2)[0]
    grads = {}
    for name in ("1f1b", "spectrain"):
        pipe = jp.Pipeline(LAYERS, mesh=jh.make_mesh(data=1, pipe=S), num_microbatches=M,
                           schedule=name, boundaries=list(range(1, S)), remat="none")
        v = pipe.init(jax.random.key(0), x)
        grads[name] = pipe.value_and_grad(loss_fn)(v, x, t)[1]
    for a, b in zip(jax.tree.leaves(grads["1f1b"]), jax.tree.leaves(grads["spectrain"])):
        np.testing.assert_allclose(a, b, rtol=1e-6)


# --- training from a config, killed and resumed ------------------------------------------
class _Killed(Exception):
    pass


def test_spectrain_run_from_config_resumes_exactly(tmp_path, monkeypatch):
    from jaxhybrid import checkpoint, train
    from jaxhybrid.config_flags import load_config
    import json

    def config():
        return load_config("gpt_hybrid.py", {
            "model.size": "tiny", "mesh.data": 2, "mesh.pipe": 4,
            "pipeline.schedule": "spectrain", "pipeline.num_microbatches": 4,
            "pipeline.boundaries": (1, 2, 3), "train.batch_size": 16, "train.steps": 5,
            "train.warmup_steps": 2, "train.log_every": 1, "train.eval_every": 0,
            "train.eval_steps": 1, "train.weight_decay": 0.0, "train.grad_clip_norm": 0.0,
            "train.optimizer": "sgd", "train.momentum": 0.9,
            "data.options.max_bytes": 40_000, "checkpoint.every": 2})

    def losses(workdir):
        lines = (workdir / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["train_loss"] for r in map(json.loads, lines)}

    train.train_and_evaluate(config(), tmp_path / "whole")
    make = train.make_train_step

    def killed_at_4(run, t):
        step, calls = make(run, t), [0]

        def wrapped(*args):
            calls[0] += 1
            if calls[0] == 4:
                raise _Killed()
            return step(*args)
        return wrapped

    with monkeypatch.context() as m:
        m.setattr(train, "make_train_step", killed_at_4)
        with pytest.raises(_Killed):
            train.train_and_evaluate(config(), tmp_path / "resumed")
    assert checkpoint.Checkpointer(tmp_path / "resumed" / "checkpoints", keep=2).all_steps() == [2]
    train.train_and_evaluate(config(), tmp_path / "resumed")
    whole, resumed = losses(tmp_path / "whole"), losses(tmp_path / "resumed")
    assert sorted(whole) == list(range(1, 6)) and resumed == whole     # bit for bit
    with pytest.raises(train.ConfigError, match="grad_clip_norm=0"):
        train.prepare(load_config("gpt_hybrid.py", {"pipeline.schedule": "pipedream"}))


def test_spectrain_prediction_is_the_papers_w_minus_s_lr_v():
    """Checked against the paper's formula, not the simulation above (which shares the
    engine's W + s u): after each update of optax.sgd(schedule, momentum) the predicting
    optimizer's last update u is -lr_t v_t, v_t the paper's momentum buffer
    (v = mu v + g, as torch's SGD keeps it) and lr_t the schedule's rate at that update,
    so W + s u is the paper's W - s lr v; integer buffers are never predicted."""
    from jaxhybrid.pipeline import async_weights
    M, mu, n = 4, 0.9, 7
    lr = optax.linear_schedule(0.1, 0.02, 5)
    tx = async_weights.pipeline_optimizer(optax.sgd(lr, momentum=mu),
                                          make_schedule("spectrain", 2, M), M)
    rng = np.random.default_rng(0)
    w = {"float32": rng.normal(size=n).astype(np.float32)}
    state, v = tx.init(w), np.zeros(n, np.float32)
    for t in range(5):
        g = rng.normal(size=n).astype(np.float32)
        upd, state = tx.update({"float32": g}, state, w)
        w = optax.apply_updates(w, upd)
        v = mu * v + M * g        # a microbatch's gradient: the engine divides losses by M
        np.testing.assert_allclose(state.last_update["float32"], -lr(t) * v, rtol=1e-5)
        pred = async_weights._predicted({**w, "int32": np.arange(3, dtype=np.int32)}, state,
                                        jnp.int32(3))
        np.testing.assert_allclose(pred["float32"], w["float32"] - 3 * lr(t) * v,
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(pred["int32"], np.arange(3))
