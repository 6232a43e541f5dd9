"""Compile-only mode: "will my run fit this TPU slice, and what does each program cost?" -- on any machine.

`python -m rloo_jax.train --config FILE --compile_only --topology v5e-8` builds the run with the training loop's own
assembly (`rloo_jax.build.assemble(abstract=True)`: the model from its `config.json` alone, no weights read; the
tokenizer; the optimizer; the mesh over the slice's chips, `rloo_jax.tpu`), then compiles exactly the programs the loop
runs (`Assembly.compile_set`) for that slice with the real TPU compiler (libtpu; no TPU needed), the chip's HBM as its
limit, and reads the compiler's own figures: per-chip argument / output bytes (`memory_analysis`), the temp heap it
assigns (`temp_heap_bytes`) and the matmul FLOPs of the compiled program (`rloo_jax.hlo`: XLA's `cost_analysis` counts a
loop body once, so a scan over layers would report one layer). A program larger than the chip's HBM fails to compile
with RESOURCE_EXHAUSTED; that is reported as "does not fit", with how far over it is and the options that bring it down.

Per program it also sets the compiler's figures against what the model needs (`rloo_jax.efficiency`): FLOPs
against model FLOPs (the update's remat, padding and recomputation), the decode loop's bytes per step (HBM + ICI)
against its floor (the matrices a chip multiplies + its KV caches), and a roofline time from the chip's published
peaks (`rloo_jax.tpu.CHIPS`; the assumption is `ROOFLINE`), summed into a step time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from rloo_jax import hlo
from rloo_jax.efficiency import program_costs, roofline_seconds
from rloo_jax.mesh import per_chip_bytes
from rloo_jax.tpu import GIB, Chip, Slice, quiet_stderr


# ------------------------------------------------------------------------------------------------ one program
@dataclasses.dataclass
class ProgramReport:
    """The compiler's figures for one program, per chip."""

    name: str
    fits: bool
    resident_bytes: int  # on the chip whatever runs: the whole train state (+ this program's batch inputs)
    argument_bytes: int  # what the program reads (jit drops unused arguments: the rollout reads no AdamW state)
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    host_temp_bytes: int
    flops: float  # matmul FLOPs per call, every loop at its trip count (`rloo_jax.hlo`)
    compile_seconds: float
    bytes_accessed: float = math.nan  # HBM bytes read + written per call, loops at their trip counts (`hlo`)
    ici_bytes: float = math.nan  # bytes received from other chips per call (collectives)
    decode: hlo.Loop | None = None  # the sampler's decode loop (rollouts): its steps and their cost
    model_flops: float = math.nan  # what the model needs per call (`rloo_jax.efficiency`), per chip
    decode_floor_bytes: float = math.nan  # per chip per decode step: the matrices it multiplies + its KV caches
    estimated_seconds: float = math.nan  # roofline (`roofline`)
    code_bytes: int = 0  # the program's code, held in HBM beside its heap (the compiler's "overlays")
    analysis_temp_bytes: int = 0  # memory_analysis's temporaries: the heap + its fragmentation again (not held)
    lower_seconds: float = math.nan  # of compile_seconds: tracing and lowering (the rest is the TPU compiler's)
    hlo_instructions: int = 0  # of the optimized program, every computation: its size, whatever the host's load
    parts: list[ProgramReport] = dataclasses.field(default_factory=list)  # a phase of several programs (`phase`)

    @property
    def flops_ratio(self) -> float:  # NaN where the model's FLOPs are counted elsewhere (a multi-turn rollout's)
        return self.flops / self.model_flops if self.model_flops else math.nan

    @property
    def decode_bytes_per_step(self) -> float:
        """Bytes a decode step brings to one chip's compute: HBM traffic + what arrives over ICI."""
        return self.decode.per_iteration.hbm_bytes + self.decode.per_iteration.ici_bytes if self.decode else math.nan

    @property
    def decode_bytes_ratio(self) -> float:
        return self.decode_bytes_per_step / self.decode_floor_bytes

    def roofline(self, chip: Chip) -> float:
        """Seconds per call at the chip's published peaks: each phase (the decode loop, every step at its bound;
        the rest of the program) takes the slowest of its FLOPs, HBM bytes and ICI bytes at their rates
        (`efficiency.roofline_seconds`); phases add."""
        rates = (chip.peak_bf16_flops, chip.hbm_bandwidth, chip.ici_bandwidth / 2)  # ICI: what arrives

        def seconds(c: hlo.Cost) -> float:
            return roofline_seconds((c.flops, c.hbm_bytes, c.ici_bytes), rates)

        total = hlo.Cost(self.flops, 0.0, self.bytes_accessed, self.ici_bytes)
        if self.decode is None:
            return seconds(total)
        loop = self.decode.per_iteration * (self.decode.trips * self.decode.runs)
        return seconds(loop) + seconds(total + loop * -1)

    @property
    def peak_bytes_per_chip(self) -> int:
        """Live at once: what stays resident (or the arguments, if more) + outputs not aliased to (donated)
        arguments + the temp heap + the code; for a phase of several programs, the largest of theirs."""
        if self.parts:
            return max(p.peak_bytes_per_chip for p in self.parts)
        return (max(self.resident_bytes, self.argument_bytes) + self.output_bytes - self.alias_bytes + self.temp_bytes
                + self.code_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "peak_bytes_per_chip": self.peak_bytes_per_chip,
            "resident_bytes": self.resident_bytes,
            "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes,
            "alias_bytes": self.alias_bytes,
            "temp_bytes": self.temp_bytes,
            "code_bytes": self.code_bytes,
            "analysis_temp_bytes": self.analysis_temp_bytes,
            "host_temp_bytes": self.host_temp_bytes,
            "flops": self.flops,
            "model_flops": self.model_flops,
            "flops_ratio": self.flops_ratio,
            "bytes_accessed": self.bytes_accessed,
            "ici_bytes": self.ici_bytes,
            "estimated_seconds": self.estimated_seconds,
            "compile_seconds": self.compile_seconds,
            "lower_seconds": self.lower_seconds,
            "hlo_instructions": self.hlo_instructions,
        } | ({} if not self.parts else {"parts": {p.name: p.to_json() for p in self.parts}}) | (
            {} if self.decode is None else {
            "decode_steps": self.decode.trips,
            "decode_flops_per_step": self.decode.per_iteration.flops,
            "decode_hbm_bytes_per_step": self.decode.per_iteration.hbm_bytes,
            "decode_ici_bytes_per_step": self.decode.per_iteration.ici_bytes,
            "decode_floor_bytes_per_step": self.decode_floor_bytes,
            "decode_bytes_ratio": self.decode_bytes_ratio,
        })


# the compiler's out-of-memory verdicts: an early exit when far over (arguments + program), else its full report
_OVER_HBM = re.compile(r"HLO temporaries \(([\d.]+)([KMGT]?)\)")
_PROGRAM_HBM = re.compile(r"^\s*program\s+([\d.]+)([KMGT]?)\s*$", re.M)  # heap + code (its "overlays")
_TEMP_HEAP = re.compile(r"^allocation \d+: size (\d+), preallocated-temp", re.M)  # HBM (color 0) only
_SCALE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _figure(m: re.Match[str]) -> int:
    return int(float(m.group(1)) * _SCALE[m.group(2)])


def temp_heap_bytes(dump_dir: str) -> int:
    """The HBM the compiler gives a program's temporaries: the size of its preallocated temp heap, from the
    buffer assignment it dumps. `memory_analysis().temp_size_in_bytes` on TPU adds the heap's fragmentation to
    it a second time (BENCHMARKS.md: the 8B update on v5e-16 reported 9.99 GiB of temporaries in a 7.49 GiB
    heap, and compiled under a 13.67 GiB limit with 6.54 GiB of arguments while reporting 10.24): the heap is
    what the chip holds and what the compiler's own out-of-memory check counts."""
    import glob

    files = glob.glob(f"{dump_dir}/*after_optimizations-buffer-assignment.txt")
    if len(files) != 1:
        raise RuntimeError(f"expected one buffer assignment from the TPU compiler in {dump_dir}, found {files}")
    with open(files[0]) as f:
        return sum(int(m.group(1)) for m in _TEMP_HEAP.finditer(f.read()))


def compile_program(name: str, lower: Callable[[], Any], hbm_bytes: int, resident_bytes: int) -> ProgramReport:
    """Lower and compile one program with the chip's HBM as the compiler's limit (it then packs the program to
    fit, as it would on the chip); a RESOURCE_EXHAUSTED compile becomes a report with `fits=False` (its
    temporaries as the compiler counted them). `resident_bytes`: per chip, what is in HBM whatever the program
    (the train state and the program's inputs, from their shardings). Temporaries are the compiler's temp heap
    (`temp_heap_bytes`); `memory_analysis`'s figure is kept as `analysis_temp_bytes`."""
    import tempfile

    from rloo_jax.models.attention import compile_target
    from rloo_jax.sampling import DECODE_LOOP

    t0 = time.perf_counter()
    lower_seconds = math.nan
    with tempfile.TemporaryDirectory() as dump:
        options = {"xla_tpu_max_hbm_size_mib": hbm_bytes // 2**20, "xla_dump_to": dump,
                   "xla_dump_hlo_pass_re": "^$"}  # no per-pass dumps: the buffer assignment is what we read
        try:
            with quiet_stderr(), compile_target("tpu"):  # traced on this host's CPU for a TPU (attention kernels)
                lowered = lower()
                lower_seconds = time.perf_counter() - t0
                compiled = lowered.compile(options)
        except Exception as e:  # noqa: BLE001 - only the out-of-memory verdict is a result; the rest re-raises
            text = str(e)
            program, total = _PROGRAM_HBM.search(text), _OVER_HBM.search(text)
            if "RESOURCE_EXHAUSTED" not in text or (program or total) is None:
                raise
            # the early exit counts the arguments in: what is left past the resident state, at least
            temp = _figure(program) if program else max(_figure(total) - resident_bytes, 0)
            seconds = time.perf_counter() - t0
            return ProgramReport(name, False, resident_bytes, 0, 0, 0, temp, 0, math.nan, seconds,
                                 lower_seconds=lower_seconds)
        heap = temp_heap_bytes(dump)
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    analysis = hlo.analyze(text)
    report = ProgramReport(
        name=name,
        fits=True,
        resident_bytes=resident_bytes,
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=heap,
        host_temp_bytes=int(getattr(mem, "host_temp_size_in_bytes", 0)),
        flops=analysis.total.flops,
        compile_seconds=seconds,
        bytes_accessed=analysis.total.hbm_bytes,
        ici_bytes=analysis.total.ici_bytes,
        decode=hlo.named_loop(analysis, DECODE_LOOP),
        code_bytes=int(mem.generated_code_size_in_bytes),
        analysis_temp_bytes=int(mem.temp_size_in_bytes),
        lower_seconds=lower_seconds,
        hlo_instructions=sum(len(body) for k, body in hlo.parse(text).items() if k != "ENTRY"),  # (an alias)
    )
    report.fits = report.peak_bytes_per_chip <= hbm_bytes
    return report


def phase(name: str, parts: list[ProgramReport]) -> ProgramReport:
    """One line of the report for programs the loop runs one after the other (the rollout: `sample`, then `finish`):
    it fits when each does; its peak is the largest part's (`peak_bytes_per_chip`); FLOPs, bytes, model FLOPs,
    estimated and compile seconds add; the decode loop is the sampler's."""
    if len(parts) == 1:
        return dataclasses.replace(parts[0], name=name)
    largest = max(parts, key=lambda p: p.peak_bytes_per_chip)
    decoding = next((p for p in parts if p.decode is not None), None)
    total = lambda field: sum(getattr(p, field) for p in parts)  # noqa: E731
    return ProgramReport(
        name=name, fits=all(p.fits for p in parts), resident_bytes=largest.resident_bytes,
        argument_bytes=largest.argument_bytes, output_bytes=largest.output_bytes, alias_bytes=largest.alias_bytes,
        temp_bytes=largest.temp_bytes, host_temp_bytes=max(p.host_temp_bytes for p in parts), flops=total("flops"),
        compile_seconds=total("compile_seconds"), bytes_accessed=total("bytes_accessed"), ici_bytes=total("ici_bytes"),
        decode=None if decoding is None else decoding.decode, model_flops=total("model_flops"),
        decode_floor_bytes=math.nan if decoding is None else decoding.decode_floor_bytes,
        estimated_seconds=total("estimated_seconds"), code_bytes=largest.code_bytes,
        analysis_temp_bytes=largest.analysis_temp_bytes, parts=list(parts),
        lower_seconds=total("lower_seconds"), hlo_instructions=total("hlo_instructions"),
    )


def decoding(report: ProgramReport, steps: int, chip: Chip) -> ProgramReport:
    """`report` with its decode loop counted at `steps` iterations. A multi-turn program's loop (`rloo_jax.turns`)
    stops at a data-dependent pause; `rloo_jax.hlo` reads its bound from the condition's paused-row count, which is
    not the rollout's: over a rollout's turns its rows decode at most C tokens (max_completion_length) in all."""
    loop = report.decode
    if loop is None:
        return report
    extra = loop.per_iteration * ((steps - loop.trips) * loop.runs)
    out = dataclasses.replace(report, flops=report.flops + extra.flops,
                              bytes_accessed=report.bytes_accessed + extra.hbm_bytes,
                              ici_bytes=report.ici_bytes + extra.ici_bytes,
                              decode=dataclasses.replace(loop, trips=steps))
    out.estimated_seconds = out.roofline(chip)
    return out


def repeated(report: ProgramReport, times: int) -> ProgramReport:
    """`report` run `times` times one after the other (its peak once; FLOPs, bytes and seconds `times` over)."""
    return dataclasses.replace(report, flops=report.flops * times, bytes_accessed=report.bytes_accessed * times,
                               ici_bytes=report.ici_bytes * times, estimated_seconds=report.estimated_seconds * times,
                               model_flops=report.model_flops * times, name=f"{report.name} x{times}")


def turns_phase(name: str, lines: dict[str, list[ProgramReport]], prefix: str, rounds: int, steps: int,
                chip: Chip) -> ProgramReport:
    """A multi-turn rollout as one report line, popped from `lines` (`<prefix>turns_start`, `...turns_resume@<w>`
    and `...turns_close`, then the line `name`'s programs: `finish`): the first turn with the C decode steps of
    every turn (`decoding`), `rounds` resumes at the narrowest suffix width (tool results that fit it) without
    decoding, the close. The wider resumes stay lines of their own (what a longer tool result runs instead), their
    decoding counted at the first turn too."""
    start = decoding(lines.pop(f"{prefix}turns_start")[0], steps, chip)
    widths = sorted((k for k in lines if k.startswith(f"{prefix}turns_resume@")), key=lambda k: int(k.split("@")[1]))
    resume = repeated(decoding(lines.pop(widths[0])[0], 0, chip), rounds)
    for w in widths[1:]:  # their decode steps are the first turn's too
        lines[w] = [decoding(lines[w][0], 0, chip)]
    close = lines.pop(f"{prefix}turns_close")[0]
    resume.model_flops = close.model_flops = 0.0  # the conversation's model FLOPs are counted at the first turn
    return phase(name, [start, resume, close, *lines.pop(name, [])])


# ------------------------------------------------------------------------------------------------ the report
STEP_PROGRAMS = ("rollout", "update")  # with each reward model: what every step of the loop runs (the estimate)
# the report's lines that gather programs the loop runs one after the other (`phase`)
PHASES = {"rollout": ("sample", "longest", "finish"), "eval_rollout": ("eval_sample", "eval_scores")}


@dataclasses.dataclass
class Report:
    topology: Slice
    programs: list[ProgramReport]
    settings: dict[str, Any]
    reshard: ProgramReport | None = None  # the move of the weights into the sampler's layout (inside the rollout)
    tokens_per_step: int = 0  # prompt + completion tokens of one generation batch, at the compiled (maximum) lengths
    host: dict[str, Any] = dataclasses.field(default_factory=dict)  # the compiling machine: CPUs, load before / after

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.programs)

    @property
    def estimated_step_seconds(self) -> float:
        """One trainer iteration on the device: the rollout, the update at max_completion_length and each reward
        model (the evaluation rollout runs every eval_steps only; `finish@<width>` and `update@<width>` are what an
        early-ending batch runs instead; the records' `score` is negligible); host work (reward functions, decoding
        text) is not included."""
        return sum(p.estimated_seconds for p in self.programs if p.name in STEP_PROGRAMS
                   or p.name.startswith("reward_model_"))

    @property
    def tokens_per_second_per_chip(self) -> float:
        """NeMo-RL's throughput measure: the prompt + completion tokens of a step (every completion with its prompt,
        at the compiled maximum lengths) / the estimated step time / the chips."""
        seconds = self.estimated_step_seconds
        return self.tokens_per_step / seconds / self.topology.chips if seconds > 0 else math.nan

    def to_json(self) -> dict[str, Any]:
        chip = self.topology.chip
        return {
            "topology": self.topology.name,
            "chips": self.topology.chips,
            "hbm_bytes_per_chip": chip.hbm_bytes,
            "fits": self.fits,
            "estimated_step_seconds": self.estimated_step_seconds,
            "tokens_per_step": self.tokens_per_step,
            "estimated_tokens_per_second_per_chip": self.tokens_per_second_per_chip,
            "roofline": {"peak_bf16_flops_per_chip": chip.peak_bf16_flops, "hbm_bytes_per_second": chip.hbm_bandwidth,
                         "ici_bidirectional_bytes_per_second": chip.ici_bandwidth, "assumption": ROOFLINE},
            "settings": self.settings,
            "programs": {p.name: p.to_json() for p in self.programs},
            "compile_host": self.host,  # compile seconds scale with the host's load; hlo_instructions do not
        } | ({} if self.reshard is None else {"rollout_reshard": {
            "ici_bytes_per_chip": self.reshard.ici_bytes, "hbm_bytes_per_chip": self.reshard.bytes_accessed,
            "copy_bytes_per_chip": self.reshard.output_bytes, "estimated_seconds": self.reshard.estimated_seconds,
            "compile_seconds": self.reshard.compile_seconds,
        }})

    def write(self, output_dir: str) -> str:
        """`<output_dir>/compile_report.json` (a local folder or a URL); returns its path."""
        from rloo_jax import outputs

        path = outputs.join(output_dir, "compile_report.json")
        outputs.write_text(path, json.dumps(_nan_to_none(self.to_json()), indent=1, allow_nan=False))
        return path


def _nan_to_none(x: Any) -> Any:
    """JSON has no NaN: a figure the compiler could not give (a program that did not compile) is null."""
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    return None if isinstance(x, float) and math.isnan(x) else x


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


ROOFLINE = (
    "each phase of a program (the decode loop, every step at its bound; the rest) takes the longest of FLOPs / "
    "peak bf16 FLOP/s, HBM bytes / HBM bandwidth and bytes received from other chips / half the bidirectional "
    "ICI bandwidth, per chip; phases and programs add; latencies, launch gaps, host transfers and host work "
    "(reward functions, decoding text) are not counted"
)


def _num(x: float, fmt: str) -> str:
    return "-" if math.isnan(x) else format(x, fmt)


def _ici_bound(cost: hlo.Cost, chip: Chip) -> bool:
    """Whether a loop step's ICI bytes take longer than its HBM bytes at the chip's rates (the roofline's
    half-duplex ICI figure); by bytes where the chip publishes no ICI rate."""
    if math.isnan(chip.ici_bandwidth):
        return cost.ici_bytes > cost.hbm_bytes
    return cost.ici_bytes / (chip.ici_bandwidth / 2) > cost.hbm_bytes / chip.hbm_bandwidth


def table_lines(report: Report) -> list[str]:
    """The per-program table as text lines: what stays resident (train state + inputs), the program's temp
    heap and code, the peak against the chip's HBM, compiler FLOPs per call and their ratio to the model's, HBM and
    ICI bytes per call, the roofline seconds, compile seconds; then the decode loop against its floor and the
    roofline's assumption and step time."""
    slc, hbm = report.topology, report.topology.chip.hbm_bytes
    head = (f"{'program':15s} {'resident':>10s} {'temp + code':>12s} {'peak/chip':>10s} {'of HBM':>7s} "
            f"{'TFLOP/call':>10s} {'x model':>7s} {'HBM GB':>7s} {'ICI GB':>7s} {'est. s':>7s} {'compile':>8s}")
    lines = [head]
    for p in report.programs:
        resident = max(p.resident_bytes, p.argument_bytes)
        lines.append(
            f"{p.name:15s} {gib(resident):>10s} {gib(p.temp_bytes + p.code_bytes):>12s} "
            f"{gib(p.peak_bytes_per_chip):>10s} "
            f"{100 * p.peak_bytes_per_chip / hbm:6.0f}% {_num(p.flops / 1e12, '10.2f'):>10s} "
            f"{_num(p.flops_ratio, '.2f') + 'x':>7s} {_num(p.bytes_accessed / 1e9, '7.1f'):>7s} "
            f"{_num(p.ici_bytes / 1e9, '7.1f'):>7s} {_num(p.estimated_seconds, '7.2f'):>7s} {p.compile_seconds:7.1f}s"
        )
    for p in report.programs:
        if p.decode is not None and not math.isnan(p.decode_floor_bytes):
            step, floor = p.decode_bytes_per_step / 1e9, p.decode_floor_bytes / 1e9
            lines.append(
                f"{p.name} decode: {p.decode.trips} steps of {step:.2f} GB/chip (HBM + ICI), "
                f"{p.decode_bytes_ratio:.2f}x the floor of {floor:.2f} GB (matrices + KV caches)"
            )
            fsdp = report.settings.get("rollout_mesh", {}).get("fsdp", 1)
            if _ici_bound(p.decode.per_iteration, slc.chip) and fsdp > 1:
                lines.append(f"  {p.name} decode is ICI-bound (on FSDP a step gathers the weights, or its rows' "
                             "partial sums cross to the weights' chips); a --rollout_mesh with fsdp 1 gathers "
                             "the weights once")
    layout = report.settings.get("rollout_mesh")
    if layout is not None:
        train = report.settings["mesh"]
        lines.append(f"rollout layout: data {layout['data']} x fsdp {layout['fsdp']} x tensor {layout['tensor']} "
                     f"(training: {train['data']} x {train['fsdp']} x {train['tensor']})")
        r = report.reshard
        if r is not None and r.fits:
            lines.append(f"  weights moved into it once per generation: {r.ici_bytes / 1e9:.2f} GB/chip over ICI, "
                         f"{r.bytes_accessed / 1e9:.2f} GB HBM, est. {r.estimated_seconds:.3f} s (in the rollout's)")
    chip = slc.chip
    ici = "" if math.isnan(chip.ici_bandwidth) else f", ICI in {chip.ici_bandwidth / 2e9:.0f} GB/s"
    lines.append(
        f"est. s: each phase (decode loop; rest) at its slowest of {chip.peak_bf16_flops / 1e12:.0f} TFLOP/s, "
        f"HBM {chip.hbm_bandwidth / 1e9:.0f} GB/s{ici} per {slc.generation} chip"
    )
    rm = " + reward models" if any(p.name.startswith("reward_model") for p in report.programs) else ""
    lines.append(
        f"est. step: {_num(report.estimated_step_seconds, '.2f')} s on the device (rollout + update{rm}), "
        "host work (reward functions, decoding text) not included"
    )
    lines.append(
        f"est. {_num(report.tokens_per_second_per_chip, ',.0f')} tokens/s per chip ({report.tokens_per_step:,} prompt "
        "+ completion tokens a step, at the maximum lengths)"
    )
    return lines


def verdict(report: Report, advice: Callable[[str], Sequence[str]]) -> str:
    """One line: fits (with the headroom), or the first program that does not fit, how far over, what helps."""
    slc, hbm = report.topology, report.topology.chip.hbm_bytes
    worst = max(report.programs, key=lambda p: p.peak_bytes_per_chip)
    if report.fits:
        return (
            f"FITS: every program fits {slc.name} ({slc.chips} chip{'s' * (slc.chips > 1)}, {gib(hbm)} HBM each); "
            "the largest, "
            f"{worst.name}, peaks at {gib(worst.peak_bytes_per_chip)} per chip ({gib(hbm - worst.peak_bytes_per_chip)}"
            " headroom)"
        )
    bad = [p for p in sorted(report.programs, key=lambda p: -p.peak_bytes_per_chip) if not p.fits]
    worst, over = bad[0], bad[0].peak_bytes_per_chip - hbm
    also = "".join(f" ({p.name} too: {gib(p.peak_bytes_per_chip)})" for p in bad[1:])
    tips = "; ".join(advice(worst.name))
    return (
        f"DOES NOT FIT: {worst.name} needs {gib(worst.peak_bytes_per_chip)} per chip, {gib(over)} "
        f"({100 * over / hbm:.0f}%) over the {gib(hbm)} of a {slc.generation} chip{also}; to bring it down: {tips}"
    )


def advice(cfg: Any, program: str) -> list[str]:
    """The options that would bring `program`'s per-chip memory down, given what `cfg` already uses."""
    tips = []
    if program.startswith("update"):
        if cfg.gradient_checkpointing is False:
            tips.append("--gradient_checkpointing true")
        elif cfg.remat_policy not in ("full", "full_offloaded"):
            tips.append(f"--remat_policy full (now {cfg.remat_policy})")
        if cfg.per_device_train_batch_size > cfg.num_generations:
            tips.append(
                "a smaller --per_device_train_batch_size with a larger --gradient_accumulation_steps and "
                "--steps_per_generation (the same generation batch in more, smaller micro-batches)"
            )
    if program.startswith(("rollout", "eval", "sample", "finish", "score")):
        tips.append("a smaller generation batch (--per_device_train_batch_size or --steps_per_generation)")
    if program.startswith("reward_model"):  # sharded like the policy, stored in the compute dtype
        tips = ["a smaller generation batch (--per_device_train_batch_size or --steps_per_generation)"]
        if cfg.bf16 is False:  # None: on for a TPU
            tips.append("--bf16 true (the reward model is stored and run in the compute dtype)")
        return [*tips, "a smaller reward model, or a slice with more chips (--fsdp -1 shards over all)"]
    if cfg.bf16 is False:  # None: on for a TPU
        tips.append("--bf16 true (bfloat16 activations, KV cache and reference model)")
    if cfg.mu_dtype != "bfloat16":
        tips.append("--mu_dtype bfloat16")
    if cfg.param_dtype != "bfloat16":
        tips.append("--param_dtype bfloat16 (master weights)")
    tips += cfg.memory_tips()  # the algorithm's own (RLOO / GRPO: beta 0 drops the reference)
    tips.append("a shorter --max_completion_length, or a slice with more chips (--fsdp -1 shards over all)")
    return tips


# ------------------------------------------------------------------------------------------------ the run
def compile_run(cfg: Any, slc: Slice, out: Callable[[str], None] = print) -> Report:
    """Build the run of `cfg` for slice `slc` exactly as training builds it (`rloo_jax.build.assemble`, abstract:
    config.json, no weights, on the slice's chips) and compile every program its loop runs (`Assembly.compile_set`:
    the sampler, the reference / old log-prob pass and the update at each completion width, the records' scores,
    the evaluation sampler, the reference sync, each reward model), and the sampler's weight move alone. The report's
    lines are those programs, the ones the loop runs one after the other gathered (`PHASES`: the sampler and the pass
    after it as `rollout`). `cfg` must be validated for `slc.chips` devices. Platform-dependent options are resolved
    for a TPU and the programs are traced at the run's matmul precision (`rloo_jax.numerics`)."""
    from rloo_jax import build, numerics
    from rloo_jax.models import abstract_model
    from rloo_jax.tpu import topology_devices

    load = os.getloadavg()
    with numerics.kept_matmul_precision():
        assembly = build.assemble(cfg, topology_devices(slc), abstract=True, device_bytes=slc.chip.hbm_bytes)
        out(assembly.prepared.description)
        cfg, shapes, state = assembly.cfg, assembly.shapes, assembly.abstract_state()
        costs = program_costs(assembly, shapes, slc.chips,
                              [abstract_model(folder, "reward").config for folder in assembly.prepared.reward_models])
        compile_set = [*assembly.compile_set(shapes), assembly.programs.layout_program()]
        reward_models = [p for p in compile_set if p.name.startswith("reward_model_")]
        # resident whatever runs: the train state and the reward models' weights (the trainer keeps both on the chips)
        state_bytes = per_chip_bytes(state) + sum(per_chip_bytes(p.args[0]) for p in reward_models)
        b, n, c = shapes.prompts, shapes.prompts * cfg.num_generations, cfg.max_completion_length
        # the batch arrays (prompt ids and masks, completion ids, masks and log-probs): small next to the state
        batch = 4 * (2 * b * shapes.prompt_length + 4 * n * c) // cfg.data_shards
        phase_of = {part: line for line, parts in PHASES.items() for part in parts}
        lines: dict[str, list[ProgramReport]] = {}  # the report's lines, in order, and their programs
        for program in compile_set:
            out(f"compiling {program.name} for {slc.name} ...")
            in_step = not program.name.startswith(("eval_", "reward_model_", "sync_reference", "rollout_layout"))
            report = compile_program(program.name, program.lower, slc.chip.hbm_bytes,
                                     state_bytes + batch * in_step)
            report.model_flops, report.decode_floor_bytes = costs.get(program.name.split("[")[0], (math.nan,) * 2)
            report.estimated_seconds = report.roofline(slc.chip)
            lines.setdefault(phase_of.get(program.name, program.name), []).append(report)
    reshard = lines.pop("rollout_layout")[0]
    if "turns_start" in lines:  # a multi-turn rollout: its turns' programs as the rollout line (`turns_phase`)
        rounds = cfg.max_tool_calling_iterations or 1
        turns = {"rollout": turns_phase("rollout", lines, "", rounds, c, slc.chip)}
        if "eval_turns_start" in lines:
            turns["eval_rollout"] = turns_phase("eval_rollout", lines, "eval_", rounds, c, slc.chip)
        lines = {**{k: [v] for k, v in turns.items()}, **lines}
    settings = run_settings(assembly, shapes)
    if reward_models:  # their weights per chip, resident in every program's figure
        settings["reward_model_bytes_per_chip"] = [per_chip_bytes(p.args[0]) for p in reward_models]
    host = {"cpus": os.cpu_count(), "load_average_before": [round(x, 2) for x in load],
            "load_average_after": [round(x, 2) for x in os.getloadavg()]}
    return Report(slc, [phase(name, parts) for name, parts in lines.items()], settings, reshard,
                  tokens_per_step=n * (shapes.prompt_length + c), host=host)


def run_settings(assembly: Any, shapes: Any) -> dict[str, Any]:
    """What the run of `assembly` (`rloo_jax.build.Assembly`) is, as compile-only's report records it: the model,
    the meshes, the batch and its lengths, the dtypes and execution options, the algorithm's own settings
    (`cfg.report_settings`), the value and device reward models' bytes per chip, the adapters."""
    import jax

    cfg, state = assembly.cfg, assembly.abstract_state()
    axes = ("data", "fsdp", "tensor")
    settings = {
        "model": cfg.model_name_or_path,
        "mesh": dict(zip(axes, cfg.mesh_shape, strict=True), **({"expert": cfg.expert_parallel}
                                                                   if cfg.expert_parallel > 1 else {})),
        "prompts_per_generation": shapes.prompts,
        "completions_per_generation": shapes.prompts * cfg.num_generations,
        "prompt_length": shapes.prompt_length, "max_completion_length": cfg.max_completion_length,
        **assembly.options, "mu_dtype": cfg.mu_dtype, "matmul_precision": cfg.matmul_precision,
        "recompute_old_logps": assembly.programs.cfg.recompute,
        "rollout_mesh": dict((assembly.rollout_mesh or assembly.mesh).shape),
        "per_device_train_batch_size": cfg.per_device_train_batch_size,
        "steps_per_generation": cfg.resolved_steps_per_generation,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "num_iterations": cfg.resolved_num_iterations, "algorithm": cfg.ALGORITHM,
        **cfg.report_settings(),  # the algorithm's own (GRPO: loss_type; PPO: its batching and models)
    }
    if state.value_params is not None:
        settings["value_model_bytes_per_chip"] = per_chip_bytes(state.value_params)
    if state.reward_params is not None:
        settings["reward_model_bytes_per_chip_on_device"] = per_chip_bytes(state.reward_params)
    if cfg.use_peft:
        settings.update(lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_target_modules=cfg.lora_target_modules,
                        lora_target_parameters=cfg.lora_target_parameters,
                        trainable_params=sum(x.size for x in jax.tree.leaves(assembly.policy.params)))
    return settings
