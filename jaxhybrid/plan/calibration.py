"""Engine-cost calibration, fitted once per device kind, stored and reused.

The step-time model (`jaxhybrid.plan.step_model`) needs a few terms that no datasheet
gives: how many simulated devices compute at once (`compute_slots` in a data-parallel
program, `lockstep_slots` in the pipelined one), the engine's own work per device per
tick (`tick_overhead`, `tick_param_bytes`), per task (`task_overhead`), per collective
(`collective_overhead`) and per step (`launch_overhead`), its waiting per tick
(`tick_latency`) and the streaming memory bandwidth.
`jaxhybrid.bench.projection_fit.calibrate` fits them on this host; `save` keeps them in
`<cache dir>/calibration/<device key>.json` and `load` gives them back as a `Hardware`,
so the projection, the planner (`stored_hardware`: `make_plan(hardware=)` from
`plan_from_config` and `Pipeline`) and later benchmark runs use one fit.

The device key names what the terms depend on: platform, device kind, device count and,
for CPU devices (simulated devices share the host's cores), the number of cores.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import time

from jaxhybrid.plan.hardware import Hardware, measured_device

# The fitted terms (Hardware fields) a calibration stores.
FIELDS = ("mem_bandwidth", "compute_slots", "tick_overhead", "tick_param_bytes",
          "tick_latency", "task_overhead", "collective_overhead", "launch_overhead",
          "lockstep_slots", "lockstep_contention", "weight_task_overhead",
          "devices_per_node")
FORMAT = 4


def device_key(devices=None) -> str:
    """e.g. "cpu-cpu-8dev-2cores", "gpu-NVIDIA_H100_80GB_HBM3-8dev"."""
    import jax
    devices = list(devices or jax.devices())
    d = devices[0]
    key = f"{d.platform}-{getattr(d, 'device_kind', '')}-{len(devices)}dev"
    if d.platform == "cpu":
        key += f"-{os.cpu_count()}cores"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key)


def path(cache_dir: str | os.PathLike, key: str | None = None) -> pathlib.Path:
    return pathlib.Path(cache_dir) / "calibration" / f"{key or device_key()}.json"


def save(hw: Hardware, cache_dir: str | os.PathLike, info: dict | None = None,
         key: str | None = None) -> pathlib.Path:
    """Writes `hw`'s fitted terms (and `info`, e.g. the fit's residuals) atomically."""
    p = path(cache_dir, key)
    p.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(format=FORMAT, device=key or device_key(), saved=time.strftime("%Y-%m-%d %H:%M:%S"),
               terms={f: getattr(hw, f) for f in FIELDS}, description=hw.description,
               info=info or {})
    tmp = p.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=float))
    os.replace(tmp, p)
    return p


def load(cache_dir: str | os.PathLike, key: str | None = None) -> tuple[Hardware, dict] | None:
    """(the stored calibration as a `measured_device`, its document), or None when this
    device kind has none (or it is unreadable, or of another format)."""
    try:
        doc = json.loads(path(cache_dir, key).read_text())
    except (OSError, ValueError):
        return None
    if (not isinstance(doc, dict) or doc.get("format") != FORMAT
            or not isinstance(doc.get("terms"), dict) or set(doc["terms"]) != set(FIELDS)):
        return None
    try:
        return measured_device(f"calibrated:{doc.get('device', '?')}",
                               description=doc.get("description", ""), **doc["terms"]), doc
    except (TypeError, ValueError) as e:   # a hand-edited or damaged file: say which
        raise ValueError(f"the stored calibration {path(cache_dir, key)} is invalid ({e}); "
                         f"delete it or calibrate again.") from None


def stored_hardware(cache_dir: str | os.PathLike | None = None):
    """The stored calibration of this device kind as a `Hardware` (its engine terms price
    `Plan.predicted_step_time` as the projection does), or None when there is none.
    cache_dir: default `jaxhybrid.startup.default_cache_dir()`."""
    if cache_dir is None:
        from jaxhybrid.startup import default_cache_dir
        cache_dir = default_cache_dir()
    stored = load(cache_dir)
    return None if stored is None else stored[0]
