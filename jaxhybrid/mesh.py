"""The device mesh: axes ("data", "pipe"), and "model" for tensor parallelism."""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DATA, PIPE, MODEL = "data", "pipe", "model"


def make_mesh(data: int = -1, pipe: int = 1, devices: Sequence[jax.Device] | None = None,
              model: int = 1) -> Mesh:
    """A Mesh with axes ("data", "pipe") over `devices` (default: all devices); with
    model > 1 a third axis "model" (tensor parallelism, innermost: a model group is
    `model` consecutive devices of the list).

    One of `data` / `pipe` may be -1: it takes the devices that are left. Explicit sizes
    whose product is below the device count take the first data x pipe (x model)
    devices of the list; the rest stay idle (`scripts/train.py` warns). Device order
    along "pipe" is the order of `devices` (e.g. from a plan's device mapping), so
    consecutive stages sit on consecutive devices of the list. Axes are `Auto` so flax
    logical sharding constraints work inside the model.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(model, (int, np.integer)) or model < 1:
        raise ValueError(f"make_mesh: model={model!r} must be a positive int.")
    if data == -1 and pipe == -1:
        raise ValueError("make_mesh: at most one of data/pipe may be -1; set the other explicitly.")
    for name, size in ((DATA, data), (PIPE, pipe)):
        if size != -1 and (not isinstance(size, (int, np.integer)) or size < 1):
            raise ValueError(f"make_mesh: {name}={size!r} must be a positive int or -1.")
    if model > 1:
        if -1 not in (data, pipe):
            # The devices the mesh uses: model=3 on 6 of 8 devices was refused for not
            # dividing 8, where data and pipe without a model axis take a prefix.
            if data * pipe * model > len(devices):
                raise ValueError(
                    f"make_mesh: data={data} x pipe={pipe} x model={model} = "
                    f"{data * pipe * model} devices, but only {len(devices)} are available; "
                    f"use sizes whose product is at most {len(devices)} (or pass devices=...).")
            devices = devices[: data * pipe * model]
        if len(devices) % model:
            raise ValueError(f"make_mesh: model={model} does not divide the {len(devices)} "
                             f"devices; choose model from the divisors of {len(devices)}.")
        try:   # one device per model group
            groups = make_mesh(data, pipe, devices[::model])
        except ValueError as e:
            raise ValueError(f"{e} (model={model}: {len(devices)} devices make "
                             f"{len(devices) // model} model groups for data x pipe)") from None
        grid = np.array([[devices[devices.index(d):devices.index(d) + model] for d in row]
                         for row in groups.devices], dtype=object)
        return Mesh(grid, (DATA, PIPE, MODEL), axis_types=(AxisType.Auto,) * 3)
    n = len(devices)
    if data == -1:
        if n % pipe:
            raise ValueError(f"make_mesh: pipe={pipe} does not divide the {n} devices; "
                             f"choose pipe from the divisors of {n}.")
        data = n // pipe
    if pipe == -1:
        if n % data:
            raise ValueError(f"make_mesh: data={data} does not divide the {n} devices; "
                             f"choose data from the divisors of {n}.")
        pipe = n // data
    if data * pipe != n:
        if data * pipe > n:
            raise ValueError(
                f"make_mesh: data={data} x pipe={pipe} = {data * pipe} devices, but only {n} "
                f"are available; use sizes whose product is at most {n} (or pass devices=...).")
        devices = devices[: data * pipe]
    grid = np.array(devices, dtype=object).reshape(data, pipe)
    return Mesh(grid, (DATA, PIPE), axis_types=(AxisType.Auto, AxisType.Auto))
