"""Split quality: the slowest stage of the automatic split of a whole model vs the best
split of a hand-made layer list, in one cost model (XLA cost analysis of lowered pieces).

The layer list is given to the splitter as one module with a forced cut after every
layer and no other cut, so its pieces are exactly the layers and both sides are costed
the same way; the planner's partition DP then picks the best contiguous split of each.

    python -m jaxhybrid.splitter.quality            # GPT tiny (tied) and Inception-V3 tiny
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import flax.linen as nn
import jax

from jaxhybrid.layers import takes_train
from jaxhybrid.plan import layer_times, partition, stage_costs
from jaxhybrid.splitter.costs import piece_costs
from jaxhybrid.splitter.model import SplitModel
from jaxhybrid.splitter.program import stage_boundary


class Sequential(nn.Module):
    """A layer list as one module; marked=True: a forced cut after every layer."""
    layers: Sequence[Any]
    marked: bool = False

    @nn.compact
    def __call__(self, x, train: bool = False):
        for i, layer in enumerate(self.layers):
            x = layer(x, train=train) if takes_train(layer) else layer(x)
            if self.marked and i < len(self.layers) - 1:
                x = stage_boundary(x)
        return x


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
    hand = SplitModel(Sequential(tuple(layers), marked=True), sample, max_pieces=1)
    rows = []
    for S in stages:
        a, plan_s = bottleneck(auto, sample, S)
        h = bottleneck(hand, sample, S)[0] if S <= hand.num_pieces else float("nan")
        rows.append(dict(stages=S, auto=a, hand=h, ratio=a / h, pieces=auto.num_pieces,
                         layers=hand.num_pieces, ops=len(auto._traced(auto._x_abs, True).prog.ops),
                         split_s=split_s, cost_plan_s=plan_s))
    return rows


def main() -> None:
    from jaxhybrid.models import get_model
    gpt_tied, gpt = get_model("gpt", "tiny", tied=True), get_model("gpt", "tiny", tied=False)
    inc = get_model("inception_v3", "tiny")
    cases = [("gpt tiny (tied, one module)", gpt_tied.layers[0], gpt.layers,
              gpt.sample_batch(2)[0]),
             ("inception_v3 tiny (one module)", Sequential(tuple(inc.layers)), inc.layers,
              inc.sample_batch(2)[0])]
    for name, model, layers, x in cases:
        for r in compare(model, layers, x):
            print(f"{name}: S={r['stages']} slowest stage auto/hand = {r['ratio']:.3f} "
                  f"(nan: the list has fewer layers than stages) "
                  f"({r['pieces']} pieces of {r['ops']} ops vs {r['layers']} layers); "
                  f"split {r['split_s']:.2f} s, cost+plan {r['cost_plan_s']:.2f} s")


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    main()
