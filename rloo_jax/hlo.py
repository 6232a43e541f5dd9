"""FLOPs of a compiled XLA program, counted from its optimized HLO text with every loop at its trip count.

XLA's own `cost_analysis()` counts a `while` body once, whatever its trip count: a `lax.scan` over 32 layers reports
the FLOPs of one layer (checked: a scan of 8 matmuls reports 1/8 of the unrolled figure). This counts the matmul
FLOPs the compiler emits (`dot` and `convolution` instructions; elementwise work is not counted), per device of an
SPMD program, walking fusions, calls and conditionals (the largest branch), and multiplying each `while` body by its
trip count: from the condition's `i < N`, the counter's initial value and the body's constant step (a
`lax.scan`/`lax.map`/`fori_loop` counter, or the compiler's own windowed-matmul loops, which step by 2); for a
data-dependent loop such as the sampler's, the bound is the most it can run.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"^[a-z]+\d*\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|true_computation|false_computation)="
                     r"(\{[^}]*\}|%[\w.\-]+)")


@dataclasses.dataclass
class _Instruction:
    name: str
    shape: tuple[int, ...] | None  # None for tuples and tokens
    opcode: str
    operands: list[str]
    args: str  # the raw text between the parentheses (a constant's value)
    attrs: str


def _shape(type_text: str) -> tuple[int, ...] | None:
    m = _ARRAY.match(type_text)
    if m is None:
        return None
    return tuple(int(d) for d in m.group(1).split(",") if d)


def _split_operands(rest: str) -> tuple[str, str]:
    """`%a, %b), attrs...` -> ("%a, %b", "attrs..."): the operand list ends at the parenthesis that closes it."""
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    return rest[: i - 1], rest[i:]


def parse(text: str) -> dict[str, list[_Instruction]]:
    """HLO module text -> {computation name: its instructions}; the entry computation is also under "ENTRY"."""
    computations: dict[str, list[_Instruction]] = {}
    current: list[_Instruction] | None = None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head and " = " not in line.split("{")[0]:
            current = computations.setdefault(head.group(1), [])
            if line.startswith("ENTRY"):
                computations["ENTRY"] = current
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            name, type_text, opcode, rest = m.groups()
            args, attrs = _split_operands(rest)
            operands = re.findall(r"%([\w.\-]+)", args)
            current.append(_Instruction(name, _shape(type_text), opcode, operands, args, attrs))
    return computations


def _dot_flops(ins: _Instruction, shapes: dict[str, tuple[int, ...] | None]) -> float:
    lhs = shapes.get(ins.operands[0]) if ins.operands else None
    dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
    if ins.shape is None or lhs is None:
        return 0.0
    contracted = [lhs[int(d)] for d in dims.group(1).split(",") if d] if dims else []
    return 2.0 * math.prod(ins.shape) * math.prod(contracted)


def _taps(size: int, out: int, window: int, stride: int, pad_low: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """(output position, window tap) pairs of one spatial dimension that land on a real input element (not on
    padding, not in a hole of `lhs_dilate`). The TPU compiler writes batched matmuls as convolutions whose batch
    dimensions are dilated spatial ones: a window of 8 taps of which one is real."""
    o = np.arange(out)[:, None]
    k = np.arange(window)[None, :]
    p = o * stride + k * rhs_dilate - pad_low  # position in the dilated input
    return int(np.sum((p >= 0) & (p <= (size - 1) * lhs_dilate) & (p % lhs_dilate == 0)))


def _conv_flops(ins: _Instruction, shapes: dict[str, tuple[int, ...] | None]) -> float:
    """2 * (batch x output features) * (input features / groups) * the real taps of every spatial dimension."""
    lhs = shapes.get(ins.operands[0]) if ins.operands else None
    rhs = shapes.get(ins.operands[1]) if len(ins.operands) > 1 else None
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if ins.shape is None or lhs is None or rhs is None or labels is None:
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    window = re.search(r"window=\{([^}]*)\}", ins.attrs)
    fields = dict(f.split("=") for f in window.group(1).split()) if window else {}
    spatial = sorted(c for c in out_l if c.isdigit())

    def field(name: str, default: str) -> list[str]:
        return fields[name].split("x") if name in fields else [default] * len(spatial)

    taps = 1
    for d, size, stride, pad, ld, rd in zip(spatial, field("size", "1"), field("stride", "1"), field("pad", "0_0"),
                                            field("lhs_dilate", "1"), field("rhs_dilate", "1"), strict=True):
        taps *= _taps(lhs[lhs_l.index(d)], ins.shape[out_l.index(d)], int(size), int(stride),
                      int(pad.split("_")[0]), int(ld), int(rd))
    groups = re.search(r"feature_group_count=(\d+)", ins.attrs)
    per_tap = rhs[rhs_l.index("i")] / (int(groups.group(1)) if groups else 1)
    return 2.0 * ins.shape[out_l.index("b")] * ins.shape[out_l.index("f")] * per_tap * taps


def _through(ins: _Instruction | None, by_name: dict[str, _Instruction]) -> _Instruction | None:
    """The instruction behind copies, bitcasts and converts."""
    while ins is not None and ins.opcode in ("copy", "bitcast", "convert") and ins.operands:
        ins = by_name.get(ins.operands[0])
    return ins


def _constant(ins: _Instruction | None, by_name: dict[str, _Instruction]) -> int | None:
    """The integer value of a scalar constant (None otherwise)."""
    ins = _through(ins, by_name)
    if ins is None or ins.opcode != "constant" or not re.fullmatch(r"-?\d+", ins.args.strip()):
        return None
    return int(ins.args)


def _tuple_index(ins: _Instruction | None, by_name: dict[str, _Instruction]) -> int | None:
    """The tuple index a get-tuple-element reads (None for any other instruction)."""
    ins = _through(ins, by_name)
    m = re.search(r"\bindex=(\d+)", ins.attrs) if ins is not None and ins.opcode == "get-tuple-element" else None
    return int(m.group(1)) if m else None


def _trip_count(condition: list[_Instruction], body: list[_Instruction], init: _Instruction | None,
                caller: dict[str, _Instruction]) -> int:
    """Iterations of a counted loop: the condition's `i < N` with `i` a tuple element that the body advances by a
    constant step (the TPU compiler's windowed matmul loops step by 2) from its initial value: ceil((N - i0) / s).
    1 when the condition has no such bound."""
    cond = {i.name: i for i in condition}
    root = next((i for i in condition if i.opcode == "compare" and "direction=LT" in i.attrs), None)
    if root is None or len(root.operands) != 2:
        return 1
    index, bound = _tuple_index(cond.get(root.operands[0]), cond), _constant(cond.get(root.operands[1]), cond)
    if bound is None:
        return 1
    if index is None:  # e.g. `(i < N) & ...` over a computed counter: the bound alone
        return max(bound, 0)
    step, start = 1, 0
    body_by_name = {i.name: i for i in body}
    out = body[-1] if body and body[-1].opcode == "tuple" else next((i for i in body if i.opcode == "tuple"), None)
    if out is not None and index < len(out.operands):
        nxt = body_by_name.get(out.operands[index])
        if nxt is not None and nxt.opcode == "add" and len(nxt.operands) == 2:
            for a, b in (nxt.operands, nxt.operands[::-1]):
                c = _constant(body_by_name.get(b), body_by_name)
                if _tuple_index(body_by_name.get(a), body_by_name) == index and c:
                    step = c
    if init is not None and init.opcode == "tuple" and index < len(init.operands):
        start = _constant(caller.get(init.operands[index]), caller) or 0
    return max(-(-(bound - start) // step), 0)


def flops(text: str) -> float:
    """Matmul FLOPs of one run of the program (per device), loops counted by their trip counts."""
    computations = parse(text)
    memo: dict[str, float] = {}

    def cost(name: str) -> float:
        if name in memo:
            return memo[name]
        memo[name] = 0.0  # guards against recursion through malformed text
        instructions = computations.get(name, [])
        shapes = {ins.name: ins.shape for ins in instructions}
        by_name = {ins.name: ins for ins in instructions}
        total = 0.0
        for ins in instructions:
            if ins.opcode == "dot":
                total += _dot_flops(ins, shapes)
            elif ins.opcode == "convolution":
                total += _conv_flops(ins, shapes)
            callees = dict((k, re.findall(r"%([\w.\-]+)", v)) for k, v in _CALLEE.findall(ins.attrs))
            if ins.opcode == "while":
                body, cond = callees.get("body", [""])[0], callees.get("condition", [""])[0]
                init = by_name.get(ins.operands[0]) if ins.operands else None
                trips = _trip_count(computations.get(cond, []), computations.get(body, []), init, by_name)
                total += trips * (cost(body) + cost(cond))
            elif ins.opcode == "conditional":
                branches = callees.get("branch_computations", []) + callees.get("true_computation", []) + \
                    callees.get("false_computation", [])
                total += max((cost(b) for b in branches), default=0.0)
            elif ins.opcode in ("fusion", "call", "async-start", "custom-call"):
                total += sum(cost(c) for c in callees.get("calls", []) + callees.get("to_apply", []))
        memo[name] = total
        return total

    return cost("ENTRY")
