"""`bench plan --sections=policy`: what a stage's backward costs under a jax.checkpoint
policy, priced by the plan (`pipeline.policy_costs`: the FLOPs the backward runs again,
over the forward's) and measured.

A stack of blocks (Dense(2w) + tanh, Dense(w) + sin, a residual) on 4 stages, each stage
timed as the pipeline runs it: its forward under `jax.vjp` (the residuals kept) and its
backward applied to those residuals, two compiled programs, so that XLA cannot share
the recomputation with the forward as it would in one program. Printed: per policy the
stages' forward + backward seconds against remat="none"'s, measured (the least of
--repeats runs, the policies interleaved so that load hits them alike) and priced
(`Plan.stage_fwd_time + stage_bwd_time`). Then remat="auto" under a budget halfway
between the memory predicted with dots_saveable and with nothing recomputed, with and
without the policies it may choose (`pipeline.planning.AUTO_POLICIES`): what each
recomputes, its predicted and compiled bytes per device, its predicted and measured
value_and_grad step (M=4), and whether its loss and gradients equal no recompute's.
"""
from __future__ import annotations

import time

import numpy as np

POLICIES = ("none", "dots_saveable", "nothing_saveable", "full")


def _model(width: int):
    import flax.linen as nn
    import jax.numpy as jnp

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jnp.tanh(nn.Dense(2 * width)(x))
            return x + jnp.sin(nn.Dense(width)(h))

    return [nn.Dense(width)] + [Block() for _ in range(6)] + [nn.Dense(4)]


def _stage_steps(layers, per_layer, x, cuts, policy: str) -> list:
    """Per stage (forward under vjp, backward, its arguments), compiled and run once."""
    import jax
    import jax.numpy as jnp

    from jaxhybrid.pipeline.stages import StageProgram
    steps, edges = [], [0, *cuts, len(layers)]
    for s, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        program = StageProgram(index=s, start=a, stop=b, stage_remat=policy)
        params = [v["params"] for v in per_layer[a:b]]

        def stage(p, h, program=program):
            return program.apply(layers, p, [{}] * len(p), h, train=True, rng=None,
                                 microbatch=0)[0]

        forward = jax.jit(lambda p, h, stage=stage: jax.vjp(stage, p, h))
        backward = jax.jit(lambda pull, c: pull(c))
        out, pull = forward(params, x)
        jax.block_until_ready(backward(pull, jnp.ones_like(out)))
        steps.append((forward, backward, params, x, jnp.ones_like(out)))
        x = out
    return steps


def _run(steps) -> float:
    import jax
    t0 = time.perf_counter()
    for forward, backward, params, x, ct in steps:
        out, pull = forward(params, x)
        jax.block_until_ready(backward(pull, ct))
    return time.perf_counter() - t0


def policy_rows(width: int = 256, microbatch: int = 64, repeats: int = 20,
                policies=POLICIES) -> list[dict]:
    """Per policy: measured and priced forward + backward seconds of the 4 stages."""
    import jax

    import jaxhybrid as jh
    from jaxhybrid import pipeline as jp
    from jaxhybrid.layers import init_layer
    layers, cuts = _model(width), [2, 4, 6]
    x = jax.random.normal(jax.random.key(0), (microbatch, 16))
    per_layer, h = [], x
    for i, layer in enumerate(layers):
        v, h = init_layer(layer, jax.random.key(i), h, train=True)
        per_layer.append(v)
    steps, priced = {}, {}
    for policy in policies:
        pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=4), num_microbatches=1,
                           boundaries=cuts, remat=policy)
        pipe.init(jax.random.key(1), x)
        priced[policy] = (float(np.sum(pipe.plan.stage_fwd_time) + np.sum(pipe.plan.stage_bwd_time)),
                          pipe.plan.stage_policy_recompute)
        steps[policy] = _stage_steps(layers, per_layer, x, cuts, policy)
    runs = {p: [] for p in policies}
    for _ in range(repeats):
        for policy in policies:
            runs[policy].append(_run(steps[policy]))
    return [dict(policy=p, measured=min(runs[p]), priced=priced[p][0], again=priced[p][1])
            for p in policies]


def print_policy(rows, width: int, microbatch: int) -> None:
    base = {k: rows[0][k] for k in ("measured", "priced")}
    print(f"blocks of Dense({2 * width})+tanh, Dense({width})+sin on 4 stages, microbatch "
          f"{microbatch}: forward + backward of the stages against remat={rows[0]['policy']!r}")
    print(f"{'remat':>18} {'measured ms':>12} {'measured x':>11} {'priced x':>9}  "
          f"share of the forward run again (priced, per stage)")
    for r in rows:
        again = "-" if r["again"] is None else ", ".join(f"{a:.2f}" for a in r["again"])
        print(f"{r['policy']:>18} {1e3 * r['measured']:>12.3f} "
              f"{r['measured'] / base['measured']:>11.3f} {r['priced'] / base['priced']:>9.3f}  {again}")


def _auto_pipeline(layers, x, remat, budget=None, policies=None):
    import jax

    import jaxhybrid as jh
    from jaxhybrid import pipeline as jp
    from jaxhybrid.pipeline import planning
    saved = planning.AUTO_POLICIES
    planning.AUTO_POLICIES = saved if policies is None else policies
    try:
        pipe = jp.Pipeline(layers, mesh=jh.make_mesh(data=1, pipe=4), num_microbatches=4,
                           boundaries=[2, 4, 6], remat=remat, memory_budget=budget,
                           param_state_factor=2)   # value_and_grad: no optimizer state
        return pipe, pipe.init(jax.random.key(1), x)
    finally:
        planning.AUTO_POLICIES = saved


def auto_rows(width: int = 256, microbatch: int = 64, repeats: int = 20) -> tuple[list, int]:
    """(Per setup: remat="none", "auto" with and without policies, its plan's
    recomputation, memory and step, predicted and measured; the budget)."""
    import jax
    import jax.numpy as jnp

    from jaxhybrid.step_memory import compiled_bytes
    layers = _model(width)
    x = jax.random.normal(jax.random.key(0), (4 * microbatch, 16))
    t = jnp.zeros((4 * microbatch, 4))
    mse = lambda y, t: jnp.mean((y - t) ** 2)  # noqa: E731
    none, variables = _auto_pipeline(layers, x, "none")
    dots = _auto_pipeline(layers, x, "dots_saveable")[0].plan.device_memory
    budget = int((dots + none.plan.device_memory) / 2)
    setups = {"none": none, "auto": _auto_pipeline(layers, x, "auto", budget)[0],
              "auto, layers only": _auto_pipeline(layers, x, "auto", budget, ())[0]}
    steps = {k: jax.jit(p.value_and_grad(mse)) for k, p in setups.items()}
    compiled = {k: compiled_bytes(f.lower(variables, x, t).compile()) for k, f in steps.items()}
    outs = {k: jax.block_until_ready(f(variables, x, t)) for k, f in steps.items()}
    runs = {k: [] for k in steps}
    for _ in range(repeats):
        for k, f in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(variables, x, t))
            runs[k].append(time.perf_counter() - t0)
    exact = lambda o: all(bool(jnp.array_equal(a, b)) for a, b in  # noqa: E731
                          zip(jax.tree.leaves(o[:2]), jax.tree.leaves(outs["none"][:2])))
    rows = []
    for k, p in setups.items():
        plan = p.plan
        what = ", ".join(str(r) if isinstance(r, str) else str(sum(r))
                         for r in (plan.pipeline_remat if plan.stage_policy else
                                   [plan.remat[a:b] for a, b in plan.stage_ranges]))
        rows.append(dict(setup=k, recompute=what, predicted_bytes=plan.device_memory,
                         compiled_bytes=compiled[k], predicted=plan.predicted_step_time,
                         measured=min(runs[k]), exact=exact(outs[k])))
    return rows, budget


def print_auto(rows, budget: int) -> None:
    from jaxhybrid.plan.topology import fmt_bytes
    print(f'remat="auto" under a budget of {fmt_bytes(budget)} per device (data=1 x pipe=4, '
          f"M=4); recompute per stage: layers recomputed or the policy")
    print(f"{'setup':>18} {'recompute per stage':<44} {'pred. mem':>9} {'compiled':>9} "
          f"{'pred. ms':>8} {'meas. ms':>8}  exact")
    for r in rows:
        print(f"{r['setup']:>18} {r['recompute'][:44]:<44} {fmt_bytes(r['predicted_bytes']):>9} "
              f"{fmt_bytes(r['compiled_bytes']):>9} {1e3 * r['predicted']:>8.3f} "
              f"{1e3 * r['measured']:>8.3f}  {r['exact']}")
