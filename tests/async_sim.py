"""A single-device simulation of the asynchronous schedules for any Flax layers (used by
tests/test_async_unseen.py): stages run one after another in the order of the 1F1B
table (lock step, or one task per tick), each task with the weights docs/async.md
names. Written from the definitions, not from the engine's control table. Covers the
policies whose backward runs with the weights its forward used (stash, two-buffer,
predict-v2: then `jax.vjp` at the forward is exact) and "newest" at S=1 (nothing in
flight); tests/test_async.py simulates the others on Dense layers."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxhybrid.layers import apply_layer, layer_rng
from jaxhybrid.schedules import asynchronous, make_schedule, TaskType


def _stage_fns(layers, idx, loss_fn, last, rng):
    """Jitted (forward, backward) of the layers `idx` in training mode: forward(params,
    state, x, gmb, tgt) -> (y or the loss, new state); backward(..., ct) -> (d params,
    d x), recomputing the forward at the same weights (what the policies covered need)."""
    def run(params, state, x, gmb, tgt):
        new = []
        for j, i in enumerate(idx):
            key = None if rng is None else layer_rng(rng, gmb, i)
            x, st = apply_layer(layers[i], {"params": params[j], **state[j]}, x, train=True,
                                rng=key)
            new.append(st)
        return (loss_fn(x, tgt) if last else x), new

    def backward(params, state, x, gmb, tgt, ct):
        _, vjp = jax.vjp(lambda p, x: run(p, state, x, gmb, tgt)[0], params, x)
        return vjp(ct)
    return jax.jit(run), jax.jit(backward)


def _mb(tree, i, n):
    return jax.tree.map(lambda a: a[i * n:(i + 1) * n], tree)


def simulate(layers, ranges, per_layer, tx, batches, M, *, policy, window=1, data=1,
             one_task=False, loss_fn, rng=None):
    """Per-call mean losses, final per-layer params and (replica-averaged) state."""
    K = len(ranges)
    idx = [list(range(a, b)) for a, b in ranges]
    w = [[per_layer[i].get("params", {}) for i in ix] for ix in idx]
    st = [[[{c: v for c, v in per_layer[i].items() if c != "params"} for i in ix]
           for ix in idx] for _ in range(data)]
    opt = [tx.init(p) for p in w]
    u = [jax.tree.map(jnp.zeros_like, p) for p in w]
    # the most updates of stage k between a forward and its backward within a call
    D = np.minimum(M - 1, (1 if one_task else 2) * (K - 1 - np.arange(K)))
    s_f = D if policy == "predict-v2" else 0 * D
    update = jax.jit(tx.update)
    fns = [_stage_fns(layers, ix, loss_fn, k == K - 1, rng) for k, ix in enumerate(idx)]
    base = asynchronous.one_task_per_tick(K, M) if one_task else make_schedule("1f1b", K, M)
    order = sorted(base.tasks, key=lambda t: (t.tick, t.kind))
    losses = []
    for x_all, t_all in batches:
        rows = jax.tree.leaves(x_all)[0].shape[0] // (data * M)
        acts, saved, g_in, acc, total = {}, {}, {}, [None] * K, 0.0
        for task in order:
            k, m = task.stage, task.microbatch
            if task.kind == TaskType.F:
                wf = jax.tree.map(lambda a, b: a + jnp.asarray(s_f[k], a.dtype) * b, w[k], u[k])
                for r in range(data):
                    gmb = r * M + m
                    x = _mb(x_all, gmb, rows) if k == 0 else acts.pop((k, m, r))
                    tgt = _mb(t_all, gmb, rows) if k == K - 1 else None
                    saved[(k, m, r)] = (wf, st[r][k], x, gmb, tgt)
                    y, st[r][k] = fns[k][0](wf, st[r][k], x, gmb, tgt)
                    if k == K - 1:
                        total += float(y)
                    else:
                        acts[(k + 1, m, r)] = y
            elif task.kind == TaskType.B:
                for r in range(data):
                    args = saved.pop((k, m, r))
                    ct = jnp.float32(1) if k == K - 1 else g_in.pop((k, m, r))
                    gp, gx = fns[k][1](*args, ct)
                    gp = jax.tree.map(lambda a: a / data, gp)
                    acc[k] = gp if acc[k] is None else jax.tree.map(jnp.add, acc[k], gp)
                    if k > 0:
                        g_in[(k - 1, m, r)] = gx
                if (m + 1) % window == 0:
                    g = jax.tree.map(lambda a: a / window, acc[k])
                    upd, opt[k] = update(g, opt[k], w[k])
                    w[k], u[k], acc[k] = optax.apply_updates(w[k], upd), upd, None
        losses.append(total / (M * data))
        mean = jax.tree.map(lambda *a: sum(a) / data, *st)   # state: replicas averaged
        st = [list(mean) for _ in range(data)]
    return losses, [p for stage in w for p in stage], [s for stage in st[0] for s in stage]
