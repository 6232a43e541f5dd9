"""Numerics of a run on CPU, GPU and TPU: the settings that depend on the platform, resolved in one place; the
matmul precision the whole run computes at; XLA's deterministic mode.

- `resolved_settings(cfg, platform)`: every option whose None means "decide by platform" (`AUTO`), resolved for
  "cpu", "gpu" or "tpu". `for_platform(cfg, platform)` is the config with those values filled in: what the trainer
  builds from, prints at start (`describe`) and saves as the run's config.yaml.
- `use_matmul_precision(value)`: JAX's default precision for float32 matmuls (`jax_default_matmul_precision`),
  set process-wide, so every dot traced afterwards carries it: training, sampling, evaluation, reward models, the
  background compile thread and the programs `--compile_only` lowers for a TPU. `kept_matmul_precision()` puts the
  previous value back afterwards (a run inside a Python session leaves no global change behind).
- `enable_determinism()`: XLA's run-to-run deterministic GPU kernels (`DETERMINISM_FLAGS` in XLA_FLAGS); only
  takes effect before the JAX backend starts.

Why: JAX's default float32 matmul is TF32 on NVIDIA GPUs and one bfloat16 pass on TPUs, so a run with bf16 off
would not compute in float32 there unless told to (docs/numerics.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import textwrap
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, Literal

import jax

logger = logging.getLogger("rloo_jax")

MatmulPrecision = Literal["default", "high", "highest", "bfloat16", "tensorfloat32", "float32"]
"""jax's names (`jax.lax.Precision` and their dtype spellings): default = bfloat16 (one bf16 pass on TPU, TF32 on
NVIDIA GPUs), high = tensorfloat32 (three bf16 passes on TPU), highest = float32. XLA:CPU computes float32 dots in
float32 whatever the value."""

# Options whose None means "decide by platform", in resolution order: each gets the values resolved before it and
# the platform ("cpu", "gpu", "tpu"). A new platform-dependent option is one more line here.
AUTO: dict[str, Callable[[dict[str, Any], str], Any]] = {
    # TRL's GPU default; on CPU bf16 is not faster at small sizes (DESIGN.md section 4)
    "bf16": lambda done, platform: platform != "cpu",
    # what a float32 run means: float32 matmuls on every backend; bf16 runs keep JAX's fast default
    "matmul_precision": lambda done, platform: "default" if done["bf16"] else "highest",
    # memory is the limit on accelerators; on CPU both cost time (BENCHMARKS.md)
    "gradient_checkpointing": lambda done, platform: platform != "cpu",
    "scan_layers": lambda done, platform: platform != "cpu",
    # fused kernels where the platform has them (splash on TPU, cuDNN flash on GPU in bf16 without XLA's
    # deterministic ops), else the einsum
    "attn_implementation": lambda done, platform: _best_attention(platform, done["bf16"]),
    # a mixture of experts' grouped matmuls: megablox (sparse gradient) on TPU, ragged_dot elsewhere
    "moe_implementation": lambda done, platform: _best_grouped_matmul(platform),
}


def _best_attention(platform: str, bf16: bool) -> str:
    from rloo_jax.models import attention  # the models import jax's Pallas modules: only when a run resolves

    return attention.resolve(None, platform, "bfloat16" if bf16 else "float32", determinism_enabled())


def _best_grouped_matmul(platform: str) -> str:
    from rloo_jax.models import moe

    return moe.resolve(None, platform)

# XLA's flag for run-to-run deterministic GPU programs (present in jaxlib 0.10's XLA: "Guarantees run-to-run
# determinism on GPU"; it implies xla_gpu_exclude_nondeterministic_ops, deterministic scatter, and autotuning that
# does not depend on timing). TPU and CPU programs are deterministic without it; XLA:CPU and libtpu accept it.
DETERMINISM_FLAGS = ("--xla_gpu_deterministic_ops=true",)


def resolved_settings(cfg: Any, platform: str) -> dict[str, Any]:
    """`AUTO`'s options for `platform` ("cpu", "gpu", "tpu"): the config's own value where it is not None.

    Example: every option None, "gpu" -> {bf16: True, matmul_precision: "default", gradient_checkpointing: True,
    scan_layers: True}; "cpu" -> {False, "highest", False, False}; bf16 False on "tpu" -> matmul_precision
    "highest".
    """
    done: dict[str, Any] = {}
    for name, auto in AUTO.items():
        value = getattr(cfg, name)
        done[name] = auto(done, platform) if value is None else value
    return done


def for_platform(cfg: Any, platform: str) -> Any:
    """`cfg` (a run config, `rloo_jax.config.TrainConfig`) with every platform-dependent None resolved for
    `platform` (a validated copy)."""
    settings = resolved_settings(cfg, platform)
    if all(getattr(cfg, name) == value for name, value in settings.items()):
        return cfg
    return cfg.replace(**settings, device_count=cfg.device_count, process_count=cfg.process_count)


def describe(cfg: Any, resolved: Any, platform: str, width: int = 118) -> str:
    """The start-of-run line(s): each resolved setting, starred where the platform chose it (None given).

    Example: `numerics on gpu (* auto): bf16 true*, matmul_precision default*, gradient_checkpointing true*,
    scan_layers false`; wrapped at `width`.
    """

    def text(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    parts = [f"{name} {text(getattr(resolved, name))}" + "*" * (getattr(cfg, name) is None) for name in AUTO]
    return textwrap.fill(f"numerics on {platform} (* auto): " + ", ".join(parts), width, subsequent_indent="  ")


# ------------------------------------------------------------------------------------------------ matmul precision
def use_matmul_precision(value: str) -> None:
    """JAX's default precision of float32 matmuls, process-wide, for everything traced from now on."""
    jax.config.update("jax_default_matmul_precision", value)


@contextlib.contextmanager
def kept_matmul_precision() -> Iterator[None]:
    """Put back the process's default matmul precision on exit (whatever was set inside)."""
    previous = jax.config.jax_default_matmul_precision
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", previous)


# ------------------------------------------------------------------------------------------------ determinism
def backend_started() -> bool:
    """Whether JAX has created its backends (after which XLA_FLAGS is not read again)."""
    from jax._src import xla_bridge  # no public API says this

    return xla_bridge.backends_are_initialized()


def with_flags(xla_flags: str, flags: tuple[str, ...]) -> str:
    """`xla_flags` with each of `flags` set: an earlier value of the same flag is replaced, the rest kept.

    Example: ("--a=1 --xla_gpu_deterministic_ops=false", ("--xla_gpu_deterministic_ops=true",)) ->
    "--a=1 --xla_gpu_deterministic_ops=true".
    """
    names = {f.split("=")[0] for f in flags}
    kept = [f for f in xla_flags.split() if f.split("=")[0] not in names]
    return " ".join([*kept, *flags])


def determinism_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process asks XLA for deterministic GPU programs (`DETERMINISM_FLAGS` in XLA_FLAGS: set by
    `enable_determinism`, `--full_determinism true` or the caller's environment)."""
    return set(DETERMINISM_FLAGS) <= set(environ.get("XLA_FLAGS", "").split())


def enable_determinism(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Ask XLA for run-to-run deterministic programs (`DETERMINISM_FLAGS` added to XLA_FLAGS); returns whether
    this process's programs are deterministic. XLA reads its flags once, when the JAX backend starts: called later
    on a GPU backend without the flags, this warns and returns False. CPU and TPU programs are deterministic
    without the flags (True).

    Call it before the first JAX computation (`jax.devices()`, an array, a jitted call), e.g. first thing in a
    script that builds an `RLOOTrainer`; the CLI does it for `--full_determinism true`.
    """
    current = environ.get("XLA_FLAGS", "")
    if determinism_enabled(environ):
        return True
    if backend_started():
        if jax.default_backend() in ("cpu", "tpu"):
            return True
        logger.warning(
            "full_determinism: the JAX backend has already started, so XLA's deterministic-ops flag cannot take "
            "effect in this process; call rloo_jax.numerics.enable_determinism() before the first JAX "
            "computation, or start Python with XLA_FLAGS='%s'", " ".join(DETERMINISM_FLAGS),
        )
        return False
    environ["XLA_FLAGS"] = with_flags(current, DETERMINISM_FLAGS)
    return True


# ------------------------------------------------------------------------------------------------ models
def model_options(cfg: Any, platform: str) -> dict[str, Any]:
    """The policy's dtypes and execution options (`ModelConfig` fields) from the run config, for the platform
    the programs run on ("cpu", "gpu", "tpu"): `bf16`, `scan_layers` and `gradient_checkpointing` None mean on
    for accelerators, off on the CPU (where they cost time and memory is not the limit; BENCHMARKS.md), as
    `rloo_jax.numerics.resolved_settings` decides, and `attn_implementation` / `moe_implementation` None the best
    the platform offers (ConfigError for one it does not offer). With `use_peft` these are the base's options;
    `policy` adds the adapters."""
    from rloo_jax.errors import ConfigError
    from rloo_jax.models import attention, moe

    settings = resolved_settings(cfg, platform)
    dtype = "bfloat16" if settings["bf16"] else "float32"
    try:
        attn = attention.resolve(settings["attn_implementation"], platform, dtype, determinism_enabled())
    except ValueError as e:
        raise ConfigError(f"{e}; fix --attn_implementation") from None
    try:
        grouped = moe.resolve(settings["moe_implementation"], platform)
    except ValueError as e:
        raise ConfigError(f"{e}; fix --moe_implementation") from None
    return {
        "dtype": dtype,
        # LoRA: the base is never trained, so it is read straight into the compute dtype (as TRL + peft load it);
        # param_dtype is then the adapters' storage
        "param_dtype": dtype if cfg.use_peft else cfg.param_dtype,
        "scan_layers": settings["scan_layers"],
        "remat_policy": cfg.remat_policy if settings["gradient_checkpointing"] else "none",
        "attn_implementation": attn,
        "moe_implementation": grouped,
    }
