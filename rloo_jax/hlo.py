"""FLOPs of a compiled XLA program, counted from its optimized HLO text with every loop at its trip count.

XLA's own `cost_analysis()` counts a `while` body once, whatever its trip count: a `lax.scan` over 32 layers reports
the FLOPs of one layer (checked: a scan of 8 matmuls reports 1/8 of the unrolled figure). This counts the matmul
FLOPs the compiler emits (`dot` and `convolution` instructions; elementwise work is not counted), per device of an
SPMD program, walking fusions, calls and conditionals (the largest branch), and multiplying each `while` body by its
trip count: the bound `N` of the loop condition's `i < N` (a `lax.scan`/`lax.map`/`fori_loop` counter; for a
data-dependent loop such as the sampler's, the bound is the most it can run).
"""

from __future__ import annotations

import dataclasses
import math
import re

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


def _conv_flops(ins: _Instruction, shapes: dict[str, tuple[int, ...] | None]) -> float:
    """2 * output elements * (input features * window elements) / feature groups."""
    rhs = shapes.get(ins.operands[1]) if len(ins.operands) > 1 else None
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if ins.shape is None or rhs is None or labels is None:
        return 0.0
    kernel = labels.group(2)
    per_output = rhs[kernel.index("i")] * math.prod(rhs[j] for j, c in enumerate(kernel) if c.isdigit())
    groups = re.search(r"feature_group_count=(\d+)", ins.attrs)
    return 2.0 * math.prod(ins.shape) * per_output / (int(groups.group(1)) if groups else 1)


def _trip_count(condition: list[_Instruction]) -> int:
    """The N of the condition's `compare(i, N), direction=LT` (1 when there is no such bound)."""
    constants = {i.name: int(i.args) for i in condition if i.opcode == "constant" and re.fullmatch(r"-?\d+", i.args)}
    for ins in condition:
        if ins.opcode == "compare" and "direction=LT" in ins.attrs:
            bounds = [constants[o] for o in ins.operands if o in constants]
            if bounds:
                return max(bounds[-1], 0)
    return 1


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
        total = 0.0
        for ins in instructions:
            if ins.opcode == "dot":
                total += _dot_flops(ins, shapes)
            elif ins.opcode == "convolution":
                total += _conv_flops(ins, shapes)
            callees = dict((k, re.findall(r"%([\w.\-]+)", v)) for k, v in _CALLEE.findall(ins.attrs))
            if ins.opcode == "while":
                body, cond = callees.get("body", [""])[0], callees.get("condition", [""])[0]
                total += _trip_count(computations.get(cond, [])) * (cost(body) + cost(cond))
            elif ins.opcode == "conditional":
                branches = callees.get("branch_computations", []) + callees.get("true_computation", []) + \
                    callees.get("false_computation", [])
                total += max((cost(b) for b in branches), default=0.0)
            elif ins.opcode in ("fusion", "call", "async-start", "custom-call"):
                total += sum(cost(c) for c in callees.get("calls", []) + callees.get("to_apply", []))
        memo[name] = total
        return total

    return cost("ENTRY")
