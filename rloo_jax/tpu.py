"""TPU slices as Google Cloud names them (`v5e-8`, `v5p-8`, ...): chips, torus shape, the compiler's topology name,
HBM per chip and the published peak FLOP/s, HBM and ICI bandwidth; and the slice's devices for ahead-of-time
compilation.

v5e and v6e slice names count chips (v5e-8 = 8 chips, also written `v5litepod-8`); v4 and v5p names count
TensorCores, two per chip (v5p-8 = 4 chips, each one "megacore" device).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

from rloo_jax.errors import ConfigError

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation as the compiler and Google's spec sheets describe one chip."""

    topology_prefix: str  # the compiler's topology name prefix: "v5e" -> "v5e:2x4"
    dims: int  # torus dimensions of a slice: 2 (v5e, v6e) or 3 (v4, v5p)
    cores_per_name_unit: int  # the slice name counts TensorCores (2 per chip: v4, v5p) or chips (1)
    chip_config: str  # "megacore" (one device per chip with 2 TensorCores) or "default"
    hbm_bytes: int  # HBM per chip the compiler makes available (its RESOURCE_EXHAUSTED figure, libtpu 0.0.42)
    peak_bf16_flops: float  # FLOP/s per chip, bf16 (Google Cloud TPU pages)
    hbm_bandwidth: float  # bytes/s per chip (Google Cloud TPU pages)
    sizes: tuple[int, ...]  # valid numbers in the slice name
    ici_bandwidth: float = math.nan  # bytes/s per chip, both directions of all its ICI links (NaN: unpublished)


_POW2 = tuple(2**i for i in range(13))
# Peak bf16 FLOP/s, HBM and ICI bandwidth per chip as Google Cloud's TPU pages state them (checked 2026-11-23):
# docs.cloud.google.com/tpu/docs/v4 (275 TFLOPs, 1200 GBps; no per-chip ICI figure), .../v5e (197 TFLOPs,
# 819 GBps, 400 GBps bidirectional ICI), .../v5p (459 TFLOPs, 2765 GBps, 1200 GBps ICI), .../v6e (918 TFLOPs,
# 1638 GBps, 800 GBps ICI).
CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", 3, 2, "megacore", int(30.75 * GIB), 275e12, 1200e9, tuple(n for n in _POW2 if n >= 8) + (384,)),
    "v5e": Chip("v5e", 2, 1, "default", int(15.75 * GIB), 197e12, 819e9, (1, 4, 8, 16, 32, 64, 128, 256), 400e9),
    "v5p": Chip("v5p", 3, 2, "megacore", int(95.74 * GIB), 459e12, 2765e9, tuple(range(8, 17921, 8)), 1200e9),
    "v6e": Chip("v6e", 2, 1, "default", int(31.25 * GIB), 918e12, 1638e9, (1, 4, 8, 16, 32, 64, 128, 256), 800e9),
}
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6litepod": "v6e"}
SLICE_EXAMPLES = "v4-8 … v4-4096, v5e-1/4/8/16 … 256 (or v5litepod-8), v5p-8 … v5p-17920, v6e-1/4/8 … 256"


@dataclasses.dataclass(frozen=True)
class Slice:
    """A named TPU slice: `v5p-8` -> chip v5p, 4 chips, topology "v5:2x2x1"."""

    name: str
    generation: str
    chip: Chip
    chips: int
    shape: tuple[int, ...]  # chips along each torus dimension

    @property
    def topology_name(self) -> str:
        prefix = "v5" if self.generation == "v5p" else self.chip.topology_prefix
        return f"{prefix}:{'x'.join(map(str, self.shape))}"

    @property
    def chips_per_host_bounds(self) -> tuple[int, int, int]:
        """Single-host 2-D slices (up to 8 chips) are one host; larger slices have 2x2 chips per host."""
        if self.chip.dims == 2 and self.chips <= 8:
            return (*self.shape, 1)  # type: ignore[return-value]
        return (2, 2, 1)


def torus_shape(chips: int, dims: int) -> tuple[int, ...]:
    """The standard slice shape for a chip count. 2-D: a x b with a <= b, a the largest power of two with
    a * a <= chips (8 -> 2x4, 16 -> 4x4). 3-D: 2x2x1 (4), 2x2x2 (8), 2x2x4 (16), 2x4x4 (32); from 64 chips every
    side a multiple of 4 and the most cube-like factorisation (smallest longest side, then largest shortest side:
    64 -> 4x4x4, 192 -> 4x4x12, 384 -> 4x8x12). Raises ValueError when there is none."""
    if dims == 2:
        a = 2 ** int(math.log2(chips) // 2)
        if chips % a:
            raise ValueError(f"{chips} chips")
        return (a, chips // a)
    small = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}
    if chips in small:
        return small[chips]
    if chips % 64:
        raise ValueError(f"{chips} chips")
    units = chips // 64
    best = None
    for a in range(1, units + 1):
        for b in range(a, units + 1):
            if units % (a * b) == 0 and units // (a * b) >= b:
                c = units // (a * b)
                key = (c, -a)
                if best is None or key < best[0]:
                    best = (key, (4 * a, 4 * b, 4 * c))
    assert best is not None
    return best[1]


def parse_slice(name: str) -> Slice:
    """`v5e-8`, `v5litepod-8`, `v5p-8`, `v4-32`, `v6e-8` (case-insensitive) -> a `Slice`; ConfigError otherwise."""
    m = re.fullmatch(r"\s*(v\d+[a-z]*)-(\d+)\s*", name.lower())
    generation = ALIASES.get(m.group(1), m.group(1)) if m else None
    if m is None or generation not in CHIPS:
        raise ConfigError(f"topology {name!r} is not a TPU slice name; use one of: {SLICE_EXAMPLES}")
    chip, count = CHIPS[generation], int(m.group(2))
    if count not in chip.sizes or count % chip.cores_per_name_unit:
        sizes = ", ".join(str(s) for s in chip.sizes[:8]) + (" …" if len(chip.sizes) > 8 else "")
        raise ConfigError(f"topology {name!r}: {generation} slices come in sizes {sizes} ({SLICE_EXAMPLES})")
    chips = count // chip.cores_per_name_unit
    try:
        shape = torus_shape(chips, chip.dims)
    except ValueError:
        raise ConfigError(f"topology {name!r}: no standard {generation} slice has {chips} chips") from None
    return Slice(f"{generation}-{count}", generation, chip, chips, shape)


def topology_devices(slc: Slice) -> list[Any]:
    """The slice's devices for ahead-of-time compilation (libtpu's compile-only client; no TPU needed)."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--compile_only needs libtpu, the TPU compiler: pip install 'rloo_jax[tpu]' (jax[tpu] at the jax "
            "version in use)"
        ) from None
    from jax.experimental import topologies

    # A compile-only client never opens a TPU: let it load beside another process holding libtpu's lock file
    # (a training run on this TPU VM, or a second compile-only run).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    with quiet_stderr():  # libtpu warns about TPU_ACCELERATOR_TYPE / worker hostnames of a TPU VM it is not on
        topo = topologies.get_topology_desc(
            platform="tpu",
            topology_name=slc.topology_name,
            chip_config_name=slc.chip.chip_config,
            chips_per_host_bounds=slc.chips_per_host_bounds,
        )
    devices = list(topo.devices)
    if len(devices) != slc.chips:
        raise ConfigError(f"topology {slc.name}: the compiler gave {len(devices)} devices, expected {slc.chips}")
    return devices


class quiet_stderr:
    """Silence file descriptor 2 (C++ logging) inside the block; Python exceptions still propagate."""

    def __enter__(self) -> None:
        self._saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc: object) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)
