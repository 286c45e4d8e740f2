"""Split quality: the slowest stage of the automatic split of a whole model vs the best
split of a hand-made layer list, in one cost model (XLA cost analysis of lowered pieces).

The layer list is given to the splitter as one module with a forced cut after every
layer and no other cut, so its pieces are exactly the layers and both sides are costed
the same way; the planner's partition DP then picks the best contiguous split of each.

    python -m jaxhybrid.splitter.quality            # GPT tiny (tied) and Inception-V3 tiny
    python -m jaxhybrid.splitter.quality flaxexamples DIR   # DIR: flax checkout's examples/
    python -m jaxhybrid.splitter.quality overhead   # CPU-s of a step: one module vs a list
    python -m jaxhybrid.splitter.quality overhead auto   # ... split and planned by itself
    python -m jaxhybrid.splitter.quality thirdparty # models nobody here wrote (see below)

`thirdparty` needs `pip install --no-deps --target DIR bottleneck-transformer-flax
deepvit-flax einops` and DIR on PYTHONPATH (they are not dependencies of jaxhybrid).
"""
from __future__ import annotations

import os
import resource
import sys
import time
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np

from jaxhybrid.layers import mode_kwargs
from jaxhybrid.models.spec import Sequential
from jaxhybrid.plan import layer_times, partition, stage_costs
from jaxhybrid.splitter.costs import piece_costs
from jaxhybrid.splitter.model import SplitModel
from jaxhybrid.splitter.program import stage_boundary


class CutAfter(nn.Module):
    """A layer followed by a forced cut."""
    layer: Any

    @nn.compact
    def __call__(self, x, train: bool = False):
        return stage_boundary(self.layer(x, **mode_kwargs(self.layer, train)))


def as_module(layers: Sequence[Any], marked: bool = False) -> nn.Module:
    """A layer list as one module; marked=True: a forced cut after every layer, so the
    pieces are exactly the layers."""
    layers = tuple(layers)
    if marked:
        layers = (*[CutAfter(l) for l in layers[:-1]], layers[-1])
    return Sequential(layers)


def bottleneck(split: SplitModel, sample, num_stages: int) -> tuple[float, float]:
    """(slowest stage time of the best split into num_stages, seconds to cost + plan)."""
    t0 = time.perf_counter()
    times = layer_times(piece_costs(split, sample))
    cuts = partition(times, num_stages)
    return float(stage_costs(times, cuts).compute.max()), time.perf_counter() - t0


def compare(model, layers, sample, stages=(4, 8)) -> list[dict]:
    t0 = time.perf_counter()
    auto = SplitModel(model, sample, min_pieces=max(stages))
    split_s = time.perf_counter() - t0
    hand = SplitModel(as_module(layers, marked=True), sample, max_pieces=1)
    rows = []
    for S in stages:
        a, plan_s = bottleneck(auto, sample, S)
        h = bottleneck(hand, sample, S)[0] if S <= hand.num_pieces else float("nan")
        rows.append(dict(stages=S, auto=a, hand=h, ratio=a / h, pieces=auto.num_pieces,
                         layers=hand.num_pieces, ops=len(auto._traced(auto._x_abs, True).prog.ops),
                         split_s=split_s, cost_plan_s=plan_s))
    return rows


def quality_cases(which=("gpt", "gpt6", "inception_v3")):
    """(name, the model as one module (`models.module`), its hand-made layer list, one
    microbatch): GPT tiny with tied embeddings vs the untied list (2 blocks: 4 layers;
    "gpt6": 6 blocks, 8 layers, so that S=8 has a list split), Inception-V3 tiny."""
    from jaxhybrid import models
    cases = []
    for key in which:
        name, kw = {"gpt": ("gpt", {}), "gpt6": ("gpt", {"num_layers": 6}),
                    "inception_v3": ("inception_v3", {})}[key]
        tied = {"tied": True} if name == "gpt" else {}
        listed = models.get_model(name, "tiny", **kw)
        cases.append((f"{key} tiny{' (tied)' if tied else ''}",
                      models.module(name, "tiny", **kw, **tied), listed.layers,
                      listed.sample_batch(2)[0]))
    return cases


def main() -> None:
    for name, model, layers, x in quality_cases():
        for r in compare(model, layers, x):
            print(f"{name}: S={r['stages']} slowest stage auto/hand = {r['ratio']:.3f} "
                  f"(nan: the list has fewer layers than stages) "
                  f"({r['pieces']} pieces of {r['ops']} ops vs {r['layers']} layers); "
                  f"split {r['split_s']:.2f} s, cost+plan {r['cost_plan_s']:.2f} s")


def overhead(repeats: int = 7, automatic: bool = False) -> float:
    """CPU-seconds of a pipelined step of GPT tiny (4 blocks) given as one module over the
    same model as a list. automatic=False: the module has forced cuts at the layers and
    takes the list's planned boundaries (the splitter's own overhead); True: the model as
    `models.module("gpt")`, split and planned automatically (pieces and cuts its own)."""
    import jaxhybrid as jh
    from jaxhybrid import pipeline as jp
    from jaxhybrid.models import get_model, module
    spec = get_model("gpt", "tiny", tied=False, num_layers=4)
    data, S, M = 2, 2, 4
    x, t = spec.sample_batch(data * M * 4)
    mesh = jh.make_mesh(data=data, pipe=S)
    lp = jp.Pipeline(spec.layers, mesh=mesh, num_microbatches=M, schedule="1f1b", remat="none")
    lv = lp.init(jax.random.key(0), x)
    if automatic:
        sp = jp.Pipeline(module("gpt", "tiny", tied=False, num_layers=4), mesh=mesh,
                         num_microbatches=M, schedule="1f1b", remat="none")
        sv = sp.init(jax.random.key(0), x)
        split = sp.splitter.split
    else:
        split = SplitModel(as_module(spec.layers, marked=True), x[:4], max_pieces=1)
        sp = jp.Pipeline(split, mesh=mesh, num_microbatches=M, schedule="1f1b", remat="none",
                         boundaries=lp.boundaries)
        sv = sp.pack(split.init_variables(jax.random.key(0), x))
    steps = {"list": (lp.value_and_grad(spec.loss_fn), lv),
             "split": (sp.value_and_grad(spec.loss_fn), sv)}
    cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    rng, times = jax.random.key(1), {k: [] for k in steps}
    for f, v in steps.values():
        jax.block_until_ready(f(v, x, t, rng))
    for _ in range(repeats):   # interleaved, so both see the same machine load
        for k, (f, v) in steps.items():
            c0 = cpu()
            jax.block_until_ready(f(v, x, t, rng))
            times[k].append(cpu() - c0)
    ml, ms = float(np.median(times["list"])), float(np.median(times["split"]))
    print(f"CPU-s per step (median of {repeats}): list {ml:.4f}, one module {ms:.4f}, "
          f"ratio {ms / ml:.3f} (list cut at {lp.boundaries}; module cut at "
          f"{sp.boundaries} of {split.num_pieces} pieces)")
    return ms / ml


def _load_file(name: str, path: str):
    """A module from a file path (packages whose own __init__ is broken, example dirs)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TwoInputs(nn.Module):
    """model(a, b) called as model((a, b)): the pipeline hands a model one input pytree."""
    model: Any

    @nn.compact
    def __call__(self, x):
        return self.model(*x)


def _linen_with_local_batch_norm():
    """flax.linen as a module namespace whose BatchNorm ignores axis_name: the example's
    ResNet syncs statistics over a pmap axis 'batch' that only its own trainer binds."""
    import types

    class BatchNorm(nn.BatchNorm):
        def __post_init__(self):
            object.__setattr__(self, "axis_name", None)
            super().__post_init__()

    shim = types.ModuleType("linen_local_batch_norm")
    shim.__dict__.update(nn.__dict__)
    shim.BatchNorm = BatchNorm
    return shim


def _flax_example_models(examples: str):
    """Models from Flax's own examples/ (a checkout of github.com/google/flax), tiny."""
    imagenet = _load_file("flax_imagenet_models", os.path.join(examples, "imagenet/models.py"))
    lm1b = _load_file("flax_lm1b_models", os.path.join(examples, "lm1b/models.py"))
    wmt = _load_file("flax_wmt_models", os.path.join(examples, "wmt/models.py"))
    lm_cfg = lm1b.TransformerConfig(vocab_size=13, output_vocab_size=13, emb_dim=16,
                                    num_heads=2, num_layers=2, qkv_dim=16, mlp_dim=32,
                                    max_len=8, dropout_rate=0.1, attention_dropout_rate=0.1,
                                    logits_via_embedding=True, deterministic=False)
    mt_cfg = wmt.TransformerConfig(vocab_size=13, output_vocab_size=13, share_embeddings=True,
                                   logits_via_embedding=True, emb_dim=16, num_heads=2,
                                   num_layers=2, qkv_dim=16, mlp_dim=32, max_len=8,
                                   dropout_rate=0.1, attention_dropout_rate=0.1,
                                   deterministic=False)
    r = np.random.RandomState(0)
    images = lambda n: (r.randn(n, 16, 16, 3).astype(np.float32),
                        r.randint(0, 5, size=(n,)).astype(np.int32))
    ids = lambda n: r.randint(1, 13, size=(n, 8)).astype(np.int32)
    tokens = lambda n: (lambda t: (t, t))(ids(n))
    pairs = lambda n: (lambda s, t: ((s, t), t))(ids(n), ids(n))
    local_bn = _load_file("flax_imagenet_models_local_bn",
                          os.path.join(examples, "imagenet/models.py"))
    local_bn.nn = _linen_with_local_batch_norm()
    resnet = lambda m: m.ResNet(stage_sizes=[1, 1], block_cls=m.ResNetBlock, num_classes=5,
                                num_filters=4)
    return [("ResNet (flax examples/imagenet, as is: BatchNorm synced over axis 'batch')",
             resnet(imagenet), images, {"train": False}),
            ("ResNet (flax examples/imagenet, BatchNorm per replica: axis_name=None)",
             resnet(local_bn), images, {"train": False}),
            ("TransformerLM (flax examples/lm1b: logits via the embedding, dropout)",
             lm1b.TransformerLM(lm_cfg), tokens, {}),
            ("Transformer (flax examples/wmt: encoder-decoder, shared embeddings, dropout)",
             TwoInputs(wmt.Transformer(mt_cfg)), pairs, {})]


def _third_party_models():
    from bottleneck_transformer_flax.botnet import BoTNet, BoTNetConfig
    # deepvit-flax's own __init__ imports a name that does not exist: load the module file.
    import importlib.util
    path = importlib.util.find_spec("deepvit_flax").submodule_search_locations[0]
    deepvit = _load_file("deepvit", os.path.join(path, "deepvit.py"))
    r = np.random.RandomState(0)
    images = lambda shape: lambda n: (r.randn(n, *shape).astype(np.float32),
                                      r.randint(0, 5, size=(n,)).astype(np.int32))
    return [("BoTNet (bottleneck-transformer-flax)",
             BoTNet(BoTNetConfig(stage_sizes=[1, 1], num_classes=5, initial_filters=4,
                                 num_heads=2, head_dim=4)), images((16, 16, 3)),
             {"train": False}),
            ("DeepViT (deepvit-flax)",
             deepvit.DeepViT(image_size=8, patch_size=4, num_classes=5, dim=16, depth=2,
                             heads=2, mlp_dim=32, dim_head=8), images((8, 8, 3)), {})]


def third_party(cases, data: int = 2, stages: int = 2, microbatches: int = 2) -> None:
    """Exactness of models nobody here wrote, split and planned automatically: prints the
    loss, gradient and batch-statistics errors against the unsplit model. `cases`:
    (name, model, batch(n) -> (inputs, targets), init keyword arguments)."""
    import jax.numpy as jnp
    import jaxhybrid as jh
    from jaxhybrid import pipeline as jp

    def loss_fn(y, t):   # cross-entropy over the last axis (classes or vocabulary)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(y), t[..., None], -1))

    # Max error over leaves / max(1, the leaf's max), the tests' tolerance: a leaf whose
    # exact gradient is 0 (a BatchNorm bias before another BatchNorm) holds only roundoff.
    rel = lambda a, b: max(float(np.abs(np.asarray(p) - np.asarray(q)).max() /
                                 max(1.0, np.abs(np.asarray(q)).max()))
                           for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    for name, model, batch, init_kw in cases:
        x, t = batch(data * microbatches * 2)
        native = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                            jax.tree.map(lambda a: a[:1], x), **init_kw)
        if "batch_stats" in native:
            native = {**native, "batch_stats": jax.tree.map(lambda a: a + 0.3,
                                                            native["batch_stats"])}
        try:
            pipe = jp.Pipeline(model, mesh=jh.make_mesh(data=data, pipe=stages),
                               num_microbatches=microbatches, schedule="1f1b", remat="none")
            pipe.init(jax.random.key(0), x)
            v = pipe.pack(native)
            key = jax.random.key(5)
            loss, g, new = pipe.value_and_grad(loss_fn)(v, x, t, key)
        except Exception as e:  # noqa: BLE001 - report what broke and go on
            print(f"{name}: BROKE: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        rl, rg, rv = jp.reference_value_and_grad([model], [native], loss_fn, x, t, data=data,
                                                 num_microbatches=microbatches, rng=key)
        stats = (f", batch_stats {rel(pipe.unpack(new)['batch_stats'], rv[0]['batch_stats']):.1e}"
                 if "batch_stats" in native else "")
        shared = pipe.splitter.split.shared_variables()
        print(f"{name}: {len(pipe.layers)} pieces, cut {pipe.boundaries}; loss rel. error "
              f"{abs(float(loss) - float(rl)) / abs(float(rl)):.1e}, grads "
              f"{rel(pipe.unpack({**v, 'params': g})['params'], rg[0]):.1e}{stats}"
              f"{'; shared ' + str(sorted(shared)) if shared else ''}")


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8")
    jax.config.update("jax_platforms", "cpu")
    what = (sys.argv[1:] or ["main"])[0]
    if what == "thirdparty":
        third_party(_third_party_models())
    elif what == "flaxexamples":   # argument: the examples/ directory of a flax checkout
        third_party(_flax_example_models(sys.argv[2]))
    elif what == "overhead":      # "overhead auto": split and planned automatically
        overhead(automatic=sys.argv[2:] == ["auto"])
    else:
        main()
