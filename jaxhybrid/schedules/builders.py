"""The registered schedule builders and `make_schedule`."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable


from jaxhybrid.checks import is_int
from jaxhybrid.schedules.placer import ScheduleDeadlock, place_tasks
from jaxhybrid.schedules.tasks import Schedule, TaskType

SCHEDULES: dict[str, Callable[..., Schedule]] = {}


def register_schedule(name: str):
    """Decorator: adds a builder `f(num_stages, num_microbatches, **options) -> Schedule`
    to `SCHEDULES` under `name`."""
    def deco(fn):
        if name in SCHEDULES:
            raise ValueError(f"register_schedule: {name!r} is already registered.")
        SCHEDULES[name] = fn
        return fn
    return deco


def _one_f_one_b_order(forwards: list, backwards: list, warmup: int) -> list:
    """`warmup` forwards, then alternately a backward and a forward, then the rest."""
    warmup = min(warmup, len(forwards))
    order = list(forwards[:warmup])
    rest_f = forwards[warmup:]
    for i, b in enumerate(backwards):
        order.append(b)
        if i < len(rest_f):
            order.append(rest_f[i])
    return order


@register_schedule("gpipe")
def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    S, M = num_stages, num_microbatches
    orders = [[(TaskType.F, d, m) for m in range(M)] + [(TaskType.B, d, m) for m in range(M)]
              for d in range(S)]
    return place_tasks("gpipe", S, M, range(S), orders)


def one_f_one_b_warmup(num_stages: int, device: int) -> int:
    """Forwards before stage `device`'s first backward in lock step: the round trip of
    microbatch 0 to the last stage and back takes 2(S-1-d) ticks."""
    return 2 * (num_stages - 1 - device) + 1


@register_schedule("1f1b")
def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    S, M = num_stages, num_microbatches
    orders = [_one_f_one_b_order([(TaskType.F, d, m) for m in range(M)],
                                 [(TaskType.B, d, m) for m in range(M)],
                                 one_f_one_b_warmup(S, d)) for d in range(S)]
    return place_tasks("1f1b", S, M, range(S), orders)


def _interleaved_groups(S: int, M: int) -> list:
    """Microbatch groupings to try: groups of S (Megatron's), and when M % S leaves a
    short last group, that group merged into the one before it. A short group runs its
    few microbatches through all S*v stages nearly alone: with M = S+1 a bubble above
    1f1b's (S=8 v=2: 0.35 against 0.29), merged 0.17, for one more microbatch in flight."""
    groups = [list(range(g, min(g + S, M))) for g in range(0, M, S)]
    if len(groups) > 1 and len(groups[-1]) < S:
        return [groups, groups[:-2] + [groups[-2] + groups[-1]]]
    return [groups]


def _interleaved_orders(S: int, v: int, extra: int, groups: list) -> list:
    orders = []
    for d in range(S):
        fw = [(TaskType.F, c * S + d, m) for grp in groups for c in range(v) for m in grp]
        bw = [(TaskType.B, c * S + d, m) for grp in groups for c in reversed(range(v))
              for m in grp]
        orders.append(_one_f_one_b_order(fw, bw, (v - 1) * S + one_f_one_b_warmup(S, d) + extra))
    return orders


@register_schedule("interleaved")
def interleaved(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    S, M, v = num_stages, num_microbatches, virtual_stages
    if not is_int(v) or v < 1:
        raise ValueError(f"interleaved: virtual_stages={v!r} must be an int >= 1.")
    stage_device = [k % S for k in range(S * v)]
    best = None
    # The smallest extra warm-up whose table has the least bubble (more warm-up only
    # costs memory once the lock step no longer stalls): extra 0..S, or when all of those
    # deadlock (S=8, M=21, v=3 needs 33: the builder returned None) the S + 1 smallest
    # that place; with every forward in the warm-up (extra = v*M) the order is
    # GPipe's, which always places.
    for groups in _interleaved_groups(S, M):
        placed = 0
        for extra in range(0, v * M + 1):
            try:
                s = place_tasks("interleaved", S, M, stage_device,
                                _interleaved_orders(S, v, extra, groups))
            except ScheduleDeadlock:
                continue
            if best is None or s.bubble_fraction() < best.bubble_fraction() - 1e-9:
                best = s
            placed += 1
            if placed > S or extra >= S:
                break
    return best


@register_schedule("zb-h1")
def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    S, M = num_stages, num_microbatches
    # Every device may hold as many microbatches as 1f1b's busiest (2S-1): the later
    # stages then defer W so that B runs first and the last microbatch's backward chain
    # starts early — which is what removes the cool-down bubble.
    cap = [one_f_one_b_warmup(S, 0)] * S
    orders = [_one_f_one_b_order([(TaskType.F, d, m) for m in range(M)],
                                 [(TaskType.B, d, m) for m in range(M)],
                                 one_f_one_b_warmup(S, d)) for d in range(S)]
    return place_tasks("zb-h1", S, M, range(S), orders, split_backward=True, per_tick=1,
                       in_flight_cap=cap)


@register_schedule("zbv")
def zbv(num_stages: int, num_microbatches: int) -> Schedule:
    S, M = num_stages, num_microbatches
    # V-shape: device d holds stages d and 2S-1-d, so the turn (S-1 -> S) stays on the
    # last device and the loss is computed on device 0, next to the input.
    stage_device = [k if k < S else 2 * S - 1 - k for k in range(2 * S)]
    orders = [[(kind, k, m) for kind in (TaskType.F, TaskType.B) for k in (d, 2 * S - 1 - d)
               for m in range(M)] for d in range(S)]
    # B before F before W; then the earlier microbatch; then the later stage (finish a
    # microbatch before starting another: bounded memory).
    priority = lambda t: (0 if t[0] == TaskType.B else 1, t[2], -t[1])
    return place_tasks("zbv", S, M, stage_device, orders, split_backward=True, per_tick=1,
                       in_flight_cap=[3 * S] * S, priority=priority)



def forward_schedule(sched: Schedule) -> Schedule:
    """Forward tasks only (evaluation) on the same stage -> device map: every device
    runs its ready forward of the earliest microbatch each tick."""
    D, M, K = sched.num_devices, sched.num_microbatches, sched.num_stages
    orders = [[(TaskType.F, k, m) for k in range(K) if sched.stage_device[k] == d
               for m in range(M)] for d in range(D)]
    return place_tasks(f"{sched.name}-forward", D, M, sched.stage_device, orders, per_tick=1,
                       priority=lambda t: (t[2], t[1]), forward_only=True)


@functools.lru_cache(maxsize=256)
def _cached(name: str, num_stages: int, num_microbatches: int, options: tuple) -> Schedule:
    sched = SCHEDULES[name](num_stages, num_microbatches, **dict(options))
    # A registered builder may build its tasks by hand (docs/pipeline.md): what it returns
    # is checked like a user's Schedule (an invalid table ran, silently).
    if not isinstance(sched, Schedule) or (sched.num_devices, sched.num_microbatches) != \
            (num_stages, num_microbatches):
        what = (f"{sched.num_devices} devices x {sched.num_microbatches} microbatches"
                if isinstance(sched, Schedule) else type(sched).__name__)
        raise ValueError(f"schedule builder {name!r} returned {what} for {num_stages} x "
                         f"{num_microbatches}; it must return a Schedule of that size.")
    sched.validate()
    return dataclasses.replace(sched, options=_resolved_options(SCHEDULES[name], sched, options))


def _resolved_options(builder: Callable, sched: Schedule, passed: tuple) -> tuple:
    """Every option the table was built with: the builder's defaults, those it resolved
    itself (2bw's window, from S and M) and the passed ones. With only the passed ones a
    default's table was not told from another (a 2bw reference written for window 1)."""
    defaults = {p.name: p.default for p in list(inspect.signature(builder).parameters.values())[2:]
                if p.default is not inspect.Parameter.empty and p.default is not None}
    return tuple(sorted({**defaults, **dict(sched.options), **dict(passed)}.items()))


def make_schedule(name: str | Schedule, num_stages: int, num_microbatches: int,
                  **options) -> Schedule:
    """The task table of a registered schedule (see `SCHEDULES`), or a user's `Schedule`
    checked against the pipeline's depth and microbatch count. num_stages = pipeline
    depth in devices; options: e.g. virtual_stages=2 for "interleaved"."""
    if isinstance(name, Schedule):
        if name.num_devices != num_stages or name.num_microbatches != num_microbatches:
            raise ValueError(f"schedule {name.name!r} is for {name.num_devices} devices x "
                             f"{name.num_microbatches} microbatches, the pipeline has "
                             f"{num_stages} x {num_microbatches}; build it for this pipeline.")
        name.validate()
        return name
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)} "
                         f"or pass a jaxhybrid.schedules.Schedule.")
    if not all(is_int(n) and n >= 1 for n in (num_stages, num_microbatches)):
        # 2.5 ran as 2; True as 1; "2" and None raised TypeError from a comparison
        raise ValueError(f"schedule needs whole numbers (ints) num_stages >= 1 and "
                         f"num_microbatches >= 1, got {num_stages!r}, {num_microbatches!r}.")
    options = tuple(sorted(options.items()))
    try:
        hash(options)
    except TypeError:   # the builder cache keys on them: "unhashable type: 'list'"
        raise ValueError(f"schedule {name!r}: options {dict(options)} must be plain values "
                         f"(ints, strings), not lists or arrays.") from None
    try:
        return _cached(name, int(num_stages), int(num_microbatches), options)
    except TypeError as e:
        takes = [p for p in inspect.signature(SCHEDULES[name]).parameters][2:]
        unknown = sorted(set(dict(options)) - set(takes))
        if not unknown:
            raise
        base = f"; {name!r} is {name[:-3]!r} with tasks_per_tick=1" if name.endswith("-1t") else ""
        raise ValueError(f"schedule {name!r} does not take options {unknown} (it takes "
                         f"{', '.join(takes) or 'none'}{base}).") from e
