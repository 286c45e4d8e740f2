"""A schedule -> the integer control table the runtime reads, tick by tick (pure numpy).

Per (tick, device) the table names the task of each kind (stage, microbatch) and the ring
buffer slots it reads and writes; per transfer channel, the slot where what arrives this
tick lands. Slots come from `Schedule.ring_slots` (interval colouring per device), so
ring sizes are what the table needs (1F1B keeps O(S) microbatches, GPipe O(M)). For the
inboxes, slot `size` (one past the last) is a dummy row that absorbs transfers nobody
needs; idle stash slots point there too (reads and writes clamp to the last row, and an
idle slot writes back what it read).

Channels: a value produced on device d for a stage on device d' moves by
`ppermute` over the channel (d' - d) mod S — +1 for 1F1B and interleaved (the last
device wraps to the first), -1 too for a V-shape, and 0 (local, no collective) for
a V's turn or for consecutive stages on one device.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxhybrid.schedules import IDLE, Schedule, TaskType
from jaxhybrid.schedules.asynchronous import WEIGHT_COLUMNS, weight_columns

# Columns of the control table (WEIGHT_COLUMNS: the weight version / prediction of each
# task of an asynchronous schedule).
COLUMNS = ("f_stage", "f_mb", "f_act", "f_stash",
           "b_stage", "b_mb", "b_grad", "b_stash", "b_cross",
           "w_stage", "w_mb", "w_stash", "w_cross",
           "u_stage", *WEIGHT_COLUMNS)
COL = {name: i for i, name in enumerate(COLUMNS)}


@dataclasses.dataclass(frozen=True)
class Channel:
    """One direction of transfer: devices d -> (d + shift) mod S, with `perm` the pairs
    actually used (empty for shift 0: kept on the device)."""
    shift: int
    perm: tuple


@dataclasses.dataclass(frozen=True)
class ControlTable:
    table: np.ndarray             # [ticks, devices, len(COLUMNS)] int32
    act_recv: np.ndarray          # [ticks, devices, channels] slot for arriving activations
    grad_recv: np.ndarray         # [ticks, devices, channels]
    act_channels: tuple
    grad_channels: tuple
    sizes: dict                   # ring sizes: act, grad, stash, cross
    kinds: frozenset              # TaskTypes some device runs (a slot per kind per tick)
    # Per tick, the same on every device: whether some device sends over activation /
    # gradient channel c, and whether some device runs a U task. The runtime issues a
    # tick's collectives under these flags only, so every device agrees on them.
    act_send: np.ndarray          # [ticks, channels] bool
    grad_send: np.ndarray         # [ticks, channels] bool
    update_tick: np.ndarray       # [ticks] bool


def _channels(sched: Schedule, edges: list) -> tuple:
    """Channels for transfers (src device, dst device)."""
    S = sched.num_devices
    shifts = sorted({(dst - src) % S for src, dst in edges})
    return tuple(Channel(sh, tuple(sorted({(a, b) for a, b in edges if (b - a) % S == sh and sh})))
                 for sh in shifts)


def control_table(sched: Schedule) -> ControlTable:
    S, K, T = sched.num_devices, sched.num_stages, sched.num_ticks
    dev = sched.stage_device
    (act_slot, grad_slot, stash_slot, cross_slot), sizes = sched.ring_slots()
    sizes = dict(sizes)   # ring_slots is cached: add the version ring to a copy
    act_edges = [(dev[k - 1], dev[k]) for k in range(1, K)]
    grad_edges = [(dev[k + 1], dev[k]) for k in range(K - 1)]
    act_ch, grad_ch = _channels(sched, act_edges), _channels(sched, grad_edges)
    tab = np.zeros((T, S, len(COLUMNS)), np.int32)
    for name in COLUMNS:
        tab[..., COL[name]] = IDLE if name.endswith(("stage", "mb")) else 0
    tab[..., COL["f_act"]], tab[..., COL["b_grad"]] = sizes["act"], sizes["grad"]
    tab[..., COL["f_stash"]] = tab[..., COL["b_stash"]] = tab[..., COL["w_stash"]] = sizes["stash"]
    tab[..., COL["b_cross"]] = tab[..., COL["w_cross"]] = sizes["cross"]
    act_recv = np.full((T, S, len(act_ch)), sizes["act"], np.int32)
    grad_recv = np.full((T, S, len(grad_ch)), sizes["grad"], np.int32)
    shift_of = lambda chans, a, b: [c.shift for c in chans].index((b - a) % S)
    for t in sched.tasks:
        row, k, m = tab[t.tick, t.device], t.stage, t.microbatch
        if t.kind == TaskType.F:
            row[COL["f_stage"]], row[COL["f_mb"]] = k, m
            if not sched.forward_only:   # forward-only programs stash nothing
                row[COL["f_stash"]] = stash_slot[(dev[k], (k, m))]
            if k > 0:
                row[COL["f_act"]] = act_slot[(dev[k], (k, m))]
            if k < K - 1:   # the output lands at stage k+1's device at the end of this tick
                act_recv[t.tick, dev[k + 1], shift_of(act_ch, dev[k], dev[k + 1])] = \
                    act_slot[(dev[k + 1], (k + 1, m))]
        elif t.kind in (TaskType.B, TaskType.W):
            p = "b" if t.kind == TaskType.B else "w"
            row[COL[f"{p}_stage"]], row[COL[f"{p}_mb"]] = k, m
            row[COL[f"{p}_stash"]] = stash_slot[(dev[k], (k, m))]
            if k < K - 1 and t.kind == TaskType.B:
                row[COL["b_grad"]] = grad_slot[(dev[k], (k, m))]
            if sched.split_backward:
                row[COL[f"{p}_cross"]] = cross_slot[(dev[k], (k, m))]
            if t.kind == TaskType.B and k > 0:
                grad_recv[t.tick, dev[k - 1], shift_of(grad_ch, dev[k], dev[k - 1])] = \
                    grad_slot[(dev[k - 1], (k - 1, m))]
        else:
            row[COL["u_stage"]] = k
    weights, sizes["versions"] = weight_columns(sched, stash_slot, sizes["stash"])
    for name, values in weights.items():
        tab[..., COL[name]] = values
    kinds = frozenset(t.kind for t in sched.tasks)
    return ControlTable(tab, act_recv, grad_recv, act_ch, grad_ch, sizes, kinds,
                        act_send=(act_recv != sizes["act"]).any(axis=1),
                        grad_send=(grad_recv != sizes["grad"]).any(axis=1),
                        update_tick=(tab[..., COL["u_stage"]] >= 0).any(axis=1))
