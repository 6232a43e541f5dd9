"""The suite's XLA:CPU compile settings, and XLA_FLAGS for the subprocesses that force several CPU devices.

The suite's cost is XLA:CPU compiling ~200 runs' programs, not running them (a tiny model's update program: 13-22
CPU s to compile, milliseconds to run). On the CPU the suite compiles with LLVM at -O0 and XLA's classic (elemental)
fusion emitters: 3-4 CPU s for that update program (BENCHMARKS.md, "The suite's compile settings"). The HLO, the
matmul kernels (library calls) and so every tested formula are the same; what changes is how each fused
elementwise loop becomes machine code. Every tolerance in the suite was checked to hold with them (a whole run);
the product's runs and CI's `make run` (the demo, whose learning is checked) keep XLA's defaults. Accelerator runs
(`make test-accelerator`) are left alone: there LLVM emits the GPU kernels.
"""

import os

from rloo_jax.numerics import with_flags

CPU_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def compile_fast(environ: dict[str, str] = os.environ) -> None:
    """Add CPU_COMPILE_FLAGS to XLA_FLAGS (before JAX starts: it reads them once); subprocesses inherit them."""
    environ["XLA_FLAGS"] = with_flags(environ.get("XLA_FLAGS", ""), CPU_COMPILE_FLAGS)


def fast_compiling(environ: dict[str, str] = os.environ) -> bool:
    """Whether this process compiles at the suite's XLA:CPU settings (a bound measured under them may differ)."""
    return set(CPU_COMPILE_FLAGS) <= set(environ.get("XLA_FLAGS", "").split())


def forced_devices(devices: int) -> str:
    """This run's XLA_FLAGS with `devices` forced CPU devices: a subprocess's, which compiles as the suite does."""
    return with_flags(os.environ.get("XLA_FLAGS", ""), (f"--xla_force_host_platform_device_count={devices}",))
