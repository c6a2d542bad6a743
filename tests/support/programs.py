"""Compiled programs looked into: the equations of a jaxpr, the data an optimized HLO module moves in its loops, and
a fresh process's compile (deviceless: the CUDA plugin and libtpu load in a process of their own)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def jaxpr_eqns(jaxpr, inside: bool = False):
    """(equation, whether a pallas_call kernel holds it) for every equation of `jaxpr` and of the jaxprs nested in it
    (jit, scan, custom_vjp, kernels)."""
    for eqn in jaxpr.eqns:
        yield eqn, inside
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
                if hasattr(sub, "eqns"):
                    yield from jaxpr_eqns(sub, inside or eqn.primitive.name == "pallas_call")


def jaxpr_dots(jaxpr, inside: bool = False):
    """(dot_general equation, whether a pallas_call kernel holds it) for every matmul of `jaxpr` and of the jaxprs
    nested in it."""
    return ((eqn, held) for eqn, held in jaxpr_eqns(jaxpr, inside) if eqn.primitive.name == "dot_general")


def fresh_process_json(script: str, timeout: int = 600) -> dict:
    """`script` (dedented) in a fresh Python process on the CPU platform, the repository importable -> the JSON its
    last line prints. For deviceless compiles: the CUDA plugin and libtpu load in a process of their own."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", textwrap.dedent(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4, "s64": 8}
_HLO_ARRAY = re.compile(r"\b(pred|s8|u8|bf16|f16|s16|f32|s32|u32|s64)\[([\d,]*)\]")
_HLO_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*?)\)")


def loop_moves(hlo_text: str) -> list[tuple[str, str, tuple[int, ...], int]]:
    """Data moved inside the while loops of an optimized HLO module: (instruction, kind, shape, bytes) of every copy,
    broadcast, dynamic slice and dynamic-update-slice (plain, or a fusion or async fusion whose root is one) in a loop
    body or a body nested in one. A dynamic-update-slice moves its update, not the buffer it updates in place."""
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            current = comps.setdefault(re.match(r"(?:ENTRY )?%?([\w.\-]+)", line)[1], [])
        elif current is not None and line.strip():
            current.append(line)
    shapes, roots, op_of = {}, {}, {}
    for name, lines in comps.items():
        for line in lines:
            if m := _HLO_INSTR.match(line):
                shapes[m[1]], op_of[m[1]] = m[2], m[3]
                if line.lstrip().startswith("ROOT"):
                    roots[name] = (m[3], m[4])
    movers = ("copy", "broadcast", "dynamic-slice", "dynamic-update-slice")

    def arrays(text):
        return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _HLO_ARRAY.findall(text)]

    def moved(op, args, shape_text, called=None):
        if op == "dynamic-update-slice":  # the update: its second operand
            update = args.split(",")[1].strip().lstrip("%")
            shape_text = shapes.get(update, "")
        (dt, dims), *_ = arrays(shape_text) or [("pred", ())]
        return dims, _HLO_BYTES[dt] * math.prod(dims)

    bodies, seen, out = [], set(), []
    for lines in comps.values():
        bodies += [m[1] for line in lines if (m := re.search(r" while\(.*\bbody=%?([\w.\-]+)", line))]
    while bodies:
        body = bodies.pop()
        if body in seen:
            continue
        seen.add(body)
        for line in comps.get(body, []):
            m = _HLO_INSTR.match(line)
            if not m:
                continue
            name, shape_text, op, args = m.groups()
            if op == "while":
                bodies.append(re.search(r"\bbody=%?([\w.\-]+)", line)[1])
            kind = op if op in ("copy", "broadcast", "dynamic-slice", "dynamic-update-slice") else None
            if op in ("fusion", "fusion-start") and (c := re.search(r"calls=%?([\w.\-]+)", line)):
                root_op, root_args = roots.get(c[1], ("", ""))
                if m.group(3) == "fusion-start":  # ((operands), output, context): the output
                    shape_text = shape_text[shape_text.index(")") + 1 :]
                if root_op in movers:
                    kind, op, args = root_op, root_op, root_args
                elif root_op == "tuple":  # a multi-output fusion of moves (e.g. one layer's keys and values)
                    parts = [a.strip().lstrip("%") for a in root_args.split(",")]
                    if parts and all(op_of.get(a) in movers for a in parts):
                        for i, a in enumerate(parts):
                            dims, nbytes = moved(op_of[a], "", shapes[a])
                            out.append((f"{name}#{i}", op_of[a], dims, nbytes))
            if kind:
                dims, nbytes = moved(op, args, shape_text)
                out.append((name, kind, dims, nbytes))
    return out
