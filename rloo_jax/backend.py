"""The platform a process runs on, set up before its first JAX computation: the CPU when no accelerator is
visible (`skip_absent_tpu`), XLA:CPU's compile flags, the multi-process runtime (`start_distributed`) and the
persistent compilation cache."""

import importlib.util
import os

import jax

from rloo_jax.errors import ConfigError
from rloo_jax.mesh import initialize_distributed


def start_distributed(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Join a multi-process run (explicit options, JAX_* variables, or a detected SLURM / Open MPI / TPU-pod
    launch; nothing on a plain single host). Must run before any other JAX work."""
    try:
        initialize_distributed(coordinator_address, num_processes, process_id)
    except ValueError as e:
        raise ConfigError(f"{e}; pass all of --coordinator_address, --num_processes and --process_id") from None


def enable_compilation_cache(directory: str | None) -> None:
    """JAX's persistent compilation cache in `directory` (None: off), every program cached (CPU ones too)."""
    if directory:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def cpu_compile_flags(environ: dict[str, str] = os.environ) -> None:
    """On a CPU-only install, add ``--xla_llvm_disable_expensive_passes=true`` to XLA_FLAGS (unless set).

    XLA:CPU runs the matmuls in library kernels (YNNPACK/Eigen), so LLVM's expensive passes buy no measured step
    time but cost ~15% of the first step's compile (BENCHMARKS.md). Accelerator installs are left alone: there
    LLVM emits the GPU kernels. Must run before the first JAX computation (XLA reads its flags once).
    """
    flags = environ.get("XLA_FLAGS", "")
    accelerators = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin", "jax_rocm60_plugin", "libtpu")
    on_cpu = environ.get("JAX_PLATFORMS", "").strip() == "cpu" or not any(
        importlib.util.find_spec(name) for name in accelerators
    )
    if on_cpu and "xla_llvm_disable_expensive_passes" not in flags:
        environ["XLA_FLAGS"] = f"{flags} --xla_llvm_disable_expensive_passes=true".strip()


def visible_accelerator() -> bool | None:
    """Whether a TPU chip (on the PCI bus), an NVIDIA or an AMD GPU device is visible, by JAX's own hardware probe
    (`jax._src.hardware_utils`, which JAX uses to skip absent GPUs); None when that probe is not there."""
    try:
        from jax._src import hardware_utils as hw

        return bool(hw.num_available_tpu_chips_and_device_id()[0] > 0 or hw.has_visible_nvidia_gpu()
                    or hw.num_available_amd_gpus(stop_at=1) > 0)
    except Exception:  # noqa: BLE001 -- another JAX version: no opinion
        return None


def skip_absent_tpu(environ: dict[str, str] = os.environ) -> bool:
    """With JAX_PLATFORMS unset on a machine with no accelerator visible (`visible_accelerator`), run on the CPU:
    JAX would otherwise start every installed backend, and libtpu (the `tpu` or `test` extra) prints errors about
    the TPU VM it is not on before JAX falls back to the CPU. A TPU VM (chips on the bus), a GPU host, JAX_PLATFORMS
    set (even empty), JAX_FORCE_TPU_INIT, or no probe: left to JAX. Must run before the first JAX computation.
    Returns whether it chose the CPU."""
    if "JAX_PLATFORMS" in environ or "JAX_FORCE_TPU_INIT" in environ or jax.config.jax_platforms:
        return False
    if visible_accelerator() is not False:
        return False
    jax.config.update("jax_platforms", "cpu")
    return True
