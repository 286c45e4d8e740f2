"""The projection's network (`jaxhybrid.plan.hybrid`): the links of a pipeline group, the
collectives over the "model" group and the gradient all-reduce over the `data` replicas,
on a `Hardware`'s nodes (devices node-major, as `make_mesh` lays out data x pipe x
model: replica r's stage s, model rank t on device (r * pipe + s) * model + t)."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from jaxhybrid.plan.costs import LayerCost
from jaxhybrid.plan.hardware import Hardware
from jaxhybrid.plan.model_axis import model_comm_time
from jaxhybrid.plan.topology import Topology


def replica_offsets(hw: Hardware, group: int, data: int) -> tuple[int, ...]:
    """Where in its node each of `data` replicas of `group` consecutive devices starts
    (device r * group of replica r, nodes of `devices_per_node`): the distinct offsets,
    at most devices_per_node of them."""
    dpn = hw.devices_per_node
    return tuple(sorted({(r * group) % dpn for r in range(max(1, min(data, dpn)))}))


def pipeline_topology(hw: Hardware, pipe: int, model: int = 1, data: int = 1) -> Topology:
    """The links of the pipeline groups: `pipe` devices `model` apart (the "model" axis is
    innermost), node-major, replica r starting at device r * pipe * model. Where a group
    does not divide the node some replicas straddle a node boundary; the lock-step ticks
    wait for every replica's transfers, so each link is its slowest over the replicas
    (bandwidth the least, latency the most)."""
    dpn, pos = hw.devices_per_node, np.arange(pipe) * model
    bw = np.full((pipe, pipe), np.inf)
    lat = np.zeros((pipe, pipe))
    for o in replica_offsets(hw, pipe * model, data):
        node = (o + pos) // dpn
        cross = node[:, None] != node[None, :]
        bw = np.minimum(bw, np.where(cross, hw.inter_bandwidth, hw.p2p_bandwidth))
        lat = np.maximum(lat, np.where(cross, hw.inter_latency, hw.intra_latency))
    nodes = math.ceil(pipe * model / dpn)
    return Topology(bw, lat, f"{pipe} stages {model} apart, {dpn} devices per node"
                             + (f", {nodes} nodes" if nodes > 1 else ""))


def model_times(costs: Sequence[LayerCost], hw: Hardware, model: int,
                groups: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds per layer of the collectives over the model group
    (`model_axis.model_comm_time`; `groups` groups of `model` consecutive devices:
    inside a node, on the all-reduce links, while no group straddles a node boundary,
    else on the network: the lock-step program waits for the slowest group)."""
    inside = all(o + model <= hw.devices_per_node for o in replica_offsets(hw, model, groups))
    bw = hw.allreduce_bandwidth if inside else hw.inter_bandwidth
    lat = hw.intra_latency if inside else hw.inter_latency
    one = lambda b, n: model_comm_time(b * hw.bytes_scale, model, bw, lat, n)  # noqa: E731
    return (np.array([one(c.model_fwd_comm_bytes, c.model_fwd_collectives) for c in costs]),
            np.array([one(c.model_bwd_comm_bytes, c.model_bwd_collectives) for c in costs]))


def allreduce_time(hw: Hardware, data: int, pipe: int, stage_bytes: Sequence[float]) -> float:
    """All stages' gradient all-reduces over their `data` replicas, run at once.

    Placement as `make_mesh` builds it: replica r's stage s on device r * pipe + s, nodes
    of `devices_per_node` consecutive devices. Stage s's group has m = dpn // pipe members
    per node (1 when pipe >= dpn) on n = ceil(data / m) nodes. Hierarchical (NCCL-style):
    reduce-scatter and all-gather inside the node, 2 (m-1)/m * bytes / allreduce_bandwidth;
    between nodes a ring moves 2 (n-1)/n of each group's bytes through every node's network
    cards, which all groups with a stage on that node share (their bytes add up);
    latency: ring steps inside a node, a tree (2 ceil(log2 n) hops) between nodes.
    With finite `compute_slots` (one host) the groups' copies serialise like compute.
    """
    if data <= 1:
        return 0.0
    sb = np.asarray(stage_bytes, float)
    dpn = hw.devices_per_node
    m = min(data, max(1, dpn // pipe))
    n = math.ceil(data / m)
    t = 0.0
    if m > 1:
        per = 2.0 * (m - 1) / m / hw.allreduce_bandwidth
        if math.isfinite(hw.compute_slots):
            t += max(sb.max() * per, sb.sum() * per * data / hw.compute_slots)
        else:
            t += sb.max() * per
        t += 2 * (m - 1) * hw.intra_latency
    if n > 1:
        if pipe <= dpn:
            load = sb.sum()
        else:
            load = max(sb[i:i + dpn].sum() for i in range(0, pipe, dpn))
        t += 2.0 * (n - 1) / n * load / hw.inter_bandwidth
        t += 2 * math.ceil(math.log2(n)) * hw.inter_latency
    return float(t)
