"""XLA thunk time of a compiled step by kind of instruction (no flags: tests import it).

`hlo_categories` reads a compiled module's text and names what each instruction that
runs as a thunk of its own does; `thunk_seconds` records steps with `jax.profiler` and
sums the trace's thunk times by those categories. `scripts/bench.py breakdown`
(`jaxhybrid.bench.breakdown_bench`) prints them for a pipelined and a data-parallel step.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile

import jax

CATEGORIES = ("matmuls", "elementwise, other", "row reads", "row writes", "fills", "copies",
              "collectives")
MOVEMENT = ("row reads", "row writes", "fills", "copies")   # data parallelism has ~none
COLLECTIVE_OPS = {"collective-permute", "all-reduce", "all-gather", "reduce-scatter",
                  "all-to-all", "collective-broadcast"}
CONTROL_OPS = {"while", "conditional", "call", "parameter", "get-tuple-element", "tuple",
               "constant", "bitcast"}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\((.*)$")


def hlo_categories(hlo_text: str) -> dict[str, str]:
    """{instruction name: category} for every instruction of a compiled module's text
    that runs as a thunk of its own (control flow and tuple plumbing left out)."""
    ops: dict[str, set[str]] = {}   # computation -> opcodes in it
    lines: list[tuple[str, str, str, str]] = []
    comp = None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            comp = m.group(1)
            ops.setdefault(comp, set())
            continue
        m = _INSTRUCTION.match(line)
        if m and comp is not None:
            name, opcode, rest = m.groups()
            ops[comp].add(opcode)
            lines.append((comp, name, opcode, rest))
    fused = {}   # fusion instruction -> the computation it runs (not a thunk of its own)
    for comp, name, opcode, rest in lines:
        called = re.search(r"calls=%?([\w.\-]+)", rest) if opcode == "fusion" else None
        if called:
            fused[name] = called.group(1)
    bodies = set(fused.values())
    return {name: _category(opcode, ops.get(fused.get(name), set()))
            for comp, name, opcode, rest in lines
            if opcode not in CONTROL_OPS and comp not in bodies}


def _category(opcode: str, inner: set[str]) -> str:
    every = inner | {opcode}
    if every & COLLECTIVE_OPS:
        return "collectives"
    if every & {"dot", "convolution", "custom-call"}:
        return "matmuls"
    if "dynamic-update-slice" in every:
        return "row writes"
    if "dynamic-slice" in every:
        return "row reads"
    if opcode == "copy":
        return "copies"
    if opcode == "broadcast" or inner and inner <= {"broadcast", "parameter", "constant",
                                                    "bitcast"}:
        return "fills"
    return "elementwise, other"


def thunk_seconds(fn, args, steps: int, categories: dict[str, str]) -> dict[str, float]:
    """Seconds per step of XLA thunks by category over `steps` traced calls of fn(*args)
    (after one untraced warm-up call)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                jax.block_until_ready(fn(*args))
        found = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        if not found:
            raise ValueError(f"jax.profiler wrote no perfetto trace under {d}; this "
                             f"bench needs a jax whose profiler can (pip install -e .).")
        with gzip.open(found[0]) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") in categories:
            total[categories[e["name"]]] += e.get("dur", 0) * 1e-6 / steps
    return {c: total.get(c, 0.0) for c in CATEGORIES}
