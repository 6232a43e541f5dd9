"""Compile-only mode: "will my run fit this TPU slice, and what does each program cost?" -- on any machine.

`python -m rloo_jax.train --config FILE --compile_only --topology v5e-8` builds the run exactly as training would
(`rloo_jax.build.prepare(abstract=True)`: the model from its `config.json` alone, no weights read; the tokenizer;
the optimizer; the mesh over the slice's chips, `rloo_jax.tpu`), then compiles every per-step program for that
slice with the real TPU compiler (libtpu; no TPU needed) and reads the compiler's own figures: per-chip argument /
output / temporary bytes (`memory_analysis`) and the matmul FLOPs of the compiled program (`rloo_jax.hlo`: XLA's
`cost_analysis` counts a loop body once, so a scan over layers would report one layer). A program larger than
the chip's HBM fails to compile with RESOURCE_EXHAUSTED; that is reported as "does not fit", with how far over it
is and the options that bring it down.
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
from rloo_jax.tpu import GIB, Slice, quiet_stderr


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

    @property
    def peak_bytes_per_chip(self) -> int:
        """Live at once: what stays resident (or the arguments, if more) + outputs not aliased to (donated)
        arguments + temporaries."""
        return max(self.resident_bytes, self.argument_bytes) + self.output_bytes - self.alias_bytes + self.temp_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "peak_bytes_per_chip": self.peak_bytes_per_chip,
            "resident_bytes": self.resident_bytes,
            "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes,
            "alias_bytes": self.alias_bytes,
            "temp_bytes": self.temp_bytes,
            "host_temp_bytes": self.host_temp_bytes,
            "flops": self.flops,
            "compile_seconds": self.compile_seconds,
        }


_OVER_HBM = re.compile(r"HLO temporaries \(([\d.]+)([KMGT]?)\)")


def compile_program(name: str, lower: Callable[[], Any], hbm_bytes: int, resident_bytes: int) -> ProgramReport:
    """Lower and compile one program; a RESOURCE_EXHAUSTED compile becomes a report with `fits=False` (its
    temporaries as the compiler counted them). `resident_bytes`: per chip, what is in HBM whatever the program
    (the train state and the program's inputs, from their shardings)."""
    t0 = time.perf_counter()
    try:
        with quiet_stderr():
            compiled = lower().compile()
    except Exception as e:  # noqa: BLE001 - only the out-of-memory verdict is a result; the rest re-raises
        text = str(e)
        m = _OVER_HBM.search(text)
        if "RESOURCE_EXHAUSTED" not in text or m is None:
            raise
        scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]
        temp = int(float(m.group(1)) * scale)
        seconds = time.perf_counter() - t0
        return ProgramReport(name, False, resident_bytes, 0, 0, 0, temp, 0, math.nan, seconds)
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    report = ProgramReport(
        name=name,
        fits=True,
        resident_bytes=resident_bytes,
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        host_temp_bytes=int(getattr(mem, "host_temp_size_in_bytes", 0)),
        flops=hlo.flops(compiled.as_text()),
        compile_seconds=seconds,
    )
    report.fits = report.peak_bytes_per_chip <= hbm_bytes
    return report


def per_chip_bytes(tree: Any) -> int:
    """Bytes one chip holds of a pytree of `ShapeDtypeStruct`s with shardings (the largest shard per leaf)."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


# ------------------------------------------------------------------------------------------------ the report
@dataclasses.dataclass
class Report:
    topology: Slice
    programs: list[ProgramReport]
    settings: dict[str, Any]

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.programs)

    def to_json(self) -> dict[str, Any]:
        return {
            "topology": self.topology.name,
            "chips": self.topology.chips,
            "hbm_bytes_per_chip": self.topology.chip.hbm_bytes,
            "fits": self.fits,
            "settings": self.settings,
            "programs": {p.name: p.to_json() for p in self.programs},
        }

    def write(self, output_dir: str) -> str:
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, "compile_report.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_nan_to_none(self.to_json()), f, indent=1, allow_nan=False)
        return path


def _nan_to_none(x: Any) -> Any:
    """JSON has no NaN: a figure the compiler could not give (a program that did not compile) is null."""
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    return None if isinstance(x, float) and math.isnan(x) else x


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def table_lines(report: Report) -> list[str]:
    """The per-program table as text lines: what stays resident (train state + inputs), the program's
    temporaries, the peak against the chip's HBM, compiler FLOPs per call, compile seconds."""
    hbm = report.topology.chip.hbm_bytes
    head = (f"{'program':13s} {'resident':>10s} {'temporaries':>12s} {'peak/chip':>10s} {'of HBM':>7s} "
            f"{'TFLOP/call':>10s} {'compile':>8s}")
    lines = [head]
    for p in report.programs:
        flops = "-" if math.isnan(p.flops) else f"{p.flops / 1e12:.2f}"
        resident = max(p.resident_bytes, p.argument_bytes)
        lines.append(
            f"{p.name:13s} {gib(resident):>10s} {gib(p.temp_bytes):>12s} {gib(p.peak_bytes_per_chip):>10s} "
            f"{100 * p.peak_bytes_per_chip / hbm:6.0f}% {flops:>10s} {p.compile_seconds:7.1f}s"
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


# ------------------------------------------------------------------------------------------------ the run
def prompt_length(cfg: Any) -> int:
    """The widest prompt batch the run compiles for: max_prompt_length rounded up to prompt_bucket."""
    from rloo_jax.errors import ConfigError

    if cfg.max_prompt_length is None:
        raise ConfigError(
            "compile_only needs --max_prompt_length: the prompt width to compile for (prompts are cut to it and "
            "padded to a multiple of prompt_bucket)"
        )
    return -(-cfg.max_prompt_length // cfg.prompt_bucket) * cfg.prompt_bucket


def advice(cfg: Any, program: str) -> list[str]:
    """The options that would bring `program`'s per-chip memory down, given what `cfg` already uses."""
    tips = []
    if program == "update":
        if cfg.gradient_checkpointing is False:
            tips.append("--gradient_checkpointing true")
        elif cfg.remat_policy not in ("full", "full_offloaded"):
            tips.append(f"--remat_policy full (now {cfg.remat_policy})")
        if cfg.per_device_train_batch_size > cfg.num_generations:
            tips.append(
                "a smaller --per_device_train_batch_size with a larger --gradient_accumulation_steps and "
                "--steps_per_generation (the same generation batch in more, smaller micro-batches)"
            )
    if program.startswith(("rollout", "eval")):
        tips.append("a smaller generation batch (--per_device_train_batch_size or --steps_per_generation)")
    if program.startswith("reward_model"):
        return ["a smaller reward model or generation batch: reward models run on one chip, unsharded"]
    if not cfg.bf16:
        tips.append("--bf16 true (bfloat16 activations, KV cache and reference model)")
    if cfg.mu_dtype != "bfloat16":
        tips.append("--mu_dtype bfloat16")
    if cfg.param_dtype != "bfloat16":
        tips.append("--param_dtype bfloat16 (master weights)")
    if cfg.beta > 0:
        tips.append("--beta 0 (no reference model)")
    tips.append("a shorter --max_completion_length, or a slice with more chips (--fsdp -1 shards over all)")
    return tips


def compile_run(cfg: Any, slc: Slice, out: Callable[[str], None] = print) -> Report:
    """Build the run of `cfg` for slice `slc` and compile its per-step programs: the rollout (sampling and the
    reference log-probs), the update, the evaluation rollout (with eval_steps) and each reward model (on one
    chip, as the trainer runs them). `cfg` must be validated for `slc.chips` devices."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from rloo_jax.build import make_optimizer, model_options, policy, prepare, sampling_config, step_config
    from rloo_jax.mesh import make_mesh, replicated
    from rloo_jax.models import abstract_model
    from rloo_jax.rloo import RLOOOptions
    from rloo_jax.step import RLOOStep, StepConfig
    from rloo_jax.tpu import topology_devices

    devices = topology_devices(slc)
    run = prepare(cfg, abstract=True)
    mesh = make_mesh(*cfg.mesh_shape, devices=devices)
    scfg = step_config(cfg, run)
    optimizer, _ = make_optimizer(cfg, max(cfg.max_steps, 1))
    pol = policy(cfg, run.model)
    step = RLOOStep(pol.graphdef, optimizer, scfg, mesh=mesh, ref_graphdef=pol.ref_graphdef)
    state = step.abstract_state(pol.params, pol.ref_params, pol.frozen)
    b, p = cfg.prompts_per_generation, prompt_length(cfg)
    n = b * cfg.num_generations
    weights = jax.ShapeDtypeStruct((len(cfg.resolved_reward_weights),), jnp.float32, sharding=replicated(mesh))
    hbm = slc.chip.hbm_bytes
    state_bytes = per_chip_bytes(state)
    # the batch arrays (prompt ids and masks, completion ids, masks and log-probs): small next to the state
    batch = 4 * (2 * b * p + 4 * n * cfg.max_completion_length) // cfg.data_shards

    programs = []

    def add(name: str, lower: Callable[[], Any], resident_bytes: int) -> None:
        out(f"compiling {name} for {slc.name} ...")
        programs.append(compile_program(name, lower, hbm, resident_bytes))

    add("rollout", lambda: step.lower_rollout(state, (b, p)), state_bytes + batch)
    add("update", lambda: step.lower_update(state, (b, p), weights), state_bytes + batch)
    if cfg.eval_steps:
        g = cfg.resolved_num_generations_eval
        eval_cfg = StepConfig(sampling=sampling_config(cfg, run, g), rloo=RLOOOptions(beta=0.0))
        sampler = RLOOStep(pol.graphdef, optimizer, eval_cfg, mesh=mesh)
        sampler.state_shardings = step.state_shardings
        add("eval_rollout", lambda: sampler.lower_rollout(state, (cfg.eval_batch_size // g, p)), state_bytes)
    options = model_options(cfg, "tpu")
    one = SingleDeviceSharding(devices[0])
    for i, folder in enumerate(run.reward_models):
        rm = abstract_model(folder, "reward", options["dtype"])
        rm_graphdef, rm_params = nnx.split(rm)
        rm_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), rm_params)
        width = -(-(p + cfg.max_completion_length) // cfg.prompt_bucket) * cfg.prompt_bucket
        ids = jax.ShapeDtypeStruct((n, width), jnp.int32, sharding=one)
        score = jax.jit(lambda s, x, m, g=rm_graphdef: nnx.merge(g, s)(x, m))
        resident = per_chip_bytes(rm_params) + (state_bytes if devices[0] in mesh.devices.flat else 0)
        add(f"reward_model_{i}", lambda f=score, w=rm_params, x=ids: f.lower(w, x, x), resident)
    settings = {
        "model": cfg.model_name_or_path, "mesh": dict(zip(("data", "fsdp", "tensor"), cfg.mesh_shape, strict=True)),
        "prompts_per_generation": b, "completions_per_generation": n, "prompt_length": p,
        "max_completion_length": cfg.max_completion_length, **options, "mu_dtype": cfg.mu_dtype,
        "beta": cfg.beta,
        "per_device_train_batch_size": cfg.per_device_train_batch_size,
        "steps_per_generation": cfg.resolved_steps_per_generation,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
    }
    if cfg.use_peft:
        settings.update(lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_target_modules=cfg.lora_target_modules,
                        trainable_params=sum(x.size for x in jax.tree.leaves(pol.params)))
    return Report(slc, programs, settings)
