"""The on-disk cache of `plan.profile`'s results: entries keyed by what each layer
computes (`layer_signature`: its class, fields, the functions it holds and a hash of the
files defining them), the input shapes and dtypes, the profiling options, the device
kind and the jax version; written atomically, read back only when every number is one.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import pathlib
import re
import types

import numpy as np

from jaxhybrid.plan.layer_cost import COST_FIELDS, LayerCost

# Bump when what `profile` computes changes, so old cache entries are not reused.
COST_FORMAT = 11  # 3: the model-axis fields; 4: backward temporaries, residuals by dtype;
#                   5: residuals the backward recomputes cheaply are not counted;
#                   6: a split backward's crossing values and W's residuals;
#                   7: float parameters by dtype; 8: residuals shared with the layer before;
#                   9: crossing values and float parameters as whole values;
#                   10: the cores a measured layer kept busy (fwd_threads, bwd_threads);
#                   11: FLOPs: scans' iterations all counted; on GPUs convolutions too
_cache_dir: str | None = os.environ.get("JAXHYBRID_CACHE_DIR") or None


def set_cache_dir(path: str | os.PathLike | None) -> None:
    """Directory where `profile` keeps its results (in `<path>/costs/`), or None: no
    disk cache (the default, unless $JAXHYBRID_CACHE_DIR is set). `scripts/train.py`
    sets it (jaxhybrid.startup)."""
    global _cache_dir
    _cache_dir = None if path is None else os.fspath(path)


def cache_dir() -> str | None:
    return _cache_dir


def layer_signature(layer) -> str:
    """What a layer computes, as text: its class (module, name, a hash of the file that
    defines it, so an edited model is profiled afresh), its fields (`repr`, object
    addresses dropped) and the Python functions among them (`_function_text`: every
    lambda has the `repr` "<function <lambda>>"). Two layers with one signature on one
    input shape cost the same."""
    cls = type(layer)
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(layer))
    functions = [_function_text(f) for f in _functions_in(layer)]
    return f"{cls.__module__}.{cls.__qualname__}@{_file_hash(cls)}:{text}" + "".join(
        f"|{f}" for f in functions)


def _file_hash(obj) -> str:
    """A hash of the source file defining `obj` ("" when there is none)."""
    try:
        return _hash_of_file(inspect.getsourcefile(obj))
    except (TypeError, OSError):
        return ""


@functools.lru_cache(maxsize=None)
def _hash_of_file(path: str) -> str:
    """Read once per process: every layer's class and the functions it holds (each
    Dense's initialisers) point at a few files, and the code in them does not change
    while the process runs."""
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()[:16]


def _functions_in(value, depth: int = 0) -> list:
    """The Python functions (and partials) among a layer's dataclass fields, in nested
    containers and sub-modules too (a few levels deep)."""
    if depth > 4:
        return []
    if isinstance(value, (types.FunctionType, functools.partial)):
        return [value]
    if isinstance(value, (list, tuple)):
        return [f for v in value for f in _functions_in(v, depth + 1)]
    if isinstance(value, dict):
        return [f for v in value.values() for f in _functions_in(v, depth + 1)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [f for fl in dataclasses.fields(value) if fl.name not in ("parent", "name")
                for f in _functions_in(getattr(value, fl.name, None), depth + 1)]
    return []


def _function_text(fn, depth: int = 0) -> str:
    """A function as what it computes: its name, its code (bytecode, constants and the
    names it reads; nested functions' too), its defaults and the values its closure
    captured (functions among them described alike), and its file's hash. A captured
    object whose repr holds an address (nothing else tells two apart) is named by its
    id: never shared with another object's entry, if not reused across runs."""
    if depth > 3:
        return f"id{id(fn)}"
    if isinstance(fn, functools.partial):
        return (f"partial({_function_text(fn.func, depth + 1)},{_value_text(fn.args, depth)},"
                f"{_value_text(fn.keywords, depth)})")
    if not isinstance(fn, types.FunctionType):
        return _value_text(fn, depth)
    cells = [_value_text(c.cell_contents, depth) if _filled(c) else "empty"
             for c in (fn.__closure__ or ())]
    return (f"{fn.__module__}.{fn.__qualname__}@{_file_hash(fn)}:{_code_text(fn.__code__)}"
            f":{_value_text(fn.__defaults__, depth)}:{cells}")


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:   # a cell not yet assigned
        return False
    return True


def _code_text(code) -> str:
    consts = [_code_text(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    body = repr((code.co_code, consts, code.co_names, code.co_varnames))
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def _value_text(value, depth: int) -> str:
    if isinstance(value, (types.FunctionType, functools.partial)):
        return _function_text(value, depth + 1)
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_value_text(v, depth) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k!r}:{_value_text(v, depth)}" for k, v in value.items()) + "}"
    if hasattr(value, "shape") and hasattr(value, "dtype"):   # an array: shape, dtype, values
        a = np.asarray(value)
        return f"{a.dtype}{list(a.shape)}#{hashlib.sha256(a.tobytes()).hexdigest()[:16]}"
    text = repr(value)
    return f"id{id(value)}" if re.search(r" at 0x[0-9a-fA-F]+", text) else text


def avals_text(tree) -> str:
    import jax
    leaves, treedef = jax.tree.flatten(tree)
    return f"{treedef}|" + ",".join(f"{np.dtype(l.dtype).name}{list(np.shape(l))}" for l in leaves)


def cache_path(directory: str, parts: list) -> pathlib.Path:
    import jax
    dev = jax.devices()[0]
    key = json.dumps([COST_FORMAT, jax.__version__, dev.platform, getattr(dev, "device_kind", ""),
                      *parts])
    return pathlib.Path(directory) / "costs" / (hashlib.sha256(key.encode()).hexdigest() + ".json")


def read_cache(path: pathlib.Path) -> list[LayerCost] | None:
    try:
        costs = [LayerCost.from_dict(d) for d in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):   # missing, or unreadable: profile afresh
        return None
    # A hand-edited entry with null or text in a number failed later, in the planner's
    # arithmetic: profile afresh.
    numbers = all(isinstance(getattr(c, f), (int, float)) for c in costs for f in COST_FIELDS)
    return costs if numbers else None


def write_cache(path: pathlib.Path, costs: list[LayerCost]) -> None:
    write_text(path, json.dumps([c.to_dict() for c in costs]))


def write_text(path: pathlib.Path, text: str) -> None:
    """A cache entry, written atomically (never half-written); a cache that cannot be
    written costs time, not the run."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        pass
