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
import subprocess
import sys

from rloo_jax.numerics import with_flags

CPU_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def compile_fast(environ: dict[str, str] = os.environ) -> None:
    """Add CPU_COMPILE_FLAGS to XLA_FLAGS (before JAX starts: it reads them once); subprocesses inherit them."""
    environ["XLA_FLAGS"] = with_flags(environ.get("XLA_FLAGS", ""), CPU_COMPILE_FLAGS)


def fast_compiling(environ: dict[str, str] = os.environ) -> bool:
    """Whether this process compiles at the suite's XLA:CPU settings (a bound measured under them may differ)."""
    return set(CPU_COMPILE_FLAGS) <= set(environ.get("XLA_FLAGS", "").split())


def xla_defaults(environ: dict[str, str] = os.environ) -> dict[str, str]:
    """A copy of `environ` without CPU_COMPILE_FLAGS: for a subprocess that runs long rather than compiles much (a
    demo that learns over hundreds of steps, a policy's SFT). -O0's machine code runs 2.5x slower: the tool-calling
    demo policy's SFT took 409 s at the suite's settings, 166 s at XLA's defaults (2026-11-28, 2 cores)."""
    flags = [f for f in environ.get("XLA_FLAGS", "").split() if f not in CPU_COMPILE_FLAGS]
    return dict(environ, XLA_FLAGS=" ".join(flags))


def cli_at_xla_defaults(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    """`python -m rloo_jax <args>` in a subprocess at XLA's defaults (`xla_defaults`): a run of hundreds of steps. The
    built-in demo's 300 steps: 0.45 s/step at the suite's settings, 0.15 at the defaults; 165 s against 94 s for the
    whole run (2026-11-28, 2 cores, nothing beside it)."""
    return subprocess.run([sys.executable, "-m", "rloo_jax", *args], env=xla_defaults(), capture_output=True,
                          text=True, timeout=timeout)


# XLA:CPU aborts a process whose devices wait more than 20 + 40 s for each other at a collective. On a loaded
# 2-core host one device of a Pallas kernel interpreted in a shard_map (its Python callbacks queue for the GIL) can
# arrive later than that: CI's test_megablox.py tensor worker aborted so (2026-11-29). The subprocess's own timeout
# (`result_on_devices`) still ends a real deadlock.
COLLECTIVE_TIMEOUT_S = 600


def forced_devices(devices: int) -> str:
    """This run's XLA_FLAGS with `devices` forced CPU devices (their collectives waiting up to COLLECTIVE_TIMEOUT_S
    for each other): a subprocess's, which compiles as the suite does."""
    return with_flags(os.environ.get("XLA_FLAGS", ""), (
        f"--xla_force_host_platform_device_count={devices}",
        f"--xla_cpu_collective_call_terminate_timeout_seconds={COLLECTIVE_TIMEOUT_S}"))


def result_on_devices(code: str, devices: int, timeout: float = 600) -> dict:
    """Run the Python source `code` in a subprocess with `devices` forced CPU devices (XLA_FLAGS must be set before
    jax starts) from the repository root, and return the JSON object of its last `RESULT {...}` line; a failed run
    fails the calling test with the end of its stderr."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, XLA_FLAGS=forced_devices(devices), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-5000:]
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])


def largest_all_gather(hlo_text: str) -> int:
    """The most elements an all-gather of a compiled module's text makes (0: none): which arrays a program moves
    between devices (e.g. a few rows, not the experts or an LM head)."""
    import re

    import numpy as np

    sizes = [int(np.prod([int(v) for v in dims.split(",") if v]))
             for line in hlo_text.splitlines() if " all-gather(" in line or " all-gather-start(" in line
             for dims in re.findall(r"\[([\d,]*)\]", line.split("=", 1)[1].split(" all-gather")[0])]
    return max(sizes, default=0)
