"""FLOPs and bytes of a compiled XLA program, counted from its optimized HLO text with every loop at its trip count.

XLA's own `cost_analysis()` counts a `while` body once, whatever its trip count: a `lax.scan` over 32 layers reports
the FLOPs of one layer (checked: a scan of 8 matmuls reports 1/8 of the unrolled figure). This counts the matmul
FLOPs the compiler emits (`dot` and `convolution` instructions, and the TPU kernels of `jax.lax.ragged_dot`;
elementwise work is not counted), plus those of Pallas attention and grouped-matmul kernels, which the compiler does
not count: the kernel's caller names them in a name scope (`kernel_flops_scope`, `grouped_matmul_flops_scope`), per
device of an SPMD program, walking fusions, calls and conditionals (the largest branch), and multiplying each
`while` body by its trip count: from the condition's `i < N`, the counter's initial value and the body's constant
step (a `lax.scan`/`lax.map`/`fori_loop` counter, or the compiler's own windowed-matmul loops, which step by 2); for
a data-dependent loop such as the sampler's, the bound is the most it can run.

Bytes follow XLA's `HloCostAnalysis` at the fusion boundary (what a fused kernel reads and writes; its inside
stays on chip): every top-level instruction reads its operands and writes its result, at the sizes of their tiled
TPU layouts (`bf16[10,20]{1,0:T(8,128)(2,1)}` occupies 16 x 128 elements); a slice or `dynamic-slice` (fused or not)
reads only its slice and a gather its rows; a `dynamic-update-slice` writes only its update, in place; outputs
aliased to an operand (async collectives carried through compute fusions) are not written again, and an async
collective is counted once, at its start; a grouped-matmul kernel that reads its groups' matrices in place in a longer
stack (every layer's experts) reads those only (`grouped_matmul_flops_scope`'s `reads`). Three figures per device
(`Cost`):

- `bytes`: in any memory, as XLA counts them. On loop-free programs of elementwise ops, converts, transposes,
  concatenations, slices, dynamic-update-slices, cumulative sums and all-gathers this equals the TPU compiler's
  `cost_analysis()["bytes accessed"]` exactly (tests/test_compile_only.py). Where the TPU cost model charges a
  kernel for re-reading its inputs (matmuls: 2-3x for a bf16 MLP; gathers; sorts; reductions over a major
  dimension) these count each input once: the traffic of a kernel that reads its inputs once.
- `hbm_bytes`: the part in HBM, memory space 0. Arrays the compiler placed in on-chip VMEM (`S(1)`) are not HBM
  traffic; its prefetches and evictions between the two (`copy-start`, free in `bytes`) are one HBM read or write.
- `ici_bytes`: what collectives receive from other chips over ICI (`_collective_ici`).

`analyze(text)` gives them with every `while` loop (its `op_name`, trip count and per-iteration cost);
`named_loop` picks one by its `jax.named_scope` (the sampler names its decode loop `DECODE_LOOP`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

import numpy as np

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"^[a-z]+\d*\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|true_computation|false_computation)="
                     r"(\{[^}]*\}|%[\w.\-]+)")


_KERNEL_FLOPS = "kernel_fwd_flops_"
# matmuls of each flash-attention kernel against the forward's two (scores q k^T, probabilities x v): the dq kernel
# recomputes the scores and forms dP = dO v^T and dq = dS k (3); the dkv kernel the scores, dP, dv = P^T dO and
# dk = dS^T q (4); a fused backward kernel (dkv with dq) all five
_KERNEL_PASSES = {"fwd": 1.0, "dq": 1.5, "dkv": 2.0}
_KERNEL_KIND = re.compile(r"_(fwd|dq|dkv)(?:_|/|$)")


def kernel_flops_scope(fwd_flops: float) -> str:
    """A `jax.named_scope` name telling `analyze` the FLOPs of the Pallas attention kernels inside it: the forward
    kernel's matmul FLOPs (the TPU compiler counts none inside a custom kernel). The backward kernels that autodiff
    emits carry the same scope and count `_KERNEL_PASSES` times as much."""
    return f"{_KERNEL_FLOPS}{int(round(fwd_flops))}"


_GROUPED_FLOPS = "grouped_matmul_flops_"


_GROUPED_READS = re.compile(r"_reads_(\d+)_of_(\d+)")


def grouped_matmul_flops_scope(flops: float, reads: tuple[int, int] | None = None) -> str:
    """A `jax.named_scope` name telling `analyze` the FLOPs of each Pallas grouped-matmul kernel inside it (megablox
    `gmm`, and the `gmm` and `tgmm` of its backward: each the same matmul size, [M, K] x [K, N]). `reads` (g, n):
    its weights operand (its largest) is a stack of n matrices of which the kernel reads its g groups' (in place),
    not the whole operand. Example: 100 -> "grouped_matmul_flops_100"; with reads (128, 6144)
    "grouped_matmul_flops_100_reads_128_of_6144"."""
    return f"{_GROUPED_FLOPS}{int(round(flops))}" + ("" if reads is None else f"_reads_{reads[0]}_of_{reads[1]}")


def _kernel_flops(ins: _Instruction) -> float:
    """FLOPs of a Pallas kernel call (`custom-call`) from its `kernel_flops_scope` and its kernel's kind, or its
    `grouped_matmul_flops_scope`; of a `jax.lax.ragged_dot` kernel from its shapes; 0 for any other custom call."""
    op_name = ins.op_name
    if 'custom_call_target="tpu_custom_call"' in ins.attrs and ins.name.startswith("ragged-dot-") and ins.shape:
        # jax.lax.ragged_dot's TPU kernel: [M, K] rows x [G, K, N] (its last operand) -> [M, N], each row by its
        # group's matrix (the rows' own group only: 2 M K N)
        rhs = re.findall(r"\w+\[(\d+),(\d+),(\d+)\]", ins.attrs.split("operand_layout_constraints=", 1)[-1])
        return 2.0 * math.prod(ins.shape) * int(rhs[-1][1]) if rhs else 0.0
    grouped = re.search(_GROUPED_FLOPS + r"(\d+)", op_name)
    if grouped is not None:  # the Pallas kernels only: its scope also names the metadata's small ops
        return float(grouped.group(1)) if 'custom_call_target="tpu_custom_call"' in ins.attrs else 0.0
    scope = re.search(_KERNEL_FLOPS + r"(\d+)", op_name)
    kind = _KERNEL_KIND.findall(op_name.rsplit(_KERNEL_FLOPS, 1)[-1]) or _KERNEL_KIND.findall(ins.name)
    if scope is None or not kind:
        return 0.0
    passes = _KERNEL_PASSES[kind[-1]]
    if kind[-1] == "dkv" and re.search(r'use_fused_bwd_kernel\\?": true', ins.attrs):
        passes += _KERNEL_PASSES["dq"] - 1.0  # dq is formed in the same kernel: one more matmul
    return float(scope.group(1)) * passes


_LEAF = re.compile(r"([a-z]+\d*[a-z\d]*)\[([\d,]*)\](?:\{([^}]*)\})?")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass
class _Instruction:
    name: str
    shape: tuple[int, ...] | None  # None for tuples and tokens
    opcode: str
    operands: list[str]
    args: str  # the raw text between the parentheses (a constant's value)
    attrs: str
    leaves: tuple[tuple[int, int], ...] = ()  # (bytes in its tiled layout, memory space) of each result array

    @property
    def nbytes(self) -> int:
        return sum(b for b, _ in self.leaves)

    @property
    def op_name(self) -> str:
        m = _OP_NAME.search(self.attrs)
        return m.group(1) if m else ""


def _shape(type_text: str) -> tuple[int, ...] | None:
    m = _ARRAY.match(type_text)
    if m is None:
        return None
    return tuple(int(d) for d in m.group(1).split(",") if d)


def _leaf_bytes(dtype: str, dims: list[int], layout: str | None) -> int:
    """Bytes of one array in its layout: the first tile `T(a,b)` pads the most minor dimensions to its multiples
    (a scalar `s32[]{:T(128)}` takes 128 elements). pred takes a byte; `f8e4m3fn` 8 bits, `bf16` 16, `s4` 4."""
    digits = re.search(r"\d+", dtype)
    bits = 8 if dtype == "pred" else int(digits.group()) if digits else 0
    if layout and ":" in layout:
        order, rest = layout.split(":", 1)
        tile = re.match(r"T\(([\d,]+)\)", rest)
        if tile:
            minor_first = [dims[int(d)] for d in order.split(",") if d]
            t = [int(x) for x in tile.group(1).split(",")][::-1]  # most minor first
            minor_first += [1] * (len(t) - len(minor_first))
            dims = [-(-d // t[i]) * t[i] if i < len(t) else d for i, d in enumerate(minor_first)]
    return -(-math.prod(dims) * bits // 8)


def _leaves(type_text: str) -> tuple[tuple[int, int], ...]:
    """(bytes, memory space) of each array in an instruction's type: space 0 is HBM, `S(1)` on-chip VMEM, ..."""
    leaves = []
    for dt, dims, layout in _LEAF.findall(type_text):
        if dt != "token":
            space = re.search(r"S\((\d+)\)", layout or "")
            leaves.append((_leaf_bytes(dt, [int(d) for d in dims.split(",") if d], layout), int(space.group(1))
                           if space else 0))
    return tuple(leaves)


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
            current.append(_Instruction(name, _shape(type_text), opcode, operands, args, attrs, _leaves(type_text)))
        elif current and line.strip() not in ("", "}"):  # an attribute spanning lines (a kernel's metadata)
            current[-1].attrs += "\n" + line
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


@dataclasses.dataclass(frozen=True)
class Cost:
    """Matmul FLOPs, bytes read + written in any memory (as XLA's cost analysis counts them), the part of those
    bytes in HBM (memory space 0; with the HBM side of the compiler's prefetches) and the bytes collectives
    receive over the chip-to-chip links (ICI), per device."""

    flops: float = 0.0
    bytes: float = 0.0
    hbm_bytes: float = 0.0
    ici_bytes: float = 0.0  # received from other chips by collectives (`_collective_ici`)

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))

    def __mul__(self, k: float) -> Cost:
        return Cost(*(a * k for a in dataclasses.astuple(self)))


def _touch(leaves: Iterable[tuple[int, int]]) -> Cost:
    """Reading or writing these (bytes, memory space) arrays once."""
    leaves = list(leaves)
    return Cost(0.0, sum(b for b, _ in leaves), sum(b for b, space in leaves if space == 0))


@dataclasses.dataclass(frozen=True)
class Loop:
    """One `while` instruction of the program: `runs` times per call (its enclosing loops' trips), `trips`
    iterations each (the bound, for a data-dependent loop), `per_iteration` = body + condition, inner loops
    at their trip counts."""

    op_name: str  # the jax name stack of the loop (`jax.named_scope` names appear in it)
    trips: int
    runs: int
    per_iteration: Cost


@dataclasses.dataclass(frozen=True)
class Analysis:
    total: Cost  # one call of the program
    loops: tuple[Loop, ...]


_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "add-dependency",
         "opt-barrier", "partition-id", "replica-id", "domain"}
_SLICES = ("slice", "dynamic-slice")
_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _group_size(attrs: str) -> int | None:
    """Devices in one replica group: `replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}` -> 4,
    `{{0,1},{2,3}}` -> 2, `[2,4]<=[8]` -> 4; None when there is no such attribute."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attrs)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes.get(a, 1)) for a in re.findall(r"'(\w+)'", m.group(2)))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[[\d,]*?(\d+)\]<=", attrs)
    return int(m.group(1)) if m else None


def _collective_ici(ins: _Instruction, operand_bytes: float) -> float:
    """Bytes one device receives over ICI in a collective (ring algorithms; n devices per group): all-gather
    its result less its own part, reduce-scatter its input less its result, all-reduce 2 (n-1)/n of the
    array, all-to-all (n-1)/n, collective-permute the array."""
    out = ins.leaves[-1][0] if ins.opcode.endswith("-start") and len(ins.leaves) > 1 else ins.nbytes
    n = _group_size(ins.attrs) or 2
    kind = ins.opcode.removesuffix("-start")
    if kind == "all-gather":
        return max(out - operand_bytes, 0.0)
    if kind == "reduce-scatter":
        return max(operand_bytes - out, 0.0)
    if kind == "all-reduce":
        return 2.0 * operand_bytes * (n - 1) / n
    if kind == "all-to-all":
        return operand_bytes * (n - 1) / n
    if kind == "collective-permute":
        return float(operand_bytes)
    return 0.0


def _read(param: _Instruction, fused: list[_Instruction], computations: dict[str, list[_Instruction]],
          start: bool) -> int:
    """Bytes a fused kernel reads of one parameter (XLA's `FusionParameterReadBytes`): a slice or dynamic-slice
    reads its slice and a gather its rows (also inside a nested fusion); the array a dynamic-update-slice writes
    into is not read; other users share one read. Buffers that only pass through (to the output tuple, or into
    an async collective that a compute fusion carries along) are not read here: the collective's `start` fusion
    counts its input."""
    size, whole = 0, False
    root = fused[-1]
    for user in (i for i in fused if param.name in i.operands):
        if user is root and root.opcode == "tuple" or user.opcode in _COLLECTIVES and not start:
            continue
        if user.opcode in (*_SLICES, "gather") and user.operands[0] == param.name:
            size += user.nbytes
        elif user.opcode == "dynamic-update-slice" and user.operands[0] == param.name:
            continue
        elif user.opcode == "fusion" and _aliases_whole(user, param.name):
            # a relayout in place (the TPU compiler's copy of stacked int8/int4 weights from their storage tiling
            # to the matmul's, written over its input): reads only what its users read
            size += _read(user, fused, computations, start)
        elif user.opcode == "fusion":
            inner = computations.get(_callees(user).get("calls", [""])[0], [])
            params = _parameters(inner)
            size += sum(_read(params[k], inner, computations, start) if k in params else param.nbytes
                        for k, o in enumerate(user.operands) if o == param.name)
        elif user.opcode in ("broadcast", "reshape"):
            size += param.nbytes
        elif not whole:
            whole, size = True, size + param.nbytes
    return size


def _aliases_whole(fusion: _Instruction, operand: str) -> bool:
    """The fusion writes its whole result over `operand`'s buffer (`output_to_operand_aliasing={{}: (k, {})}`)."""
    m = re.search(r"output_to_operand_aliasing=\{\{\}: \((\d+), \{\}\)\}", fusion.attrs)
    return m is not None and int(m.group(1)) < len(fusion.operands) and fusion.operands[int(m.group(1))] == operand


def _parameters(fused: list[_Instruction]) -> dict[int, _Instruction]:
    return {int(i.args): i for i in fused if i.opcode == "parameter" and i.args.strip().isdigit()}


def _fusion_cost(ins: _Instruction, computations: dict[str, list[_Instruction]],
                 operands: list[tuple[tuple[int, int], ...]]) -> Cost:
    """Bytes a fusion reads and writes: its parameters as `_read` says (from their memory space); each output
    array (an in-place dynamic-update-slice: its update), none for outputs aliased to an operand. An async
    collective is counted at its `start` (its input read, its result written); its `done` moves nothing more."""
    fused = computations.get(_callees(ins).get("calls", [""])[0], [])
    by_name = {i.name: i for i in fused}
    root = fused[-1] if fused else None
    if root is None or (root.opcode == "custom-call" and "AsyncCollectiveDone" in root.attrs):
        return Cost()
    start = root.opcode == "custom-call" and "AsyncCollectiveStart" in root.attrs
    params = _parameters(fused)
    reads: list[tuple[int, int]] = []
    for k, leaves in enumerate(operands):
        if k in params:
            reads += _scaled(leaves, _read(params[k], fused, computations, start))
        else:
            reads += leaves
    ici = 0.0
    if start:  # the collective the async pair runs
        sizes = {i.name: i.nbytes for i in fused}
        ici = sum(_collective_ici(i, sum(sizes.get(o, 0) for o in i.operands)) for i in fused
                  if i.opcode in _COLLECTIVES)
    aliasing = re.search(r"output_to_operand_aliasing=\{(.*?)\}\}", ins.attrs)
    aliased = re.findall(r"\{(\d*)\}: \(", aliasing.group(1) + "}") if aliasing else []
    if "" in aliased:  # the whole output is an operand's buffer
        return _touch(reads) + Cost(ici_bytes=ici)
    aliased = {int(k) for k in aliased}
    outputs = [by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root] * len(ins.leaves)
    writes = []
    for k, (out, leaf) in enumerate(zip(outputs, ins.leaves, strict=False)):
        if k in aliased:
            continue
        if out is not None and out.opcode == "dynamic-update-slice" and out.operands[1] in by_name:
            leaf = (by_name[out.operands[1]].nbytes, leaf[1])
        writes.append(leaf)
    return _touch(reads + writes) + Cost(ici_bytes=ici)


def _scaled(leaves: tuple[tuple[int, int], ...], nbytes: int) -> list[tuple[int, int]]:
    """`nbytes` of the array `leaves` (a slice of it), in its memory space."""
    return [(nbytes, leaves[0][1] if leaves else 0)]


def _instruction_cost(ins: _Instruction, leaves: dict[str, tuple[tuple[int, int], ...]]) -> Cost:
    """Bytes one unfused instruction reads and writes (XLA's `HloCostAnalysis` rules; allocating a buffer moves
    nothing). A `copy-start` (the compiler's prefetch into, or eviction from, on-chip memory) is free as XLA counts
    it; its HBM side is one read or write of HBM."""
    if ins.opcode in _FREE or ins.opcode.endswith("-done") or 'custom_call_target="AllocateBuffer"' in ins.attrs:
        return Cost()
    operands = [leaves.get(o, ()) for o in ins.operands]
    if ins.opcode == "copy-start":
        (dst, dst_space), (_, src_space) = ins.leaves[:2]
        return Cost(0.0, 0.0, dst if (dst_space == 0) != (src_space == 0) else 0.0)
    index = [leaf for op in operands[1:] for leaf in op]
    if ins.opcode in _SLICES or ins.opcode == "slice-start":
        out = ins.leaves[-2:-1] if ins.opcode == "slice-start" else ins.leaves
        return _touch(_scaled(operands[0], sum(b for b, _ in out)) + list(out) + index)
    if ins.opcode == "dynamic-update-slice":
        update = operands[1]
        return _touch(list(update) + _scaled(ins.leaves, sum(b for b, _ in update)) + index[len(update):])
    if ins.opcode == "gather":
        return _touch(_scaled(operands[0], ins.nbytes) + list(ins.leaves) + list(operands[1]))
    read = [leaf for op in operands for leaf in op]
    if ins.opcode == "custom-call" and read and (part := _GROUPED_READS.search(ins.op_name)) is not None:
        stack = max(range(len(read)), key=lambda i: read[i][0])  # the weights: of the stack, its groups' part only
        read[stack] = (read[stack][0] * int(part.group(1)) / int(part.group(2)), read[stack][1])
    ici = Cost()
    if ins.opcode.removesuffix("-start") in _COLLECTIVES:
        ici = Cost(ici_bytes=_collective_ici(ins, sum(b for b, _ in read)))
    if ins.opcode.endswith("-start"):  # async collective: (operands, results, sync flags...)
        return _touch(read + list(ins.leaves[len(operands):])) + ici
    return _touch(read + list(ins.leaves)) + ici


def analyze(text: str) -> Analysis:
    """FLOPs and bytes of one call of the program (per device), every loop at its trip count, and its loops."""
    computations = parse(text)
    memo: dict[str, Cost] = {}
    loops: dict[str, tuple[str, int, Cost]] = {}  # while instruction -> (op_name, trips, per iteration)
    inside: dict[str, list[str]] = {}  # computation -> the while instructions directly in it (with their trips)

    def matmul_flops(name: str) -> float:
        """Matmul FLOPs inside a fusion (no bytes: a fusion's inside stays on chip)."""
        total = 0.0
        instructions = computations.get(name, [])
        shapes = {i.name: i.shape for i in instructions}
        for ins in instructions:
            if ins.opcode == "dot":
                total += _dot_flops(ins, shapes)
            elif ins.opcode == "convolution":
                total += _conv_flops(ins, shapes)
            for callee in _callees(ins).get("calls", []):
                total += matmul_flops(callee)
        return total

    def cost(name: str) -> Cost:
        if name in memo:
            return memo[name]
        memo[name] = Cost()  # guards against recursion through malformed text
        instructions = computations.get(name, [])
        shapes = {ins.name: ins.shape for ins in instructions}
        leaves = {ins.name: ins.leaves for ins in instructions}
        by_name = {ins.name: ins for ins in instructions}
        total = Cost()
        for ins in instructions:
            callees = _callees(ins)
            if ins.opcode == "dot":
                total += _instruction_cost(ins, leaves) + Cost(_dot_flops(ins, shapes))
            elif ins.opcode == "convolution":
                total += _instruction_cost(ins, leaves) + Cost(_conv_flops(ins, shapes))
            elif ins.opcode == "while":
                body, cond = callees.get("body", [""])[0], callees.get("condition", [""])[0]
                init = by_name.get(ins.operands[0]) if ins.operands else None
                trips = _trip_count(computations.get(cond, []), computations.get(body, []), init, by_name)
                once = cost(body) + cost(cond)
                loops[ins.name] = (ins.op_name, trips, once)
                inside.setdefault(name, []).append(ins.name)
                total += once * trips
            elif ins.opcode == "conditional":
                branches = callees.get("branch_computations", []) + callees.get("true_computation", []) + \
                    callees.get("false_computation", [])
                total += max((cost(b) for b in branches), default=Cost(), key=lambda c: (c.bytes, c.flops))
            elif ins.opcode == "fusion":
                operands = [leaves.get(o, ()) for o in ins.operands]
                total += _fusion_cost(ins, computations, operands) + Cost(matmul_flops(callees["calls"][0]))
            elif ins.opcode in ("call", "async-start"):
                total += sum((cost(c) for c in callees.get("calls", []) + callees.get("to_apply", [])), Cost())
            elif ins.opcode == "custom-call":
                total += _instruction_cost(ins, leaves) + Cost(_kernel_flops(ins))
            else:
                total += _instruction_cost(ins, leaves)
        memo[name] = total
        return total

    total = cost("ENTRY")

    def collect(name: str, runs: int) -> list[Loop]:
        found = []
        for w in inside.get(name, []):
            op_name, trips, once = loops[w]
            found.append(Loop(op_name, trips, runs, once))
            ins = next(i for i in computations[name] if i.name == w)
            for c in _callees(ins).get("body", []) + _callees(ins).get("condition", []):
                found += collect(c, runs * trips)
        for ins in computations.get(name, []):
            if ins.opcode in ("call", "async-start", "conditional"):
                for c in sum(_callees(ins).values(), []):
                    found += collect(c, runs)
        return found

    return Analysis(total, tuple(collect("ENTRY", 1)))


def _callees(ins: _Instruction) -> dict[str, list[str]]:
    return {k: re.findall(r"%([\w.\-]+)", v) for k, v in _CALLEE.findall(ins.attrs)}


def flops(text: str) -> float:
    """Matmul FLOPs of one run of the program (per device), loops counted by their trip counts."""
    return analyze(text).total.flops


def bytes_accessed(text: str) -> float:
    """Bytes read and written in any device memory by one run of the program (per device), loops at their trip
    counts (the module docstring says what counts)."""
    return analyze(text).total.bytes


def named_loop(analysis: Analysis, scope: str) -> Loop | None:
    """The outermost loop created directly under `jax.named_scope(scope)` (its op_name ends `scope/while`)."""
    found = [loop for loop in analysis.loops if re.search(rf"(^|/){re.escape(scope)}/while$", loop.op_name)]
    return found[0] if found else None
