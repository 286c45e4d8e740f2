"""A compiled step's memory per device, against the device's capacity and the user's
`memory_budget`: one measure (`compiled_bytes`) and one message for `scripts/train.py`
(`train.check_step_memory`), `Pipeline.train_step` and the benches."""
from __future__ import annotations

import jax

from jaxhybrid.plan.topology import fmt_bytes, parse_bytes

MORE_STAGES = "use more pipeline stages or smaller microbatches (more of them)"


def compiled_bytes(compiled) -> float | None:
    """Bytes per device a compiled program holds while it runs (`memory_analysis`:
    arguments + outputs + temporaries - aliased, i.e. donated); None where the backend
    does not report them."""
    try:
        ma = compiled.memory_analysis()
        return float(ma.argument_size_in_bytes + ma.output_size_in_bytes
                     + ma.temp_size_in_bytes - ma.alias_size_in_bytes)
    except Exception:   # a backend without memory analysis
        return None


def device_memory_limit() -> float | None:
    """Bytes one local device can allocate (a GPU's `bytes_limit`), or None (CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:   # no memory statistics on this backend
        return None
    return float(stats["bytes_limit"]) if stats.get("bytes_limit") else None


def over_budget(need: float, budget, planned: float | None, recomputes_all: bool,
                remat_full: str) -> str | None:
    """The warning for a step that needs `need` bytes over `budget` (None if within it):
    the planner's model (`planned` bytes) fell short, with what to change (`remat_full`:
    how the caller's user asks to recompute every stage)."""
    if budget is None or need <= parse_bytes(budget):
        return None
    fix = f"set {remat_full} (recompute every stage), or {MORE_STAGES}"
    more = ("" if recomputes_all else f"lower the budget by "
            f"{fmt_bytes(need - parse_bytes(budget))} to have the planner recompute more (if "
            f"it then refuses the budget, recomputing everything cannot meet it), or ")
    return (f"the compiled step needs {fmt_bytes(need)} per device, over memory_budget="
            f"{budget} (the planner's model: {fmt_bytes(planned) if planned else 'not planned'}"
            f"); {more}{MORE_STAGES if recomputes_all else fix}.")
